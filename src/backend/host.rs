//! The host-memory backend: batches stay in the process's memory exactly as they were decoded.
//!
//! It is the default where no NVIDIA driver exists and what CI tests, so it implements the
//! whole [`Backend`] contract with no shortcuts: sizes are real, reads honour row ranges, and
//! memory is returned when the last [`Partition`] reference goes. A dataset never keeps the
//! message it came in: uploads keep the buffers Arrow's decoder already copied into allocations
//! of their own (to align them) and copy the rest (`arrays::owned`).
//!
//! Commits do not concatenate batches of a reasonable size: serving a row range from several
//! partitions costs nothing more on the host, and skipping it saves a copy of every byte put
//! (and of the whole dataset at each append). Batches are concatenated when the dataset has
//! dictionary columns (whose dictionaries are merged into one, as the CUDA backend does) or
//! when they average under [`COALESCE_BELOW`], so that many tiny batches become fewer.
//!
//! Its capacity is the machine's memory or the container's (cgroup) limit, whichever is lower;
//! the default budget is three quarters of that, leaving the rest for the server's own buffers.
//!
//! [`HostBackend::with_devices`] splits that memory into several pretend devices, each with a
//! budget of its own, so that placement across GPUs is tested where there are none.

use std::sync::Arc;

use arrow::array::{Array, ArrayRef, make_array};
use arrow::datatypes::{DataType, Schema};
use arrow::record_batch::{RecordBatch, RecordBatchOptions};
use futures::FutureExt;
use futures::future::BoxFuture;

use super::{
    Backend, BackendError, DeviceInfo, ExportDevice, ExportedColumn, Partition, check_rows,
    dictionary, downcast_all, downcast_one,
};
use crate::arrays::batch_bytes;
use crate::arrays::{batch_owns_its_allocations, owned, owns_its_buffers};

/// Partitions averaging fewer bytes than this are concatenated at commit.
pub const COALESCE_BELOW: u64 = 1 << 20;

/// Keeps datasets in host memory. Stateless: memory accounting is the store's job.
#[derive(Debug)]
pub struct HostBackend {
    total_bytes: Option<u64>,
    devices: u32,
}

impl Default for HostBackend {
    fn default() -> Self {
        Self {
            total_bytes: None,
            devices: 1,
        }
    }
}

impl HostBackend {
    pub fn new() -> Self {
        Self {
            total_bytes: host_memory_bytes(),
            devices: 1,
        }
    }

    /// The same memory as `devices` pretend devices (at least one), each with an equal share
    /// and a budget of its own: what the store's placement across GPUs is tested with.
    pub fn with_devices(mut self, devices: u32) -> Self {
        self.devices = devices.max(1);
        self
    }
}

