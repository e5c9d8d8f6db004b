//! The catalog of datasets, the put lifecycle and memory accounting.
//!
//! The store knows nothing of gRPC: it takes names, schemas and host record batches, and hands
//! out [`Dataset`]s. It owns the rules the protocol relies on:
//!
//! - **Atomic puts.** A [`PendingPut`] collects uploaded partitions privately. Only
//!   [`PendingPut::commit`] makes them visible, in one catalog operation; dropping a pending put
//!   (bad input, a vanished client, shutdown) frees everything it uploaded.
//! - **Budgets.** Every partition is paid for by a [`memory::Reservation`] taken *before* the
//!   upload, so a put beyond the memory limit fails without disturbing other datasets.
//! - **Snapshot reads.** Datasets are immutable; readers hold an `Arc`, so `drop`, `replace` and
//!   `append` never cut a running stream short.
//! - **Leases.** An `ipc-export` lease holds its dataset like a reader does (`lease`), so
//!   memory other processes have mapped outlives `drop` and `replace` until the lease ends.
//!
//! The catalog is a `DashMap`: lookups from many concurrent `DoGet`s never contend on one lock,
//! and no shard lock is ever held across an `.await`.

mod dataset;
mod lease;
pub mod memory;
mod progress;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use arrow::datatypes::{Schema, SchemaRef};
use arrow::record_batch::RecordBatch;
use dashmap::DashMap;
use dashmap::mapref::entry::Entry;
use futures::future::BoxFuture;
use futures::{FutureExt, TryFutureExt};

pub use dataset::Dataset;
use dataset::StoredPartition;
pub use lease::Lease;
use memory::{MemoryBudget, Reservation};
pub use progress::PutProgress;

use crate::backend::{Backend, BackendError, DeviceInfo, PartitionExport};
use crate::batch_size::{array_count, batch_bytes, schema_bytes};

/// What can go wrong in the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("dataset '{name}' does not exist")]
    NotFound { name: String },
    #[error(
        "dataset '{name}' already exists; put with mode \"replace\" or \"append\", or drop it first"
    )]
    AlreadyExists { name: String },
    #[error(
        "cannot append to dataset '{name}': its schema is {existing} but the put sends {incoming}; \
         append needs identical fields"
    )]
    SchemaMismatch {
        name: String,
        existing: String,
        incoming: String,
    },
    #[error("the put changed its schema mid-stream from {first} to {second}")]
    SchemaChanged { first: String, second: String },
    #[error("the put sent record batches before a schema")]
    MissingSchema,
    #[error(
        "memory limit reached on device {device}: the put needs {requested} more bytes, \
         {used} of {limit} are in use; drop datasets or raise --memory-limit"
    )]
    MemoryExhausted {
        device: u32,
        requested: u64,
        used: u64,
        limit: u64,
    },
    #[error("no device {device} in this backend")]
    NoSuchDevice { device: u32 },
    #[error(
        "dataset '{name}' changed since this ticket was issued (ticket version {ticket}, now {current}); \
         call GetFlightInfo again for fresh tickets"
    )]
    StaleVersion {
        name: String,
        ticket: u64,
        current: u64,
    },
    #[error("rows {start}..{end} are outside dataset '{name}', which has {rows} rows")]
    RowsOutOfRange {
        name: String,
        start: u64,
        end: u64,
        rows: u64,
    },
    #[error("dataset '{name}' has no column '{column}'; its columns are {available}")]
    UnknownColumn {
        name: String,
        column: String,
        available: String,
    },
    #[error(
        "dataset '{name}' is held as {partitions} separate batches ({reason}), so its columns \
         are not contiguous and cannot be exported; read it with DoGet"
    )]
    NotCompact {
        name: String,
        partitions: usize,
        reason: &'static str,
    },
    #[error("dataset '{name}' has no rows, so there is no memory to export")]
    EmptyDataset { name: String },
    #[error("lease '{lease}' does not exist: it expired, was released, or was never granted")]
    LeaseNotFound { lease: String },
    #[error("lease '{lease}' is for dataset '{leased}', not '{requested}'")]
    LeaseMismatch {
        lease: String,
        leased: String,
        requested: String,
    },
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// How a put treats an existing dataset of the same name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PutMode {
    /// Fail with ALREADY_EXISTS if the name is taken.
    Create,
    /// Swap the dataset atomically; readers of the old one finish undisturbed.
    Replace,
    /// Add rows to the dataset (creating it if absent); the fields must be identical.
    Append,
}

