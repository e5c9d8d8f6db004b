//! The CUDA backend: datasets in GPU memory.
//!
//! - `ffi`: every `unsafe` line, the driver calls and the RAII types around them.
//! - `abi`: what the concatenation kernel and the host agree on (task record, launch shape,
//!   the range check before each launch); `ffi` and `concat` both use it.
//! - `staging`: the pool of pinned host buffers transfers go through.
//! - `layout`: how a batch lies in device memory (the contract `ipc-export` publishes) and
//!   upload plans; no device calls, unit-tested without a GPU.
//! - `read`: row ranges copied back into pinned host memory, in rounds.
//! - `pieces`: large uploads and whole-partition host copies (spills) through staging, a
//!   piece at a time in two overlapping lanes; or, where `--pinned-host-memory` pinned host
//!   memory for them, straight between the device and that memory.
//! - `pinned`: that pinned memory, pinned on a thread of its own; `arena`: which blocks of
//!   it are in use.
//! - `concat`: one-launch concatenation of many batches into compact columns
//!   (`kernels/concat.cu`, loaded once from the committed PTX).
//! - `import`: the consumer's side of `ipc-export`, mapping another process's allocations.
//! - `ingest`: `ipc-import`, a producer's allocations copied into this backend's layout and
//!   validated.
//!
//! An upload copies the batch's buffers into a pinned staging buffer laid out exactly as the
//! device allocation, then issues one host-to-device copy (one per 64 MiB piece, in two
//! overlapping lanes, for a larger batch: `pieces`) and waits on its own stream, on a
//! blocking thread: the store keeps several uploads in flight, so the CPU copy of one batch
//! overlaps the DMA of another while more messages arrive. A read copies a row range back in
//! one synchronization per round (see `layout`) into pinned memory that the returned Arrow
//! arrays use directly; the store keeps the next chunk's read in flight while the previous one
//! is encoded and sent.
//!
//! The driver is loaded at run time (cudarc's dynamic loading), so the binary builds and runs
//! without CUDA; [`CudaBackend::open`] checks for the library before touching it, because
//! cudarc panics on first use when it is missing.

mod abi;
mod arena;
mod concat;
#[cfg(test)]
mod device_tests;
mod ffi;
mod filter;
mod filter_abi;
mod import;
mod ingest;
mod layout;
mod pieces;
mod pinned;
mod read;
mod reuse;
mod staging;

pub use import::{DeviceMemory, ImportDevice, ImportedAllocation, ProducerAllocation};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use futures::FutureExt;
use futures::future::BoxFuture;
use serde_json::{Map, Value};

use super::filter::RowFilter;
use super::{
    Backend, BackendError, DeviceInfo, ExportDevice, ExportedColumn, Partition, PreparedImport,
    check_rows, downcast_all, downcast_one,
};
use concat::{Arrangement, Fragment};
use ffi::{ConcatTable, Context, DeviceAllocation, FilterKernels, Kernel, Stream};
use layout::{DeviceArray, Kind, UploadPlan};
use pinned::PinnedHostMemory;
use read::Stored;
use staging::{PinnedPool, ReadStaging};

/// The concatenation kernel, compiled from `kernels/concat.cu` by `kernels/build_ptx.py`.
const CONCAT_PTX: &str = include_str!("../../../kernels/concat.ptx");
const FILTER_PTX: &str = include_str!("../../../kernels/filter.ptx");

/// Pinned memory kept for reuse between transfers.
const MAX_CACHED_PINNED_BYTES: u64 = 1 << 30;
/// Freed device memory kept for reuse: at most this fraction of the GPU's memory.
const KEPT_DEVICE_FRACTION: u64 = 32;
/// Uploads run at once per GPU (see `Shared::upload_permits`).
pub const UPLOADS_AT_ONCE: usize = 8;

/// Pinned memory leased at once per GPU beyond which reads (chunks in flight and those their
/// readers have not taken yet) are refused: 256 reads of 16 MiB chunks.
pub const MAX_LEASED_PINNED_BYTES: u64 = 4 << 30;

/// Why CUDA cannot be used here, if it cannot; `None` when a driver and device `ordinal` exist.
pub fn unavailable_reason(ordinal: u32) -> Option<String> {
    if !ffi::driver_present() {
        return Some("no NVIDIA driver library (libcuda) could be loaded".to_owned());
    }
    match ffi::device_count() {
        Ok(0) => Some("the NVIDIA driver reports no CUDA device".to_owned()),
        Ok(count) if i64::from(ordinal) >= i64::from(count) => Some(format!(
            "there is no CUDA device {ordinal}; this machine has {count} (0..{})",
            count - 1
        )),
        Ok(_) => None,
        Err(error) => Some(format!("the CUDA driver failed to initialize: {error}")),
    }
}

/// Keeps datasets in the memory of the GPUs it opened. The store numbers them by their
/// position here (device 0, 1, …), whatever their CUDA ordinals.
#[derive(Debug)]
pub struct CudaBackend {
    devices: Vec<Gpu>,
    /// `peer_access[a][b]`, asked of the driver once at open: the topology does not change.
    peer_access: Vec<Vec<bool>>,
    /// Whether spills copy partitions whole ([`Backend::host_copy`]); off only for
    /// benchmarks comparing with reads in pieces.
    whole_spills: bool,
    /// Pinned host memory for `DoPut` message bodies and spills, shared by every GPU.
    pinned: Arc<PinnedHostMemory>,
    /// Message bodies copied into that memory ([`Backend::pinned_copy`]), and their bytes.
    pinned_bodies: AtomicU64,
    pinned_body_bytes: AtomicU64,
}

/// One GPU: its context, streams, staging pool and kernel, and what `status` says of it.
#[derive(Debug)]
struct Gpu {
    shared: Arc<Shared>,
    name: String,
    total_bytes: u64,
    numa_node: Option<u32>,
}

/// What uploads, partitions and reads share.
#[derive(Debug)]
struct Shared {
    context: Arc<Context>,
    /// How `ipc-export` consumers recognise this GPU.
    identity: ExportDevice,
    pool: Arc<PinnedPool>,
    /// The backend's pinned host memory (`pieces`).
    pinned: Arc<PinnedHostMemory>,
    /// Whether reads stage in it (`ReadStaging`): only on the NUMA node it was pinned on (the
    /// first GPU's); the pool places its buffers on this GPU's.
    reads_in_pinned: std::sync::atomic::AtomicBool,
    /// Freed device memory kept for the next allocation of its size.
    reuse: reuse::Reuse,
    /// Uploads running at once. Each copies on several cores and keeps the copy engine busy
    /// alone; more at once only hold more pinned staging (past what the pool keeps, pinning
    /// anew costs more than the copy) and queue on the same engine.
    upload_permits: Arc<tokio::sync::Semaphore>,
    streams: Mutex<Vec<Stream>>,
    /// `None` where the driver could not load the PTX (it then says why in the log).
    concat_kernel: Option<Kernel>,
    /// `None` where the driver could not load the PTX: reads are then filtered on the host.
    filter_kernels: Option<FilterKernels>,
    /// Fill concatenation outputs with 0xAB first, so a test sees any byte left unwritten.
    poison_outputs: bool,
    counters: Counters,
}

