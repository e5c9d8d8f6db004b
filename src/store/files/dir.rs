//! The open data directory ([`DataDir`]): what open reads and sweeps, and the commits. Beside
//! the catalog it keeps the ledger of segment files, named by the catalog, possibly in force
//! after a commit that failed late, or named by nothing and due for deletion, so that a file
//! is deleted only once no catalog that may be in force names it and no reader pins it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::datatypes::Schema;
#[cfg(test)]
use arrow::datatypes::SchemaRef;

use super::change::{Change, apply, effect};
use super::check::{Checked, Damage, check_segments, check_size};
use super::error::{Failed, FilesError, corrupt, io_error};
#[cfg(test)]
use super::fs::FaultPlan;
use super::fs::remove_if_present;
use super::journal::{self, Journal};
use super::layout::{JOURNAL, MANIFEST, MANIFEST_TMP, SEGMENTS, parse_file_name, segment_path};
use super::lock::lock;
use super::manifest::{self, Manifest, Segment};
use super::segment::SegmentFiles;
use super::writer::SegmentWriter;

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

impl DataDir {
    /// Opens (creating if absent) the data directory at `root`: locks it, reads the
    /// checkpoint (none yet is an empty catalog) and replays the journal onto it, checks
    /// every segment the catalog names is present and whole in size, then removes what an
    /// interrupted write left behind.
    pub(crate) fn open(root: &Path) -> Result<(DataDir, Manifest), FilesError> {
        let lock = lock(root)?;
        let segments = root.join(SEGMENTS);
        let journal_path = root.join(JOURNAL);
        let checkpoint = manifest::read(&root.join(MANIFEST))?;
        let mut replay = journal::read(&journal_path)?;
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
        journal::replay(&mut catalog, sequence, std::mem::take(&mut replay.records))
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
        let writer = Arc::new(SegmentWriter::new(segments.clone(), next_id));
        let journal = Journal::open(writer.fs(), root, &replay, sequence, checkpoint_bytes)?;
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
            journal,
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
        let checkpoint = self.journal.checkpoint_due();
        // From here on what the change names may be in force, until it is known not to be.
        let mut unsettled = Vec::new();
        for segment in &effect.added {
            if let Some(was) = self.uncertain.insert(segment.file.clone(), segment.clone()) {
                unsettled.push(was);
            }
        }
        let result = if checkpoint {
            self.checkpoint_with(change)
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
        let mut fresh = self.unname(effect.removed);
        if checkpoint {
            self.settle_uncertain(&mut fresh);
        }
        self.delete_unnamed(fresh, checkpoint);
        Ok(())
    }

    /// Moves the segments a commit stopped naming from `named` to `unnamed`, and returns the
    /// names it moved: all of `removed` but files that are not ours or that another dataset
    /// still names.
    fn unname(&mut self, removed: Vec<Segment>) -> Vec<String> {
        let mut fresh = Vec::new();
        for segment in removed {
            // A damaged dataset's entry may name what is not ours to delete, or a file
            // another dataset names too.
            if segment_path(self.writer.segments(), &segment.file).is_err() {
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
        fresh
    }

    /// A new checkpoint is in force, and no other catalog can come back: the files only such
    /// a catalog named are unnamed now, and join `fresh`.
    fn settle_uncertain(&mut self, fresh: &mut Vec<String>) {
        for (file, segment) in std::mem::take(&mut self.uncertain) {
            if !self.named.contains_key(&file) {
                fresh.push(file.clone());
                self.unnamed.insert(file, segment);
            }
        }
    }

    /// Folds the journal into a new checkpoint, if it holds anything: for a clean shutdown,
    /// after which `manifest.json` alone describes the directory.
    pub(crate) fn checkpoint(&mut self) -> Result<(), FilesError> {
        if !self.journal.holds_changes() {
            return Ok(());
        }
        self.write_checkpoint().map_err(|failed| failed.error)?;
        let mut fresh = Vec::new();
        self.settle_uncertain(&mut fresh);
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
                let path = segment_path(self.writer.segments(), &segment.file).map_err(unknown)?;
                check_size(&path, segment).map_err(|e| unknown(e.to_string()))
            }
        }
    }

    /// Appends `change` to the journal as its next record and applies it to the catalog.
    fn append_record(&mut self, change: Change) -> Result<(), Failed> {
        let record = self.journal.append(self.writer.fs(), change)?;
        apply(&mut self.catalog.datasets, record.change);
        Ok(())
    }

    /// Applies `change` to the catalog and writes it as the new checkpoint; an error leaves
    /// the catalog as it was.
    fn checkpoint_with(&mut self, change: Change) -> Result<(), Failed> {
        let name = change.name().to_owned();
        let previous = self.catalog.datasets.get(&name).cloned();
        apply(&mut self.catalog.datasets, change);
        let result = self.write_checkpoint();
        if result.is_err() {
            match previous {
                Some(previous) => self.catalog.datasets.insert(name, previous),
                None => self.catalog.datasets.remove(&name),
            };
        }
        result
    }

    /// Writes the catalog as the new checkpoint, including every record numbered so far, and
    /// empties the journal.
    fn write_checkpoint(&mut self) -> Result<(), Failed> {
        let fs = self.writer.fs();
        match manifest::write(fs, &self.root, &self.catalog, self.journal.last()) {
            Ok(bytes) => {
                self.journal.checkpointed(fs, bytes);
                Ok(())
            }
            Err(failed) => {
                if failed.maybe_in_force {
                    self.journal.checkpoint_failed();
                }
                Err(failed)
            }
        }
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
            let path = self.writer.segments().join(&file);
            match self.writer.fs().remove(&path) {
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
        let path = segment_path(self.writer.segments(), &segment.file).map_err(|reason| {
            FilesError::UnknownSegment {
                file: segment.file.clone(),
                reason,
            }
        })?;
        match self.writer.fs().remove(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_error(&path, "deleting")(e)),
            _ => Ok(()),
        }
    }

    /// Makes the `plan.step`-th file-system step from now on fail (see [`FaultPlan`]).
    #[cfg(test)]
    pub(crate) fn inject(&mut self, plan: FaultPlan) {
        self.writer.fs().inject(plan);
    }

    /// Whether the injected fault happened.
    #[cfg(test)]
    pub(crate) fn fault_fired(&self) -> bool {
        self.writer.fs().fired()
    }

    /// Makes the next commit write a checkpoint rather than a journal record.
    #[cfg(test)]
    pub(crate) fn checkpoint_next(&mut self) {
        self.journal.checkpoint_next();
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
