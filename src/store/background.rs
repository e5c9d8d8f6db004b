//! Background compaction: the partitions appends add are compacted with their neighbours after
//! the commit, on a task of their own, so that an append costs what it adds and not the dataset.
//!
//! Neighbours on one device are compacted while they are of comparable size (the newer no larger
//! than the older and at least half of it), oldest pair first. That is the order in which
//! compacting after each append, one append at a time, would take them: every compaction at least
//! doubles the newer's bytes and grows the older's by half, so over n appends a byte is copied
//! O(log n) times and the dataset keeps O(log n) partitions, whether the compactions keep up with
//! the appends or catch up later.
//!
//! A compaction changes how rows are held, not which rows a version has: the compacted dataset keeps
//! its version number, so tickets issued for it stay valid and the persistence writer (which
//! follows versions) has nothing to write. Readers holding the version from before keep the
//! partitions they started on. A compaction is published only if its inputs are still where they
//! were in the dataset the catalog holds; after a replace, a drop or a move it is discarded.
//! Its copy is paid for only from memory free at the time: it never spills other partitions.
//!
//! One task runs per dataset name at a time; an append that commits while it runs asks it to
//! look once more rather than starting another. The task ends when nothing is left to compact.

use std::collections::HashMap;
use std::sync::Arc;

use dashmap::mapref::entry::Entry;

use super::catalog::Catalog;
use super::compactor::{Compactor, Room};
use super::dataset::Dataset;
use super::durable::Job;
use super::slot::{StoredPartition, Tier};
use super::stats::Stats;

/// Dataset names with a compaction task, each with whether an append committed since the task last
/// looked at the dataset (so that it looks again).
type Running = HashMap<String, bool>;

/// Background compactions of a catalog's appended partitions, through the one compactor.
#[derive(Debug)]
pub(crate) struct Background {
    catalog: Arc<Catalog>,
    compactor: Arc<Compactor>,
    /// Names whose partitions a compaction task is working on.
    running: tokio::sync::watch::Sender<Running>,
    stats: Arc<Stats>,
}

impl Background {
    pub(crate) fn new(catalog: Arc<Catalog>, compactor: Arc<Compactor>, stats: Arc<Stats>) -> Self {
        Self {
            catalog,
            compactor,
            running: tokio::sync::watch::Sender::new(Running::new()),
            stats,
        }
    }

    /// Starts compacting `name`'s partitions in the background, or asks the task already doing
    /// so to look again once it is done.
    pub(crate) fn schedule(self: &Arc<Self>, name: &str) {
        // Without a runtime there is nothing to run the task on; the next append will try.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut start = false;
        self.running
            .send_modify(|running| match running.get_mut(name) {
                Some(again) => *again = true,
                None => {
                    running.insert(name.to_owned(), false);
                    start = true;
                }
            });
        if start {
            let background = Arc::clone(self);
            let name = name.to_owned();
            runtime.spawn(async move { background.compact_while_asked(name).await });
        }
    }

    /// Waits until no background compaction is running or asked for. For tests and
    /// benchmarks, which look at partitions and copied bytes once the compactions their
    /// appends started are done; serving never needs to wait for one.
    pub(crate) async fn settled(&self) {
        let mut running = self.running.subscribe();
        // The sender lives as long as `self`: this cannot fail.
        let _ = running.wait_for(Running::is_empty).await;
    }

    /// Waits until no background compaction of `name` is running or asked for.
    pub(crate) async fn settled_for(&self, name: &str) {
        let mut running = self.running.subscribe();
        let _ = running
            .wait_for(|running| !running.contains_key(name))
            .await;
    }

    async fn compact_while_asked(self: Arc<Self>, name: String) {
        let mut task = Task {
            background: &self,
            name: &name,
            finished: false,
        };
        loop {
            self.compact(&name).await;
            let mut again = false;
            self.running
                .send_modify(|running| match running.get_mut(&name) {
                    Some(asked) if *asked => {
                        *asked = false;
                        again = true;
                    }
                    _ => {
                        running.remove(&name);
                    }
                });
            if !again {
                task.finished = true;
                return;
            }
        }
    }

