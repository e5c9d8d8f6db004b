//! What the store's unit tests share: batches, puts, and a backend that holds compactions
//! and copies until the test lets them go on.

use std::sync::Arc;

use arrow::array::{ArrayRef, Int64Array};
use arrow::record_batch::RecordBatch;
use futures::FutureExt;
use futures::future::BoxFuture;

use super::{PendingPut, PutMode, Store, StoreOptions};
use crate::backend::{Backend, BackendError, DeviceInfo, HostBackend, Partition};

/// One int64 column `x` holding `values`.
pub(super) fn batch(values: std::ops::Range<i64>) -> RecordBatch {
    let column: ArrayRef = Arc::new(Int64Array::from_iter_values(values));
    RecordBatch::try_from_iter([("x", column)]).expect("batch")
}

/// A put of `batches` to dataset `t`, uploaded and ready to commit.
pub(super) async fn put(store: &Store, mode: PutMode, batches: Vec<RecordBatch>) -> PendingPut {
    let mut pending = store
        .begin_put("t".to_owned(), mode, "test")
        .expect("begin");
    pending.declare_schema(batches[0].schema()).expect("schema");
    for b in batches {
        if let Some(upload) = pending.upload(b, None).await.expect("reserve") {
            pending.add(upload.await.expect("upload"));
        }
    }
    pending
}

/// Which of its operations a [`GatedBackend`] holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Gate {
    Compactions,
    Copies,
    /// Uploads, which run on a task of their own, as the cuda backend's do: dropping the
    /// future does not stop them.
    Uploads,
}

/// The host backend, but one kind of operation ([`Gate`]) waits for `release` (after saying
/// it started), so a test can act while a commit, a background compaction, a copy or an
/// upload is running.
#[derive(Debug)]
pub(super) struct GatedBackend {
    host: HostBackend,
    pub(super) started: Arc<tokio::sync::Notify>,
    pub(super) release: Arc<tokio::sync::Notify>,
    gate: Gate,
}

impl GatedBackend {
    pub(super) fn new(host: HostBackend, gate: Gate) -> Self {
        Self {
            host,
            started: Arc::new(tokio::sync::Notify::new()),
            release: Arc::new(tokio::sync::Notify::new()),
            gate,
        }
    }

    fn gate<T: Send + 'static>(&self, work: BoxFuture<'static, T>) -> BoxFuture<'static, T> {
        let (started, release) = (Arc::clone(&self.started), Arc::clone(&self.release));
        async move {
            started.notify_one();
            release.notified().await;
            work.await
        }
        .boxed()
    }
}

impl Backend for GatedBackend {
    fn name(&self) -> &'static str {
        "gated"
    }
    fn devices(&self) -> Vec<DeviceInfo> {
        self.host.devices()
    }
    fn stored_size(&self, batch: &RecordBatch) -> Result<u64, BackendError> {
        self.host.stored_size(batch)
    }
    fn upload(
        &self,
        device: u32,
        batch: RecordBatch,
    ) -> BoxFuture<'static, Result<Arc<dyn Partition>, BackendError>> {
        let upload = self.host.upload(device, batch);
        if self.gate != Gate::Uploads {
            return upload;
        }
        let task = tokio::spawn(self.gate(upload));
        task.map(|joined| {
            joined.unwrap_or_else(|e| Err(BackendError::Device(format!("upload task: {e}"))))
        })
        .boxed()
    }
    fn compacted_size(&self, partitions: &[Arc<dyn Partition>]) -> Result<u64, BackendError> {
        self.host.compacted_size(partitions)
    }
    fn copied_size(
        &self,
        partition: &Arc<dyn Partition>,
        columns: &[usize],
    ) -> Result<u64, BackendError> {
        self.host.copied_size(partition, columns)
    }
    fn copy_to(
        &self,
        partition: Arc<dyn Partition>,
        columns: Vec<usize>,
        device: u32,
    ) -> BoxFuture<'static, Result<Arc<dyn Partition>, BackendError>> {
        let copy = self.host.copy_to(partition, columns, device);
        if self.gate == Gate::Copies {
            self.gate(copy)
        } else {
            copy
        }
    }
    fn compact(
        &self,
        partitions: Vec<Arc<dyn Partition>>,
    ) -> BoxFuture<'static, Result<Arc<dyn Partition>, BackendError>> {
        let compacted = self.host.compact(partitions);
        if self.gate == Gate::Compactions {
            self.gate(compacted)
        } else {
            compacted
        }
    }
}

/// A directory of a test's own for a store's data (`--data-dir`), under the system's
/// temporary one: emptied first, removed when dropped.
pub(super) struct DataDir(std::path::PathBuf);

impl DataDir {
    pub(super) fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("gpu-flight-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Self(dir)
    }

    /// Bytes of the segment files here.
    pub(super) fn segment_bytes(&self) -> u64 {
        std::fs::read_dir(self.0.join("segments"))
            .map(|entries| {
                entries
                    .filter_map(|entry| entry.ok()?.metadata().ok())
                    .map(|metadata| metadata.len())
                    .sum()
            })
            .unwrap_or(0)
    }

    /// Options that persist here, with `memory_limit` for each device and
    /// `host_memory_limit` for the host tier (0: none, the host backend's default).
    pub(super) fn options(
        &self,
        memory_limit: Option<u64>,
        host_memory_limit: u64,
    ) -> StoreOptions {
        StoreOptions {
            data_dir: Some(self.0.clone()),
            memory_limit,
            host_memory_limit: Some(host_memory_limit),
            ..StoreOptions::default()
        }
    }
}

impl Drop for DataDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A store over the host backend, opened with `options`.
pub(super) async fn open_host(options: &StoreOptions) -> Store {
    Store::open(Arc::new(HostBackend::new()), options.clone())
        .await
        .expect("open")
}

/// `store` closed, and its directory opened again over `backend`: a restart, whose store holds
/// only what the directory does.
pub(super) async fn reopened(
    store: Store,
    backend: Arc<dyn Backend>,
    options: &StoreOptions,
) -> Store {
    store.close().await;
    drop(store);
    Store::open(backend, options.clone()).await.expect("reopen")
}
