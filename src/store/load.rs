//! Loading: partitions brought back into memory, from the disk tier (datasets of
//! `--data-dir` whose rows are not loaded yet) and, onto their devices, from the host tier.
//!
//! A server starts by reading its manifest and each dataset's schema, not its rows, so it
//! answers at once whatever the directory holds. Each dataset then is one partition whose rows
//! are its segment files ([`DiskPartition`]), pinned so that no commit deletes them while a
//! version naming them lives. The first read of such a partition loads it: into the host tier
//! where that has room (DoGet serves it from there as it is), else onto its device. An
//! `ipc-export`, a move or a copy, which need it on a device, load it there directly. Checksums
//! are verified as a segment is loaded, so a damaged file fails the reads of its own dataset,
//! with DATA_LOSS and the file's name, and nothing else.
//!
//! A partition spilled to the host tier is read from there as it is; where it must be on its
//! device (an `ipc-export`), it is restored there ([`Loader::restore`]).

use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Weak};
use std::time::Instant;

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt, TryFutureExt, TryStreamExt};

use super::compactor::Compactor;
use super::error::StoreError;
use super::files::{PinnedSegment, Segment, SegmentFiles};
use super::memory::{Reservation, stored_charge};
use super::slot::{Resident, Slot, StoredPartition, Tier};
use super::stats::Stats;
use super::tier::Tiers;
use crate::backend::{
    Backend, BackendError, ExportDevice, ExportedColumn, Partition, SpilledPartition,
};

/// A partition held only in segment files: a dataset as the data directory holds it. Cheap
/// to clone: the segments are shared.
#[derive(Clone)]
pub(crate) struct DiskPartition {
    schema: SchemaRef,
    segments: Arc<[PinnedSegment]>,
    /// `starts[i]` is the first row of segment i; the last entry is the segments' row count.
    starts: Arc<[u64]>,
    /// The partition's rows among the segments': all of them, but for a partition whose
    /// first and last segments hold rows of its neighbours too.
    window: Range<u64>,
    /// Bytes of the files.
    file_bytes: u64,
    /// Arrow bytes of the rows, as they were written.
    data_bytes: u64,
    /// The loader that loads it; a read outliving the store reads the files instead.
    loader: Weak<Loader>,
}

impl fmt::Debug for DiskPartition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DiskPartition")
            .field("segments", &self.segments.len())
            .field("rows", &self.rows())
            .field("file_bytes", &self.file_bytes)
            .finish()
    }
}

impl DiskPartition {
    /// The rows of `segments`, in order, all of `schema`.
    pub(crate) fn new(
        schema: SchemaRef,
        segments: Vec<PinnedSegment>,
        loader: &Arc<Loader>,
    ) -> Result<Self, StoreError> {
        let mut starts = Vec::with_capacity(segments.len() + 1);
        let mut rows = 0u64;
        starts.push(0);
        for segment in &segments {
            rows = rows.saturating_add(segment.segment().rows);
            starts.push(rows);
        }
        // Rows are counted in `usize` once loaded; a manifest that claims more is damaged.
        usize::try_from(rows).map_err(|_| {
            StoreError::Corrupt(format!("the manifest claims {rows} rows for one dataset"))
        })?;
        // Sizes a damaged manifest may claim: summed without overflowing.
        let file_bytes = segments
            .iter()
            .fold(0u64, |sum, s| sum.saturating_add(s.segment().bytes));
        let data_bytes = segments.iter().fold(0u64, |sum, s| {
            sum.saturating_add(match s.segment().data_bytes {
                0 => s.segment().bytes,
                bytes => bytes,
            })
        });
        Ok(Self {
            schema,
            segments: segments.into(),
            starts: starts.into(),
            window: 0..rows,
            file_bytes,
            data_bytes,
            loader: Arc::downgrade(loader),
        })
    }