#[derive(Debug, Default)]
struct Counters {
    device_bytes: AtomicU64,
    uploads: AtomicU64,
    upload_syncs: AtomicU64,
    /// Time uploads spent, summed over those running at once: allocating device memory and
    /// leasing pinned staging, copying into it, and the host-to-device copy (queued to
    /// synchronized).
    upload_allocate_ns: AtomicU64,
    upload_fill_ns: AtomicU64,
    upload_copy_ns: AtomicU64,
    read_chunks: AtomicU64,
    /// Read rounds staged in the pinned host memory rather than the pool (`ReadStaging`).
    read_pinned_rounds: AtomicU64,
    read_syncs: AtomicU64,
    /// Bytes reads copied from the device to host memory.
    read_bytes: AtomicU64,
    concat_launches: AtomicU64,
    /// Copies onto this GPU from another (moves and `ipc-export` replicas), and their bytes.
    peer_copies: AtomicU64,
    peer_copy_bytes: AtomicU64,
    /// The last concatenation: all of it, allocating its outputs, and the task-table copy +
    /// launch + sync.
    concat_last_total_ns: AtomicU64,
    concat_last_allocate_ns: AtomicU64,
    /// The last concatenation's planning on the host (fragments, tasks, arrangement), and
    /// its task table's preparation (allocated on the device, written into pinned staging).
    concat_last_plan_ns: AtomicU64,
    concat_last_table_ns: AtomicU64,
    concat_last_kernel_ns: AtomicU64,
    /// Chunks filtered on this GPU, the rows they held and the rows they kept.
    filtered_chunks: AtomicU64,
    filtered_rows: AtomicU64,
    filtered_rows_kept: AtomicU64,
    /// Chunks that could not be filtered on this GPU for want of memory.
    filter_fallbacks: AtomicU64,
    /// `ipc-import`s committed to this GPU's memory, and the bytes they allocated.
    imports: AtomicU64,
    imported_bytes: AtomicU64,
    /// Allocations spills copied straight into the pinned host memory, and uploads (of
    /// message bodies and restores) copied straight from it, with their bytes.
    pinned_spill_copies: AtomicU64,
    pinned_spill_bytes: AtomicU64,
    pinned_upload_copies: AtomicU64,
    pinned_upload_bytes: AtomicU64,
    /// The host-to-device copies those uploads made: one per run of buffers that follow each
    /// other without a gap in pinned memory as on the device (`layout::copy_runs`).
    pinned_upload_runs: AtomicU64,
    /// Spills through staging (those not straight into pinned memory): the allocations they
    /// copied (one per allocation of a partition, not one per spill) and their bytes, and the
    /// time their lanes spent, summed, leasing staging, waiting for device-to-host copies and
    /// writing out of staging into fresh host memory. Counted once a copy is done.
    staged_spill_copies: AtomicU64,
    staged_spill_bytes: AtomicU64,
    staged_spill_lease_ns: AtomicU64,
    staged_spill_copy_ns: AtomicU64,
    staged_spill_write_ns: AtomicU64,
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        self.pinned.finish();
    }
}

impl CudaBackend {
    /// Opens GPU `ordinal` alone, or says why it cannot.
    pub fn open(ordinal: u32) -> Result<Self, BackendError> {
        Self::open_all(&[ordinal])
    }

    /// Opens every GPU in `ordinals` (CUDA ordinals, as `CUDA_VISIBLE_DEVICES` numbers them),
    /// or says why one cannot be.
    pub fn open_all(ordinals: &[u32]) -> Result<Self, BackendError> {
        if ordinals.is_empty() {
            return Err(BackendError::Device(
                "no CUDA device was asked for".to_owned(),
            ));
        }
        let pinned = Arc::new(PinnedHostMemory::default());
        let devices: Vec<Gpu> = ordinals
            .iter()
            .map(|&ordinal| Gpu::open(ordinal, &pinned))
            .collect::<Result<_, _>>()?;
        if let Some(first) = devices.first() {
            // On the first GPU's NUMA node, as its staging is.
            let cpus = first
                .numa_node
                .and_then(|node| super::numa::node_cpus(std::path::Path::new("/sys"), node));
            pinned.place(Arc::clone(&first.shared.context), cpus);
            for gpu in &devices {
                gpu.shared
                    .reads_in_pinned
                    .store(gpu.numa_node == first.numa_node, Ordering::Relaxed);
            }
        }
        let peer_access = devices
            .iter()
            .map(|a| {
                devices
                    .iter()
                    .map(|b| a.shared.context.can_access_peer(&b.shared.context))
                    .collect::<Result<_, _>>()
            })
            .collect::<Result<Vec<Vec<bool>>, _>>()?;
        for (a, row) in devices.iter().zip(&peer_access) {
            for (b, &can) in devices.iter().zip(row) {
                if can && let Err(error) = a.shared.context.enable_peer_access(&b.shared.context) {
                    tracing::warn!(%error, "peer access could not be enabled; copies between these GPUs go through host memory");
                }
            }
        }
        Ok(Self {
            devices,
            peer_access,
            whole_spills: true,
            pinned,
            pinned_bodies: AtomicU64::new(0),
            pinned_body_bytes: AtomicU64::new(0),
        })
    }

    /// Every CUDA device the driver shows this process (after `CUDA_VISIBLE_DEVICES`).
    pub fn visible_devices() -> Result<Vec<u32>, BackendError> {
        if !ffi::driver_present() {
            return Err(BackendError::Device(
                "no NVIDIA driver library (libcuda) could be loaded".to_owned(),
            ));
        }
        let count = ffi::device_count()?;
        Ok((0..u32::try_from(count).unwrap_or(0)).collect())
    }

    fn gpu(&self, device: u32) -> Result<&Gpu, BackendError> {
        self.devices.get(device as usize).ok_or_else(|| {
            BackendError::Device(format!(
                "no device {device}: this backend has {}",
                self.devices.len()
            ))
        })
    }
}

