//! Partitions spilled to host memory: the store's host tier.
//!
//! A partition leaves its device whole where its backend can copy it so
//! (`Backend::host_copy`: the CUDA backend copies its allocations as they are, one piece),
//! otherwise as a series of reads, each at most a staging buffer's worth, so that spilling a
//! partition of any size never needs more pinned memory than a reader does. Either way the
//! pieces are kept in pageable buffers of their own (pinned memory is scarce and must go back
//! to the staging pool); a read that straddles two pieces, which only happens at their
//! boundaries, concatenates the two slices it needs.

use std::sync::Arc;

use arrow::record_batch::RecordBatch;
use futures::FutureExt;
use futures::future::BoxFuture;

use arrow::array::make_array;
use arrow::record_batch::RecordBatchOptions;

use super::{BackendError, ExportDevice, ExportedColumn, Partition, check_rows};
use crate::arrays::batch_bytes;
use crate::arrays::{copied_array, copies_as_is, owned};

/// A partition held in host memory as consecutive pieces of its rows.
#[derive(Debug)]
pub struct SpilledPartition {
    pieces: Vec<RecordBatch>,
    /// `starts[i]` is the first row of piece i; the last entry is the row count.
    starts: Vec<usize>,
    bytes: u64,
}

impl SpilledPartition {
    /// A partition of `pieces`, consecutive rows of one schema, each holding only memory of its
    /// own: a backend's whole host copy (`Backend::host_copy`: one piece, whose arrays share
    /// its buffers), [`copied`] out of the staging buffers it was read into (as they are read,
    /// so a spill holds a few pieces of staging memory at most), or decoded from a file read
    /// into memory for it.
    pub fn of_copies(pieces: Vec<RecordBatch>) -> Self {
        let pieces: Vec<RecordBatch> = pieces.into_iter().filter(|p| p.num_rows() > 0).collect();
        let mut starts = Vec::with_capacity(pieces.len() + 1);
        let mut rows = 0;
        starts.push(0);
        for piece in &pieces {
            rows += piece.num_rows();
            starts.push(rows);
        }
        let bytes = pieces.iter().map(batch_bytes).sum();
        Self {
            pieces,
            starts,
            bytes,
        }
    }

    /// The pieces, in row order: what a restore uploads.
    pub fn pieces(&self) -> &[RecordBatch] {
        &self.pieces
    }

    fn rows(&self) -> usize {
        self.starts.last().copied().unwrap_or(0)
    }

    fn slice(&self, offset: usize, len: usize) -> Result<RecordBatch, BackendError> {
        check_rows(offset, len, self.rows())?;
        let end = offset + len;
        // The last piece starting at or before `offset`.
        let first = self.starts.partition_point(|&start| start <= offset);
        let first = first
            .saturating_sub(1)
            .min(self.pieces.len().saturating_sub(1));
        let mut parts = Vec::new();
        let mut index = first;
        while index < self.pieces.len() && self.starts[index] < end {
            let start = self.starts[index];
            let from = offset.max(start) - start;
            let to = end.min(self.starts[index + 1]) - start;
            parts.push(self.pieces[index].slice(from, to - from));
            index += 1;
        }
        match parts.len() {
            0 => Ok(RecordBatch::new_empty(self.schema_or_empty())),
            1 => Ok(parts.swap_remove(0)),
            _ => arrow::compute::concat_batches(&parts[0].schema(), &parts).map_err(|e| {
                BackendError::Device(format!("joining pieces of a spilled partition: {e}"))
            }),
        }
    }

    fn schema_or_empty(&self) -> arrow::datatypes::SchemaRef {
        self.pieces.first().map_or_else(
            || Arc::new(arrow::datatypes::Schema::empty()),
            RecordBatch::schema,
        )
    }
}

