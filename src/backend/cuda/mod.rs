//! The CUDA backend: datasets in GPU memory.
//!
//! - `ffi`: every `unsafe` line, the driver calls and the RAII types around them.
//! - `staging`: the pool of pinned host buffers transfers go through.
//! - `layout`: how a batch lies in device memory and how row ranges come back.
//! - `concat`: one-launch concatenation of many batches into compact columns
//!   (`kernels/concat.cu`, loaded once from the committed PTX).
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

mod concat;
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

use super::{Backend, BackendError, DeviceInfo, Partition, check_rows, downcast_all};
use concat::{ConcatTask, Fragment};
use ffi::{Context, DeviceAllocation, Kernel, Stream};
use layout::{DeviceArray, Stored, UploadPlan};
use staging::PinnedPool;

/// The concatenation kernel, compiled from `kernels/concat.cu` by `kernels/build_ptx.py`.
const CONCAT_PTX: &str = include_str!("../../../kernels/concat.ptx");

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
    /// `None` where the driver could not load the PTX (it then says why in the log).
    concat_kernel: Option<Kernel>,
    /// Fill concatenation outputs with 0xAB first, so a test sees any byte left unwritten.
    poison_outputs: bool,
    counters: Counters,
}

#[derive(Debug, Default)]
struct Counters {
    device_bytes: AtomicU64,
    uploads: AtomicU64,
    upload_syncs: AtomicU64,
    read_chunks: AtomicU64,
    read_syncs: AtomicU64,
    concat_launches: AtomicU64,
    /// The last concatenation: all of it, and the task-table copy + launch + sync alone.
    concat_last_total_ns: AtomicU64,
    concat_last_kernel_ns: AtomicU64,
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
        let concat_kernel = match Kernel::load(&context, CONCAT_PTX, "gpu_flight_concat") {
            Ok(kernel) => Some(kernel),
            Err(error) => {
                tracing::warn!(%error, "the concatenation kernel did not load; datasets stay in their uploaded batches");
                None
            }
        };
        Ok(Self {
            shared: Arc::new(Shared {
                context,
                pool,
                streams: Mutex::new(Vec::new()),
                concat_kernel,
                poison_outputs: false,
                counters: Counters::default(),
            }),
            name,
            total_bytes,
        })
    }
}

impl CudaBackend {
    /// Poisons every concatenation output before the kernel writes it. For tests: it costs a
    /// device memset per output.
    pub fn with_poisoned_outputs(mut self) -> Self {
        if let Some(shared) = Arc::get_mut(&mut self.shared) {
            shared.poison_outputs = true;
        }
        self
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
            allocations: Arc::new(vec![allocation]),
            columns: Arc::new(plan.columns.into_iter().map(|array| (0, array)).collect()),
            schema: batch.schema(),
            rows: batch.num_rows(),
        }))
    }

    /// Concatenates partitions into one allocation per column with one kernel launch.
    fn concatenate(
        self: &Arc<Self>,
        partitions: &[&CudaPartition],
    ) -> Result<Arc<dyn Partition>, BackendError> {
        let started = std::time::Instant::now();
        let kernel = self.concat_kernel.as_ref().ok_or_else(|| {
            BackendError::Device("the concatenation kernel is not loaded".to_owned())
        })?;
        let first = partitions
            .first()
            .ok_or_else(|| BackendError::Device("nothing to concatenate".to_owned()))?;
        let mut allocations = Vec::new();
        let mut columns = Vec::new();
        let mut tasks = Vec::new();
        for column in 0..first.columns.len() {
            let fragments: Vec<Fragment<'_>> = partitions
                .iter()
                .map(|p| {
                    let (allocation, array) = &p.columns[column];
                    Fragment {
                        base: p.allocations[*allocation].inner.address(),
                        array,
                    }
                })
                .collect();
            let mut used = 0;
            let array = concat::plan_column(&fragments, &mut used)?;
            let bytes = used.max(1).div_ceil(layout::ALLOCATION_GRANULARITY)
                * layout::ALLOCATION_GRANULARITY;
            let allocation = TrackedAllocation::new(self, bytes)?;
            if self.poison_outputs {
                allocation.inner.fill(0xAB)?;
            }
            concat::column_tasks(&fragments, &array, allocation.inner.address(), &mut tasks);
            columns.push((allocations.len(), array));
            allocations.push(allocation);
        }
        let starts = concat::unit_starts(&tasks);
        let table_bytes =
            std::mem::size_of_val(tasks.as_slice()) + std::mem::size_of_val(starts.as_slice());
        let table = TrackedAllocation::new(self, table_bytes)?;
        let mut staging = self.pool.lease(table_bytes)?;
        {
            let target = staging.buffer_mut().as_mut_slice();
            let (task_bytes, rest) = target.split_at_mut(std::mem::size_of_val(tasks.as_slice()));
            for (chunk, task) in task_bytes
                .chunks_exact_mut(std::mem::size_of::<ConcatTask>())
                .zip(&tasks)
            {
                chunk.copy_from_slice(task_bytes_of(task).as_slice());
            }
            for (chunk, start) in rest.chunks_exact_mut(8).zip(&starts) {
                chunk.copy_from_slice(&start.to_le_bytes());
            }
        }
        let sources: Vec<&DeviceAllocation> = partitions
            .iter()
            .flat_map(|p| p.allocations.iter().map(|a| &a.inner))
            .collect();
        let destinations: Vec<&DeviceAllocation> = allocations.iter().map(|a| &a.inner).collect();
        let launched = std::time::Instant::now();
        self.with_stream(|stream| {
            let mut batch = stream.copies()?;
            batch.copy_to_device(&table.inner, 0, staging.as_ref(), 0..table_bytes)?;
            batch.launch_concat(
                kernel,
                &table.inner,
                &tasks,
                &starts,
                &sources,
                &destinations,
            )?;
            batch.finish()
        })?;
        let counters = &self.counters;
        counters.concat_launches.fetch_add(1, Ordering::Relaxed);
        let nanos = |since: std::time::Instant| {
            u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX)
        };
        counters
            .concat_last_kernel_ns
            .store(nanos(launched), Ordering::Relaxed);
        counters
            .concat_last_total_ns
            .store(nanos(started), Ordering::Relaxed);
        let rows = partitions.iter().map(|p| p.rows).sum();
        Ok(Arc::new(CudaPartition {
            shared: Arc::clone(self),
            allocations: Arc::new(allocations),
            columns: Arc::new(columns),
            schema: Arc::clone(&first.schema),
            rows,
        }))
    }
}