impl Gpu {
    fn open(ordinal: u32, pinned: &Arc<PinnedHostMemory>) -> Result<Self, BackendError> {
        if let Some(reason) = unavailable_reason(ordinal) {
            return Err(BackendError::Device(reason));
        }
        let ordinal = i32::try_from(ordinal)
            .map_err(|_| BackendError::Device(format!("device ordinal {ordinal} is too large")))?;
        let context = Context::open(ordinal)?;
        let name = context.name()?;
        let total_bytes = context.total_bytes()?;
        let identity = ExportDevice {
            ordinal: context.ordinal() as u32,
            uuid: context.uuid()?,
            pci_bus_id: context.pci_bus_id()?,
        };
        let sysfs = std::path::Path::new("/sys");
        let numa_node = super::pci_numa_node(sysfs, &identity.pci_bus_id);
        let cpus = numa_node.and_then(|node| super::numa::node_cpus(sysfs, node));
        if let (Some(node), Some(cpus)) = (numa_node, &cpus) {
            tracing::info!(
                ordinal,
                node,
                cpus = cpus.len(),
                "pinned staging on the GPU's NUMA node"
            );
        }
        let pool = PinnedPool::new(
            Arc::clone(&context),
            cpus,
            MAX_CACHED_PINNED_BYTES,
            MAX_LEASED_PINNED_BYTES,
        );
        // What a spill's or a large upload's two lanes take (`pieces`).
        pool.warm_in_background(vec![pieces::PIECE_BYTES; 2]);
        let concat_kernel = match Kernel::load(&context, CONCAT_PTX, "gpu_flight_concat") {
            Ok(kernel) => Some(kernel),
            Err(error) => {
                tracing::warn!(%error, ordinal, "the concatenation kernel did not load; datasets stay in their uploaded batches");
                None
            }
        };
        let filter_kernels = if context.supports_memory_pools() {
            FilterKernels::load(&context, FILTER_PTX)
        } else {
            Err(BackendError::Device(
                "no stream-ordered memory pools for the filters' scratch memory".to_owned(),
            ))
        };
        let filter_kernels = match filter_kernels {
            Ok(kernels) => Some(kernels),
            Err(error) => {
                tracing::warn!(%error, ordinal, "filters run on the host");
                None
            }
        };
        Ok(Self {
            numa_node,
            shared: Arc::new(Shared {
                context,
                identity,
                pool,
                pinned: Arc::clone(pinned),
                reads_in_pinned: std::sync::atomic::AtomicBool::new(false),
                reuse: reuse::Reuse::new(total_bytes / KEPT_DEVICE_FRACTION),
                upload_permits: Arc::new(tokio::sync::Semaphore::new(UPLOADS_AT_ONCE)),
                streams: Mutex::new(Vec::new()),
                concat_kernel,
                filter_kernels,
                poison_outputs: false,
                counters: Counters::default(),
            }),
            name,
            total_bytes,
        })
    }
}

impl CudaBackend {
    /// Sets how much freed device memory each GPU keeps for reuse (default a 32nd of its
    /// memory; 0: none, every allocation goes to the driver and every free back to it).
    pub fn with_kept_device_memory(self, bytes: u64) -> Self {
        for gpu in &self.devices {
            gpu.shared.reuse.set_limit(bytes);
        }
        self
    }

    /// For benchmarks: spills read partitions in pieces of rows, as the host backend's do,
    /// instead of copying their allocations whole.
    pub fn with_spills_in_pieces(mut self) -> Self {
        self.whole_spills = false;
        self
    }

    /// For benchmarks, on a backend nothing has uploaded to yet: how many uploads run at
    /// once on each GPU (default [`UPLOADS_AT_ONCE`]; at least 1).
    pub fn with_uploads_at_once(self, uploads: usize) -> Self {
        let uploads = uploads.max(1);
        for gpu in &self.devices {
            let permits = &gpu.shared.upload_permits;
            if uploads > UPLOADS_AT_ONCE {
                permits.add_permits(uploads - UPLOADS_AT_ONCE);
            } else {
                permits.forget_permits(UPLOADS_AT_ONCE - uploads);
            }
        }
        self
    }

    /// Pins `bytes` of host memory for transfers now, in the background (about a quarter of a
    /// second a GiB, see `pinned`); [`CudaBackend::pinned_host_memory`] says when it is done.
    /// Once it is pinned, large `DoPut` message bodies are copied into it
    /// ([`Backend::pinned_copy`]) and uploaded straight from it, a spill copies a partition
    /// straight from the device into it and a restore uploads straight from it, and reads copy
    /// rows into it (`ReadStaging`): all at the link's rate, without staging of their own. Until
    /// then, and for what does not fit in what is free of it, transfers go through staging.
    pub fn with_pinned_host_memory(self, bytes: u64) -> Self {
        self.pinned.start(bytes);
        self
    }

    /// The pinned host memory's size and the bytes of it in use, once it has been pinned.
    pub fn pinned_host_memory(&self) -> Option<(u64, u64)> {
        let arena = self.pinned.ready()?;
        Some((arena.len() as u64, arena.used() as u64))
    }

    /// Caps the pinned staging memory leased at once on each GPU, past which reads staged in
    /// the pool are refused (default [`MAX_LEASED_PINNED_BYTES`]; what reads hold of the
    /// pinned host memory is bounded by that memory instead).
    pub fn with_pinned_limit(self, bytes: u64) -> Self {
        for gpu in &self.devices {
            gpu.shared.pool.set_max_leased_bytes(bytes);
        }
        self
    }

    /// For benchmarks comparing variants of `kernels/concat.cu` in one run, on a backend
    /// nothing has concatenated with yet: the concatenation kernel loaded from `ptx` (the same
    /// launch contract) instead of the committed PTX.
    pub fn with_concat_kernel(mut self, ptx: &str) -> Result<Self, BackendError> {
        for gpu in &mut self.devices {
            let shared = Arc::get_mut(&mut gpu.shared).ok_or_else(|| {
                BackendError::Device("the backend is in use; load the kernel first".to_owned())
            })?;
            shared.concat_kernel = Some(Kernel::load(&shared.context, ptx, "gpu_flight_concat")?);
        }
        Ok(self)
    }

    /// Poisons every concatenation output before the kernel writes it. For tests: it costs a
    /// device memset per output.
    pub fn with_poisoned_outputs(mut self) -> Self {
        for gpu in &mut self.devices {
            if let Some(shared) = Arc::get_mut(&mut gpu.shared) {
                shared.poison_outputs = true;
            }
        }
        self
    }
}

impl CudaBackend {
    /// For benchmarks, the baseline seed 004 warns about: the value buffers of every
    /// fixed-width column of `partitions` concatenated with one `cuMemcpyDtoDAsync` per
    /// fragment, on one stream, synchronized once. Bitmaps are left out (a byte copy cannot
    /// shift bits), so it does less than [`Backend::compact`]. The outputs are freed
    /// after.
    pub fn copy_per_fragment(
        &self,
        partitions: &[Arc<dyn Partition>],
    ) -> Result<FragmentCopies, BackendError> {
        let parts = downcast_all::<CudaPartition>(partitions, "the cuda backend")?;
        let Some(first) = parts.first() else {
            return Ok(FragmentCopies::default());
        };
        let shared = one_device(&parts)?;
        let mut copies = Vec::new();
        let mut outputs = Vec::new();
        for column in 0..first.columns.len() {
            let Kind::Fixed(width) = first.columns[column].1.kind else {
                continue;
            };
            let rows: usize = parts.iter().map(|p| p.columns[column].1.len).sum();
            outputs.push(TrackedAllocation::new(shared, rows * width)?);
            let mut at = 0;
            for part in &parts {
                let (allocation, array) = &part.columns[column];
                let values = array.buffers[0];
                copies.push((outputs.len() - 1, at, *allocation, part, values));
                at += values.len;
            }
        }
        let started = std::time::Instant::now();
        shared.with_stream(|stream| {
            stream.copies(|batch| {
                for &(output, at, allocation, part, values) in &copies {
                    batch.copy_within_device(
                        &outputs[output].inner,
                        at,
                        &part.allocations[allocation].inner,
                        values.offset,
                        values.len,
                    )?;
                }
                Ok(())
            })
        })?;
        Ok(FragmentCopies {
            copies: copies.len(),
            bytes: copies.iter().map(|c| c.4.len as u64).sum(),
            elapsed: started.elapsed(),
        })
    }
}

