//! The durable on-disk layout of the catalog: segment files, and the checkpoint and journal
//! that name them.
//!
//! A data directory holds
//!
//! ```text
//! DIR/LOCK                       held with an exclusive lock while a server uses DIR
//! DIR/manifest.json              the catalog's checkpoint: dataset names to versions and segments
//! DIR/journal                    the catalog's changes since the checkpoint, one record each
//! DIR/segments/seg-<id>.arrow    Arrow IPC *file* format, readable without the server
//! ```
//!
//! Segments are immutable and named by a counter, never by a dataset name: names are arbitrary
//! client strings (`/`, `..`, NUL, megabytes) and live only inside the catalog. A segment is
//! written under a temporary name, fsync'd, renamed into place and its directory fsync'd
//! before any record names it. A commit appends one record (a dataset set, appended to,
//! removed, or some of its segments merged) to the journal and fsyncs it, so that it costs what
//! it changes (see `journal`). Once the journal outgrows the checkpoint, a commit writes a new
//! checkpoint instead (temporary file, fsync, rename, directory fsync) and empties the journal.
//! A crash at any instant leaves the catalog as it was before a commit or after it, and the
//! catalog only ever names complete segments. What a crash can leave behind (temporary files,
//! segments nothing names, a torn last record) is removed by the next [`DataDir::open`], and
//! only after the catalog was read: an unreadable checkpoint or journal is an error, never an
//! empty catalog that would let the sweep delete data.
//!
//! The layer is blocking `std::fs` on purpose: the store calls it from one writer task through
//! `spawn_blocking`, and writes merged segments beside it ([`SegmentWriter`]). Every step that
//! changes the disk goes through [`Fs`], where tests inject faults (a failed or torn write,
//! fsync, rename, truncation or delete, or a crash from that step on).

mod journal;
mod segment;
mod steps;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{self, File, OpenOptions, TryLockError};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arrow::array::RecordBatch;
use arrow::datatypes::Schema;
#[cfg(test)]
use arrow::datatypes::SchemaRef;
use arrow::error::ArrowError;
use arrow::ipc::writer::FileWriter;
use serde::{Deserialize, Serialize};

use journal::{JOURNAL, Record};
pub(crate) use segment::{PinnedSegment, SegmentFiles};
use segment::{join, one_dictionary_per_field, parse_file_name, segment_name, segment_path};
#[cfg(test)]
pub(crate) use steps::FaultPlan;
use steps::{Fs, Tracked};

/// The manifest format this code writes and reads. Bump it when the manifest's meaning changes.
pub(crate) const MANIFEST_FORMAT: u32 = 1;

const LOCK: &str = "LOCK";
const MANIFEST: &str = "manifest.json";
const MANIFEST_TMP: &str = "manifest.json.tmp";
const SEGMENTS: &str = "segments";
const TMP_SUFFIX: &str = ".tmp";

/// A journal is folded into a new checkpoint once it is longer than the checkpoint and than
/// this: writing checkpoints then costs at most what appending the records did, and replaying
/// the journal at open stays short.
const JOURNAL_BYTES: u64 = 64 << 10;

/// The durable catalog: what [`DataDir::open`] returns and [`DataDir::commit`] changes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Manifest {
    pub(crate) datasets: BTreeMap<String, DatasetEntry>,
}

/// One dataset as committed: its version and, in order, the segments holding its rows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct DatasetEntry {
    pub(crate) version: u64,
    /// The version's random tag (see `store::Version`); absent in manifests written before
    /// versions had tags.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) tag: Option<u64>,
    pub(crate) segments: Vec<Segment>,
}

/// One immutable Arrow IPC file under `segments/`, as [`DataDir::write_segment`] made it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Segment {
    /// The file name inside `segments/`, `seg-<20-digit id>.arrow`.
    pub(crate) file: String,
    pub(crate) rows: u64,
    /// The file's size.
    pub(crate) bytes: u64,
    /// CRC-32 of the whole file.
    pub(crate) checksum: u32,
    /// Arrow bytes of its rows as they were written (0 in manifests written before this was
    /// recorded: the file's size stands in).
    #[serde(default)]
    pub(crate) data_bytes: u64,
}

/// One change to the catalog: what a commit makes durable, as one journal record. Entries
/// are recorded whole, so that every field of one comes back as it was committed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Change {
    /// `name` is `entry` now, whether it existed or not.
    Set { name: String, entry: DatasetEntry },
    /// `name`, which exists, is `entry` now, with `entry.segments` after the segments it had.
    Append { name: String, entry: DatasetEntry },
    /// `name` is gone.
    Remove { name: String },
    /// `name`'s segments from index `at`, which must be `run`, are `merged` now: the same
    /// rows, in the same order, in one file. Its entry is otherwise unchanged.
    Merge {
        name: String,
        at: usize,
        run: Vec<Segment>,
        merged: Segment,
    },
}

impl Change {
    fn name(&self) -> &str {
        match self {
            Change::Set { name, .. }
            | Change::Append { name, .. }
            | Change::Remove { name }
            | Change::Merge { name, .. } => name,
        }
    }
}

/// The segment files a change names that the catalog did not, and those the catalog named
/// that it does not any more.
#[derive(Debug, Default)]
struct Effect {
    added: Vec<Segment>,
    removed: Vec<Segment>,
}

/// What `change` does to `datasets`' files, or why it does not apply to them. Costs what the
/// change and the entry it changes hold.
fn effect(datasets: &BTreeMap<String, DatasetEntry>, change: &Change) -> Result<Effect, String> {
    let name = change.name();
    let current = datasets.get(name);
    let existing = || current.ok_or_else(|| format!("there is no dataset {name:?} to change"));
    let distinct = |segments: &[Segment]| {
        let mut seen = HashSet::new();
        match segments.iter().find(|s| !seen.insert(&s.file)) {
            Some(twice) => Err(format!("it names segment {:?} twice", twice.file)),
            None => Ok(()),
        }
    };
    match change {
        Change::Set { entry, .. } => {
            distinct(&entry.segments)?;
            let old: HashSet<&str> = current
                .iter()
                .flat_map(|e| &e.segments)
                .map(|s| s.file.as_str())
                .collect();
            let new: HashSet<&str> = entry.segments.iter().map(|s| s.file.as_str()).collect();
            Ok(Effect {
                added: (entry.segments.iter())
                    .filter(|s| !old.contains(s.file.as_str()))
                    .cloned()
                    .collect(),
                removed: (current.iter().flat_map(|e| &e.segments))
                    .filter(|s| !new.contains(s.file.as_str()))
                    .cloned()
                    .collect(),
            })
        }
        Change::Append { entry, .. } => {
            let old = existing()?;
            distinct(&entry.segments)?;
            if let Some(again) = (entry.segments.iter()).find(|s| old.segments.contains(s)) {
                return Err(format!("{name:?} names segment {:?} already", again.file));
            }
            Ok(Effect {
                added: entry.segments.clone(),
                removed: Vec::new(),
            })
        }
        Change::Remove { .. } => Ok(Effect {
            added: Vec::new(),
            removed: existing()?.segments.clone(),
        }),
        Change::Merge {
            at, run, merged, ..
        } => {
            let old = existing()?;
            let held = at
                .checked_add(run.len())
                .and_then(|end| old.segments.get(*at..end));
            if run.is_empty() || held != Some(run.as_slice()) {
                return Err(format!(
                    "{name:?} does not hold the {} segments merged at {at}",
                    run.len()
                ));
            }
            let rows = run.iter().fold(0u64, |sum, s| sum.saturating_add(s.rows));
            if merged.rows != rows || run.iter().any(|s| s.file == merged.file) {
                return Err(format!(
                    "the merge of {name:?}'s segments at {at} holds other rows"
                ));
            }
            Ok(Effect {
                added: vec![merged.clone()],
                removed: run.clone(),
            })
        }
    }
}

/// Makes `change`, for which [`effect`] held, in `datasets`.
fn apply(datasets: &mut BTreeMap<String, DatasetEntry>, change: Change) {
    match change {
        Change::Set { name, entry } => {
            datasets.insert(name, entry);
        }
        Change::Append { name, entry } => {
            if let Some(current) = datasets.get_mut(&name) {
                let mut segments = std::mem::take(&mut current.segments);
                segments.extend(entry.segments.iter().cloned());
                *current = DatasetEntry { segments, ..entry };
            }
        }
        Change::Remove { name } => {
            datasets.remove(&name);
        }
        Change::Merge {
            name,
            at,
            run,
            merged,
        } => {
            if let Some(current) = datasets.get_mut(&name) {
                current.segments.splice(at..at + run.len(), [merged]);
            }
        }
    }
}

/// The first line of `manifest.json`; the JSON manifest follows it. The checksum covers the
/// body's bytes exactly, so a torn or altered manifest cannot parse as a smaller catalog.
#[derive(Debug, Serialize, Deserialize)]
struct Header {
    format: u32,
    bytes: u64,
    crc32: u32,
    /// The last journal record the checkpoint includes (0 in manifests written before there
    /// was a journal, and before the first record).
    #[serde(default)]
    sequence: u64,
}

/// What can go wrong in the data directory. Every message names the file.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FilesError {
    #[error("{action} {}: {source}", path.display())]
    Io {
        path: PathBuf,
        action: &'static str,
        source: io::Error,
    },
    #[error("{action} {}: {source}", path.display())]
    Arrow {
        path: PathBuf,
        action: &'static str,
        source: ArrowError,
    },
    #[error("{} is corrupt: {reason}", path.display())]
    Corrupt { path: PathBuf, reason: String },
    #[error(
        "{} has manifest format {found}, but this server reads format {MANIFEST_FORMAT}; \
         it was written by another gpu-flight version",
        path.display()
    )]
    Format { path: PathBuf, found: u32 },
    #[error(
        "data directory {} is in use by another process (it holds the lock on {}); \
         give each server its own --data-dir",
        root.display(), lock.display()
    )]
    Locked { root: PathBuf, lock: PathBuf },
    #[error(
        "cannot commit a manifest naming segment {file:?}: it is not a complete segment file \
         of this data directory ({reason})"
    )]
    UnknownSegment { file: String, reason: String },
    /// A change that does not apply to the catalog as it is, such as a merge of segments a
    /// later commit replaced.
    #[error("cannot commit a change of {name:?} to the catalog: {reason}")]
    Inapplicable { name: String, reason: String },
}

