//! Filtered reads: a `WHERE` clause run on the GPU, so that only the rows it keeps are copied
//! to host memory (`kernels/filter.cu`).
//!
//! A chunk is read in three rounds on one stream:
//! 1. the program and the flag of every row, each tile's count of kept rows, their scan, and
//!    for each string column the bytes of each tile's kept strings and their scan; the host
//!    reads back the totals (rows kept, bytes of each string column): one synchronization;
//! 2. the kept rows gathered into a compact copy of the output columns, laid out as an upload
//!    is (`layout`), in scratch memory of the device's stream-ordered pool: one more;
//! 3. that copy read back as any partition's rows are (`read`): one more, two with strings.
//!
//! A chunk where every row is kept skips the gather and reads its rows directly; one where
//! none is, stops after the first round. Filters read fixed-width, boolean and string columns
//! (and dictionaries of strings); rows can be gathered from columns of any flat type (fixed
//! width, booleans, strings and binary, dictionaries of those, nulls). Anything else is read
//! whole and filtered on the host by the caller. Scratch memory holds a byte per row and the
//! kept rows of the output columns (each dictionary whole), at most the chunk's size again
//! plus its dictionaries; it is not counted in the memory budget, so a GPU without room for
//! it falls back to the host (see `CudaPartition::read_filtered`). It is freed once the chunk
//! has been read.

use std::ops::Range;
use std::sync::Arc;

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;

use super::ffi::{
    DeviceAllocation, FilterInput, FilterKernels, FilterRows, Span, Stream, filter_program_bytes,
};
use super::filter_abi::{self, TILE};
use super::layout::{ALIGNMENT, DeviceArray, Kind, Region};
use super::read::{Stored, read_rows};
use super::staging::ReadStaging;
use crate::backend::BackendError;
use crate::backend::filter::{ColumnType, KeyType, RowFilter};

/// What a filtered read cost.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct FilterStats {
    pub(super) syncs: u64,
    /// Bytes copied from the device to host memory.
    pub(super) bytes: u64,
    pub(super) kept: u64,
}

/// Whether [`read_filtered`] can run `filter` over `columns` and gather `output` of them.
pub(super) fn supports(filter: &RowFilter, columns: &[Stored<'_>], output: &[usize]) -> bool {
    let tested = filter.columns().iter().all(|&(position, column_type)| {
        columns
            .get(position)
            .is_some_and(|column| readable(column.array, column_type))
    });
    let flat = |array: &DeviceArray| {
        matches!(
            array.kind,
            Kind::Null | Kind::Fixed(_) | Kind::Bits | Kind::VarLen(_)
        ) && array.children.is_empty()
    };
    let gathered = output.iter().all(|&position| {
        columns.get(position).is_some_and(|column| {
            let array = column.array;
            match array.kind {
                Kind::Dictionary(_) => array.children.len() == 1 && flat(&array.children[0]),
                _ => flat(array),
            }
        })
    });
    tested && gathered
}

/// Whether the filter kernel can read `array` as `column_type` says.
fn readable(array: &DeviceArray, column_type: ColumnType) -> bool {
    let strings = |array: &DeviceArray, offsets: usize| {
        array.kind == Kind::VarLen(offsets) && array.buffers.len() == 2
    };
    match (array.kind, column_type) {
        (Kind::Fixed(width), ColumnType::Key(key)) => key.width() == Some(width),
        (Kind::Bits, ColumnType::Key(key)) => key == KeyType::Bits,
        (Kind::VarLen(_), ColumnType::Strings { offsets }) => strings(array, offsets),
        // A dictionary whose strings hold NULLs is left to the host: those rows are NULL
        // through their values, not their keys.
        (Kind::Dictionary(width), ColumnType::Dictionary { keys, offsets }) => {
            key_fits(keys, width)
                && array
                    .children
                    .first()
                    .is_some_and(|values| strings(values, offsets) && values.validity.is_none())
        }
        _ => false,
    }
}

fn key_fits(keys: KeyType, width: usize) -> bool {
    keys.width() == Some(width)
}

/// The kernel's view of a column the filter reads.
fn input<'a>(column: Stored<'a>, column_type: ColumnType) -> FilterInput<'a> {
    let array = column.array;
    let at = |region: Region| span(column.allocation, region);
    let (data, dictionary) = match column_type {
        ColumnType::Key(_) => (None, None),
        ColumnType::Strings { .. } => (array.buffers.get(1).map(|&r| at(r)), None),
        ColumnType::Dictionary { .. } => match array.children.first() {
            Some(values) => (
                values.buffers.get(1).map(|&r| at(r)),
                values.buffers.first().map(|&r| (at(r), values.len)),
            ),
            None => (None, None),
        },
    };
    FilterInput {
        values: at(array.buffers[0]),
        validity: array.validity.map(at),
        data,
        dictionary,
        column: column_type,
    }
}

