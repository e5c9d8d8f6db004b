//! Custom `DoAction` actions: their names, descriptions, request bodies and JSON results.

use arrow_flight::{Action, ActionType};
use serde_json::{Value, json};

use super::descriptor::{parse_json_object, parse_name};
use crate::error::Error;
use crate::store::StoreStatus;

/// The actions this server understands, as `ListActions` reports them.
pub const ACTIONS: &[(&str, &str)] = &[
    (
        "drop",
        "Remove a dataset. Body: JSON {\"name\": \"...\"}. Result: JSON {\"name\", \"rows\", \"bytes\"}. \
         Streams already reading it finish with their data; its memory returns when they are done.",
    ),
    (
        "status",
        "Describe the server. Body: empty. Result: JSON {\"version\", \"backend\", \"devices\": \
         [{\"ordinal\", \"name\", \"total_bytes\", \"limit_bytes\", \"used_bytes\"}], \"datasets\", \
         \"bytes\" (memory held), \"data_bytes\" (Arrow bytes), \"leases\", \"leased_only_bytes\", \
         \"counters\"}.",
    ),
    (
        "ipc-export",
        "Map a dataset's columns zero-copy from another process on this node (CUDA backend). \
         Body: JSON {\"name\", \"columns\" (optional), \"lease_seconds\" (optional, default 300), \
         \"lease\" (optional: renew this lease)}. Result: JSON document version 1 with the lease, \
         device UUID and PCI bus id, schema, and per column a CUDA IPC handle and buffer offsets \
         (see the README). The memory stays valid until ipc-release or expiry.",
    ),
    (
        "ipc-release",
        "End an ipc-export lease. Body: JSON {\"lease\"}. Result: JSON {\"lease\", \"name\"}. \
         Close your handles first: memory of a dropped dataset is freed once its last lease ends.",
    ),
];

/// Lease length when `ipc-export` names none.
pub const DEFAULT_LEASE_SECONDS: u64 = 300;
/// Longest lease `ipc-export` grants: a day; renew for longer.
pub const MAX_LEASE_SECONDS: u64 = 86_400;

/// A parsed action request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ActionRequest {
    Drop {
        name: String,
    },
    Status,
    IpcExport {
        name: String,
        columns: Option<Vec<String>>,
        lease_seconds: u64,
        renew: Option<String>,
    },
    IpcRelease {
        lease: String,
    },
}

/// Parses an action's type and body.
pub fn parse(action: &Action) -> Result<ActionRequest, Error> {
    match action.r#type.as_str() {
        "drop" => {
            #[derive(serde::Deserialize)]
            #[serde(deny_unknown_fields)]
            struct DropBody {
                name: String,
            }
            let body: DropBody =
                parse_json_object(&action.body, "drop takes a JSON object {\"name\": \"...\"}")?;
            Ok(ActionRequest::Drop {
                name: parse_name(body.name.as_bytes())?,
            })
        }
        "status" => Ok(ActionRequest::Status),
        "ipc-export" => {
            #[derive(serde::Deserialize)]
            #[serde(deny_unknown_fields)]
            struct ExportBody {
                name: String,
                columns: Option<Vec<String>>,
                lease_seconds: Option<u64>,
                lease: Option<String>,
            }
            let body: ExportBody = parse_json_object(
                &action.body,
                "ipc-export takes a JSON object {\"name\": \"...\", \"columns\": [...], \
                 \"lease_seconds\": N, \"lease\": \"...\"} (all but name optional)",
            )?;
            let lease_seconds = body.lease_seconds.unwrap_or(DEFAULT_LEASE_SECONDS);
            if !(1..=MAX_LEASE_SECONDS).contains(&lease_seconds) {
                return Err(Error::InvalidCommand(format!(
                    "lease_seconds must be 1..={MAX_LEASE_SECONDS}, not {lease_seconds}"
                )));
            }
            Ok(ActionRequest::IpcExport {
                name: parse_name(body.name.as_bytes())?,
                columns: body.columns,
                lease_seconds,
                renew: body.lease.map(|lease| parse_lease(&lease)).transpose()?,
            })
        }
        "ipc-release" => {
            #[derive(serde::Deserialize)]
            #[serde(deny_unknown_fields)]
            struct ReleaseBody {
                lease: String,
            }
            let body: ReleaseBody = parse_json_object(
                &action.body,
                "ipc-release takes a JSON object {\"lease\": \"...\"}",
            )?;
            Ok(ActionRequest::IpcRelease {
                lease: parse_lease(&body.lease)?,
            })
        }
        other => Err(Error::UnknownAction(other.to_owned())),
    }
}

