//! The journal: the catalog's changes since its checkpoint (`manifest.json`), so that a commit
//! writes what it changes rather than the whole catalog.
//!
//! Each commit appends one record and fsyncs it:
//!
//! ```text
//! length: u32 LE | crc32: u32 LE (of the payload) | payload: JSON {"seq": n, "change": ...}
//! ```
//!
//! Sequence numbers count up by one from record to record; the checkpoint records the last
//! one it includes, so records it already holds are skipped when the journal is replayed (a
//! crash between writing a checkpoint and emptying the journal applies nothing twice).
//!
//! A crash mid-append leaves at most the last record short or torn, and that record was never
//! acknowledged: replay stops there and open cuts it off. A bad record with a good one after it
//! is no torn append but damage, and the directory is refused, naming the journal.

use std::fs;
use std::io;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::{Change, FilesError, corrupt, io_error};

/// The journal's file name in the data directory.
pub(super) const JOURNAL: &str = "journal";

/// The length and checksum before each payload.
const HEADER: usize = 8;

/// One journal record.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Record {
    pub(super) seq: u64,
    pub(super) change: Change,
}

/// What the journal holds, as open found it.
#[derive(Debug, Default)]
pub(super) struct Replay {
    pub(super) records: Vec<Record>,
    /// Where the last whole record ends: the journal's length once a torn tail is cut off.
    pub(super) end: u64,
    /// The file's length: more than `end` where a torn record follows the last whole one.
    pub(super) len: u64,
    pub(super) exists: bool,
}

/// `record` as the journal holds it.
pub(super) fn encode(record: &Record) -> Result<Vec<u8>, serde_json::Error> {
    let payload = serde_json::to_vec(record)?;
    let length = u32::try_from(payload.len()).map_err(|_| {
        <serde_json::Error as serde::ser::Error>::custom("a journal record over 4 GiB")
    })?;
    let mut bytes = Vec::with_capacity(HEADER + payload.len());
    bytes.extend_from_slice(&length.to_le_bytes());
    bytes.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    bytes.extend_from_slice(&payload);
    Ok(bytes)
}

/// Why the bytes at an offset are not a whole record.
enum Bad {
    /// The file ends inside it, or its checksum fails: what a crash mid-append leaves.
    Torn(&'static str),
    /// Its checksum holds, yet it is no record this code wrote.
    Invalid(String),
}

/// The record at `at` in `data`, and where it ends.
fn record_at(data: &[u8], at: usize) -> Result<(Record, usize), Bad> {
    let payload = whole_at(data, at)?;
    let record = serde_json::from_slice(payload)
        .map_err(|e| Bad::Invalid(format!("the record at byte {at} does not parse: {e}")))?;
    Ok((record, at + HEADER + payload.len()))
}

/// The payload of the record at `at`, if it is whole and its checksum holds.
fn whole_at(data: &[u8], at: usize) -> Result<&[u8], Bad> {
    let rest = &data[at..];
    let (Some(length), Some(checksum)) = (rest.get(..4), rest.get(4..HEADER)) else {
        return Err(Bad::Torn("short"));
    };
    let length = u32::from_le_bytes(length.try_into().unwrap_or_default()) as usize;
    let checksum = u32::from_le_bytes(checksum.try_into().unwrap_or_default());
    let payload = rest
        .get(HEADER..)
        .and_then(|rest| rest.get(..length))
        .ok_or(Bad::Torn("short"))?;
    // An empty payload is no record: a zero-filled tail (a file grown before its data was
    // written) would otherwise pass, as the CRC-32 of nothing is 0.
    if payload.is_empty() || crc32fast::hash(payload) != checksum {
        return Err(Bad::Torn("torn"));
    }
    Ok(payload)
}

/// Reads the journal at `path` (none is an empty one).
pub(super) fn read(path: &Path) -> Result<Replay, FilesError> {
    let data = match fs::read(path) {
        Ok(data) => data,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Replay::default()),
        Err(e) => return Err(io_error(path, "reading")(e)),
    };
    let mut replay = Replay {
        len: data.len() as u64,
        exists: true,
        ..Replay::default()
    };
    let mut at = 0;
    while at < data.len() {
        match record_at(&data, at) {
            Ok((record, end)) => {
                replay.records.push(record);
                at = end;
            }
            Err(Bad::Invalid(reason)) => return Err(corrupt(path, reason)),
            Err(Bad::Torn(what)) => {
                // Only the last append can be torn; a whole record after this one means this
                // one was damaged after it was written.
                if let Some(next) = (at + 1..data.len()).find(|&q| whole_at(&data, q).is_ok()) {
                    return Err(corrupt(
                        path,
                        format!(
                            "the record at byte {at} is {what}, yet a whole record follows at \
                             byte {next}"
                        ),
                    ));
                }
                break;
            }
        }
    }
    replay.end = at as u64;
    Ok(replay)
}
