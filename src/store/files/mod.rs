//! The durable on-disk layout of the catalog: segment files and the manifest that names them.
//!
//! A data directory holds
//!
//! ```text
//! DIR/LOCK                       held with an exclusive lock while a server uses DIR
//! DIR/manifest.json              the catalog: dataset names to versions and segment files
//! DIR/segments/seg-<id>.arrow    Arrow IPC *file* format, readable without the server
//! ```
//!
//! Segments are immutable and named by a counter, never by a dataset name: names are arbitrary
//! client strings (`/`, `..`, NUL, megabytes) and live only inside the manifest. Every file is
//! written under a temporary name, fsync'd, renamed into place and its directory fsync'd, so a
//! crash at any instant leaves the old manifest or the new one, and a manifest only ever names
//! complete segments. What a crash can leave behind (temporary files, segments no manifest
//! names) is removed by the next [`DataDir::open`], and only after the manifest was read: an
//! unreadable manifest is an error, never an empty catalog that would let the sweep delete data.
//!
//! The layer is blocking `std::fs` on purpose: the store calls it from one writer task through
//! `spawn_blocking`. Every step that changes the disk goes through [`Fs`], where tests inject
//! faults (a failed or torn write, fsync, rename or delete, or a crash from that step on).

mod segment;
mod steps;

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File, OpenOptions, TryLockError};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
#[cfg(test)]
use std::sync::atomic::Ordering;

use arrow::array::RecordBatch;
use arrow::datatypes::Schema;
#[cfg(test)]
use arrow::datatypes::SchemaRef;
use arrow::error::ArrowError;
use arrow::ipc::writer::FileWriter;
use serde::{Deserialize, Serialize};

pub(crate) use segment::{PinnedSegment, SegmentFiles};
use segment::{one_dictionary_per_field, parse_file_name, segment_name, segment_path};
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

/// The durable catalog: what [`DataDir::commit`] writes and [`DataDir::open`] returns.
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

/// The first line of `manifest.json`; the JSON manifest follows it. The checksum covers the
/// body's bytes exactly, so a torn or altered manifest cannot parse as a smaller catalog.
#[derive(Debug, Serialize, Deserialize)]
struct Header {
    format: u32,
    bytes: u64,
    crc32: u32,
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
    segments: PathBuf,
    /// Closing the file releases the lock, so it lives as long as the `DataDir`.
    _lock: File,
    next_id: u64,
    /// Segment files that a manifest which may be in force names: the one opened or last
    /// committed, plus those of a commit that failed at or after its rename (on disk it may
    /// have won). Only the next successful commit may delete files from this set.
    live: BTreeMap<String, Segment>,
    /// Datasets found damaged at open, as the manifest recorded them: while an entry stays so,
    /// its files are kept for an operator to restore and not checked again (they failed once).
    quarantined: BTreeMap<String, DatasetEntry>,
    damaged: BTreeMap<String, Damage>,
    files: Arc<SegmentFiles>,
    fs: Fs,
}

/// Why a dataset's files cannot be served, naming the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Damage {
    pub(crate) reason: String,
    /// The dataset's segment files that are safe to name (in the segments folder).
    pub(crate) files: Vec<String>,
}

/// Checks every segment the manifest names: a name of ours (never a path elsewhere), present,
/// of the recorded size, and named by one dataset only. Returns the files to keep and the
/// datasets whose files failed.
fn check_segments(
    root: &Path,
    segments: &Path,
    manifest: &Manifest,
) -> (BTreeMap<String, Segment>, BTreeMap<String, Damage>) {
    let mut live = BTreeMap::new();
    let mut damaged: BTreeMap<String, Damage> = BTreeMap::new();
    let mut owners: HashMap<&str, &str> = HashMap::new();
    for (name, entry) in &manifest.datasets {
        let mut reason = None;
        let mut files = Vec::new();
        for segment in &entry.segments {
            let path = match segment_path(segments, &segment.file) {
                Ok(path) => path,
                Err(why) => {
                    reason.get_or_insert_with(|| corrupt(&root.join(MANIFEST), why).to_string());
                    continue;
                }
            };
            files.push(segment.file.clone());
            if let Err(error) = check_size(&path, segment) {
                reason.get_or_insert_with(|| error.to_string());
            }
            match owners.insert(&segment.file, name) {
                Some(other) if other != name => {
                    let why = format!(
                        "segment {:?} is named by datasets {other:?} and {name:?}",
                        segment.file
                    );
                    let shared = corrupt(&root.join(MANIFEST), why).to_string();
                    if let Some(other) = damaged.get_mut(other) {
                        other.reason.clone_from(&shared);
                    } else {
                        let other_files = manifest.datasets[other]
                            .segments
                            .iter()
                            .filter(|s| segment_path(segments, &s.file).is_ok())
                            .map(|s| s.file.clone())
                            .collect();
                        damaged.insert(
                            other.to_owned(),
                            Damage {
                                reason: shared.clone(),
                                files: other_files,
                            },
                        );
                    }
                    reason = Some(shared);
                }
                _ => {}
            }
            live.entry(segment.file.clone())
                .or_insert_with(|| segment.clone());
        }
        if let Some(reason) = reason {
            damaged.insert(name.clone(), Damage { reason, files });
        }
    }
    (live, damaged)
}

