//! Persistence (`--data-dir`): committed datasets written to disk by one writer task, in the
//! order they were committed, and loaded back when the server starts.
//!
//! Every catalog change (a put, a copy, a drop) queues a job while it still holds the
//! catalog's entry for the name, so the jobs for one name are in commit order. The writer reads
//! what a commit added back out of the dataset (through the staging path on a GPU) in segments
//! of at most [`SEGMENT_BYTES`], writes them as Arrow IPC files and then commits a manifest
//! naming them (`files`). An append adds segments to what the manifest holds for the name
//! when that is the version it appended to; anything else writes the dataset whole. A move
//! changes where the rows are, not what they are: it only renames the version.
//!
//! Under `--durability sync` a commit waits for its job and fails (undoing itself in the
//! catalog) if the disk does; under `async` it is acknowledged at once, and a failed write is
//! logged and counted while the dataset stays served from memory. Either way a crash leaves
//! each dataset at a version that was whole on disk.

use std::collections::HashMap;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures::TryStreamExt;
use tokio::sync::{mpsc, oneshot};

use super::files::{DataDir, FilesError, Manifest, Segment};
use super::{Dataset, StoreError};

/// Most Arrow bytes in one segment file: what the writer holds in host memory at once.
const SEGMENT_BYTES: u64 = 256 << 20;

/// When a commit is acknowledged under `--data-dir`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Durability {
    /// Once it is on disk (fsync'd): an acknowledged put survives a crash.
    #[default]
    Sync,
    /// At once; the disk catches up in commit order. A crash may lose the latest commits,
    /// never tear one.
    Async,
}

/// Where a job reports its outcome, when its commit waits for it.
pub(super) type Done = Option<oneshot::Sender<Result<(), StoreError>>>;

/// A queued job's outcome, when the commit must wait for it (`--durability sync`).
pub(super) type Persisted = Option<oneshot::Receiver<Result<(), StoreError>>>;

/// A catalog change to make durable.
pub(super) enum Job {
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
}

/// The handle commits queue their jobs on.
#[derive(Debug)]
pub(super) struct Durable {
    /// Taken (closing the queue) by [`Durable::close`].
    jobs: std::sync::Mutex<Option<mpsc::UnboundedSender<Job>>>,
    writer: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    pub(super) durability: Durability,
    pub(super) root: PathBuf,
    pub(super) counters: Arc<Counters>,
}

/// What the writer did, for `status`.
#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) written_bytes: AtomicU64,
    pub(super) segments: AtomicU64,
    pub(super) failures: AtomicU64,
    /// Jobs queued and not yet done.
    pub(super) pending: AtomicU64,
}

impl Durable {
    /// Starts the writer over `dir`, whose manifest is `manifest`; `loaded` maps each name
    /// to the in-memory version its manifest entry was loaded as.
    pub(super) fn start(
        dir: DataDir,
        manifest: Manifest,
        loaded: HashMap<String, u64>,
        durability: Durability,
    ) -> Self {
        let (jobs, receiver) = mpsc::unbounded_channel();
        let root = dir.root().to_path_buf();
        let counters = Arc::new(Counters::default());
        let writer = Writer {
            dir: Some(dir),
            manifest,
            persisted: loaded,
            counters: Arc::clone(&counters),
        };
        let writer = tokio::spawn(writer.run(receiver));
        Self {
            jobs: std::sync::Mutex::new(Some(jobs)),
            writer: std::sync::Mutex::new(Some(writer)),
            durability,
            root,
            counters,
        }
    }

    /// Queues `job`. Returns a receiver for its outcome where the caller must wait for it.
    pub(super) fn queue(&self, make: impl FnOnce(Done) -> Job) -> Persisted {
        let (sender, receiver) = match self.durability {
            Durability::Sync => {
                let (sender, receiver) = oneshot::channel();
                (Some(sender), Some(receiver))
            }
            Durability::Async => (None, None),
        };
        let jobs = self.jobs.lock().unwrap_or_else(|p| p.into_inner());
        let sent = jobs
            .as_ref()
            .is_some_and(|jobs| jobs.send(make(sender)).is_ok());
        if sent {
            self.counters.pending.fetch_add(1, Ordering::Relaxed);
        } else {
            // Only after `close`, or when the runtime is going away.
            tracing::warn!("the persistence writer has stopped; a change was not written");
        }
        receiver
    }

