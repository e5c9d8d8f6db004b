//! Where column bytes live: the [`Backend`] trait and the choice between its implementations.
//!
//! The store above never touches memory directly. It hands the backend host record batches
//! (decoded from `DoPut`) and gets back [`Partition`]s, opaque handles to data held wherever the
//! backend keeps it: host memory for [`host::HostBackend`], GPU memory for the CUDA backend. Reading
//! a partition back is asynchronous because for a device it means a device-to-host copy; uploading
//! is asynchronous for the same reason in the other direction. Both return `'static` futures that
//! own what they need, so the caller can keep several in flight and overlap copies with network
//! I/O.

pub mod cuda;
pub(crate) mod dictionary;
pub mod export;
pub mod filter;
pub mod host;
pub mod ingest;
pub mod numa;
pub mod spilled;

use std::fmt;
use std::sync::Arc;

use arrow::datatypes::Schema;
use arrow::record_batch::RecordBatch;
use futures::future::BoxFuture;

pub use cuda::{CudaBackend, FragmentCopies, PlainCopies, UPLOADS_AT_ONCE};
pub use export::{
    BufferKind, ExportDevice, ExportedArray, ExportedBuffer, ExportedColumn, ForeignAllocation,
};
pub use host::{HostBackend, host_memory_available, host_memory_bytes};
pub use ingest::PreparedImport;
pub use spilled::SpilledPartition;

/// What can go wrong below the store. Each variant says which gRPC code it becomes in
/// `crate::error`.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The device has no room for an allocation of this size.
    #[error("device {device} is out of memory: could not allocate {requested} bytes")]
    OutOfMemory { device: u32, requested: u64 },
    /// Transfers in flight already hold as much pinned host memory as a device may.
    #[error(
        "pinned staging memory for device {device} is exhausted: transfers in flight hold \
         {in_use} of {limit} bytes and this one needs {requested}; retry when readers have \
         caught up"
    )]
    StagingExhausted {
        device: u32,
        requested: u64,
        in_use: u64,
        limit: u64,
    },
    /// The data uses a type this backend cannot hold.
    #[error("column type {data_type} cannot be stored by the {backend} backend")]
    UnsupportedType {
        backend: &'static str,
        data_type: String,
    },
    /// These partitions cannot be compacted into one (e.g. their merged dictionary outgrows
    /// the key type); the store then keeps them as they are. (The message keeps the word it
    /// was first sent with.)
    #[error("cannot concatenate: {reason}")]
    CannotCompact { reason: String },
    /// The data is in host memory, which another process cannot map.
    #[error(
        "the dataset is in host memory (the {backend} backend), which other processes cannot \
         map; read it with DoGet, or run the server with --backend cuda"
    )]
    NotExportable { backend: &'static str },
    /// `ipc-import` copies from another process's GPU memory, which this backend cannot.
    #[error(
        "ipc-import copies another process's GPU memory and needs the cuda backend; this \
         server keeps datasets in host memory (the {backend} backend): send the data with DoPut"
    )]
    NotImportable { backend: &'static str },
    /// What an `ipc-import` document describes cannot be imported: handles that do not open,
    /// sizes, offsets or lengths that do not fit, data Arrow's validation refuses.
    #[error("ipc-import refused: {0}")]
    ImportRefused(String),
    /// A producer's handle did not open for want of what a mapping takes on this GPU now
    /// (device memory, peer mappings): the server's state, not the document's fault.
    #[error(
        "device {device} cannot map ipc-import handle {handle} now ({reason}); retry when \
         other imports have finished or memory has been freed"
    )]
    MappingExhausted {
        device: u32,
        handle: usize,
        reason: String,
    },
    /// A row range outside the partition: a bug in the caller, never client input (a client's
    /// range outside a dataset is the store's `RowsOutOfRange`, checked before any partition
    /// is read).
    #[error(
        "rows {offset}..{end} are outside a partition of {rows} rows",
        end = offset.saturating_add(*len)
    )]
    OutsidePartition {
        offset: usize,
        len: usize,
        rows: usize,
    },
    /// The device or its driver failed.
    #[error("device failure: {0}")]
    Device(String),
}