impl DataDir {
    /// Opens (creating if absent) the data directory at `root`: locks it, reads the manifest
    /// (none yet is an empty catalog), checks every segment it names is present and whole in
    /// size, then removes what an interrupted write left behind. A directory that cannot be
    /// locked or whose manifest cannot be read is an error; a dataset whose segments fail the
    /// checks is only listed in [`DataDir::damaged`], and its files are kept.
    pub(crate) fn open(root: &Path) -> Result<(DataDir, Manifest), FilesError> {
        let segments = root.join(SEGMENTS);
        let existed = root.is_dir();
        fs::create_dir_all(&segments).map_err(io_error(&segments, "creating"))?;
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
        let lock = OpenOptions::new()
            .create(true)
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

        let manifest = read_manifest(&root.join(MANIFEST))?;
        let (live, damaged) = check_segments(root, &segments, &manifest);

        // Only now, with the manifest known good, is anything deleted.
        remove_if_present(&root.join(MANIFEST_TMP))?;
        let mut last_id = None;
        let entries = fs::read_dir(&segments).map_err(io_error(&segments, "listing"))?;
        for entry in entries {
            let entry = entry.map_err(io_error(&segments, "listing"))?;
            let name = entry.file_name();
            // Files whose names are not ours are not ours to delete.
            let Some((id, _)) = name.to_str().and_then(parse_file_name) else {
                continue;
            };
            last_id = last_id.max(Some(id));
            if !name.to_str().is_some_and(|n| live.contains_key(n)) {
                remove_if_present(&entry.path())?;
            }
        }
        // Ids are never reused, even those of swept files: a name always means one content.
        let next_id = last_id.map_or(0, |id| id.saturating_add(1));
        let dir = DataDir {
            root: root.to_path_buf(),
            files: Arc::new(SegmentFiles::new(root.to_path_buf(), segments.clone())),
            segments,
            _lock: lock,
            next_id,
            live,
            quarantined: damaged
                .keys()
                .map(|name| (name.clone(), manifest.datasets[name].clone()))
                .collect(),
            damaged,
            fs: Fs::default(),
        };
        Ok((dir, manifest))
    }

    /// Datasets of the manifest whose files failed the checks at open, by name. They stay in
    /// the manifest (and their files on disk) until they are dropped or replaced.
    pub(crate) fn damaged(&self) -> &BTreeMap<String, Damage> {
        &self.damaged
    }

    /// The data directory, for messages and status.
    pub(crate) fn root(&self) -> &Path {
        &self.root
    }

    /// Its segment files, for reading datasets as they are needed.
    pub(crate) fn segment_files(&self) -> Arc<SegmentFiles> {
        Arc::clone(&self.files)
    }