impl CudaBackend {
    /// For benchmarks, the baseline of uploads, spills and restores: `bytes` copied from
    /// pinned host memory to one device allocation, then back, in copies of `piece` bytes on
    /// one stream, each direction synchronized once. Nothing else happens in between (no
    /// layout, no allocation, no CPU copy): the most any transfer path can move.
    pub fn plain_copies(
        &self,
        device: u32,
        bytes: usize,
        piece: usize,
    ) -> Result<PlainCopies, BackendError> {
        let shared = &self.gpu(device)?.shared;
        let piece = piece.max(1);
        let allocation = TrackedAllocation::new(shared, bytes)?;
        let mut host = shared.pool.lease(bytes)?;
        let started = std::time::Instant::now();
        shared.with_stream(|stream| {
            stream.copies(|batch| {
                for start in (0..bytes).step_by(piece) {
                    let end = bytes.min(start + piece);
                    batch.copy_to_device(&allocation.inner, start, host.as_ref(), start..end)?;
                }
                Ok(())
            })
        })?;
        let to_device = started.elapsed();
        let started = std::time::Instant::now();
        shared.with_stream(|stream| {
            stream.copies(|batch| {
                let target = &mut host.buffer_mut().as_mut_slice()[..bytes];
                for (index, chunk) in target.chunks_mut(piece).enumerate() {
                    batch.copy_to_host(chunk, &allocation.inner, index * piece)?;
                }
                Ok(())
            })
        })?;
        Ok(PlainCopies {
            bytes: bytes as u64,
            to_device,
            to_host: started.elapsed(),
        })
    }
}

/// What [`CudaBackend::plain_copies`] measured.
#[derive(Debug, Clone, Copy, Default)]
pub struct PlainCopies {
    pub bytes: u64,
    /// Pinned host memory to the device, from the first copy queued to the synchronization.
    pub to_device: std::time::Duration,
    /// The device back to pinned host memory, the same way.
    pub to_host: std::time::Duration,
}

/// What [`CudaBackend::copy_per_fragment`] did.
#[derive(Debug, Clone, Copy, Default)]
pub struct FragmentCopies {
    pub copies: usize,
    pub bytes: u64,
    /// From the first copy queued to the stream's synchronization.
    pub elapsed: std::time::Duration,
}