    /// Only `window` of the segments' rows (numbered from the first segment's first row):
    /// a partition whose first and last segments begin and end inside its neighbours. Its
    /// Arrow bytes, and the files' bytes it is charged on disk, are counted as its share of
    /// the segments' (the neighbours hold the rest of them).
    pub(crate) fn within(mut self, window: Range<u64>) -> Result<Self, StoreError> {
        let total = self.starts.last().copied().unwrap_or(0);
        if window.start > window.end || window.end > total {
            return Err(StoreError::Corrupt(format!(
                "rows {window:?} of segments holding {total}"
            )));
        }
        let rows = window.end - window.start;
        let share = |bytes: u64| {
            u64::try_from(u128::from(bytes) * u128::from(rows) / u128::from(total.max(1)))
                .unwrap_or(u64::MAX)
        };
        self.data_bytes = share(self.data_bytes);
        self.file_bytes = share(self.file_bytes);
        self.window = window;
        Ok(self)
    }

    /// The rows of segment `index`'s `batches` that are this partition's.
    fn clip(&self, index: usize, batches: Vec<RecordBatch>) -> Vec<RecordBatch> {
        let mut row = self.starts[index];
        let mut kept = Vec::with_capacity(batches.len());
        for batch in batches {
            let end = row.saturating_add(batch.num_rows() as u64);
            let (from, to) = (self.window.start.max(row), self.window.end.min(end));
            if from < to {
                kept.push(if from == row && to == end {
                    batch
                } else {
                    batch.slice((from - row) as usize, (to - from) as usize)
                });
            }
            row = end;
        }
        kept
    }

    /// `resident`'s data, if it is on disk.
    pub(super) fn of(resident: &Resident) -> Option<&Self> {
        resident.data.as_any().downcast_ref::<Self>()
    }

    pub(super) fn file_bytes(&self) -> u64 {
        self.file_bytes
    }

    fn rows(&self) -> usize {
        // Within the segments' rows, which `new` checked to fit.
        (self.window.end - self.window.start) as usize
    }

    fn loader(&self) -> Option<Arc<Loader>> {
        self.loader.upgrade()
    }

    /// The rows, one segment's batches after another, each segment read (and checked) on a
    /// blocking thread, the next while the stream's reader handles one: a reader holds at
    /// most two segments at a time.
    pub(super) fn pieces(&self) -> BoxStream<'static, Result<RecordBatch, StoreError>> {
        self.segments_read()
            .map_ok(|(batches, _)| futures::stream::iter(batches.into_iter().map(Ok)))
            .try_flatten()
            .boxed()
    }

    /// Each segment's batches (those of the partition's rows), with the size of its file
    /// (which they point into), in order.
    fn segments_read(&self) -> BoxStream<'static, Result<(Vec<RecordBatch>, u64), StoreError>> {
        let (segments, schema) = (Arc::clone(&self.segments), Arc::clone(&self.schema));
        let partition = self.clone();
        futures::stream::iter(0..segments.len())
            .map(move |index| {
                let bytes = segments[index].segment().bytes;
                let partition = partition.clone();
                read_segment(Arc::clone(&segments), index, Arc::clone(&schema))
                    .map_ok(move |batches| (partition.clip(index, batches), bytes))
            })
            .buffered(2)
            .boxed()
    }

    /// Rows `rows`, read from the files that hold them: for a read without a store to load
    /// the partition into.
    async fn read_rows(&self, rows: Range<u64>) -> Result<RecordBatch, StoreError> {
        let rows = rows.start + self.window.start..rows.end + self.window.start;
        let first = self.starts.partition_point(|&start| start <= rows.start);
        let mut parts = Vec::new();
        for index in first.saturating_sub(1)..self.segments.len() {
            let start = self.starts[index];
            if start >= rows.end {
                break;
            }
            let batches =
                read_segment(Arc::clone(&self.segments), index, Arc::clone(&self.schema)).await?;
            let mut row = start;
            for batch in batches {
                let end = row.saturating_add(batch.num_rows() as u64);
                let (from, to) = (rows.start.max(row), rows.end.min(end));
                if from < to {
                    parts.push(batch.slice((from - row) as usize, (to - from) as usize));
                }
                row = end;
            }
        }
        arrow::compute::concat_batches(&self.schema, &parts)
            .map_err(|e| StoreError::Corrupt(format!("joining segments: {e}")))
    }
}