    /// Writes `batches` (all of `schema`; none keeps just the schema) as a new segment file.
    /// Nothing names it until a manifest that includes it is committed.
    pub(crate) fn write_segment(
        &mut self,
        schema: &Schema,
        batches: &[RecordBatch],
    ) -> Result<Segment, FilesError> {
        let file = segment_name(self.next_id);
        self.next_id = self.next_id.saturating_add(1);
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
                data_bytes: batches.iter().map(crate::batch_size::batch_bytes).sum(),
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

    /// Reads a segment back after checking its size and checksum against `segment`.
    #[cfg(test)]
    pub(crate) fn read_segment(
        &self,
        segment: &Segment,
    ) -> Result<(SchemaRef, Vec<RecordBatch>), FilesError> {
        self.files.read(segment)
    }

    /// Makes `manifest` the durable catalog, then deletes the segment files no manifest that
    /// may be in force names any more. An error before the rename leaves the old manifest in
    /// force; an error after it leaves either (the next open says which).
    pub(crate) fn commit(&mut self, manifest: &Manifest) -> Result<(), FilesError> {
        let mut files = BTreeMap::new();
        for (name, entry) in &manifest.datasets {
            if self.quarantined.get(name) == Some(entry) {
                for segment in &entry.segments {
                    if let Some(known) = self.live.get(&segment.file) {
                        files.insert(segment.file.clone(), known.clone());
                    }
                }
                continue;
            }
            self.check_named(entry, &mut files)?;
        }
        let tmp = self.root.join(MANIFEST_TMP);
        let path = self.root.join(MANIFEST);
        let text = encode_manifest(manifest).map_err(|e| io_error(&tmp, "encoding")(e.into()))?;
        if let Err(e) = self.write_manifest(&tmp, &text) {
            let _ = self.fs.remove(&tmp);
            return Err(e);
        }
        self.live.extend(files.clone());
        self.fs
            .rename(&tmp, &path)
            .map_err(io_error(&tmp, "renaming into place"))?;
        self.fs.sync_dir(&self.root)?;

        // The new manifest is durable: nothing can bring back one naming the other files. The
        // deletions need no fsync: a file a crash brings back is unnamed, and open sweeps it.
        let mut unnamed = std::mem::replace(&mut self.live, files);
        unnamed.retain(|file, _| !self.live.contains_key(file));
        for (file, segment) in unnamed {
            // Still to be loaded by a dataset version being read: the next commit after the
            // last such reader is done removes it (or the next start does).
            if self.files.is_pinned(&file) {
                self.live.insert(file, segment);
                continue;
            }
            let path = self.segments.join(&file);
            if let Err(error) = self.fs.remove(&path) {
                tracing::warn!(path = %path.display(), %error,
                    "could not delete a segment file no manifest names; the next start removes it");
                // Kept live so that the next commit tries again.
                self.live.insert(file, segment);
            }
        }
        Ok(())
    }

    /// Checks that `entry` names only complete segments of this directory, each as a manifest
    /// in force records it, and adds them to `files`.
    fn check_named(
        &self,
        entry: &DatasetEntry,
        files: &mut BTreeMap<String, Segment>,
    ) -> Result<(), FilesError> {
        for segment in &entry.segments {
            match self.live.get(&segment.file) {
                Some(known) if known == segment => {}
                Some(known) => {
                    return Err(FilesError::UnknownSegment {
                        file: segment.file.clone(),
                        reason: format!("a manifest in force records it as {known:?}"),
                    });
                }
                // A manifest must only name complete segments; the checksum was taken as
                // the file was written, so a stat is check enough.
                None => {
                    let unknown = |reason| FilesError::UnknownSegment {
                        file: segment.file.clone(),
                        reason,
                    };
                    let path = segment_path(&self.segments, &segment.file).map_err(unknown)?;
                    check_size(&path, segment).map_err(|e| unknown(e.to_string()))?;
                }
            }
            files.insert(segment.file.clone(), segment.clone());
        }
        Ok(())
    }

    fn write_manifest(&self, tmp: &Path, text: &[u8]) -> Result<(), FilesError> {
        let file = self.fs.create(tmp).map_err(io_error(tmp, "creating"))?;
        let mut out = Tracked::new(file, &self.fs);
        out.write_all(text).map_err(io_error(tmp, "writing"))?;
        self.fs.sync(&out.file).map_err(io_error(tmp, "syncing"))
    }

    /// Deletes a segment written for a put that will not be committed. A file a manifest in
    /// force may name is kept: the next successful commit removes it if it is unnamed then.
    pub(crate) fn discard(&mut self, segment: &Segment) -> Result<(), FilesError> {
        if self.live.contains_key(&segment.file) {
            return Ok(());
        }
        let path = segment_path(&self.segments, &segment.file).map_err(|reason| {
            FilesError::UnknownSegment {
                file: segment.file.clone(),
                reason,
            }
        })?;
        match self.fs.remove(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_error(&path, "deleting")(e)),
            _ => Ok(()),
        }
    }

    /// Makes the `plan.step`-th file-system step from now on fail (see [`FaultPlan`]).
    #[cfg(test)]
    pub(crate) fn inject(&mut self, plan: FaultPlan) {
        self.fs = Fs {
            fail_at: Some(plan.step),
            torn: plan.torn,
            crash: plan.crash,
            ..Fs::default()
        };
    }

    /// Whether the injected fault happened.
    #[cfg(test)]
    pub(crate) fn fault_fired(&self) -> bool {
        self.fs.fired.load(Ordering::Relaxed)
    }
}