fn io_error(path: &Path, action: &'static str) -> impl FnOnce(io::Error) -> FilesError {
    let path = path.to_path_buf();
    move |source| FilesError::Io {
        path,
        action,
        source,
    }
}

/// Arrow wraps the writer's I/O errors; unwrapping them keeps "No space left on device" plain.
fn arrow_error(path: &Path, action: &'static str) -> impl FnOnce(ArrowError) -> FilesError {
    let path = path.to_path_buf();
    move |error| match error {
        ArrowError::IoError(_, source) => FilesError::Io {
            path,
            action,
            source,
        },
        source => FilesError::Arrow {
            path,
            action,
            source,
        },
    }
}

fn corrupt(path: &Path, reason: impl Into<String>) -> FilesError {
    FilesError::Corrupt {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// `path` is corrupt: its `what` is `found`, but `by` records `recorded`.
fn differs(
    path: &Path,
    what: &str,
    found: impl std::fmt::Display,
    recorded: impl std::fmt::Display,
    by: &str,
) -> FilesError {
    corrupt(
        path,
        format!("its {what} is {found} but {by} records {recorded}"),
    )
}

fn crc(checksum: u32) -> String {
    format!("{checksum:#010x}")
}

/// A data directory opened by this process, holding its lock until dropped.
#[derive(Debug)]
pub(crate) struct DataDir {
    root: PathBuf,
    /// Closing the file releases the lock, so it lives as long as the `DataDir`.
    _lock: File,
    /// The catalog as the checkpoint and the journal make it.
    catalog: Manifest,
    /// Every segment file `catalog` names.
    named: HashMap<String, Segment>,
    /// Files `catalog` does not name that a catalog which may be in force does: those of a
    /// commit that failed where on disk it may have won. A checkpoint settles them.
    uncertain: BTreeMap<String, Segment>,
    /// Files no catalog in force names, not deleted yet: a version still being read pins
    /// them, or their deletion failed.
    unnamed: BTreeMap<String, Segment>,
    /// How many pins `files` had released when `unnamed` was last looked through whole.
    swept: u64,
    /// Datasets whose files failed the checks at open: kept (files too) until dropped or
    /// replaced, not served.
    damaged: BTreeMap<String, Damage>,
    /// Files that several datasets name, which only damaged ones do: removing one dataset's
    /// name for such a file deletes it only once no dataset names it.
    shared: HashSet<String>,
    journal: Journal,
    writer: Arc<SegmentWriter>,
    files: Arc<SegmentFiles>,
}

/// The journal file, open for appending.
#[derive(Debug)]
struct Journal {
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

/// Writes segment files: for the commits, and beside them for the background merges.
#[derive(Debug)]
pub(crate) struct SegmentWriter {
    segments: PathBuf,
    next_id: AtomicU64,
    fs: Fs,
}

/// A commit that failed, and whether what it wrote may be in force on disk all the same.
struct Failed {
    error: FilesError,
    maybe_in_force: bool,
}

impl Failed {
    fn not_in_force(error: FilesError) -> Self {
        Self {
            error,
            maybe_in_force: false,
        }
    }
}

impl DataDir {
    /// Opens (creating if absent) the data directory at `root`: locks it, reads the
    /// checkpoint (none yet is an empty catalog) and replays the journal onto it, checks
    /// every segment the catalog names is present and whole in size, then removes what an
    /// interrupted write left behind.
    pub(crate) fn open(root: &Path) -> Result<(DataDir, Manifest), FilesError> {
        let segments = root.join(SEGMENTS);
        let existed = root.is_dir();
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&segments)
            .map_err(io_error(&segments, "creating"))?;
        warn_if_shared(root);
        if !existed && let Some(parent) = root.parent() {
            let parent = if parent.as_os_str().is_empty() {
                Path::new(".")
            } else {
                parent
            };
            sync_dir(parent)?;
        }
        sync_dir(root)?;

        let lock_path = root.join(LOCK);
        let lock = private_file()
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io_error(&lock_path, "opening"))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                return Err(FilesError::Locked {
                    root: root.to_path_buf(),
                    lock: lock_path,
                });
            }
            Err(TryLockError::Error(e)) => return Err(io_error(&lock_path, "locking")(e)),
        }

        let journal_path = root.join(JOURNAL);
        let checkpoint = read_manifest(&root.join(MANIFEST))?;
        let replay = journal::read(&journal_path)?;
        let (mut catalog, sequence, checkpoint_bytes) = match checkpoint {
            Some(checkpoint) => checkpoint,
            None if replay.records.is_empty() => (Manifest::default(), 0, 0),
            // Open writes a checkpoint before any record: this one was lost.
            None => {
                return Err(corrupt(
                    &journal_path,
                    format!("it holds changes but there is no {MANIFEST} they follow"),
                ));
            }
        };
        let last_record = replay.records.last().map(|r| r.seq);
        replay_records(&mut catalog, sequence, replay.records)
            .map_err(|reason| corrupt(&journal_path, reason))?;
        let Checked {
            named,
            damaged,
            shared,
        } = check_segments(root, &segments, &catalog);

        // Only now, with the catalog known good, is anything deleted.
        remove_if_present(&root.join(MANIFEST_TMP))?;
        // Ids are never reused: not those of files on disk, nor of files a damaged dataset
        // names that are missing (a new file of that name would pass for the lost one).
        let next_id = sweep_segments(&segments, &named)?.max(
            named
                .keys()
                .filter_map(|file| parse_file_name(file))
                .map(|(id, _)| id.saturating_add(1))
                .max()
                .unwrap_or(0),
        );
        let journal_file = private_file()
            .truncate(false)
            .read(true)
            .write(true)
            .open(&journal_path)
            .map_err(io_error(&journal_path, "opening"))?;
        if !replay.exists {
            sync_dir(root)?;
        }
        let writer = Arc::new(SegmentWriter {
            segments: segments.clone(),
            next_id: AtomicU64::new(next_id),
            fs: Fs::default(),
        });
        // A torn last record was never acknowledged; records the checkpoint holds are spent.
        let stale = last_record.is_none_or(|last| last <= sequence);
        let keep = if stale { 0 } else { replay.end };
        if replay.len != keep {
            writer
                .fs
                .truncate(&journal_file, keep)
                .map_err(io_error(&journal_path, "cutting off the torn end of"))?;
        }
        let mut dir = DataDir {
            root: root.to_path_buf(),
            files: Arc::new(SegmentFiles::new(root.to_path_buf(), segments)),
            _lock: lock,
            catalog,
            named,
            uncertain: BTreeMap::new(),
            unnamed: BTreeMap::new(),
            swept: 0,
            damaged,
            shared,
            journal: Journal {
                path: journal_path,
                file: journal_file,
                len: keep,
                next: last_record.unwrap_or(0).max(sequence) + 1,
                checkpoint_bytes,
                checkpoint_due: false,
            },
            writer,
        };
        if checkpoint_bytes == 0 {
            // Records follow a checkpoint, so a new directory starts with one.
            dir.write_checkpoint().map_err(|failed| failed.error)?;
        }
        let opened = dir.catalog.clone();
        Ok((dir, opened))
    }

    /// The data directory, for messages and status.
    pub(crate) fn root(&self) -> &Path {
        &self.root
    }

    /// The catalog as committed.
    pub(crate) fn catalog(&self) -> &Manifest {
        &self.catalog
    }

    /// Datasets of the catalog whose files failed the checks at open, by name. They stay in
    /// the catalog (and their files on disk) until they are dropped or replaced.
    pub(crate) fn damaged(&self) -> &BTreeMap<String, Damage> {
        &self.damaged
    }

    /// Its segment files, for reading datasets as they are needed.
    pub(crate) fn segment_files(&self) -> Arc<SegmentFiles> {
        Arc::clone(&self.files)
    }

    /// What writes its segment files, for writing them beside the commits.
    pub(crate) fn segment_writer(&self) -> Arc<SegmentWriter> {
        Arc::clone(&self.writer)
    }

    /// Writes `batches` (all of `schema`; none keeps just the schema) as a new segment file.
    /// Nothing names it until a change that includes it is committed.
    pub(crate) fn write_segment(
        &mut self,
        schema: &Schema,
        batches: &[RecordBatch],
    ) -> Result<Segment, FilesError> {
        self.writer.write(schema, batches)
    }

    /// Reads a segment back after checking its size and checksum against `segment`.
    #[cfg(test)]
    pub(crate) fn read_segment(
        &self,
        segment: &Segment,
    ) -> Result<(SchemaRef, Vec<RecordBatch>), FilesError> {
        self.files.read(segment)
    }

    /// Makes `change` durable, then deletes the segment files no catalog that may be in
    /// force names any more. An error leaves the catalog as it was, on disk too, unless it
    /// came at or after the step that makes the change durable: then the next open finds one
    /// or the other.
    pub(crate) fn commit(&mut self, change: Change) -> Result<(), FilesError> {
        let name = change.name().to_owned();
        let effect =
            effect(&self.catalog.datasets, &change).map_err(|reason| FilesError::Inapplicable {
                name: name.clone(),
                reason,
            })?;
        for segment in &effect.added {
            self.check_new(segment)?;
        }
        let checkpoint = self.journal.checkpoint_due
            || self.journal.len > self.journal.checkpoint_bytes.max(JOURNAL_BYTES);
        // From here on what the change names may be in force, until it is known not to be.
        let mut unsettled = Vec::new();
        for segment in &effect.added {
            if let Some(was) = self.uncertain.insert(segment.file.clone(), segment.clone()) {
                unsettled.push(was);
            }
        }
        let result = if checkpoint {
            let previous = self.catalog.datasets.get(&name).cloned();
            apply(&mut self.catalog.datasets, change);
            let result = self.write_checkpoint();
            if result.is_err() {
                match previous {
                    Some(previous) => self.catalog.datasets.insert(name.clone(), previous),
                    None => self.catalog.datasets.remove(&name),
                };
            }
            result
        } else {
            self.append_record(change)
        };
        if let Err(failed) = result {
            if !failed.maybe_in_force {
                for segment in &effect.added {
                    self.uncertain.remove(&segment.file);
                }
                for was in unsettled {
                    self.uncertain.insert(was.file.clone(), was);
                }
            }
            return Err(failed.error);
        }
        for segment in effect.added {
            self.uncertain.remove(&segment.file);
            self.unnamed.remove(&segment.file);
            self.named.insert(segment.file.clone(), segment);
        }
        self.damaged.remove(&name);
        let mut fresh: Vec<String> = Vec::new();
        for segment in effect.removed {
            // A damaged dataset's entry may name what is not ours to delete, or a file
            // another dataset names too.
            if segment_path(&self.writer.segments, &segment.file).is_err() {
                continue;
            }
            if self.shared.contains(&segment.file) {
                let named_elsewhere = (self.catalog.datasets.values())
                    .flat_map(|d| &d.segments)
                    .any(|s| s.file == segment.file);
                if named_elsewhere {
                    continue;
                }
                self.shared.remove(&segment.file);
            }
            self.named.remove(&segment.file);
            fresh.push(segment.file.clone());
            self.unnamed.insert(segment.file.clone(), segment);
        }
        if checkpoint {
            // The new checkpoint is in force, and no other catalog can come back.
            for (file, segment) in std::mem::take(&mut self.uncertain) {
                if !self.named.contains_key(&file) {
                    fresh.push(file.clone());
                    self.unnamed.insert(file, segment);
                }
            }
        }
        self.delete_unnamed(fresh, checkpoint);
        Ok(())
    }

    /// Folds the journal into a new checkpoint, if it holds anything: for a clean shutdown,
    /// after which `manifest.json` alone describes the directory.
    pub(crate) fn checkpoint(&mut self) -> Result<(), FilesError> {
        if self.journal.len == 0 && !self.journal.checkpoint_due {
            return Ok(());
        }
        self.write_checkpoint().map_err(|failed| failed.error)?;
        let mut fresh = Vec::new();
        for (file, segment) in std::mem::take(&mut self.uncertain) {
            if !self.named.contains_key(&file) {
                fresh.push(file.clone());
                self.unnamed.insert(file, segment);
            }
        }
        self.delete_unnamed(fresh, true);
        Ok(())
    }

    /// Checks that a segment a change is to name is a complete file of this directory that
    /// nothing names yet.
    fn check_new(&self, segment: &Segment) -> Result<(), FilesError> {
        let unknown = |reason: String| FilesError::UnknownSegment {
            file: segment.file.clone(),
            reason,
        };
        if let Some(known) = self.named.get(&segment.file) {
            return Err(unknown(format!(
                "the catalog names it already as {known:?}"
            )));
        }
        match self.uncertain.get(&segment.file) {
            Some(known) if known == segment => Ok(()),
            Some(known) => Err(unknown(format!(
                "a catalog that may be in force records it as {known:?}"
            ))),
            // The checksum was taken as the file was written, so a stat is check enough.
            None => {
                let path = segment_path(&self.writer.segments, &segment.file).map_err(unknown)?;
                check_size(&path, segment).map_err(|e| unknown(e.to_string()))
            }
        }
    }

    /// Appends `change` to the journal as its next record and applies it to the catalog.
    fn append_record(&mut self, change: Change) -> Result<(), Failed> {
        let journal = &mut self.journal;
        let fs = &self.writer.fs;
        let record = Record {
            seq: journal.next,
            change,
        };
        let bytes = journal::encode(&record)
            .map_err(|e| Failed::not_in_force(io_error(&journal.path, "encoding")(e.into())))?;
        let written = fs
            .append(&mut journal.file, journal.len, &bytes)
            .and_then(|()| fs.sync(&journal.file));
        if let Err(e) = written {
            let error = io_error(&journal.path, "appending to")(e);
            // Cut back, the record is gone for certain, and its number is free again.
            if fs.truncate(&journal.file, journal.len).is_ok() {
                return Err(Failed::not_in_force(error));
            }
            journal.next += 1;
            journal.checkpoint_due = true;
            return Err(Failed {
                error,
                maybe_in_force: true,
            });
        }
        journal.len += bytes.len() as u64;
        journal.next += 1;
        apply(&mut self.catalog.datasets, record.change);
        Ok(())
    }

    /// Writes the catalog as the new checkpoint, including every record numbered so far, and
    /// empties the journal.
    fn write_checkpoint(&mut self) -> Result<(), Failed> {
        let tmp = self.root.join(MANIFEST_TMP);
        let path = self.root.join(MANIFEST);
        let fs = &self.writer.fs;
        let text = encode_manifest(&self.catalog, self.journal.next - 1)
            .map_err(|e| Failed::not_in_force(io_error(&tmp, "encoding")(e.into())))?;
        if let Err(error) = write_file(fs, &tmp, &text) {
            let _ = fs.remove(&tmp);
            return Err(Failed::not_in_force(error));
        }
        let in_place = fs
            .rename(&tmp, &path)
            .map_err(io_error(&tmp, "renaming into place"))
            .and_then(|()| fs.sync_dir(&self.root));
        if let Err(error) = in_place {
            self.journal.checkpoint_due = true;
            return Err(Failed {
                error,
                maybe_in_force: true,
            });
        }
        self.journal.checkpoint_bytes = text.len() as u64;
        // The checkpoint holds every record, so a journal that keeps some only repeats it.
        match fs.truncate(&self.journal.file, 0) {
            Ok(()) => {
                self.journal.len = 0;
                self.journal.checkpoint_due = false;
            }
            Err(error) => {
                tracing::warn!(path = %self.journal.path.display(), %error,
                    "could not empty the journal; the next commit writes a checkpoint again");
                self.journal.checkpoint_due = true;
            }
        }
        Ok(())
    }

    /// Deletes the files of `unnamed` that no version being read pins: `fresh`, or all of
    /// them where pins were released since they were last looked through (or with `all`).
    /// The deletions need no fsync: a file a crash brings back is unnamed, and open sweeps it.
    fn delete_unnamed(&mut self, fresh: Vec<String>, all: bool) {
        let released = self.files.released();
        let files = if all || released != self.swept {
            self.swept = released;
            self.unnamed.keys().cloned().collect()
        } else {
            fresh
        };
        for file in files {
            // Still to be loaded by a dataset version being read: deleted once it is done.
            if self.files.is_pinned(&file) || self.named.contains_key(&file) {
                continue;
            }
            let path = self.writer.segments.join(&file);
            match self.writer.fs.remove(&path) {
                Err(error) if error.kind() != io::ErrorKind::NotFound => {
                    tracing::warn!(path = %path.display(), %error,
                        "could not delete a segment file nothing names; the next start removes it");
                }
                _ => {
                    self.unnamed.remove(&file);
                }
            }
        }
    }

    /// Deletes a segment written for a change that will not be committed. A file a catalog
    /// that may be in force names is kept.
    pub(crate) fn discard(&mut self, segment: &Segment) -> Result<(), FilesError> {
        if self.named.contains_key(&segment.file)
            || self.uncertain.contains_key(&segment.file)
            || self.unnamed.contains_key(&segment.file)
        {
            return Ok(());
        }
        let path = segment_path(&self.writer.segments, &segment.file).map_err(|reason| {
            FilesError::UnknownSegment {
                file: segment.file.clone(),
                reason,
            }
        })?;
        match self.writer.fs.remove(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_error(&path, "deleting")(e)),
            _ => Ok(()),
        }
    }

    /// Makes the `plan.step`-th file-system step from now on fail (see [`FaultPlan`]).
    #[cfg(test)]
    pub(crate) fn inject(&mut self, plan: FaultPlan) {
        self.writer.fs.inject(plan);
    }

    /// Whether the injected fault happened.
    #[cfg(test)]
    pub(crate) fn fault_fired(&self) -> bool {
        self.writer.fs.fired()
    }

    /// Makes the next commit write a checkpoint rather than a journal record.
    #[cfg(test)]
    pub(crate) fn checkpoint_next(&mut self) {
        self.journal.checkpoint_due = true;
    }
}

