//! Persistence (`--data-dir`): committed datasets written to disk by one writer task, in the
//! order they were committed, and loaded back when the server starts.
//!
//! Every catalog change (a put, a copy, a drop) queues a job while it still holds the
//! catalog's entry for the name, so the jobs for one name are in commit order. The writer reads
//! what a commit added back out of the dataset (through the staging path on a GPU) in segments
//! of at most [`SEGMENT_BYTES`], writes them as Arrow IPC files and then commits a journal
//! record naming them (`files`). An append adds segments to what the catalog holds for the
//! name when that is the version it appended to; anything else writes the dataset whole. A
//! move changes where the rows are, not what they are: it only renames the version.
//!
//! Appends leave many small segment files; a merger task beside the writer joins runs of them
//! ([`plan_merge`]), off the commit path, and the writer commits each merge if the dataset
//! still holds the run it read. A merge changes neither rows nor version. The run's files go
//! once no version being read pins them.
//!
//! A partition whose rows whole files hold is marked as held on disk, so that it can leave
//! memory for the disk, as one loaded from it does: after the write, and again after a merge
//! or a background compaction changes where files or partitions end.
//!
//! Under `--durability sync` a commit waits for its job and fails (undoing itself in the
//! catalog) if the disk does; under `async` it is acknowledged at once, and a failed write is
//! logged and counted while the dataset stays served from memory. Either way a crash leaves
//! each dataset at a version that was whole on disk.

use std::collections::{BTreeSet, HashMap};
use std::ops::Range;
use std::path::PathBuf;
use std::sync::{Arc, Weak};

use futures::TryStreamExt;
use tokio::sync::{mpsc, oneshot};

use super::dataset::Dataset;
use super::error::StoreError;
use super::files::{
    Change, DataDir, DatasetEntry, FilesError, Manifest, PinnedSegment, Segment, SegmentFiles,
    SegmentWriter,
};
use super::load::{DiskPartition, Loader};
use super::options::Durability;
use super::stats::Stats;

/// Most Arrow bytes in one segment file: what the writer holds in host memory at once.
const SEGMENT_BYTES: u64 = 256 << 20;

/// Segment files smaller than this are merged with their neighbours on disk (see
/// [`plan_merge`]); the loader joins such files as it reads them too.
const MERGE_BELOW: u64 = 1 << 20;

/// Where a job reports its outcome, when its commit waits for it.
pub(crate) type Done = Option<oneshot::Sender<Result<(), StoreError>>>;

/// A queued job's outcome, when the commit must wait for it (`--durability sync`).
pub(crate) type Persisted = Option<oneshot::Receiver<Result<(), StoreError>>>;

/// A catalog change to make durable.
pub(crate) enum Job {
    /// `dataset` is now the version of its name; `base` is the version it appended `rows`
    /// to, if it was an append.
    Write {
        dataset: Arc<Dataset>,
        base: Option<u64>,
        rows: Range<u64>,
        done: Done,
    },
    /// Version `from` of `name` is now version `to`, with the same rows.
    Rename { name: String, from: u64, to: u64 },
    /// `name` was dropped.
    Remove { name: String, done: Done },
    /// A background compaction changed how `dataset` holds its rows, keeping its version:
    /// partitions whose rows the data directory holds whole are marked as held there. Weak:
    /// a queued job must not keep a replaced or dropped dataset's memory.
    Compacted { dataset: Weak<Dataset> },
}

impl Job {
    /// Whether the job changes the disk, and so counts among the changes not on it yet
    /// (`persistence.pending`): marking partitions held there does not.
    fn changes_the_disk(&self) -> bool {
        !matches!(self, Job::Compacted { .. })
    }
}

/// The handle commits queue their jobs on.
#[derive(Debug)]
pub(crate) struct Durable {
    /// Taken (closing the queue) by [`Durable::close`].
    jobs: std::sync::Mutex<Option<mpsc::UnboundedSender<Job>>>,
    writer: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    pub(crate) durability: Durability,
    pub(crate) root: PathBuf,
    stats: Arc<Stats>,
}