impl Shared {
    /// Where this GPU's reads stage (see `ReadStaging`).
    fn read_staging(&self) -> ReadStaging<'_> {
        ReadStaging {
            pool: &self.pool,
            arena: self
                .pinned
                .ready()
                .filter(|_| self.reads_in_pinned.load(Ordering::Relaxed)),
            in_arena: &self.counters.read_pinned_rounds,
        }
    }

    /// Runs `work` with a stream from the pool.
    fn with_stream<T>(
        &self,
        work: impl FnOnce(&mut Stream) -> Result<T, BackendError>,
    ) -> Result<T, BackendError> {
        let pooled = self.streams.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut stream = match pooled {
            Some(stream) => stream,
            None => Stream::new(&self.context)?,
        };
        let result = work(&mut stream);
        self.streams
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(stream);
        result
    }

    fn upload(self: &Arc<Self>, batch: RecordBatch) -> Result<Arc<dyn Partition>, BackendError> {
        let plan = UploadPlan::new(&batch)?;
        let bytes = plan.allocation_bytes();
        let started = std::time::Instant::now();
        let allocation = TrackedAllocation::new(self, bytes)?;
        let allocated = started.elapsed();
        let times = pieces::upload(self, &plan, &allocation.inner)?;
        let counters = &self.counters;
        counters.uploads.fetch_add(1, Ordering::Relaxed);
        counters
            .upload_syncs
            .fetch_add(times.syncs, Ordering::Relaxed);
        add_time(&counters.upload_allocate_ns, allocated);
        add_time(&counters.upload_fill_ns, times.fill);
        add_time(&counters.upload_copy_ns, times.copy);
        Ok(Arc::new(CudaPartition {
            shared: Arc::clone(self),
            allocations: Arc::new(vec![allocation]),
            columns: Arc::new(plan.columns.into_iter().map(|array| (0, array)).collect()),
            schema: batch.schema(),
            rows: batch.num_rows(),
        }))
    }

    /// Copies `columns` of `source` (on any GPU) into one new allocation on this one: each
    /// column's span (its buffers lie together, in the layout `ipc-export` publishes) at the
    /// next aligned offset, one copy per column (`layout::SpanCopy`), so a replica of some
    /// columns holds those alone.
    fn copy_from(
        self: &Arc<Self>,
        source: &CudaPartition,
        columns: &[usize],
    ) -> Result<Arc<dyn Partition>, BackendError> {
        let chosen = source.chosen(columns)?;
        let arrays: Vec<&DeviceArray> = chosen.iter().map(|(_, array)| *array).collect();
        let plan = layout::SpanCopy::new(&arrays);
        let allocations = if columns.is_empty() {
            Vec::new()
        } else {
            vec![TrackedAllocation::new(
                self,
                layout::allocation_bytes(plan.used_bytes),
            )?]
        };
        self.with_stream(|stream| {
            stream.copies(|batch| {
                for (&(allocation, _), &(span, to)) in chosen.iter().zip(&plan.spans) {
                    if let (Some(span), Some(copy)) = (span, allocations.first()) {
                        let original = &source.allocations[allocation].inner;
                        batch.copy_between_devices(
                            &copy.inner,
                            to,
                            original,
                            span.offset,
                            span.len,
                        )?;
                    }
                }
                // After the copies, which bring the gaps inside each column's span along.
                if let Some(copy) = allocations.first() {
                    let placed: Vec<(&DeviceArray, usize)> =
                        plan.columns.iter().map(|array| (array, 0)).collect();
                    pieces::zero_gaps(batch, &copy.inner, &placed)?;
                }
                Ok(())
            })
        })?;
        self.counters.peer_copies.fetch_add(1, Ordering::Relaxed);
        self.counters
            .peer_copy_bytes
            .fetch_add(plan.used_bytes as u64, Ordering::Relaxed);
        let remapped = plan.columns.into_iter().map(|array| (0, array)).collect();
        let schema = source
            .schema
            .project(columns)
            .map_err(|e| BackendError::Device(format!("projecting the copied columns: {e}")))?;
        Ok(Arc::new(CudaPartition {
            shared: Arc::clone(self),
            allocations: Arc::new(allocations),
            columns: Arc::new(remapped),
            schema: Arc::new(schema),
            rows: source.rows,
        }))
    }

    /// Concatenates partitions into compact columns with one kernel launch.
    fn compact(
        self: &Arc<Self>,
        partitions: &[&CudaPartition],
    ) -> Result<Arc<dyn Partition>, BackendError> {
        let started = std::time::Instant::now();
        let kernel = self.concat_kernel.as_ref().ok_or_else(|| {
            BackendError::Device("the concatenation kernel is not loaded".to_owned())
        })?;
        let first = partitions
            .first()
            .ok_or_else(|| BackendError::Device("nothing to concatenate".to_owned()))?;
        let fragments = fragments_of(partitions, true);
        let mut plan = concat::plan_table(&fragments)?;
        let arrangement = arrangement_of(&plan);
        let planned = started.elapsed();
        let allocating = std::time::Instant::now();
        let allocations = arrangement
            .allocations
            .iter()
            .map(|&bytes| {
                let allocation = TrackedAllocation::new(self, bytes)?;
                if self.poison_outputs {
                    allocation.inner.fill(0xAB)?;
                }
                Ok(allocation)
            })
            .collect::<Result<Vec<_>, BackendError>>()?;
        let allocated = allocating.elapsed();
        for (column, &(allocation, offset)) in arrangement.columns.iter().enumerate() {
            let address = allocations[allocation].inner.address();
            plan.place(column, allocation as u32, address, offset);
        }
        for (index, allocation) in allocations.iter().enumerate() {
            let (base, bytes) = (allocation.inner.address(), allocation.inner.bytes());
            plan.zero_gaps(index as u32, base, bytes, |column| {
                arrangement.columns[column].0 == index
            });
        }

        // Staging, and the table allocation's first bytes: tasks | unit starts | key maps;
        // then, in staging only, the merged dictionaries to copy into their columns.
        let tasks = &plan.tasks;
        let starts = abi::unit_starts(tasks);
        let table_bytes = std::mem::size_of_val(tasks.as_slice())
            + std::mem::size_of_val(starts.as_slice())
            + std::mem::size_of_val(plan.maps.as_slice());
        let copies_bytes: usize = plan.host_copies.iter().map(|(_, r, _)| r.len).sum();
        // Whole granules, so that the next concatenation reuses it (`reuse`).
        let table_started = std::time::Instant::now();
        let table = TrackedAllocation::new(self, layout::allocation_bytes(table_bytes))?;
        let table_allocated = table_started.elapsed();
        let mut staging = self.pool.lease(table_bytes + copies_bytes)?;
        let table_leased = table_started.elapsed();
        let mut copy_ranges = Vec::with_capacity(plan.host_copies.len());
        {
            let target = staging.buffer_mut().as_mut_slice();
            let mut at = 0;
            let mut put = |bytes: &[u8]| {
                target[at..at + bytes.len()].copy_from_slice(bytes);
                at += bytes.len();
                at - bytes.len()..at
            };
            for task in tasks {
                put(&task.to_le_bytes());
            }
            for start in &starts {
                put(&start.to_le_bytes());
            }
            for entry in &plan.maps {
                put(&entry.to_le_bytes());
            }
            for (_, _, bytes) in &plan.host_copies {
                copy_ranges.push(put(bytes.as_slice()));
            }
        }
        let sources: Vec<&DeviceAllocation> = partitions
            .iter()
            .flat_map(|p| p.allocations.iter().map(|a| &a.inner))
            .collect();
        let destinations: Vec<&DeviceAllocation> = allocations.iter().map(|a| &a.inner).collect();
        let launched = std::time::Instant::now();
        let tabled = launched - allocating - allocated;
        tracing::debug!(
            tasks = tasks.len(),
            table_bytes,
            allocate_us = table_allocated.as_secs_f64() * 1e6,
            lease_us = (table_leased - table_allocated).as_secs_f64() * 1e6,
            fill_us = (table_started.elapsed() - table_leased).as_secs_f64() * 1e6,
            "concatenation task table prepared"
        );
        self.with_stream(|stream| {
            stream.copies(|batch| {
                batch.copy_to_device(&table.inner, 0, staging.as_ref(), 0..table_bytes)?;
                for ((column, region, _), range) in plan.host_copies.iter().zip(copy_ranges) {
                    let allocation = &allocations[arrangement.columns[*column].0].inner;
                    batch.copy_to_device(allocation, region.offset, staging.as_ref(), range)?;
                }
                batch.launch_concat(
                    kernel,
                    &table.inner,
                    ConcatTable {
                        tasks,
                        owners: &plan.owners,
                        unit_starts: &starts,
                        maps: &plan.maps,
                    },
                    &sources,
                    &destinations,
                )
            })
        })?;
        let counters = &self.counters;
        counters.concat_launches.fetch_add(1, Ordering::Relaxed);
        let last = [
            (&counters.concat_last_kernel_ns, launched.elapsed()),
            (&counters.concat_last_total_ns, started.elapsed()),
            (&counters.concat_last_allocate_ns, allocated),
            (&counters.concat_last_plan_ns, planned),
            (&counters.concat_last_table_ns, tabled),
        ];
        for (counter, spent) in last {
            counter.store(nanos(spent), Ordering::Relaxed);
        }
        let rows = partitions.iter().map(|p| p.rows).sum();
        let columns = arrangement
            .columns
            .iter()
            .zip(plan.columns)
            .map(|(&(allocation, _), (array, _))| (allocation, array))
            .collect();
        Ok(Arc::new(CudaPartition {
            shared: Arc::clone(self),
            allocations: Arc::new(allocations),
            columns: Arc::new(columns),
            schema: Arc::clone(&first.schema),
            rows,
        }))
    }
}

/// Sets its flag when dropped.
struct CancelOnDrop(Arc<std::sync::atomic::AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Each partition's columns as concatenation fragments. Sources are numbered as
/// `compact` lists them: every allocation of the first partition, then of the next.
/// With `at_addresses` false the allocations are taken to start at 0 (enough to size a
/// concatenation).
fn fragments_of<'a>(
    partitions: &[&'a CudaPartition],
    at_addresses: bool,
) -> Vec<Vec<Fragment<'a>>> {
    let mut first_source = 0;
    partitions
        .iter()
        .map(|p| {
            let fragments = p
                .columns
                .iter()
                .map(|(allocation, array)| Fragment {
                    base: if at_addresses {
                        p.allocations[*allocation].inner.address()
                    } else {
                        0
                    },
                    source: (first_source + *allocation) as u32,
                    array,
                })
                .collect();
            first_source += p.allocations.len();
            fragments
        })
        .collect()
}