/// Settings the store needs from the configuration.
#[derive(Debug, Clone, Default)]
pub struct StoreOptions {
    /// Bytes each device may hold; `None` leaves only the device's own capacity.
    pub memory_limit: Option<u64>,
}

/// The catalog of datasets over one backend. Cheap to clone: all clones share the catalog.
#[derive(Debug, Clone)]
pub struct Store {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    backend: Arc<dyn Backend>,
    budget: Arc<MemoryBudget>,
    catalog: DashMap<String, Arc<Dataset>>,
    next_version: AtomicU64,
    leases: lease::Leases,
    puts: Arc<progress::Puts>,
    concatenations: AtomicU64,
    concatenation_nanos: AtomicU64,
}

/// A snapshot of what the store holds, for the `status` action.
#[derive(Debug, Clone)]
pub struct StoreStatus {
    pub backend: &'static str,
    pub devices: Vec<DeviceStatus>,
    pub datasets: usize,
    /// Backend memory held by committed datasets.
    pub bytes: u64,
    /// Arrow bytes in committed datasets.
    pub data_bytes: u64,
    pub counters: serde_json::Map<String, serde_json::Value>,
    pub leases: Vec<LeaseStatus>,
    /// Backend memory held only by leases: datasets dropped or replaced while exported.
    pub leased_only_bytes: u64,
    /// Puts being received, oldest first.
    pub puts: Vec<Arc<PutProgress>>,
    /// Compactions of batches into one partition (at commit), and the time they took.
    pub concatenations: u64,
    pub concatenation_seconds: f64,
}

/// A live lease, for `status`.
#[derive(Debug, Clone)]
pub struct LeaseStatus {
    pub id: String,
    /// The principal that was granted the lease.
    pub owner: String,
    pub dataset: String,
    pub version: u64,
    pub columns: Vec<String>,
    /// Backend memory of the leased dataset.
    pub bytes: u64,
    pub expires_at: SystemTime,
    /// Whether the leased version is still the one in the catalog.
    pub in_catalog: bool,
}

/// What `ipc-export` asks for.
#[derive(Debug, Clone)]
pub struct ExportRequest {
    pub name: String,
    /// Column names; `None` for all.
    pub columns: Option<Vec<String>>,
    pub duration: Duration,
    /// Renew this lease (of the same dataset) instead of granting a new one.
    pub renew: Option<String>,
    /// Who asks, recorded on a new lease.
    pub owner: String,
}

/// An exported dataset under its lease.
#[derive(Debug, Clone)]
pub struct Export {
    pub lease: Lease,
    /// Indices of the exported columns in the dataset's schema, as `partition` lists them.
    pub columns: Vec<usize>,
    pub partition: PartitionExport,
}

/// One device's memory as the store accounts it.
#[derive(Debug, Clone)]
pub struct DeviceStatus {
    pub info: DeviceInfo,
    /// The budget: `--memory-limit`, else the device's capacity.
    pub limit_bytes: Option<u64>,
    /// Bytes reserved: committed datasets and puts in flight.
    pub used_bytes: u64,
}

/// What a committed put reports back to the client.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PutSummary {
    pub name: String,
    pub mode: PutMode,
    /// Rows and Arrow bytes this put added.
    pub rows: u64,
    pub bytes: u64,
    /// The dataset's rows and Arrow bytes after the commit.
    pub total_rows: u64,
    pub total_bytes: u64,
}