impl SegmentWriter {
    /// Writes `batches` (all of `schema`; none keeps just the schema) as a new segment file.
    pub(crate) fn write(
        &self,
        schema: &Schema,
        batches: &[RecordBatch],
    ) -> Result<Segment, FilesError> {
        let file = segment_name(self.next_id.fetch_add(1, Ordering::Relaxed));
        let path = self.segments.join(&file);
        let tmp = self.segments.join(format!("{file}{TMP_SUFFIX}"));
        // Arrow's writer does not check batches against the schema it was given.
        if let Some(batch) = batches
            .iter()
            .find(|b| b.schema_ref().fields() != schema.fields())
        {
            return Err(FilesError::Arrow {
                path,
                action: "writing",
                source: ArrowError::SchemaError(format!(
                    "a batch has schema {} but the segment's is {schema}",
                    batch.schema_ref()
                )),
            });
        }
        let batches =
            one_dictionary_per_field(schema, batches).map_err(|source| FilesError::Arrow {
                path: path.clone(),
                action: "merging the dictionaries of",
                source,
            })?;
        match self.write_new(&tmp, &path, schema, &batches) {
            Ok((bytes, checksum)) => Ok(Segment {
                file,
                rows: batches.iter().map(|b| b.num_rows() as u64).sum(),
                bytes,
                checksum,
                data_bytes: batches.iter().map(crate::arrays::batch_bytes).sum(),
            }),
            Err(e) => {
                // Best effort: whatever remains is unnamed, and the next open sweeps it.
                let _ = self.fs.remove(&tmp);
                let _ = self.fs.remove(&path);
                Err(e)
            }
        }
    }