fn encode_manifest(manifest: &Manifest) -> Result<Vec<u8>, serde_json::Error> {
    let body = serde_json::to_vec(manifest)?;
    let header = Header {
        format: MANIFEST_FORMAT,
        bytes: body.len() as u64,
        crc32: crc32fast::hash(&body),
    };
    let mut text = serde_json::to_vec(&header)?;
    text.push(b'\n');
    text.extend_from_slice(&body);
    Ok(text)
}

fn read_manifest(path: &Path) -> Result<Manifest, FilesError> {
    let text = match fs::read(path) {
        Ok(text) => text,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Manifest::default()),
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
    serde_json::from_slice(body).map_err(|e| corrupt(path, format!("it does not parse: {e}")))
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

    /// What a reopened directory must hold: the lock, the manifest, and exactly its segments.
    fn expected_tree(manifest: &Manifest) -> BTreeSet<String> {
        let mut expected: BTreeSet<String> = [LOCK, MANIFEST, SEGMENTS].map(String::from).into();
        for segment in manifest.datasets.values().flat_map(|d| &d.segments) {
            expected.insert(format!("{SEGMENTS}/{}", segment.file));
        }
        expected
    }

    type Contents = BTreeMap<String, Vec<RecordBatch>>;

    /// The state each crash run starts from: "d" at version 1, "keep" beside it, and "empty"
    /// with a schema and no rows.
    fn old_state(root: &Path) -> (Manifest, Contents) {
        let (mut dir, opened) = DataDir::open(root).expect("open");
        assert_eq!(opened, Manifest::default());
        let mut manifest = Manifest::default();
        let mut contents = Contents::new();
        for (name, batches) in [
            ("d", vec![batch(0, 5)]),
            ("keep", vec![batch(100, 3), batch(200, 4)]),
            ("empty", vec![]),
        ] {
            let segment = dir.write_segment(&schema(), &batches).expect("write");
            manifest.datasets.insert(
                name.to_owned(),
                DatasetEntry {
                    version: 1,
                    tag: None,
                    segments: vec![segment],
                },
            );
            contents.insert(name.to_owned(), batches);
        }
        dir.commit(&manifest).expect("commit");
        (manifest, contents)
    }

    fn new_parts() -> [Vec<RecordBatch>; 2] {
        [vec![batch(1000, 6)], vec![batch(2000, 2), batch(3000, 1)]]
    }

    /// What one attempt at replacing "d" got as far as.
    #[derive(Default)]
    struct Attempt {
        written: Vec<Segment>,
        manifest: Option<Manifest>,
    }

    /// Replaces "d" with version 2, held in two new segments, as the store's put would.
    fn replace_d(
        dir: &mut DataDir,
        old: &Manifest,
        attempt: &mut Attempt,
    ) -> Result<(), FilesError> {
        for part in new_parts() {
            let segment = dir.write_segment(&schema(), &part)?;
            attempt.written.push(segment);
        }
        let mut new = old.clone();
        new.datasets.insert(
            "d".to_owned(),
            DatasetEntry {
                version: 2,
                tag: None,
                segments: attempt.written.clone(),
            },
        );
        attempt.manifest = Some(new.clone());
        dir.commit(&new)
    }

    /// Reopens `root` and checks it holds exactly the old catalog or exactly `new`, every
    /// segment reads back as written, and nothing else is left.
    fn check_reopened(
        root: &Path,
        old: &Manifest,
        old_contents: &Contents,
        new: Option<&Manifest>,
        must_be_new: bool,
        context: &str,
    ) {
        let (dir, manifest) = DataDir::open(root).unwrap_or_else(|e| panic!("{context}: {e}"));
        let is_new = new == Some(&manifest);
        assert!(
            is_new || manifest == *old,
            "{context}: torn catalog {manifest:?}"
        );
        assert!(
            is_new || !must_be_new,
            "{context}: a commit that returned Ok was lost"
        );
        let mut contents = old_contents.clone();
        if is_new {
            contents.insert("d".to_owned(), new_parts().concat());
        }
        for (name, entry) in &manifest.datasets {
            assert_eq!(
                read_dataset(&dir, entry),
                contents[name],
                "{context}: {name}"
            );
        }
        assert_eq!(tree(root), expected_tree(&manifest), "{context}: leftovers");
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

    #[test]
    fn every_fault_leaves_the_old_or_the_new_catalog() {
        let then = [Then::Crash, Then::Reopen, Then::Discard, Then::Retry];
        // A torn write puts half its bytes down before it fails.
        for (then, torn) in then.into_iter().flat_map(|t| [(t, false), (t, true)]) {
            let mut step = 0;
            loop {
                let context = format!("{then:?}, torn {torn}, step {step}");
                let tmp = TempDir::new();
                let (old, old_contents) = old_state(tmp.path());
                let (mut dir, opened) = DataDir::open(tmp.path()).expect("open");
                assert_eq!(opened, old);
                let crash = then == Then::Crash;
                dir.inject(FaultPlan { step, torn, crash });
                let mut attempt = Attempt::default();
                let result = replace_d(&mut dir, &old, &mut attempt);
                if !dir.fault_fired() {
                    result.expect("no fault, no error");
                    drop(dir);
                    let new = attempt.manifest.as_ref();
                    check_reopened(tmp.path(), &old, &old_contents, new, true, &context);
                    break;
                }
                // Only a failed deletion after the commit can leave the operation Ok.
                let mut must_be_new = result.is_ok();
                if let Err(e) = &result {
                    let message = e.to_string();
                    assert!(message.contains("injected fault"), "{context}: {message}");
                    let path = tmp.path().to_string_lossy();
                    assert!(message.contains(&*path), "{context}: {message}");
                }
                if result.is_err() && matches!(then, Then::Discard | Then::Retry) {
                    // The store keeps serving the old version, which must still read back.
                    for segment in &attempt.written {
                        dir.discard(segment).expect("discard");
                    }
                    for (name, entry) in &old.datasets {
                        assert_eq!(read_dataset(&dir, entry), old_contents[name], "{context}");
                    }
                }
                if result.is_err() && then == Then::Retry {
                    // Steps after a fault that is no crash go through.
                    attempt = Attempt::default();
                    replace_d(&mut dir, &old, &mut attempt).expect("retry");
                    must_be_new = true;
                }
                drop(dir);
                let new = attempt.manifest.as_ref();
                check_reopened(tmp.path(), &old, &old_contents, new, must_be_new, &context);
                step += 1;
            }
            // Two segments (create, write, fsync, rename, directory fsync each), the
            // manifest (the same five) and the old segment's deletion.
            assert!(step >= 16, "only {step} steps: {then:?}, torn {torn}");
        }
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
        let (old, _) = old_state(tmp.path());
        let path = tmp.path().join(MANIFEST);
        let good = fs::read(&path).expect("read");
        let newline = good.iter().position(|&b| b == b'\n').expect("header");
        let mut flipped = good.clone();
        flipped[newline + 5] ^= 0x01;
        let mut future = encode_manifest(&old).expect("encode");
        future.splice(
            ..newline,
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
        let (old, _) = old_state(tmp.path());
        let (mut dir, _) = DataDir::open(tmp.path()).expect("open");
        let real = old.datasets["d"].segments[0].clone();
        for file in [
            "../../etc/passwd",
            "/etc/passwd",
            "seg-1.arrow",
            "seg-00000000000000000099.arrow",
        ] {
            let mut bad = old.clone();
            bad.datasets.get_mut("d").expect("d").segments[0].file = file.to_owned();
            let error = dir.commit(&bad).expect_err(file);
            assert!(
                matches!(error, FilesError::UnknownSegment { .. }),
                "{error}"
            );
        }
        let mut bad = old.clone();
        bad.datasets.get_mut("d").expect("d").segments[0].bytes += 1;
        dir.commit(&bad).expect_err("wrong size");
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
        drop(dir);
        assert!(segment.exists(), "a damaged dataset's files are kept");

        // Written by hand, as a forger or a bug elsewhere would: commits go on with d as it
        // was found, and dropping d deletes only files of ours, never what a name points at.
        let mut bad = old.clone();
        bad.datasets.get_mut("d").expect("d").segments[0].file = "../LOCK".to_owned();
        fs::write(&path, encode_manifest(&bad).expect("encode")).expect("write");
        let (mut dir, manifest) = DataDir::open(tmp.path()).expect("only d is damaged");
        let damage = &dir.damaged()["d"];
        assert!(
            damage
                .reason
                .contains("\"../LOCK\" is not a segment file name"),
            "{damage:?}"
        );
        assert_eq!(dir.damaged().len(), 1, "{:?}", dir.damaged());
        dir.commit(&manifest).expect("a commit keeping d as found");
        let mut without = manifest.clone();
        without.datasets.remove("d");
        dir.commit(&without).expect("a commit dropping d");
        assert!(tmp.path().join(LOCK).exists());
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
            manifest.datasets.insert(name.clone(), entry);
        }
        dir.commit(&manifest).expect("commit");
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
        dir.commit(&manifest).expect("commit");
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
        assert_eq!(tree(tmp.path()), [LOCK, SEGMENTS].map(String::from).into());
    }
}