impl Durable {
    /// Starts the writer over `dir`, whose catalog open returned as `_manifest`; `loaded`
    /// maps each name to the in-memory version its entry was loaded as. The writer follows
    /// the directory's own catalog, which its commits change.
    pub(crate) fn start(
        dir: DataDir,
        _manifest: Manifest,
        loaded: HashMap<String, u64>,
        durability: Durability,
        loader: Weak<Loader>,
        stats: Arc<Stats>,
    ) -> Self {
        let (jobs, receiver) = mpsc::unbounded_channel();
        let root = dir.root().to_path_buf();
        let writer = Writer {
            files: dir.segment_files(),
            loader,
            dir: Some(dir),
            persisted: loaded,
            stats: Arc::clone(&stats),
            to_merge: BTreeSet::new(),
            merging: None,
            live: HashMap::new(),
        };
        let writer = tokio::spawn(writer.run(receiver));
        Self {
            jobs: std::sync::Mutex::new(Some(jobs)),
            writer: std::sync::Mutex::new(Some(writer)),
            durability,
            root,
            stats,
        }
    }

    /// Queues `job`. Returns a receiver for its outcome where the caller must wait for it.
    pub(crate) fn queue(&self, make: impl FnOnce(Done) -> Job) -> Persisted {
        let (sender, receiver) = match self.durability {
            Durability::Sync => {
                let (sender, receiver) = oneshot::channel();
                (Some(sender), Some(receiver))
            }
            Durability::Async => (None, None),
        };
        let jobs = self.jobs.lock().unwrap_or_else(|p| p.into_inner());
        let job = make(sender);
        let counted = u64::from(job.changes_the_disk());
        // Counted before it is sent: the writer may finish it (and count it off) before
        // `send` returns, and the gauge must never go below zero meanwhile.
        Stats::add(&self.stats.pending_writes, counted);
        let sent = jobs.as_ref().is_some_and(|jobs| jobs.send(job).is_ok());
        if !sent {
            self.stats
                .pending_writes
                .fetch_sub(counted, std::sync::atomic::Ordering::Relaxed);
            // Only after `close`, or when the runtime is going away.
            tracing::warn!("the persistence writer has stopped; a change was not written");
        }
        receiver
    }

    /// Stops taking changes and waits until every one queued is on disk, and the data
    /// directory is closed (its lock released).
    pub(crate) async fn close(&self) {
        drop(self.jobs.lock().unwrap_or_else(|p| p.into_inner()).take());
        let writer = self.writer.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(writer) = writer
            && let Err(error) = writer.await
        {
            tracing::warn!(%error, "the persistence writer failed");
        }
    }
}

/// Waits for a job's outcome (nothing to wait for under `async`).
pub(crate) async fn wait(receiver: Persisted) -> Result<(), StoreError> {
    match receiver {
        None => Ok(()),
        Some(receiver) => receiver.await.unwrap_or_else(|_| {
            Err(StoreError::Persist(
                "the persistence writer stopped before writing this change".to_owned(),
            ))
        }),
    }
}

struct Writer {
    /// Taken while a blocking step runs on another thread.
    dir: Option<DataDir>,
    /// Name to the in-memory version its catalog entry holds.
    persisted: HashMap<String, u64>,
    stats: Arc<Stats>,
    /// Names whose segments may hold a run to merge.
    to_merge: BTreeSet<String>,
    /// The name whose run the merger is writing: one merge at a time.
    merging: Option<String>,
    /// The segment files, pinned for partitions whose rows they hold (`held_on_disk`).
    files: Arc<SegmentFiles>,
    /// The store's loader, for the partitions it holds on disk; a writer outliving it marks
    /// none.
    loader: Weak<Loader>,
    /// The newest dataset seen for each name written, for marking its partitions held on
    /// disk once the files are merged to end where they end.
    live: HashMap<String, Weak<Dataset>>,
}

/// A run of a dataset's segments to write as one, pinned while it is read.
struct MergeRequest {
    name: String,
    at: usize,
    run: Vec<PinnedSegment>,
}

/// A merge written, to commit if the dataset still holds the run it read.
struct Merged {
    name: String,
    at: usize,
    run: Vec<Segment>,
    merged: Result<Segment, StoreError>,
}

