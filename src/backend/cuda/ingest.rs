//! `ipc-import` on the CUDA backend: columns another process holds on this GPU, copied device
//! to device into the layout `ipc-export` publishes, then checked as a put's data is.
//!
//! [`ImportPlan`] (pure, unit-tested without a GPU) lays each column out as an upload would
//! (validity, buffers, children depth first, a dictionary's values last, each 64-byte
//! aligned) and arranges the columns as a concatenation does (every column in one
//! allocation), so an import is exportable and compact at once.
//!
//! [`import`] opens each distinct handle once and checks the size the driver reports for the
//! mapped allocation against the document's, copies every buffer into the server's own
//! allocations, and closes the mappings as soon as those copies are done, on every path, so the
//! producer may free its memory once the call returns. From the server's own copy it then
//! copies back to host memory the bytes Arrow's validation reads (validity bitmaps, offsets,
//! UTF-8 strings, dictionary keys, and dictionaries whole, which the layout keeps a host copy
//! of), in bounded pieces through one pinned staging lease ([`read_back`]), so that imports of
//! any size validate. The copies are then validated in full, with zeroed stand-ins for the
//! buffers no value of which can be invalid (fixed-width values, booleans, binary bytes): what was
//! validated is the server's own copy, which the producer can no longer change. Only then is
//! the partition made, so readers (`read_back_array` trusts put data to be validated) never
//! see unchecked bytes.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::Arc;

use arrow::array::{ArrayData, make_array};
use arrow::buffer::Buffer;
use arrow::datatypes::{DataType, SchemaRef};
use arrow::record_batch::{RecordBatch, RecordBatchOptions};

use super::concat::Arrangement;
use super::ffi::{self, IpcMapping, MappingError, OpenFailure};
use super::layout::{self, ALIGNMENT, DeviceArray, Kind, Region};
use super::{CudaPartition, Shared, TrackedAllocation};
use crate::backend::ingest::refused;
use crate::backend::{
    BackendError, BufferKind, ExportedArray, ExportedBuffer, ExportedColumn, ForeignAllocation,
};

/// Where an import's bytes come from and go.
#[derive(Debug)]
pub(super) struct ImportPlan {
    /// Each distinct handle a buffer with bytes lies in, once, with the largest allocation
    /// size declared for it.
    handles: Vec<([u8; 64], u64)>,
    /// Each column's layout from the start of its place.
    columns: Vec<DeviceArray>,
    /// Every region of every column in layout order.
    regions: Vec<Planned>,
    arrangement: Arrangement,
}

/// Part of a host region that one round of `read_back` copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Piece {
    /// Its index in `ImportPlan::regions`.
    region: usize,
    /// Bytes from the region's start.
    from: usize,
    len: usize,
}

/// One buffer to copy.
#[derive(Debug, Clone, Copy)]
struct Planned {
    column: usize,
    /// From the column's start.
    region: Region,
    /// The producer's allocation (in `handles`), and the offset from its base.
    handle: usize,
    source: u64,
    /// Copied back to the host too, for Arrow's validation to read.
    host: bool,
}

impl ImportPlan {
    /// Lays out `columns`, which `backend::ingest::check_columns` has checked.
    pub(super) fn new(columns: &[ExportedColumn]) -> Result<Self, BackendError> {
        let mut handles: Vec<([u8; 64], u64)> = Vec::new();
        let mut handle_index = HashMap::new();
        let mut planned = Vec::with_capacity(columns.len());
        let mut regions = Vec::new();
        let mut used = Vec::with_capacity(columns.len());
        for (index, column) in columns.iter().enumerate() {
            let mut planner = Planner {
                column: index,
                own: ForeignAllocation {
                    handle: column.handle,
                    bytes: column.allocation_bytes,
                },
                used: 0,
                regions: &mut regions,
                handles: &mut handles,
                handle_index: &mut handle_index,
            };
            let array = planner.array(&column.array, false)?;
            used.push(planner.used);
            planned.push(array);
        }
        Ok(Self {
            handles,
            columns: planned,
            regions,
            arrangement: Arrangement::new(&used),
        })
    }

