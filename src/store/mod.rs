//! The catalog of datasets, the put lifecycle and memory accounting.
//!
//! The store knows nothing of gRPC: it takes names, schemas and host record batches, and hands
//! out [`Dataset`]s. It owns the rules the protocol relies on:
//!
//! - **Atomic puts.** A [`PendingPut`] collects uploaded partitions privately. Only
//!   [`PendingPut::commit`] makes them visible, in one catalog operation; dropping a pending put
//!   (bad input, a vanished client, shutdown) frees everything it uploaded.
//! - **Budgets.** Every partition is paid for by a [`memory::Reservation`] taken *before* the
//!   upload, so a put beyond the memory limit fails without disturbing other datasets.
//! - **Snapshot reads.** Datasets are immutable; readers hold an `Arc`, so `drop`, `replace` and
//!   `append` never cut a running stream short.
//! - **Tiers.** A partition lives on its device or, spilled there when the device needs room
//!   for something else, in host memory (`tier`); reads serve it where it is, `ipc-export`
//!   brings it back first.
//! - **Leases.** An `ipc-export` lease holds its dataset like a reader does (`lease`), so
//!   memory other processes have mapped outlives `drop` and `replace` until the lease ends.
//!
//! The catalog is a `DashMap`: lookups from many concurrent `DoGet`s never contend on one lock,
//! and no shard lock is ever held across an `.await`.
//!
//! Files: `catalog` (names to datasets), `put` (pending puts, commit and compaction), `merge`
//! (merging appended partitions in the background), `relocate` (moving a dataset to another device), `export` (`ipc-export` and its leases),
//! `status` (what the store holds), `tier` (spilling to host memory and back), `durable` and
//! `files` (persistence under `--data-dir`), `disk` (datasets loaded from it when needed);
//! `dataset`,
//! `lease`, `memory` and `progress` are the parts they share.

mod catalog;
mod dataset;
mod disk;
mod durable;
mod export;
mod files;
mod lease;
pub mod memory;
mod merge;
mod progress;
mod put;
mod relocate;
mod status;
#[cfg(test)]
mod testing;
mod tier;

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use dashmap::DashMap;

pub use catalog::{Damaged, Dropped};
pub use dataset::{Dataset, TierBytes, Version};
pub use durable::Durability;
pub use export::{Access, Export, ExportRequest, ExportedPartition, MAX_EXPORT_PARTITIONS};
pub use lease::{Lease, LeaseTerms};
use memory::MemoryBudget;
pub use progress::PutProgress;
pub use put::{PendingPut, PutSummary, Upload, UploadedPartition};
pub use relocate::{CopySummary, MoveSummary};
pub use status::{DeviceStatus, LeaseStatus, PersistenceStatus, StoreStatus, TierStatus};
pub use tier::Tier;

use crate::backend::{Backend, BackendError};

