//! A committed dataset: a schema plus partitions held by the backend, immutable once built.
//!
//! Datasets are shared as `Arc<Dataset>`. A reader clones the `Arc` and keeps it for the life of
//! its stream, so a `drop` or `replace` removes the name from the catalog at once while every
//! stream already reading finishes with the data it started on; the memory is returned when the
//! last reader is done. `append` builds a new `Dataset` that shares the old partitions.

use std::ops::Range;
use std::sync::Arc;

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt, TryFutureExt, TryStreamExt};

use super::error::StoreError;
use super::load::readable;
use super::memory::Reservation;
use super::slot::{Slot, StoredPartition, Tier};
use crate::backend::filter::RowFilter;
use crate::backend::{BackendError, Partition};

/// Bytes of a dataset in each tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct TierBytes {
    /// On devices (GPUs, or the host backend's memory).
    pub device: u64,
    /// Spilled to the host tier, or loaded there from the data directory.
    pub host: u64,
    /// Only in the data directory's files (their size), not loaded since the server started.
    pub disk: u64,
}

/// Which committed version of a dataset a ticket names: the number that `status` and
/// `GetFlightInfo` show, which grows with every commit, and a random tag. Numbers alone repeat
/// (after a restart without `--data-dir`, in a copy of a data directory, on another server);
/// a number and its tag together name one version of one store's dataset, so a ticket is
/// either read as it was issued or refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Version {
    pub number: u64,
    pub tag: u64,
}

impl Version {
    /// Version `number` with a tag of its own.
    pub(crate) fn new(number: u64) -> Self {
        Self {
            number,
            tag: random_tag(),
        }
    }
}

/// 64 random bits. Without the OS's generator (which TLS needs too), the clock and a
/// counter still differ between versions of one process and, almost surely, between processes.
fn random_tag() -> u64 {
    getrandom::u64().unwrap_or_else(|_| {
        static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let count = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        nanos ^ count.rotate_left(48) ^ u64::from(std::process::id()).rotate_left(24)
    })
}

/// An immutable, committed dataset.
#[derive(Debug)]
pub struct Dataset {
    name: String,
    schema: SchemaRef,
    version: Version,
    partitions: Vec<StoredPartition>,
    /// Pays for the schema itself: names, types and metadata, which a client can make large.
    schema_charge: Arc<Reservation>,
    /// `row_starts[i]` is the first row of partition i; the last entry is the row count.
    row_starts: Vec<u64>,
    data_bytes: u64,
}

impl Dataset {
    pub(crate) fn new(
        name: String,
        schema: SchemaRef,
        version: Version,
        partitions: Vec<StoredPartition>,
        schema_charge: Arc<Reservation>,
    ) -> Self {
        let mut row_starts = Vec::with_capacity(partitions.len() + 1);
        let mut rows = 0u64;
        row_starts.push(0);
        for partition in &partitions {
            rows = rows.saturating_add(partition.num_rows() as u64);
            row_starts.push(rows);
        }
        let data_bytes = partitions
            .iter()
            .fold(0u64, |sum, p| sum.saturating_add(p.data_bytes));
        Self {
            name,
            schema,
            version,
            partitions,
            schema_charge,
            row_starts,
            data_bytes,
        }
    }

