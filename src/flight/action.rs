//! Custom `DoAction` actions: their names, descriptions, request bodies and JSON results.

use arrow_flight::{Action, ActionType};
use serde_json::Value;

use super::descriptor::{Compression, DeviceRef, ReadCommand, parse_json_object, parse_name};
use super::ipc_export::{self, ImportDocument};
use super::stages::StagesDocument;
use crate::auth::{self, Operation, Principal};
use crate::error::Error;
use crate::store::{PersistenceStatus, PutMode, StoreStatus, TierStatus};

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
         [{\"device\" (what puts and endpoints call it), \"ordinal\" (CUDA's), \"name\", \
         \"uuid\", \"pci_bus_id\", \"numa_node\" (GPUs), \"total_bytes\", \"limit_bytes\", \
         \"used_bytes\"}], \"topology\": {\"peer_access\"}, \"datasets\", \
         \"bytes\" (memory held), \"data_bytes\" (Arrow bytes), \"leases\" (ids only to their \
         owner and admins), \"leased_only_bytes\", \"puts\" (in flight: rows and bytes so far; the caller's own unless admin), \
         \"counters\"}.",
    ),
    (
        "ipc-export",
        "Map a dataset's columns zero-copy from another process on this node (CUDA backend). \
         Body: JSON {\"name\", \"columns\" (optional), \"lease_seconds\" (optional, default 300), \
         \"lease\" (optional: renew this lease), \"version\" (1, the default, or 2), \"device\" \
         (optional: the consumer's GPU, number or UUID), \"copy\" (optional: replicate onto it)}. \
         Result: a JSON document with the lease, schema, and per partition its device (UUID, PCI \
         bus id), how to open it, and per column a CUDA IPC handle and buffer offsets (see \
         docs/protocol.md). The memory stays valid until ipc-release or expiry.",
    ),
    (
        "move",
        "Move a dataset to another device (see Placement in docs/protocol.md). Body: JSON {\"name\", \
         \"device\": number or GPU UUID}. Result: JSON {\"name\", \"device\", \"moved_bytes\", \
         \"version\"}. Readers see the old version or the new one; the old memory returns when \
         they are done.",
    ),
    (
        "copy",
        "Copy a dataset to a new name on a device (see Placement in docs/protocol.md). Body: JSON \
         {\"name\", \"as\" (the new name), \"device\": number or GPU UUID (optional on a \
         server with one device)}. Result: JSON {\"name\", \"as\", \"device\", \
         \"copied_bytes\", \"version\"}.",
    ),
    (
        "shm-read",
        "Stage a dataset's rows as an Arrow IPC file in shared memory, for a process on this \
         node to map without a copy (needs --shm-socket). Body: JSON {\"name\", \"columns\" \
         (optional), \"where\" (optional SQL predicate), \"compression\" (optional), \
         \"lease_seconds\" (optional, default 300)}. Result: JSON {\"lease\", \"token\", \
         \"socket\", \"bytes\", \"num_rows\", \"files\": [{\"bytes\", \"num_rows\"}], \
         \"order\": \"round-robin\" (batch i is in file i % files), \"token_expires_at\", \
         \"lease_seconds\"}: send the token on the Unix socket to receive the files' \
         descriptors (see docs/protocol.md). The files stay until ipc-release or expiry \
         (lease-renew extends it), and are revoked then.",
    ),
    (
        "lease-renew",
        "Extend a lease you hold (a shm-read's or an ipc-export's) without asking again. Body: \
         JSON {\"lease\", \"lease_seconds\" (optional: as long as it was last granted \
         for)}. Result: JSON {\"lease\", \"expires_at\"}; NOT_FOUND if it has ended.",
    ),
    (
        "ipc-import",
        "Copy Arrow columns another process on this node holds on one of the server's GPUs into \
         a dataset, device to device, without the network (CUDA backend). Body: JSON {\"name\", \
         \"mode\" (optional: create, replace or append), \"device\" ({\"uuid\", \"pci_bus_id\", \
         \"ordinal\"}: the producer's GPU), \"num_rows\", \"schema\" (base64 Arrow IPC \
         schema), \"columns\" (per column a CUDA IPC handle, allocation_bytes and buffer offsets, \
         as ipc-export describes them)}. Result: JSON as DoPut's {\"name\", \"mode\", \"rows\", \
         \"bytes\", \"total_rows\", \"total_bytes\"}. The producer may free its memory once \
         this returns (see docs/protocol.md).",
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
        /// The consumer's device.
        device: Option<DeviceRef>,
        copy: bool,
        /// The document version to write.
        version: u32,
    },
    IpcRelease {
        lease: String,
    },
    /// `lease-renew`: lease `lease` extended, by `lease_seconds` or its last term.
    LeaseRenew {
        lease: String,
        lease_seconds: Option<u64>,
    },
    /// `shm-read`: a read command (the GetFlightInfo CMD document) staged in shared memory.
    ShmRead {
        read: ReadCommand,
        lease_seconds: u64,
    },
    IpcImport {
        document: Box<ImportDocument>,
    },
    Move {
        name: String,
        device: DeviceRef,
    },
    Copy {
        name: String,
        copy: String,
        /// `None`: the server's only device ([`copy_device`]).
        device: Option<DeviceRef>,
    },
}