/// What can go wrong in the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("dataset '{name}' does not exist")]
    NotFound { name: String },
    #[error(
        "dataset '{name}' already exists; put with mode \"replace\" or \"append\", or drop it first"
    )]
    AlreadyExists { name: String },
    #[error(
        "cannot append to dataset '{name}': its schema is {existing} but the put sends {incoming}; \
         append needs identical fields"
    )]
    SchemaMismatch {
        name: String,
        existing: String,
        incoming: String,
    },
    #[error("the put changed its schema mid-stream from {first} to {second}")]
    SchemaChanged { first: String, second: String },
    #[error("the put sent record batches before a schema")]
    MissingSchema,
    #[error(
        "memory limit reached on {}: {requested} more bytes are needed, \
         {used} of {limit} are in use; drop datasets or raise --memory-limit",
        memory_name(*device, *host_backend)
    )]
    MemoryExhausted {
        device: u32,
        requested: u64,
        used: u64,
        limit: u64,
        /// The backend's devices are host memory (pretend devices).
        host_backend: bool,
    },
    #[error(
        "no room on device {device}: {requested} more bytes are needed and {used} of \
         {limit} are in use by partitions that cannot be spilled now (being read, exported or \
         put), while the host tier holds {host_used} of {host_limit} bytes; drop datasets, \
         raise --memory-limit or --host-memory-limit, or retry when reads are done"
    )]
    TiersExhausted {
        device: u32,
        requested: u64,
        used: u64,
        limit: u64,
        host_used: u64,
        host_limit: u64,
    },
    #[error("no device {device} in this backend")]
    NoSuchDevice { device: u32 },
    #[error(
        "there is no device {device}: this server has {devices} (ordinals 0 to {last}; the \
         status action lists them)", last = devices.saturating_sub(1)
    )]
    UnknownDevice { device: u32, devices: u32 },
    #[error(
        "dataset '{name}' changed since this ticket was issued (ticket version {ticket}, now {current}); \
         call GetFlightInfo again for fresh tickets"
    )]
    StaleVersion {
        name: String,
        ticket: u64,
        current: u64,
    },
    #[error(
        "this ticket for dataset '{name}' was issued by another server, or by this one before it \
         restarted or was upgraded; call GetFlightInfo again for fresh tickets"
    )]
    ForeignTicket { name: String },
    #[error(
        "dataset '{name}' changed while it was being moved; it stays as the change left it: \
         move it again"
    )]
    ChangedDuringMove { name: String },
    #[error("rows {start}..{end} are outside dataset '{name}', which has {rows} rows")]
    RowsOutOfRange {
        name: String,
        start: u64,
        end: u64,
        rows: u64,
    },
    #[error("dataset '{name}' has no column '{column}'; its columns are {available}")]
    UnknownColumn {
        name: String,
        column: String,
        available: String,
    },
    #[error(
        "dataset '{name}' is held as {partitions} partitions ({reason}), which a version 1 \
         export document cannot describe: ask ipc-export for \"version\": 2, move the \
         dataset onto one device, or read it with DoGet"
    )]
    NotCompact {
        name: String,
        partitions: usize,
        reason: &'static str,
    },
    #[error(
        "dataset '{name}' is held as {partitions} partitions, more than an export describes \
         ({max}): copy it to a new name (the copy action compacts it where there is room), or \
         read it with DoGet"
    )]
    TooManyPartitions {
        name: String,
        partitions: usize,
        max: usize,
    },
    #[error("dataset '{name}' has no rows, so there is no memory to export")]
    EmptyDataset { name: String },
    #[error(
        "dataset '{name}' has rows on device {holder}, which device {consumer} cannot access \
         directly: export with \"copy\": true for a replica on device {consumer}, or move \
         the dataset there"
    )]
    NoPeerAccess {
        name: String,
        holder: u32,
        consumer: u32,
    },
    #[error(
        "lease '{lease}' is renewed as it was granted: its columns, device and copy cannot \
         change; ask for a new export instead"
    )]
    RenewalChangesTerms { lease: String },
    #[error("lease '{lease}' does not exist: it expired, was released, or was never granted")]
    LeaseNotFound { lease: String },
    #[error("lease '{lease}' is for dataset '{leased}', not '{requested}'")]
    LeaseMismatch {
        lease: String,
        leased: String,
        requested: String,
    },
    #[error("the data directory is full: {0}; free space there or drop datasets")]
    DiskFull(String),
    #[error("the data directory failed: {0}")]
    Persist(String),
    #[error("stored data is damaged: {0}; restore the file from a backup, or drop the dataset")]
    Corrupt(String),
    #[error(
        "dataset '{name}' is damaged and not served: {reason}; restore the file from a backup \
         and restart the server, or drop or replace the dataset"
    )]
    Damaged { name: String, reason: String },
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// What a device of the budget is, for messages: on the host backend, host memory.
fn memory_name(device: u32, host_backend: bool) -> String {
    match host_backend {
        true => format!("device {device} (host memory)"),
        false => format!("device {device}"),
    }
}

impl From<files::FilesError> for StoreError {
    fn from(error: files::FilesError) -> Self {
        match &error {
            files::FilesError::Io { source, .. }
                if source.kind() == std::io::ErrorKind::StorageFull =>
            {
                Self::DiskFull(error.to_string())
            }
            files::FilesError::Corrupt { .. } => Self::Corrupt(error.to_string()),
            _ => Self::Persist(error.to_string()),
        }
    }
}