    fn write_new(
        &self,
        tmp: &Path,
        path: &Path,
        schema: &Schema,
        batches: &[RecordBatch],
    ) -> Result<(u64, u32), FilesError> {
        let file = self.fs.create(tmp).map_err(io_error(tmp, "creating"))?;
        let mut writer = FileWriter::try_new_buffered(Tracked::new(file, &self.fs), schema)
            .map_err(arrow_error(tmp, "writing"))?;
        for batch in batches {
            writer.write(batch).map_err(arrow_error(tmp, "writing"))?;
        }
        let tracked = writer
            .into_inner()
            .map_err(arrow_error(tmp, "writing"))?
            .into_inner()
            .map_err(|e| io_error(tmp, "writing")(e.into_error()))?;
        let checksum = tracked.hasher.finalize();
        self.fs
            .sync(&tracked.file)
            .map_err(io_error(tmp, "syncing"))?;
        drop(tracked.file);
        self.fs
            .rename(tmp, path)
            .map_err(io_error(tmp, "renaming into place"))?;
        self.fs.sync_dir(&self.segments)?;
        Ok((tracked.bytes, checksum))
    }

    /// Writes the rows of `run`, in order, as one new segment (its batches joined into one):
    /// what replaces a run of small segments. Each is checked against its checksum and the
    /// rows it records as it is read.
    pub(crate) fn merge(&self, run: &[PinnedSegment]) -> Result<Segment, FilesError> {
        let mut schema = None;
        let mut batches = Vec::new();
        for pinned in run {
            let segment = pinned.segment();
            let path = self.segments.join(&segment.file);
            let (found, read) = pinned.read()?;
            let rows = read.iter().fold(0u64, |sum, b| sum + b.num_rows() as u64);
            if rows != segment.rows {
                return Err(differs(
                    &path,
                    "row count",
                    rows,
                    segment.rows,
                    "the catalog",
                ));
            }
            match &schema {
                None => schema = Some(found),
                Some(first) if first.fields() != found.fields() => {
                    return Err(corrupt(
                        &path,
                        format!("its schema is {found}, but the segment before it has {first}"),
                    ));
                }
                Some(_) => {}
            }
            batches.extend(read);
        }
        let schema = schema.ok_or_else(|| FilesError::Inapplicable {
            name: String::new(),
            reason: "a merge of no segments".to_owned(),
        })?;
        let joined = join(&schema, &batches).map_err(|source| FilesError::Arrow {
            path: self.segments.clone(),
            action: "joining the batches of a merge in",
            source,
        })?;
        self.write(&schema, &joined)
    }
}

/// Applies the journal's `records` after the checkpoint's last, `sequence`, to `catalog`.
fn replay_records(
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

/// Why a dataset's files cannot be served, naming the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Damage {
    pub(crate) reason: String,
}

/// What [`check_segments`] found.
struct Checked {
    /// Every segment file the catalog names that is ours (damaged datasets' included, so
    /// that they are kept), by file name.
    named: HashMap<String, Segment>,
    damaged: BTreeMap<String, Damage>,
    /// Files more than one dataset names.
    shared: HashSet<String>,
}

/// Checks every segment `catalog` names: a name of ours (never a path elsewhere), present,
/// of the recorded size, and named by one dataset only. A dataset that fails is damaged; its
/// files are kept, and every other dataset is served.
fn check_segments(root: &Path, segments: &Path, catalog: &Manifest) -> Checked {
    let mut named = HashMap::new();
    let mut damaged: BTreeMap<String, Damage> = BTreeMap::new();
    let mut shared = HashSet::new();
    let mut owners: HashMap<&str, &str> = HashMap::new();
    for (name, entry) in &catalog.datasets {
        let mut reason = None;
        for segment in &entry.segments {
            let path = match segment_path(segments, &segment.file) {
                Ok(path) => path,
                Err(why) => {
                    reason.get_or_insert_with(|| corrupt(&root.join(MANIFEST), why).to_string());
                    continue;
                }
            };
            if let Err(error) = check_size(&path, segment) {
                reason.get_or_insert_with(|| error.to_string());
            }
            if let Some(other) = owners.insert(&segment.file, name)
                && other != name
            {
                let why = format!(
                    "segment {:?} is named by datasets {other:?} and {name:?}",
                    segment.file
                );
                let why = corrupt(&root.join(MANIFEST), why).to_string();
                damaged.insert(
                    other.to_owned(),
                    Damage {
                        reason: why.clone(),
                    },
                );
                reason = Some(why);
                shared.insert(segment.file.clone());
            }
            named
                .entry(segment.file.clone())
                .or_insert_with(|| segment.clone());
        }
        if let Some(reason) = reason {
            damaged.insert(name.clone(), Damage { reason });
        }
    }
    Checked {
        named,
        damaged,
        shared,
    }
}

/// Options that create a file only the server's user may read or write (dataset names and
/// rows are in these files); the caller adds the access it needs.
pub(super) fn private_file() -> OpenOptions {
    let mut options = OpenOptions::new();
    options.create(true).write(true).mode(0o600);
    options
}

/// Logs where the data directory, created before the server made its files private, lets
/// other users in: the files hold every dataset's name and rows.
fn warn_if_shared(root: &Path) {
    if let Ok(meta) = fs::metadata(root)
        && meta.permissions().mode() & 0o077 != 0
    {
        tracing::warn!(
            data_dir = %root.display(),
            mode = format!("{:o}", meta.permissions().mode() & 0o777),
            "the data directory is open to other users; `chmod 700` it (the server creates it so)"
        );
    }
}

/// Deletes the segment files (and temporary ones) in `segments` that `named` does not hold.
/// Returns the id the next segment gets: ids are never reused, even those of swept files, so
/// that a name always means one content.
fn sweep_segments(segments: &Path, named: &HashMap<String, Segment>) -> Result<u64, FilesError> {
    let mut last_id = None;
    let entries = fs::read_dir(segments).map_err(io_error(segments, "listing"))?;
    for entry in entries {
        let entry = entry.map_err(io_error(segments, "listing"))?;
        let name = entry.file_name();
        // Files whose names are not ours are not ours to delete.
        let Some((id, _)) = name.to_str().and_then(parse_file_name) else {
            continue;
        };
        last_id = last_id.max(Some(id));
        if !name.to_str().is_some_and(|n| named.contains_key(n)) {
            remove_if_present(&entry.path())?;
        }
    }
    Ok(last_id.map_or(0, |id| id.saturating_add(1)))
}

/// Creates `path` holding `text`, fsync'd.
fn write_file(fs: &Fs, path: &Path, text: &[u8]) -> Result<(), FilesError> {
    let file = fs.create(path).map_err(io_error(path, "creating"))?;
    let mut out = Tracked::new(file, fs);
    out.write_all(text).map_err(io_error(path, "writing"))?;
    fs.sync(&out.file).map_err(io_error(path, "syncing"))
}

fn encode_manifest(manifest: &Manifest, sequence: u64) -> Result<Vec<u8>, serde_json::Error> {
    let body = serde_json::to_vec(manifest)?;
    let header = Header {
        format: MANIFEST_FORMAT,
        bytes: body.len() as u64,
        crc32: crc32fast::hash(&body),
        sequence,
    };
    let mut text = serde_json::to_vec(&header)?;
    text.push(b'\n');
    text.extend_from_slice(&body);
    Ok(text)
}

/// Reads the checkpoint at `path`: the catalog, the last journal record it includes, and the
/// file's size. `None` where there is none yet.
fn read_manifest(path: &Path) -> Result<Option<(Manifest, u64, u64)>, FilesError> {
    let text = match fs::read(path) {
        Ok(text) => text,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_error(path, "reading")(e)),
    };
    let newline = text
        .iter()
        .position(|&b| b == b'\n')
        .ok_or_else(|| corrupt(path, "it has no header line"))?;
    let (header, body) = (&text[..newline], &text[newline + 1..]);
    let header: Header = serde_json::from_slice(header)
        .map_err(|e| corrupt(path, format!("its header does not parse: {e}")))?;
    if header.format != MANIFEST_FORMAT {
        return Err(FilesError::Format {
            path: path.to_path_buf(),
            found: header.format,
        });
    }
    if header.bytes != body.len() as u64 {
        return Err(differs(
            path,
            "body size",
            body.len(),
            header.bytes,
            "its header",
        ));
    }
    let checksum = crc32fast::hash(body);
    if checksum != header.crc32 {
        let (found, recorded) = (crc(checksum), crc(header.crc32));
        return Err(differs(path, "CRC-32", found, recorded, "its header"));
    }
    let manifest = serde_json::from_slice(body)
        .map_err(|e| corrupt(path, format!("it does not parse: {e}")))?;
    // An empty catalog's checkpoint is some bytes long too: zero stands for none.
    Ok(Some((
        manifest,
        header.sequence,
        (text.len() as u64).max(1),
    )))
}

/// Checks by its size that the file at `path` is the segment the manifest records.
fn check_size(path: &Path, segment: &Segment) -> Result<(), FilesError> {
    match fs::metadata(path) {
        Ok(meta) if meta.len() == segment.bytes => Ok(()),
        Ok(meta) => Err(differs(
            path,
            "size",
            meta.len(),
            segment.bytes,
            "the manifest",
        )),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            Err(corrupt(path, "the manifest names it but it is missing"))
        }
        Err(e) => Err(io_error(path, "checking")(e)),
    }
}

fn remove_if_present(path: &Path) -> Result<(), FilesError> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_error(path, "deleting")(e)),
        _ => Ok(()),
    }
}