impl Writer {
    async fn run(mut self, mut jobs: mpsc::UnboundedReceiver<Job>) {
        let (requests, merges) = mpsc::unbounded_channel();
        let (done, mut merged) = mpsc::unbounded_channel();
        if let Some(dir) = &self.dir {
            tokio::spawn(merger(dir.segment_writer(), merges, done));
        }
        let mut open = true;
        loop {
            tokio::select! {
                biased;
                job = jobs.recv(), if open => match job {
                    Some(job) => self.job(job).await,
                    None => open = false,
                },
                Some(merged) = merged.recv(), if self.merging.is_some() => {
                    self.merged(merged).await;
                }
                // Closed, with the merges the changes called for done.
                else => break,
            }
            if self.dir.is_none() {
                tracing::error!("the data directory was lost to a failed task; persistence stops");
                return;
            }
            self.start_merge(&requests);
        }
        // A cleanly closed directory is described by its manifest alone.
        if let Err(error) = self.blocking(DataDir::checkpoint).await {
            tracing::warn!(%error, "could not write a checkpoint at shutdown");
        }
    }

    async fn job(&mut self, job: Job) {
        let counted = u64::from(job.changes_the_disk());
        let (result, done) = match job {
            Job::Write {
                dataset,
                base,
                rows,
                done,
            } => (self.write(&dataset, base, rows).await, done),
            Job::Rename { name, from, to } => {
                if self.persisted.get(&name) == Some(&from) {
                    self.persisted.insert(name, to);
                }
                (Ok(()), None)
            }
            Job::Remove { name, done } => (self.remove(&name).await, done),
            Job::Compacted { dataset } => {
                if let Some(dataset) = dataset.upgrade() {
                    self.mark_held(&dataset);
                }
                (Ok(()), None)
            }
        };
        self.stats
            .pending_writes
            .fetch_sub(counted, std::sync::atomic::Ordering::Relaxed);
        if let Err(error) = &result {
            Stats::add(&self.stats.write_failures, 1);
            tracing::warn!(%error, "a change was not made durable");
        }
        if let Some(done) = done {
            let _ = done.send(result);
        }
    }