fn arrangement_of(plan: &concat::TablePlan) -> Arrangement {
    let used: Vec<usize> = plan.columns.iter().map(|(_, used)| *used).collect();
    Arrangement::new(&used)
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn devices(&self) -> Vec<DeviceInfo> {
        self.devices
            .iter()
            .map(|gpu| DeviceInfo {
                ordinal: gpu.shared.context.ordinal() as u32,
                name: gpu.name.clone(),
                total_bytes: Some(gpu.total_bytes),
                default_limit_bytes: Some(gpu.total_bytes),
                uuid: Some(gpu.shared.identity.uuid.clone()),
                pci_bus_id: Some(gpu.shared.identity.pci_bus_id.clone()),
                numa_node: gpu.numa_node,
            })
            .collect()
    }

    fn peer_access(&self) -> Vec<Vec<bool>> {
        self.peer_access.clone()
    }

    fn stored_size(&self, batch: &RecordBatch) -> Result<u64, BackendError> {
        Ok(UploadPlan::new(batch)?.allocation_bytes() as u64)
    }

    fn upload(
        &self,
        device: u32,
        batch: RecordBatch,
    ) -> BoxFuture<'static, Result<Arc<dyn Partition>, BackendError>> {
        let shared = match self.gpu(device) {
            Ok(gpu) => Arc::clone(&gpu.shared),
            Err(error) => return futures::future::ready(Err(error)).boxed(),
        };
        // A task of its own, so that the upload runs (and gives its permit back) whether or not
        // the caller polls it meanwhile: a put waiting for its client's next message must not
        // hold one of the GPU's upload turns. The permit goes with the blocking work, so a
        // caller that drops the future cannot let more uploads run at once either.
        let permits = Arc::clone(&shared.upload_permits);
        let task = tokio::spawn(async move {
            // Never closed: `Shared` owns the semaphore.
            let permit = permits
                .acquire_owned()
                .await
                .map_err(|e| BackendError::Device(format!("waiting to upload: {e}")))?;
            flatten_join(
                tokio::task::spawn_blocking(move || {
                    let _permit = permit;
                    shared.upload(batch)
                })
                .await,
            )
        });
        task.map(flatten_join).boxed()
    }

    fn plan_import(&self, columns: &[ExportedColumn]) -> Result<PreparedImport, BackendError> {
        let plan = ingest::ImportPlan::new(columns)?;
        Ok(PreparedImport::new(plan.allocated_bytes(), plan))
    }

    /// Copies and validates on a blocking thread: the copies take one synchronization.
    fn import(
        &self,
        device: u32,
        schema: SchemaRef,
        rows: usize,
        plan: PreparedImport,
    ) -> BoxFuture<'static, Result<Arc<dyn Partition>, BackendError>> {
        let shared = match self.gpu(device) {
            Ok(gpu) => Arc::clone(&gpu.shared),
            Err(error) => return futures::future::ready(Err(error)).boxed(),
        };
        let task = tokio::task::spawn_blocking(move || {
            let plan = plan.into_plan::<ingest::ImportPlan>("the cuda backend")?;
            let partition = ingest::import(&shared, plan, schema, rows)?;
            Ok(Arc::new(partition) as Arc<dyn Partition>)
        });
        task.map(flatten_join).boxed()
    }

    fn pin_host_memory(&self, bytes: u64) {
        self.pinned.start(bytes);
    }

    fn body_block(&self, len: usize) -> Option<Box<dyn crate::backend::BodyBlock>> {
        let block = self.pinned.ready()?.take(len)?;
        self.pinned_bodies.fetch_add(1, Ordering::Relaxed);
        self.pinned_body_bytes
            .fetch_add(len as u64, Ordering::Relaxed);
        Some(Box::new(block))
    }

    /// A block of the pinned host memory with `bytes` in it, copied over several cores.
    fn pinned_copy(&self, bytes: &[u8]) -> Option<arrow::buffer::Buffer> {
        let mut block = self.pinned.ready()?.take(bytes.len())?;
        crate::arrays::copy_all(vec![(bytes, block.as_mut_slice())]);
        self.pinned_bodies.fetch_add(1, Ordering::Relaxed);
        self.pinned_body_bytes
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        Some(block.into_buffer())
    }

    /// The partition's allocations copied whole, on a blocking thread (`pieces::host_copy`).
    fn host_copy(
        &self,
        partition: &Arc<dyn Partition>,
    ) -> Option<BoxFuture<'static, Result<RecordBatch, BackendError>>> {
        if !self.whole_spills {
            return None;
        }
        partition.as_any().downcast_ref::<CudaPartition>()?;
        let partition = Arc::clone(partition);
        // Set when the future is dropped, done or not: a caller that goes away stops the copy
        // at its next piece rather than leave a whole partition's copy running unpaid for.
        let cancelled = CancelOnDrop(Arc::new(std::sync::atomic::AtomicBool::new(false)));
        let flag = Arc::clone(&cancelled.0);
        let task = tokio::task::spawn_blocking(move || {
            let part = downcast_one::<CudaPartition>(&partition, "the cuda backend")?;
            pieces::host_copy(&part.shared, part, &flag)
        });
        Some(
            async move {
                let _cancelled = cancelled;
                flatten_join(task.await)
            }
            .boxed(),
        )
    }

    fn compacted_size(&self, partitions: &[Arc<dyn Partition>]) -> Result<u64, BackendError> {
        let parts = downcast_all::<CudaPartition>(partitions, "the cuda backend")?;
        if parts.is_empty() {
            return Ok(0);
        }
        if one_device(&parts)?.concat_kernel.is_none() {
            return Err(BackendError::CannotCompact {
                reason: "the concatenation kernel did not load (see the startup log)".to_owned(),
            });
        }
        let plan = concat::plan_table(&fragments_of(&parts, false))?;
        Ok(arrangement_of(&plan).total_bytes())
    }

    /// Concatenates on the GPU that holds the partitions, which must all be on one.
    fn compact(
        &self,
        partitions: Vec<Arc<dyn Partition>>,
    ) -> BoxFuture<'static, Result<Arc<dyn Partition>, BackendError>> {
        let task = tokio::task::spawn_blocking(move || {
            let parts = downcast_all::<CudaPartition>(&partitions, "the cuda backend")?;
            let shared = Arc::clone(one_device(&parts)?);
            shared.compact(&parts)
        });
        task.map(flatten_join).boxed()
    }

    fn copied_size(
        &self,
        partition: &Arc<dyn Partition>,
        columns: &[usize],
    ) -> Result<u64, BackendError> {
        let part = downcast_one::<CudaPartition>(partition, "the cuda backend")?;
        if columns.is_empty() {
            return Ok(0);
        }
        let chosen = part.chosen(columns)?;
        let arrays: Vec<&DeviceArray> = chosen.iter().map(|(_, array)| *array).collect();
        Ok(layout::allocation_bytes(layout::SpanCopy::new(&arrays).used_bytes) as u64)
    }

    /// One `cuMemcpyPeerAsync` per column, queued on the target GPU (`Shared::copy_from`).
    fn copy_to(
        &self,
        partition: Arc<dyn Partition>,
        columns: Vec<usize>,
        device: u32,
    ) -> BoxFuture<'static, Result<Arc<dyn Partition>, BackendError>> {
        let target = match self.gpu(device) {
            Ok(gpu) => Arc::clone(&gpu.shared),
            Err(error) => return futures::future::ready(Err(error)).boxed(),
        };
        let task = tokio::task::spawn_blocking(move || {
            let source = downcast_one::<CudaPartition>(&partition, "the cuda backend")?;
            target.copy_from(source, &columns)
        });
        task.map(flatten_join).boxed()
    }

    /// Each GPU's counters; with several GPUs, each name starts with `device<N>_`.
    fn counters(&self) -> Map<String, Value> {
        let mut all = Map::new();
        for (index, gpu) in self.devices.iter().enumerate() {
            for (key, value) in gpu.shared.counters() {
                let key = if self.devices.len() == 1 {
                    key
                } else {
                    format!("device{index}_{key}")
                };
                all.insert(key, value);
            }
        }
        let arena = self.pinned.ready();
        // 0 until pinned (and with `--pinned-host-memory 0`).
        let figures = [
            (
                "pinned_host_memory_bytes",
                arena.map_or(0, |a| a.len() as u64),
            ),
            (
                "pinned_host_memory_used_bytes",
                arena.map_or(0, |a| a.used() as u64),
            ),
            ("pinned_host_memory_pending_bytes", self.pinned.pending()),
            (
                "pinned_put_bodies",
                self.pinned_bodies.load(Ordering::Relaxed),
            ),
            (
                "pinned_put_body_bytes",
                self.pinned_body_bytes.load(Ordering::Relaxed),
            ),
        ];
        for (key, value) in figures {
            all.insert(key.to_owned(), value.into());
        }
        all
    }
}

