//! The CUDA backend: datasets in GPU memory.
//!
//! - `ffi`: every `unsafe` line, the driver calls and the RAII types around them.
//! - `staging`: the pool of pinned host buffers transfers go through.
//! - `layout`: how a batch lies in device memory and how row ranges come back.
//!
//! An upload copies the batch's buffers into a pinned staging buffer laid out exactly as the
//! device allocation, then issues one host-to-device copy and waits on its own stream, on a
//! blocking thread: the store keeps several uploads in flight, so the CPU copy of one batch
//! overlaps the DMA of another while more messages arrive. A read copies a row range back in
//! one synchronization per round (see `layout`) into pinned memory that the returned Arrow
//! arrays use directly; the store keeps the next chunk's read in flight while the previous one
//! is encoded and sent.
//!
//! The driver is loaded at run time (cudarc's dynamic loading), so the binary builds and runs
//! without CUDA; [`CudaBackend::open`] checks for the library before touching it, because
//! cudarc panics on first use when it is missing.

mod ffi;
mod layout;
mod staging;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use futures::FutureExt;
use futures::future::BoxFuture;
use serde_json::{Map, Value, json};

use super::{Backend, BackendError, DeviceInfo, Partition, check_rows};
use ffi::{Context, DeviceAllocation, Stream};
use layout::{DeviceArray, UploadPlan};
use staging::PinnedPool;

/// Pinned memory kept for reuse between transfers.
const MAX_CACHED_PINNED_BYTES: u64 = 1 << 30;

/// Why CUDA cannot be used here, if it cannot; `None` when a driver and device `ordinal` exist.
pub fn unavailable_reason(ordinal: u32) -> Option<String> {
    if !ffi::driver_present() {
        return Some("no NVIDIA driver library (libcuda) could be loaded".to_owned());
    }
    match ffi::device_count() {
        Ok(0) => Some("the NVIDIA driver reports no CUDA device".to_owned()),
        Ok(count) if i64::from(ordinal) >= i64::from(count) => Some(format!(
            "there is no CUDA device {ordinal}; this machine has {count} (0..{})",
            count - 1
        )),
        Ok(_) => None,
        Err(error) => Some(format!("the CUDA driver failed to initialize: {error}")),
    }
}

/// Keeps datasets in the memory of one GPU.
#[derive(Debug)]
pub struct CudaBackend {
    shared: Arc<Shared>,
    name: String,
    total_bytes: u64,
}

/// What uploads, partitions and reads share.
#[derive(Debug)]
struct Shared {
    context: Arc<Context>,
    pool: Arc<PinnedPool>,
    streams: Mutex<Vec<Stream>>,
    counters: Counters,
}

#[derive(Debug, Default)]
struct Counters {
    device_bytes: AtomicU64,
    uploads: AtomicU64,
    upload_syncs: AtomicU64,
    read_chunks: AtomicU64,
    read_syncs: AtomicU64,
}

impl CudaBackend {
    /// Opens GPU `ordinal`, or says why it cannot.
    pub fn open(ordinal: u32) -> Result<Self, BackendError> {
        if let Some(reason) = unavailable_reason(ordinal) {
            return Err(BackendError::Device(reason));
        }
        let ordinal = i32::try_from(ordinal)
            .map_err(|_| BackendError::Device(format!("device ordinal {ordinal} is too large")))?;
        let context = Context::open(ordinal)?;
        let name = context.name()?;
        let total_bytes = context.total_bytes()?;
        let pool = PinnedPool::new(Arc::clone(&context), MAX_CACHED_PINNED_BYTES);
        Ok(Self {
            shared: Arc::new(Shared {
                context,
                pool,
                streams: Mutex::new(Vec::new()),
                counters: Counters::default(),
            }),
            name,
            total_bytes,
        })
    }
}

impl Shared {
    /// Runs `work` with a stream from the pool.
    fn with_stream<T>(
        &self,
        work: impl FnOnce(&mut Stream) -> Result<T, BackendError>,
    ) -> Result<T, BackendError> {
        let pooled = self.streams.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut stream = match pooled {
            Some(stream) => stream,
            None => Stream::new(&self.context)?,
        };
        let result = work(&mut stream);
        self.streams
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(stream);
        result
    }

