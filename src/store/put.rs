//! Puts: a [`PendingPut`] collects uploaded partitions privately, then commits them in one
//! catalog operation (compacting them first where the backend wants that).

use std::sync::Arc;

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use dashmap::mapref::entry::Entry;
use futures::future::BoxFuture;

use super::background::Background;
use super::catalog::Catalog;
use super::compactor::Compactor;
use super::dataset::Dataset;
use super::durable::{self, Job};
use super::error::StoreError;
use super::import::CheckedImport;
use super::memory::{ARRAY_OVERHEAD, Reservation, charge, stored_charge};
use super::options::PutMode;
use super::progress::{InFlight, Registered};
use super::slot::StoredPartition;
use super::tier::{MessageYields, Tiers};
use crate::arrays::{batch_bytes, schema_bytes};
use crate::backend::Backend;

/// What a committed put reports back to the client.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
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

/// The components a put reserves, uploads, compacts and commits through.
#[derive(Debug)]
pub(crate) struct Puts {
    backend: Arc<dyn Backend>,
    tiers: Arc<Tiers>,
    compactor: Arc<Compactor>,
    catalog: Arc<Catalog>,
    background: Arc<Background>,
    in_flight: Arc<InFlight>,
}

impl Puts {
    pub(crate) fn new(
        backend: Arc<dyn Backend>,
        tiers: Arc<Tiers>,
        compactor: Arc<Compactor>,
        catalog: Arc<Catalog>,
        background: Arc<Background>,
        in_flight: Arc<InFlight>,
    ) -> Self {
        Self {
            backend,
            tiers,
            compactor,
            catalog,
            background,
            in_flight,
        }
    }

    /// Starts a put by `owner` on `device`, or placed by the store when `None`: on the device
    /// with the most free memory, moving to the next-freest one for each batch that no longer
    /// fits, so a dataset larger than any one device is spread across them, partition by
    /// partition. A put on a named device stays there. `create` fails here already if the name
    /// is taken, so a client learns it before sending any data; the check is repeated
    /// atomically at commit. The put is listed in `status` until it commits or is dropped.
    pub(crate) fn begin(
        self: &Arc<Self>,
        name: String,
        mode: PutMode,
        owner: &str,
        device: Option<u32>,
    ) -> Result<PendingPut, StoreError> {
        let budget = self.tiers.budget();
        if let Some(device) = device {
            budget.check_device(device)?;
        }
        if mode == PutMode::Create && self.catalog.contains(&name) {
            return Err(StoreError::AlreadyExists { name });
        }
        Ok(PendingPut {
            progress: self.in_flight.register(&name, mode, owner),
            puts: Arc::clone(self),
            name,
            mode,
            device: device.unwrap_or_else(|| budget.freest_device()),
            fixed: device.is_some(),
            schema: None,
            schema_charge: None,
            partitions: Vec::new(),
            rows: 0,
            data_bytes: 0,
            must_exist: false,
        })
    }
}

/// A put in progress: uploaded partitions that nobody else can see yet.
#[derive(Debug)]
pub struct PendingPut {
    /// Listed in `status` while the put runs.
    progress: Registered,
    puts: Arc<Puts>,
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
    /// Commit only over the dataset as it exists (see [`PendingPut::require_existing`]).
    must_exist: bool,
}

/// An upload running in the backend; resolve it and pass the result to [`PendingPut::add`].
pub type Upload = BoxFuture<'static, Result<StoredPartition, StoreError>>;

impl PendingPut {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Makes the put fail with [`StoreError::NotFound`] unless its dataset exists: now, and
    /// again in the catalog operation that commits it. An `append` (or `replace`) that must not
    /// create its dataset (Flight SQL ingestion with `if_not_exist = FAIL`, ADBC's `append`)
    /// then fails, committing nothing, when the dataset is dropped while it runs.
    pub fn require_existing(&mut self) -> Result<(), StoreError> {
        if !self.puts.catalog.contains(&self.name) {
            return Err(StoreError::NotFound {
                name: self.name.clone(),
            });
        }
        self.must_exist = true;
        Ok(())
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
        let catalog = &self.puts.catalog;
        catalog.check_damage(&self.name, self.mode)?;
        if self.mode == PutMode::Append
            && let Ok(existing) = catalog.get(&self.name)
        {
            check_append_schema(&existing, &schema)?;
        }
        let charge = self
            .puts
            .tiers
            .budget()
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
        let bytes = stored_charge(self.puts.backend.as_ref(), &batch)?;
        let mut message = message;
        let reservation = self.reserve(bytes, &mut message).await?;
        let data_bytes = batch_bytes(&batch);
        self.rows = self.rows.saturating_add(batch.num_rows() as u64);
        self.data_bytes = self.data_bytes.saturating_add(data_bytes);
        self.progress
            .progress
            .add(batch.num_rows() as u64, data_bytes);
        Ok(Some(self.puts.tiers.upload(batch, reservation, message)))
    }