/// How a put treats an existing dataset of the same name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PutMode {
    /// Fail with ALREADY_EXISTS if the name is taken.
    Create,
    /// Swap the dataset atomically; readers of the old one finish undisturbed.
    Replace,
    /// Add rows to the dataset (creating it if absent); the fields must be identical.
    Append,
}

/// Settings the store needs from the configuration.
#[derive(Debug, Clone, Default)]
pub struct StoreOptions {
    /// Bytes each device may hold; `None` leaves only the device's own capacity.
    pub memory_limit: Option<u64>,
    /// Bytes the host tier may hold; `None` for the default ([`default_host_memory_limit`]).
    pub host_memory_limit: Option<u64>,
    /// Where committed datasets are made durable (`--data-dir`); `None`: nowhere, nothing
    /// touches the disk. Only [`Store::open`] reads it.
    pub data_dir: Option<std::path::PathBuf>,
    /// When a commit is acknowledged under `data_dir`.
    pub durability: Durability,
}

/// The host tier's budget without `--host-memory-limit`: half the memory this process may use
/// (the machine's, or its cgroup's limit where lower) for a backend of device memory, and none
/// for the host backend, whose datasets are in host memory already.
pub fn default_host_memory_limit(backend: &dyn Backend) -> u64 {
    if backend.holds_host_memory() {
        0
    } else {
        crate::backend::host_memory_bytes().map_or(0, |bytes| bytes / 2)
    }
}

/// The catalog of datasets over one backend. Cheap to clone: all clones share the catalog.
#[derive(Debug, Clone)]
pub struct Store {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    backend: Arc<dyn Backend>,
    budget: Arc<MemoryBudget>,
    catalog: DashMap<String, Arc<Dataset>>,
    /// Datasets of the data directory whose files were found damaged at start: not served,
    /// kept on disk until dropped or replaced (see `catalog`).
    damaged: DashMap<String, Damaged>,
    next_version: AtomicU64,
    leases: lease::Leases,
    tiers: tier::Tiers,
    /// The persistence writer, under `--data-dir`: set once the data directory is loaded.
    durable: std::sync::OnceLock<durable::Durable>,
    puts: Arc<progress::Puts>,
    /// Compactions of a put's batches at commit, and background merges.
    concatenations: AtomicU64,
    /// Arrow bytes those compactions copied.
    concatenated_bytes: AtomicU64,
    concatenation_nanos: AtomicU64,
    /// Names whose partitions a background merge task is working on (`merge`).
    merging: tokio::sync::watch::Sender<merge::Running>,
    /// Background merges published.
    merges: AtomicU64,
}

/// What each array of a stored batch costs beyond its buffers (headers, `Arc`s, allocator
/// rounding): a batch of ten thousand one-row columns is not ten thousand bytes.
pub const ARRAY_OVERHEAD: u64 = 256;

/// What a partition of `rows` rows whose backend memory is `bytes` is charged: never less than
/// one bit a row. Null columns and zero-column batches hold no bytes yet may declare any
/// number of rows, and reading, planning and listing a dataset all do work per row; charging
/// the rows makes the memory limit bound that work too.
fn charge(bytes: u64, rows: u64) -> u64 {
    bytes.max(rows.div_ceil(8))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_disk_is_its_own_error() {
        let error = |kind: std::io::ErrorKind| {
            StoreError::from(files::FilesError::Io {
                path: "/data/segments/seg-1.arrow.tmp".into(),
                action: "writing",
                source: std::io::Error::from(kind),
            })
        };
        let full = error(std::io::ErrorKind::StorageFull);
        assert!(matches!(full, StoreError::DiskFull(_)), "{full}");
        assert!(full.to_string().contains("seg-1.arrow.tmp"), "{full}");
        let denied = error(std::io::ErrorKind::PermissionDenied);
        assert!(matches!(denied, StoreError::Persist(_)), "{denied}");
    }
}