/// One memory space the backend can place data in, as reported by `status`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: u32,
    pub name: String,
    /// Capacity of the memory space, if known.
    pub total_bytes: Option<u64>,
    /// The budget when `--memory-limit` is not given: what datasets may take of the capacity,
    /// leaving the rest for the server's own work (buffers, messages in flight).
    pub default_limit_bytes: Option<u64>,
    /// A GPU's UUID (`GPU-…`, as `nvidia-smi` prints it).
    pub uuid: Option<String>,
    /// A GPU's PCI bus id (`domain:bus:device.function`).
    pub pci_bus_id: Option<String>,
    /// The NUMA node nearest the device, where the system says (sysfs).
    pub numa_node: Option<u32>,
}

/// The NUMA node of PCI device `bus_id` under `sysfs` (normally `/sys`), where it reports one:
/// `-1` (no NUMA affinity) and unreadable files are `None`.
pub fn pci_numa_node(sysfs: &std::path::Path, bus_id: &str) -> Option<u32> {
    let path = sysfs
        .join("bus/pci/devices")
        .join(bus_id.to_lowercase())
        .join("numa_node");
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Host memory [`Backend::body_block`] hands out for one message body: written by its one owner
/// as the body's bytes arrive, then shared read-only as the Arrow buffer the body's arrays are
/// decoded in.
pub trait BodyBlock: Send {
    /// The block's length: the body's.
    fn size(&self) -> usize;
    /// The block's bytes, all of them the body's; every one is written before
    /// [`into_buffer`](Self::into_buffer).
    fn as_mut_slice(&mut self) -> &mut [u8];
    fn into_buffer(self: Box<Self>) -> arrow::buffer::Buffer;
}

/// A place to keep datasets: host memory or a GPU.
pub trait Backend: Send + Sync + fmt::Debug + 'static {
    /// Short name shown in logs and `status`: `host` or `cuda`.
    fn name(&self) -> &'static str;

    /// The memory spaces this backend can place data in. Never empty.
    fn devices(&self) -> Vec<DeviceInfo>;

    /// How many bytes `upload` of this batch will take on the device. The store reserves this
    /// much against its memory budget before uploading, so a put that does not fit fails before
    /// anything is allocated.
    fn stored_size(&self, batch: &RecordBatch) -> Result<u64, BackendError>;

    /// Copies a host batch into backend memory on `device`. The returned future owns the batch
    /// and may run the copy on another task; dropping it releases whatever it allocated.
    fn upload(
        &self,
        device: u32,
        batch: RecordBatch,
    ) -> BoxFuture<'static, Result<Arc<dyn Partition>, BackendError>>;

    /// The whole of `partition` (of this backend) as one host batch whose arrays lie in
    /// buffers of the copy's own (shared among them, nothing else's), when this backend
    /// copies it out faster than reads of its rows would: what a spill to the host tier keeps, and hands back to [`Backend::upload`] to
    /// restore. `None` (the default): the store reads the rows in pieces and copies those.
    fn host_copy(
        &self,
        _partition: &Arc<dyn Partition>,
    ) -> Option<BoxFuture<'static, Result<RecordBatch, BackendError>>> {
        None
    }

    /// Pins `bytes` of host memory for transfers (`--pinned-host-memory`), in the background.
    /// The default: nothing, for a backend whose transfers gain nothing from pinned memory.
    fn pin_host_memory(&self, _bytes: u64) {}

    /// `bytes` copied into host memory this backend uploads from directly (pinned), where it
    /// has such memory free: the `DoPut` decoder copies large message bodies there, so that
    /// their arrays need no staging copy. `None` (the default): the decoder keeps the body
    /// where it lies.
    fn pinned_copy(&self, _bytes: &[u8]) -> Option<arrow::buffer::Buffer> {
        None
    }

    /// A block of `len` bytes of host memory this backend uploads from directly (pinned), where
    /// it has such memory free, for a `DoPut` message body to be received into straight from
    /// the network, so that its arrays need no staging copy and the body no second copy.
    /// `None` (the default): the body goes where the reader puts it.
    fn body_block(&self, _len: usize) -> Option<Box<dyn BodyBlock>> {
        None
    }

    /// Whether this backend keeps the host arrays `upload` is given (rather than copying them
    /// elsewhere and dropping them): the decoder then hands it arrays that own their memory.
    fn keeps_decoded_arrays(&self) -> bool {
        false
    }

    /// Whether a commit compacts these partitions of a dataset with `schema` into one. A
    /// device backend always does: its compact layout is what `ipc-export` publishes and what
    /// reads fastest. Others may serve partitions as they are, and save the copy.
    fn compacts(&self, _schema: &Schema, _partitions: &[Arc<dyn Partition>]) -> bool {
        true
    }

    /// Bytes [`Backend::compact`] of these partitions will allocate, so the store can
    /// reserve them first. `UnsupportedType` when this backend cannot compact them.
    fn compacted_size(&self, partitions: &[Arc<dyn Partition>]) -> Result<u64, BackendError>;

    /// Compacts `partitions` (all of one schema, uploaded by this backend, in row order) into
    /// one partition: each column's buffers contiguous (on a GPU, every column in one
    /// allocation), dictionaries merged. The inputs are left as
    /// they are; the caller frees them by dropping them.
    fn compact(
        &self,
        partitions: Vec<Arc<dyn Partition>>,
    ) -> BoxFuture<'static, Result<Arc<dyn Partition>, BackendError>>;

    /// Bytes [`Backend::copy_to`] of `columns` of `partition` allocates, so the store can
    /// reserve them on the target first.
    fn copied_size(
        &self,
        partition: &Arc<dyn Partition>,
        columns: &[usize],
    ) -> Result<u64, BackendError>;

    /// Copies `columns` of `partition` (in that order) onto `device` as a new partition, for
    /// moves and for `ipc-export` replicas on a consumer's GPU. A GPU backend copies between
    /// devices directly and keeps the layout, so the copy exports like the original.
    fn copy_to(
        &self,
        partition: Arc<dyn Partition>,
        columns: Vec<usize>,
        device: u32,
    ) -> BoxFuture<'static, Result<Arc<dyn Partition>, BackendError>>;

    /// Plans an `ipc-import` of `columns` (checked by [`ingest::check_columns`]): lays them
    /// out once, for the store to reserve [`PreparedImport::allocated_bytes`] and then hand
    /// the plan to [`Backend::import`]. `NotImportable` where the backend cannot map another
    /// process's memory.
    fn plan_import(&self, _columns: &[ExportedColumn]) -> Result<PreparedImport, BackendError> {
        Err(BackendError::NotImportable {
            backend: self.name(),
        })
    }

    /// Copies the columns `plan` (from this backend's [`Backend::plan_import`]) describes,
    /// `rows` rows of `schema`, out of another process's memory on `device` into a new
    /// partition of this backend's own layout, and checks the copy as Arrow's decoder checks a
    /// put's data. The producer's memory is no longer used once the future resolved, whatever
    /// its outcome; every mapping of it is closed by then.
    fn import(
        &self,
        _device: u32,
        _schema: arrow::datatypes::SchemaRef,
        _rows: usize,
        _plan: PreparedImport,
    ) -> BoxFuture<'static, Result<Arc<dyn Partition>, BackendError>> {
        let backend = self.name();
        Box::pin(futures::future::ready(Err(BackendError::NotImportable {
            backend,
        })))
    }

    /// Which devices can access which directly: `peer_access()[a][b]` says whether device `a`
    /// can read and write device `b`'s memory (every device its own). One memory space
    /// shared by every device (the host) is all true.
    fn peer_access(&self) -> Vec<Vec<bool>> {
        let devices = self.devices().len();
        vec![vec![true; devices]; devices]
    }

    /// Whether the backend's devices are host memory themselves. The store then has no host
    /// tier to spill to unless one is configured: moving data within the same memory frees
    /// nothing.
    fn holds_host_memory(&self) -> bool {
        false
    }

    /// Backend-specific counters for `status` (e.g. stream synchronizations), as JSON.
    fn counters(&self) -> serde_json::Map<String, serde_json::Value> {
        serde_json::Map::new()
    }
}