    fn upload(self: &Arc<Self>, batch: RecordBatch) -> Result<Arc<dyn Partition>, BackendError> {
        let plan = UploadPlan::new(&batch)?;
        let bytes = plan.allocation_bytes();
        let allocation = TrackedAllocation::new(self, bytes)?;
        let mut staging = self.pool.lease(plan.used_bytes)?;
        layout::fill_staging(&plan, &mut staging);
        self.with_stream(|stream| {
            let mut copies = stream.copies()?;
            copies.copy_to_device(&allocation.inner, 0, staging.as_ref(), 0..plan.used_bytes)?;
            copies.finish()
        })?;
        self.counters.uploads.fetch_add(1, Ordering::Relaxed);
        self.counters.upload_syncs.fetch_add(1, Ordering::Relaxed);
        Ok(Arc::new(CudaPartition {
            shared: Arc::clone(self),
            allocation: Arc::new(allocation),
            columns: Arc::new(plan.columns),
            schema: batch.schema(),
            rows: batch.num_rows(),
        }))
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn devices(&self) -> Vec<DeviceInfo> {
        vec![DeviceInfo {
            ordinal: self.shared.context.ordinal() as u32,
            name: self.name.clone(),
            total_bytes: Some(self.total_bytes),
        }]
    }

    fn stored_size(&self, batch: &RecordBatch) -> Result<u64, BackendError> {
        Ok(UploadPlan::new(batch)?.allocation_bytes() as u64)
    }

    fn upload(
        &self,
        _device: u32,
        batch: RecordBatch,
    ) -> BoxFuture<'static, Result<Arc<dyn Partition>, BackendError>> {
        let shared = Arc::clone(&self.shared);
        let task = tokio::task::spawn_blocking(move || shared.upload(batch));
        task.map(flatten_join).boxed()
    }

    fn counters(&self) -> Map<String, Value> {
        let c = &self.shared.counters;
        let free = self.shared.context.memory_info().map(|(free, _)| free).ok();
        let counters = json!({
            "device_allocated_bytes": c.device_bytes.load(Ordering::Acquire),
            "device_free_bytes": free,
            "pinned_leased_bytes": self.shared.pool.leased_bytes(),
            "pinned_cached_bytes": self.shared.pool.cached_bytes(),
            "uploads": c.uploads.load(Ordering::Relaxed),
            "upload_syncs": c.upload_syncs.load(Ordering::Relaxed),
            "read_chunks": c.read_chunks.load(Ordering::Relaxed),
            "read_syncs": c.read_syncs.load(Ordering::Relaxed),
        });
        match counters {
            Value::Object(map) => map,
            _ => Map::new(),
        }
    }
}

fn flatten_join<T>(
    joined: Result<Result<T, BackendError>, tokio::task::JoinError>,
) -> Result<T, BackendError> {
    joined.unwrap_or_else(|e| Err(BackendError::Device(format!("a transfer task failed: {e}"))))
}

/// A device allocation counted in the backend's `device_allocated_bytes`.
#[derive(Debug)]
struct TrackedAllocation {
    inner: DeviceAllocation,
    shared: Arc<Shared>,
}

impl TrackedAllocation {
    fn new(shared: &Arc<Shared>, bytes: usize) -> Result<Self, BackendError> {
        let inner = DeviceAllocation::new(&shared.context, bytes)?;
        shared
            .counters
            .device_bytes
            .fetch_add(bytes as u64, Ordering::AcqRel);
        Ok(Self {
            inner,
            shared: Arc::clone(shared),
        })
    }
}

impl Drop for TrackedAllocation {
    fn drop(&mut self) {
        self.shared
            .counters
            .device_bytes
            .fetch_sub(self.inner.bytes() as u64, Ordering::AcqRel);
    }
}

/// One uploaded batch in device memory.
#[derive(Debug)]
struct CudaPartition {
    shared: Arc<Shared>,
    allocation: Arc<TrackedAllocation>,
    columns: Arc<Vec<DeviceArray>>,
    schema: SchemaRef,
    rows: usize,
}

impl Partition for CudaPartition {
    fn num_rows(&self) -> usize {
        self.rows
    }

    fn bytes(&self) -> u64 {
        self.allocation.inner.bytes() as u64
    }

    fn read(
        &self,
        offset: usize,
        len: usize,
    ) -> BoxFuture<'static, Result<RecordBatch, BackendError>> {
        if let Err(error) = check_rows(offset, len, self.rows) {
            return futures::future::ready(Err(error)).boxed();
        }
        let shared = Arc::clone(&self.shared);
        let allocation = Arc::clone(&self.allocation);
        let columns = Arc::clone(&self.columns);
        let schema = Arc::clone(&self.schema);
        let task = tokio::task::spawn_blocking(move || {
            let (batch, syncs) = shared.with_stream(|stream| {
                layout::read_rows(
                    &allocation.inner,
                    &columns,
                    &schema,
                    offset..offset + len,
                    stream,
                    &shared.pool,
                )
            })?;
            shared.counters.read_chunks.fetch_add(1, Ordering::Relaxed);
            shared
                .counters
                .read_syncs
                .fetch_add(syncs, Ordering::Relaxed);
            Ok(batch)
        });
        task.map(flatten_join).boxed()
    }
}
