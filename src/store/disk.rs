//! The disk tier: datasets of `--data-dir` whose rows are not loaded yet.
//!
//! A server starts by reading its manifest and each dataset's schema, not its rows, so it
//! answers at once whatever the directory holds. Each dataset then is one partition whose rows
//! are its segment files ([`DiskPartition`]), pinned so that no commit deletes them while a
//! version naming them lives. The first read of such a partition loads it: into the host tier
//! where that has room (DoGet serves it from there as it is), else onto its device. An
//! `ipc-export`, a move or a copy, which need it on a device, load it there directly. Checksums
//! are verified as a segment is loaded, so a damaged file fails the reads of its own dataset,
//! with DATA_LOSS and the file's name, and nothing else.

use std::fmt;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Instant;

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt, TryStreamExt};

use super::files::{PinnedSegment, SegmentFiles};
use super::tier::{Resident, Slot, Tier};
use super::{Inner, Store, StoreError};
use crate::backend::{BackendError, Partition, PartitionExport, SpilledPartition};

/// A partition held only in segment files: a dataset as the data directory holds it.
pub(crate) struct DiskPartition {
    schema: SchemaRef,
    segments: Arc<[PinnedSegment]>,
    /// `starts[i]` is the first row of segment i; the last entry is the row count.
    starts: Arc<[u64]>,
    /// Bytes of the files.
    file_bytes: u64,
    /// Arrow bytes of the rows, as they were written.
    data_bytes: u64,
    /// The store that loads it; a read outliving the store reads the files instead.
    store: Weak<Inner>,
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
    pub(super) fn new(
        schema: SchemaRef,
        segments: Vec<PinnedSegment>,
        store: &Store,
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
            file_bytes,
            data_bytes,
            store: Arc::downgrade(&store.inner),
        })
    }

    /// `resident`'s data, if it is on disk.
    pub(super) fn of(resident: &Resident) -> Option<&Self> {
        resident.data.as_any().downcast_ref::<Self>()
    }

    pub(super) fn file_bytes(&self) -> u64 {
        self.file_bytes
    }

    fn rows(&self) -> usize {
        // Checked to fit in `new`.
        self.starts.last().map_or(0, |&rows| rows as usize)
    }

    fn store(&self) -> Option<Store> {
        self.store.upgrade().map(|inner| Store { inner })
    }

    /// The rows, one segment's batches after another, each segment read (and checked) on a
    /// blocking thread, the next while the stream's reader handles one: a reader holds at
    /// most two segments at a time.
    pub(super) fn pieces(&self) -> BoxStream<'static, Result<RecordBatch, StoreError>> {
        let (segments, schema) = (Arc::clone(&self.segments), Arc::clone(&self.schema));
        futures::stream::iter(0..segments.len())
            .map(move |index| read_segment(Arc::clone(&segments), index, Arc::clone(&schema)))
            .buffered(2)
            .map_ok(|batches| futures::stream::iter(batches.into_iter().map(Ok)))
            .try_flatten()
            .boxed()
    }

    /// Rows `rows`, read from the files that hold them: for a read without a store to load
    /// the partition into.
    async fn read_rows(&self, rows: Range<u64>) -> Result<RecordBatch, StoreError> {
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
                let end = row + batch.num_rows() as u64;
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
    ) -> BoxFuture<'static, Result<RecordBatch, BackendError>> {
        if let Err(error) = crate::backend::check_rows(offset, len, self.rows()) {
            return futures::future::ready(Err(error)).boxed();
        }
        let partition = Self {
            schema: Arc::clone(&self.schema),
            segments: Arc::clone(&self.segments),
            starts: Arc::clone(&self.starts),
            file_bytes: self.file_bytes,
            data_bytes: self.data_bytes,
            store: Weak::clone(&self.store),
        };
        async move {
            let rows = offset as u64..(offset + len) as u64;
            partition
                .read_rows(rows)
                .await
                .map_err(|e| BackendError::Device(format!("reading from the data directory: {e}")))
        }
        .boxed()
    }

    fn export(&self, _columns: &[usize]) -> Result<PartitionExport, BackendError> {
        Err(BackendError::NotExportable {
            backend: "disk tier",
        })
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Slot {
    /// What to read the partition's rows from: where they are only on disk, they are loaded
    /// first (see [`Store::load`]).
    pub(crate) async fn readable(&self) -> Result<Arc<Resident>, StoreError> {
        let resident = self.resident();
        match DiskPartition::of(&resident).and_then(DiskPartition::store) {
            Some(store) => store.load(self).await,
            None => Ok(resident),
        }
    }
}

impl Store {
    /// Loads `slot`'s partition if it is only on disk: into the host tier where that has room
    /// for it, else onto its device, making room there as a put does. Returns what the slot
    /// holds then.
    pub(super) async fn load(&self, slot: &Slot) -> Result<Arc<Resident>, StoreError> {
        let _moving = slot.moving().lock().await;
        let resident = slot.resident();
        let Some(disk) = DiskPartition::of(&resident) else {
            return Ok(resident);
        };
        let started = Instant::now();
        let tiers = &self.inner.tiers;
        let loaded = match tiers.try_reserve_host(disk.file_bytes) {
            Ok(mut host) => {
                let pieces: Vec<RecordBatch> = disk.pieces().try_collect().await?;
                let spilled = SpilledPartition::of_copies(pieces);
                let rows = spilled.num_rows() as u64;
                match host.resize(super::charge(spilled.bytes(), rows)) {
                    Ok(()) => Arc::new(Resident {
                        data: Arc::new(spilled),
                        reservation: host,
                        tier: Tier::Host,
                    }),
                    // More than the files held (dictionaries the file shares count for each
                    // batch): onto the device after all.
                    Err(_) => {
                        drop(host);
                        let pieces = futures::stream::iter(spilled.pieces().to_vec())
                            .map(Ok)
                            .boxed();
                        let peak = disk.file_bytes.saturating_mul(2);
                        self.upload_pieces(pieces, peak, slot.home(), disk.data_bytes)
                            .await?
                            .slot
                            .resident()
                    }
                }
            }
            Err(_) => {
                let peak = disk.file_bytes.saturating_mul(2);
                self.upload_pieces(disk.pieces(), peak, slot.home(), disk.data_bytes)
                    .await?
                    .slot
                    .resident()
            }
        };
        slot.replace(Arc::clone(&loaded));
        tiers.loads.fetch_add(1, Ordering::Relaxed);
        tiers
            .loaded_bytes
            .fetch_add(disk.file_bytes, Ordering::Relaxed);
        tiers
            .load_nanos
            .fetch_add(super::tier::elapsed_nanos(started), Ordering::Relaxed);
        tracing::info!(
            rows = loaded.data.num_rows(),
            file_bytes = disk.file_bytes,
            tier = ?loaded.tier,
            seconds = started.elapsed().as_secs_f64(),
            "partition loaded from the data directory"
        );
        Ok(loaded)
    }

    /// A dataset of the data directory as a partition of its `segments` (none if they hold
    /// no rows), on disk and homed on `device`. Nothing is read.
    pub(super) fn disk_partitions(
        &self,
        files: &Arc<SegmentFiles>,
        schema: &SchemaRef,
        segments: &[super::files::Segment],
        device: u32,
    ) -> Result<Vec<super::dataset::StoredPartition>, StoreError> {
        let segments: Vec<PinnedSegment> = segments
            .iter()
            .filter(|segment| segment.rows > 0)
            .map(|segment| files.pin(segment))
            .collect();
        if segments.is_empty() {
            return Ok(Vec::new());
        }
        let disk = DiskPartition::new(Arc::clone(schema), segments, self)?;
        let tiers = &self.inner.tiers;
        let reservation = tiers.reserve_disk(disk.file_bytes);
        let data_bytes = disk.data_bytes;
        Ok(vec![tiers.hold_on_disk(
            Arc::new(disk),
            reservation,
            device,
            data_bytes,
        )])
    }
}
