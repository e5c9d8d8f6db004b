//! Puts: a [`PendingPut`] collects uploaded partitions privately, then commits them in one
//! catalog operation (compacting them first where the backend wants that).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use arrow::datatypes::{Schema, SchemaRef};
use arrow::record_batch::RecordBatch;
use dashmap::mapref::entry::Entry;
use futures::future::BoxFuture;
use futures::{FutureExt, TryFutureExt};

use super::dataset::StoredPartition;
use super::durable::{self, Job, Persisted};
use super::memory::Reservation;
use super::{ARRAY_OVERHEAD, Dataset, PutMode, Store, StoreError, Tier, charge, progress};
use crate::arrays::{array_count, batch_bytes, schema_bytes};
use crate::backend::BackendError;

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
    /// Starts a put by `owner`, placed by the store (see [`Store::begin_put_on`]).
    pub fn begin_put(
        &self,
        name: String,
        mode: PutMode,
        owner: &str,
    ) -> Result<PendingPut, StoreError> {
        self.begin_put_on(name, mode, owner, None)
    }

    /// Starts a put by `owner` on `device`, or placed by the store when `None`: on the device
    /// with the most free memory, moving to the next-freest one for each batch that no longer
    /// fits, so a dataset larger than any one device is spread across them, partition by
    /// partition. A put on a named device stays there. `create` fails here already if the name
    /// is taken, so a client learns it before sending any data; the check is repeated
    /// atomically at commit. The put is listed in [`Store::status`] until it commits or is
    /// dropped.
    pub fn begin_put_on(
        &self,
        name: String,
        mode: PutMode,
        owner: &str,
        device: Option<u32>,
    ) -> Result<PendingPut, StoreError> {
        let budget = &self.inner.budget;
        if let Some(device) = device
            && device >= budget.devices()
        {
            return Err(StoreError::UnknownDevice {
                device,
                devices: budget.devices(),
            });
        }
        if mode == PutMode::Create && self.inner.catalog.contains_key(&name) {
            return Err(StoreError::AlreadyExists { name });
        }
        Ok(PendingPut {
            progress: self.inner.puts.register(&name, mode, owner),
            store: self.clone(),
            name,
            mode,
            device: device.unwrap_or_else(|| self.freest_device()),
            fixed: device.is_some(),
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
    /// holds yet count against the budget like any other. They are charged to the device with
    /// the most free memory, where the store places the batches it cannot fit elsewhere: a
    /// message must not fail for lack of room on a device its batch will not go to.
    ///
    /// The message itself is in host memory: where no device has room for it, the host tier
    /// may pay for it instead, and the batch makes room on its device when it is uploaded.
    pub fn reserve_message(&self, bytes: u64) -> Result<Reservation, StoreError> {
        match self.inner.budget.try_reserve(self.freest_device(), bytes) {
            Err(error @ StoreError::MemoryExhausted { .. }) => self
                .inner
                .tiers
                .try_reserve_host(bytes)
                .map_err(|_| self.tiers_full(error)),
            reserved => reserved,
        }
    }

    /// Grows `message` (from [`Store::reserve_message`]) by `bytes` as more of it arrives;
    /// where its device has no room, the whole message moves to the host tier.
    pub fn grow_message(&self, message: &mut Reservation, bytes: u64) -> Result<(), StoreError> {
        match message.try_grow(bytes) {
            Err(StoreError::MemoryExhausted {
                device,
                used,
                limit,
                host_backend,
                ..
            }) => {
                let total = message.bytes().saturating_add(bytes);
                // Said of the whole message, beside what else is in use: "1048576 more" of
                // an 8 MiB message only confuses.
                let error = StoreError::MemoryExhausted {
                    device,
                    requested: total,
                    used: used.saturating_sub(message.bytes()),
                    limit,
                    host_backend,
                };
                *message = self
                    .inner
                    .tiers
                    .try_reserve_host(total)
                    .map_err(|_| self.tiers_full(error))?;
                Ok(())
            }
            grown => grown,
        }
    }

    /// A received message's charge when its batch finds no room on a device: where the
    /// message is paid for by a device, that charge gives way to the batch's. A backend that
    /// keeps the decoded arrays keeps the message's memory as the batch, which the batch's
    /// charge then pays for: the two would count it twice. Any other's message is host
    /// memory that a device's budget stood in for: it moves to the host tier where that has
    /// room, and otherwise stays where it is (counted, if beside the batch).
    fn message_yields(&self, message: Reservation) -> Option<Reservation> {
        if !message.is_of(&self.inner.budget) {
            return Some(message);
        }
        if self.inner.backend.keeps_decoded_arrays() {
            return None;
        }
        match self.inner.tiers.try_reserve_host(message.bytes()) {
            Ok(host) => Some(host),
            Err(_) => Some(message),
        }
    }

    /// What keeping `batch` in the backend is charged: its stored size (at least a bit a row)
    /// and an overhead per array. Paid before the batch is uploaded anywhere.
    pub(super) fn stored_charge(&self, batch: &RecordBatch) -> Result<u64, StoreError> {
        let stored = self.inner.backend.stored_size(batch)?;
        Ok(charge(stored, batch.num_rows() as u64)
            .saturating_add(ARRAY_OVERHEAD.saturating_mul(array_count(batch))))
    }

    /// The device with the most free memory (the lowest number on a tie).
    fn freest_device(&self) -> u32 {
        let budget = &self.inner.budget;
        (0..budget.devices())
            .rev()
            .max_by_key(|&d| budget.free(d))
            .unwrap_or(0)
    }

    /// Every device, the one with the most free memory first (the lower ordinal on a tie).
    fn freest_devices(&self) -> Vec<u32> {
        let budget = &self.inner.budget;
        let mut devices: Vec<u32> = (0..budget.devices().max(1)).collect();
        // Free bytes change as other puts reserve: read each once (see `spill_candidates`).
        devices.sort_by_cached_key(|&d| std::cmp::Reverse(budget.free(d)));
        devices
    }
}

/// Where a compaction finds the memory for its copy when the device is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Room {
    /// Spills other partitions to the host tier: the copy is part of a request (a put, a
    /// move, a restore) that asked for it.
    Spill,
    /// Only memory free now: a background merge is an optimisation, and must not evict
    /// other datasets' partitions for itself.
    Free,
}

/// A put in progress: uploaded partitions that nobody else can see yet.
#[derive(Debug)]
pub struct PendingPut {
    /// Listed in `status` while the put runs.
    progress: progress::Registered,
    store: Store,
    name: String,
    mode: PutMode,
    /// Where the next batch goes.
    device: u32,
    /// The client named the device: never move to another.
    fixed: bool,
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
        self.store.check_damage(&self.name, self.mode)?;
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
    /// which holds nothing. The reservation is made before the upload starts (spilling other
    /// partitions to the host tier if that makes room), so a batch that does not fit fails
    /// here with nothing allocated. `message` paid for the message the batch
    /// was decoded from, which the batch may still point into; it is released once the upload
    /// is done with the batch.
    pub async fn upload(
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
        let bytes = self.store.stored_charge(&batch)?;
        let mut message = message;
        let reservation = self.reserve(bytes, &mut message).await?;
        let data_bytes = batch_bytes(&batch);
        self.rows = self.rows.saturating_add(batch.num_rows() as u64);
        self.data_bytes = self.data_bytes.saturating_add(data_bytes);
        self.progress
            .progress
            .add(batch.num_rows() as u64, data_bytes);
        let store = self.store.clone();
        let upload = backend
            .upload(self.device, batch)
            .map_err(StoreError::from)
            .map_ok(move |data| {
                drop(message);
                UploadedPartition(store.inner.tiers.hold(data, reservation, data_bytes))
            })
            .boxed();
        Ok(Some(upload))
    }

    /// Reserves `bytes` on the put's device or, for a put the store places, on the freest
    /// device that has room, which the put then stays on. Where none has room, the charge of
    /// the batch's own `message` on a device gives way first (see [`Store::message_yields`]),
    /// so that a put fits whenever its bytes are free; then partitions on the put's device
    /// are spilled to the host tier to make room. Fails saying what every tier holds when
    /// that does not make room either.
    async fn reserve(
        &mut self,
        bytes: u64,
        message: &mut Option<Reservation>,
    ) -> Result<Reservation, StoreError> {
        if let Some(reservation) = self.reserve_without_spilling(bytes)? {
            return Ok(reservation);
        }
        if let Some(charged) = message.take() {
            *message = self.store.message_yields(charged);
            if let Some(reservation) = self.reserve_without_spilling(bytes)? {
                return Ok(reservation);
            }
        }
        self.store.reserve_on(self.device, bytes).await
    }

    /// `bytes` on the put's device, or another with room where the store places the put;
    /// `None` where none has room.
    fn reserve_without_spilling(&mut self, bytes: u64) -> Result<Option<Reservation>, StoreError> {
        let budget = &self.store.inner.budget;
        match budget.try_reserve(self.device, bytes) {
            Err(StoreError::MemoryExhausted { .. }) => {}
            reserved => return reserved.map(Some),
        }
        if !self.fixed {
            for device in self.store.freest_devices() {
                if device == self.device {
                    continue;
                }
                if let Ok(reservation) = budget.try_reserve(device, bytes) {
                    self.device = device;
                    return Ok(Some(reservation));
                }
            }
        }
        Ok(None)
    }

    /// Adds a finished upload to the put.
    pub fn add(&mut self, uploaded: UploadedPartition) {
        self.partitions.push(uploaded.0);
    }

    /// Compacts the put's partitions and makes them visible in one catalog operation (after
    /// the dataset's, for `append`), or fails leaving the catalog untouched. An append copies
    /// only its own batches here, so that its cost follows what it adds, not the dataset: the
    /// dataset's partitions are merged afterwards, in the background (`merge`).
    pub async fn commit(self) -> Result<PutSummary, StoreError> {
        let (Some(schema), Some(schema_charge)) = (self.schema, self.schema_charge) else {
            return Err(StoreError::MissingSchema);
        };
        let store = self.store;
        if self.mode == PutMode::Append
            && let Ok(existing) = store.get(&self.name)
        {
            check_append_schema(&existing, &schema)?;
        }
        let compacted = store.compact_runs(&schema, self.partitions).await?;

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
        // Each arm makes the new version visible and queues it for the disk while it still
        // holds the name's entry: the writer sees a name's versions in commit order.
        let (committed, previous, persisted) = match catalog.entry(self.name.clone()) {
            Entry::Occupied(_) if self.mode == PutMode::Create => {
                return Err(StoreError::AlreadyExists { name: self.name });
            }
            Entry::Occupied(mut entry) if self.mode == PutMode::Append => {
                let current = Arc::clone(entry.get());
                check_append_schema(&current, &schema)?;
                let mut partitions = current.partitions().to_vec();
                partitions.extend(compacted);
                let dataset = Arc::new(Dataset::new(
                    self.name.clone(),
                    current.schema(),
                    version,
                    partitions,
                    Arc::clone(current.schema_charge()),
                ));
                let total = dataset.num_rows();
                let persisted = store.persist(|done| Job::Write {
                    dataset: Arc::clone(&dataset),
                    base: Some(current.version()),
                    rows: total.saturating_sub(self.rows)..total,
                    done,
                });
                entry.insert(Arc::clone(&dataset));
                (dataset, Some(current), persisted)
            }
            Entry::Occupied(mut entry) => {
                let dataset = Arc::new(Dataset::new(
                    self.name.clone(),
                    schema,
                    version,
                    compacted,
                    schema_charge,
                ));
                let persisted = store.persist_whole(&dataset);
                let previous = entry.insert(Arc::clone(&dataset));
                (dataset, Some(previous), persisted)
            }
            Entry::Vacant(entry) => {
                store.check_damage(&self.name, self.mode)?;
                let dataset = Arc::new(Dataset::new(
                    self.name.clone(),
                    schema,
                    version,
                    compacted,
                    schema_charge,
                ));
                let persisted = store.persist_whole(&dataset);
                entry.insert(Arc::clone(&dataset));
                (dataset, None, persisted)
            }
        };
        if let Err(error) = durable::wait(persisted).await {
            store.undo(&self.name, version.number, previous);
            return Err(error);
        }
        store.replaced_on_disk(&self.name);
        if self.mode == PutMode::Append {
            store.schedule_merge(&self.name);
        }
        Ok(summary(&committed))
    }
}

impl Store {
    /// Queues all of `dataset` for the disk (see [`Store::persist`]).
    pub(super) fn persist_whole(&self, dataset: &Arc<Dataset>) -> Persisted {
        self.persist(|done| Job::Write {
            dataset: Arc::clone(dataset),
            base: None,
            rows: 0..dataset.num_rows(),
            done,
        })
    }

    /// Compacts each run of consecutive partitions on one device, on that device, keeping the
    /// runs in row order: a dataset spread across devices stays spread, each part compact.
    pub(super) async fn compact_runs(
        &self,
        schema: &Schema,
        partitions: Vec<StoredPartition>,
    ) -> Result<Vec<StoredPartition>, StoreError> {
        let mut runs: Vec<(Tier, Vec<StoredPartition>)> = Vec::new();
        for partition in partitions {
            let tier = partition.tier();
            match runs.last_mut() {
                Some((run_tier, run)) if *run_tier == tier => run.push(partition),
                _ => runs.push((tier, vec![partition])),
            }
        }
        let mut compacted = Vec::new();
        for (tier, run) in runs {
            match tier {
                Tier::Device(device) => {
                    compacted.extend(self.compact(schema, run, device, Room::Spill).await?);
                }
                // Spilled while the put ran: compacted if it is ever restored.
                Tier::Host | Tier::Disk => compacted.extend(run),
            }
        }
        Ok(compacted)
    }

    /// Concatenates partitions of `device` into one compact partition where the backend wants
    /// that (see [`Store::concatenate`]).
    pub(super) async fn compact(
        &self,
        schema: &Schema,
        partitions: Vec<StoredPartition>,
        device: u32,
        room: Room,
    ) -> Result<Vec<StoredPartition>, StoreError> {
        if partitions.len() <= 1 {
            return Ok(partitions);
        }
        let data: Vec<_> = partitions
            .iter()
            .map(|p| Arc::clone(&p.slot.resident().data))
            .collect();
        if !self.inner.backend.compacts(schema, &data) {
            return Ok(partitions);
        }
        self.concatenate(partitions, device, room).await
    }

    /// Concatenates partitions of `device` into one compact partition, reserving its memory
    /// first (as `room` allows): the inputs stay reserved until they are dropped, so the
    /// budget covers the transient peak. Partitions are returned unchanged where the compact
    /// copy does not fit beside them, or the backend cannot concatenate them (a merged
    /// dictionary its keys cannot index).
    pub(super) async fn concatenate(
        &self,
        partitions: Vec<StoredPartition>,
        device: u32,
        room: Room,
    ) -> Result<Vec<StoredPartition>, StoreError> {
        if partitions.len() <= 1 {
            return Ok(partitions);
        }
        let backend = &self.inner.backend;
        // Held for the copy: a spill meanwhile must not free them.
        let residents: Vec<_> = partitions.iter().map(|p| p.slot.resident()).collect();
        // Spilled, or gone back to disk, since the caller looked: not the device's to copy
        // now (they are compacted if they are ever brought back).
        if residents.iter().any(|r| r.tier != Tier::Device(device)) {
            return Ok(partitions);
        }
        let data: Vec<_> = residents.iter().map(|r| Arc::clone(&r.data)).collect();
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
        let rows = partitions.iter().map(|p| p.num_rows() as u64).sum();
        let reserved = match room {
            Room::Spill => self.reserve_on(device, charge(size, rows)).await,
            Room::Free => self.inner.budget.try_reserve(device, charge(size, rows)),
        };
        let reservation = match reserved {
            Ok(reservation) => reservation,
            Err(
                StoreError::MemoryExhausted {
                    requested,
                    used,
                    limit,
                    ..
                }
                | StoreError::TiersExhausted {
                    requested,
                    used,
                    limit,
                    ..
                },
            ) => {
                // The rows are stored and paid for already; only the compact copy does not
                // fit beside them. Keep the batches as they are rather than fail a put whose
                // data fits (reads and ipc-export serve them as they are).
                tracing::info!(
                    device,
                    partitions = partitions.len(),
                    requested,
                    used,
                    limit,
                    "batches kept uncompacted: no room for their compact copy"
                );
                return Ok(partitions);
            }
            Err(error) => return Err(error),
        };
        let data_bytes = partitions.iter().map(|p| p.data_bytes).sum();
        let started = std::time::Instant::now();
        let compacted = backend.concatenate(data).await?;
        drop(residents);
        let inner = &self.inner;
        inner.concatenations.fetch_add(1, Ordering::Relaxed);
        inner
            .concatenated_bytes
            .fetch_add(data_bytes, Ordering::Relaxed);
        inner.concatenation_nanos.fetch_add(
            u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        Ok(vec![inner.tiers.hold(compacted, reservation, data_bytes)])
    }
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
    use super::*;
    use crate::backend::HostBackend;
    use crate::store::StoreOptions;
    use crate::store::testing::{GatedBackend, batch, put};

    /// Other puts spill a put's uploaded partitions while it runs: by the time it compacts
    /// them they may be in the host tier, which is not the backend's to concatenate (on the
    /// cuda backend a soak saw INTERNAL "a partition from another backend").
    #[tokio::test]
    async fn partitions_spilled_before_their_compaction_are_left_as_they_are() {
        let store = Store::new(
            Arc::new(HostBackend::new()),
            StoreOptions {
                memory_limit: Some(1 << 20),
                host_memory_limit: Some(64 << 20),
                ..StoreOptions::default()
            },
        );
        let pending = put(
            &store,
            PutMode::Create,
            vec![batch(0..1000), batch(1000..2000)],
        )
        .await;
        let held: u64 = pending.partitions.iter().map(|p| p.memory_bytes()).sum();
        let all = store.inner.budget.free(0) + held;
        assert!(store.make_room(0, all).await, "both spill");
        assert!(pending.partitions.iter().all(|p| p.tier() == Tier::Host));
        let schema = pending.schema.clone().expect("schema");
        let partitions = store
            .compact_runs(&schema, pending.partitions.clone())
            .await
            .expect("nothing to compact on the device");
        assert_eq!(partitions.len(), 2);
        let kept = store
            .concatenate(pending.partitions.clone(), 0, Room::Free)
            .await
            .expect("left as they are");
        assert_eq!(kept.len(), 2);
    }

    #[tokio::test]
    async fn an_append_to_a_dataset_dropped_while_compacting_does_not_bring_it_back() {
        let backend = GatedBackend::new(HostBackend::new(), false);
        let (started, release) = (Arc::clone(&backend.started), Arc::clone(&backend.release));
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

    #[tokio::test]
    async fn a_move_aborts_when_the_dataset_changes_meanwhile() {
        let backend = GatedBackend::new(HostBackend::new().with_devices(2), false);
        let (started, release) = (Arc::clone(&backend.started), Arc::clone(&backend.release));
        let store = Store::new(Arc::new(backend), StoreOptions::default());
        for (mode, device, rows) in [(PutMode::Create, 0, 0..10), (PutMode::Append, 1, 10..20)] {
            let mut pending = store
                .begin_put_on("t".to_owned(), mode, "test", Some(device))
                .expect("begin");
            pending
                .declare_schema(batch(0..1).schema())
                .expect("schema");
            let upload = pending.upload(batch(rows), None).await.expect("reserve");
            pending.add(upload.expect("rows").await.expect("upload"));
            pending
                .commit()
                .await
                .expect("commit: one partition a device");
        }
        // Moving onto device 1 compacts there, which the gate holds while the dataset changes.
        let moving = tokio::spawn({
            let store = store.clone();
            async move { store.move_dataset("t", 1).await }
        });
        started.notified().await;
        store.remove("t").expect("drop while the move compacts");
        release.notify_one();
        let error = moving.await.expect("task").expect_err("changed meanwhile");
        assert!(
            matches!(error, StoreError::ChangedDuringMove { .. }),
            "{error}"
        );
        assert!(store.get("t").is_err(), "the drop stands");
        assert_eq!(
            store.status().devices[1].used_bytes,
            0,
            "the moved copy was freed"
        );
    }

    #[tokio::test]
    async fn a_move_abandoned_mid_copy_keeps_its_budget_until_the_copy_is_done() {
        let backend = GatedBackend::new(HostBackend::new().with_devices(2), true);
        let (started, release) = (Arc::clone(&backend.started), Arc::clone(&backend.release));
        let store = Store::new(Arc::new(backend), StoreOptions::default());
        let mut pending = store
            .begin_put_on("t".to_owned(), PutMode::Create, "test", Some(0))
            .expect("begin");
        pending
            .declare_schema(batch(0..1).schema())
            .expect("schema");
        let upload = pending
            .upload(batch(0..100_000), None)
            .await
            .expect("reserve");
        pending.add(upload.expect("rows").await.expect("upload"));
        pending.commit().await.expect("commit");
        let used = |store: &Store| store.status().devices[1].used_bytes;

        let moving = tokio::spawn({
            let store = store.clone();
            async move { store.move_dataset("t", 1).await }
        });
        started.notified().await;
        moving.abort();
        assert!(moving.await.is_err(), "the move was abandoned");
        assert!(
            used(&store) >= 800_000,
            "the copy still under way is still paid for"
        );
        release.notify_one();
        for _ in 0..100 {
            if used(&store) == 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(used(&store), 0, "returned with the copy's memory");
        assert_eq!(store.get("t").expect("t").device_runs()[0].1, 0);
    }
}