    /// Compacts `name`'s comparable neighbours until none are left, or there is no room for
    /// the next one.
    async fn compact(&self, name: &str) {
        // Where the next pair may start: pairs before it were looked at already.
        let mut from = 0;
        loop {
            let Ok(dataset) = self.catalog.get(name) else {
                return;
            };
            let Some(at) = next_pair(dataset.partitions(), from) else {
                return;
            };
            let inputs = dataset.partitions()[at..at + 2].to_vec();
            let Tier::Device(device) = inputs[0].tier() else {
                from = at + 1;
                continue;
            };
            let schema = dataset.schema();
            // Not held through the copy: a drop meanwhile frees the rest of the dataset now.
            drop(dataset);
            let compacted = match self
                .compactor
                .compact(&schema, inputs.clone(), device, Room::Free)
                .await
            {
                Ok(compacted) => compacted,
                // Such as an input spilled since it was looked at: later pairs may still be
                // compacted, and this one at the next look.
                Err(error) => {
                    tracing::info!(dataset = name, %error, "a background compaction failed");
                    from = at + 1;
                    continue;
                }
            };
            let Ok([compacted]) = <[StoredPartition; 1]>::try_from(compacted) else {
                // No room for the copy, or the backend keeps these apart: later pairs may
                // still be compacted.
                from = at + 1;
                continue;
            };
            let bytes = compacted.data_bytes;
            let rows = compacted.num_rows();
            match self.publish(name, at, &inputs, compacted) {
                Some(version) => {
                    Stats::add(&self.stats.background_compactions, 1);
                    tracing::debug!(
                        dataset = name,
                        version,
                        rows,
                        bytes,
                        "appended partitions compacted"
                    );
                    // The compacted partition may now be comparable with the one before it.
                    from = at.saturating_sub(1);
                }
                None => {
                    tracing::debug!(
                        dataset = name,
                        "a compaction discarded: the dataset changed"
                    );
                    from = 0;
                }
            }
        }
    }

    /// Replaces `inputs`, at `at` in `name`'s partitions, with `compacted` (their rows, in one
    /// partition), keeping the dataset's version. Returns that version, or `None` where the
    /// dataset no longer holds `inputs` there.
    fn publish(
        &self,
        name: &str,
        at: usize,
        inputs: &[StoredPartition],
        compacted: StoredPartition,
    ) -> Option<u64> {
        let Entry::Occupied(mut entry) = self.catalog.entry(name) else {
            return None;
        };
        let current = entry.get();
        let partitions = current.partitions();
        let still_there = partitions.get(at..at + inputs.len()).is_some_and(|held| {
            held.iter()
                .zip(inputs)
                .all(|(held, input)| Arc::ptr_eq(&held.slot, &input.slot))
        });
        if !still_there {
            return None;
        }
        let mut kept = Vec::with_capacity(partitions.len() + 1 - inputs.len());
        kept.extend_from_slice(&partitions[..at]);
        kept.push(compacted);
        kept.extend_from_slice(&partitions[at + inputs.len()..]);
        let version = current.version_id();
        let dataset = Dataset::new(
            name.to_owned(),
            current.schema(),
            version,
            kept,
            Arc::clone(current.schema_charge()),
        );
        let dataset = Arc::new(dataset);
        // Queued while the entry is held, so that it follows the write of this version.
        let _ = self.catalog.persist(|_| Job::Compacted {
            dataset: Arc::downgrade(&dataset),
        });
        entry.insert(dataset);
        Some(version.number)
    }
}

/// The first pair of neighbours at or after `from` worth compacting: on one device, and of
/// comparable size.
fn next_pair(partitions: &[StoredPartition], from: usize) -> Option<usize> {
    partitions
        .get(from..)?
        .windows(2)
        .position(|pair| {
            let [older, newer] = pair else {
                return false;
            };
            let comparable = newer.data_bytes <= older.data_bytes
                && older.data_bytes <= newer.data_bytes.saturating_mul(2);
            comparable && matches!(newer.tier(), Tier::Device(_)) && older.tier() == newer.tier()
        })
        .map(|position| from + position)
}

