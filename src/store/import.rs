//! `ipc-import` before its put: a producer's columns checked against their schema and planned
//! by the backend, once per call, and the server's device that is the producer's GPU.
//!
//! The protocol layer reaches the backend's document checks (`backend::ingest`) only through
//! here, so that they fail with the store's error, as everything a put does. The
//! [`CheckedImport`] carries the backend's plan to [`super::PendingPut::import`], which
//! reserves what it allocates and has the backend carry it out: the columns are laid out once.

use arrow::datatypes::SchemaRef;

use super::error::StoreError;
use crate::backend::{Backend, DeviceInfo, ExportedArray, ExportedColumn, PreparedImport, ingest};

/// An import's columns, checked against `schema` and planned by the backend: what
/// [`super::PendingPut::import`] pays for and copies.
#[derive(Debug)]
pub struct CheckedImport {
    pub(super) schema: SchemaRef,
    pub(super) rows: u64,
    pub(super) plan: PreparedImport,
    /// Arrays the columns describe (themselves, children, dictionaries), each charged
    /// `ARRAY_OVERHEAD`.
    pub(super) arrays: u64,
    /// Arrow bytes of the columns, as a put of them reports.
    pub(super) data_bytes: u64,
}

impl CheckedImport {
    /// Checks `columns` (`rows` rows of `schema`) from their numbers alone and has `backend`
    /// plan them: a malformed description is refused (INVALID_ARGUMENT) before a backend that
    /// cannot import says so (FAILED_PRECONDITION), and both before anything is opened.
    pub(super) fn new(
        backend: &dyn Backend,
        schema: SchemaRef,
        rows: u64,
        mut columns: Vec<ExportedColumn>,
    ) -> Result<Self, StoreError> {
        ingest::check_columns(&schema, rows, &mut columns)?;
        let plan = backend.plan_import(&columns)?;
        Ok(Self {
            schema,
            rows,
            plan,
            arrays: columns.iter().map(|c| array_count(&c.array)).sum(),
            data_bytes: columns.iter().map(|c| array_bytes(&c.array)).sum(),
        })
    }
}

/// The index among `devices` of the producer's GPU: by UUID, else by PCI bus id (the same GPU
/// whatever either process's `CUDA_VISIBLE_DEVICES`).
pub(super) fn producer_device(
    devices: &[DeviceInfo],
    uuid: &str,
    pci_bus_id: &str,
) -> Result<u32, StoreError> {
    let by_uuid = devices.iter().position(|d| {
        d.uuid
            .as_deref()
            .is_some_and(|u| u.eq_ignore_ascii_case(uuid))
    });
    let by_bus = || {
        devices.iter().position(|d| {
            d.pci_bus_id
                .as_deref()
                .is_some_and(|b| b.eq_ignore_ascii_case(pci_bus_id))
        })
    };
    match by_uuid.or_else(by_bus) {
        Some(index) => Ok(index as u32),
        None => Err(StoreError::Backend(ingest::refused(format!(
            "the producer's GPU ({:?}, PCI {:?}) is not one this server holds datasets on; \
             the status action lists them",
            uuid.chars().take(64).collect::<String>(),
            pci_bus_id.chars().take(32).collect::<String>()
        )))),
    }
}

/// Arrays an imported column describes: itself, its children and its dictionary's.
fn array_count(array: &ExportedArray) -> u64 {
    1 + array.children.iter().map(array_count).sum::<u64>()
        + array.dictionary.as_deref().map_or(0, array_count)
}