/// Segment `index`'s batches, read on a blocking thread, checked to be of `schema` and to
/// hold the rows the manifest says: the dataset's rows were numbered by it.
async fn read_segment(
    segments: Arc<[PinnedSegment]>,
    index: usize,
    schema: SchemaRef,
) -> Result<Vec<RecordBatch>, StoreError> {
    let segment = segments[index].segment().clone();
    let (found, batches) = tokio::task::spawn_blocking(move || segments[index].read())
        .await
        .map_err(|e| StoreError::Persist(format!("a disk task failed: {e}")))??;
    if found.fields() != schema.fields() {
        return Err(StoreError::Corrupt(format!(
            "segment {} has schema {found}, but its dataset's is {schema}",
            segment.file
        )));
    }
    let rows = batches.iter().fold(0u64, |rows, batch| {
        rows.saturating_add(batch.num_rows() as u64)
    });
    if rows != segment.rows {
        return Err(StoreError::Corrupt(format!(
            "segment {} holds {rows} rows, but the manifest records {}",
            segment.file, segment.rows
        )));
    }
    Ok(batches
        .into_iter()
        .filter(|batch| batch.num_rows() > 0)
        .collect())
}

impl Partition for DiskPartition {
    fn num_rows(&self) -> usize {
        self.rows()
    }

    fn bytes(&self) -> u64 {
        self.file_bytes
    }