/// One uploaded record batch, held in backend memory until the last reference is dropped.
pub trait Partition: Send + Sync + fmt::Debug {
    fn num_rows(&self) -> usize;

    /// Bytes of backend memory this partition holds.
    fn bytes(&self) -> u64;

    /// How many rows from `offset` on a [`Partition::read`] returns without joining pieces
    /// the partition holds apart (copying them into one batch): readers end their chunks
    /// there. All of them, for a partition held as one piece.
    fn contiguous_rows(&self, offset: usize) -> usize {
        self.num_rows().saturating_sub(offset)
    }

    /// Copies rows `offset..offset + len` of `columns` (schema positions, in that order; all
    /// of them for `None`) back into a host record batch. Columns not asked for are not
    /// copied: a projected read costs only what it returns.
    fn read(
        &self,
        offset: usize,
        len: usize,
        columns: Option<&[usize]>,
    ) -> BoxFuture<'static, Result<RecordBatch, BackendError>>;

    /// [`Partition::read`] of the rows `filter` keeps, filtered where the partition lives:
    /// of the columns `columns` (schema positions; the filter's tests name positions among
    /// them), those at `output` (positions among `columns`) are returned. `None` where this
    /// partition cannot run the filter, and a read that ends in `Ok(None)` where it could not
    /// this time (no device memory to filter in): the caller then filters a plain read.
    fn read_filtered(
        &self,
        _offset: usize,
        _len: usize,
        _columns: &[usize],
        _filter: &Arc<filter::RowFilter>,
        _output: &[usize],
    ) -> Option<BoxFuture<'static, Result<Option<RecordBatch>, BackendError>>> {
        None
    }

    /// Bytes of Arrow buffers `columns` hold (schema positions), as a client reading them
    /// receives them, give or take framing; `None` where the partition cannot tell without
    /// reading its data (only on disk).
    fn column_bytes(&self, _columns: &[usize]) -> Option<u64> {
        None
    }

    /// Describes columns `columns` for another process on this machine to map zero-copy: the
    /// GPU holding them, and per column an IPC handle and buffer offsets. Every device write to them has completed (uploads and
    /// concatenations synchronize before they return). `NotExportable` where the memory
    /// cannot be shared.
    fn export(
        &self,
        columns: &[usize],
    ) -> Result<(ExportDevice, Vec<ExportedColumn>), BackendError>;

    /// For a backend to recognise its own partitions.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// `partition` as the backend's own partition type, or an error naming what was found.
