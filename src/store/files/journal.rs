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
//!
//! This file owns the record format, reading and replaying the journal at open, and the open
//! journal ([`Journal`]): appending records, and when a checkpoint is due.

use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::change::{Change, apply, effect};
use super::error::{Failed, FilesError, corrupt, io_error};
use super::fs::{Fs, private_file, sync_dir};
use super::layout::{JOURNAL, MANIFEST};
use super::manifest::Manifest;

/// A journal is folded into a new checkpoint once it is longer than the checkpoint and than
/// this: writing checkpoints then costs at most what appending the records did, and replaying
/// the journal at open stays short.
pub(super) const JOURNAL_BYTES: u64 = 64 << 10;

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
    /// The number of the last whole record.
    pub(super) last: Option<u64>,
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
    replay.last = replay.records.last().map(|r| r.seq);
    Ok(replay)
}

/// Applies the journal's `records` after the checkpoint's last, `sequence`, to `catalog`.
pub(super) fn replay(
    catalog: &mut Manifest,
    sequence: u64,
    records: Vec<Record>,
) -> Result<(), String> {
    let mut previous: Option<u64> = None;
    for record in records {
        match previous {
            Some(previous) if Some(record.seq) != previous.checked_add(1) => {
                return Err(format!("record {} follows record {previous}", record.seq));
            }
            None if record.seq > sequence.saturating_add(1) => {
                return Err(format!(
                    "its first record is number {}, but {MANIFEST} ends at {sequence}",
                    record.seq
                ));
            }
            _ => {}
        }
        previous = Some(record.seq);
        // Written before the checkpoint that holds it; the journal was not emptied yet.
        if record.seq <= sequence {
            continue;
        }
        effect(&catalog.datasets, &record.change)
            .map_err(|reason| format!("record {}: {reason}", record.seq))?;
        apply(&mut catalog.datasets, record.change);
    }
    Ok(())
}

/// The journal file, open for appending.
#[derive(Debug)]
pub(super) struct Journal {
    path: PathBuf,
    file: File,
    /// Where the last record ends.
    len: u64,
    /// The sequence number of the next record; the checkpoint includes every one before.
    next: u64,
    /// The size of the checkpoint in force.
    checkpoint_bytes: u64,
    /// The journal's end is unknown (an append failed and could not be cut back, or a
    /// checkpoint could not empty it), so no record may follow it: the next commit writes a
    /// checkpoint.
    checkpoint_due: bool,
}

impl Journal {
    /// Opens the journal of `root` (creating it) after the checkpoint, which includes records
    /// up to `sequence` and is `checkpoint_bytes` long, and `replay`, whose records were
    /// applied: cuts off a torn last record, and records the checkpoint holds already.
    pub(super) fn open(
        fs: &Fs,
        root: &Path,
        replay: &Replay,
        sequence: u64,
        checkpoint_bytes: u64,
    ) -> Result<Self, FilesError> {
        let path = root.join(JOURNAL);
        let file = private_file()
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)
            .map_err(io_error(&path, "opening"))?;
        if !replay.exists {
            sync_dir(root)?;
        }
        // A torn last record was never acknowledged; records the checkpoint holds are spent.
        let stale = replay.last.is_none_or(|last| last <= sequence);
        let keep = if stale { 0 } else { replay.end };
        if replay.len != keep {
            fs.truncate(&file, keep)
                .map_err(io_error(&path, "cutting off the torn end of"))?;
        }
        Ok(Self {
            path,
            file,
            len: keep,
            next: replay.last.unwrap_or(0).max(sequence) + 1,
            checkpoint_bytes,
            checkpoint_due: false,
        })
    }

    /// The last record numbered so far: a checkpoint written now includes it.
    pub(super) fn last(&self) -> u64 {
        self.next - 1
    }

    /// Whether anything is not in the checkpoint yet.
    pub(super) fn holds_changes(&self) -> bool {
        self.len > 0 || self.checkpoint_due
    }

    /// Whether the next commit writes a checkpoint rather than a record: the journal
    /// outgrew the checkpoint, or its end is unknown.
    pub(super) fn checkpoint_due(&self) -> bool {
        self.checkpoint_due || self.len > self.checkpoint_bytes.max(JOURNAL_BYTES)
    }

    /// Appends `change` as the next record and fsyncs it; returns the record.
    pub(super) fn append(&mut self, fs: &Fs, change: Change) -> Result<Record, Failed> {
        let record = Record {
            seq: self.next,
            change,
        };
        let bytes = encode(&record)
            .map_err(|e| Failed::not_in_force(io_error(&self.path, "encoding")(e.into())))?;
        let written = fs
            .append(&mut self.file, self.len, &bytes)
            .and_then(|()| fs.sync(&self.file));
        if let Err(e) = written {
            let error = io_error(&self.path, "appending to")(e);
            // Cut back, the record is gone for certain, and its number is free again.
            if fs.truncate(&self.file, self.len).is_ok() {
                return Err(Failed::not_in_force(error));
            }
            self.next += 1;
            self.checkpoint_due = true;
            return Err(Failed {
                error,
                maybe_in_force: true,
            });
        }
        self.len += bytes.len() as u64;
        self.next += 1;
        Ok(record)
    }

    /// A checkpoint failed where it may be in force: no record may follow the journal until
    /// one is written.
    pub(super) fn checkpoint_failed(&mut self) {
        self.checkpoint_due = true;
    }

    /// A checkpoint of `checkpoint_bytes` holding every record is in force: empties the
    /// journal, as keeping records only repeats the checkpoint.
    pub(super) fn checkpointed(&mut self, fs: &Fs, checkpoint_bytes: u64) {
        self.checkpoint_bytes = checkpoint_bytes;
        match fs.truncate(&self.file, 0) {
            Ok(()) => {
                self.len = 0;
                self.checkpoint_due = false;
            }
            Err(error) => {
                tracing::warn!(path = %self.path.display(), %error,
                    "could not empty the journal; the next commit writes a checkpoint again");
                self.checkpoint_due = true;
            }
        }
    }

    /// Makes the next commit write a checkpoint rather than a record.
    #[cfg(test)]
    pub(super) fn checkpoint_next(&mut self) {
        self.checkpoint_due = true;
    }
}