/// The GPU that holds all of `parts` (none of them is ever moved to another).
fn one_device<'a>(parts: &[&'a CudaPartition]) -> Result<&'a Arc<Shared>, BackendError> {
    let first = parts
        .first()
        .ok_or_else(|| BackendError::Device("no partitions given".to_owned()))?;
    if parts.iter().any(|p| !Arc::ptr_eq(&p.shared, &first.shared)) {
        return Err(BackendError::Device(
            "partitions on different GPUs cannot be concatenated in one launch".to_owned(),
        ));
    }
    Ok(&first.shared)
}

impl Shared {
    fn counters(&self) -> Map<String, Value> {
        let c = &self.counters;
        let free = self.context.memory_info().map(|(free, _)| free).ok();
        let n = |counter: &AtomicU64| Value::from(counter.load(Ordering::Relaxed));
        let figures: Vec<(&str, Value)> = vec![
            (
                "device_allocated_bytes",
                Value::from(c.device_bytes.load(Ordering::Acquire)),
            ),
            ("device_kept_bytes", Value::from(self.reuse.kept_bytes())),
            ("device_reused_allocations", n(&self.reuse.hits)),
            ("device_new_allocations", n(&self.reuse.misses)),
            ("device_free_bytes", Value::from(free)),
            ("pinned_leased_bytes", Value::from(self.pool.leased_bytes())),
            ("pinned_cached_bytes", Value::from(self.pool.cached_bytes())),
            ("uploads", n(&c.uploads)),
            ("upload_syncs", n(&c.upload_syncs)),
            ("upload_allocate_ns", n(&c.upload_allocate_ns)),
            ("upload_fill_ns", n(&c.upload_fill_ns)),
            ("upload_copy_ns", n(&c.upload_copy_ns)),
            ("read_chunks", n(&c.read_chunks)),
            ("read_pinned_rounds", n(&c.read_pinned_rounds)),
            ("read_syncs", n(&c.read_syncs)),
            ("read_bytes", n(&c.read_bytes)),
            ("concat_launches", n(&c.concat_launches)),
            ("peer_copies", n(&c.peer_copies)),
            ("peer_copy_bytes", n(&c.peer_copy_bytes)),
            ("concat_last_total_ns", n(&c.concat_last_total_ns)),
            ("concat_last_allocate_ns", n(&c.concat_last_allocate_ns)),
            ("concat_last_plan_ns", n(&c.concat_last_plan_ns)),
            ("concat_last_table_ns", n(&c.concat_last_table_ns)),
            ("concat_last_kernel_ns", n(&c.concat_last_kernel_ns)),
            (
                "concat_kernel_loaded",
                Value::from(self.concat_kernel.is_some()),
            ),
            ("filtered_chunks", n(&c.filtered_chunks)),
            ("filtered_rows", n(&c.filtered_rows)),
            ("filtered_rows_kept", n(&c.filtered_rows_kept)),
            ("filter_fallbacks", n(&c.filter_fallbacks)),
            (
                "filter_kernels_loaded",
                Value::from(self.filter_kernels.is_some()),
            ),
            ("imports", n(&c.imports)),
            ("imported_bytes", n(&c.imported_bytes)),
            ("pinned_spill_copies", n(&c.pinned_spill_copies)),
            ("pinned_spill_bytes", n(&c.pinned_spill_bytes)),
            ("pinned_upload_copies", n(&c.pinned_upload_copies)),
            ("pinned_upload_runs", n(&c.pinned_upload_runs)),
            ("pinned_upload_bytes", n(&c.pinned_upload_bytes)),
            ("staged_spill_copies", n(&c.staged_spill_copies)),
            ("staged_spill_bytes", n(&c.staged_spill_bytes)),
            ("staged_spill_lease_ns", n(&c.staged_spill_lease_ns)),
            ("staged_spill_copy_ns", n(&c.staged_spill_copy_ns)),
            ("staged_spill_write_ns", n(&c.staged_spill_write_ns)),
        ];
        figures
            .into_iter()
            .map(|(name, value)| (name.to_owned(), value))
            .collect()
    }
}

/// `spent` in whole nanoseconds, as the counters keep time.
fn nanos(spent: std::time::Duration) -> u64 {
    u64::try_from(spent.as_nanos()).unwrap_or(u64::MAX)
}

/// Adds `spent` to a counter of nanoseconds.
fn add_time(counter: &AtomicU64, spent: std::time::Duration) {
    counter.fetch_add(nanos(spent), Ordering::Relaxed);
}

fn flatten_join<T>(
    joined: Result<Result<T, BackendError>, tokio::task::JoinError>,
) -> Result<T, BackendError> {
    joined.unwrap_or_else(|e| Err(BackendError::Device(format!("a transfer task failed: {e}"))))
}

impl crate::backend::BodyBlock for ffi::ArenaBlock {
    fn size(&self) -> usize {
        ffi::ArenaBlock::len(self)
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        ffi::ArenaBlock::as_mut_slice(self)
    }

    fn into_buffer(self: Box<Self>) -> arrow::buffer::Buffer {
        ffi::ArenaBlock::into_buffer(*self)
    }
}

/// A device allocation counted in the backend's `device_allocated_bytes`.
#[derive(Debug)]
struct TrackedAllocation {
    inner: DeviceAllocation,
    shared: Arc<Shared>,
    /// Its IPC handle, made on the first export and reused by later ones.
    ipc_handle: OnceLock<[u8; 64]>,
}

impl TrackedAllocation {
    fn new(shared: &Arc<Shared>, bytes: usize) -> Result<Self, BackendError> {
        let inner = shared.reuse.allocate(&shared.context, bytes)?;
        shared
            .counters
            .device_bytes
            .fetch_add(inner.bytes() as u64, Ordering::AcqRel);
        Ok(Self {
            inner,
            shared: Arc::clone(shared),
            ipc_handle: OnceLock::new(),
        })
    }

    fn ipc_handle(&self) -> Result<[u8; 64], BackendError> {
        if let Some(handle) = self.ipc_handle.get() {
            return Ok(*handle);
        }
        let handle = self.inner.ipc_handle()?;
        Ok(*self.ipc_handle.get_or_init(|| handle))
    }
}

impl Drop for TrackedAllocation {
    fn drop(&mut self) {
        self.shared
            .counters
            .device_bytes
            .fetch_sub(self.inner.bytes() as u64, Ordering::AcqRel);
        let exported = self.ipc_handle.get().is_some();
        self.shared.reuse.give_back(self.inner.take(), exported);
    }
}