    /// This version without its rows: what a lease on a copy of them names (a
    /// shared-memory read's), holding none of the dataset's memory but its schema's charge.
    pub(crate) fn without_rows(&self) -> Self {
        Self::new(
            self.name.clone(),
            Arc::clone(&self.schema),
            self.version,
            Vec::new(),
            Arc::clone(&self.schema_charge),
        )
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn schema(&self) -> SchemaRef {
        Arc::clone(&self.schema)
    }

    /// Changes with every commit to this name; tickets carry it so that a reader never mixes
    /// rows of two versions.
    pub fn version(&self) -> u64 {
        self.version.number
    }

    /// The version's number and tag: what a ticket must match.
    pub fn version_id(&self) -> Version {
        self.version
    }

    pub fn num_rows(&self) -> u64 {
        self.row_starts.last().copied().unwrap_or(0)
    }

    pub fn num_partitions(&self) -> usize {
        self.partitions.len()
    }

    /// Bytes of memory the dataset holds, in every tier of memory (not on disk).
    pub fn memory_bytes(&self) -> u64 {
        let tiers = self.tier_bytes();
        tiers.device + tiers.host + self.schema_charge.bytes()
    }

    /// Bytes of memory the dataset's partitions hold in each tier now.
    pub fn tier_bytes(&self) -> TierBytes {
        let mut bytes = TierBytes::default();
        for partition in &self.partitions {
            let (tier, held) = partition
                .slot
                .look(|resident| (resident.tier, resident.reservation.bytes()));
            match tier {
                Tier::Device(_) => bytes.device += held,
                Tier::Host => bytes.host += held,
                Tier::Disk => bytes.disk += held,
            }
        }
        bytes
    }

    /// Bytes of Arrow buffers in the dataset: what a client reading it receives, give or take
    /// message framing. `GetFlightInfo` reports this as `total_bytes`.
    pub fn data_bytes(&self) -> u64 {
        self.data_bytes
    }

    /// [`Dataset::data_bytes`] of only `columns`: each partition's bytes in the share its
    /// partition says those columns hold, or, for one only on disk, their share of the
    /// schema's columns (an estimate).
    pub fn projected_data_bytes(&self, columns: &[usize]) -> u64 {
        let width = self.schema.fields().len().max(1) as u64;
        let all: Vec<usize> = (0..self.schema.fields().len()).collect();
        self.partitions
            .iter()
            .map(|partition| {
                let measured = partition.slot.look(|resident| {
                    let data = &resident.data;
                    data.column_bytes(columns)
                        .zip(data.column_bytes(&all))
                        .filter(|&(_, whole)| whole > 0)
                });
                let (part, whole) = measured.unwrap_or((columns.len() as u64, width));
                let share = u128::from(partition.data_bytes) * u128::from(part.min(whole))
                    / u128::from(whole.max(1));
                u64::try_from(share).unwrap_or(u64::MAX)
            })
            .fold(0u64, u64::saturating_add)
    }

    pub(crate) fn partitions(&self) -> &[StoredPartition] {
        &self.partitions
    }

    /// The dataset's rows as runs of consecutive partitions on one device: `(rows, device)`,
    /// in row order.
    pub fn device_runs(&self) -> Vec<(Range<u64>, u32)> {
        let mut runs: Vec<(Range<u64>, u32)> = Vec::new();
        for (index, partition) in self.partitions.iter().enumerate() {
            let rows = self.row_starts[index]..self.row_starts[index + 1];
            match runs.last_mut() {
                Some((run, device)) if *device == partition.device() => run.end = rows.end,
                _ => runs.push((rows, partition.device())),
            }
        }
        runs
    }

    pub(crate) fn schema_charge(&self) -> &Arc<Reservation> {
        &self.schema_charge
    }

    /// Streams rows `rows` as host record batches of roughly `chunk_bytes` each, keeping up to
    /// `prefetch` chunk reads in flight so that device-to-host copies overlap with whatever the
    /// consumer does with the previous chunk. The stream holds the dataset alive.
    pub fn read(
        self: &Arc<Self>,
        rows: Range<u64>,
        chunk_bytes: u64,
        prefetch: usize,
    ) -> Result<BoxStream<'static, Result<RecordBatch, StoreError>>, StoreError> {
        self.read_columns(rows, None, chunk_bytes, prefetch)
    }

