//! Pretend devices for the placement and export tests: the host backend split into devices
//! with a budget each, and [`PretendGpus`], whose partitions export as if they were on GPUs.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arrow::array::{ArrayRef, Int64Array};
use arrow::compute::concat_batches;
use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use futures::future::BoxFuture;
use futures::{FutureExt, TryStreamExt};
use gpu_flight::backend::{
    Backend, BackendError, DeviceInfo, ExportDevice, ExportedArray, ExportedColumn, HostBackend,
    Partition,
};
use gpu_flight::store::{PutMode, Store, StoreError, StoreOptions};

/// Rows of one batch: 1.6 MB of int64, above the size the host backend concatenates at commit,
/// so partitions stay as they were placed.
pub const ROWS: i64 = 200_000;
/// Each pretend device holds two such batches, not three.
pub const LIMIT: u64 = 4_000_000;

/// A store over `backend` with [`LIMIT`] per device.
pub fn store_over(backend: Arc<dyn Backend>) -> Store {
    Store::new(
        backend,
        StoreOptions {
            memory_limit: Some(LIMIT),
            // The device's limit alone: no host tier to spill to.
            host_memory_limit: Some(0),
            ..StoreOptions::default()
        },
    )
}

/// A store over `devices` pretend host devices.
pub fn store(devices: u32) -> Store {
    store_over(Arc::new(HostBackend::new().with_devices(devices)))
}

/// Batch `index`: [`ROWS`] consecutive int64s from `index * ROWS`.
pub fn batch(index: i64) -> RecordBatch {
    let column: ArrayRef = Arc::new(Int64Array::from_iter_values(
        index * ROWS..(index + 1) * ROWS,
    ));
    RecordBatch::try_from_iter([("x", column)]).expect("batch")
}

/// Puts `batches` as `name`, on `device` or where the store places them.
pub async fn put(
    store: &Store,
    name: &str,
    mode: PutMode,
    device: Option<u32>,
    batches: &[RecordBatch],
) -> Result<(), StoreError> {
    let mut pending = store.begin_put_on(name.to_owned(), mode, "test", device)?;
    pending.declare_schema(batches[0].schema())?;
    for batch in batches {
        if let Some(upload) = pending.upload(batch.clone(), None).await? {
            pending.add(upload.await?);
        }
    }
    pending.commit().await.map(|_| ())
}

/// Every row of `name`, as one batch.
pub async fn read_all(store: &Store, name: &str) -> RecordBatch {
    let dataset = store.get(name).expect("dataset");
    let batches: Vec<RecordBatch> = dataset
        .read(0..dataset.num_rows(), 1 << 20, 2)
        .expect("read")
        .try_collect()
        .await
        .expect("read");
    concat_batches(&dataset.schema(), &batches).expect("concat")
}

/// Each device's reserved bytes.
pub fn used(store: &Store) -> Vec<u64> {
    store
        .status()
        .devices
        .iter()
        .map(|d| d.used_bytes)
        .collect()
}

/// `batches` as one.
pub fn rows(batches: &[RecordBatch]) -> RecordBatch {
    concat_batches(&batches[0].schema(), batches).expect("concat")
}

/// The host backend's pretend devices, with exports: each exported column gets a made-up
/// handle naming its partition and column, and each device a made-up UUID, so the store's
/// export logic (every partition, peers, replicas and their leases) runs without a GPU.
/// Nothing can map these handles.
#[derive(Debug)]
pub struct PretendGpus {
    host: HostBackend,
    devices: u32,
    /// Whether devices can reach each other's memory (each can always reach its own).
    peer_access: bool,
}

impl PretendGpus {
    pub fn new(devices: u32, peer_access: bool) -> Self {
        Self {
            host: HostBackend::new().with_devices(devices),
            devices,
            peer_access,
        }
    }

    /// The UUID pretend device `device` reports.
    pub fn uuid(device: u32) -> String {
        format!("GPU-00000000-0000-0000-0000-{device:012}")
    }
}

#[derive(Debug)]
struct PretendPartition {
    inner: Arc<dyn Partition>,
    schema: SchemaRef,
    device: u32,
    /// Unique per partition: what its handles are made of.
    id: u64,
}

fn wrap(inner: Arc<dyn Partition>, schema: SchemaRef, device: u32) -> Arc<dyn Partition> {
    static IDS: AtomicU64 = AtomicU64::new(1);
    Arc::new(PretendPartition {
        inner,
        schema,
        device,
        id: IDS.fetch_add(1, Ordering::Relaxed),
    })
}

fn unwrap(partition: &Arc<dyn Partition>) -> &PretendPartition {
    partition
        .as_any()
        .downcast_ref::<PretendPartition>()
        .expect("a pretend partition")
}

