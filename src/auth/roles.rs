//! Who may do what: the one table of the role each Flight method and each action needs.
//!
//! The server's authentication layer looks a method up here before the request's body is
//! read, so a refused call costs nothing; `DoAction` looks its action up once the body has
//! said which one it is. Roles include the ones before them, so the table names the least
//! role that will do.

use std::fmt;

use super::{AuthError, Principal, Role};

/// The Flight methods, by the last segment of their gRPC path (`Unknown`: a path the protocol
/// does not have, answered `UNIMPLEMENTED` once it passed this table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    Handshake,
    ListFlights,
    GetFlightInfo,
    PollFlightInfo,
    GetSchema,
    DoGet,
    DoPut,
    DoExchange,
    DoAction,
    ListActions,
    Unknown,
}

impl Method {
    /// The method's name in the protocol, as logs, metrics and refusals name it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Handshake => "Handshake",
            Self::ListFlights => "ListFlights",
            Self::GetFlightInfo => "GetFlightInfo",
            Self::PollFlightInfo => "PollFlightInfo",
            Self::GetSchema => "GetSchema",
            Self::DoGet => "DoGet",
            Self::DoPut => "DoPut",
            Self::DoExchange => "DoExchange",
            Self::DoAction => "DoAction",
            Self::ListActions => "ListActions",
            Self::Unknown => "unknown",
        }
    }
}

/// The `DoAction` actions, as far as roles go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Drop,
    Status,
    /// `copy`: the export replicates the dataset onto the consumer's device.
    IpcExport {
        copy: bool,
    },
    IpcRelease,
    /// `lease-renew`: extends a lease the caller holds.
    LeaseRenew,
    /// `shm-read`: a read, staged in shared memory.
    ShmRead,
    /// Writes a dataset, as a put does.
    IpcImport,
    Move,
    Copy,
    /// The Flight specification's `CancelFlightInfo` and `RenewFlightEndpoint`.
    FlightInfo,
    /// A `DoPut` of data (ours, or Flight SQL bulk ingestion), once its descriptor says so.
    Put,
    /// Flight SQL's `CreatePreparedStatement` and `ClosePreparedStatement` (and the ones it
    /// refuses as unimplemented).
    PreparedStatements,
}

impl Action {
    /// The action's type, as clients name it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Drop => "drop",
            Self::Status => "status",
            Self::IpcExport { .. } => "ipc-export",
            Self::IpcRelease => "ipc-release",
            Self::LeaseRenew => "lease-renew",
            Self::ShmRead => "shm-read",
            Self::IpcImport => "ipc-import",
            Self::Move => "move",
            Self::Copy => "copy",
            Self::PreparedStatements => "Flight SQL prepared statement",
            Self::FlightInfo => "CancelFlightInfo or RenewFlightEndpoint",
            Self::Put => "DoPut",
        }
    }
}

/// What a call asks to do, as far as roles go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Method(Method),
    Action(Action),
}

/// The table: the least role `operation` needs; `None` for `Handshake`, which is how callers
/// authenticate in the first place. Every method and action is named, so a new one does not
/// compile until it has a role here.
pub fn required_role(operation: Operation) -> Option<Role> {
    use Action as A;
    use Method as M;
    match operation {
        Operation::Method(M::Handshake) => None,
        Operation::Method(M::DoExchange) => Some(Role::Write),
        // DoAction itself: each action needs its own role, below.
        // DoPut itself: a put of data needs `Action::Put`, below, once its descriptor says it
        // is one; binding a prepared statement's parameters is a read.
        Operation::Method(
            M::DoPut
            | M::ListFlights
            | M::GetFlightInfo
            | M::PollFlightInfo
            | M::GetSchema
            | M::DoGet
            | M::DoAction
            | M::ListActions,
        ) => Some(Role::Read),
        // Answered UNIMPLEMENTED; a caller without a role learns nothing from it either.
        Operation::Method(M::Unknown) => Some(Role::Read),
        // Replicas allocate device memory.
        Operation::Action(
            A::Drop | A::Move | A::Copy | A::IpcExport { copy: true } | A::IpcImport | A::Put,
        ) => Some(Role::Write),
        Operation::Action(
            A::Status
            | A::IpcExport { copy: false }
            | A::IpcRelease
            | A::LeaseRenew
            | A::ShmRead
            | A::PreparedStatements
            | A::FlightInfo,
        ) => Some(Role::Read),
    }
}

/// The role that sees every caller's lease ids and puts in `status`, not only its own.
const SEES_EVERYONE: Role = Role::Admin;

impl Principal {
    /// `Ok` if this principal's role allows `operation`.
    pub fn authorize(&self, operation: Operation) -> Result<(), AuthError> {
        match required_role(operation) {
            Some(needed) => self.require(needed, &operation.to_string()),
            None => Ok(()),
        }
    }

    /// Whether `status` shows this principal what other callers hold (lease ids, puts).
    pub fn sees_everyone(&self) -> bool {
        self.role >= SEES_EVERYONE
    }
}

/// How a refusal names what was refused.
impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Method(method) => f.write_str(method.name()),
            Self::Action(Action::IpcExport { copy: true }) => {
                f.write_str("ipc-export with \"copy\": true, which allocates device memory,")
            }
            Self::Action(Action::Put) => f.write_str("DoPut"),
            Self::Action(action) => write!(f, "the {} action", action.name()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_need_write_and_reads_read() {
        assert_eq!(required_role(Operation::Method(Method::Handshake)), None);
        assert_eq!(
            required_role(Operation::Action(Action::Put)),
            Some(Role::Write)
        );
        assert_eq!(
            required_role(Operation::Method(Method::DoGet)),
            Some(Role::Read)
        );
        for (action, role) in [
            (Action::Drop, Role::Write),
            (Action::Move, Role::Write),
            (Action::Copy, Role::Write),
            (Action::IpcExport { copy: false }, Role::Read),
            (Action::IpcExport { copy: true }, Role::Write),
            (Action::IpcRelease, Role::Read),
            (Action::LeaseRenew, Role::Read),
            (Action::ShmRead, Role::Read),
            (Action::IpcImport, Role::Write),
            (Action::Status, Role::Read),
            (Action::PreparedStatements, Role::Read),
            (Action::FlightInfo, Role::Read),
        ] {
            assert_eq!(
                required_role(Operation::Action(action)),
                Some(role),
                "{action:?}"
            );
        }
    }

    #[test]
    fn a_refusal_names_what_was_refused() {
        let reader = Principal {
            name: "alice".into(),
            role: Role::Read,
        };
        let refused = reader
            .authorize(Operation::Action(Action::Drop))
            .expect_err("refused");
        assert!(
            refused
                .to_string()
                .starts_with("the drop action needs the write role")
        );
        assert!(reader.authorize(Operation::Method(Method::DoGet)).is_ok());
    }
}