    /// [`Dataset::read`] of only `columns` (schema positions, in that order; all for
    /// `None`): the backend never copies the others out of its memory.
    pub fn read_columns(
        self: &Arc<Self>,
        rows: Range<u64>,
        columns: Option<Arc<[usize]>>,
        chunk_bytes: u64,
        prefetch: usize,
    ) -> Result<BoxStream<'static, Result<RecordBatch, StoreError>>, StoreError> {
        self.read_chunks(
            rows,
            columns,
            chunk_bytes,
            prefetch,
            |data, chunk, columns| data.read(chunk.offset, chunk.len, columns.as_deref()),
        )
    }

    /// [`Dataset::read_columns`] of the rows `filter` keeps (its tests name positions among
    /// `columns`), returning columns `output` (positions among `columns`). Each chunk is
    /// filtered where its partition lives when the backend can
    /// ([`FilteredChunk::Filtered`]); otherwise it comes whole, for the caller to filter.
    pub fn read_filtered(
        self: &Arc<Self>,
        rows: Range<u64>,
        columns: Arc<[usize]>,
        filter: Arc<RowFilter>,
        output: Arc<[usize]>,
        chunk_bytes: u64,
        prefetch: usize,
    ) -> Result<BoxStream<'static, Result<FilteredChunk, StoreError>>, StoreError> {
        if let Some(&bad) = output.iter().find(|&&p| p >= columns.len()) {
            return Err(StoreError::UnknownColumn {
                name: self.name.clone(),
                columns: vec![format!("#{bad} of the columns read")],
                available: format!("#0 to #{}", columns.len().saturating_sub(1)),
            });
        }
        let all = Some(Arc::clone(&columns));
        self.read_chunks(rows, all, chunk_bytes, prefetch, move |data, chunk, _| {
            let plain = {
                let (data, columns) = (Arc::clone(data), Arc::clone(&columns));
                move || {
                    data.read(chunk.offset, chunk.len, Some(&columns))
                        .map_ok(FilteredChunk::Unfiltered)
                }
            };
            match data.read_filtered(chunk.offset, chunk.len, &columns, &filter, &output) {
                // Ok(None): the backend could not filter this chunk after all.
                Some(filtered) => async move {
                    match filtered.await? {
                        Some(batch) => Ok(FilteredChunk::Filtered(batch)),
                        None => plain().await,
                    }
                }
                .boxed(),
                None => plain().boxed(),
            }
        })
    }

    /// Streams rows `rows` as chunks of roughly `chunk_bytes`, each read by `read` from its
    /// partition, up to `prefetch` in flight.
    fn read_chunks<T: Send + 'static>(
        self: &Arc<Self>,
        rows: Range<u64>,
        columns: Option<Arc<[usize]>>,
        chunk_bytes: u64,
        prefetch: usize,
        read: impl Fn(
            &Arc<dyn Partition>,
            Chunk,
            &Option<Arc<[usize]>>,
        ) -> BoxFuture<'static, Result<T, BackendError>>
        + Send
        + Sync
        + 'static,
    ) -> Result<BoxStream<'static, Result<T, StoreError>>, StoreError> {
        if let Some(columns) = &columns
            && let Some(&bad) = columns.iter().find(|&&c| c >= self.schema.fields().len())
        {
            return Err(StoreError::UnknownColumn {
                name: self.name.clone(),
                columns: vec![format!("#{bad}")],
                available: format!("#0 to #{}", self.schema.fields().len().saturating_sub(1)),
            });
        }
        if rows.start > rows.end || rows.end > self.num_rows() {
            return Err(StoreError::RowsOutOfRange {
                name: self.name.clone(),
                start: rows.start,
                end: rows.end,
                rows: self.num_rows(),
            });
        }
        let chunks = Chunks::new(Arc::clone(self), rows, chunk_bytes.max(1));
        let dataset = Arc::clone(self);
        // A partition only on disk is loaded before its chunks are planned: they end where
        // its pieces in memory will.
        let chunks = futures::stream::try_unfold(chunks, |mut chunks| async move {
            if let Some(slot) = chunks.next_slot()
                && slot.look(|resident| resident.tier) == Tier::Disk
            {
                readable(&slot).await?;
            }
            Ok::<_, StoreError>(chunks.next().map(|chunk| (chunk, chunks)))
        });
        let read = Arc::new(read);
        let stream = chunks
            .map_ok(move |chunk| {
                let slot = Arc::clone(&dataset.partitions[chunk.partition].slot);
                slot.touch();
                let (columns, read) = (columns.clone(), Arc::clone(&read));
                async move {
                    // Held until the read is done, so that a spill meanwhile frees nothing
                    // under it.
                    let resident = readable(&slot).await?;
                    let batch = read(&resident.data, chunk, &columns).await;
                    drop(resident);
                    batch.map_err(StoreError::from)
                }
            })
            .try_buffered(prefetch.max(1));
        Ok(stream.boxed())
    }
}