    /// Runs `step` on the data directory on a blocking thread.
    async fn blocking<T: Send + 'static>(
        &mut self,
        step: impl FnOnce(&mut DataDir) -> Result<T, FilesError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let Some(mut dir) = self.dir.take() else {
            return Err(StoreError::Persist("the data directory is gone".to_owned()));
        };
        let (dir, result) = tokio::task::spawn_blocking(move || {
            let result = step(&mut dir);
            (dir, result)
        })
        .await
        .map_err(|e| StoreError::Persist(format!("a disk task failed: {e}")))?;
        self.dir = Some(dir);
        result.map_err(StoreError::from)
    }

    /// Whether the catalog holds `name`.
    fn holds(&self, name: &str) -> bool {
        self.dir
            .as_ref()
            .is_some_and(|dir| dir.catalog().datasets.contains_key(name))
    }

    async fn write(
        &mut self,
        dataset: &Arc<Dataset>,
        base: Option<u64>,
        rows: Range<u64>,
    ) -> Result<(), StoreError> {
        let name = dataset.name().to_owned();
        // Already there: an undo puts back the version a refused change would have replaced.
        if self.persisted.get(&name) == Some(&dataset.version()) && self.holds(&name) {
            return Ok(());
        }
        let append =
            base.is_some() && base == self.persisted.get(&name).copied() && self.holds(&name);
        let rows = if append { rows } else { 0..dataset.num_rows() };
        let mut written: Vec<Segment> = Vec::new();
        let result = self
            .write_segments(dataset, rows.clone(), append, &mut written)
            .await;
        let result = match result {
            Ok(()) => {
                let entry = DatasetEntry {
                    version: dataset.version(),
                    tag: Some(dataset.version_id().tag),
                    segments: written.clone(),
                };
                let change = if append {
                    Change::Append {
                        name: name.clone(),
                        entry,
                    }
                } else {
                    Change::Set {
                        name: name.clone(),
                        entry,
                    }
                };
                match self.blocking(move |dir| dir.commit(change)).await {
                    Ok(()) => {
                        self.persisted.insert(name.clone(), dataset.version());
                        // All its rows, not only the written ones: an append shares the
                        // partitions before it, which a compaction may have made since they
                        // were last marked (a queued `Job::Compacted` does not outlive its
                        // version).
                        self.mark_held(dataset);
                        self.to_merge.insert(name);
                        return Ok(());
                    }
                    Err(error) => Err(error),
                }
            }
            Err(error) => Err(error),
        };
        // Nothing names the new segments: give their space back (the files layer keeps any
        // a catalog on disk might name).
        for segment in written {
            let _ = self.blocking(move |dir| dir.discard(&segment)).await;
        }
        result
    }

    async fn write_segments(
        &mut self,
        dataset: &Arc<Dataset>,
        rows: Range<u64>,
        append: bool,
        written: &mut Vec<Segment>,
    ) -> Result<(), StoreError> {
        let schema = dataset.schema();
        let total = dataset.num_rows().max(1);
        let bytes_per_row = dataset.data_bytes().div_ceil(total).max(1);
        let rows_per_segment = (SEGMENT_BYTES / bytes_per_row).max(1);
        let mut start = rows.start;
        // A dataset without rows still keeps its schema on disk, in a segment of no batches.
        if rows.is_empty() && !append {
            let schema = Arc::clone(&schema);
            written.push(
                self.blocking(move |dir| dir.write_segment(&schema, &[]))
                    .await?,
            );
            return Ok(());
        }
        // Segments end where partitions do, so that a partition's rows are whole segments
        // (see `held_on_disk`).
        let mut ends = Vec::with_capacity(dataset.partitions().len());
        let mut row = 0u64;
        for partition in dataset.partitions() {
            row = row.saturating_add(partition.num_rows() as u64);
            ends.push(row);
        }
        while start < rows.end {
            let partition_end = ends
                .get(ends.partition_point(|&end| end <= start))
                .copied()
                .unwrap_or(rows.end);
            let end = rows.end.min(start + rows_per_segment).min(partition_end);
            let batches: Vec<_> = dataset.read(start..end, 8 << 20, 2)?.try_collect().await?;
            let schema = Arc::clone(&schema);
            let segment = self
                .blocking(move |dir| dir.write_segment(&schema, &batches))
                .await?;
            Stats::add(&self.stats.written_bytes, segment.bytes);
            Stats::add(&self.stats.segments_written, 1);
            written.push(segment);
            start = end;
        }
        Ok(())
    }

    /// Marks each partition of `dataset` whose rows `written` (rows `rows` of it, in order)
    /// hold, in files of at least [`MERGE_BELOW`] bytes, as held by the data directory: a put
    /// made durable can leave memory like a dataset loaded from disk. A partition whose rows
    /// begin or end inside a file is held by the files its rows are in, and reads only its
    /// own rows of them.
    fn held_on_disk(&self, dataset: &Dataset, rows: Range<u64>, written: &[Segment]) {
        let Some(loader) = self.loader.upgrade() else {
            return;
        };
        let segments: Vec<&Segment> = written.iter().filter(|s| s.rows > 0).collect();
        let mut starts = Vec::with_capacity(segments.len() + 1);
        starts.push(rows.start);
        for segment in &segments {
            let last = starts.last().copied().unwrap_or(rows.start);
            starts.push(last.saturating_add(segment.rows));
        }
        if starts.last() != Some(&rows.end) {
            return; // not the rows said: nothing is guessed
        }
        let mut first = 0u64;
        for partition in dataset.partitions() {
            let end = first.saturating_add(partition.num_rows() as u64);
            if first >= rows.start
                && end <= rows.end
                && end > first
                && partition.slot.on_disk().is_none()
            {
                // The files holding its first row and its last.
                let from = starts.partition_point(|&start| start <= first) - 1;
                let to = starts.partition_point(|&start| start < end) - 1;
                let covering = &segments[from..=to];
                // Small files are the merger's to join, and a pin would keep them: such a
                // partition is marked once they are merged (see `Writer::mark_held`).
                if covering.iter().all(|segment| segment.bytes >= MERGE_BELOW) {
                    let pins = covering.iter().map(|s| self.files.pin(s)).collect();
                    let window = first - starts[from]..end - starts[from];
                    let disk = DiskPartition::new(dataset.schema(), pins, &loader)
                        .and_then(|disk| disk.within(window));
                    if let Ok(disk) = disk {
                        partition.slot.held_on_disk(Arc::new(disk));
                    }
                }
            }
            first = end;
        }
    }

    /// Marks each partition of `dataset` whose rows the directory's files for its name hold
    /// whole as held there (see [`Writer::held_on_disk`]), where its version is the one the
    /// directory holds.
    fn mark_held(&mut self, dataset: &Arc<Dataset>) {
        let name = dataset.name();
        if self.persisted.get(name) != Some(&dataset.version()) {
            return;
        }
        let Some(entry) = self
            .dir
            .as_ref()
            .and_then(|dir| dir.catalog().datasets.get(name))
        else {
            return;
        };
        let segments = entry.segments.clone();
        self.held_on_disk(dataset, 0..dataset.num_rows(), &segments);
        self.live.insert(name.to_owned(), Arc::downgrade(dataset));
    }

    async fn remove(&mut self, name: &str) -> Result<(), StoreError> {
        self.persisted.remove(name);
        self.live.remove(name);
        if !self.holds(name) {
            return Ok(());
        }
        let name = name.to_owned();
        self.blocking(move |dir| dir.commit(Change::Remove { name }))
            .await
    }

    /// Hands the merger the next run to merge, if it is idle and there is one.
    fn start_merge(&mut self, requests: &mpsc::UnboundedSender<MergeRequest>) {
        let Some(dir) = &self.dir else {
            return;
        };
        if self.merging.is_some() {
            return;
        }
        while let Some(name) = self.to_merge.pop_first() {
            let Some(entry) = dir.catalog().datasets.get(&name) else {
                continue;
            };
            let Some(run) = plan_merge(&entry.segments) else {
                continue;
            };
            // Pinned before the writer can replace them: a commit may unname them, but
            // nothing deletes them until the merger has read them.
            let files = dir.segment_files();
            let request = MergeRequest {
                name: name.clone(),
                at: run.start,
                run: entry.segments[run].iter().map(|s| files.pin(s)).collect(),
            };
            if requests.send(request).is_ok() {
                self.merging = Some(name);
            }
            return;
        }
    }

    /// Commits a merge if the dataset still holds the run it read: the merge leaves rows
    /// and version as they are, so an append since (after the run) leaves it valid, and a
    /// replace or a drop wins over it.
    async fn merged(&mut self, merged: Merged) {
        self.merging = None;
        let Merged {
            name,
            at,
            run,
            merged,
        } = merged;
        let merged = match merged {
            Ok(merged) => merged,
            Err(error) => {
                tracing::warn!(dataset = name, %error, "merging segment files failed");
                return;
            }
        };
        let held = self
            .dir
            .as_ref()
            .and_then(|dir| dir.catalog().datasets.get(&name))
            .and_then(|entry| entry.segments.get(at..at.saturating_add(run.len())));
        if held == Some(run.as_slice()) {
            let (count, bytes) = (run.len(), merged.bytes);
            let change = Change::Merge {
                name: name.clone(),
                at,
                run,
                merged: merged.clone(),
            };
            match self.blocking(move |dir| dir.commit(change)).await {
                Ok(()) => {
                    tracing::debug!(
                        dataset = name,
                        segments = count,
                        bytes,
                        "segment files merged"
                    );
                    if let Some(dataset) = self.live.get(&name).and_then(Weak::upgrade) {
                        self.mark_held(&dataset);
                    }
                    self.to_merge.insert(name);
                    return;
                }
                Err(error) => {
                    tracing::warn!(dataset = name, %error, "a merge of segment files was not committed");
                }
            }
        }
        let _ = self.blocking(move |dir| dir.discard(&merged)).await;
    }
}