impl ActionRequest {
    /// What the action asks to do, as the role table (`crate::auth::required_role`) reads it.
    pub fn operation(&self) -> Operation {
        Operation::Action(match self {
            Self::Drop { .. } => auth::Action::Drop,
            Self::Status => auth::Action::Status,
            Self::IpcExport { copy, .. } => auth::Action::IpcExport { copy: *copy },
            Self::IpcRelease { .. } => auth::Action::IpcRelease,
            Self::LeaseRenew { .. } => auth::Action::LeaseRenew,
            Self::ShmRead { .. } => auth::Action::ShmRead,
            Self::IpcImport { .. } => auth::Action::IpcImport,
            Self::Move { .. } => auth::Action::Move,
            Self::Copy { .. } => auth::Action::Copy,
        })
    }

    /// The name of an action only a caller on this node can use (`None` for the others):
    /// the same-node paths hand over CUDA IPC handles or shared memory, which mean nothing
    /// elsewhere, and what they hold for the caller (a lease, an import's copy) a remote
    /// caller would only tie up.
    pub fn same_node_only(&self) -> Option<&'static str> {
        match self {
            Self::IpcExport { .. } => Some("ipc-export"),
            Self::ShmRead { .. } => Some("shm-read"),
            Self::IpcImport { .. } => Some("ipc-import"),
            Self::Drop { .. }
            | Self::Status
            | Self::IpcRelease { .. }
            | Self::LeaseRenew { .. }
            | Self::Move { .. }
            | Self::Copy { .. } => None,
        }
    }

    /// What the action is about, for its call's log line.
    pub fn subject(&self) -> String {
        match self {
            Self::Drop { name } => format!("drop {name}"),
            Self::Status => "status".to_owned(),
            Self::IpcExport { name, .. } => format!("ipc-export {name}"),
            Self::IpcRelease { .. } => "ipc-release".to_owned(),
            Self::LeaseRenew { .. } => "lease-renew".to_owned(),
            Self::ShmRead { read, .. } => format!("shm-read {}", read.name),
            Self::IpcImport { document } => format!("ipc-import {}", document.name),
            Self::Move { name, .. } => format!("move {name}"),
            Self::Copy { name, copy, .. } => format!("copy {name} as {copy}"),
        }
    }
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
                device: Option<DeviceRef>,
                #[serde(default)]
                copy: bool,
                version: Option<u32>,
            }
            let body: ExportBody = parse_json_object(
                &action.body,
                "ipc-export takes a JSON object {\"name\": \"...\", \"columns\": [...], \
                 \"lease_seconds\": N, \"lease\": \"...\", \"device\": number or GPU UUID, \
                 \"copy\": bool, \"version\": 1 or 2} (all but name optional)",
            )?;
            let version = body.version.unwrap_or(ipc_export::VERSION_1);
            if !(ipc_export::VERSION_1..=ipc_export::VERSION).contains(&version) {
                return Err(Error::InvalidCommand(format!(
                    "this server writes export documents of versions {} and {}, not {version}",
                    ipc_export::VERSION_1,
                    ipc_export::VERSION
                )));
            }
            if body.copy && body.device.is_none() {
                return Err(Error::InvalidCommand(
                    "\"copy\": true copies onto the consumer's device: name it with \"device\""
                        .to_owned(),
                ));
            }
            let lease_seconds = body.lease_seconds.unwrap_or(DEFAULT_LEASE_SECONDS);
            check_lease_seconds(lease_seconds)?;
            Ok(ActionRequest::IpcExport {
                name: parse_name(body.name.as_bytes())?,
                columns: body.columns,
                lease_seconds,
                renew: body.lease.map(|lease| parse_lease(&lease)).transpose()?,
                device: body.device,
                copy: body.copy,
                version,
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
        "lease-renew" => {
            #[derive(serde::Deserialize)]
            #[serde(deny_unknown_fields)]
            struct RenewBody {
                lease: String,
                lease_seconds: Option<u64>,
            }
            let body: RenewBody = parse_json_object(
                &action.body,
                "lease-renew takes a JSON object {\"lease\": \"...\", \"lease_seconds\": N} \
                 (lease_seconds optional)",
            )?;
            if let Some(seconds) = body.lease_seconds {
                check_lease_seconds(seconds)?;
            }
            Ok(ActionRequest::LeaseRenew {
                lease: parse_lease(&body.lease)?,
                lease_seconds: body.lease_seconds,
            })
        }
        "shm-read" => {
            #[derive(serde::Deserialize)]
            #[serde(deny_unknown_fields)]
            struct ShmReadBody {
                name: String,
                columns: Option<Vec<String>>,
                compression: Option<Compression>,
                #[serde(rename = "where")]
                filter: Option<String>,
                lease_seconds: Option<u64>,
            }
            let body: ShmReadBody = parse_json_object(
                &action.body,
                "shm-read takes a JSON object {\"name\": \"...\", \"columns\": [...], \
                 \"where\": \"SQL predicate\", \"compression\": \"lz4\" | \"zstd\", \
                 \"lease_seconds\": N} (all but name optional)",
            )?;
            let lease_seconds = body.lease_seconds.unwrap_or(DEFAULT_LEASE_SECONDS);
            check_lease_seconds(lease_seconds)?;
            Ok(ActionRequest::ShmRead {
                read: ReadCommand {
                    name: parse_name(body.name.as_bytes())?,
                    compression: body.compression,
                    columns: body.columns,
                    filter: body.filter,
                },
                lease_seconds,
            })
        }
        "ipc-import" => {
            // Not `parse_json_object`, whose limit is for small bodies: a document grows with
            // its columns, and the request limit (--max-request-bytes) bounds it.
            let usage = "ipc-import takes a JSON object {\"name\", \"mode\", \"device\", \
                         \"num_rows\", \"schema\", \"columns\"} (see docs/protocol.md)";
            let document: ImportDocument = serde_json::from_slice(&action.body)
                .map_err(|e| Error::InvalidCommand(format!("{usage}: {e}")))?;
            if let Some(version) = document.version
                && version != ipc_export::IMPORT_VERSION
            {
                return Err(Error::InvalidCommand(format!(
                    "this server reads import documents of version {}, not {version}",
                    ipc_export::IMPORT_VERSION
                )));
            }
            parse_name(document.name.as_bytes())?;
            Ok(ActionRequest::IpcImport {
                document: Box::new(document),
            })
        }
        "move" => {
            #[derive(serde::Deserialize)]
            #[serde(deny_unknown_fields)]
            struct MoveBody {
                name: String,
                device: DeviceRef,
            }
            let body: MoveBody = parse_json_object(
                &action.body,
                "move takes a JSON object {\"name\": \"...\", \"device\": number or GPU UUID}",
            )?;
            Ok(ActionRequest::Move {
                name: parse_name(body.name.as_bytes())?,
                device: body.device,
            })
        }
        "copy" => {
            #[derive(serde::Deserialize)]
            #[serde(deny_unknown_fields)]
            struct CopyBody {
                name: String,
                #[serde(rename = "as")]
                copy: String,
                device: Option<DeviceRef>,
            }
            let body: CopyBody = parse_json_object(
                &action.body,
                "copy takes a JSON object {\"name\": \"...\", \"as\": \"...\", \"device\": \
                 number or GPU UUID (optional on a server with one device)}",
            )?;
            Ok(ActionRequest::Copy {
                name: parse_name(body.name.as_bytes())?,
                copy: parse_name(body.copy.as_bytes())?,
                device: body.device,
            })
        }
        other => Err(Error::UnknownAction(other.to_owned())),
    }
}