/// A chunk of [`Dataset::read_filtered`].
#[derive(Debug)]
pub enum FilteredChunk {
    /// Filtered where the rows live: the rows kept, of the output columns.
    Filtered(RecordBatch),
    /// Read whole, of every column read: the caller filters it.
    Unfiltered(RecordBatch),
}

#[derive(Debug, Clone, Copy)]
struct Chunk {
    partition: usize,
    offset: usize,
    len: usize,
}

/// A row range split into per-partition chunks of about `chunk_bytes`, produced one at a time.
///
/// Lazily, because the number of chunks follows the rows a dataset declares: a partition is
/// charged at least one bit a row (see `PendingPut::upload`), so a chunk never has more rows
/// than `chunk_bytes * 8`, and a reader that stops early never pays for the rest of the plan.
struct Chunks {
    dataset: Arc<Dataset>,
    rows: Range<u64>,
    chunk_bytes: u64,
    partition: usize,
    next_row: u64,
}

impl Chunks {
    fn new(dataset: Arc<Dataset>, rows: Range<u64>, chunk_bytes: u64) -> Self {
        let next_row = rows.start;
        // The partition holding the first row: those before are not touched (not loaded).
        let partition = dataset
            .row_starts
            .partition_point(|&start| start <= rows.start)
            .saturating_sub(1);
        Self {
            dataset,
            rows,
            chunk_bytes,
            partition,
            next_row,
        }
    }

    /// The partition the next chunk is read from, if any.
    fn next_slot(&self) -> Option<Arc<Slot>> {
        let dataset = &self.dataset;
        (self.partition..dataset.partitions.len())
            .take_while(|_| self.next_row < self.rows.end)
            // Partitions without rows of the range (empty ones) are skipped, not loaded.
            .find(|&index| dataset.row_starts[index + 1] > self.next_row)
            .map(|index| Arc::clone(&dataset.partitions[index].slot))
    }
}

impl Iterator for Chunks {
    type Item = Chunk;

    fn next(&mut self) -> Option<Chunk> {
        let dataset = &self.dataset;
        while self.partition < dataset.partitions.len() && self.next_row < self.rows.end {
            let index = self.partition;
            let first = dataset.row_starts[index];
            let end = dataset.row_starts[index + 1];
            let stop = self.rows.end.min(end);
            let start = self.next_row.max(first);
            if start >= stop {
                self.partition += 1;
                continue;
            }
            let partition_rows = (end - first).max(1);
            let (held, contiguous) = dataset.partitions[index].slot.look(|resident| {
                (
                    resident.reservation.bytes(),
                    resident.data.contiguous_rows((start - first) as usize) as u64,
                )
            });
            let bytes_per_row = held.div_ceil(partition_rows).max(1);
            let rows_per_chunk = (self.chunk_bytes / bytes_per_row).max(1);
            // Chunks end where the partition's pieces do (spilled or loaded ones), so that
            // each is a slice of one, not a copy of two joined.
            let len = rows_per_chunk.min(stop - start).min(contiguous.max(1));
            self.next_row = start + len;
            if self.next_row >= stop {
                self.partition += 1;
            }
            return Some(Chunk {
                partition: index,
                offset: (start - first) as usize,
                len: len as usize,
            });
        }
        None
    }
}