/// Checks a lease id's shape: the server issues 32 hex digits, so anything else cannot name a
/// lease, and never reaches a log line or an error message unchecked.
fn parse_lease(lease: &str) -> Result<String, Error> {
    if lease.len() <= 64
        && lease
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-')
    {
        Ok(lease.to_owned())
    } else {
        Err(Error::InvalidCommand(
            "a lease id is the hex string ipc-export returned".to_owned(),
        ))
    }
}

/// `ListActions`' answer.
pub fn action_types() -> Vec<ActionType> {
    ACTIONS
        .iter()
        .map(|(name, description)| ActionType {
            r#type: (*name).to_owned(),
            description: (*description).to_owned(),
        })
        .collect()
}

/// The `status` action's JSON document.
pub fn status_json(status: &StoreStatus) -> Value {
    let devices: Vec<Value> = status
        .devices
        .iter()
        .map(|device| {
            json!({
                "ordinal": device.info.ordinal,
                "name": device.info.name,
                "total_bytes": device.info.total_bytes,
                "limit_bytes": device.limit_bytes,
                "used_bytes": device.used_bytes,
            })
        })
        .collect();
    let leases: Vec<Value> = status
        .leases
        .iter()
        .map(|lease| {
            json!({
                "lease": lease.id,
                "name": lease.dataset,
                "version": lease.version,
                "columns": lease.columns,
                "bytes": lease.bytes,
                "expires_at": rfc3339(lease.expires_at),
                "in_catalog": lease.in_catalog,
            })
        })
        .collect();
    json!({
        "version": env!("CARGO_PKG_VERSION"),
        "backend": status.backend,
        "devices": devices,
        "datasets": status.datasets,
        "bytes": status.bytes,
        "data_bytes": status.data_bytes,
        "leases": leases,
        "leased_only_bytes": status.leased_only_bytes,
        "counters": status.counters,
    })
}

/// RFC 3339 in UTC with milliseconds, as every timestamp the server reports.
pub fn rfc3339(time: std::time::SystemTime) -> String {
    chrono::DateTime::<chrono::Utc>::from(time).to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn actions_parse() {
        let drop = Action::new("drop", r#"{"name": "t"}"#);
        assert_eq!(
            parse(&drop).expect("valid"),
            ActionRequest::Drop {
                name: "t".to_owned()
            }
        );
        assert_eq!(
            parse(&Action::new("status", "")).expect("valid"),
            ActionRequest::Status
        );
        for bad in ["t", r#"["t"]"#, "[]", "null", "\"t\""] {
            assert!(
                matches!(
                    parse(&Action::new("drop", bad)),
                    Err(Error::InvalidCommand(_))
                ),
                "{bad}"
            );
        }
        assert!(matches!(
            parse(&Action::new("explode", "")),
            Err(Error::UnknownAction(_))
        ));
        assert_eq!(
            parse(&Action::new("ipc-export", r#"{"name": "t"}"#)).expect("valid"),
            ActionRequest::IpcExport {
                name: "t".to_owned(),
                columns: None,
                lease_seconds: DEFAULT_LEASE_SECONDS,
                renew: None,
            }
        );
        for bad in [
            r#"{"name": "t", "lease_seconds": 0}"#,
            r#"{"name": "t", "lease_seconds": 86401}"#,
            r#"{"name": "t", "colums": ["x"]}"#,
            r#"{"columns": ["x"]}"#,
            r#"["t"]"#,
            r#"{"name": "t", "lease": "a\nb"}"#,
        ] {
            assert!(
                matches!(
                    parse(&Action::new("ipc-export", bad)),
                    Err(Error::InvalidCommand(_))
                ),
                "{bad}"
            );
        }
        assert_eq!(
            parse(&Action::new("ipc-release", r#"{"lease": "ab"}"#)).expect("valid"),
            ActionRequest::IpcRelease {
                lease: "ab".to_owned()
            }
        );
    }
}