    fn read(
        &self,
        offset: usize,
        len: usize,
        columns: Option<&[usize]>,
    ) -> BoxFuture<'static, Result<RecordBatch, BackendError>> {
        if let Err(error) = crate::backend::check_rows(offset, len, self.rows()) {
            return futures::future::ready(Err(error)).boxed();
        }
        let partition = self.clone();
        let columns = columns.map(<[usize]>::to_vec);
        async move {
            let rows = offset as u64..(offset + len) as u64;
            // Segments are whole record batches: the file is read, then the columns chosen.
            let batch = partition.read_rows(rows).await.map_err(|e| {
                BackendError::Device(format!("reading from the data directory: {e}"))
            })?;
            crate::backend::project(batch, columns.as_deref())
        }
        .boxed()
    }

    fn export(
        &self,
        _columns: &[usize],
    ) -> Result<(ExportDevice, Vec<ExportedColumn>), BackendError> {
        Err(BackendError::NotExportable {
            backend: "disk tier",
        })
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Segment files smaller than this are joined with their neighbours when loaded.
const SMALL_SEGMENT_BYTES: u64 = 1 << 20;

/// About how large a piece joined from small segments grows.
const JOINED_PIECE_BYTES: u64 = 8 << 20;

/// Loads that run at once (see [`Loader::load`]).
const LOADS_AT_ONCE: usize = 2;

/// Moves a restore makes at most, each from where other moves left the partition (see
/// [`Loader::restore`]).
const RESTORE_PASSES: usize = 4;

/// What to read `slot`'s rows from: where they are only on disk, they are loaded first (see
/// [`Loader::load`]).
pub(crate) async fn readable(slot: &Arc<Slot>) -> Result<Arc<Resident>, StoreError> {
    let resident = slot.resident();
    match DiskPartition::of(&resident).and_then(DiskPartition::loader) {
        Some(loader) => loader.load(slot, false).await,
        None => Ok(resident),
    }
}

/// Brings partitions into memory from the disk tier, and onto their devices from the host
/// tier.
#[derive(Debug)]
pub(crate) struct Loader {
    backend: Arc<dyn Backend>,
    tiers: Arc<Tiers>,
    compactor: Arc<Compactor>,
    /// Turns for loads from disk (see [`Loader::load`]).
    loading: tokio::sync::Semaphore,
    stats: Arc<Stats>,
}

impl Loader {
    pub(crate) fn new(
        backend: Arc<dyn Backend>,
        tiers: Arc<Tiers>,
        compactor: Arc<Compactor>,
        stats: Arc<Stats>,
    ) -> Self {
        Self {
            backend,
            tiers,
            compactor,
            loading: tokio::sync::Semaphore::new(LOADS_AT_ONCE),
            stats,
        }
    }

    /// Loads `slot`'s partition if it is only on disk: into the host tier where that has room
    /// for it, else (or with `onto_device`) onto its device, making room there as a put
    /// does. Returns what the slot holds then.
    ///
    /// The load runs on a task of its own, which owns what it allocates and what pays for
    /// it: a reader that goes away mid-load (a cancelled DoGet) neither frees the budget under
    /// memory still in use nor wastes the work, and the next reader finds it loaded. Loads
    /// run [`LOADS_AT_ONCE`] at a time, which bounds the host memory their reads hold on the
    /// way to a device whatever clients ask for.
    pub(crate) async fn load(
        self: &Arc<Self>,
        slot: &Arc<Slot>,
        onto_device: bool,
    ) -> Result<Arc<Resident>, StoreError> {
        let (loader, slot) = (Arc::clone(self), Arc::clone(slot));
        tokio::spawn(async move { loader.load_now(&slot, onto_device).await })
            .await
            .map_err(|e| StoreError::Persist(format!("a load task failed: {e}")))?
    }

    async fn load_now(&self, slot: &Slot, onto_device: bool) -> Result<Arc<Resident>, StoreError> {
        let _turn = self.loading.acquire().await;
        let _moving = slot.moving().lock().await;
        let resident = slot.resident();
        let Some(disk) = DiskPartition::of(&resident) else {
            return Ok(resident);
        };
        let started = Instant::now();
        let tiers = &self.tiers;
        let host = if onto_device {
            None
        } else {
            tiers.try_reserve_host(disk.file_bytes).ok()
        };
        let loaded = match host {
            Some(host) => self.load_to_host(disk, host, slot.home()).await?,
            None => {
                let peak = disk.file_bytes.saturating_mul(2);
                self.compactor
                    .upload_pieces(disk.pieces(), peak, slot.home(), disk.data_bytes)
                    .await?
                    .slot
                    .resident()
            }
        };
        slot.replace(Arc::clone(&loaded));
        let stats = &self.stats;
        Stats::add(&stats.loads, 1);
        Stats::add(&stats.loaded_bytes, disk.file_bytes);
        Stats::add_time(&stats.load_nanos, started);
        tracing::info!(
            rows = loaded.data.num_rows(),
            file_bytes = disk.file_bytes,
            tier = ?loaded.tier,
            seconds = started.elapsed().as_secs_f64(),
            "partition loaded from the data directory"
        );
        Ok(loaded)
    }

    /// `disk`'s rows in the host tier, paid for by `host` (reserved for the files' size and
    /// trued up): a large segment's batches stay slices of the file read into memory, which
    /// is charged whole; runs of small segments (an append's each) are joined into pieces of
    /// their own, so that they cost what their rows do and read as few large chunks. Where
    /// the result outgrows the host tier, it goes onto `device` instead.
    async fn load_to_host(
        &self,
        disk: &DiskPartition,
        mut host: Reservation,
        device: u32,
    ) -> Result<Arc<Resident>, StoreError> {
        let mut pieces = Vec::new();
        let mut charge = 0u64;
        let mut small: Vec<RecordBatch> = Vec::new();
        let mut small_bytes = 0u64;
        let join = |small: &mut Vec<RecordBatch>,
                    pieces: &mut Vec<RecordBatch>|
         -> Result<u64, StoreError> {
            if small.is_empty() {
                return Ok(0);
            }
            let joined = arrow::compute::concat_batches(&disk.schema, small.iter())
                .map_err(|e| StoreError::Corrupt(format!("joining segments: {e}")))?;
            small.clear();
            let bytes = crate::arrays::batch_bytes(&joined);
            pieces.push(joined);
            Ok(bytes)
        };
        let mut segments = disk.segments_read();
        while let Some((batches, file_bytes)) = segments.try_next().await? {
            if file_bytes < SMALL_SEGMENT_BYTES {
                small_bytes += batches.iter().map(crate::arrays::batch_bytes).sum::<u64>();
                small.extend(batches);
                if small_bytes >= JOINED_PIECE_BYTES {
                    charge = charge.saturating_add(join(&mut small, &mut pieces)?);
                    small_bytes = 0;
                }
            } else {
                charge = charge.saturating_add(join(&mut small, &mut pieces)?);
                small_bytes = 0;
                charge = charge.saturating_add(file_bytes);
                pieces.extend(batches);
            }
        }
        charge = charge.saturating_add(join(&mut small, &mut pieces)?);
        let spilled = SpilledPartition::of_copies(pieces);
        let rows = spilled.num_rows() as u64;
        if host.resize(super::memory::charge(charge, rows)).is_ok() {
            return Ok(Arc::new(Resident {
                data: Arc::new(spilled),
                reservation: host,
                tier: Tier::Host,
            }));
        }
        // The host tier is still paying for what was read until it is uploaded.
        let pieces = futures::stream::iter(spilled.pieces().to_vec())
            .map(Ok)
            .boxed();
        let peak = disk.file_bytes.saturating_mul(2);
        let loaded = self
            .compactor
            .upload_pieces(pieces, peak, device, disk.data_bytes)
            .await?
            .slot
            .resident();
        drop((spilled, host));
        Ok(loaded)
    }

    /// A dataset of the data directory as partitions of its `segments` (none if they hold
    /// no rows), on disk and homed on `device`. Nothing is read. Each partition is a run of
    /// whole segments of at most a quarter of `device`'s budget where it has one (and at
    /// least one segment): a dataset larger than the device loads, and is read, a partition at
    /// a time, as it was before the restart.
    pub(crate) fn disk_partitions(
        self: &Arc<Self>,
        files: &Arc<SegmentFiles>,
        schema: &SchemaRef,
        segments: &[Segment],
        device: u32,
    ) -> Result<Vec<StoredPartition>, StoreError> {
        let tiers = &self.tiers;
        let most = tiers
            .budget()
            .limit(device)
            .map_or(u64::MAX, |limit| (limit / 4).max(1));
        let mut runs: Vec<Vec<PinnedSegment>> = Vec::new();
        let mut run_bytes = 0u64;
        for segment in segments.iter().filter(|segment| segment.rows > 0) {
            match runs.last_mut() {
                Some(run) if run_bytes.saturating_add(segment.bytes) <= most => {
                    run_bytes = run_bytes.saturating_add(segment.bytes);
                    run.push(files.pin(segment));
                }
                _ => {
                    run_bytes = segment.bytes;
                    runs.push(vec![files.pin(segment)]);
                }
            }
        }
        runs.into_iter()
            .map(|run| {
                let disk = DiskPartition::new(Arc::clone(schema), run, self)?;
                let reservation = tiers.reserve_disk(disk.file_bytes);
                let data_bytes = disk.data_bytes;
                Ok(tiers.hold_on_disk(Arc::new(disk), reservation, device, data_bytes))
            })
            .collect()
    }

    /// `partition` on a device: restored from the host tier, or loaded from disk, onto the
    /// device it was stored on where it is not on one. The returned resident holds the device
    /// memory for the caller. Another move may take the partition elsewhere while this one
    /// waits its turn (a DoGet's load into the host tier, an eviction back to disk): each
    /// pass starts from where the partition is then, for up to [`RESTORE_PASSES`]; a
    /// partition other moves keep taking away is returned where the last left it.
    pub(crate) async fn restore(
        self: &Arc<Self>,
        partition: &StoredPartition,
    ) -> Result<Arc<Resident>, StoreError> {
        let slot = &partition.slot;
        let mut resident = slot.resident();
        for _ in 0..RESTORE_PASSES {
            resident = match resident.tier {
                Tier::Device(_) => return Ok(resident),
                Tier::Disk => self.load(slot, true).await?,
                Tier::Host => {
                    // On a task of its own, like a load (see `Loader::load`): a caller that
                    // goes away mid-restore frees nothing still in use.
                    let (loader, slot, data_bytes) =
                        (Arc::clone(self), Arc::clone(slot), partition.data_bytes);
                    tokio::spawn(async move { loader.restore_now(&slot, data_bytes).await })
                        .await
                        .map_err(|e| {
                            BackendError::Device(format!("a restore task failed: {e}"))
                        })??
                }
            };
        }
        Ok(resident)
    }

    async fn restore_now(&self, slot: &Slot, data_bytes: u64) -> Result<Arc<Resident>, StoreError> {
        let _moving = slot.moving().lock().await;
        let resident = slot.resident();
        if resident.tier != Tier::Host {
            // Restored meanwhile; or, loaded onto its device, on it.
            return Ok(resident);
        }
        let started = Instant::now();
        let restored = self
            .upload_resident(&resident, slot.home(), data_bytes)
            .await?;
        let restored = restored.slot.resident();
        slot.replace(Arc::clone(&restored));
        let stats = &self.stats;
        Stats::add(&stats.restores, 1);
        Stats::add(&stats.restored_bytes, restored.reservation.bytes());
        Stats::add_time(&stats.restore_nanos, started);
        tracing::info!(
            device = slot.home(),
            rows = restored.data.num_rows(),
            bytes = restored.reservation.bytes(),
            ms = started.elapsed().as_secs_f64() * 1e3,
            "partition restored from host memory"
        );
        Ok(restored)
    }

    /// A compact copy on `device` of a partition off the devices (spilled to the host tier,
    /// or only on disk).
    pub(crate) async fn upload_resident(
        &self,
        resident: &Resident,
        device: u32,
        data_bytes: u64,
    ) -> Result<StoredPartition, StoreError> {
        if let Some(disk) = DiskPartition::of(resident) {
            let peak = disk.file_bytes().saturating_mul(2);
            return self
                .compactor
                .upload_pieces(disk.pieces(), peak, device, data_bytes)
                .await;
        }
        let Some(spilled) = resident.data.as_any().downcast_ref::<SpilledPartition>() else {
            return Err(BackendError::Device(
                "a host-tier partition of an unknown kind".to_owned(),
            )
            .into());
        };
        let pieces = spilled.pieces().to_vec();
        let total = pieces
            .iter()
            .map(|piece| stored_charge(self.backend.as_ref(), piece))
            .sum::<Result<u64, _>>()?;
        // Room for the pieces and, where there are several, their compacted copy beside them.
        let peak = if pieces.len() > 1 { 2 * total } else { total };
        let pieces = futures::stream::iter(pieces).map(Ok).boxed();
        self.compactor
            .upload_pieces(pieces, peak, device, data_bytes)
            .await
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::backend::HostBackend;
    use crate::store::PutMode;
    use crate::store::testing::{DataDir, Gate, GatedBackend, batch, open_host, put, reopened};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_load_goes_on_when_its_reader_goes_away() {
        let dir = DataDir::new("load");
        let options = dir.options(None, 0);
        let store = open_host(&options).await;
        // Sizes far apart, which the merges on disk leave as two segments.
        for (mode, rows) in [(PutMode::Create, 0..1000), (PutMode::Append, 1000..1100)] {
            put(&store, mode, vec![batch(rows)])
                .await
                .commit()
                .await
                .expect("commit");
        }

        // Two segments, so loading onto the device ends in a compaction, which waits.
        let backend = GatedBackend::new(HostBackend::new(), Gate::Compactions);
        let (started, release) = (Arc::clone(&backend.started), Arc::clone(&backend.release));
        let store = reopened(store, Arc::new(backend), &options).await;
        let dataset = store.get("t").expect("t");
        let mut reading = dataset.read(0..1100, 1 << 20, 2).expect("a stream");
        tokio::select! {
            _ = reading.next() => panic!("the read went past the waiting compaction"),
            () = started.notified() => {}
        }
        // The reader goes away mid-load (a cancelled DoGet); the load finishes all the same.
        drop(reading);
        release.notify_one();
        for _ in 0..500 {
            if store.status().tiers.loads == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(store.status().tiers.loads, 1, "the load was abandoned");
        let tiers = dataset.tier_bytes();
        assert!(tiers.device > 0 && tiers.disk == 0, "{tiers:?}");
        let rows: Vec<RecordBatch> = dataset
            .read(0..1100, 1 << 20, 2)
            .expect("a stream")
            .try_collect()
            .await
            .expect("read");
        assert_eq!(
            arrow::compute::concat_batches(&rows[0].schema(), &rows).expect("concat"),
            batch(0..1100)
        );
        store.close().await;
    }

    /// A restore for an export finds the partition on disk, and waits while a DoGet's load
    /// brings it into the host tier: the restore must go on to the device, not hand back
    /// host memory (which fails the export with "not exportable").
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_restore_goes_on_to_the_device_from_wherever_another_move_left_it() {
        let dir = DataDir::new("restore");
        let options = dir.options(None, 64 << 20);
        let store = open_host(&options).await;
        put(&store, PutMode::Create, vec![batch(0..1000)])
            .await
            .commit()
            .await
            .expect("commit");
        let store = reopened(store, Arc::new(HostBackend::new()), &options).await;
        let dataset = store.get("t").expect("t");
        let partition = dataset.partitions()[0].clone();
        let slot = Arc::clone(&partition.slot);
        assert_eq!(slot.resident().tier, Tier::Disk);
        let loader = Arc::clone(&store.exporter.loader);

        let moving = slot.moving().lock().await;
        let restoring = tokio::spawn({
            let loader = Arc::clone(&loader);
            async move { loader.restore(&partition).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        // What a DoGet's load does meanwhile: into the host tier.
        let resident = slot.resident();
        let disk = DiskPartition::of(&resident).expect("on disk");
        let host = loader
            .tiers
            .try_reserve_host(disk.file_bytes)
            .expect("host room");
        let loaded = loader
            .load_to_host(disk, host, slot.home())
            .await
            .expect("load");
        assert_eq!(loaded.tier, Tier::Host);
        slot.replace(loaded);
        drop((resident, moving));

        let restored = restoring.await.expect("task").expect("restore");
        assert_eq!(restored.tier, Tier::Device(0));
        assert_eq!(slot.resident().tier, Tier::Device(0));
        drop(restored);
        store.close().await;
    }

    /// Without a host tier (the host backend's default), a dataset loaded after a restart
    /// goes onto its device: one larger than half the device's budget must load all the same.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dataset_over_half_the_budget_loads_after_a_restart() {
        let dir = DataDir::new("big");
        let options = dir.options(Some(64 << 20), 0);
        let store = open_host(&options).await;
        put(&store, PutMode::Create, vec![batch(0..5_000_000)])
            .await
            .commit()
            .await
            .expect("40 MB of 64");
        let store = reopened(store, Arc::new(HostBackend::new()), &options).await;
        let dataset = store.get("t").expect("t");
        let rows: Vec<RecordBatch> = dataset
            .read(0..5_000_000, 8 << 20, 2)
            .expect("a stream")
            .try_collect()
            .await
            .expect("loaded and read");
        assert_eq!(
            rows.iter().map(RecordBatch::num_rows).sum::<usize>(),
            5_000_000
        );
        drop((rows, dataset));
        store.close().await;
    }

    /// A dataset larger than its device's budget, built while the server ran (its partitions
    /// went back to disk in turn): after a restart it is read a partition at a time too.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dataset_larger_than_the_device_reads_after_a_restart() {
        let dir = DataDir::new("larger");
        let options = dir.options(Some(32 << 20), 0);
        let store = open_host(&options).await;
        const ROWS: i64 = 1_000_000;
        for i in 0..6 {
            let mode = if i == 0 {
                PutMode::Create
            } else {
                PutMode::Append
            };
            put(&store, mode, vec![batch(i * ROWS..(i + 1) * ROWS)])
                .await
                .commit()
                .await
                .expect("8 MB more, older ones going back to disk");
        }
        let store = reopened(store, Arc::new(HostBackend::new()), &options).await;
        let dataset = store.get("t").expect("t");
        let rows: Vec<RecordBatch> = dataset
            .read(0..6 * ROWS as u64, 4 << 20, 2)
            .expect("a stream")
            .try_collect()
            .await
            .expect("48 MB read through a device of 32");
        let total: usize = rows.iter().map(RecordBatch::num_rows).sum();
        assert_eq!(total, 6 * ROWS as usize);
        let first = rows[0]
            .column(0)
            .as_any()
            .downcast_ref::<arrow::array::Int64Array>();
        assert_eq!(first.map(|c| c.value(0)), Some(0));
        drop((rows, dataset));
        store.close().await;
    }
}