    /// Adds the rows another process holds on the put's device (`ipc-import`), as `import`
    /// describes them (see [`crate::store::Store::check_import`]): declares their schema, pays
    /// for what the backend's plan allocates first, as an upload does (spilling other
    /// partitions to make room), then has the backend carry the plan out, copying the columns
    /// into memory of its own and checking them there. Fails with nothing kept where the
    /// schema is not the put's, the memory does not fit, or the producer's data is refused.
    pub async fn import(&mut self, import: CheckedImport) -> Result<(), StoreError> {
        let CheckedImport {
            schema,
            rows,
            plan,
            arrays,
            data_bytes,
        } = import;
        self.declare_schema(Arc::clone(&schema))?;
        if rows == 0 {
            return Ok(());
        }
        let backend = Arc::clone(&self.puts.backend);
        let cost = charge(plan.allocated_bytes(), rows)
            .saturating_add(ARRAY_OVERHEAD.saturating_mul(arrays));
        let reservation = self.reserve(cost, &mut None).await?;
        let rows_usize = usize::try_from(rows).unwrap_or(usize::MAX);
        let data = backend
            .import(self.device, schema, rows_usize, plan)
            .await?;
        self.rows = self.rows.saturating_add(rows);
        self.data_bytes = self.data_bytes.saturating_add(data_bytes);
        self.progress.progress.add(rows, data_bytes);
        let stored = self.puts.tiers.hold(data, reservation, data_bytes);
        self.partitions.push(stored);
        Ok(())
    }

    /// Reserves `bytes` on the put's device or, for a put the store places, on the freest
    /// device that has room, which the put then stays on. Where none has room, the charge of
    /// the batch's own `message` on a device yields first (see [`Tiers::message_yields`]):
    /// it moves to the host tier, or becomes part of the batch's charge where the batch is
    /// the message's memory, so that a put fits whenever its bytes are free (a charge on
    /// another device stays beside until the upload is done); then partitions on the put's
    /// device are spilled to the host tier to make room. Fails saying what every tier holds
    /// when that does not make room either.
    async fn reserve(
        &mut self,
        bytes: u64,
        message: &mut Option<Reservation>,
    ) -> Result<Reservation, StoreError> {
        if let Some(reservation) = self.reserve_without_spilling(bytes)? {
            return Ok(reservation);
        }
        if let Some(charged) = message.take() {
            match self.puts.tiers.message_yields(charged, self.device) {
                MessageYields::Within(charged) => {
                    // Only the rest is reserved, so that the message's bytes stay paid for
                    // while room is made.
                    let rest = bytes.saturating_sub(charged.bytes());
                    let mut reservation = self.puts.tiers.reserve_on(self.device, rest).await?;
                    if let Err(other) = reservation.absorb(charged) {
                        *message = Some(other);
                    }
                    reservation.resize(bytes)?;
                    return Ok(reservation);
                }
                MessageYields::Beside(charged) => *message = Some(charged),
            }
            if let Some(reservation) = self.reserve_without_spilling(bytes)? {
                return Ok(reservation);
            }
        }
        self.puts.tiers.reserve_on(self.device, bytes).await
    }