/// A compacted column's allocation: its buffers, rounded to the allocation granularity.
fn column_allocation_bytes(used: usize) -> usize {
    used.max(1).div_ceil(layout::ALLOCATION_GRANULARITY) * layout::ALLOCATION_GRANULARITY
}

/// A task's bytes exactly as the kernel reads its `struct Task` (little-endian, no padding).
fn task_bytes_of(task: &ConcatTask) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(std::mem::size_of::<ConcatTask>());
    bytes.extend_from_slice(&task.kind.to_le_bytes());
    bytes.extend_from_slice(&task.reserved.to_le_bytes());
    for field in [task.src, task.dst, task.count, task.src_bit, task.dst_bit] {
        bytes.extend_from_slice(&field.to_le_bytes());
    }
    bytes.extend_from_slice(&task.base.to_le_bytes());
    bytes
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

    fn concatenated_size(&self, partitions: &[Arc<dyn Partition>]) -> Result<u64, BackendError> {
        let parts = downcast_all::<CudaPartition>(partitions, "the cuda backend")?;
        let Some(first) = parts.first() else {
            return Ok(0);
        };
        let mut total = 0;
        for column in 0..first.columns.len() {
            let fragments: Vec<Fragment<'_>> = parts
                .iter()
                .map(|p| Fragment {
                    base: 0,
                    array: &p.columns[column].1,
                })
                .collect();
            let mut used = 0;
            concat::plan_column(&fragments, &mut used)?;
            total += column_allocation_bytes(used) as u64;
        }
        Ok(total)
    }

    fn concatenate(
        &self,
        partitions: Vec<Arc<dyn Partition>>,
    ) -> BoxFuture<'static, Result<Arc<dyn Partition>, BackendError>> {
        let shared = Arc::clone(&self.shared);
        let task = tokio::task::spawn_blocking(move || {
            let parts = downcast_all::<CudaPartition>(&partitions, "the cuda backend")?;
            shared.concatenate(&parts)
        });
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
            "concat_launches": c.concat_launches.load(Ordering::Relaxed),
            "concat_last_total_ns": c.concat_last_total_ns.load(Ordering::Relaxed),
            "concat_last_kernel_ns": c.concat_last_kernel_ns.load(Ordering::Relaxed),
            "concat_kernel_loaded": self.shared.concat_kernel.is_some(),
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

/// Rows in device memory: an uploaded batch (all columns in one allocation) or a concatenation
/// (one allocation per column).
#[derive(Debug)]
struct CudaPartition {
    shared: Arc<Shared>,
    allocations: Arc<Vec<TrackedAllocation>>,
    /// Each column: the index of its allocation, and its layout there.
    columns: Arc<Vec<(usize, DeviceArray)>>,
    schema: SchemaRef,
    rows: usize,
}

impl Partition for CudaPartition {
    fn num_rows(&self) -> usize {
        self.rows
    }

    fn bytes(&self) -> u64 {
        self.allocations
            .iter()
            .map(|a| a.inner.bytes() as u64)
            .sum()
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
        let allocations = Arc::clone(&self.allocations);
        let columns = Arc::clone(&self.columns);
        let schema = Arc::clone(&self.schema);
        let task = tokio::task::spawn_blocking(move || {
            let stored: Vec<Stored<'_>> = columns
                .iter()
                .map(|(allocation, array)| Stored {
                    allocation: &allocations[*allocation].inner,
                    array,
                })
                .collect();
            let (batch, syncs) = shared.with_stream(|stream| {
                layout::read_rows(&stored, &schema, offset..offset + len, stream, &shared.pool)
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

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