    /// Stops taking changes and waits until every one queued is on disk, and the data
    /// directory is closed (its lock released).
    pub(super) async fn close(&self) {
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
pub(super) async fn wait(receiver: Persisted) -> Result<(), StoreError> {
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
    manifest: Manifest,
    /// Name to the in-memory version its manifest entry holds.
    persisted: HashMap<String, u64>,
    counters: Arc<Counters>,
}

impl Writer {
    async fn run(mut self, mut jobs: mpsc::UnboundedReceiver<Job>) {
        while let Some(job) = jobs.recv().await {
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
            };
            self.counters.pending.fetch_sub(1, Ordering::Relaxed);
            if let Err(error) = &result {
                self.counters.failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%error, "a change was not made durable");
            }
            if let Some(done) = done {
                let _ = done.send(result);
            }
            if self.dir.is_none() {
                tracing::error!("the data directory was lost to a failed task; persistence stops");
                return;
            }
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

    async fn write(
        &mut self,
        dataset: &Arc<Dataset>,
        base: Option<u64>,
        rows: Range<u64>,
    ) -> Result<(), StoreError> {
        let name = dataset.name().to_owned();
        // Already there: an undo puts back the version a refused change would have replaced.
        if self.persisted.get(&name) == Some(&dataset.version())
            && self.manifest.datasets.contains_key(&name)
        {
            return Ok(());
        }
        let append = base.is_some()
            && base == self.persisted.get(&name).copied()
            && self.manifest.datasets.contains_key(&name);
        let rows = if append { rows } else { 0..dataset.num_rows() };
        let mut written: Vec<Segment> = Vec::new();
        let result = self
            .write_segments(dataset, rows, append, &mut written)
            .await;
        let result = match result {
            Ok(()) => {
                let mut manifest = self.manifest.clone();
                let entry = manifest.datasets.entry(name.clone()).or_insert_with(|| {
                    super::files::DatasetEntry {
                        version: dataset.version(),
                        tag: None,
                        segments: Vec::new(),
                    }
                });
                if !append {
                    entry.segments.clear();
                }
                entry.version = dataset.version();
                entry.tag = Some(dataset.version_id().tag);
                entry.segments.extend(written.iter().cloned());
                let committed = manifest.clone();
                match self.blocking(move |dir| dir.commit(&committed)).await {
                    Ok(()) => {
                        self.manifest = manifest;
                        self.persisted.insert(name, dataset.version());
                        return Ok(());
                    }
                    Err(error) => Err(error),
                }
            }
            Err(error) => Err(error),
        };
        // Nothing names the new segments: give their space back (the files layer keeps any
        // a manifest on disk might name).
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
        while start < rows.end {
            let end = rows.end.min(start + rows_per_segment);
            let batches: Vec<_> = dataset.read(start..end, 8 << 20, 2)?.try_collect().await?;
            let schema = Arc::clone(&schema);
            let segment = self
                .blocking(move |dir| dir.write_segment(&schema, &batches))
                .await?;
            self.counters
                .written_bytes
                .fetch_add(segment.bytes, Ordering::Relaxed);
            self.counters.segments.fetch_add(1, Ordering::Relaxed);
            written.push(segment);
            start = end;
        }
        Ok(())
    }

    async fn remove(&mut self, name: &str) -> Result<(), StoreError> {
        self.persisted.remove(name);
        if !self.manifest.datasets.contains_key(name) {
            return Ok(());
        }
        let mut manifest = self.manifest.clone();
        manifest.datasets.remove(name);
        let committed = manifest.clone();
        self.blocking(move |dir| dir.commit(&committed)).await?;
        self.manifest = manifest;
        Ok(())
    }
}

/// Opens `root` and reads what it holds, on a blocking thread.
pub(super) async fn open(root: PathBuf) -> Result<(DataDir, Manifest), StoreError> {
    tokio::task::spawn_blocking(move || DataDir::open(&root))
        .await
        .map_err(|e| StoreError::Persist(format!("opening the data directory failed: {e}")))?
        .map_err(StoreError::from)
}