    /// Device bytes the import allocates.
    pub(super) fn allocated_bytes(&self) -> u64 {
        self.arrangement.total_bytes()
    }

    /// Bytes copied back to the host for validation.
    fn host_bytes(&self) -> usize {
        self.regions
            .iter()
            .filter(|r| r.host)
            .map(|r| r.region.len)
            .sum()
    }

    /// The bytes validation reads (the host regions), in rounds of at most `limit` bytes, in
    /// layout order: each round is one trip through a staging buffer of `limit` bytes, and a
    /// region larger than that spans several.
    fn read_back_rounds(&self, limit: usize) -> Vec<Vec<Piece>> {
        let limit = limit.max(1);
        let mut rounds = Vec::new();
        let mut round = Vec::new();
        let mut room = limit;
        for (region, planned) in self.regions.iter().enumerate() {
            if !planned.host {
                continue;
            }
            let mut from = 0;
            while from < planned.region.len {
                let len = (planned.region.len - from).min(room);
                round.push(Piece { region, from, len });
                from += len;
                room -= len;
                if room == 0 {
                    rounds.push(std::mem::take(&mut round));
                    room = limit;
                }
            }
        }
        if !round.is_empty() {
            rounds.push(round);
        }
        rounds
    }

    /// Where a planned region lies among the import's allocations: (allocation, offset).
    fn destination(&self, planned: &Planned) -> (usize, usize) {
        let (allocation, at) = self.arrangement.columns[planned.column];
        (allocation, at + planned.region.offset)
    }
}

struct Planner<'a> {
    column: usize,
    /// The column's allocation, where its buffers do not name another.
    own: ForeignAllocation,
    used: usize,
    regions: &'a mut Vec<Planned>,
    handles: &'a mut Vec<([u8; 64], u64)>,
    /// Each handle's position in `handles`: a document may name thousands of buffers.
    handle_index: &'a mut HashMap<[u8; 64], usize>,
}

impl Planner<'_> {
    /// The index of `allocation` among the handles to open.
    fn handle(&mut self, allocation: ForeignAllocation) -> usize {
        match self.handle_index.entry(allocation.handle) {
            Entry::Occupied(known) => {
                let position = *known.get();
                let declared = &mut self.handles[position].1;
                *declared = (*declared).max(allocation.bytes);
                position
            }
            Entry::Vacant(new) => {
                self.handles.push((allocation.handle, allocation.bytes));
                *new.insert(self.handles.len() - 1)
            }
        }
    }

    fn region(&mut self, buffer: &ExportedBuffer, host: bool) -> Result<Region, BackendError> {
        let (source, len) = (buffer.offset, buffer.length);
        let len = usize::try_from(len).map_err(|_| refused(format!("a buffer of {len} bytes")))?;
        // Only allocations something is copied from are opened.
        let handle = if len > 0 {
            self.handle(buffer.allocation.unwrap_or(self.own))
        } else {
            usize::MAX
        };
        let offset = self
            .used
            .checked_next_multiple_of(ALIGNMENT)
            .ok_or_else(|| refused("the columns' bytes overflow".to_owned()))?;
        let region = Region { offset, len };
        self.used = offset
            .checked_add(len)
            .ok_or_else(|| refused("the columns' bytes overflow".to_owned()))?;
        self.regions.push(Planned {
            column: self.column,
            region,
            handle,
            source,
            host,
        });
        Ok(region)
    }

    /// Lays out `array`; `in_dictionary`: it is (part of) a dictionary's values, all of which
    /// go to the host too.
    fn array(
        &mut self,
        array: &ExportedArray,
        in_dictionary: bool,
    ) -> Result<DeviceArray, BackendError> {
        let kind = layout::kind(&array.data_type)?;
        let len =
            usize::try_from(array.length).map_err(|_| refused(format!("{} rows", array.length)))?;
        let mut validity = None;
        let mut buffers = Vec::new();
        for buffer in &array.buffers {
            let host = in_dictionary
                || match (buffer.kind, kind) {
                    (BufferKind::Validity | BufferKind::Offsets, _) => true,
                    (BufferKind::Values, Kind::Dictionary(_)) => true,
                    (BufferKind::Values, Kind::VarLen(_)) => {
                        matches!(array.data_type, DataType::Utf8 | DataType::LargeUtf8)
                    }
                    (BufferKind::Values, _) => false,
                };
            let region = self.region(buffer, host)?;
            match buffer.kind {
                BufferKind::Validity => validity = Some(region),
                BufferKind::Offsets | BufferKind::Values => buffers.push(region),
            }
        }
        let mut children = array
            .children
            .iter()
            .map(|child| self.array(child, in_dictionary))
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(values) = &array.dictionary {
            children.push(self.array(values, true)?);
        }
        Ok(DeviceArray {
            data_type: array.data_type.clone(),
            kind,
            len,
            null_count: usize::try_from(array.null_count).unwrap_or(usize::MAX),
            validity,
            buffers,
            children,
            dictionary: None,
        })
    }
}