pub(crate) fn downcast_one<'a, P: 'static>(
    partition: &'a Arc<dyn Partition>,
    backend: &'static str,
) -> Result<&'a P, BackendError> {
    let [part] = downcast_all::<P>(std::slice::from_ref(partition), backend)?[..] else {
        return Err(BackendError::Device("no partition given".to_owned()));
    };
    Ok(part)
}

/// `partitions` as the backend's own partition type, or an error naming what was found.
pub(crate) fn downcast_all<'a, P: 'static>(
    partitions: &'a [Arc<dyn Partition>],
    backend: &'static str,
) -> Result<Vec<&'a P>, BackendError> {
    partitions
        .iter()
        .map(|p| {
            p.as_any().downcast_ref::<P>().ok_or_else(|| {
                BackendError::Device(format!(
                    "a partition from another backend was given to {backend}"
                ))
            })
        })
        .collect()
}

/// The `--backend` choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendChoice {
    /// CUDA where a driver and a device exist, otherwise host memory.
    Auto,
    /// Host memory.
    Host,
    /// GPU memory through the CUDA driver.
    Cuda,
}

/// Why the requested backend could not be started.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct SelectError(String);

/// Which GPUs a CUDA backend opens.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum GpuSelection {
    /// Every GPU the driver shows this process (after `CUDA_VISIBLE_DEVICES`).
    #[default]
    All,
    /// These CUDA ordinals, in this order.
    Ordinals(Vec<u32>),
}

impl std::str::FromStr for GpuSelection {
    type Err = String;

    /// `all`, or CUDA ordinals separated by commas (`0,2,3`), each at most once.
    fn from_str(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if text.eq_ignore_ascii_case("all") {
            return Ok(Self::All);
        }
        let mut ordinals = Vec::new();
        for part in text.split(',') {
            let ordinal: u32 = part.trim().parse().map_err(|_| {
                format!("expected `all` or CUDA ordinals such as 0,2,3; got {text:?}")
            })?;
            if ordinals.contains(&ordinal) {
                return Err(format!("device {ordinal} is listed twice in {text:?}"));
            }
            ordinals.push(ordinal);
        }
        Ok(Self::Ordinals(ordinals))
    }
}

