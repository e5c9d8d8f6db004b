//! What can go wrong in the store: one error type for every component, which `crate::error`
//! maps to gRPC codes.

use crate::backend::BackendError;

use super::files;

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
    /// Columns a request names that the dataset lacks: every one of them.
    #[error(
        "dataset '{name}' has no {}; its columns are {available}",
        quoted(columns)
    )]
    UnknownColumn {
        name: String,
        columns: Vec<String>,
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
    #[error(
        "lease '{lease}' was granted to another principal: only its owner renews or releases it"
    )]
    LeaseNotYours { lease: String },
    #[error(
        "principal '{owner}' holds {max} ipc-export leases already, the most one may hold \
         (--ipc-max-leases): release some (ipc-release) or let them expire"
    )]
    TooManyLeases { owner: String, max: u32 },
    #[error(
        "lease '{lease}' is a shared-memory read's (shm-read): renew it with lease-renew, not \
         ipc-export"
    )]
    NotAnExportLease { lease: String },
    #[error("lease '{lease}' is for dataset '{leased}', not '{requested}'")]
    LeaseMismatch {
        lease: String,
        leased: String,
        requested: String,
    },
    #[error(
        "principal '{owner}' would hold {what} in shared-memory reads, over {flag}; release \
         some (ipc-release, or let go of the tables read_shared returned) or raise {flag}"
    )]
    SharedMemoryLimit {
        owner: String,
        what: String,
        flag: &'static str,
    },
    #[error("staging rows in shared memory failed: {0}")]
    SharedMemory(String),
    /// The OS ran out of what shared-memory files take: memory, or descriptors.
    #[error(
        "staging rows in shared memory failed, the node is out of memory or descriptors: {0}; \
         retry later, or read fewer rows"
    )]
    SharedMemoryExhausted(String),
    /// A shared-memory token that opens nothing: unknown, used, expired, or presented by
    /// another user than the one who asked for it.
    #[error("{0}")]
    TokenRejected(String),
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

/// `column 'a'`, or `columns 'a', 'b'`.
fn quoted(columns: &[String]) -> String {
    let list: Vec<String> = columns.iter().map(|c| format!("'{c}'")).collect();
    match list.len() {
        1 => format!("column {}", list[0]),
        _ => format!("columns {}", list.join(", ")),
    }
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