/// Writes the runs the writer hands it as one segment each, beside the writer's commits.
async fn merger(
    writer: Arc<SegmentWriter>,
    mut requests: mpsc::UnboundedReceiver<MergeRequest>,
    done: mpsc::UnboundedSender<Merged>,
) {
    while let Some(MergeRequest { name, at, run }) = requests.recv().await {
        let segments: Vec<Segment> = run.iter().map(|p| p.segment().clone()).collect();
        let writer = Arc::clone(&writer);
        // The pins go with the read: the run's files may be deleted once it is done.
        let merged = tokio::task::spawn_blocking(move || writer.merge(&run))
            .await
            .map_err(|e| StoreError::Persist(format!("a disk task failed: {e}")))
            .and_then(|merged| merged.map_err(StoreError::from));
        let merged = Merged {
            name,
            at,
            run: segments,
            merged,
        };
        if done.send(merged).is_err() {
            return;
        }
    }
}

/// The run of `segments` to merge next, if any. Going from the oldest, each segment is
/// stacked on the runs before it, and the newest run joins the one before it while both are
/// below [`MERGE_BELOW`] and the older is less than twice as large (appends of any sizes), or
/// either holds no rows (a schema-only segment). The small runs left are thus each less than
/// half the one before: a byte is rewritten O(log n) times over n appends, and a dataset
/// keeps O(log n) small segments, less than twice [`MERGE_BELOW`] in all at its end.
fn plan_merge(segments: &[Segment]) -> Option<Range<usize>> {
    struct Run {
        start: usize,
        bytes: u64,
        rows: u64,
    }
    let comparable = |older: &Run, newer: &Run| {
        older.bytes < MERGE_BELOW
            && newer.bytes < MERGE_BELOW
            && (older.rows == 0 || newer.rows == 0 || newer.bytes.saturating_mul(2) >= older.bytes)
    };
    let mut stack: Vec<Run> = Vec::new();
    for (index, segment) in segments.iter().enumerate() {
        stack.push(Run {
            start: index,
            bytes: segment.bytes,
            rows: segment.rows,
        });
        while let [.., older, newer] = stack.as_slice()
            && comparable(older, newer)
        {
            let newer = stack.pop()?;
            let older = stack.last_mut()?;
            older.bytes = older.bytes.saturating_add(newer.bytes);
            older.rows = older.rows.saturating_add(newer.rows);
        }
    }
    // The first run of more than one segment.
    let ends = stack
        .iter()
        .skip(1)
        .map(|run| run.start)
        .chain([segments.len()]);
    stack
        .iter()
        .zip(ends)
        .map(|(run, end)| run.start..end)
        .find(|run| run.len() > 1)
}