impl Store {
    pub fn new(backend: Arc<dyn Backend>, options: StoreOptions) -> Self {
        let limits = backend
            .devices()
            .iter()
            .map(|device| match (options.memory_limit, device.total_bytes) {
                (Some(limit), Some(total)) => Some(limit.min(total)),
                (Some(limit), None) => Some(limit),
                (None, _) => device.default_limit_bytes.or(device.total_bytes),
            })
            .collect();
        Self {
            inner: Arc::new(Inner {
                budget: MemoryBudget::new(limits),
                backend,
                catalog: DashMap::new(),
                next_version: AtomicU64::new(1),
                leases: lease::Leases::default(),
                puts: Arc::default(),
                concatenations: AtomicU64::new(0),
                concatenation_nanos: AtomicU64::new(0),
            }),
        }
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.inner.backend
    }

    /// The dataset named `name`.
    pub fn get(&self, name: &str) -> Result<Arc<Dataset>, StoreError> {
        self.inner
            .catalog
            .get(name)
            .map(|entry| Arc::clone(entry.value()))
            .ok_or_else(|| StoreError::NotFound {
                name: name.to_owned(),
            })
    }

    /// Datasets whose names start with `prefix`, sorted by name.
    pub fn list(&self, prefix: &str) -> Vec<Arc<Dataset>> {
        let mut datasets: Vec<_> = self
            .inner
            .catalog
            .iter()
            .filter(|entry| entry.key().starts_with(prefix))
            .map(|entry| Arc::clone(entry.value()))
            .collect();
        datasets.sort_by(|a, b| a.name().cmp(b.name()));
        datasets
    }

    /// Removes `name` from the catalog. Its memory returns once running reads finish.
    pub fn remove(&self, name: &str) -> Result<Arc<Dataset>, StoreError> {
        self.inner
            .catalog
            .remove(name)
            .map(|(_, dataset)| dataset)
            .ok_or_else(|| StoreError::NotFound {
                name: name.to_owned(),
            })
    }

    /// Starts a put by `owner`. `create` fails here already if the name is taken, so a client
    /// learns it before sending any data; the check is repeated atomically at commit. The put
    /// is listed in [`Store::status`] until it commits or is dropped.
    pub fn begin_put(
        &self,
        name: String,
        mode: PutMode,
        owner: &str,
    ) -> Result<PendingPut, StoreError> {
        if mode == PutMode::Create && self.inner.catalog.contains_key(&name) {
            return Err(StoreError::AlreadyExists { name });
        }
        Ok(PendingPut {
            progress: self.inner.puts.register(&name, mode, owner),
            store: self.clone(),
            name,
            mode,
            device: PUT_DEVICE,
            schema: None,
            schema_charge: None,
            partitions: Vec::new(),
            rows: 0,
            data_bytes: 0,
        })
    }

    /// Whether the backend keeps the host arrays a put gives it (see
    /// [`crate::backend::Backend::keeps_decoded_arrays`]).
    pub fn keeps_decoded_arrays(&self) -> bool {
        self.inner.backend.keeps_decoded_arrays()
    }

    /// Reserves `bytes` for a `DoPut` message being received (grown with
    /// [`Reservation::try_grow`] as its bytes arrive): bytes a client has sent but no dataset
    /// holds yet count against the budget like any other.
    pub fn reserve_message(&self, bytes: u64) -> Result<Reservation, StoreError> {
        self.inner.budget.try_reserve(PUT_DEVICE, bytes)
    }