/// Arrow bytes of an imported column: its buffers', its children's and its dictionary's.
fn array_bytes(array: &ExportedArray) -> u64 {
    array
        .buffers
        .iter()
        .map(|b| b.length)
        .fold(0u64, u64::saturating_add)
        .saturating_add(array.children.iter().map(array_bytes).sum::<u64>())
        .saturating_add(array.dictionary.as_deref().map_or(0, array_bytes))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use arrow::datatypes::{DataType, Field, Schema};
    use arrow::record_batch::RecordBatch;
    use futures::future::BoxFuture;

    use super::*;
    use crate::backend::{BackendError, BufferKind, ExportedBuffer, HostBackend, Partition};
    use crate::store::testing::batch;
    use crate::store::{PutMode, Store, StoreOptions};

    /// The host backend, importing by uploading zeros where a GPU backend would copy, and
    /// counting the plans it makes.
    #[derive(Debug, Default)]
    struct Planning {
        host: HostBackend,
        plans: AtomicUsize,
    }

    /// What [`Planning`]'s plans allocate.
    const PLANNED_BYTES: u64 = 4096;

    impl Backend for Planning {
        fn name(&self) -> &'static str {
            "planning"
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
            self.host.upload(device, batch)
        }
        fn compacted_size(&self, partitions: &[Arc<dyn Partition>]) -> Result<u64, BackendError> {
            self.host.compacted_size(partitions)
        }
        fn compact(
            &self,
            partitions: Vec<Arc<dyn Partition>>,
        ) -> BoxFuture<'static, Result<Arc<dyn Partition>, BackendError>> {
            self.host.compact(partitions)
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
            self.host.copy_to(partition, columns, device)
        }
        fn plan_import(&self, columns: &[ExportedColumn]) -> Result<PreparedImport, BackendError> {
            self.plans.fetch_add(1, Ordering::SeqCst);
            Ok(PreparedImport::new(PLANNED_BYTES, columns.len()))
        }
        fn import(
            &self,
            device: u32,
            _schema: SchemaRef,
            rows: usize,
            plan: PreparedImport,
        ) -> BoxFuture<'static, Result<Arc<dyn Partition>, BackendError>> {
            match plan.into_plan::<usize>("planning") {
                Ok(1) => self.host.upload(device, batch(0..rows as i64)),
                other => panic!("not this backend's plan of one column: {other:?}"),
            }
        }
    }

    fn columns(rows: u64) -> Vec<ExportedColumn> {
        vec![ExportedColumn {
            handle: [7; 64],
            allocation_bytes: 1 << 20,
            array: ExportedArray {
                data_type: DataType::Int64,
                length: rows,
                null_count: 0,
                buffers: vec![ExportedBuffer {
                    kind: BufferKind::Values,
                    offset: 0,
                    length: rows * 8,
                    allocation: None,
                }],
                children: vec![],
                dictionary: None,
            },
        }]
    }

    #[tokio::test]
    async fn an_import_is_planned_once_and_pays_for_what_the_plan_allocates() {
        let backend = Arc::new(Planning::default());
        let store = Store::new(
            Arc::clone(&backend) as Arc<dyn Backend>,
            StoreOptions::default(),
        );
        let schema = Arc::new(Schema::new(vec![Field::new("x", DataType::Int64, true)]));
        let checked = store
            .check_import(Arc::clone(&schema), 100, columns(100))
            .expect("well formed");
        assert_eq!(checked.plan.allocated_bytes(), PLANNED_BYTES);
        assert_eq!((checked.arrays, checked.data_bytes), (1, 800));
        let mut pending = store
            .begin_put_on("t".to_owned(), PutMode::Create, "test", Some(0))
            .expect("begin");
        pending.import(checked).await.expect("import");
        let summary = pending.commit().await.expect("commit");
        assert_eq!((summary.rows, summary.bytes), (100, 800));
        assert_eq!(
            backend.plans.load(Ordering::SeqCst),
            1,
            "one plan for the size, the reservation and the copy"
        );
    }

    #[tokio::test]
    async fn a_malformed_document_is_refused_before_the_backend_plans_it() {
        let backend = Arc::new(Planning::default());
        let store = Store::new(
            Arc::clone(&backend) as Arc<dyn Backend>,
            StoreOptions::default(),
        );
        let schema = Arc::new(Schema::new(vec![Field::new("x", DataType::Int64, true)]));
        let error = store
            .check_import(schema, 101, columns(100))
            .expect_err("rows disagree");
        assert!(
            matches!(&error, StoreError::Backend(BackendError::ImportRefused(_))),
            "{error}"
        );
        assert_eq!(backend.plans.load(Ordering::SeqCst), 0);
        let host = Store::new(Arc::new(HostBackend::new()), StoreOptions::default());
        let schema = Arc::new(Schema::new(vec![Field::new("x", DataType::Int64, true)]));
        let error = host
            .check_import(schema, 100, columns(100))
            .expect_err("host memory cannot import");
        assert!(
            matches!(
                &error,
                StoreError::Backend(BackendError::NotImportable { .. })
            ),
            "{error}"
        );
    }

    #[test]
    fn the_producers_gpu_is_found_by_uuid_then_by_pci_bus_id() {
        let device = |uuid: &str, bus: &str| DeviceInfo {
            ordinal: 0,
            name: "gpu".to_owned(),
            total_bytes: None,
            default_limit_bytes: None,
            uuid: Some(uuid.to_owned()),
            pci_bus_id: Some(bus.to_owned()),
            numa_node: None,
        };
        let devices = [
            device("GPU-a", "0000:1a:00.0"),
            device("GPU-b", "0000:2b:00.0"),
        ];
        assert_eq!(producer_device(&devices, "gpu-B", "x").ok(), Some(1));
        assert_eq!(
            producer_device(&devices, "GPU-c", "0000:1A:00.0").ok(),
            Some(0)
        );
        let error = producer_device(&devices, "GPU-c", "0000:3c:00.0").expect_err("none");
        assert!(
            matches!(&error, StoreError::Backend(BackendError::ImportRefused(_))),
            "{error}"
        );
        assert!(error.to_string().contains("status action"), "{error}");
    }
}
