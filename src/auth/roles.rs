//! Who may do what: the one table of the role each Flight method and each action needs.
//!
//! The server's authentication layer looks a method up here before the request's body is
//! read, so a refused call costs nothing; `DoAction` looks its action up once the body has
//! said which one it is. Roles include the ones before them, so the table names the least
//! role that will do.

use std::fmt;

use super::{AuthError, Principal, Role};

/// What a call asks to do, as far as roles go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation<'a> {
    /// A Flight method, by its name in the protocol (`DoPut`).
    Method(&'a str),
    /// A `DoAction` action, by its type (`drop`). `copy`: an `ipc-export` that replicates the
    /// dataset onto the consumer's device.
    Action { name: &'a str, copy: bool },
}

/// The table: the least role `operation` needs; `None` for `Handshake`, which is how callers
/// authenticate in the first place.
pub fn required_role(operation: Operation<'_>) -> Option<Role> {
    match operation {
        Operation::Method("Handshake") => None,
        Operation::Method("DoPut" | "DoExchange") => Some(Role::Write),
        // Reading, listing, and DoAction itself: each action needs its own role below.
        Operation::Method(_) => Some(Role::Read),
        Operation::Action {
            name: "drop" | "move" | "copy",
            ..
        } => Some(Role::Write),
        // Replicas allocate device memory.
        Operation::Action {
            name: "ipc-export",
            copy: true,
        } => Some(Role::Write),
        Operation::Action { .. } => Some(Role::Read),
    }
}

/// The role that sees every caller's lease ids and puts in `status`, not only its own.
const SEES_EVERYONE: Role = Role::Admin;

impl Principal {
    /// `Ok` if this principal's role allows `operation`.
    pub fn authorize(&self, operation: Operation<'_>) -> Result<(), AuthError> {
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
impl fmt::Display for Operation<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Method(name) => f.write_str(name),
            Self::Action {
                name: "ipc-export",
                copy: true,
            } => f.write_str("ipc-export with \"copy\": true, which allocates device memory,"),
            Self::Action { name, .. } => write!(f, "the {name} action"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_need_write_and_reads_read() {
        assert_eq!(required_role(Operation::Method("Handshake")), None);
        assert_eq!(required_role(Operation::Method("DoPut")), Some(Role::Write));
        assert_eq!(required_role(Operation::Method("DoGet")), Some(Role::Read));
        for (name, copy, role) in [
            ("drop", false, Role::Write),
            ("ipc-export", false, Role::Read),
            ("ipc-export", true, Role::Write),
            ("status", false, Role::Read),
        ] {
            assert_eq!(
                required_role(Operation::Action { name, copy }),
                Some(role),
                "{name}"
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
            .authorize(Operation::Action {
                name: "drop",
                copy: false,
            })
            .expect_err("refused");
        assert!(
            refused
                .to_string()
                .starts_with("the drop action needs the write role")
        );
        assert!(reader.authorize(Operation::Method("DoGet")).is_ok());
    }
}