/// The device a `copy` goes to: the one it names, else the server's only device. A server
/// with several cannot guess which one the copy is meant to be near, so it asks.
pub fn copy_device(device: Option<DeviceRef>, devices: usize) -> Result<DeviceRef, Error> {
    match device {
        Some(device) => Ok(device),
        None if devices == 1 => Ok(DeviceRef::Number(0)),
        None => Err(Error::InvalidCommand(format!(
            "copy needs \"device\": the device to put the copy on, a number from 0..{} (as \
             status lists them) or a GPU's UUID; this server has {devices} devices",
            devices.saturating_sub(1)
        ))),
    }
}

/// Leases last 1 s to [`MAX_LEASE_SECONDS`].
fn check_lease_seconds(lease_seconds: u64) -> Result<(), Error> {
    if !(1..=MAX_LEASE_SECONDS).contains(&lease_seconds) {
        return Err(Error::InvalidCommand(format!(
            "lease_seconds must be 1..={MAX_LEASE_SECONDS}, not {lease_seconds}"
        )));
    }
    Ok(())
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

/// The `drop` action's result: what the dataset held.
#[derive(Debug, serde::Serialize)]
pub struct DropResult {
    pub name: String,
    pub rows: u64,
    /// Arrow bytes.
    pub bytes: u64,
}

/// The `ipc-release` action's result.
#[derive(Debug, serde::Serialize)]
pub struct ReleaseResult {
    pub lease: String,
    pub name: String,
}

/// The `lease-renew` action's result.
#[derive(Debug, serde::Serialize)]
pub struct RenewResult {
    pub lease: String,
    /// RFC 3339, UTC.
    pub expires_at: String,
}

/// An action's result as JSON.
pub fn to_value(result: &impl serde::Serialize) -> Result<Value, Error> {
    serde_json::to_value(result)
        .map_err(|e| Error::Internal(format!("encoding an action result: {e}")))
}

/// The first characters of a lease id, enough to follow it through the logs: a whole id is a
/// capability, and logs are read by more people than the lease's owner.
pub fn lease_prefix(id: &str) -> &str {
    id.get(..8).unwrap_or(id)
}

/// The `status` action's result.
#[derive(Debug, serde::Serialize)]
pub struct StatusDocument {
    pub version: &'static str,
    pub backend: &'static str,
    pub devices: Vec<DeviceDocument>,
    pub datasets: usize,
    /// Backend memory held by committed datasets.
    pub bytes: u64,
    /// Arrow bytes in committed datasets.
    pub data_bytes: u64,
    pub leases: Vec<LeaseDocument>,
    pub leased_only_bytes: u64,
    /// Puts being received now, oldest first.
    pub puts: Vec<PutDocument>,
    pub counters: serde_json::Map<String, Value>,
    pub topology: TopologyDocument,
    pub tiers: TierStatus,
    /// Under `--data-dir`; absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub persistence: Option<PersistenceStatus>,
    /// Where streaming time went since the server started (`stages`).
    pub stages: StagesDocument,
}

/// How the devices reach each other: the first rung of the transfer-cost hierarchy (same
/// device < a peer over NVLink or PCIe < through host memory < the network).
#[derive(Debug, serde::Serialize)]
pub struct TopologyDocument {
    /// `peer_access[a][b]`: whether device `a` can read and write device `b`'s memory
    /// directly (`cuDeviceCanAccessPeer`); the host backend's pretend devices share one memory.
    pub peer_access: Vec<Vec<bool>>,
}

#[derive(Debug, serde::Serialize)]
pub struct DeviceDocument {
    /// The number puts (`"device"`) and endpoints' app_metadata use: the position here.
    pub device: u32,
    /// The CUDA ordinal (for the host backend, the same as `device`).
    pub ordinal: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pci_bus_id: Option<String>,
    /// The NUMA node nearest the device, where the system reports one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<u32>,
    pub name: String,
    pub total_bytes: Option<u64>,
    pub limit_bytes: Option<u64>,
    pub used_bytes: u64,
}

#[derive(Debug, serde::Serialize)]
pub struct LeaseDocument {
    /// The lease id, a capability to renew or release the lease: shown only to its owner and
    /// to admins, `null` to everyone else.
    pub lease: Option<String>,
    pub owner: String,
    pub name: String,
    pub version: u64,
    pub columns: Vec<String>,
    /// The consumer's device, where it named one.
    pub device: Option<u32>,
    pub bytes: u64,
    /// Memory of the replicas made for this lease (`"copy": true`), freed when it ends.
    pub replica_bytes: u64,
    /// Memory of a shared-memory read's file (`shm-read`), freed when the lease ends.
    pub staged_bytes: u64,
    pub expires_at: String,
    pub in_catalog: bool,
}

#[derive(Debug, serde::Serialize)]
pub struct PutDocument {
    pub name: String,
    pub mode: PutMode,
    pub principal: String,
    /// Rows and Arrow bytes received so far.
    pub rows: u64,
    pub bytes: u64,
    pub seconds: f64,
}

/// The `status` action's JSON document, as `viewer` may see it.
pub fn status_document(
    status: &StoreStatus,
    stages: StagesDocument,
    viewer: &Principal,
) -> Result<Value, Error> {
    let document = StatusDocument {
        version: env!("CARGO_PKG_VERSION"),
        backend: status.backend,
        devices: status
            .devices
            .iter()
            .enumerate()
            .map(|(index, device)| DeviceDocument {
                device: index as u32,
                ordinal: device.info.ordinal,
                uuid: device.info.uuid.clone(),
                pci_bus_id: device.info.pci_bus_id.clone(),
                numa_node: device.info.numa_node,
                name: device.info.name.clone(),
                total_bytes: device.info.total_bytes,
                limit_bytes: device.limit_bytes,
                used_bytes: device.used_bytes,
            })
            .collect(),
        datasets: status.datasets,
        bytes: status.bytes,
        data_bytes: status.data_bytes,
        leases: status
            .leases
            .iter()
            .map(|lease| LeaseDocument {
                lease: (viewer.sees_everyone() || *viewer.name == *lease.owner)
                    .then(|| lease.id.clone()),
                owner: lease.owner.clone(),
                name: lease.dataset.clone(),
                version: lease.version,
                columns: lease.columns.clone(),
                device: lease.device,
                bytes: lease.bytes,
                replica_bytes: lease.replica_bytes,
                staged_bytes: lease.staged_bytes,
                expires_at: ipc_export::rfc3339(lease.expires_at),
                in_catalog: lease.in_catalog,
            })
            .collect(),
        leased_only_bytes: status.leased_only_bytes,
        // A put's dataset name can tell what a principal is about to publish, which a reader
        // may not be meant to know yet.
        puts: status
            .puts
            .iter()
            .filter(|put| viewer.sees_everyone() || *viewer.name == *put.owner)
            .map(|put| PutDocument {
                name: put.name.clone(),
                mode: put.mode,
                principal: put.owner.clone(),
                rows: put.rows(),
                bytes: put.bytes(),
                seconds: (put.elapsed().as_secs_f64() * 1e3).round() / 1e3,
            })
            .collect(),
        counters: status.counters.clone(),
        topology: TopologyDocument {
            peer_access: status.peer_access.clone(),
        },
        tiers: status.tiers.clone(),
        persistence: status.persistence.clone(),
        stages,
    };
    to_value(&document)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::Role;

    /// What hands over CUDA IPC handles or shared memory, or takes them, is for callers on
    /// this node alone; releasing, renewing and the rest are not.
    #[test]
    fn the_same_node_paths_are_the_only_actions_for_this_node_alone() {
        let local_only = |kind: &str, body: &str| {
            parse(&Action::new(kind.to_owned(), body.to_owned()))
                .expect("valid")
                .same_node_only()
        };
        assert_eq!(
            local_only("ipc-export", r#"{"name": "t"}"#),
            Some("ipc-export")
        );
        assert_eq!(local_only("shm-read", r#"{"name": "t"}"#), Some("shm-read"));
        assert_eq!(local_only("ipc-release", r#"{"lease": "ab"}"#), None);
        assert_eq!(local_only("lease-renew", r#"{"lease": "ab"}"#), None);
        assert_eq!(local_only("drop", r#"{"name": "t"}"#), None);
        assert_eq!(local_only("status", ""), None);
    }

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
                device: None,
                copy: false,
                version: 1,
            }
        );
        assert_eq!(
            parse(&Action::new(
                "ipc-export",
                r#"{"name": "t", "device": "GPU-1", "copy": true, "version": 2}"#
            ))
            .expect("valid"),
            ActionRequest::IpcExport {
                name: "t".to_owned(),
                columns: None,
                lease_seconds: DEFAULT_LEASE_SECONDS,
                renew: None,
                device: Some(DeviceRef::Uuid("GPU-1".to_owned())),
                copy: true,
                version: 2,
            }
        );
        assert_eq!(
            parse(&Action::new(
                "copy",
                r#"{"name": "t", "as": "u", "device": 1}"#
            ))
            .expect("valid"),
            ActionRequest::Copy {
                name: "t".to_owned(),
                copy: "u".to_owned(),
                device: Some(DeviceRef::Number(1)),
            }
        );
        assert_eq!(
            parse(&Action::new("copy", r#"{"name": "t", "as": "u"}"#)).expect("valid"),
            ActionRequest::Copy {
                name: "t".to_owned(),
                copy: "u".to_owned(),
                device: None,
            }
        );
        assert_eq!(
            copy_device(None, 1).expect("the only one"),
            DeviceRef::Number(0)
        );
        assert_eq!(
            copy_device(Some(DeviceRef::Number(1)), 2).expect("named"),
            DeviceRef::Number(1)
        );
        let Err(Error::InvalidCommand(message)) = copy_device(None, 3) else {
            panic!("three devices: which?");
        };
        assert!(
            message.contains("\"device\"") && message.contains("0..2"),
            "{message}"
        );
        for bad in [
            r#"{"name": "t", "device": 1}"#,
            r#"{"name": "t", "as": "", "device": 1}"#,
            r#"{"name": "t", "as": "u", "device": 1, "mode": "replace"}"#,
        ] {
            assert!(
                matches!(
                    parse(&Action::new("copy", bad)),
                    Err(Error::InvalidCommand(_) | Error::InvalidDescriptor(_))
                ),
                "{bad}"
            );
        }
        for bad in [
            r#"{"name": "t", "lease_seconds": 0}"#,
            r#"{"name": "t", "lease_seconds": 86401}"#,
            r#"{"name": "t", "colums": ["x"]}"#,
            r#"{"columns": ["x"]}"#,
            r#"["t"]"#,
            r#"{"name": "t", "lease": "a\nb"}"#,
            r#"{"name": "t", "copy": true}"#,
            r#"{"name": "t", "version": 3}"#,
            r#"{"name": "t", "version": 0}"#,
            r#"{"name": "t", "device": -1}"#,
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

    #[test]
    fn lease_ids_are_shown_to_their_owner_and_admins_only() {
        let lease = |id: &str, owner: &str| crate::store::LeaseStatus {
            id: id.to_owned(),
            owner: owner.to_owned(),
            dataset: "d".to_owned(),
            version: 1,
            columns: vec![],
            device: None,
            bytes: 0,
            replica_bytes: 0,
            staged_bytes: 0,
            expires_at: std::time::SystemTime::now(),
            in_catalog: true,
        };
        let status = StoreStatus {
            backend: "host",
            devices: vec![],
            datasets: 1,
            bytes: 0,
            data_bytes: 0,
            counters: serde_json::Map::new(),
            peer_access: vec![],
            leases: vec![lease("aaaa", "alice"), lease("bbbb", "bob")],
            leased_only_bytes: 0,
            puts: vec![],
            concatenations: 0,
            concatenated_bytes: 0,
            concatenation_seconds: 0.0,
            merges: 0,
            tiers: TierStatus::default(),
            persistence: None,
        };
        let viewer = |name: &str, role: Role| Principal {
            name: name.into(),
            role,
        };
        let ids = |viewer: Principal| -> Vec<Value> {
            let document = status_document(
                &status,
                crate::flight::stages::Stages::default().document(),
                &viewer,
            )
            .expect("document");
            document["leases"]
                .as_array()
                .expect("leases")
                .iter()
                .map(|l| l["lease"].clone())
                .collect()
        };
        assert_eq!(
            ids(viewer("alice", Role::Read)),
            [Value::from("aaaa"), Value::Null]
        );
        assert_eq!(
            ids(viewer("carol", Role::Write)),
            [Value::Null, Value::Null]
        );
        assert_eq!(
            ids(viewer("root", Role::Admin)),
            [Value::from("aaaa"), Value::from("bbbb")]
        );
    }
}