    pub fn status(&self) -> StoreStatus {
        let inner = &self.inner;
        let devices = inner
            .backend
            .devices()
            .into_iter()
            .enumerate()
            .map(|(index, info)| DeviceStatus {
                info,
                limit_bytes: inner.budget.limit(index as u32),
                used_bytes: inner.budget.used(index as u32),
            })
            .collect();
        let (datasets, bytes, data_bytes) = inner.catalog.iter().fold((0, 0, 0), |(n, b, d), e| {
            (
                n + 1,
                b + e.value().memory_bytes(),
                d + e.value().data_bytes(),
            )
        });
        let mut leases = Vec::new();
        let mut leased_only = std::collections::HashMap::new();
        for lease in inner.leases.list() {
            let dataset = &lease.dataset;
            let in_catalog = inner
                .catalog
                .get(dataset.name())
                .is_some_and(|current| current.version() == dataset.version());
            if !in_catalog {
                leased_only.insert(dataset.version(), dataset.memory_bytes());
            }
            leases.push(LeaseStatus {
                id: lease.id,
                owner: lease.owner,
                dataset: dataset.name().to_owned(),
                version: dataset.version(),
                columns: lease.columns,
                bytes: dataset.memory_bytes(),
                expires_at: lease.expires_at,
                in_catalog,
            });
        }
        StoreStatus {
            backend: inner.backend.name(),
            devices,
            datasets,
            bytes,
            data_bytes,
            counters: inner.backend.counters(),
            leases,
            leased_only_bytes: leased_only.values().sum(),
            puts: inner.puts.list(),
            concatenations: inner.concatenations.load(Ordering::Relaxed),
            concatenation_seconds: Duration::from_nanos(
                inner.concatenation_nanos.load(Ordering::Relaxed),
            )
            .as_secs_f64(),
        }
    }

