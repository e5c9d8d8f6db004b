//! Tickets: what `DoGet` reads.
//!
//! The server issues opaque tickets in `GetFlightInfo`, one per endpoint. Each names a dataset,
//! the version it was issued for (its number and random tag: see `store::Version`), and a row
//! range; a reader of several endpoints therefore never mixes rows of two versions, and a ticket
//! is never read against data other than what it was issued for, whether the dataset changed, the
//! server restarted, or the ticket came from another server (it is refused as NOT_FOUND, and the
//! client asks again). The encoding
//! starts with a NUL byte and a format version: NUL can never begin a dataset name, so `DoGet`
//! also accepts a bare dataset name as a ticket (what pyarrow users type, `Ticket(b"name")`)
//! without ambiguity.

use std::ops::Range;

use bytes::Bytes;

use super::descriptor::{ReadOptions, parse_name};
use crate::error::Error;
use crate::store::{StoreError, Version};

const MAGIC: &[u8] = b"\0gpu-flight-ticket/";

/// An endpoint's `app_metadata` in `GetFlightInfo`: where its rows lie, so a reader can pull
/// endpoints on different devices in parallel (and a co-located one can pick its own GPU's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct EndpointMetadata {
    /// The ordinal of the device holding the endpoint's rows, as `status` lists devices.
    pub device: u32,
}

impl EndpointMetadata {
    pub fn encode(&self) -> Result<Bytes, Error> {
        serde_json::to_vec(self)
            .map(Bytes::from)
            .map_err(|e| Error::Internal(format!("encoding endpoint metadata: {e}")))
    }
}
/// `GetFlightInfo`'s `app_metadata`: where the dataset's memory is, tier by tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct DatasetMetadata {
    /// The version the endpoints' tickets read.
    pub version: u64,
    /// Bytes on devices and spilled to host memory.
    pub tiers: crate::store::TierBytes,
}

impl DatasetMetadata {
    pub fn encode(&self) -> Result<Bytes, Error> {
        serde_json::to_vec(self)
            .map(Bytes::from)
            .map_err(|e| Error::Internal(format!("encoding dataset metadata: {e}")))
    }
}

/// Format 1 tickets carried a version number without a tag. Format 2 tickets read every
/// column; format 3, issued only for a projection, adds the column indices to read, in order
/// (indices, not names: a ticket stays bounded by the schema's width). Tickets of all columns
/// stay format 2, so that they read the same on a server of either format.
const FORMAT_VERSION: u32 = 2;
const PROJECTED_FORMAT_VERSION: u32 = 3;

/// What a ticket asks `DoGet` for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TicketRequest {
    /// The whole current version of a dataset (a bare name).
    Whole { name: String },
    /// Rows of one version of a dataset (a server-issued ticket), encoded as its
    /// `GetFlightInfo` asked.
    Rows {
        name: String,
        version: Version,
        rows: Range<u64>,
        options: ReadOptions,
        /// Schema positions of the columns to read, in order; `None` reads them all.
        columns: Option<Vec<usize>>,
    },
}

impl TicketRequest {
    /// The dataset the ticket names.
    pub fn name(&self) -> &str {
        match self {
            Self::Whole { name } | Self::Rows { name, .. } => name,
        }
    }
}

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct TicketBody {
    name: String,
    version: u64,
    tag: u64,
    start: u64,
    end: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    compression: Option<super::descriptor::Compression>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    columns: Option<Vec<usize>>,
}

/// Encodes a server-issued ticket; `columns` is a projection already checked against the
/// dataset's schema.
pub fn encode(
    name: &str,
    version: Version,
    rows: Range<u64>,
    options: ReadOptions,
    columns: Option<&[usize]>,
) -> Bytes {
    let body = TicketBody {
        name: name.to_owned(),
        version: version.number,
        tag: version.tag,
        start: rows.start,
        end: rows.end,
        compression: options.compression,
        columns: columns.map(<[usize]>::to_vec),
    };
    let format = match columns {
        None => FORMAT_VERSION,
        Some(_) => PROJECTED_FORMAT_VERSION,
    };
    let mut ticket = format!("{}{format}\n", String::from_utf8_lossy(MAGIC)).into_bytes();
    // Serializing a struct of strings and integers cannot fail.
    ticket.extend(serde_json::to_vec(&body).unwrap_or_default());
    Bytes::from(ticket)
}