    /// `bytes` on the put's device, or another with room where the store places the put;
    /// `None` where none has room.
    fn reserve_without_spilling(&mut self, bytes: u64) -> Result<Option<Reservation>, StoreError> {
        let budget = self.puts.tiers.budget();
        match budget.try_reserve(self.device, bytes) {
            Err(StoreError::MemoryExhausted { .. }) => {}
            reserved => return reserved.map(Some),
        }
        if !self.fixed {
            for device in budget.freest_devices() {
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
    pub fn add(&mut self, uploaded: StoredPartition) {
        self.partitions.push(uploaded);
    }

    /// Compacts the put's partitions and makes them visible in one catalog operation (after
    /// the dataset's, for `append`), or fails leaving the catalog untouched: where the name is
    /// taken for `create`, or free for a put that [requires its
    /// dataset](Self::require_existing). An append copies only its own batches here, so that
    /// its cost follows what it adds, not the dataset: the dataset's partitions are compacted
    /// afterwards, in the background (`background`).
    pub async fn commit(self) -> Result<PutSummary, StoreError> {
        let (Some(schema), Some(schema_charge)) = (self.schema, self.schema_charge) else {
            return Err(StoreError::MissingSchema);
        };
        let puts = self.puts;
        let catalog = &puts.catalog;
        if self.mode == PutMode::Append
            && let Ok(existing) = catalog.get(&self.name)
        {
            check_append_schema(&existing, &schema)?;
        }
        let compacted = puts
            .compactor
            .compact_runs(&schema, self.partitions)
            .await?;

        let version = catalog.next_version();
        let summary = |dataset: &Dataset| PutSummary {
            name: dataset.name().to_owned(),
            mode: self.mode,
            rows: self.rows,
            bytes: self.data_bytes,
            total_rows: dataset.num_rows(),
            total_bytes: dataset.data_bytes(),
        };
        // Each arm makes the new version visible and queues it for the disk while it still
        // holds the name's entry: the writer sees a name's versions in commit order.
        let (committed, previous, persisted) = match catalog.entry(&self.name) {
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
                let persisted = catalog.persist(|done| Job::Write {
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
                let persisted = catalog.persist_whole(&dataset);
                let previous = entry.insert(Arc::clone(&dataset));
                (dataset, Some(previous), persisted)
            }
            Entry::Vacant(_) if self.must_exist => {
                return Err(StoreError::NotFound { name: self.name });
            }
            Entry::Vacant(entry) => {
                catalog.check_damage(&self.name, self.mode)?;
                let dataset = Arc::new(Dataset::new(
                    self.name.clone(),
                    schema,
                    version,
                    compacted,
                    schema_charge,
                ));
                let persisted = catalog.persist_whole(&dataset);
                entry.insert(Arc::clone(&dataset));
                (dataset, None, persisted)
            }
        };
        if let Err(error) = durable::wait(persisted).await {
            catalog.undo(&self.name, version.number, previous);
            return Err(error);
        }
        catalog.replaced_on_disk(&self.name);
        if self.mode == PutMode::Append {
            puts.background.schedule(&self.name);
        }
        Ok(summary(&committed))
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
    use crate::store::compactor::Room;
    use crate::store::slot::Tier;
    use crate::store::testing::{DataDir, Gate, GatedBackend, batch, open_host, put};
    use crate::store::{Store, StoreOptions};

    /// Waits up to a second for every device of `store` to hold nothing (memory that tasks
    /// still running give back when they end).
    async fn nothing_used_soon(store: &Store) {
        for _ in 0..100 {
            if store.status().devices.iter().all(|d| d.used_bytes == 0) {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }

    /// A store over the host backend with a device of 1 MiB and a host tier of 64 MiB.
    fn small_device() -> Store {
        Store::new(
            Arc::new(HostBackend::new()),
            StoreOptions {
                memory_limit: Some(1 << 20),
                host_memory_limit: Some(64 << 20),
                ..StoreOptions::default()
            },
        )
    }

    /// Other puts spill a put's uploaded partitions while it runs: by the time it compacts
    /// them they may be in the host tier, which is not the backend's to compact (on the
    /// cuda backend a soak saw INTERNAL "a partition from another backend").
    #[tokio::test]
    async fn partitions_spilled_before_their_compaction_are_left_as_they_are() {
        let store = small_device();
        let pending = put(
            &store,
            PutMode::Create,
            vec![batch(0..1000), batch(1000..2000)],
        )
        .await;
        let held: u64 = pending.partitions.iter().map(|p| p.memory_bytes()).sum();
        let all = store.tiers.budget().free(0) + held;
        assert!(store.tiers.reserve_on(0, all).await.is_ok(), "both spill");
        assert!(pending.partitions.iter().all(|p| p.tier() == Tier::Host));
        let schema = pending.schema.clone().expect("schema");
        let partitions = store
            .puts
            .compactor
            .compact_runs(&schema, pending.partitions.clone())
            .await
            .expect("nothing to compact on the device");
        assert_eq!(partitions.len(), 2);
        let kept = store
            .puts
            .compactor
            .compact_always(pending.partitions.clone(), 0, Room::Free)
            .await
            .expect("left as they are");
        assert_eq!(kept.len(), 2);
    }

    #[tokio::test]
    async fn an_append_to_a_dataset_dropped_while_compacting_does_not_bring_it_back() {
        let backend = GatedBackend::new(HostBackend::new(), Gate::Compactions);
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
    async fn an_append_that_requires_its_dataset_fails_when_it_is_dropped_while_compacting() {
        let backend = GatedBackend::new(HostBackend::new(), Gate::Compactions);
        let (started, release) = (Arc::clone(&backend.started), Arc::clone(&backend.release));
        let store = Store::new(Arc::new(backend), StoreOptions::default());
        let mut absent = store
            .begin_put("t".to_owned(), PutMode::Append, "test")
            .expect("begin");
        assert!(matches!(
            absent.require_existing(),
            Err(StoreError::NotFound { .. })
        ));
        drop(absent);
        put(&store, PutMode::Create, vec![batch(0..10)])
            .await
            .commit()
            .await
            .expect("create");
        let mut append = put(&store, PutMode::Append, vec![batch(10..15), batch(15..20)]).await;
        append
            .require_existing()
            .expect("t exists when the append begins");
        let commit = tokio::spawn(append.commit());
        started.notified().await;
        store.remove("t").expect("drop while the append compacts");
        release.notify_one();
        let error = commit.await.expect("task").expect_err("t is gone");
        assert!(
            matches!(&error, StoreError::NotFound { name } if name == "t"),
            "{error}"
        );
        assert!(
            store.get("t").is_err(),
            "the drop stands: nothing committed"
        );
        nothing_used_soon(&store).await;
        assert_eq!(
            store.status().devices[0].used_bytes,
            0,
            "the append's memory is returned"
        );
    }

    #[tokio::test]
    async fn a_move_aborts_when_the_dataset_changes_meanwhile() {
        let backend = GatedBackend::new(HostBackend::new().with_devices(2), Gate::Compactions);
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
        let backend = GatedBackend::new(HostBackend::new().with_devices(2), Gate::Copies);
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
        nothing_used_soon(&store).await;
        assert_eq!(used(&store), 0, "returned with the copy's memory");
        assert_eq!(store.get("t").expect("t").device_runs()[0].1, 0);
    }

    /// The cuda backend uploads on a task of its own, which goes on when a failed DoPut drops
    /// the upload's future: the memory it allocates stays paid for until it is freed.
    #[tokio::test]
    async fn an_upload_abandoned_mid_copy_keeps_its_budget_until_the_copy_is_done() {
        let backend = GatedBackend::new(HostBackend::new(), Gate::Uploads);
        let (started, release) = (Arc::clone(&backend.started), Arc::clone(&backend.release));
        let store = Store::new(Arc::new(backend), StoreOptions::default());
        let used = |store: &Store| store.status().devices[0].used_bytes;
        let mut pending = store
            .begin_put("t".to_owned(), PutMode::Create, "test")
            .expect("begin");
        pending
            .declare_schema(batch(0..1).schema())
            .expect("schema");
        let schema_only = used(&store);
        let upload = pending
            .upload(batch(0..100_000), None)
            .await
            .expect("reserve")
            .expect("rows");
        started.notified().await;
        drop(upload);
        drop(pending);
        assert!(
            used(&store) >= 800_000,
            "the upload still under way is still paid for"
        );
        release.notify_one();
        nothing_used_soon(&store).await;
        assert!(schema_only > 0, "the schema was charged");
        assert_eq!(used(&store), 0, "returned with the upload's memory");
    }

    /// On the host backend a batch is the memory of the message it was decoded from. While
    /// its put waits to make room, that memory stays paid for: the message's charge becomes
    /// part of the batch's, rather than being given back before the wait.
    #[tokio::test]
    async fn a_message_stays_paid_for_while_its_batch_waits_for_room() {
        let store = small_device();
        let used = |store: &Store| store.tiers.budget().used(0);
        put(&store, PutMode::Create, vec![batch(0..100_000)])
            .await
            .commit()
            .await
            .expect("a dataset filling most of the device");
        let mut pending = store
            .begin_put("u".to_owned(), PutMode::Create, "test")
            .expect("begin");
        pending
            .declare_schema(batch(0..1).schema())
            .expect("schema");
        let message = store
            .reserve_message(100_000)
            .expect("room for the message");
        assert_eq!(message.device(), 0);
        let before = used(&store);
        let turn = store.tiers.room_turn(0).await;
        let uploading = tokio::spawn(async move {
            let upload = pending
                .upload(batch(0..40_000), Some(message))
                .await?
                .expect("rows");
            let uploaded = upload.await?;
            pending.add(uploaded);
            pending.commit().await
        });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(
            !uploading.is_finished(),
            "waiting for the turn to make room"
        );
        assert!(
            used(&store) >= before,
            "the message is still paid for: {} of {before}",
            used(&store)
        );
        drop(turn);
        uploading
            .await
            .expect("task")
            .expect("room made by a spill");
        assert!(used(&store) < 1 << 20);
    }

    /// The same where the message was charged to another device than its batch's: its
    /// charge stays there until the batch is paid for, so the memory is never counted on
    /// neither device.
    #[tokio::test]
    async fn a_message_on_another_device_stays_paid_for_while_its_batch_waits_for_room() {
        let store = Store::new(
            Arc::new(HostBackend::new().with_devices(2)),
            StoreOptions {
                memory_limit: Some(1 << 20),
                host_memory_limit: Some(64 << 20),
                ..StoreOptions::default()
            },
        );
        let used = |device: u32| store.tiers.budget().used(device);
        let mut filler = store
            .begin_put_on("a".to_owned(), PutMode::Create, "test", Some(0))
            .expect("begin");
        filler.declare_schema(batch(0..1).schema()).expect("schema");
        let upload = filler.upload(batch(0..100_000), None).await.expect("room");
        filler.add(upload.expect("rows").await.expect("upload"));
        filler.commit().await.expect("most of device 0");
        let mut pending = store
            .begin_put_on("u".to_owned(), PutMode::Create, "test", Some(0))
            .expect("begin");
        pending
            .declare_schema(batch(0..1).schema())
            .expect("schema");
        let message = store
            .reserve_message(100_000)
            .expect("room for the message");
        assert_eq!(message.device(), 1, "the freest device");
        let turn = store.tiers.room_turn(0).await;
        let uploading = tokio::spawn(async move {
            let upload = pending
                .upload(batch(0..40_000), Some(message))
                .await?
                .expect("rows");
            pending.add(upload.await?);
            pending.commit().await
        });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(
            !uploading.is_finished(),
            "waiting for the turn to make room"
        );
        assert!(
            used(1) >= 100_000,
            "the message is still paid for: {}",
            used(1)
        );
        drop(turn);
        uploading
            .await
            .expect("task")
            .expect("room made by a spill");
        assert_eq!(used(1), 0, "given back once the batch was uploaded");
    }

    /// With no host tier (the host backend's default), a message that finds no room makes
    /// it by putting a dataset the data directory holds back there: data on disk never
    /// stands in the way of a put, whether the room is wanted for a message or its batch.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_message_makes_room_by_evicting_a_dataset_held_on_disk() {
        let dir = DataDir::new("msg");
        let store = open_host(&dir.options(Some(64 << 20), 0)).await;
        put(&store, PutMode::Create, vec![batch(0..5_000_000)])
            .await
            .commit()
            .await
            .expect("40 MB of 64, written to disk");
        let held = store.get("t").expect("t").partitions()[0].clone();
        let mut message = store
            .reserve_message(20 << 20)
            .expect("20 MB beside the 40");
        assert_eq!(held.tier(), Tier::Device(0));
        store
            .grow_message(&mut message, 10 << 20)
            .expect("10 MB more: room made by evicting t");
        assert_eq!(held.tier(), Tier::Disk);
        let other = store
            .reserve_message(20 << 20)
            .expect("a new message, in the room made");
        drop((message, other, held));
        store.close().await;
    }
}