/// Rows in device memory: an uploaded batch (all columns in one allocation) or a concatenation
/// (one allocation per column).
#[derive(Debug)]
struct CudaPartition {
    shared: Arc<Shared>,
    allocations: Arc<Vec<TrackedAllocation>>,
    /// Each column: the index of its allocation, and its layout there.
    columns: Arc<Vec<(usize, DeviceArray)>>,
    schema: SchemaRef,
    rows: usize,
}

impl CudaPartition {
    /// Each of `columns`: the allocation it lies in, and where.
    fn chosen(&self, columns: &[usize]) -> Result<Vec<(usize, &DeviceArray)>, BackendError> {
        columns
            .iter()
            .map(|&column| {
                self.columns
                    .get(column)
                    .map(|(allocation, array)| (*allocation, array))
                    .ok_or_else(|| {
                        BackendError::Device(format!("no column {column} in this partition"))
                    })
            })
            .collect()
    }
}

/// Columns `chosen` of a partition's layout, each with the allocation it lies in.
fn stored_columns<'a>(
    allocations: &'a [TrackedAllocation],
    columns: &'a [(usize, DeviceArray)],
    chosen: &[usize],
) -> Result<Vec<Stored<'a>>, BackendError> {
    chosen
        .iter()
        .map(|&index| {
            let (allocation, array) = columns.get(index).ok_or_else(|| {
                BackendError::Device(format!("no column {index} in this partition"))
            })?;
            let allocation = &allocations
                .get(*allocation)
                .ok_or_else(|| BackendError::Device(format!("no allocation {allocation}")))?
                .inner;
            Ok(Stored { allocation, array })
        })
        .collect()
}

impl CudaPartition {
    fn stored(&self, chosen: &[usize]) -> Result<Vec<Stored<'_>>, BackendError> {
        stored_columns(&self.allocations, &self.columns, chosen)
    }
}

impl Partition for CudaPartition {
    fn num_rows(&self) -> usize {
        self.rows
    }

    fn bytes(&self) -> u64 {
        self.allocations
            .iter()
            .map(|a| a.inner.bytes() as u64)
            .sum()
    }

    fn read(
        &self,
        offset: usize,
        len: usize,
        projection: Option<&[usize]>,
    ) -> BoxFuture<'static, Result<RecordBatch, BackendError>> {
        if let Err(error) = check_rows(offset, len, self.rows) {
            return futures::future::ready(Err(error)).boxed();
        }
        // Only the chosen columns are ever copied off the device.
        let chosen: Vec<usize> = match projection {
            Some(columns) => columns.to_vec(),
            None => (0..self.columns.len()).collect(),
        };
        let schema = match projection {
            None => Arc::clone(&self.schema),
            Some(columns) => match self.schema.project(columns) {
                Ok(schema) => Arc::new(schema),
                Err(e) => {
                    return futures::future::ready(Err(BackendError::Device(format!(
                        "choosing columns to read: {e}"
                    ))))
                    .boxed();
                }
            },
        };
        let shared = Arc::clone(&self.shared);
        let allocations = Arc::clone(&self.allocations);
        let columns = Arc::clone(&self.columns);
        let task = tokio::task::spawn_blocking(move || {
            let stored = stored_columns(&allocations, &columns, &chosen)?;
            let (batch, syncs, bytes) = shared.with_stream(|stream| {
                read::read_rows(
                    &stored,
                    &schema,
                    offset..offset + len,
                    stream,
                    shared.read_staging(),
                )
            })?;
            shared.counters.read_chunks.fetch_add(1, Ordering::Relaxed);
            shared
                .counters
                .read_syncs
                .fetch_add(syncs, Ordering::Relaxed);
            shared
                .counters
                .read_bytes
                .fetch_add(bytes, Ordering::Relaxed);
            Ok(batch)
        });
        task.map(flatten_join).boxed()
    }

    fn read_filtered(
        &self,
        offset: usize,
        len: usize,
        columns: &[usize],
        filter: &Arc<RowFilter>,
        output: &[usize],
    ) -> Option<BoxFuture<'static, Result<Option<RecordBatch>, BackendError>>> {
        self.shared.filter_kernels.as_ref()?;
        check_rows(offset, len, self.rows).ok()?;
        let stored = self.stored(columns).ok()?;
        if !filter::supports(filter, &stored, output) {
            return None;
        }
        let schema = Arc::new(self.schema.project(columns).ok()?.project(output).ok()?);
        let (shared, allocations, layout) = (
            Arc::clone(&self.shared),
            Arc::clone(&self.allocations),
            Arc::clone(&self.columns),
        );
        let (columns, output, filter) = (columns.to_vec(), output.to_vec(), Arc::clone(filter));
        let task = tokio::task::spawn_blocking(move || {
            let stored = stored_columns(&allocations, &layout, &columns)?;
            let kernels = shared.filter_kernels.as_ref().ok_or_else(|| {
                BackendError::Device("the filter kernels are not loaded".to_owned())
            })?;
            let filtered = shared.with_stream(|stream| {
                filter::read_filtered(
                    kernels,
                    &stored,
                    &filter,
                    &output,
                    &schema,
                    offset..offset + len,
                    stream,
                    shared.read_staging(),
                )
            });
            let (batch, stats) = match filtered {
                // The GPU's memory is the datasets'; without room to filter in, the rows are
                // read plainly and filtered on the host.
                Err(BackendError::OutOfMemory { requested, .. }) => {
                    tracing::debug!(requested, "no device memory to filter in");
                    shared
                        .counters
                        .filter_fallbacks
                        .fetch_add(1, Ordering::Relaxed);
                    return Ok(None);
                }
                other => other?,
            };
            let c = &shared.counters;
            c.filtered_chunks.fetch_add(1, Ordering::Relaxed);
            c.filtered_rows.fetch_add(len as u64, Ordering::Relaxed);
            c.filtered_rows_kept
                .fetch_add(stats.kept, Ordering::Relaxed);
            c.read_syncs.fetch_add(stats.syncs, Ordering::Relaxed);
            c.read_bytes.fetch_add(stats.bytes, Ordering::Relaxed);
            Ok(Some(batch))
        });
        Some(task.map(flatten_join).boxed())
    }

    /// The bytes of the columns' regions, from their layout: no device memory is touched.
    fn column_bytes(&self, columns: &[usize]) -> Option<u64> {
        columns.iter().try_fold(0u64, |sum, &index| {
            let (_, array) = self.columns.get(index)?;
            Some(sum.saturating_add(layout::used_bytes(array)))
        })
    }

    fn export(
        &self,
        columns: &[usize],
    ) -> Result<(ExportDevice, Vec<ExportedColumn>), BackendError> {
        let device = self.shared.identity.clone();
        let columns = columns
            .iter()
            .map(|&index| {
                let (allocation, array) = self.columns.get(index).ok_or_else(|| {
                    BackendError::Device(format!("no column {index} in this partition"))
                })?;
                let tracked = &self.allocations[*allocation];
                let allocation = &tracked.inner;
                Ok(ExportedColumn {
                    handle: tracked.ipc_handle()?,
                    allocation_bytes: allocation.bytes() as u64,
                    array: layout::exported(array),
                })
            })
            .collect::<Result<_, BackendError>>()?;
        Ok((device, columns))
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