/// A rename or a new file's entry is durable only once its directory is.
fn sync_dir(dir: &Path) -> Result<(), FilesError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_error(dir, "syncing directory"))
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::collections::BTreeSet;

    use arrow::array::{
        ArrayRef, DictionaryArray, Int32Array, Int64Array, ListArray, StringArray, StructArray,
    };
    use arrow::buffer::OffsetBuffer;
    use arrow::datatypes::{DataType, Field, Int8Type, Int32Type};
    use arrow::ipc::reader::FileReader;

    /// A directory under the system's temporary one, removed when dropped.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new() -> Self {
            let mut name = [0u8; 8];
            getrandom::fill(&mut name).expect("random");
            let path = std::env::temp_dir().join(format!("gpu-flight-files-{}", hex::encode(name)));
            Self(path)
        }

        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    /// A schema with the types that make IPC files interesting: a dictionary and nesting.
    fn schema() -> SchemaRef {
        let item = DataType::Struct(
            vec![
                Field::new("a", DataType::Int32, false),
                Field::new("b", DataType::Utf8, true),
                Field::new(
                    "c",
                    DataType::Dictionary(Box::new(DataType::Int8), Box::new(DataType::Utf8)),
                    true,
                ),
            ]
            .into(),
        );
        let tag = DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8));
        Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("name", DataType::Utf8, true),
            Field::new("tag", tag, false),
            Field::new_list("items", Field::new_list_field(item, true), true),
        ]))
    }

    fn batch(seed: i64, rows: usize) -> RecordBatch {
        let schema = schema();
        let ids = Int64Array::from_iter_values((0..rows as i64).map(|i| seed + i));
        let names: StringArray = (0..rows)
            .map(|i| (i % 3 != 0).then(|| format!("name {}", seed + i as i64)))
            .collect();
        let tags: DictionaryArray<Int32Type> = (0..rows)
            .map(|i| ["x", "y", "z"][(seed as usize + i) % 3])
            .collect();
        let DataType::List(item) = schema.field(3).data_type() else {
            panic!("items is a list");
        };
        let DataType::Struct(fields) = item.data_type() else {
            panic!("items are structs");
        };
        let values = StructArray::new(
            fields.clone(),
            vec![
                Arc::new(Int32Array::from_iter_values(
                    (0..2 * rows as i32).map(|v| v * 7),
                )) as ArrayRef,
                Arc::new(StringArray::from_iter(
                    (0..2 * rows).map(|v| (v % 2 == 0).then(|| format!("b{v}"))),
                )),
                Arc::new(
                    (0..2 * rows)
                        .map(|v| {
                            (v % 5 != 0).then_some(["p", "q", "r", "s"][(seed as usize + v) % 4])
                        })
                        .collect::<DictionaryArray<Int8Type>>(),
                ),
            ],
            None,
        );
        let items = ListArray::new(
            Arc::clone(item),
            OffsetBuffer::from_lengths(std::iter::repeat_n(2, rows)),
            Arc::new(values),
            None,
        );
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(ids),
                Arc::new(names),
                Arc::new(tags),
                Arc::new(items),
            ],
        )
        .expect("batch")
    }

    fn read_dataset(dir: &DataDir, entry: &DatasetEntry) -> Vec<RecordBatch> {
        let mut batches = Vec::new();
        for segment in &entry.segments {
            let (got, read) = dir.read_segment(segment).expect("segment reads back");
            assert_eq!(got, schema());
            assert_eq!(
                read.iter().map(|b| b.num_rows() as u64).sum::<u64>(),
                segment.rows
            );
            batches.extend(read);
        }
        batches
    }

    /// The rows of `batches`, in one batch: a merge keeps rows, not batch boundaries.
    fn rows(batches: &[RecordBatch]) -> RecordBatch {
        arrow::compute::concat_batches(&schema(), batches).expect("concat")
    }

    /// Every file and directory under `root`, relative to it.
    fn tree(root: &Path) -> BTreeSet<String> {
        let mut found = BTreeSet::new();
        let mut pending = vec![root.to_path_buf()];
        while let Some(dir) = pending.pop() {
            for entry in fs::read_dir(&dir).expect("list") {
                let path = entry.expect("entry").path();
                let relative = path.strip_prefix(root).expect("inside");
                found.insert(relative.to_string_lossy().into_owned());
                if path.is_dir() {
                    pending.push(path);
                }
            }
        }
        found
    }

    /// What a reopened directory must hold: the lock, the checkpoint, the journal, and
    /// exactly the catalog's segments.
    fn expected_tree(manifest: &Manifest) -> BTreeSet<String> {
        let mut expected: BTreeSet<String> =
            [LOCK, MANIFEST, JOURNAL, SEGMENTS].map(String::from).into();
        for segment in manifest.datasets.values().flat_map(|d| &d.segments) {
            expected.insert(format!("{SEGMENTS}/{}", segment.file));
        }
        expected
    }

    type Contents = BTreeMap<String, Vec<RecordBatch>>;

    fn set(name: &str, version: u64, segments: Vec<Segment>) -> Change {
        Change::Set {
            name: name.to_owned(),
            entry: DatasetEntry {
                version,
                tag: None,
                segments,
            },
        }
    }

    /// The state each crash run starts from, committed through the journal: "d" at version
    /// 1, "keep" of two segments (an append), and "empty" with a schema and no rows.
    fn old_state(root: &Path) -> (Manifest, Contents) {
        let (mut dir, opened) = DataDir::open(root).expect("open");
        assert_eq!(opened, Manifest::default());
        let mut contents = Contents::new();
        for (name, batches) in [
            ("d", vec![batch(0, 5)]),
            ("keep", vec![batch(100, 3)]),
            ("empty", vec![]),
        ] {
            let segment = dir.write_segment(&schema(), &batches).expect("write");
            dir.commit(set(name, 1, vec![segment])).expect("commit");
            contents.insert(name.to_owned(), batches);
        }
        let appended = vec![batch(200, 4), batch(300, 1)];
        let segment = dir.write_segment(&schema(), &appended).expect("write");
        let entry = DatasetEntry {
            version: 2,
            tag: None,
            segments: vec![segment],
        };
        let name = "keep".to_owned();
        dir.commit(Change::Append { name, entry }).expect("append");
        contents.get_mut("keep").expect("keep").extend(appended);
        (dir.catalog().clone(), contents)
    }

    /// [`old_state`], folded into the checkpoint: the journal is empty.
    fn checkpointed_state(root: &Path) -> (Manifest, Contents) {
        let state = old_state(root);
        let (mut dir, _) = DataDir::open(root).expect("open");
        dir.checkpoint().expect("checkpoint");
        assert_eq!(fs::metadata(root.join(JOURNAL)).expect("journal").len(), 0);
        state
    }

    fn new_parts() -> [Vec<RecordBatch>; 2] {
        [vec![batch(1000, 6)], vec![batch(2000, 2), batch(3000, 1)]]
    }

    /// The commits the fault matrix runs, each from [`old_state`].
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Op {
        /// "d" replaced by version 2, in two new segments: a journal record.
        Replace,
        /// The same, written as a new checkpoint that empties the journal.
        ReplaceByCheckpoint,
        /// Rows appended to "d", in a new segment.
        Append,
        /// "keep"'s two segments merged into one, as the background merges do.
        Merge,
        /// "d" dropped.
        Remove,
    }

    /// What one attempt at an operation got as far as: the segments it wrote, and the
    /// catalog and rows it makes.
    #[derive(Default)]
    struct Attempt {
        written: Vec<Segment>,
        new: Option<(Manifest, Contents)>,
    }

    fn run_op(
        op: Op,
        dir: &mut DataDir,
        old: &(Manifest, Contents),
        attempt: &mut Attempt,
    ) -> Result<(), FilesError> {
        let (mut manifest, mut contents) = old.clone();
        let change = match op {
            Op::Replace | Op::ReplaceByCheckpoint => {
                if op == Op::ReplaceByCheckpoint {
                    dir.checkpoint_next();
                }
                for part in new_parts() {
                    let segment = dir.write_segment(&schema(), &part)?;
                    attempt.written.push(segment);
                }
                contents.insert("d".to_owned(), new_parts().concat());
                set("d", 2, attempt.written.clone())
            }
            Op::Append => {
                let part = vec![batch(7000, 2)];
                attempt.written.push(dir.write_segment(&schema(), &part)?);
                contents.get_mut("d").expect("d").extend(part);
                let entry = DatasetEntry {
                    version: 2,
                    tag: None,
                    segments: attempt.written.clone(),
                };
                let name = "d".to_owned();
                Change::Append { name, entry }
            }
            Op::Merge => {
                let run = old.0.datasets["keep"].segments.clone();
                let files = dir.segment_files();
                let pins: Vec<_> = run.iter().map(|s| files.pin(s)).collect();
                let merged = dir.segment_writer().merge(&pins)?;
                drop(pins);
                attempt.written.push(merged.clone());
                let name = "keep".to_owned();
                Change::Merge {
                    name,
                    at: 0,
                    run,
                    merged,
                }
            }
            Op::Remove => {
                contents.remove("d");
                Change::Remove {
                    name: "d".to_owned(),
                }
            }
        };
        let mut datasets = manifest.datasets.clone();
        effect(&datasets, &change).expect("the change applies");
        apply(&mut datasets, change.clone());
        manifest.datasets = datasets;
        attempt.new = Some((manifest, contents));
        dir.commit(change)
    }

    /// Reopens `root` and checks it holds exactly the old catalog or exactly `new`, every
    /// dataset reads back as committed, nothing else is left, and it takes commits again.
    fn check_reopened(
        root: &Path,
        old: &(Manifest, Contents),
        new: Option<&(Manifest, Contents)>,
        must_be_new: bool,
        context: &str,
    ) {
        let (mut dir, manifest) = DataDir::open(root).unwrap_or_else(|e| panic!("{context}: {e}"));
        let is_new = new.is_some_and(|(new, _)| *new == manifest);
        assert!(
            is_new || manifest == old.0,
            "{context}: torn catalog {manifest:?}"
        );
        assert!(
            is_new || !must_be_new,
            "{context}: a commit that returned Ok was lost"
        );
        let contents = match new {
            Some((_, contents)) if is_new => contents,
            _ => &old.1,
        };
        assert_eq!(
            manifest.datasets.keys().collect::<Vec<_>>(),
            contents.keys().collect::<Vec<_>>()
        );
        for (name, entry) in &manifest.datasets {
            assert_eq!(
                rows(&read_dataset(&dir, entry)),
                rows(&contents[name]),
                "{context}: {name}"
            );
        }
        assert_eq!(tree(root), expected_tree(&manifest), "{context}: leftovers");
        // Whatever a crash left at the journal's end is gone: a new record follows.
        let segment = dir
            .write_segment(&schema(), &[batch(9000, 1)])
            .expect("write");
        dir.commit(set("after", 1, vec![segment]))
            .unwrap_or_else(|e| panic!("{context}: {e}"));
        let expected = dir.catalog().clone();
        drop(dir);
        let (_, reopened) = DataDir::open(root).unwrap_or_else(|e| panic!("{context}: {e}"));
        assert_eq!(reopened, expected, "{context}: after a later commit");
    }

    /// What follows a fault: the process dies there, or the store carries on with the error.
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Then {
        /// Every later step fails too, so no cleanup runs; then the directory is reopened.
        Crash,
        /// The directory is closed and reopened.
        Reopen,
        /// The store discards what the put wrote, then the server stops.
        Discard,
        /// The store discards what the put wrote, and a later put succeeds.
        Retry,
    }

    /// Injects a fault at every step of `op` in turn, followed by each of [`Then`].
    fn every_fault_of(op: Op) -> u64 {
        let then = [Then::Crash, Then::Reopen, Then::Discard, Then::Retry];
        let mut steps = u64::MAX;
        // A torn write puts half its bytes down before it fails.
        for (then, torn) in then.into_iter().flat_map(|t| [(t, false), (t, true)]) {
            let mut step = 0;
            loop {
                let context = format!("{op:?}, {then:?}, torn {torn}, step {step}");
                let tmp = TempDir::new();
                let old = old_state(tmp.path());
                let (mut dir, opened) = DataDir::open(tmp.path()).expect("open");
                assert_eq!(opened, old.0);
                let crash = then == Then::Crash;
                dir.inject(FaultPlan { step, torn, crash });
                let mut attempt = Attempt::default();
                let result = run_op(op, &mut dir, &old, &mut attempt);
                if !dir.fault_fired() {
                    result.expect("no fault, no error");
                    drop(dir);
                    check_reopened(tmp.path(), &old, attempt.new.as_ref(), true, &context);
                    break;
                }
                // Only a failed deletion after the commit can leave the operation Ok.
                let mut must_be_new = result.is_ok();
                if let Err(e) = &result {
                    let message = e.to_string();
                    assert!(message.contains("injected fault"), "{context}: {message}");
                    let path = tmp.path().to_string_lossy();
                    assert!(message.contains(&*path), "{context}: {message}");
                    assert_eq!(dir.catalog(), &old.0, "{context}: the catalog changed");
                }
                if result.is_err() && matches!(then, Then::Discard | Then::Retry) {
                    // The store keeps serving the old version, which must still read back.
                    for segment in &attempt.written {
                        dir.discard(segment).expect("discard");
                    }
                    for (name, entry) in &old.0.datasets {
                        let read = rows(&read_dataset(&dir, entry));
                        assert_eq!(read, rows(&old.1[name]), "{context}");
                    }
                }
                if result.is_err() && then == Then::Retry {
                    // Steps after a fault that is no crash go through.
                    attempt = Attempt::default();
                    run_op(op, &mut dir, &old, &mut attempt).expect("retry");
                    must_be_new = true;
                }
                drop(dir);
                let new = attempt.new.as_ref();
                check_reopened(tmp.path(), &old, new, must_be_new, &context);
                step += 1;
            }
            steps = steps.min(step);
        }
        steps
    }

    #[test]
    fn every_fault_of_a_journal_record_leaves_the_old_or_the_new_catalog() {
        // Two segments (create, write, fsync, rename, directory fsync each), the record
        // (a write, an fsync) and the old segment's deletion.
        let steps = every_fault_of(Op::Replace);
        assert!(steps >= 13, "only {steps} steps");
        // A segment, the record.
        let steps = every_fault_of(Op::Append);
        assert!(steps >= 7, "only {steps} steps");
        // The record, the deletion of its segment.
        let steps = every_fault_of(Op::Remove);
        assert!(steps >= 3, "only {steps} steps");
    }

    #[test]
    fn every_fault_of_a_checkpoint_leaves_the_old_or_the_new_catalog() {
        // Two segments, the checkpoint (create, write, fsync, rename, directory fsync), the
        // journal emptied (a truncation, an fsync) and the old segment's deletion.
        let steps = every_fault_of(Op::ReplaceByCheckpoint);
        assert!(steps >= 18, "only {steps} steps");
    }

    #[test]
    fn every_fault_of_a_merge_leaves_the_old_or_the_new_catalog() {
        // The merged segment, the record, the two merged segments' deletions.
        let steps = every_fault_of(Op::Merge);
        assert!(steps >= 9, "only {steps} steps");
    }

    #[test]
    fn segments_are_plain_arrow_ipc_files() {
        let tmp = TempDir::new();
        let (mut dir, _) = DataDir::open(tmp.path()).expect("open");
        let batches = vec![batch(0, 4), batch(10, 0), batch(20, 3)];
        let full = dir.write_segment(&schema(), &batches).expect("write");
        let empty = dir.write_segment(&schema(), &[]).expect("write");
        assert_eq!((full.rows, empty.rows), (7, 0));

        // Arrow's own reader, which reads what pyarrow.ipc.open_file does.
        for (segment, expected) in [(&full, &batches), (&empty, &vec![])] {
            let path = tmp.path().join(SEGMENTS).join(&segment.file);
            assert_eq!(fs::metadata(&path).expect("stat").len(), segment.bytes);
            let data = fs::read(&path).expect("read");
            assert_eq!(crc32fast::hash(&data), segment.checksum);
            let reader = FileReader::try_new(File::open(&path).expect("open"), None).expect("ipc");
            assert_eq!(reader.schema(), schema());
            let read: Vec<RecordBatch> = reader.collect::<Result<_, _>>().expect("batches");
            assert_eq!(&read, expected);

            let (got, read) = dir.read_segment(segment).expect("read_segment");
            assert_eq!(got, schema(), "the schema survives with no batches too");
            assert_eq!(&read, expected);
        }
    }

    #[test]
    fn a_damaged_segment_is_corrupt_naming_the_file() {
        let tmp = TempDir::new();
        let (mut dir, _) = DataDir::open(tmp.path()).expect("open");
        let segment = dir.write_segment(&schema(), &[batch(0, 8)]).expect("write");
        let path = tmp.path().join(SEGMENTS).join(&segment.file);
        let good = fs::read(&path).expect("read");

        for at in [0, good.len() / 2, good.len() - 1] {
            let mut bad = good.clone();
            bad[at] ^= 0x20;
            fs::write(&path, &bad).expect("damage");
            let error = dir.read_segment(&segment).expect_err("flipped byte");
            assert!(matches!(error, FilesError::Corrupt { .. }), "{error}");
            assert!(error.to_string().contains(&segment.file), "{error}");
        }
        fs::write(&path, &good[..good.len() - 3]).expect("truncate");
        let error = dir.read_segment(&segment).expect_err("truncated");
        assert!(error.to_string().contains("its size is"), "{error}");
        fs::remove_file(&path).expect("remove");
        let error = dir.read_segment(&segment).expect_err("missing");
        assert!(error.to_string().contains(&segment.file), "{error}");
        fs::write(&path, &good).expect("restore");
        assert_eq!(
            dir.read_segment(&segment).expect("read").1,
            vec![batch(0, 8)]
        );
    }

    #[test]
    fn forged_segments_are_errors_not_panics() {
        // A file whose checksum matches yet is not valid Arrow: only a forger makes one, and
        // it still must not take the server down.
        let tmp = TempDir::new();
        let (mut dir, _) = DataDir::open(tmp.path()).expect("open");
        let segment = dir.write_segment(&schema(), &[batch(0, 3)]).expect("write");
        let path = tmp.path().join(SEGMENTS).join(&segment.file);
        let good = fs::read(&path).expect("read");
        let forge = |data: &[u8]| {
            fs::write(&path, data).expect("forge");
            let forged = Segment {
                bytes: data.len() as u64,
                checksum: crc32fast::hash(data),
                ..segment.clone()
            };
            // Either outcome is fine; a panic or an abort is not.
            let _ = dir.read_segment(&forged);
        };
        for at in 0..good.len() {
            for flip in [0x01, 0x80, 0xff] {
                let mut bad = good.clone();
                bad[at] ^= flip;
                forge(&bad);
            }
        }
        for len in (0..good.len()).step_by(5) {
            forge(&good[..len]);
        }
        forge(b"ARROW1\0\0not really\xff\xff\xff\x7fARROW1");
    }

    #[test]
    fn a_damaged_manifest_is_an_error_at_open_and_deletes_nothing() {
        let tmp = TempDir::new();
        let (old, _) = checkpointed_state(tmp.path());
        let path = tmp.path().join(MANIFEST);
        let good = fs::read(&path).expect("read");
        let newline = good.iter().position(|&b| b == b'\n').expect("header");
        let mut flipped = good.clone();
        flipped[newline + 5] ^= 0x01;
        let mut future = encode_manifest(&old, 0).expect("encode");
        let future_newline = future.iter().position(|&b| b == b'\n').expect("header");
        future.splice(
            ..future_newline,
            br#"{"format":2,"bytes":0,"crc32":0}"#.iter().copied(),
        );
        let cases: [(&str, &[u8]); 7] = [
            ("garbage", b"this is not a manifest\n{}"),
            ("empty", b""),
            ("header only", &good[..newline]),
            ("truncated", &good[..good.len() - 4]),
            ("flipped", &flipped),
            ("extended", &[&good[..], b" "].concat()),
            ("future", &future),
        ];
        for (case, bytes) in cases {
            fs::write(&path, bytes).expect("damage");
            let error = DataDir::open(tmp.path()).expect_err(case);
            let message = error.to_string();
            assert!(
                message.contains(&*path.to_string_lossy()),
                "{case}: {message}"
            );
            if case == "future" {
                assert!(
                    matches!(error, FilesError::Format { found: 2, .. }),
                    "{message}"
                );
            } else {
                assert!(
                    matches!(error, FilesError::Corrupt { .. }),
                    "{case}: {message}"
                );
            }
            assert_eq!(
                tree(tmp.path()),
                expected_tree(&old),
                "{case}: the segments stay"
            );
        }
        fs::write(&path, &good).expect("restore");
        assert_eq!(DataDir::open(tmp.path()).expect("open").1, old);
    }

    #[test]
    fn a_manifest_naming_foreign_or_missing_segments_is_refused() {
        let tmp = TempDir::new();
        let (old, _) = checkpointed_state(tmp.path());
        let (mut dir, _) = DataDir::open(tmp.path()).expect("open");
        let real = old.datasets["d"].segments[0].clone();
        let kept = old.datasets["keep"].segments[0].clone();
        let named = |file: &str| Segment {
            file: file.to_owned(),
            ..real.clone()
        };
        for segment in [
            named("../../etc/passwd"),
            named("/etc/passwd"),
            named("seg-1.arrow"),
            named("seg-00000000000000000099.arrow"),
            Segment {
                bytes: real.bytes + 1,
                ..real.clone()
            },
            // Named by another dataset already: deleting one would break the other.
            kept.clone(),
        ] {
            let error = dir
                .commit(set("other", 1, vec![segment.clone()]))
                .expect_err(&segment.file);
            assert!(
                matches!(error, FilesError::UnknownSegment { .. }),
                "{error}"
            );
        }
        // Changes that do not apply to the catalog as it is.
        let entry = DatasetEntry {
            version: 3,
            tag: None,
            segments: vec![],
        };
        let name = "missing".to_owned();
        let error = dir
            .commit(Change::Append { name, entry })
            .expect_err("no such dataset");
        assert!(matches!(error, FilesError::Inapplicable { .. }), "{error}");
        let stale = Change::Merge {
            name: "keep".to_owned(),
            at: 1,
            run: vec![kept.clone()],
            merged: real.clone(),
        };
        let error = dir.commit(stale).expect_err("not where it was");
        assert!(matches!(error, FilesError::Inapplicable { .. }), "{error}");
        drop(dir);
        assert_eq!(DataDir::open(tmp.path()).expect("open").1, old);

        // Damaged files: the open quarantines the dataset, names the file and keeps it.
        let path = tmp.path().join(MANIFEST);
        let segment = tmp.path().join(SEGMENTS).join(&real.file);
        let data = fs::read(&segment).expect("read");
        fs::remove_file(&segment).expect("remove");
        let (dir, _) = DataDir::open(tmp.path()).expect("only d is damaged");
        let reason = &dir.damaged()["d"].reason;
        assert!(reason.contains("missing"), "{reason}");
        assert!(reason.contains(&real.file), "{reason}");
        drop(dir);
        fs::write(&segment, &data[..10]).expect("write");
        let (dir, _) = DataDir::open(tmp.path()).expect("only d is damaged");
        assert!(dir.damaged()["d"].reason.contains(&real.file));
        assert_eq!(dir.damaged().len(), 1);
        drop(dir);
        assert!(segment.exists(), "a damaged dataset's files are kept");

        // Written by hand, as a forger or a bug elsewhere would: commits go on with d as it
        // was found, and dropping d deletes only files of ours, never what a name points at.
        let mut bad = old.clone();
        bad.datasets.get_mut("d").expect("d").segments[0].file = "../LOCK".to_owned();
        fs::write(&path, encode_manifest(&bad, 0).expect("encode")).expect("write");
        let (mut dir, _) = DataDir::open(tmp.path()).expect("only d is damaged");
        let reason = &dir.damaged()["d"].reason;
        assert!(
            reason.contains("\"../LOCK\" is not a segment file name"),
            "{reason}"
        );
        assert_eq!(dir.damaged().len(), 1);
        dir.commit(Change::Remove {
            name: "d".to_owned(),
        })
        .expect("a drop of the damaged dataset");
        assert!(dir.damaged().is_empty());
        dir.checkpoint().expect("checkpoint");
        assert!(tmp.path().join(LOCK).exists());
        drop(dir);
        let (dir, catalog) = DataDir::open(tmp.path()).expect("open");
        assert!(dir.damaged().is_empty());
        assert!(!catalog.datasets.contains_key("d"));
    }

    #[test]
    fn a_locked_directory_cannot_be_opened_twice() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<DataDir>(); // the store moves it into spawn_blocking
        let tmp = TempDir::new();
        let (first, _) = DataDir::open(tmp.path()).expect("open");
        let error = DataDir::open(tmp.path()).expect_err("second open");
        assert!(matches!(error, FilesError::Locked { .. }), "{error}");
        assert!(
            error.to_string().contains("in use by another process"),
            "{error}"
        );
        assert!(
            error.to_string().contains(&*tmp.path().to_string_lossy()),
            "{error}"
        );
        drop(first);
        DataDir::open(tmp.path()).expect("open once the first is closed");
    }

    #[test]
    fn dataset_names_never_become_paths() {
        let tmp = TempDir::new();
        let (mut dir, _) = DataDir::open(tmp.path()).expect("open");
        let names = [
            "../../etc/passwd".to_owned(),
            "a/b".to_owned(),
            "/abs".to_owned(),
            "nul\0inside".to_owned(),
            "..".to_owned(),
            String::new(),
            "segments/seg-00000000000000000000.arrow".to_owned(),
            "\u{202e}ünïcödé\n\"quoted\"".to_owned(),
            "x".repeat(1 << 20),
        ];
        let mut manifest = Manifest::default();
        for (version, name) in names.iter().enumerate() {
            let segment = dir.write_segment(&schema(), &[]).expect("write");
            let entry = DatasetEntry {
                version: version as u64,
                tag: None,
                segments: vec![segment],
            };
            manifest.datasets.insert(name.clone(), entry.clone());
            let name = name.clone();
            dir.commit(Change::Set { name, entry }).expect("commit");
        }
        drop(dir);
        let (dir, reopened) = DataDir::open(tmp.path()).expect("reopen");
        assert_eq!(reopened, manifest);
        assert_eq!(tree(tmp.path()), expected_tree(&manifest));
        for entry in reopened.datasets.values() {
            assert!(read_dataset(&dir, entry).is_empty());
        }
    }

    #[test]
    fn segment_ids_survive_restarts_and_sweeps() {
        let tmp = TempDir::new();
        let (mut dir, _) = DataDir::open(tmp.path()).expect("open");
        let committed = dir.write_segment(&schema(), &[batch(0, 1)]).expect("write");
        let mut manifest = Manifest::default();
        manifest.datasets.insert(
            "d".to_owned(),
            DatasetEntry {
                version: 1,
                tag: None,
                segments: vec![committed.clone()],
            },
        );
        dir.commit(set("d", 1, vec![committed.clone()]))
            .expect("commit");
        // A put that never committed, as a crash would leave it, and its temporary file.
        let orphan = dir.write_segment(&schema(), &[batch(0, 2)]).expect("write");
        let segments = tmp.path().join(SEGMENTS);
        fs::write(segments.join("seg-00000000000000000077.arrow.tmp"), b"half").expect("tmp");
        fs::write(tmp.path().join(MANIFEST_TMP), b"half a manifest").expect("tmp");
        fs::write(segments.join("notes.txt"), b"not ours").expect("foreign");
        drop(dir);

        let (mut dir, reopened) = DataDir::open(tmp.path()).expect("reopen");
        assert_eq!(reopened, manifest);
        let mut expected = expected_tree(&manifest);
        expected.insert(format!("{SEGMENTS}/notes.txt"));
        assert_eq!(
            tree(tmp.path()),
            expected,
            "leftovers swept, foreign files kept"
        );
        let next = dir.write_segment(&schema(), &[]).expect("write");
        let id = |s: &Segment| parse_file_name(&s.file).expect("ours").0;
        assert!(
            id(&next) > id(&orphan) && id(&next) > 77,
            "{next:?} reuses an id"
        );
        assert!(id(&orphan) > id(&committed));
    }

    #[test]
    fn discard_removes_only_what_no_manifest_names() {
        let tmp = TempDir::new();
        let (old, _) = old_state(tmp.path());
        let (mut dir, _) = DataDir::open(tmp.path()).expect("open");
        let committed = old.datasets["d"].segments[0].clone();
        let pending = dir.write_segment(&schema(), &[batch(0, 1)]).expect("write");
        dir.discard(&pending).expect("discard");
        dir.discard(&pending).expect("discarding twice is harmless");
        dir.discard(&committed).expect("kept");
        assert_eq!(tree(tmp.path()), expected_tree(&old));
    }

    #[test]
    fn a_batch_of_another_schema_is_refused_and_leaves_nothing() {
        let tmp = TempDir::new();
        let (mut dir, _) = DataDir::open(tmp.path()).expect("open");
        let other = Schema::new(vec![Field::new("id", DataType::Int64, false)]);
        let error = dir
            .write_segment(&other, &[batch(0, 1)])
            .expect_err("mismatch");
        assert!(matches!(error, FilesError::Arrow { .. }), "{error}");
        assert_eq!(
            tree(tmp.path()),
            [LOCK, MANIFEST, JOURNAL, SEGMENTS].map(String::from).into()
        );
    }

    /// The journal's records: (start, end) of each, by walking the length prefixes.
    fn records(journal: &[u8]) -> Vec<(usize, usize)> {
        let mut found = Vec::new();
        let mut at = 0;
        while at < journal.len() {
            let length = u32::from_le_bytes(journal[at..at + 4].try_into().expect("4")) as usize;
            found.push((at, at + 8 + length));
            at += 8 + length;
        }
        found
    }

    #[test]
    fn a_torn_last_record_is_cut_off_at_open() {
        let tmp = TempDir::new();
        let (old, _) = old_state(tmp.path());
        let path = tmp.path().join(JOURNAL);
        // One more record, the one a crash tears.
        let (mut dir, _) = DataDir::open(tmp.path()).expect("open");
        let segment = dir
            .write_segment(&schema(), &[batch(50, 2)])
            .expect("write");
        dir.commit(set("late", 1, vec![segment])).expect("commit");
        drop(dir);
        let good = fs::read(&path).expect("journal");
        let &(start, end) = records(&good).last().expect("records");
        let mut tails: Vec<(String, Vec<u8>)> = (start..end)
            .map(|len| (format!("cut at {len}"), good[..len].to_vec()))
            .collect();
        // A file grown before its data reached the disk reads as zeros there.
        let mut zeros = good.clone();
        zeros[start..].fill(0);
        tails.push(("zero-filled".to_owned(), zeros));
        let mut flipped = good.clone();
        flipped[end - 2] ^= 0x10;
        tails.push(("its last bytes damaged".to_owned(), flipped));
        for (case, bytes) in tails {
            fs::write(&path, &bytes).expect("tear");
            let (mut dir, opened) =
                DataDir::open(tmp.path()).unwrap_or_else(|e| panic!("{case}: {e}"));
            assert_eq!(opened, old, "{case}");
            assert_eq!(
                fs::metadata(&path).expect("journal").len(),
                start as u64,
                "{case}"
            );
            assert_eq!(tree(tmp.path()), expected_tree(&old), "{case}: swept");
            // A record appended now follows the last whole one.
            let segment = dir
                .write_segment(&schema(), &[batch(60, 1)])
                .expect("write");
            dir.commit(set("after", 1, vec![segment])).expect("commit");
            let expected = dir.catalog().clone();
            drop(dir);
            assert_eq!(
                DataDir::open(tmp.path()).expect("reopen").1,
                expected,
                "{case}"
            );
        }
    }

    #[test]
    fn a_bad_record_before_good_ones_is_corruption_and_deletes_nothing() {
        let tmp = TempDir::new();
        let (old, _) = old_state(tmp.path());
        let path = tmp.path().join(JOURNAL);
        let good = fs::read(&path).expect("journal");
        let spans = records(&good);
        assert!(spans.len() >= 4, "{spans:?}");
        let (start, end) = spans[1];
        let mut flipped = good.clone();
        flipped[(start + end) / 2] ^= 0x01;
        let mut short = good.clone();
        short[start..start + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        let mut swapped = good[..spans[1].0].to_vec();
        swapped.extend_from_slice(&good[spans[2].0..spans[2].1]);
        swapped.extend_from_slice(&good[spans[1].0..spans[1].1]);
        swapped.extend_from_slice(&good[spans[2].1..]);
        let mut gap = good[..spans[1].0].to_vec();
        gap.extend_from_slice(&good[spans[2].0..]);
        let forged = |seq: u64, change: Change| {
            let mut bytes = good.clone();
            bytes.extend(journal::encode(&Record { seq, change }).expect("encode"));
            bytes
        };
        let next = spans.len() as u64 + 1;
        let entry = DatasetEntry {
            version: 9,
            tag: None,
            segments: vec![],
        };
        let name = "nobody".to_owned();
        let inapplicable = forged(next, Change::Append { name, entry });
        let invalid = {
            let payload = b"{\"seq\": 5, \"change\": {\"rename\": {}}}";
            let mut bytes = good.clone();
            bytes.extend_from_slice(&(payload.len() as u32).to_le_bytes());
            bytes.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
            bytes.extend_from_slice(payload);
            bytes
        };
        let cases: [(&str, &[u8], &str); 6] = [
            ("a flipped byte", &flipped, "yet a whole record follows"),
            ("a damaged length", &short, "yet a whole record follows"),
            ("records out of order", &swapped, "follows record"),
            ("a record missing", &gap, "follows record"),
            ("a change that does not apply", &inapplicable, "no dataset"),
            ("a record of no known change", &invalid, "does not parse"),
        ];
        for (case, bytes, says) in cases {
            fs::write(&path, bytes).expect("damage");
            let error = DataDir::open(tmp.path()).expect_err(case);
            assert!(
                matches!(error, FilesError::Corrupt { .. }),
                "{case}: {error}"
            );
            let message = error.to_string();
            assert!(
                message.contains(&*path.to_string_lossy()),
                "{case}: {message}"
            );
            assert!(message.contains(says), "{case}: {message}");
            assert_eq!(
                fs::read(&path).expect("journal"),
                bytes,
                "{case}: kept as found"
            );
            assert_eq!(
                tree(tmp.path()),
                expected_tree(&old),
                "{case}: the segments stay"
            );
        }
        // Records with no checkpoint before them: the manifest was lost.
        fs::write(&path, &good).expect("restore");
        let manifest = fs::read(tmp.path().join(MANIFEST)).expect("manifest");
        fs::remove_file(tmp.path().join(MANIFEST)).expect("remove");
        let error = DataDir::open(tmp.path()).expect_err("no manifest");
        assert!(error.to_string().contains("no manifest.json"), "{error}");
        fs::write(tmp.path().join(MANIFEST), manifest).expect("restore");
        assert_eq!(DataDir::open(tmp.path()).expect("open").1, old);
    }

    #[test]
    fn records_a_checkpoint_holds_are_not_applied_twice() {
        let tmp = TempDir::new();
        let (old, _) = old_state(tmp.path());
        let path = tmp.path().join(JOURNAL);
        let journal = fs::read(&path).expect("journal");
        assert!(!journal.is_empty());
        let (mut dir, _) = DataDir::open(tmp.path()).expect("open");
        dir.checkpoint().expect("checkpoint");
        drop(dir);
        assert_eq!(fs::metadata(&path).expect("journal").len(), 0);
        // A crash after the checkpoint was renamed into place, before the journal was emptied.
        fs::write(&path, &journal).expect("put back");
        let (mut dir, opened) = DataDir::open(tmp.path()).expect("open");
        assert_eq!(opened, old);
        assert_eq!(
            fs::metadata(&path).expect("journal").len(),
            0,
            "spent records go"
        );
        dir.commit(Change::Remove {
            name: "d".to_owned(),
        })
        .expect("commit");
        let expected = dir.catalog().clone();
        drop(dir);
        assert_eq!(DataDir::open(tmp.path()).expect("reopen").1, expected);
    }

    #[test]
    fn a_directory_written_before_the_journal_opens() {
        // What the code before the journal wrote: a manifest of format 1 whose header has no
        // sequence number, and no journal.
        let tmp = TempDir::new();
        let (old, contents) = checkpointed_state(tmp.path());
        fs::remove_file(tmp.path().join(JOURNAL)).expect("remove");
        let body = serde_json::to_vec(&old).expect("json");
        let header = format!(
            r#"{{"format":1,"bytes":{},"crc32":{}}}"#,
            body.len(),
            crc32fast::hash(&body)
        );
        fs::write(
            tmp.path().join(MANIFEST),
            [header.as_bytes(), b"\n", &body].concat(),
        )
        .expect("write");
        let (mut dir, opened) = DataDir::open(tmp.path()).expect("open");
        assert_eq!(opened, old);
        for (name, entry) in &opened.datasets {
            assert_eq!(rows(&read_dataset(&dir, entry)), rows(&contents[name]));
        }
        assert_eq!(tree(tmp.path()), expected_tree(&old));
        let segment = dir.write_segment(&schema(), &[batch(5, 5)]).expect("write");
        dir.commit(set("new", 1, vec![segment])).expect("commit");
        let expected = dir.catalog().clone();
        drop(dir);
        assert_eq!(DataDir::open(tmp.path()).expect("reopen").1, expected);
    }

    #[test]
    fn commits_cost_what_they_change() {
        let tmp = TempDir::new();
        let (mut dir, _) = DataDir::open(tmp.path()).expect("open");
        let size = |name: &str| fs::metadata(tmp.path().join(name)).map_or(0, |m| m.len());
        let mut checkpoints = 0;
        let mut checkpoint = size(MANIFEST);
        for i in 0..2000 {
            let segment = dir.write_segment(&schema(), &[]).expect("write");
            let name = format!("d{}", i % 10);
            let change = if i < 10 {
                set(&name, 1, vec![segment])
            } else {
                let entry = DatasetEntry {
                    version: i,
                    tag: None,
                    segments: vec![segment],
                };
                Change::Append { name, entry }
            };
            let journal = size(JOURNAL);
            dir.commit(change).expect("commit");
            if size(MANIFEST) != checkpoint {
                checkpoints += 1;
                checkpoint = size(MANIFEST);
                assert_eq!(size(JOURNAL), 0);
            } else {
                // One record of what changed, not the catalog: a few hundred bytes.
                assert!(
                    size(JOURNAL) - journal < 512,
                    "{} bytes",
                    size(JOURNAL) - journal
                );
            }
            // The journal is folded once it outgrows the checkpoint (and a floor).
            assert!(size(JOURNAL) <= checkpoint.max(JOURNAL_BYTES) + 512);
        }
        assert!(
            checkpoints > 0 && checkpoints < 40,
            "{checkpoints} checkpoints"
        );
    }
}