/// A running compaction task: removes its name from the running ones if it ends without saying
/// it is done (it panicked, or the runtime is shutting down), so that
/// [`Background::settled`] does not wait for it forever.
struct Task<'a> {
    background: &'a Background,
    name: &'a str,
    finished: bool,
}

impl Drop for Task<'_> {
    fn drop(&mut self) {
        if !self.finished {
            self.background.running.send_modify(|running| {
                running.remove(self.name);
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use arrow::array::Int64Array;
    use arrow::record_batch::RecordBatch;
    use futures::TryStreamExt;

    use super::*;
    use crate::backend::HostBackend;
    use crate::store::testing::{DataDir, Gate, GatedBackend, batch, open_host, put};
    use crate::store::{PutMode, Store, StoreOptions};

    /// The values of column `x` of `batches`, in order.
    fn values(batches: &[RecordBatch]) -> Vec<i64> {
        batches
            .iter()
            .flat_map(|b| {
                b.column(0)
                    .as_any()
                    .downcast_ref::<Int64Array>()
                    .expect("int64")
                    .values()
                    .to_vec()
            })
            .collect()
    }

    async fn read(dataset: &Arc<Dataset>) -> Vec<i64> {
        let batches: Vec<RecordBatch> = dataset
            .read(0..dataset.num_rows(), 1 << 20, 2)
            .expect("read")
            .try_collect()
            .await
            .expect("read");
        values(&batches)
    }

    /// Whether `slot` is marked as held on disk within five seconds (the persistence writer
    /// marks it after its own work).
    async fn held_on_disk_soon(slot: &crate::store::slot::Slot) -> bool {
        for _ in 0..500 {
            if slot.on_disk().is_some() {
                return true;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        false
    }

    async fn commit(store: &Store, mode: PutMode, batches: Vec<RecordBatch>) {
        put(store, mode, batches)
            .await
            .commit()
            .await
            .expect("commit");
    }

    #[tokio::test]
    async fn an_append_commit_copies_what_it_adds_and_merges_after() {
        let backend = GatedBackend::new(HostBackend::new(), Gate::Compactions);
        let (started, release) = (Arc::clone(&backend.started), Arc::clone(&backend.release));
        let store = Store::new(Arc::new(backend), StoreOptions::default());
        commit(&store, PutMode::Create, vec![batch(0..1000)]).await;
        let append = put(
            &store,
            PutMode::Append,
            vec![batch(1000..1500), batch(1500..2000)],
        );
        let committing = tokio::spawn(append.await.commit());
        // The append's own two batches, compacted.
        started.notified().await;
        release.notify_one();
        // The next copy is the dataset's merge, which the commit did not wait for.
        started.notified().await;
        assert!(
            committing.is_finished(),
            "the commit returned before the dataset was merged"
        );
        let summary = committing.await.expect("task").expect("append");
        let status = store.status();
        assert_eq!(
            (status.concatenations, status.concatenated_bytes),
            (1, summary.bytes),
            "the commit copied the appended bytes, not the dataset"
        );
        assert_eq!(store.get("t").expect("t").num_partitions(), 2);

        release.notify_one();
        store.compactions_settled().await;
        let status = store.status();
        assert_eq!(status.merges, 1);
        assert_eq!(
            (status.concatenations, status.concatenated_bytes),
            (2, summary.bytes + summary.total_bytes)
        );
        let dataset = store.get("t").expect("t");
        assert_eq!(dataset.num_partitions(), 1);
        assert_eq!(read(&dataset).await, (0..2000).collect::<Vec<_>>());
    }

    #[tokio::test]
    async fn readers_and_tickets_of_a_version_outlive_its_merge() {
        let backend = GatedBackend::new(HostBackend::new(), Gate::Compactions);
        let (started, release) = (Arc::clone(&backend.started), Arc::clone(&backend.release));
        let store = Store::new(Arc::new(backend), StoreOptions::default());
        commit(&store, PutMode::Create, vec![batch(0..1000)]).await;
        commit(&store, PutMode::Append, vec![batch(1000..2000)]).await;
        let before = store.get("t").expect("t");
        assert_eq!(before.num_partitions(), 2);
        // A read under way: a chunk of it taken, the rest still to come.
        let mut reading = before.read(0..2000, 800, 1).expect("read");
        let first = reading.try_next().await.expect("read").expect("a chunk");

        started.notified().await;
        release.notify_one();
        store.compactions_settled().await;
        let after = store.get("t").expect("t");
        assert_eq!(after.num_partitions(), 1, "merged");
        assert_eq!(
            after.version(),
            before.version(),
            "the same rows: tickets for the version still read"
        );
        let mut rest: Vec<RecordBatch> = reading.try_collect().await.expect("the read goes on");
        rest.insert(0, first);
        assert_eq!(values(&rest), (0..2000).collect::<Vec<_>>());
        assert_eq!(read(&before).await, read(&after).await);
    }

    #[tokio::test]
    async fn a_merge_is_discarded_when_the_dataset_is_dropped_or_replaced() {
        for replace in [false, true] {
            let backend = GatedBackend::new(HostBackend::new(), Gate::Compactions);
            let (started, release) = (Arc::clone(&backend.started), Arc::clone(&backend.release));
            let store = Store::new(Arc::new(backend), StoreOptions::default());
            commit(&store, PutMode::Create, vec![batch(0..1000)]).await;
            commit(&store, PutMode::Append, vec![batch(1000..2000)]).await;
            started.notified().await;
            if replace {
                commit(&store, PutMode::Replace, vec![batch(5..10)]).await;
            } else {
                store.remove("t").expect("drop");
            }
            release.notify_one();
            store.compactions_settled().await;
            let status = store.status();
            assert_eq!(
                (status.concatenations, status.merges),
                (1, 0),
                "copied, then discarded"
            );
            assert_eq!(
                status.devices[0].used_bytes, status.bytes,
                "nothing but the catalog holds memory"
            );
            if replace {
                let dataset = store.get("t").expect("t");
                assert_eq!(read(&dataset).await, (5..10).collect::<Vec<_>>());
            } else {
                assert!(store.get("t").is_err(), "the drop stands");
                assert_eq!(status.devices[0].used_bytes, 0);
            }
        }
    }

    #[tokio::test]
    async fn an_append_committed_while_merging_keeps_the_merge() {
        let backend = GatedBackend::new(HostBackend::new(), Gate::Compactions);
        let (started, release) = (Arc::clone(&backend.started), Arc::clone(&backend.release));
        let store = Store::new(Arc::new(backend), StoreOptions::default());
        commit(&store, PutMode::Create, vec![batch(0..1000)]).await;
        commit(&store, PutMode::Append, vec![batch(1000..2000)]).await;
        started.notified().await;
        // Too small to merge with the two before it, whether merged or not.
        commit(&store, PutMode::Append, vec![batch(2000..2100)]).await;
        let version = store.get("t").expect("t").version();
        release.notify_one();
        store.compactions_settled().await;
        let dataset = store.get("t").expect("t");
        assert_eq!(store.status().merges, 1);
        assert_eq!(dataset.version(), version);
        assert_eq!(dataset.num_partitions(), 2);
        assert_eq!(read(&dataset).await, (0..2100).collect::<Vec<_>>());
    }

    #[tokio::test]
    async fn a_merge_without_room_spills_nothing() {
        let other = batch(0..4000);
        let rows = || (batch(0..1000), batch(1000..2000));
        // What the datasets below hold once put, with the second batch a dataset of its own
        // (one more schema's charge than an append of it, far less than a merged copy).
        let probe = Store::new(Arc::new(HostBackend::new()), StoreOptions::default());
        let (first, second) = rows();
        for (name, batch) in [("other", &other), ("t", &first), ("u", &second)] {
            let mut pending = probe
                .begin_put(name.to_owned(), PutMode::Create, "test")
                .expect("begin");
            pending.declare_schema(batch.schema()).expect("schema");
            let upload = pending.upload(batch.clone(), None).await.expect("reserve");
            pending.add(upload.expect("rows").await.expect("upload"));
            pending.commit().await.expect("commit");
        }
        let limit = probe.status().devices[0].used_bytes;
        let store = Store::new(
            Arc::new(HostBackend::new()),
            StoreOptions {
                memory_limit: Some(limit),
                host_memory_limit: Some(1 << 30),
                ..StoreOptions::default()
            },
        );
        let mut pending = store
            .begin_put("other".to_owned(), PutMode::Create, "test")
            .expect("begin");
        pending.declare_schema(other.schema()).expect("schema");
        let upload = pending.upload(other.clone(), None).await.expect("reserve");
        pending.add(upload.expect("rows").await.expect("upload"));
        pending.commit().await.expect("other");
        commit(&store, PutMode::Create, vec![first]).await;
        commit(&store, PutMode::Append, vec![second]).await;
        store.compactions_settled().await;
        let status = store.status();
        assert_eq!(status.tiers.spills, 0, "{:?}", status.tiers);
        assert_eq!((status.merges, status.concatenations), (0, 0));
        assert_eq!(store.get("other").expect("other").tier_bytes().host, 0);
        assert_eq!(store.get("t").expect("t").num_partitions(), 2);

        // With room, the next append's merges run.
        store.remove("other").expect("drop");
        commit(&store, PutMode::Append, vec![batch(2000..3000)]).await;
        store.compactions_settled().await;
        assert!(store.status().merges >= 1);
        let dataset = store.get("t").expect("t");
        assert!(dataset.num_partitions() < 3);
        assert_eq!(read(&dataset).await, (0..3000).collect::<Vec<_>>());
    }

    #[tokio::test]
    async fn appends_copy_each_byte_a_logarithmic_number_of_times() {
        let store = Store::new(Arc::new(HostBackend::new()), StoreOptions::default());
        let appends = 256_i64;
        let rows = 1000;
        for i in 0..appends {
            let mode = if i == 0 {
                PutMode::Create
            } else {
                PutMode::Append
            };
            put(&store, mode, vec![batch(i * rows..(i + 1) * rows)])
                .await
                .commit()
                .await
                .expect("append");
        }
        store.compactions_settled().await;
        let dataset = store.get("t").expect("dataset");
        assert_eq!(dataset.num_rows(), (appends * rows) as u64);
        let total = dataset.data_bytes();
        let copied = store.status().concatenated_bytes;
        // Recopying the dataset at every append would copy about appends / 2 times its size.
        assert!(
            copied <= total * 9,
            "{copied} bytes copied for {total} appended: more than log2(256) + 1 times"
        );
        assert!(
            dataset.num_partitions() <= 9,
            "{} partitions",
            dataset.num_partitions()
        );
        assert_eq!(
            read(&dataset).await,
            (0..appends * rows).collect::<Vec<_>>()
        );
    }

    /// With `--data-dir` and no host tier (the host backend's default), memory is made by
    /// letting partitions the data directory holds go back to it. A partition a background
    /// compaction made holds rows the directory holds too: it must be able to go as well.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_partition_compacted_in_the_background_can_go_back_to_the_data_directory() {
        let dir = DataDir::new("held");
        let store = open_host(&dir.options(Some(8 << 20), 0)).await;
        // Small enough for the host backend to compact, and for their files to be merged.
        commit(&store, PutMode::Create, vec![batch(0..100_000)]).await;
        commit(&store, PutMode::Append, vec![batch(100_000..200_000)]).await;
        store.compactions_settled().await;
        let dataset = store.get("t").expect("t");
        assert_eq!(dataset.num_partitions(), 1, "compacted");
        let slot = Arc::clone(&dataset.partitions()[0].slot);
        drop(dataset);
        assert!(held_on_disk_soon(&slot).await, "not marked as held on disk");
        let budget = store.tiers.budget();
        let wanted = budget.free(0) + slot.look(|resident| resident.reservation.bytes());
        assert!(store.tiers.reserve_on(0, wanted).await.is_ok(), "room made");
        assert_eq!(slot.resident().tier, Tier::Disk);
        let dataset = store.get("t").expect("t");
        assert_eq!(read(&dataset).await, (0..200_000).collect::<Vec<_>>());
        drop(dataset);
        store.close().await;
    }

    /// Many small appends: the merger joins their files in runs of its own, and background
    /// compactions join their partitions in others, so partitions begin and end inside
    /// files. Each must still be held by the files its rows are in, and able to go back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn partitions_that_end_inside_files_can_go_back_to_the_data_directory() {
        let dir = DataDir::new("window");
        let store = open_host(&dir.options(Some(16 << 20), 0)).await;
        const ROWS: i64 = 50_000;
        commit(&store, PutMode::Create, vec![batch(0..ROWS)]).await;
        for i in 1..12 {
            commit(
                &store,
                PutMode::Append,
                vec![batch(i * ROWS..(i + 1) * ROWS)],
            )
            .await;
        }
        store.compactions_settled().await;
        let all_held = |store: &Store| {
            let dataset = store.get("t").expect("t");
            dataset
                .partitions()
                .iter()
                .all(|p| p.slot.on_disk().is_some())
        };
        for _ in 0..500 {
            if all_held(&store) {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let dataset = store.get("t").expect("t");
        let held: Vec<bool> = dataset
            .partitions()
            .iter()
            .map(|p| p.slot.on_disk().is_some())
            .collect();
        assert!(held.iter().all(|&h| h), "held on disk: {held:?}");
        let budget = store.tiers.budget();
        let wanted = budget.free(0) + dataset.tier_bytes().device;
        assert!(store.tiers.reserve_on(0, wanted).await.is_ok(), "room made");
        let placed = dataset.tier_bytes();
        assert_eq!(placed.device, 0, "every partition went back");
        assert!(
            placed.disk <= dir.segment_bytes(),
            "{} bytes on disk counted for {} of files",
            placed.disk,
            dir.segment_bytes()
        );
        assert_eq!(read(&dataset).await, (0..12 * ROWS).collect::<Vec<_>>());
        drop(dataset);
        store.close().await;
    }

    /// A background compaction of partitions whose files the merger leaves as they are
    /// (each of 1 MiB or more; the host backend compacts dictionary columns whatever their
    /// size): the compacted partition is marked as held by those files when it is published,
    /// not only after a merge.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_compaction_of_large_files_marks_its_partition_held_on_disk() {
        use arrow::array::{DictionaryArray, StringArray};
        use arrow::datatypes::Int32Type;
        let dir = DataDir::new("dict");
        let store = open_host(&dir.options(None, 0)).await;
        let dictionary = |from: i32| {
            let keys =
                arrow::array::Int32Array::from_iter_values((from..from + 300_000).map(|k| k % 4));
            let values = Arc::new(StringArray::from(vec!["a", "b", "c", "d"]));
            let column: arrow::array::ArrayRef =
                Arc::new(DictionaryArray::<Int32Type>::try_new(keys, values).expect("dictionary"));
            RecordBatch::try_from_iter([("d", column)]).expect("batch")
        };
        commit(&store, PutMode::Create, vec![dictionary(0)]).await;
        commit(&store, PutMode::Append, vec![dictionary(1)]).await;
        store.compactions_settled().await;
        let dataset = store.get("t").expect("t");
        assert_eq!(dataset.num_partitions(), 1, "compacted");
        let slot = Arc::clone(&dataset.partitions()[0].slot);
        drop(dataset);
        assert!(held_on_disk_soon(&slot).await, "not marked as held on disk");
        assert_eq!(store.status().merges, 1, "one background compaction");
        store.close().await;
    }
}