    /// Exports columns of a dataset for zero-copy use by another process, under a new or
    /// renewed lease. Fails, granting nothing, where the dataset cannot be exported.
    pub fn export(&self, request: ExportRequest) -> Result<Export, StoreError> {
        let inner = &self.inner;
        let renewed = match &request.renew {
            Some(id) => Some(inner.leases.renew(id, &request.name, request.duration)?),
            None => None,
        };
        let dataset = match &renewed {
            Some(lease) => Arc::clone(&lease.dataset),
            None => self.get(&request.name)?,
        };
        let schema = dataset.schema();
        let names: Vec<String> = match request.columns {
            Some(names) => names,
            None => schema.fields().iter().map(|f| f.name().clone()).collect(),
        };
        let columns = names
            .iter()
            .map(|column| {
                schema
                    .index_of(column)
                    .map_err(|_| StoreError::UnknownColumn {
                        name: dataset.name().to_owned(),
                        column: column.clone(),
                        available: format!(
                            "{:?}",
                            schema.fields().iter().map(|f| f.name()).collect::<Vec<_>>()
                        ),
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let partition = match dataset.partitions() {
            [] => {
                return Err(StoreError::EmptyDataset {
                    name: dataset.name().to_owned(),
                });
            }
            [partition] => partition,
            many => {
                return Err(StoreError::NotCompact {
                    name: dataset.name().to_owned(),
                    partitions: many.len(),
                    reason: "its batches could not be concatenated, e.g. their merged \
                             dictionary outgrew the key type",
                });
            }
        };
        let partition = partition.data.export(&columns)?;
        let lease = match renewed {
            Some(lease) => lease,
            None => inner
                .leases
                .grant(dataset, names, request.duration, request.owner),
        };
        Ok(Export {
            lease,
            columns,
            partition,
        })
    }

    /// Ends lease `id`. Memory that only the lease held is freed.
    pub fn release(&self, id: &str) -> Result<Lease, StoreError> {
        self.inner
            .leases
            .release(id)
            .ok_or_else(|| StoreError::LeaseNotFound {
                lease: id.to_owned(),
            })
    }

    /// Starts the task that ends expired leases, checking every `period`. It stops by itself
    /// when the store is dropped.
    pub fn spawn_lease_reaper(&self, period: Duration) -> tokio::task::JoinHandle<()> {
        lease::spawn_reaper(Arc::downgrade(&self.inner), period)
    }

    fn next_version(&self) -> u64 {
        self.inner.next_version.fetch_add(1, Ordering::Relaxed)
    }
}

/// A put in progress: uploaded partitions that nobody else can see yet.
#[derive(Debug)]
pub struct PendingPut {
    /// Listed in `status` while the put runs.
    progress: progress::Registered,
    store: Store,
    name: String,
    mode: PutMode,
    device: u32,
    schema: Option<SchemaRef>,
    schema_charge: Option<Arc<Reservation>>,
    partitions: Vec<StoredPartition>,
    rows: u64,
    data_bytes: u64,
}

/// An upload running in the backend; resolve it and pass the result to [`PendingPut::add`].
pub type Upload = BoxFuture<'static, Result<UploadedPartition, StoreError>>;

/// A partition uploaded for a pending put.
#[derive(Debug)]
pub struct UploadedPartition(StoredPartition);

impl PendingPut {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Records the schema the client declared. A repeated identical schema is accepted; a
    /// different one fails the put. For `append` the fields must match the existing dataset.
    pub fn declare_schema(&mut self, schema: SchemaRef) -> Result<(), StoreError> {
        if let Some(first) = &self.schema {
            if first.as_ref() != schema.as_ref() {
                return Err(StoreError::SchemaChanged {
                    first: first.to_string(),
                    second: schema.to_string(),
                });
            }
            return Ok(());
        }
        if self.mode == PutMode::Append
            && let Ok(existing) = self.store.get(&self.name)
        {
            check_append_schema(&existing, &schema)?;
        }
        let charge = self
            .store
            .inner
            .budget
            .try_reserve(self.device, schema_bytes(&schema))?;
        self.schema_charge = Some(Arc::new(charge));
        self.schema = Some(schema);
        Ok(())
    }

    /// Reserves memory for `batch` and starts uploading it. Returns `None` for an empty batch,
    /// which holds nothing. The reservation is made before the upload starts, so a batch that
    /// does not fit fails here with nothing allocated. `message` paid for the message the batch
    /// was decoded from, which the batch may still point into; it is released once the upload
    /// is done with the batch.
    pub fn upload(
        &mut self,
        batch: RecordBatch,
        message: Option<Reservation>,
    ) -> Result<Option<Upload>, StoreError> {
        if self.schema.is_none() {
            return Err(StoreError::MissingSchema);
        }
        if batch.num_rows() == 0 {
            return Ok(None);
        }
        let backend = Arc::clone(&self.store.inner.backend);
        let bytes = charge(backend.stored_size(&batch)?, batch.num_rows() as u64)
            .saturating_add(ARRAY_OVERHEAD.saturating_mul(array_count(&batch)));
        let reservation = Arc::new(self.store.inner.budget.try_reserve(self.device, bytes)?);
        let data_bytes = batch_bytes(&batch);
        self.rows = self.rows.saturating_add(batch.num_rows() as u64);
        self.data_bytes = self.data_bytes.saturating_add(data_bytes);
        self.progress
            .progress
            .add(batch.num_rows() as u64, data_bytes);
        let upload = backend
            .upload(self.device, batch)
            .map_err(StoreError::from)
            .map_ok(move |data| {
                drop(message);
                UploadedPartition(StoredPartition {
                    data,
                    reservation,
                    data_bytes,
                })
            })
            .boxed();
        Ok(Some(upload))
    }

    /// Adds a finished upload to the put.
    pub fn add(&mut self, uploaded: UploadedPartition) {
        self.partitions.push(uploaded.0);
    }

    /// Compacts the put's partitions (with the dataset's, for `append`) and makes the result
    /// visible in one catalog operation, or fails leaving the catalog untouched.
    pub async fn commit(self) -> Result<PutSummary, StoreError> {
        let (Some(schema), Some(schema_charge)) = (self.schema, self.schema_charge) else {
            return Err(StoreError::MissingSchema);
        };
        let store = self.store;
        let base = match self.mode {
            PutMode::Append => store.get(&self.name).ok(),
            PutMode::Create | PutMode::Replace => None,
        };
        let mut combined = match &base {
            Some(existing) => {
                check_append_schema(existing, &schema)?;
                existing.partitions().to_vec()
            }
            None => Vec::new(),
        };
        combined.extend(self.partitions.iter().cloned());
        let compacted = store.compact(&schema, combined, self.device).await?;

        let version = store.next_version();
        let summary = |dataset: &Dataset| PutSummary {
            name: dataset.name().to_owned(),
            mode: self.mode,
            rows: self.rows,
            bytes: self.data_bytes,
            total_rows: dataset.num_rows(),
            total_bytes: dataset.data_bytes(),
        };
        let catalog = &store.inner.catalog;
        let committed = match catalog.entry(self.name.clone()) {
            Entry::Occupied(_) if self.mode == PutMode::Create => {
                return Err(StoreError::AlreadyExists { name: self.name });
            }
            Entry::Occupied(mut entry) if self.mode == PutMode::Append => {
                let current = entry.get();
                check_append_schema(current, &schema)?;
                let partitions = if base.as_ref().map(|b| b.version()) == Some(current.version()) {
                    compacted
                } else {
                    // Another commit won the race since we compacted: append our own
                    // partitions to what is there now, uncompacted, rather than lose rows.
                    let mut partitions = current.partitions().to_vec();
                    partitions.extend(self.partitions);
                    partitions
                };
                let dataset = Arc::new(Dataset::new(
                    self.name.clone(),
                    current.schema(),
                    version,
                    partitions,
                    Arc::clone(current.schema_charge()),
                ));
                entry.insert(Arc::clone(&dataset));
                dataset
            }
            Entry::Occupied(mut entry) => {
                let dataset = Arc::new(Dataset::new(
                    self.name.clone(),
                    schema,
                    version,
                    compacted,
                    schema_charge,
                ));
                entry.insert(Arc::clone(&dataset));
                dataset
            }
            Entry::Vacant(entry) => {
                // An append whose dataset was dropped meanwhile commits its own rows only: the
                // compacted copy holds the dropped rows too.
                let partitions = if base.is_some() {
                    self.partitions
                } else {
                    compacted
                };
                let dataset = Arc::new(Dataset::new(
                    self.name.clone(),
                    schema,
                    version,
                    partitions,
                    schema_charge,
                ));
                entry.insert(Arc::clone(&dataset));
                dataset
            }
        };
        Ok(summary(&committed))
    }
}

impl Store {
    /// Concatenates partitions into one compact partition, reserving its memory first: the
    /// inputs stay reserved until they are dropped, so the budget covers the transient peak,
    /// and a compaction that does not fit fails with `MemoryExhausted`. Partitions the backend
    /// cannot concatenate (a merged dictionary its keys cannot index) are returned unchanged.
    async fn compact(
        &self,
        schema: &Schema,
        partitions: Vec<StoredPartition>,
        device: u32,
    ) -> Result<Vec<StoredPartition>, StoreError> {
        if partitions.len() <= 1 {
            return Ok(partitions);
        }
        let backend = &self.inner.backend;
        let data: Vec<_> = partitions.iter().map(|p| Arc::clone(&p.data)).collect();
        if !backend.compacts(schema, &data) {
            return Ok(partitions);
        }
        let size = match backend.concatenated_size(&data) {
            Ok(size) => size,
            Err(
                error @ (BackendError::UnsupportedType { .. }
                | BackendError::CannotConcatenate { .. }),
            ) => {
                tracing::info!(%error, "dataset kept in its uploaded batches");
                return Ok(partitions);
            }
            Err(error) => return Err(error.into()),
        };
        let rows = partitions.iter().map(|p| p.data.num_rows() as u64).sum();
        let reservation = self.inner.budget.try_reserve(device, charge(size, rows))?;
        let data_bytes = partitions.iter().map(|p| p.data_bytes).sum();
        let started = std::time::Instant::now();
        let compacted = backend.concatenate(data).await?;
        let inner = &self.inner;
        inner.concatenations.fetch_add(1, Ordering::Relaxed);
        inner.concatenation_nanos.fetch_add(
            u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        Ok(vec![StoredPartition {
            data: compacted,
            reservation: Arc::new(reservation),
            data_bytes,
        }])
    }
}

/// What each array of a stored batch costs beyond its buffers (headers, `Arc`s, allocator
/// rounding): a batch of ten thousand one-row columns is not ten thousand bytes.
pub const ARRAY_OVERHEAD: u64 = 256;

/// Where puts place their data: the backend's first device.
const PUT_DEVICE: u32 = 0;

/// What a partition of `rows` rows whose backend memory is `bytes` is charged: never less than
/// one bit a row. Null columns and zero-column batches hold no bytes yet may declare any
/// number of rows, and reading, planning and listing a dataset all do work per row; charging
/// the rows makes the memory limit bound that work too.
fn charge(bytes: u64, rows: u64) -> u64 {
    bytes.max(rows.div_ceil(8))
}

/// `append` needs the same fields (names, types, nullability, field metadata). Schema-level
/// metadata may differ: pandas, for one, writes each frame's index range there.
fn check_append_schema(existing: &Dataset, incoming: &SchemaRef) -> Result<(), StoreError> {
    let existing_schema = existing.schema();
    if existing_schema.fields() == incoming.fields() {
        Ok(())
    } else {
        Err(StoreError::SchemaMismatch {
            name: existing.name().to_owned(),
            existing: existing_schema.to_string(),
            incoming: incoming.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use arrow::array::{ArrayRef, Int64Array};

    use super::*;
    use crate::backend::HostBackend;

    fn batch(values: std::ops::Range<i64>) -> RecordBatch {
        let column: ArrayRef = Arc::new(Int64Array::from_iter_values(values));
        RecordBatch::try_from_iter([("x", column)]).expect("batch")
    }

    async fn put(store: &Store, mode: PutMode, batches: Vec<RecordBatch>) -> PendingPut {
        let mut pending = store
            .begin_put("t".to_owned(), mode, "test")
            .expect("begin");
        pending.declare_schema(batches[0].schema()).expect("schema");
        for b in batches {
            if let Some(upload) = pending.upload(b, None).expect("reserve") {
                pending.add(upload.await.expect("upload"));
            }
        }
        pending
    }

    /// The host backend, but concatenation waits for `release` (after saying it started), so
    /// a test can act while a commit is compacting.
    #[derive(Debug)]
    struct GatedBackend {
        host: HostBackend,
        started: Arc<tokio::sync::Notify>,
        release: Arc<tokio::sync::Notify>,
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
        ) -> BoxFuture<'static, Result<Arc<dyn crate::backend::Partition>, BackendError>> {
            self.host.upload(device, batch)
        }
        fn concatenated_size(
            &self,
            partitions: &[Arc<dyn crate::backend::Partition>],
        ) -> Result<u64, BackendError> {
            self.host.concatenated_size(partitions)
        }
        fn concatenate(
            &self,
            partitions: Vec<Arc<dyn crate::backend::Partition>>,
        ) -> BoxFuture<'static, Result<Arc<dyn crate::backend::Partition>, BackendError>> {
            let concatenated = self.host.concatenate(partitions);
            let (started, release) = (Arc::clone(&self.started), Arc::clone(&self.release));
            async move {
                started.notify_one();
                release.notified().await;
                concatenated.await
            }
            .boxed()
        }
    }

    #[tokio::test]
    async fn an_append_to_a_dataset_dropped_while_compacting_does_not_bring_it_back() {
        let started = Arc::new(tokio::sync::Notify::new());
        let release = Arc::new(tokio::sync::Notify::new());
        let backend = GatedBackend {
            host: HostBackend::new(),
            started: Arc::clone(&started),
            release: Arc::clone(&release),
        };
        let store = Store::new(Arc::new(backend), StoreOptions::default());
        put(&store, PutMode::Create, vec![batch(0..10)])
            .await
            .commit()
            .await
            .expect("create");
        let append = put(&store, PutMode::Append, vec![batch(10..15), batch(15..20)]).await;
        let commit = tokio::spawn(append.commit());
        started.notified().await;
        store.remove("t").expect("drop while the append compacts");
        release.notify_one();
        let summary = commit.await.expect("task").expect("append");
        assert_eq!(
            summary.total_rows, 10,
            "only the appended rows, not the dropped ones"
        );
        assert_eq!(store.get("t").expect("dataset").num_rows(), 10);
    }
}