/// Copies the planned columns out of the producer's memory into new allocations of `shared`'s
/// GPU and validates them; `rows` rows of `schema`.
pub(super) fn import(
    shared: &Arc<Shared>,
    plan: ImportPlan,
    schema: SchemaRef,
    rows: usize,
) -> Result<CudaPartition, BackendError> {
    let started = std::time::Instant::now();
    let mappings = plan
        .handles
        .iter()
        .enumerate()
        .map(|(index, (handle, declared))| {
            let mapping = IpcMapping::open(&shared.context, handle)
                .map_err(|e| unopened(index, shared.context.ordinal() as u32, e))?;
            if *declared > mapping.bytes() as u64 {
                return Err(refused(format!(
                    "handle {index} maps an allocation of {} bytes, not the {declared} the \
                     document declares",
                    mapping.bytes()
                )));
            }
            Ok(mapping)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let opened = started.elapsed();
    let allocations = plan
        .arrangement
        .allocations
        .iter()
        .map(|&bytes| TrackedAllocation::new(shared, bytes))
        .collect::<Result<Vec<_>, _>>()?;
    let allocated = started.elapsed();
    shared.with_stream(|stream| {
        stream.copies(|batch| {
            for planned in &plan.regions {
                if planned.region.len == 0 {
                    continue;
                }
                let (allocation, at) = plan.destination(planned);
                let handle = planned.handle;
                let source = usize::try_from(planned.source)
                    .map_err(|_| refused(format!("an offset of {}", planned.source)))?;
                batch.copy_from_mapping(
                    &allocations[allocation].inner,
                    at,
                    &mappings[handle],
                    source,
                    planned.region.len,
                )?;
            }
            for (index, allocation) in allocations.iter().enumerate() {
                let placed: Vec<(&DeviceArray, usize)> = plan
                    .arrangement
                    .columns
                    .iter()
                    .zip(&plan.columns)
                    .filter(|((at, _), _)| *at == index)
                    .map(|(&(_, at), array)| (array, at))
                    .collect();
                super::pieces::zero_gaps(batch, &allocation.inner, &placed)?;
            }
            Ok(())
        })
    })?;
    let copied = started.elapsed();
    // The producer's memory is not touched again.
    drop(mappings);
    let closed = started.elapsed();

    let mut bytes = read_back(shared, &plan, &allocations)?.into_iter();
    let read = started.elapsed();
    let plan_handles = plan.handles.len();
    let ImportPlan {
        columns,
        arrangement,
        ..
    } = plan;
    let mut placed = Vec::with_capacity(columns.len());
    let mut arrays = Vec::with_capacity(columns.len());
    for (index, (mut array, field)) in columns.into_iter().zip(schema.fields()).enumerate() {
        let data = validate(field.name(), &mut array, &mut bytes)?;
        arrays.push(make_array(data));
        let (allocation, at) = arrangement.columns[index];
        array.shift(at);
        placed.push((allocation, array));
    }
    // The schema's own rules: lengths, types, and no nulls in non-nullable fields.
    RecordBatch::try_new_with_options(
        Arc::clone(&schema),
        arrays,
        &RecordBatchOptions::new().with_row_count(Some(rows)),
    )
    .map_err(|e| {
        refused(format!(
            "the columns do not make a batch of the schema: {e}"
        ))
    })?;
    let bytes: u64 = allocations.iter().map(|a| a.inner.bytes() as u64).sum();
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    tracing::info!(
        bytes,
        handles = plan_handles,
        open_ms = ms(opened),
        allocate_ms = ms(allocated - opened),
        copy_ms = ms(copied - allocated),
        close_ms = ms(closed - copied),
        read_back_ms = ms(read - closed),
        validate_ms = ms(started.elapsed() - read),
        "ipc-import copied"
    );
    let counters = &shared.counters;
    counters
        .imports
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    counters
        .imported_bytes
        .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
    Ok(CudaPartition {
        shared: Arc::clone(shared),
        allocations: Arc::new(allocations),
        columns: Arc::new(placed),
        schema,
        rows,
    })
}

/// Pinned staging one round of [`read_back`] takes at most: the bytes validation reads go
/// through it in pieces, so an import of any size validates with this much pinned memory.
const READ_BACK_PIECE_BYTES: usize = 64 << 20;

/// The bytes validation reads of each region of `plan` (`None` for the others), copied back
/// from the server's own `allocations` in rounds through one ordinary staging lease of at most
/// [`READ_BACK_PIECE_BYTES`], as uploads and concatenations lease theirs: held only for the
/// copies, so neither capped like a read's nor in the memory budget. The host copies
/// themselves are ordinary memory, as large as what they hold, kept until validation is done
/// (a dictionary's for as long as the partition, as an upload's).
fn read_back(
    shared: &Arc<Shared>,
    plan: &ImportPlan,
    allocations: &[TrackedAllocation],
) -> Result<Vec<Option<Buffer>>, BackendError> {
    let mut copies: Vec<Option<Vec<u8>>> = plan
        .regions
        .iter()
        .map(|planned| planned.host.then(|| Vec::with_capacity(planned.region.len)))
        .collect();
    let rounds = plan.read_back_rounds(READ_BACK_PIECE_BYTES);
    if !rounds.is_empty() {
        let mut staging = shared
            .pool
            .lease(plan.host_bytes().min(READ_BACK_PIECE_BYTES))?;
        for round in &rounds {
            shared.with_stream(|stream| {
                stream.copies(|batch| {
                    let mut rest = staging.buffer_mut().as_mut_slice();
                    for piece in round {
                        let (target, tail) = std::mem::take(&mut rest).split_at_mut(piece.len);
                        let (allocation, at) = plan.destination(&plan.regions[piece.region]);
                        batch.copy_to_host(
                            target,
                            &allocations[allocation].inner,
                            at + piece.from,
                        )?;
                        rest = tail;
                    }
                    Ok(())
                })
            })?;
            let mut filled = staging.as_ref().as_slice();
            for piece in round {
                let (piece_bytes, tail) = filled.split_at(piece.len);
                if let Some(copy) = copies[piece.region].as_mut() {
                    copy.extend_from_slice(piece_bytes);
                }
                filled = tail;
            }
        }
    }
    Ok(copies
        .into_iter()
        .map(|copy| copy.map(Buffer::from_vec))
        .collect())
}

/// The error for handle `index` of an import that did not open on `device`: the producer's
/// (INVALID_ARGUMENT) where the handle maps nothing this server may open, the server's
/// (RESOURCE_EXHAUSTED) where the GPU lacks what a mapping takes now, a device failure
/// (INTERNAL) otherwise.
fn unopened(index: usize, device: u32, error: MappingError) -> BackendError {
    let MappingError { failure, error } = error;
    match failure {
        OpenFailure::Handle => refused(format!(
            "handle {index} could not be opened on this GPU ({error}): it must be a \
             cudaIpcGetMemHandle of memory that is still allocated, by a live process other \
             than this server, on the GPU the document names"
        )),
        OpenFailure::Exhausted => BackendError::MappingExhausted {
            device,
            handle: index,
            reason: error.to_string(),
        },
        OpenFailure::Driver => {
            BackendError::Device(format!("opening ipc-import handle {index}: {error}"))
        }
    }
}

/// Rebuilds `array` on the host from `bytes` (the host copy of each region in layout order, or
/// `None` where a zeroed stand-in will do) and validates it in full; records its null count,
/// drops a bitmap without nulls and keeps a dictionary's host copy, as uploads do.
fn validate(
    path: &str,
    array: &mut DeviceArray,
    bytes: &mut impl Iterator<Item = Option<Buffer>>,
) -> Result<ArrayData, BackendError> {
    let mut next = |region: &Region| -> Buffer {
        match bytes.next().flatten() {
            Some(buffer) => buffer,
            None => ffi::untouched_zeroes(region.len),
        }
    };
    let validity = array.validity.as_ref().map(&mut next);
    let buffers: Vec<Buffer> = array.buffers.iter().map(&mut next).collect();
    let child_paths: Vec<String> = match &array.data_type {
        DataType::Struct(fields) => fields
            .iter()
            .map(|f| format!("{path}.{}", f.name()))
            .collect(),
        DataType::List(f)
        | DataType::LargeList(f)
        | DataType::FixedSizeList(f, _)
        | DataType::Map(f, _) => {
            vec![format!("{path}.{}", f.name())]
        }
        _ => vec![format!("{path}.values")],
    };
    let children = array
        .children
        .iter_mut()
        .zip(
            child_paths
                .iter()
                .chain(std::iter::repeat(&format!("{path}.values"))),
        )
        .map(|(child, child_path)| validate(child_path, child, bytes))
        .collect::<Result<Vec<_>, _>>()?;
    let offsets = buffers.first().cloned();
    let data = ArrayData::builder(array.data_type.clone())
        .len(array.len)
        .null_bit_buffer(validity)
        .buffers(buffers)
        .child_data(children)
        .build()
        .map_err(|e| refused(format!("{path}: {e}")))?;
    // The layout's own contract, beyond Arrow's: offsets start at 0 and end where the bytes
    // (or the child's rows) do, so the arrays are compact.
    let end = match array.kind {
        Kind::VarLen(_) => Some(array.buffers[1].len),
        Kind::List(_) => Some(array.children[0].len),
        _ => None,
    };
    if let (Some(end), Some(offsets), Kind::VarLen(width) | Kind::List(width)) =
        (end, offsets, array.kind)
    {
        let first = layout::offset_at(offsets.as_slice(), 0, width);
        let last = layout::offset_at(offsets.as_slice(), array.len, width);
        if first != 0 || last != end {
            return Err(refused(format!(
                "{path}: offsets run from {first} to {last}; an import's start at 0 and end at \
                 {end}, where its data ends"
            )));
        }
    }
    array.null_count = data.null_count();
    if array.null_count == 0 {
        array.validity = None;
    }
    if let Kind::Dictionary(_) = array.kind {
        let values = data
            .child_data()
            .first()
            .ok_or_else(|| refused(format!("{path}: a dictionary without values")))?;
        array.dictionary = Some(make_array(values.clone()));
    }
    Ok(data)
}

#[cfg(test)]
mod tests {
    use arrow::datatypes::Field;

    use super::*;
    use crate::backend::ingest::tests::{array, buffer};

    fn column(handle: u8, allocation_bytes: u64, array: ExportedArray) -> ExportedColumn {
        ExportedColumn {
            handle: [handle; 64],
            allocation_bytes,
            array,
        }
    }

    #[test]
    fn handles_that_do_not_open_answer_by_whose_failure_it_is() {
        use tonic::Code;
        let code = |failure| {
            let error = unopened(
                3,
                1,
                MappingError {
                    failure,
                    error: BackendError::Device("cuIpcOpenMemHandle: the driver's words".into()),
                },
            );
            let status = crate::error::Error::from(error).quiet_status();
            assert!(status.message().contains("handle 3"), "{status:?}");
            assert!(
                status.message().contains("the driver's words"),
                "{status:?}"
            );
            status.code()
        };
        assert_eq!(code(OpenFailure::Handle), Code::InvalidArgument);
        assert_eq!(code(OpenFailure::Exhausted), Code::ResourceExhausted);
        assert_eq!(code(OpenFailure::Driver), Code::Internal);
    }

    #[test]
    fn an_import_lands_in_one_allocation_each_handle_opened_once() {
        let rows = 1 << 20;
        let big = |handle| {
            column(
                handle,
                8 << 20,
                array(
                    DataType::Int64,
                    rows,
                    vec![buffer(BufferKind::Values, 0, rows * 8)],
                ),
            )
        };
        let small = column(
            3,
            1 << 20,
            array(
                DataType::Int32,
                10,
                vec![buffer(BufferKind::Values, 64, 40)],
            ),
        );
        let plan = ImportPlan::new(&[big(1), big(1), small.clone(), small]).expect("plan");
        assert_eq!(plan.handles.len(), 2, "each handle once");
        assert_eq!(plan.arrangement.allocations.len(), 1);
        assert_eq!(
            plan.allocated_bytes(),
            18 << 20,
            "8 + 8 MiB and 2 x 40 bytes, rounded up to 2 MiB"
        );
        assert_eq!(plan.host_bytes(), 0, "fixed-width values need no host copy");
        let (allocation, offset) = plan.destination(&plan.regions[3]);
        assert_eq!((allocation, offset), (0, (16 << 20) + ALIGNMENT));
    }

    #[test]
    fn many_buffers_over_few_handles_name_the_handles_a_plain_search_finds() {
        // Buffers in their column's allocation, in one of 37 others, and empty ones (nothing
        // to open), over 13 column handles; declared sizes differ from buffer to buffer.
        let other = |i: u64| ForeignAllocation {
            handle: [100 + (i * 7 % 37) as u8; 64],
            bytes: 4096 + i * 3 % 1000,
        };
        let columns: Vec<ExportedColumn> = (0..3000u64)
            .map(|i| {
                let mut validity = buffer(BufferKind::Validity, 0, 2);
                if i % 2 == 0 {
                    validity.allocation = Some(other(i));
                }
                let offsets = buffer(BufferKind::Offsets, 64, 44);
                let mut values = buffer(BufferKind::Values, 128, if i % 5 == 0 { 0 } else { 9 });
                if i % 3 == 0 {
                    values.allocation = Some(other(i + 1));
                }
                let mut strings = array(DataType::Utf8, 10, vec![validity, offsets, values]);
                strings.null_count = 1;
                column((i % 13) as u8, 1 << 20 | i, strings)
            })
            .collect();
        let plan = ImportPlan::new(&columns).expect("plan");

        // The plain way: each buffer with bytes searches the handles seen so far.
        let mut handles: Vec<([u8; 64], u64)> = Vec::new();
        let mut named = Vec::new();
        for column in &columns {
            for buffer in &column.array.buffers {
                if buffer.length == 0 {
                    named.push(usize::MAX);
                    continue;
                }
                let allocation = buffer.allocation.unwrap_or(ForeignAllocation {
                    handle: column.handle,
                    bytes: column.allocation_bytes,
                });
                match handles.iter().position(|(h, _)| *h == allocation.handle) {
                    Some(at) => {
                        handles[at].1 = handles[at].1.max(allocation.bytes);
                        named.push(at);
                    }
                    None => {
                        handles.push((allocation.handle, allocation.bytes));
                        named.push(handles.len() - 1);
                    }
                }
            }
        }
        assert_eq!(handles.len(), 13 + 37);
        assert_eq!(
            plan.handles, handles,
            "each once, in order, with its largest size"
        );
        let planned: Vec<usize> = plan.regions.iter().map(|r| r.handle).collect();
        assert_eq!(planned, named, "every buffer names its allocation's handle");
        let sources: Vec<u64> = plan.regions.iter().map(|r| r.source).collect();
        let offsets: Vec<u64> = columns
            .iter()
            .flat_map(|c| c.array.buffers.iter().map(|b| b.offset))
            .collect();
        assert_eq!(sources, offsets);
    }

    #[test]
    fn validation_reads_back_every_host_byte_once_in_bounded_rounds() {
        // 2 GiB of strings next to small ones, bitmaps, offsets and int64s (not read back):
        // planned, never allocated.
        let strings = |bytes: u64| {
            let mut strings = array(
                DataType::Utf8,
                1 << 18,
                vec![
                    buffer(BufferKind::Validity, 0, 1 << 15),
                    buffer(BufferKind::Offsets, 0, (1 << 20) + 4),
                    buffer(BufferKind::Values, 0, bytes),
                ],
            );
            strings.null_count = 1;
            column(1, 1 << 40, strings)
        };
        let ints = column(
            2,
            1 << 20,
            array(
                DataType::Int64,
                1000,
                vec![buffer(BufferKind::Values, 0, 8000)],
            ),
        );
        let plan = |big| {
            ImportPlan::new(&[strings(big), ints.clone(), strings(5), strings(0)]).expect("plan")
        };
        let small = plan(5000);
        for limit in [1, 100, 4096, 1 << 20, READ_BACK_PIECE_BYTES, usize::MAX] {
            let plan = &small;
            let rounds = plan.read_back_rounds(limit);
            assert!(
                rounds.iter().all(|round| {
                    round.iter().map(|p| p.len).sum::<usize>() <= limit
                        && round.iter().all(|p| p.len > 0)
                }),
                "each round fits in {limit} bytes"
            );
            let pieces: Vec<Piece> = rounds.into_iter().flatten().collect();
            // Per region, its pieces in order, from 0 to its end.
            for (index, planned) in plan.regions.iter().enumerate() {
                let mut next = 0;
                for piece in pieces.iter().filter(|p| p.region == index) {
                    assert!(planned.host, "only what validation reads");
                    assert_eq!(piece.from, next, "region {index}, limit {limit}");
                    next += piece.len;
                }
                let expected = if planned.host { planned.region.len } else { 0 };
                assert_eq!(next, expected, "region {index}, limit {limit}");
            }
            assert!(
                pieces.windows(2).all(|w| w[0].region <= w[1].region),
                "layout order"
            );
        }
        let large = plan(2 << 30);
        let host = large.host_bytes();
        assert!(host > 2 << 30);
        for limit in [1 << 20, READ_BACK_PIECE_BYTES] {
            let rounds = large.read_back_rounds(limit);
            assert_eq!(
                rounds.len(),
                host.div_ceil(limit),
                "rounds are full but the last: any size goes"
            );
            let read: usize = rounds.iter().flatten().map(|p| p.len).sum();
            assert_eq!(read, host);
        }
        let none = ImportPlan::new(&[column(
            2,
            1 << 20,
            array(DataType::Int64, 10, vec![buffer(BufferKind::Values, 0, 80)]),
        )])
        .expect("plan");
        assert!(none.read_back_rounds(64).is_empty(), "nothing to read back");
    }

    #[test]
    fn strings_offsets_bitmaps_and_dictionaries_are_checked_on_the_host() {
        let mut strings = array(
            DataType::Utf8,
            2,
            vec![
                buffer(BufferKind::Validity, 0, 1),
                buffer(BufferKind::Offsets, 64, 12),
                buffer(BufferKind::Values, 128, 5),
            ],
        );
        strings.null_count = 1;
        let binary = array(
            DataType::Binary,
            2,
            vec![
                buffer(BufferKind::Offsets, 0, 12),
                buffer(BufferKind::Values, 64, 5),
            ],
        );
        let mut dictionary = array(
            DataType::Dictionary(Box::new(DataType::Int8), Box::new(DataType::Int64)),
            4,
            vec![buffer(BufferKind::Values, 0, 4)],
        );
        dictionary.dictionary = Some(Box::new(array(
            DataType::Int64,
            2,
            vec![buffer(BufferKind::Values, 64, 16)],
        )));
        let plan = ImportPlan::new(&[
            column(1, 1 << 20, strings),
            column(1, 1 << 20, binary),
            column(1, 1 << 20, dictionary),
        ])
        .expect("plan");
        let host: Vec<bool> = plan.regions.iter().map(|r| r.host).collect();
        assert_eq!(
            host,
            [true, true, true, true, false, true, true],
            "binary bytes need no check; keys and the whole dictionary do"
        );
        assert_eq!(plan.host_bytes(), 1 + 12 + 5 + 12 + 4 + 16);
    }

    /// Validates one planned column from host bytes given per region.
    fn validated(
        column: ExportedColumn,
        regions: Vec<Option<Vec<u8>>>,
    ) -> Result<DeviceArray, String> {
        let plan = ImportPlan::new(&[column]).expect("plan");
        let mut array = plan.columns.into_iter().next().expect("column");
        let mut bytes = regions.into_iter().map(|r| r.map(Buffer::from_vec));
        validate("c", &mut array, &mut bytes).map_err(|e| e.to_string())?;
        Ok(array)
    }

    fn offsets(values: &[i32]) -> Option<Vec<u8>> {
        Some(values.iter().flat_map(|v| v.to_le_bytes()).collect())
    }

    #[test]
    fn copied_bytes_are_validated_in_full() {
        let strings = || {
            column(
                1,
                1 << 20,
                array(
                    DataType::Utf8,
                    2,
                    vec![
                        buffer(BufferKind::Offsets, 0, 12),
                        buffer(BufferKind::Values, 64, 5),
                    ],
                ),
            )
        };
        let good = validated(
            strings(),
            vec![offsets(&[0, 2, 5]), Some(b"abcde".to_vec())],
        )
        .expect("valid");
        assert_eq!(good.null_count, 0);
        for (regions, expected) in [
            (vec![offsets(&[0, 2, 9]), Some(b"abcde".to_vec())], "offset"),
            (vec![offsets(&[0, 4, 2]), Some(b"abcde".to_vec())], "offset"),
            (
                vec![offsets(&[0, -1, 5]), Some(b"abcde".to_vec())],
                "offset",
            ),
            (vec![offsets(&[0, 2, 5]), Some(b"ab\xffde".to_vec())], "utf"),
            (
                vec![offsets(&[1, 2, 5]), Some(b"abcde".to_vec())],
                "start at 0",
            ),
            (
                vec![offsets(&[0, 2, 4]), Some(b"abcde".to_vec())],
                "start at 0",
            ),
        ] {
            let error = validated(strings(), regions).expect_err(expected);
            assert!(
                error.to_lowercase().contains(expected),
                "{expected}: {error}"
            );
        }
        let mut keys = array(
            DataType::Dictionary(Box::new(DataType::Int8), Box::new(DataType::Utf8)),
            3,
            vec![buffer(BufferKind::Values, 0, 3)],
        );
        keys.dictionary = Some(Box::new(array(
            DataType::Utf8,
            2,
            vec![
                buffer(BufferKind::Offsets, 64, 12),
                buffer(BufferKind::Values, 128, 2),
            ],
        )));
        let dictionary = |keys_bytes: Vec<u8>| {
            validated(
                column(1, 1 << 20, keys.clone()),
                vec![Some(keys_bytes), offsets(&[0, 1, 2]), Some(b"xy".to_vec())],
            )
        };
        let kept = dictionary(vec![0, 1, 1]).expect("keys in range");
        assert!(kept.dictionary.is_some(), "a host copy of the dictionary");
        let error = dictionary(vec![0, 2, 1]).expect_err("key out of range");
        assert!(error.contains("c"), "{error}");
        let mut nullable = array(
            DataType::Int64,
            10,
            vec![
                buffer(BufferKind::Validity, 0, 2),
                buffer(BufferKind::Values, 64, 80),
            ],
        );
        nullable.null_count = 0;
        let counted = validated(
            column(1, 1 << 20, nullable.clone()),
            vec![Some(vec![0xff, 0x01]), None],
        )
        .expect("valid");
        assert_eq!(counted.null_count, 1, "counted from the bitmap");
        let none = validated(
            column(1, 1 << 20, nullable),
            vec![Some(vec![0xff, 0x03]), None],
        )
        .expect("valid");
        assert!(none.validity.is_none(), "a bitmap without nulls is dropped");
        let list = |child_rows| {
            let mut list = array(
                DataType::List(Arc::new(Field::new("item", DataType::Int32, true))),
                2,
                vec![buffer(BufferKind::Offsets, 0, 12)],
            );
            list.children = vec![array(
                DataType::Int32,
                child_rows,
                vec![buffer(BufferKind::Values, 64, child_rows * 4)],
            )];
            column(1, 1 << 20, list)
        };
        validated(list(3), vec![offsets(&[0, 1, 3]), None]).expect("compact");
        let error = validated(list(4), vec![offsets(&[0, 1, 3]), None]).expect_err("extra rows");
        assert!(error.contains("start at 0"), "{error}");
    }
}
