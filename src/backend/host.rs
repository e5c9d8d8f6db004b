//! The host-memory backend: batches stay in the process's memory exactly as they were decoded.
//!
//! It is the default where no NVIDIA driver exists and what CI tests, so it implements the
//! whole [`Backend`] contract with no shortcuts: sizes are real, reads honour row ranges, and
//! memory is returned when the last [`Partition`] reference goes.

use std::sync::Arc;

use arrow::array::{Array, ArrayRef};
use arrow::datatypes::DataType;
use arrow::record_batch::{RecordBatch, RecordBatchOptions};
use futures::FutureExt;
use futures::future::BoxFuture;

use super::{
    Backend, BackendError, DeviceInfo, Partition, PartitionExport, check_rows, dictionary,
    downcast_all,
};
use crate::batch_size::batch_bytes;

/// Keeps datasets in host memory. Stateless: memory accounting is the store's job.
#[derive(Debug, Default)]
pub struct HostBackend {
    total_bytes: Option<u64>,
}

impl HostBackend {
    pub fn new() -> Self {
        Self {
            total_bytes: physical_memory_bytes(),
        }
    }
}

impl Backend for HostBackend {
    fn name(&self) -> &'static str {
        "host"
    }

    fn devices(&self) -> Vec<DeviceInfo> {
        vec![DeviceInfo {
            ordinal: 0,
            name: "host memory".to_owned(),
            total_bytes: self.total_bytes,
        }]
    }

    fn stored_size(&self, batch: &RecordBatch) -> Result<u64, BackendError> {
        Ok(batch_bytes(batch))
    }

    fn upload(
        &self,
        _device: u32,
        batch: RecordBatch,
    ) -> BoxFuture<'static, Result<Arc<dyn Partition>, BackendError>> {
        let bytes = batch_bytes(&batch);
        let partition: Arc<dyn Partition> = Arc::new(HostPartition { batch, bytes });
        futures::future::ready(Ok(partition)).boxed()
    }

    fn concatenated_size(&self, partitions: &[Arc<dyn Partition>]) -> Result<u64, BackendError> {
        Ok(partitions.iter().map(|p| p.bytes()).sum())
    }

    /// Arrow's own concatenation, except for dictionary columns, whose dictionaries are merged
    /// (see `dictionary`). It is the host reference the CUDA kernel is checked against.
    fn concatenate(
        &self,
        partitions: Vec<Arc<dyn Partition>>,
    ) -> BoxFuture<'static, Result<Arc<dyn Partition>, BackendError>> {
        let concatenated = downcast_all::<HostPartition>(&partitions, "the host backend")
            .and_then(|parts| concatenate_batches(&parts));
        futures::future::ready(concatenated).boxed()
    }
}

fn concatenate_batches(parts: &[&HostPartition]) -> Result<Arc<dyn Partition>, BackendError> {
    let first = parts
        .first()
        .ok_or_else(|| BackendError::Device("nothing to concatenate".to_owned()))?;
    let schema = first.batch.schema();
    let columns = (0..schema.fields().len())
        .map(|index| {
            let arrays: Vec<&dyn Array> = parts
                .iter()
                .map(|p| p.batch.column(index).as_ref())
                .collect();
            match schema.field(index).data_type() {
                DataType::Dictionary(_, _) => dictionary::concat_on_host(&arrays),
                _ => arrow::compute::concat(&arrays)
                    .map_err(|e| BackendError::Device(format!("concatenating batches: {e}"))),
            }
        })
        .collect::<Result<Vec<ArrayRef>, _>>()?;
    let rows = parts.iter().map(|p| p.batch.num_rows()).sum();
    let options = RecordBatchOptions::new().with_row_count(Some(rows));
    let batch = RecordBatch::try_new_with_options(schema, columns, &options)
        .map_err(|e| BackendError::Device(format!("concatenating batches: {e}")))?;
    let bytes = batch_bytes(&batch);
    Ok(Arc::new(HostPartition { batch, bytes }))
}

#[derive(Debug)]
struct HostPartition {
    batch: RecordBatch,
    bytes: u64,
}

impl Partition for HostPartition {
    fn num_rows(&self) -> usize {
        self.batch.num_rows()
    }

    fn bytes(&self) -> u64 {
        self.bytes
    }

    fn read(
        &self,
        offset: usize,
        len: usize,
    ) -> BoxFuture<'static, Result<RecordBatch, BackendError>> {
        let result =
            check_rows(offset, len, self.batch.num_rows()).map(|()| self.batch.slice(offset, len));
        futures::future::ready(result).boxed()
    }

    fn export(&self, _columns: &[usize]) -> Result<PartitionExport, BackendError> {
        Err(BackendError::NotExportable { backend: "host" })
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Total physical memory from `/proc/meminfo`, where there is one; `status` reports it as the
/// host "device" capacity.
fn physical_memory_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