/// Opens `root` and reads what it holds, on a blocking thread.
pub(crate) async fn open(root: PathBuf) -> Result<(DataDir, Manifest), StoreError> {
    tokio::task::spawn_blocking(move || DataDir::open(&root))
        .await
        .map_err(|e| StoreError::Persist(format!("opening the data directory failed: {e}")))?
        .map_err(StoreError::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Appends of `sizes`, each merged as the merger would before the next comes, run by run.
    fn appended(sizes: &[u64]) -> Vec<Segment> {
        let segment = |bytes: u64| Segment {
            file: String::new(),
            rows: bytes / 8,
            bytes,
            checksum: 0,
            data_bytes: bytes,
        };
        let mut segments = Vec::new();
        for &bytes in sizes {
            segments.push(segment(bytes));
            while let Some(run) = plan_merge(&segments) {
                let merged: Vec<Segment> = segments.drain(run.clone()).collect();
                let bytes = merged.iter().map(|s| s.bytes).sum();
                segments.insert(run.start, segment(bytes));
            }
        }
        segments
    }

    /// Appends of sizes that vary (a larger one after a smaller) are merged as well as
    /// uniform ones: what stays in small files is less than twice [`MERGE_BELOW`] in all, so the
    /// rest can go back to the data directory when memory is needed.
    #[test]
    fn small_files_are_merged_whatever_the_appends_sizes() {
        let kib = 1u64 << 10;
        let varying: Vec<u64> = (0..100u64).map(|i| (96 + (i * 37) % 305) * kib).collect();
        for sizes in [vec![320 * kib; 100], varying] {
            let segments = appended(&sizes);
            let small: u64 = segments
                .iter()
                .filter(|s| s.bytes < MERGE_BELOW)
                .map(|s| s.bytes)
                .sum();
            assert!(small < 2 * MERGE_BELOW, "{small} bytes left in small files");
            let total: u64 = segments.iter().map(|s| s.bytes).sum();
            assert_eq!(total, sizes.iter().sum::<u64>());
        }
    }
}