/// Decodes a ticket: a server-issued one, or a bare dataset name.
pub fn decode(ticket: &[u8]) -> Result<TicketRequest, Error> {
    let Some(rest) = ticket.strip_prefix(MAGIC) else {
        return parse_name(ticket)
            .map(|name| TicketRequest::Whole { name })
            .map_err(|e| {
                Error::InvalidTicket(format!(
                    "a ticket is either one issued by GetFlightInfo or a dataset name ({e})"
                ))
            });
    };
    let newline = rest.iter().position(|&b| b == b'\n');
    let (version, body) = match newline {
        Some(at) => (&rest[..at], &rest[at + 1..]),
        None => return Err(Error::InvalidTicket("truncated ticket".to_owned())),
    };
    if version == b"1" {
        // Issued before an upgrade: its version cannot be told from a later one of the name.
        #[derive(serde::Deserialize)]
        struct Untagged {
            name: String,
        }
        return match serde_json::from_slice::<Untagged>(body) {
            Ok(Untagged { name }) => Err(StoreError::ForeignTicket { name }.into()),
            Err(e) => Err(Error::InvalidTicket(format!("corrupt ticket: {e}"))),
        };
    }
    let projected = version == PROJECTED_FORMAT_VERSION.to_string().as_bytes();
    if version != FORMAT_VERSION.to_string().as_bytes() && !projected {
        return Err(Error::InvalidTicket(format!(
            "ticket format {} is not supported by this server (it issues format {FORMAT_VERSION}); \
             call GetFlightInfo for a fresh ticket",
            String::from_utf8_lossy(version)
        )));
    }
    let body: TicketBody = serde_json::from_slice(body)
        .map_err(|e| Error::InvalidTicket(format!("corrupt ticket: {e}")))?;
    if body.start > body.end {
        return Err(Error::InvalidTicket(format!(
            "corrupt ticket: row range {}..{} is reversed",
            body.start, body.end
        )));
    }
    // Format 2 has no projection, format 3 always one; which columns exist is checked
    // against the dataset when the ticket is read.
    match (&body.columns, projected) {
        (None, false) => {}
        (Some(columns), true) if !columns.is_empty() => {}
        _ => {
            return Err(Error::InvalidTicket(
                "corrupt ticket: its columns".to_owned(),
            ));
        }
    }
    Ok(TicketRequest::Rows {
        name: parse_name(body.name.as_bytes())?,
        version: Version {
            number: body.version,
            tag: body.tag,
        },
        rows: body.start..body.end,
        options: ReadOptions {
            compression: body.compression,
        },
        columns: body.columns,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issued_tickets_round_trip() {
        for options in [
            ReadOptions::default(),
            ReadOptions {
                compression: Some(super::super::descriptor::Compression::Lz4),
            },
        ] {
            let version = Version { number: 7, tag: 42 };
            for columns in [None, Some(vec![2, 0])] {
                let ticket = encode("trips", version, 10..20, options, columns.as_deref());
                let format = if columns.is_some() { b'3' } else { b'2' };
                assert_eq!(ticket[MAGIC.len()], format, "all columns stay format 2");
                assert_eq!(
                    decode(&ticket).expect("valid"),
                    TicketRequest::Rows {
                        name: "trips".to_owned(),
                        version,
                        rows: 10..20,
                        options,
                        columns,
                    }
                );
            }
        }
    }

    #[test]
    fn projections_belong_to_format_3_only() {
        for bad in [
            &b"\0gpu-flight-ticket/2\n{\"name\":\"t\",\"version\":1,\"tag\":2,\"start\":0,\"end\":1,\"columns\":[0]}"[..],
            b"\0gpu-flight-ticket/3\n{\"name\":\"t\",\"version\":1,\"tag\":2,\"start\":0,\"end\":1}",
            b"\0gpu-flight-ticket/3\n{\"name\":\"t\",\"version\":1,\"tag\":2,\"start\":0,\"end\":1,\"columns\":[]}",
            b"\0gpu-flight-ticket/3\n{\"name\":\"t\",\"version\":1,\"tag\":2,\"start\":0,\"end\":1,\"columns\":[-1]}",
        ] {
            assert!(
                matches!(decode(bad), Err(Error::InvalidTicket(_))),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn bare_names_are_whole_datasets() {
        assert_eq!(
            decode(b"trips").expect("valid"),
            TicketRequest::Whole {
                name: "trips".to_owned()
            }
        );
    }

    #[test]
    fn corrupt_tickets_are_rejected() {
        let version = Version { number: 7, tag: 42 };
        let mut ticket = encode("trips", version, 10..20, ReadOptions::default(), None).to_vec();
        ticket.truncate(ticket.len() - 3);
        for bad in [
            ticket,
            b"\0gpu-flight-ticket/9\n{}".to_vec(),
            b"\0gpu-flight-ticket/2".to_vec(),
            b"".to_vec(),
            b"\x01x".to_vec(),
        ] {
            assert!(
                matches!(decode(&bad), Err(Error::InvalidTicket(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn tickets_of_the_untagged_format_are_not_found() {
        let old =
            b"\0gpu-flight-ticket/1\n{\"name\":\"trips\",\"version\":7,\"start\":0,\"end\":3}";
        assert!(matches!(
            decode(old),
            Err(Error::Store(StoreError::ForeignTicket { name })) if name == "trips"
        ));
    }
}