/// Bump allocation of 64-byte aligned regions from offset 0.
#[derive(Debug, Default)]
struct Cursor(usize);

impl Cursor {
    fn take(&mut self, len: usize) -> Region {
        let offset = self.0.next_multiple_of(ALIGNMENT);
        self.0 = offset + len;
        Region { offset, len }
    }
}

fn span(allocation: &DeviceAllocation, region: Region) -> Span<'_> {
    Span {
        allocation,
        offset: region.offset,
        len: region.len,
    }
}

/// Bytes of a bitmap the gather writes for `rows` rows: whole 32-bit words.
fn gathered_bitmap(rows: usize) -> usize {
    rows.div_ceil(32) * 4
}

/// Reads rows `rows` of `columns` that `filter` keeps (its tests name positions among
/// `columns`), returning columns `output` (positions among `columns`) of them as `schema`
/// describes. The caller checked [`supports`].
#[allow(clippy::too_many_arguments)]
pub(super) fn read_filtered(
    kernels: &FilterKernels,
    columns: &[Stored<'_>],
    filter: &RowFilter,
    output: &[usize],
    schema: &SchemaRef,
    rows: Range<usize>,
    stream: &mut Stream,
    read_staging: ReadStaging<'_>,
) -> Result<(RecordBatch, FilterStats), BackendError> {
    let pool = read_staging.pool;
    let mut stats = FilterStats::default();
    let n = rows.len();
    if n == 0 {
        return Ok((RecordBatch::new_empty(Arc::clone(schema)), stats));
    }
    let program = filter_abi::program(filter)
        .ok_or_else(|| BackendError::Device("a filter too large for the device".to_owned()))?;
    let outputs: Vec<Stored<'_>> = output.iter().map(|&p| columns[p]).collect();
    let strings: Vec<usize> = (0..outputs.len())
        .filter(|&i| matches!(outputs[i].array.kind, Kind::VarLen(_)))
        .collect();
    // For each output column, its place among the string columns, if it is one.
    let mut string_slot = vec![None; outputs.len()];
    for (slot, &index) in strings.iter().enumerate() {
        string_slot[index] = Some(slot);
    }

    // Round 1: flags, counts, string bytes; read back the totals.
    let tiles = n.div_ceil(TILE);
    let mut scratch_layout = Cursor::default();
    let table = scratch_layout.take(filter_program_bytes(filter.columns().len(), &program));
    let flags = scratch_layout.take(n);
    let tile_counts = scratch_layout.take(tiles * 8);
    let tile_offsets = scratch_layout.take((tiles + 1) * 8);
    let string_tiles: Vec<(Region, Region)> = strings
        .iter()
        .map(|_| {
            (
                scratch_layout.take(tiles * 8),
                scratch_layout.take((tiles + 1) * 8),
            )
        })
        .collect();
    // Pinned memory first: nothing may fail between allocating scratch memory and the first
    // synchronization (the allocation is freed in the stream's order either way).
    let mut staging = pool.lease(table.len)?;
    let mut totals = pool.lease(8 * (1 + strings.len()))?;
    let scratch = DeviceAllocation::scratch(stream, scratch_layout.0)?;
    let row_span = FilterRows {
        first: rows.start,
        count: n,
        flags: span(&scratch, flags),
        tile_offsets: span(&scratch, tile_offsets),
    };
    let inputs: Vec<FilterInput<'_>> = filter
        .columns()
        .iter()
        .map(|&(position, column_type)| input(columns[position], column_type))
        .collect();
    let staged_program = staging.buffer_mut();
    let (first_total, mut rest) = totals.buffer_mut().as_mut_slice().split_at_mut(8);
    stream.copies(|batch| {
        batch.launch_filter(
            kernels,
            staged_program,
            span(&scratch, table),
            &inputs,
            &program,
            row_span,
            span(&scratch, tile_counts),
        )?;
        batch.launch_scan(
            kernels,
            span(&scratch, tile_counts),
            tiles,
            span(&scratch, tile_offsets),
        )?;
        batch.copy_to_host(first_total, &scratch, tile_offsets.offset + tiles * 8)?;
        for (&index, &(bytes, scanned)) in strings.iter().zip(&string_tiles) {
            let column = outputs[index];
            let Kind::VarLen(width) = column.array.kind else {
                continue;
            };
            batch.launch_string_bytes(
                kernels,
                row_span,
                span(column.allocation, column.array.buffers[0]),
                width,
                column.array.buffers[1].len,
                span(&scratch, bytes),
            )?;
            batch.launch_scan(
                kernels,
                span(&scratch, bytes),
                tiles,
                span(&scratch, scanned),
            )?;
            let (total, tail) = std::mem::take(&mut rest).split_at_mut(8);
            batch.copy_to_host(total, &scratch, scanned.offset + tiles * 8)?;
            rest = tail;
        }
        Ok(())
    })?;
    stats.syncs += 1;
    stats.bytes += 8 * (1 + strings.len() as u64);
    let read_total = |index: usize| {
        let bytes = &totals.as_ref().as_slice()[index * 8..index * 8 + 8];
        u64::from_le_bytes(bytes.try_into().unwrap_or([0; 8]))
    };
    let kept = usize::try_from(read_total(0)).unwrap_or(usize::MAX);
    if kept > n {
        return Err(BackendError::Device(format!(
            "the filter kept {kept} of {n} rows"
        )));
    }
    stats.kept = kept as u64;
    if kept == 0 {
        return Ok((RecordBatch::new_empty(Arc::clone(schema)), stats));
    }
    if kept == n {
        let (batch, syncs, bytes) = read_rows(&outputs, schema, rows, stream, read_staging)?;
        stats.syncs += syncs;
        stats.bytes += bytes;
        return Ok((batch, stats));
    }
    let mut string_bytes = Vec::with_capacity(strings.len());
    for (i, &index) in strings.iter().enumerate() {
        let total = usize::try_from(read_total(i + 1)).unwrap_or(usize::MAX);
        if total > outputs[index].array.buffers[1].len {
            return Err(BackendError::Device(format!(
                "the filter kept {total} bytes of a string column holding {}",
                outputs[index].array.buffers[1].len
            )));
        }
        string_bytes.push(total);
    }

    // Round 2: the kept rows, gathered into a compact copy of the output columns.
    let mut out_layout = Cursor::default();
    let mut gathered = Vec::with_capacity(outputs.len());
    for (index, column) in outputs.iter().enumerate() {
        let source = column.array;
        let validity = source
            .validity
            .map(|_| out_layout.take(gathered_bitmap(kept)));
        let (buffers, children) = match source.kind {
            Kind::Null => (Vec::new(), Vec::new()),
            Kind::Fixed(width) => (vec![out_layout.take(kept * width)], Vec::new()),
            Kind::Bits => (vec![out_layout.take(gathered_bitmap(kept))], Vec::new()),
            Kind::VarLen(width) => {
                let position = string_slot[index].ok_or_else(|| {
                    BackendError::Device("a string column without its totals".to_owned())
                })?;
                let offsets = out_layout.take((kept + 1) * width);
                let data = out_layout.take(string_bytes[position]);
                (vec![offsets, data], Vec::new())
            }
            Kind::Dictionary(width) => {
                let keys = out_layout.take(kept * width);
                // The dictionary is copied whole: its regions, one after another.
                let values = &source.children[0];
                let mut copy = values.clone();
                copy.validity = values.validity.map(|r| out_layout.take(r.len));
                copy.buffers = values
                    .buffers
                    .iter()
                    .map(|r| out_layout.take(r.len))
                    .collect();
                (vec![keys], vec![copy])
            }
            _ => {
                return Err(BackendError::Device(
                    "a filtered read of a nested column".to_owned(),
                ));
            }
        };
        gathered.push(DeviceArray {
            data_type: source.data_type.clone(),
            kind: source.kind,
            len: kept,
            null_count: 0,
            validity,
            buffers,
            children,
            dictionary: source.dictionary.clone(),
        });
    }
    let out = DeviceAllocation::scratch(stream, out_layout.0)?;
    stream.copies(|batch| {
        for (index, (column, target)) in outputs.iter().zip(&gathered).enumerate() {
            let source = column.array;
            let from = |region: Region| span(column.allocation, region);
            let to = |region: Region| span(&out, region);
            if let (Some(src), Some(dst)) = (source.validity, target.validity) {
                batch.zero(to(dst))?;
                batch.launch_gather_bits(kernels, row_span, kept, from(src), to(dst))?;
            }
            match source.kind {
                Kind::Fixed(width) | Kind::Dictionary(width) => batch.launch_gather_fixed(
                    kernels,
                    row_span,
                    kept,
                    width,
                    from(source.buffers[0]),
                    to(target.buffers[0]),
                )?,
                Kind::Bits => {
                    batch.zero(to(target.buffers[0]))?;
                    batch.launch_gather_bits(
                        kernels,
                        row_span,
                        kept,
                        from(source.buffers[0]),
                        to(target.buffers[0]),
                    )?;
                }
                Kind::VarLen(width) => {
                    let position = string_slot[index].ok_or_else(|| {
                        BackendError::Device("a string column without its totals".to_owned())
                    })?;
                    batch.launch_gather_strings(
                        kernels,
                        row_span,
                        span(&scratch, string_tiles[position].1),
                        (kept, target.buffers[1].len),
                        width,
                        (from(source.buffers[0]), from(source.buffers[1])),
                        (to(target.buffers[0]), to(target.buffers[1])),
                    )?;
                }
                _ => {}
            }
            if let (Kind::Dictionary(_), Some(values), Some(copy)) = (
                source.kind,
                source.children.first(),
                target.children.first(),
            ) {
                let pairs = values
                    .validity
                    .iter()
                    .zip(copy.validity.iter())
                    .chain(values.buffers.iter().zip(&copy.buffers));
                for (src, dst) in pairs {
                    batch.copy_within_device(
                        &out,
                        dst.offset,
                        column.allocation,
                        src.offset,
                        src.len,
                    )?;
                }
            }
        }
        Ok(())
    })?;
    stats.syncs += 1;

    // Round 3: the compact copy, read back.
    let stored: Vec<Stored<'_>> = gathered
        .iter()
        .map(|array| Stored {
            allocation: &out,
            array,
        })
        .collect();
    let (batch, syncs, bytes) = read_rows(&stored, schema, 0..kept, stream, read_staging)?;
    stats.syncs += syncs;
    stats.bytes += bytes;
    Ok((batch, stats))
}
