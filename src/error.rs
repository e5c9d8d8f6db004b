//! The protocol-level error and the one place that decides which gRPC code a client sees.
//!
//! Each layer has its own error type (`BackendError`, `StoreError`, and this [`Error`] for the
//! protocol); they nest by `#[from]`. [`From<Error> for Status`] matches every variant of all
//! three without a catch-all arm, so adding a variant anywhere forces a decision about its code.
//! Client mistakes are logged at `info`, server faults at `warn`.

use tonic::{Code, Status};

use crate::auth::AuthError;
use crate::backend::BackendError;
use crate::store::StoreError;

/// Longest message sent in a Status; schemas in mismatch errors can be long.
const MAX_MESSAGE_BYTES: usize = 4096;

/// Everything a Flight request can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid descriptor: {0}")]
    InvalidDescriptor(String),
    #[error("invalid ticket: {0}")]
    InvalidTicket(String),
    #[error("invalid request body: {0}")]
    InvalidCommand(String),
    #[error("invalid Arrow IPC data: {0}")]
    InvalidIpc(String),
    #[error("undecodable request: {0}")]
    Undecodable(String),
    #[error(
        "a request message of {declared} bytes is over the limit of {limit} bytes ({flag}); \
         tickets, descriptors and action bodies are small"
    )]
    RequestTooLarge {
        declared: usize,
        limit: usize,
        flag: &'static str,
    },
    #[error("a message of {declared} bytes is over the limit of {limit} bytes ({flag}); {hint}")]
    MessageTooLarge {
        declared: usize,
        limit: usize,
        flag: &'static str,
        hint: &'static str,
    },
    #[error("the server's host memory could not hold {0} more bytes now; retry later")]
    HostMemory(usize),
    #[error(
        "a record batch of this dataset cannot be sent within the {limit}-byte message limit \
         (--max-message-bytes): {what} alone takes {needed} bytes; raise --max-message-bytes \
         and the client's maximum receive size, or store fewer columns per dataset"
    )]
    ReplyTooLarge {
        what: &'static str,
        needed: usize,
        limit: usize,
    },
    #[error("unknown action '{0}'; ListActions lists the actions this server offers")]
    UnknownAction(String),
    #[error("{0} is not supported by gpu-flight")]
    Unsupported(&'static str),
    #[error("the client stream broke off: {0}")]
    ClientGone(String),
    #[error("the client abandoned the put: {0}")]
    PutAbandoned(String),
    #[error("the server is shutting down; retry against another server or after it restarts")]
    ShuttingDown,
    /// Prepared statements hold what the server allows them: the message says which limit.
    #[error("{0}")]
    PreparedStatementsFull(String),
    /// A prepared statement handle the caller holds no statement under.
    #[error("{0}")]
    UnknownPreparedStatement(String),
    /// Valid SQL that Flight SQL here does not run; the message says what it runs.
    #[error("{0}")]
    SqlUnsupported(String),
    /// SQL that is not valid, or not meaningful for the dataset it names.
    #[error("{0}")]
    SqlInvalid(String),
    /// A shared-memory read this server or this call cannot make: the message says why.
    #[error("{0}")]
    SharedMemoryUnavailable(String),
    /// A same-node path (`ipc-import`, `shm-read`) asked for by a client on another node.
    #[error(
        "{0} is for processes on the server's own node: call it over a Unix socket or a \
         loopback address"
    )]
    NotOnThisNode(&'static str),
    /// The dataset changed while a read that must see one version was planned; asking again
    /// reads the new one.
    #[error("dataset '{0}' changed while its read was being planned; ask again")]
    ChangedWhileReading(String),
    #[error("internal error (a bug in gpu-flight, please report it): {0}")]
    Internal(String),
    #[error(transparent)]
    Auth(#[from] AuthError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<BackendError> for Error {
    fn from(error: BackendError) -> Self {
        Self::Store(StoreError::Backend(error))
    }
}

impl Error {
    /// The status a client sees, without logging it (for errors logged where they are handled).
    pub(crate) fn quiet_status(&self) -> Status {
        Status::new(self.code(), bounded(self.to_string()))
    }

    fn code(&self) -> Code {
        match self {
            Self::InvalidDescriptor(_)
            | Self::InvalidTicket(_)
            | Self::InvalidCommand(_)
            | Self::InvalidIpc(_)
            | Self::Undecodable(_)
            | Self::RequestTooLarge { .. } => Code::InvalidArgument,
            Self::MessageTooLarge { .. } | Self::HostMemory(_) => Code::ResourceExhausted,
            Self::ReplyTooLarge { .. } => Code::FailedPrecondition,
            Self::UnknownAction(_) | Self::Unsupported(_) => Code::Unimplemented,
            Self::ClientGone(_) => Code::Cancelled,
            Self::PutAbandoned(_) => Code::Aborted,
            Self::ShuttingDown => Code::Unavailable,
            Self::PreparedStatementsFull(_) => Code::ResourceExhausted,
            Self::UnknownPreparedStatement(_) => Code::NotFound,
            Self::SqlUnsupported(_) => Code::Unimplemented,
            Self::SqlInvalid(_) => Code::InvalidArgument,
            Self::SharedMemoryUnavailable(_) | Self::NotOnThisNode(_) => Code::FailedPrecondition,
            Self::ChangedWhileReading(_) => Code::Aborted,
            Self::Internal(_) => Code::Internal,
            Self::Auth(error) => auth_code(error),
            Self::Store(error) => store_code(error),
        }
    }
}

fn auth_code(error: &AuthError) -> Code {
    match error {
        AuthError::Missing | AuthError::Rejected(_) | AuthError::Throttled { .. } => {
            Code::Unauthenticated
        }
        AuthError::Denied { .. } => Code::PermissionDenied,
    }
}

fn store_code(error: &StoreError) -> Code {
    match error {
        StoreError::NotFound { .. }
        | StoreError::StaleVersion { .. }
        | StoreError::ForeignTicket { .. }
        | StoreError::LeaseNotFound { .. } => Code::NotFound,
        StoreError::AlreadyExists { .. } => Code::AlreadyExists,
        StoreError::SchemaMismatch { .. }
        | StoreError::SchemaChanged { .. }
        | StoreError::MissingSchema
        | StoreError::RowsOutOfRange { .. }
        | StoreError::UnknownColumn { .. }
        | StoreError::LeaseMismatch { .. }
        | StoreError::NotAnExportLease { .. }
        | StoreError::RenewalChangesTerms { .. } => Code::InvalidArgument,
        StoreError::NotCompact { .. }
        | StoreError::TooManyPartitions { .. }
        | StoreError::EmptyDataset { .. }
        | StoreError::NoPeerAccess { .. } => Code::FailedPrecondition,
        StoreError::MemoryExhausted { .. } | StoreError::TiersExhausted { .. } => {
            Code::ResourceExhausted
        }
        StoreError::UnknownDevice { .. } => Code::InvalidArgument,
        StoreError::ChangedDuringMove { .. } => Code::Aborted,
        StoreError::SharedMemoryLimit { .. } | StoreError::TooManyLeases { .. } => {
            Code::ResourceExhausted
        }
        StoreError::SharedMemory(_) => Code::Internal,
        StoreError::SharedMemoryExhausted(_) => Code::ResourceExhausted,
        StoreError::TokenRejected(_) | StoreError::LeaseNotYours { .. } => Code::PermissionDenied,
        StoreError::DiskFull(_) => Code::ResourceExhausted,
        StoreError::Persist(_) => Code::Internal,
        StoreError::Corrupt(_) | StoreError::Damaged { .. } => Code::DataLoss,
        StoreError::Backend(error) => backend_code(error),
    }
}

fn backend_code(error: &BackendError) -> Code {
    match error {
        BackendError::OutOfMemory { .. }
        | BackendError::StagingExhausted { .. }
        | BackendError::MappingExhausted { .. } => Code::ResourceExhausted,
        BackendError::UnsupportedType { .. } | BackendError::ImportRefused(_) => {
            Code::InvalidArgument
        }
        BackendError::CannotCompact { .. }
        | BackendError::NotExportable { .. }
        | BackendError::NotImportable { .. } => Code::FailedPrecondition,
        BackendError::OutsidePartition { .. } | BackendError::Device(_) => Code::Internal,
    }
}

impl From<Error> for Status {
    fn from(error: Error) -> Self {
        let code = error.code();
        let message = bounded(error.to_string());
        // Messages quote what clients sent (names, action types); escaped, a newline in them
        // cannot forge a log line.
        let logged = message.escape_debug();
        match code {
            Code::Internal | Code::Unknown | Code::DataLoss => {
                tracing::warn!(message = %logged, ?code, "request failed")
            }
            // The call's log line says it too, with who asked and for what.
            _ => tracing::debug!(message = %logged, ?code, "request refused"),
        }
        Status::new(code, message)
    }
}

fn bounded(mut message: String) -> String {
    if message.len() > MAX_MESSAGE_BYTES {
        let mut end = MAX_MESSAGE_BYTES;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
        message.push_str("...");
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_memory_out_of_resources_is_resource_exhausted() {
        let exhausted = Error::Store(StoreError::SharedMemoryExhausted("memfd_create".into()));
        assert_eq!(Status::from(exhausted).code(), Code::ResourceExhausted);
        let failed = Error::Store(StoreError::SharedMemory("sealing".into()));
        assert_eq!(Status::from(failed).code(), Code::Internal);
    }
}