/// `batch` in new buffers of its own, always copied: what it points into (a pinned staging
/// buffer, which looks like an allocation of its own, or a larger allocation) is not kept.
pub fn copied(batch: &RecordBatch) -> Result<RecordBatch, BackendError> {
    let failed = |e: arrow::error::ArrowError| BackendError::Device(format!("spilling: {e}"));
    // Fixed-width columns are copied as they are, by several cores (a spill must keep up
    // with the device-to-host copies); others through `owned`, which checks what it copies.
    let columns = batch
        .columns()
        .iter()
        .map(|column| {
            let data = column.to_data();
            if copies_as_is(&data) {
                copied_array(&data)
            } else {
                owned(&data)
            }
            .map(make_array)
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(failed)?;
    let options = RecordBatchOptions::new().with_row_count(Some(batch.num_rows()));
    RecordBatch::try_new_with_options(batch.schema(), columns, &options).map_err(failed)
}

impl Partition for SpilledPartition {
    fn num_rows(&self) -> usize {
        self.rows()
    }

    fn bytes(&self) -> u64 {
        self.bytes
    }

    fn contiguous_rows(&self, offset: usize) -> usize {
        // The end of the piece holding `offset`.
        let next = self.starts.partition_point(|&start| start <= offset);
        self.starts
            .get(next)
            .map_or(0, |&end| end.saturating_sub(offset))
    }

    fn read(
        &self,
        offset: usize,
        len: usize,
        columns: Option<&[usize]>,
    ) -> BoxFuture<'static, Result<RecordBatch, BackendError>> {
        let result = self
            .slice(offset, len)
            .and_then(|batch| crate::backend::project(batch, columns));
        futures::future::ready(result).boxed()
    }

    fn column_bytes(&self, columns: &[usize]) -> Option<u64> {
        self.pieces.iter().try_fold(0u64, |sum, piece| {
            let chosen = piece.project(columns).ok()?;
            Some(sum.saturating_add(crate::arrays::batch_bytes(&chosen)))
        })
    }

    fn export(
        &self,
        _columns: &[usize],
    ) -> Result<(ExportDevice, Vec<ExportedColumn>), BackendError> {
        Err(BackendError::NotExportable {
            backend: "host tier",
        })
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use arrow::array::{ArrayRef, Int64Array, StringArray};

    use super::*;

    fn keep(pieces: &[RecordBatch]) -> SpilledPartition {
        SpilledPartition::of_copies(pieces.iter().map(|p| copied(p).expect("copy")).collect())
    }

    fn batch(range: std::ops::Range<i64>) -> RecordBatch {
        let x: ArrayRef = Arc::new(Int64Array::from_iter_values(range.clone()));
        let s: ArrayRef = Arc::new(StringArray::from_iter_values(
            range.map(|v| format!("v{v}")),
        ));
        RecordBatch::try_from_iter([("x", x), ("s", s)]).expect("batch")
    }

    #[tokio::test]
    async fn reads_within_and_across_pieces_return_the_rows_asked_for() {
        let whole = batch(0..100);
        let pieces = vec![whole.slice(0, 30), whole.slice(30, 0), whole.slice(30, 70)];
        let spilled = keep(&pieces);
        assert_eq!((spilled.num_rows(), spilled.pieces().len()), (100, 2));
        for (offset, len) in [(0, 100), (0, 30), (29, 2), (30, 5), (99, 1), (10, 0)] {
            let read = spilled.read(offset, len, None).await.expect("read");
            assert_eq!(read, whole.slice(offset, len), "rows {offset}+{len}");
        }
        assert!(spilled.read(90, 11, None).await.is_err(), "past the end");
        let runs: Vec<usize> = [0, 29, 30, 99, 100]
            .map(|offset| spilled.contiguous_rows(offset))
            .into();
        assert_eq!(runs, [30, 1, 70, 1, 0], "rows to the end of each piece");
        assert!(matches!(
            spilled.export(&[0]),
            Err(BackendError::NotExportable { .. })
        ));
    }

    /// Memory a piece may point into; `alive` tells whether anything still holds it.
    struct Staging {
        bytes: arrow::buffer::Buffer,
        _alive: Arc<()>,
    }

    impl AsRef<[u8]> for Staging {
        fn as_ref(&self) -> &[u8] {
            self.bytes.as_slice()
        }
    }

    #[test]
    fn pieces_never_keep_the_memory_they_were_read_into() {
        // As a read from a GPU hands them over: buffers over a staging buffer, which look
        // like allocations of their own.
        let alive = Arc::new(());
        let staging = Staging {
            bytes: arrow::buffer::Buffer::from_vec(vec![7i64; 1000]),
            _alive: Arc::clone(&alive),
        };
        let buffer = arrow::buffer::Buffer::from(bytes::Bytes::from_owner(staging));
        let column: ArrayRef = Arc::new(Int64Array::new(buffer.into(), None));
        let piece = RecordBatch::try_from_iter([("x", column)]).expect("batch");
        let spilled = keep(&[piece]);
        assert_eq!(
            Arc::strong_count(&alive),
            1,
            "the staging buffer is given back"
        );
        assert_eq!(spilled.pieces()[0].num_rows(), 1000);
    }

    #[test]
    fn pieces_keep_only_the_rows_they_hold() {
        let whole = batch(0..10_000);
        let spilled = keep(&[whole.slice(0, 10)]);
        assert!(
            spilled.bytes() < batch_bytes(&whole) / 100,
            "{} bytes kept for 10 rows",
            spilled.bytes()
        );
    }
}