/// Starts the backend `choice` asks for, on the GPUs `gpus` names where it is CUDA; host
/// memory is split into `host_devices` pretend devices (see [`HostBackend::with_devices`]).
/// `auto` never fails: without a usable GPU it falls back to host memory and says why in the
/// log.
pub fn select(
    choice: BackendChoice,
    gpus: &GpuSelection,
    host_devices: u32,
) -> Result<Arc<dyn Backend>, SelectError> {
    let host = || Arc::new(HostBackend::new().with_devices(host_devices)) as Arc<dyn Backend>;
    // The GPUs to open; an error here means there are none to try.
    let ordinals = || match gpus {
        GpuSelection::All => CudaBackend::visible_devices().and_then(|ordinals| {
            if ordinals.is_empty() {
                Err(BackendError::Device(
                    "the NVIDIA driver reports no CUDA device".to_owned(),
                ))
            } else {
                Ok(ordinals)
            }
        }),
        GpuSelection::Ordinals(ordinals) => Ok(ordinals.clone()),
    };
    match choice {
        BackendChoice::Host => {
            tracing::info!(
                backend = "host",
                "datasets are kept in host memory (--backend host)"
            );
            Ok(host())
        }
        BackendChoice::Cuda => ordinals()
            .and_then(|ordinals| CudaBackend::open_all(&ordinals))
            .map(|backend| Arc::new(backend) as Arc<dyn Backend>)
            .map_err(|error| SelectError(format!("{error}; run with --backend host (or auto)"))),
        BackendChoice::Auto => {
            let ordinals = match ordinals() {
                Ok(ordinals) => ordinals,
                Err(reason) => {
                    // The ordinary start of a machine without a GPU: nothing failed.
                    tracing::info!(
                        backend = "host",
                        reason = %plain(&reason),
                        "no GPU to use: datasets are kept in host memory"
                    );
                    return Ok(host());
                }
            };
            match CudaBackend::open_all(&ordinals) {
                Ok(backend) => {
                    tracing::info!(
                        backend = "cuda",
                        ?ordinals,
                        "backend selected: CUDA devices are present"
                    );
                    Ok(Arc::new(backend))
                }
                // GPUs the operator named are wanted, not whatever memory there is.
                Err(error) if matches!(gpus, GpuSelection::Ordinals(_)) => {
                    Err(SelectError(format!(
                        "GPUs {ordinals:?} were named (--devices/--device), but {}; with GPUs \
                         named the server does not fall back to host memory: name GPUs that \
                         exist, or leave the flag out",
                        plain(&error)
                    )))
                }
                Err(error) => {
                    tracing::warn!(backend = "host", error = %plain(&error), "a CUDA device failed to open: datasets are kept in host memory");
                    Ok(host())
                }
            }
        }
    }
}

/// A backend error as a sentence for the start log, without the "device failure" a failure
/// at run time is prefixed with.
fn plain(error: &BackendError) -> String {
    match error {
        BackendError::Device(reason) => reason.clone(),
        other => other.to_string(),
    }
}

/// `columns` of a host batch (all for `None`), for partitions that hold host batches: the
/// arrays are shared, not copied.
pub(crate) fn project(
    batch: RecordBatch,
    columns: Option<&[usize]>,
) -> Result<RecordBatch, BackendError> {
    match columns {
        None => Ok(batch),
        Some(columns) => batch
            .project(columns)
            .map_err(|e| BackendError::Device(format!("choosing columns to read: {e}"))),
    }
}

/// Checks a row range against a partition's length.
pub(crate) fn check_rows(offset: usize, len: usize, rows: usize) -> Result<(), BackendError> {
    match offset.checked_add(len) {
        Some(end) if end <= rows => Ok(()),
        _ => Err(BackendError::OutsidePartition { offset, len, rows }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numa_nodes_come_from_sysfs() {
        let sysfs = std::env::temp_dir().join(format!("gpu-flight-sysfs-{}", std::process::id()));
        let write = |bus: &str, node: &str| {
            let dir = sysfs.join("bus/pci/devices").join(bus);
            std::fs::create_dir_all(&dir).expect("dir");
            std::fs::write(dir.join("numa_node"), node).expect("write");
        };
        write("0000:1a:00.0", "1\n");
        write("0000:2b:00.0", "-1\n");
        assert_eq!(
            pci_numa_node(&sysfs, "0000:1A:00.0"),
            Some(1),
            "bus ids in any case"
        );
        assert_eq!(
            pci_numa_node(&sysfs, "0000:2b:00.0"),
            None,
            "-1: no affinity"
        );
        assert_eq!(
            pci_numa_node(&sysfs, "0000:3c:00.0"),
            None,
            "no such device"
        );
        std::fs::remove_dir_all(&sysfs).expect("clean up");
    }

    #[test]
    fn gpu_selections_parse() {
        assert_eq!("all".parse(), Ok(GpuSelection::All));
        assert_eq!("ALL".parse(), Ok(GpuSelection::All));
        assert_eq!("3,1".parse(), Ok(GpuSelection::Ordinals(vec![3, 1])));
        assert!("1,1".parse::<GpuSelection>().is_err());
        assert!("-1".parse::<GpuSelection>().is_err());
    }
}