impl Backend for HostBackend {
    fn name(&self) -> &'static str {
        "host"
    }

    fn devices(&self) -> Vec<DeviceInfo> {
        let share = self
            .total_bytes
            .map(|total| total / u64::from(self.devices));
        (0..self.devices)
            .map(|ordinal| DeviceInfo {
                ordinal,
                name: if self.devices == 1 {
                    "host memory".to_owned()
                } else {
                    format!("host memory (pretend device {ordinal})")
                },
                total_bytes: share,
                default_limit_bytes: share.map(|total| total / 4 * 3),
                uuid: None,
                pci_bus_id: None,
                numa_node: None,
            })
            .collect()
    }

    fn stored_size(&self, batch: &RecordBatch) -> Result<u64, BackendError> {
        Ok(batch_bytes(batch))
    }

    fn upload(
        &self,
        _device: u32,
        batch: RecordBatch,
    ) -> BoxFuture<'static, Result<Arc<dyn Partition>, BackendError>> {
        let uploaded = owned_batch(&batch).map(|batch| {
            let bytes = batch_bytes(&batch);
            Arc::new(HostPartition { batch, bytes }) as Arc<dyn Partition>
        });
        futures::future::ready(uploaded).boxed()
    }

    fn keeps_decoded_arrays(&self) -> bool {
        true
    }

    fn holds_host_memory(&self) -> bool {
        true
    }

    fn compacts(&self, schema: &Schema, partitions: &[Arc<dyn Partition>]) -> bool {
        let bytes: u64 = partitions.iter().map(|p| p.bytes()).sum();
        let small = bytes / (partitions.len().max(1) as u64) < COALESCE_BELOW;
        small
            || schema
                .fields()
                .iter()
                .any(|f| has_dictionary(f.data_type()))
    }

    fn compacted_size(&self, partitions: &[Arc<dyn Partition>]) -> Result<u64, BackendError> {
        Ok(partitions.iter().map(|p| p.bytes()).sum())
    }

    fn copied_size(
        &self,
        partition: &Arc<dyn Partition>,
        columns: &[usize],
    ) -> Result<u64, BackendError> {
        let part = downcast_one::<HostPartition>(partition, "the host backend")?;
        Ok(batch_bytes(&part.project(columns)?))
    }

    /// A deep copy: pretend devices share one memory, but a copy on one must not share
    /// buffers with the original, or the budgets would charge twice for memory held once.
    fn copy_to(
        &self,
        partition: Arc<dyn Partition>,
        columns: Vec<usize>,
        _device: u32,
    ) -> BoxFuture<'static, Result<Arc<dyn Partition>, BackendError>> {
        let copied =
            downcast_one::<HostPartition>(&partition, "the host backend").and_then(|part| {
                let batch = part.project(&columns)?;
                let copy_failed = |e: arrow::error::ArrowError| {
                    BackendError::Device(format!("copying a batch: {e}"))
                };
                let arrays = batch
                    .columns()
                    .iter()
                    .map(|column| owned(&column.to_data()).map(make_array))
                    .collect::<Result<Vec<ArrayRef>, _>>()
                    .map_err(copy_failed)?;
                let options = RecordBatchOptions::new().with_row_count(Some(batch.num_rows()));
                let batch = RecordBatch::try_new_with_options(batch.schema(), arrays, &options)
                    .map_err(copy_failed)?;
                let bytes = batch_bytes(&batch);
                Ok(Arc::new(HostPartition { batch, bytes }) as Arc<dyn Partition>)
            });
        futures::future::ready(copied).boxed()
    }

    /// Arrow's own concatenation, except for dictionary columns, whose dictionaries are merged
    /// (see `dictionary`). It is the host reference the CUDA kernel is checked against.
    fn compact(
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

fn has_dictionary(data_type: &DataType) -> bool {
    crate::arrays::contains(data_type, &|t| matches!(t, DataType::Dictionary(_, _)))
}

/// `batch` in buffers of its own (see [`crate::arrays::owned`]): kept whole where its allocations
/// hold nothing else (a `DoPut` body decoded in place); otherwise columns whose buffers are
/// already allocations of their own are kept, the others copied.
fn owned_batch(batch: &RecordBatch) -> Result<RecordBatch, BackendError> {
    if batch_owns_its_allocations(batch) {
        return Ok(batch.clone());
    }
    let copy_failed =
        |e: arrow::error::ArrowError| BackendError::Device(format!("copying a batch: {e}"));
    let columns = batch
        .columns()
        .iter()
        .map(|column| {
            let data = column.to_data();
            if owns_its_buffers(&data) {
                Ok(Arc::clone(column))
            } else {
                owned(&data).map(make_array)
            }
        })
        .collect::<Result<Vec<ArrayRef>, _>>()
        .map_err(copy_failed)?;
    let options = RecordBatchOptions::new().with_row_count(Some(batch.num_rows()));
    RecordBatch::try_new_with_options(batch.schema(), columns, &options).map_err(copy_failed)
}

#[derive(Debug)]
struct HostPartition {
    batch: RecordBatch,
    bytes: u64,
}

impl HostPartition {
    fn project(&self, columns: &[usize]) -> Result<RecordBatch, BackendError> {
        self.batch
            .project(columns)
            .map_err(|e| BackendError::Device(format!("choosing columns to copy: {e}")))
    }
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
        columns: Option<&[usize]>,
    ) -> BoxFuture<'static, Result<RecordBatch, BackendError>> {
        let result = check_rows(offset, len, self.batch.num_rows())
            .and_then(|()| crate::backend::project(self.batch.slice(offset, len), columns));
        futures::future::ready(result).boxed()
    }

    fn column_bytes(&self, columns: &[usize]) -> Option<u64> {
        self.project(columns).ok().map(|batch| batch_bytes(&batch))
    }

    fn export(
        &self,
        _columns: &[usize],
    ) -> Result<(ExportDevice, Vec<ExportedColumn>), BackendError> {
        Err(BackendError::NotExportable { backend: "host" })
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// The memory limit of this process's cgroup (v2 `memory.max`, else v1
/// `memory.limit_in_bytes`), where one is set.
fn cgroup_memory_limit() -> Option<u64> {
    cgroup_memory_file("memory.max", "memory.limit_in_bytes")
}

/// The memory this process's cgroup uses now (v2 `memory.current`, else v1
/// `memory.usage_in_bytes`), where it has a limit to count against.
fn cgroup_memory_usage() -> Option<u64> {
    cgroup_memory_file("memory.current", "memory.usage_in_bytes")
}

/// A number from a file of this process's memory cgroup: `v2` under the unified hierarchy,
/// else `v1` under the memory controller's.
fn cgroup_memory_file(v2_name: &str, v1_name: &str) -> Option<u64> {
    let group = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    // v2: a line `0::/path`; v1: `N:memory:/path` (or `N:...,memory,...:/path`).
    let v2 = group.lines().find_map(|line| line.strip_prefix("0::"));
    let v1 = group.lines().find_map(|line| {
        let mut parts = line.splitn(3, ':');
        let controllers = parts.nth(1)?;
        controllers
            .split(',')
            .any(|c| c == "memory")
            .then(|| parts.next())
            .flatten()
    });
    let candidates = [
        v2.map(|path| format!("/sys/fs/cgroup{path}/{v2_name}")),
        Some(format!("/sys/fs/cgroup/{v2_name}")),
        v1.map(|path| format!("/sys/fs/cgroup/memory{path}/{v1_name}")),
        Some(format!("/sys/fs/cgroup/memory/{v1_name}")),
    ];
    candidates
        .into_iter()
        .flatten()
        .find_map(|file| parse_cgroup_limit(&std::fs::read_to_string(file).ok()?))
}

/// A cgroup limit file's value: bytes, or none for `max` (v2) or the huge number v1 uses.
fn parse_cgroup_limit(text: &str) -> Option<u64> {
    let bytes: u64 = text.trim().parse().ok()?;
    (bytes < 1 << 60).then_some(bytes)
}

/// The memory this process may use: the machine's, or the container's (cgroup) limit where
/// that is lower.
pub fn host_memory_bytes() -> Option<u64> {
    match (physical_memory_bytes(), cgroup_memory_limit()) {
        (Some(physical), Some(cgroup)) => Some(physical.min(cgroup)),
        (physical, cgroup) => physical.or(cgroup),
    }
}

/// The memory this process could still have now: the machine's available memory, or what is
/// left under the container's (cgroup) limit where that is less.
pub fn host_memory_available() -> Option<u64> {
    let cgroup = cgroup_memory_limit()
        .zip(cgroup_memory_usage())
        .map(|(limit, usage)| limit.saturating_sub(usage));
    match (meminfo_bytes("MemAvailable:"), cgroup) {
        (Some(machine), Some(cgroup)) => Some(machine.min(cgroup)),
        (machine, cgroup) => machine.or(cgroup),
    }
}

/// Total physical memory from `/proc/meminfo`, where there is one.
fn physical_memory_bytes() -> Option<u64> {
    meminfo_bytes("MemTotal:")
}

/// A `/proc/meminfo` figure (given in KiB there), in bytes.
fn meminfo_bytes(key: &str) -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with(key))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(target_os = "linux")]
    fn free_memory_is_known_and_within_the_memory() {
        let free = host_memory_available().expect("/proc/meminfo has MemAvailable");
        let total = host_memory_bytes().expect("/proc/meminfo has MemTotal");
        assert!(free > 0 && free <= total, "{free} of {total}");
    }

    #[tokio::test]
    async fn projected_reads_share_only_the_chosen_columns() {
        let batch = RecordBatch::try_from_iter([
            (
                "a",
                Arc::new(arrow::array::Int64Array::from(vec![1, 2, 3])) as _,
            ),
            (
                "b",
                Arc::new(arrow::array::StringArray::from(vec!["x", "y", "z"])) as _,
            ),
            (
                "c",
                Arc::new(arrow::array::Int8Array::from(vec![7, 8, 9])) as _,
            ),
        ])
        .expect("batch");
        let partition = HostPartition {
            bytes: batch_bytes(&batch),
            batch: batch.clone(),
        };
        let read = partition.read(1, 2, Some(&[2, 0])).await.expect("read");
        assert_eq!(read, batch.slice(1, 2).project(&[2, 0]).expect("project"));
        // The arrays are the partition's own, not copies.
        assert!(std::ptr::eq(
            read.column(1).to_data().buffers()[0].as_ptr(),
            batch.slice(1, 2).column(0).to_data().buffers()[0].as_ptr(),
        ));
        assert_eq!(
            partition.read(0, 3, None).await.expect("read"),
            batch,
            "None reads every column"
        );
        assert!(partition.read(0, 1, Some(&[3])).await.is_err());
    }

    #[test]
    fn cgroup_limits_parse() {
        assert_eq!(parse_cgroup_limit("536870912\n"), Some(512 << 20));
        assert_eq!(parse_cgroup_limit("max\n"), None);
        assert_eq!(parse_cgroup_limit("9223372036854771712\n"), None);
    }

    #[test]
    fn commits_concatenate_only_small_batches_and_dictionaries() {
        let partition = |bytes: u64| -> Arc<dyn Partition> {
            let batch = RecordBatch::new_empty(Arc::new(Schema::empty()));
            Arc::new(HostPartition { batch, bytes })
        };
        let plain = Schema::new(vec![arrow::datatypes::Field::new(
            "x",
            DataType::Int64,
            true,
        )]);
        let backend = HostBackend::new();
        let large = [partition(COALESCE_BELOW), partition(4 * COALESCE_BELOW)];
        assert!(
            !backend.compacts(&plain, &large),
            "large batches are served as they are"
        );
        let small = [partition(COALESCE_BELOW / 2), partition(COALESCE_BELOW / 4)];
        assert!(
            backend.compacts(&plain, &small),
            "many small batches become one"
        );
        let nested = DataType::List(Arc::new(arrow::datatypes::Field::new(
            "item",
            DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8)),
            true,
        )));
        let dictionaries = Schema::new(vec![arrow::datatypes::Field::new("d", nested, true)]);
        assert!(
            backend.compacts(&dictionaries, &large),
            "dictionaries are merged, at any depth"
        );
    }

    #[test]
    fn the_default_budget_leaves_a_quarter() {
        let devices = HostBackend {
            total_bytes: Some(1 << 30),
            devices: 1,
        }
        .devices();
        assert_eq!(devices[0].default_limit_bytes, Some(3 << 28));
    }

    #[test]
    fn pretend_devices_share_the_memory() {
        let devices = HostBackend {
            total_bytes: Some(1 << 30),
            devices: 1,
        }
        .with_devices(4)
        .devices();
        let ordinals: Vec<u32> = devices.iter().map(|d| d.ordinal).collect();
        assert_eq!(ordinals, [0, 1, 2, 3]);
        assert!(devices.iter().all(|d| d.total_bytes == Some(1 << 28)));
        assert_eq!(HostBackend::default().with_devices(0).devices().len(), 1);
    }
}