/// The 64 handle bytes of column `column` of partition `id`.
pub fn pretend_handle(id: u64, column: usize) -> [u8; 64] {
    let mut handle = [0u8; 64];
    handle[..8].copy_from_slice(&id.to_le_bytes());
    handle[8..16].copy_from_slice(&(column as u64).to_le_bytes());
    handle
}

impl Partition for PretendPartition {
    fn num_rows(&self) -> usize {
        self.inner.num_rows()
    }
    fn bytes(&self) -> u64 {
        self.inner.bytes()
    }
    fn read(
        &self,
        offset: usize,
        len: usize,
        columns: Option<&[usize]>,
    ) -> BoxFuture<'static, Result<RecordBatch, BackendError>> {
        self.inner.read(offset, len, columns)
    }
    fn column_bytes(&self, columns: &[usize]) -> Option<u64> {
        self.inner.column_bytes(columns)
    }
    fn export(
        &self,
        columns: &[usize],
    ) -> Result<(ExportDevice, Vec<ExportedColumn>), BackendError> {
        let device = ExportDevice {
            ordinal: self.device,
            uuid: PretendGpus::uuid(self.device),
            pci_bus_id: format!("0000:{:02x}:00.0", self.device),
        };
        let columns = columns
            .iter()
            .map(|&column| ExportedColumn {
                handle: pretend_handle(self.id, column),
                allocation_bytes: self.inner.bytes(),
                array: ExportedArray {
                    data_type: self.schema.field(column).data_type().clone(),
                    length: self.inner.num_rows() as u64,
                    null_count: 0,
                    buffers: Vec::new(),
                    children: Vec::new(),
                    dictionary: None,
                },
            })
            .collect();
        Ok((device, columns))
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Backend for PretendGpus {
    fn name(&self) -> &'static str {
        "pretend-gpus"
    }
    fn devices(&self) -> Vec<DeviceInfo> {
        self.host
            .devices()
            .into_iter()
            .map(|mut info| {
                info.uuid = Some(Self::uuid(info.ordinal));
                info
            })
            .collect()
    }
    fn stored_size(&self, batch: &RecordBatch) -> Result<u64, BackendError> {
        self.host.stored_size(batch)
    }
    fn upload(
        &self,
        device: u32,
        batch: RecordBatch,
    ) -> BoxFuture<'static, Result<Arc<dyn Partition>, BackendError>> {
        let schema = batch.schema();
        self.host
            .upload(device, batch)
            .map(move |uploaded| uploaded.map(|p| wrap(p, schema, device)))
            .boxed()
    }
    fn keeps_decoded_arrays(&self) -> bool {
        self.host.keeps_decoded_arrays()
    }
    fn compacts(
        &self,
        schema: &arrow::datatypes::Schema,
        partitions: &[Arc<dyn Partition>],
    ) -> bool {
        let inner: Vec<_> = partitions
            .iter()
            .map(|p| Arc::clone(&unwrap(p).inner))
            .collect();
        self.host.compacts(schema, &inner)
    }
    fn compacted_size(&self, partitions: &[Arc<dyn Partition>]) -> Result<u64, BackendError> {
        let inner: Vec<_> = partitions
            .iter()
            .map(|p| Arc::clone(&unwrap(p).inner))
            .collect();
        self.host.compacted_size(&inner)
    }
    fn compact(
        &self,
        partitions: Vec<Arc<dyn Partition>>,
    ) -> BoxFuture<'static, Result<Arc<dyn Partition>, BackendError>> {
        let first = unwrap(&partitions[0]);
        let (schema, device) = (Arc::clone(&first.schema), first.device);
        let inner: Vec<_> = partitions
            .iter()
            .map(|p| Arc::clone(&unwrap(p).inner))
            .collect();
        self.host
            .compact(inner)
            .map(move |joined| joined.map(|p| wrap(p, schema, device)))
            .boxed()
    }
    fn copied_size(
        &self,
        partition: &Arc<dyn Partition>,
        columns: &[usize],
    ) -> Result<u64, BackendError> {
        self.host.copied_size(&unwrap(partition).inner, columns)
    }
    fn copy_to(
        &self,
        partition: Arc<dyn Partition>,
        columns: Vec<usize>,
        device: u32,
    ) -> BoxFuture<'static, Result<Arc<dyn Partition>, BackendError>> {
        let source = unwrap(&partition);
        let schema = Arc::new(source.schema.project(&columns).expect("columns"));
        self.host
            .copy_to(Arc::clone(&source.inner), columns, device)
            .map(move |copied| copied.map(|p| wrap(p, schema, device)))
            .boxed()
    }
    fn peer_access(&self) -> Vec<Vec<bool>> {
        (0..self.devices)
            .map(|a| {
                (0..self.devices)
                    .map(|b| a == b || self.peer_access)
                    .collect()
            })
            .collect()
    }
}
