//! How a record batch lies in device memory, and how rows of it come back.
//!
//! **The layout (the contract `ipc-export` publishes).** Every array lies in one device
//! allocation: its validity bitmap (when it has nulls), then its own buffers (values; offsets
//! then bytes for strings and binary; offsets for lists; keys for dictionaries), then its
//! children depth first (list items, struct fields, a dictionary's values), each at a 64-byte
//! aligned offset; [`DeviceArray`] records where. Arrays start at row 0: bitmaps at bit 0,
//! offsets at 0, children hold exactly the rows their parent references. Allocations are
//! rounded up to 2 MiB, the driver's sub-allocation granularity: a CUDA IPC handle exposes the
//! whole underlying block, so rounding guarantees no block ever holds bytes of two datasets.
//!
//! An uploaded batch is one allocation holding all its columns in order; the staging buffer
//! has the same layout, so an upload is one host-to-device copy. Compaction (`concat`) then
//! gives each large column an allocation of its own and packs the small ones together.
//!
//! **Reading rows `s..e`** copies only what those rows need, into pinned memory, in rounds:
//! the first round copies validity bytes, fixed-width values and offsets; once the stream has
//! synchronized, offsets give the byte ranges of string data and the row ranges of list
//! children, which the next round copies. Fixed-width tables take one synchronization per
//! chunk, flat strings two, and each further level of list nesting one more. Bitmaps are
//! copied from byte `s / 8` and addressed with a bit offset, so no bits are shifted on the
//! CPU; offsets are rebased to start at zero in pinned memory before Arrow sees them.

use std::ops::Range;
use std::sync::Arc;

use arrow::array::{ArrayData, ArrayDataBuilder, ArrayRef, MutableArrayData, make_array};
use arrow::buffer::{BooleanBuffer, Buffer, NullBuffer};
use arrow::datatypes::{DataType, SchemaRef};
use arrow::record_batch::{RecordBatch, RecordBatchOptions};

use super::ffi::{self, DeviceAllocation, Stream};
use super::staging::{PinnedLease, PinnedPool};
use crate::backend::{BackendError, BufferKind, ExportedArray, ExportedBuffer};

/// Alignment of every buffer in device and staging memory.
pub(super) const ALIGNMENT: usize = 64;
/// `cuMemAlloc`'s sub-allocation granularity; see the module docs.
pub(super) const ALLOCATION_GRANULARITY: usize = 2 << 20;

/// A byte range of a partition's device allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Region {
    pub(super) offset: usize,
    pub(super) len: usize,
}

/// How one array's bytes are addressed by row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Null,
    /// Values of this many bytes each.
    Fixed(usize),
    /// Bit-packed booleans.
    Bits,
    /// Offsets of this width into a byte buffer (strings, binary).
    VarLen(usize),
    /// Offsets of this width into child rows (lists, maps).
    List(usize),
    /// This many child rows per row.
    FixedList(usize),
    Struct,
    /// Keys of this width, and the whole dictionary.
    Dictionary(usize),
}

fn kind(data_type: &DataType) -> Result<Kind, BackendError> {
    let kind = match data_type {
        DataType::Null => Kind::Null,
        DataType::Boolean => Kind::Bits,
        DataType::Utf8 | DataType::Binary => Kind::VarLen(4),
        DataType::LargeUtf8 | DataType::LargeBinary => Kind::VarLen(8),
        DataType::List(_) | DataType::Map(_, _) => Kind::List(4),
        DataType::LargeList(_) => Kind::List(8),
        DataType::FixedSizeList(_, size) => Kind::FixedList(usize::try_from(*size).unwrap_or(0)),
        DataType::FixedSizeBinary(size) => Kind::Fixed(usize::try_from(*size).unwrap_or(0)),
        DataType::Struct(_) => Kind::Struct,
        DataType::Dictionary(key, _) => Kind::Dictionary(key.primitive_width().unwrap_or(0)),
        other => match other.primitive_width() {
            Some(width) => Kind::Fixed(width),
            None => {
                return Err(BackendError::UnsupportedType {
                    backend: "cuda",
                    data_type: other.to_string(),
                });
            }
        },
    };
    Ok(kind)
}

/// Where one array lives in its partition's allocation.
#[derive(Debug, Clone)]
pub(super) struct DeviceArray {
    pub(super) data_type: DataType,
    pub(super) kind: Kind,
    pub(super) len: usize,
    pub(super) null_count: usize,
    pub(super) validity: Option<Region>,
    pub(super) buffers: Vec<Region>,
    pub(super) children: Vec<DeviceArray>,
    /// For a dictionary: a host copy of its values (also on the device, as `children[0]`), so
    /// concatenation can merge dictionaries without reading them back. Dictionaries are small.
    pub(super) dictionary: Option<ArrayRef>,
}

impl DeviceArray {
    /// Moves every region `by` bytes further into the allocation.
    pub(super) fn shift(&mut self, by: usize) {
        let move_region = |region: &mut Region| region.offset += by;
        self.validity.iter_mut().for_each(move_region);
        self.buffers.iter_mut().for_each(move_region);
        self.children.iter_mut().for_each(|child| child.shift(by));
    }
}

/// The layout of one batch, and the host bytes that fill it.
#[derive(Debug)]
pub(super) struct UploadPlan {
    pub(super) columns: Vec<DeviceArray>,
    /// Host bytes to place at each region, in allocation order.
    pub(super) sources: Vec<(Region, Buffer)>,
    /// Bytes the buffers span, before rounding.
    pub(super) used_bytes: usize,
}

impl UploadPlan {
    /// Plans `batch`'s layout. Arrays that are not compact (slices; offsets not starting at 0;
    /// children holding rows nobody references) are copied to fresh buffers first, so every
    /// device array starts at its row 0 and concatenation can work on whole fragments.
    pub(super) fn new(batch: &RecordBatch) -> Result<Self, BackendError> {
        let mut plan = Self::starting_at(0);
        for column in batch.columns() {
            let array = plan.place(&column.to_data())?;
            plan.columns.push(array);
        }
        Ok(plan)
    }

    /// An empty plan whose first buffer goes at (the next aligned offset from) `offset`.
    pub(super) fn starting_at(offset: usize) -> Self {
        Self {
            columns: Vec::new(),
            sources: Vec::new(),
            used_bytes: offset,
        }
    }

    /// Bytes the device allocation takes, rounded to the allocation granularity.
    pub(super) fn allocation_bytes(&self) -> usize {
        allocation_bytes(self.used_bytes)
    }

    fn region(&mut self, buffer: &Buffer, len: usize) -> Region {
        let offset = self.used_bytes.next_multiple_of(ALIGNMENT);
        let region = Region { offset, len };
        self.used_bytes = offset + len;
        if len > 0 {
            self.sources
                .push((region, buffer.slice_with_length(0, len)));
        }
        region
    }

    /// Lays out `data` (compacted first if it is not) after what is planned so far.
    pub(super) fn place(&mut self, data: &ArrayData) -> Result<DeviceArray, BackendError> {
        let data = compact(data.clone())?;
        self.place_compact(&data)
    }

    fn place_compact(&mut self, data: &ArrayData) -> Result<DeviceArray, BackendError> {
        let kind = kind(data.data_type())?;
        let len = data.len();
        let validity = data
            .nulls()
            .map(|nulls| self.region(nulls.buffer(), len.div_ceil(8)));
        let mut buffers = Vec::new();
        let mut children = Vec::new();
        let mut dictionary = None;
        match kind {
            Kind::Null => {}
            Kind::Fixed(width) => buffers.push(self.region(&data.buffers()[0], len * width)),
            Kind::Bits => buffers.push(self.region(&data.buffers()[0], len.div_ceil(8))),
            Kind::VarLen(width) => {
                buffers.push(self.region(&data.buffers()[0], (len + 1) * width));
                let end = last_offset(&data.buffers()[0], len, width);
                buffers.push(self.region(&data.buffers()[1], end));
            }
            Kind::List(width) => {
                buffers.push(self.region(&data.buffers()[0], (len + 1) * width));
                children.push(self.place_compact(&data.child_data()[0])?);
            }
            Kind::FixedList(_) | Kind::Struct => {
                for child in data.child_data() {
                    children.push(self.place_compact(child)?);
                }
            }
            Kind::Dictionary(width) => {
                buffers.push(self.region(&data.buffers()[0], len * width));
                let values = &data.child_data()[0];
                children.push(self.place_compact(values)?);
                dictionary = Some(owned_copy(values)?);
            }
        }
        Ok(DeviceArray {
            data_type: data.data_type().clone(),
            kind,
            len,
            null_count: data.null_count(),
            validity,
            buffers,
            children,
            dictionary,
        })
    }
}

/// How `array` is published by `ipc-export`: its buffers in Arrow's order, by role.
pub(super) fn exported(array: &DeviceArray) -> ExportedArray {
    let buffer = |kind, region: Region| ExportedBuffer {
        kind,
        offset: region.offset as u64,
        length: region.len as u64,
    };
    let mut buffers: Vec<ExportedBuffer> = array
        .validity
        .map(|v| buffer(BufferKind::Validity, v))
        .into_iter()
        .collect();
    let mut children: Vec<ExportedArray> = array.children.iter().map(exported).collect();
    let mut dictionary = None;
    match array.kind {
        Kind::Null | Kind::FixedList(_) | Kind::Struct => {}
        Kind::Fixed(_) | Kind::Bits => buffers.push(buffer(BufferKind::Values, array.buffers[0])),
        Kind::VarLen(_) => buffers.extend([
            buffer(BufferKind::Offsets, array.buffers[0]),
            buffer(BufferKind::Values, array.buffers[1]),
        ]),
        Kind::List(_) => buffers.push(buffer(BufferKind::Offsets, array.buffers[0])),
        Kind::Dictionary(_) => {
            buffers.push(buffer(BufferKind::Values, array.buffers[0]));
            dictionary = children.pop().map(Box::new);
        }
    }
    ExportedArray {
        data_type: array.data_type.clone(),
        length: array.len as u64,
        null_count: array.null_count as u64,
        buffers,
        children,
        dictionary,
    }
}

/// `used` bytes rounded up to the allocation granularity (at least one granule).
pub(super) fn allocation_bytes(used: usize) -> usize {
    used.max(1).div_ceil(ALLOCATION_GRANULARITY) * ALLOCATION_GRANULARITY
}

/// A copy of `data` in buffers of its own, so that keeping it does not keep alive the message
/// it was decoded from.
fn owned_copy(data: &ArrayData) -> Result<ArrayRef, BackendError> {
    crate::backend::owned::owned(data)
        .map(make_array)
        .map_err(|e| BackendError::Device(format!("copying a dictionary: {e}")))
}

/// The array itself if it is compact, else a fresh copy that is.
fn compact(data: ArrayData) -> Result<ArrayData, BackendError> {
    if is_compact(&data) {
        return Ok(data);
    }
    let len = data.len();
    let mut copy = MutableArrayData::new(vec![&data], false, len);
    copy.try_extend(0, 0, len)
        .map_err(|e| BackendError::Device(format!("compacting a sliced array: {e}")))?;
    Ok(copy.freeze())
}

/// Starts at row 0 everywhere; offsets start at 0; children hold exactly the rows referenced.
fn is_compact(data: &ArrayData) -> bool {
    let len = data.len();
    let own = data.offset() == 0 && data.nulls().is_none_or(|n| n.offset() == 0);
    let layout = match kind(data.data_type()) {
        Ok(Kind::VarLen(width)) => offset_at(data.buffers()[0].as_slice(), 0, width) == 0,
        Ok(Kind::List(width)) => {
            let offsets = data.buffers()[0].as_slice();
            offset_at(offsets, 0, width) == 0
                && data.child_data()[0].len() == offset_at(offsets, len, width)
        }
        Ok(Kind::FixedList(size)) => data.child_data()[0].len() == len * size,
        Ok(Kind::Struct) => data.child_data().iter().all(|c| c.len() == len),
        _ => true,
    };
    own && layout && data.child_data().iter().all(is_compact)
}

/// `offsets[index]` of an offsets buffer of `width`-byte integers, as usize.
fn offset_at(bytes: &[u8], index: usize, width: usize) -> usize {
    let at = index * width;
    if width == 4 {
        let mut raw = [0; 4];
        raw.copy_from_slice(&bytes[at..at + 4]);
        i32::from_le_bytes(raw).max(0) as usize
    } else {
        let mut raw = [0; 8];
        raw.copy_from_slice(&bytes[at..at + 8]);
        i64::from_le_bytes(raw).max(0) as usize
    }
}

fn last_offset(offsets: &Buffer, len: usize, width: usize) -> usize {
    offset_at(offsets.as_slice(), len, width)
}

/// Subtracts `base` from `count` offsets in place.
fn rebase_offsets(bytes: &mut [u8], count: usize, width: usize, base: usize) {
    for index in 0..count {
        let at = index * width;
        if width == 4 {
            let value = offset_at(bytes, index, 4) - base;
            bytes[at..at + 4].copy_from_slice(&(value as i32).to_le_bytes());
        } else {
            let value = offset_at(bytes, index, 8) - base;
            bytes[at..at + 8].copy_from_slice(&(value as i64).to_le_bytes());
        }
    }
}

/// Fills the staging buffer with the plan's host bytes, laid out as on the device.
pub(super) fn fill_staging(plan: &UploadPlan, staging: &mut PinnedLease) {
    let target = staging.buffer_mut().as_mut_slice();
    for (region, source) in &plan.sources {
        target[region.offset..region.offset + region.len].copy_from_slice(source.as_slice());
    }
}

/// A range of one round's pinned buffer.
#[derive(Debug, Clone, Copy)]
struct Slot {
    round: usize,
    start: usize,
    len: usize,
}

/// One array of the result, assembled once every round is done.
#[derive(Debug)]
struct OutArray {
    data_type: DataType,
    len: usize,
    offset: usize,
    nulls: Option<(Slot, usize)>,
    buffers: Vec<Option<Slot>>,
    children: Vec<usize>,
}

/// A device array and the allocation it lives in.
#[derive(Debug, Clone, Copy)]
pub(super) struct Stored<'a> {
    pub(super) allocation: &'a DeviceAllocation,
    pub(super) array: &'a DeviceArray,
}

impl<'a> Stored<'a> {
    fn child(self, index: usize) -> Self {
        Self {
            allocation: self.allocation,
            array: &self.array.children[index],
        }
    }
}

/// Work for a round: an array's rows, or bytes whose range an earlier round revealed.
enum Work<'a> {
    Rows {
        stored: Stored<'a>,
        rows: Range<usize>,
        out: usize,
    },
    Bytes {
        allocation: &'a DeviceAllocation,
        region: Region,
        out: usize,
        buffer: usize,
    },
}

/// What to do once a round's copies have landed.
enum AfterRound<'a> {
    /// Rebase offsets; then copy the strings they address.
    Strings {
        offsets: Slot,
        len: usize,
        width: usize,
        values: Region,
        allocation: &'a DeviceAllocation,
        out: usize,
    },
    /// Rebase offsets; then read the child rows they address.
    ListChild {
        offsets: Slot,
        len: usize,
        width: usize,
        child: Stored<'a>,
        out: usize,
    },
}

/// Copies rows `rows` of a partition's columns back into a host record batch. Returns the
/// batch and the number of stream synchronizations it took.
pub(super) fn read_rows(
    columns: &[Stored<'_>],
    schema: &SchemaRef,
    rows: Range<usize>,
    stream: &mut Stream,
    pool: &Arc<PinnedPool>,
) -> Result<(RecordBatch, u64), BackendError> {
    let mut outputs: Vec<OutArray> = Vec::new();
    let mut roots = Vec::with_capacity(columns.len());
    let mut work = Vec::with_capacity(columns.len());
    for column in columns {
        let out = new_out(&mut outputs, column.array);
        roots.push(out);
        work.push(Work::Rows {
            stored: *column,
            rows: rows.clone(),
            out,
        });
    }

    let mut leases: Vec<PinnedLease> = Vec::new();
    let mut syncs = 0;
    while !work.is_empty() {
        let round = leases.len();
        let mut copies: Vec<(&DeviceAllocation, Region, Slot)> = Vec::new();
        let mut after = Vec::new();
        let mut staged = 0usize;
        let mut stage = |allocation, region: Region| {
            let start = staged.next_multiple_of(ALIGNMENT);
            staged = start + region.len;
            let slot = Slot {
                round,
                start,
                len: region.len,
            };
            copies.push((allocation, region, slot));
            slot
        };
        while let Some(item) = work.pop() {
            match item {
                Work::Bytes {
                    allocation,
                    region,
                    out,
                    buffer,
                } => {
                    // String bytes start anywhere; copied from there into a 64-byte aligned
                    // slot, source and destination disagree in alignment and the copy engine
                    // runs at a fraction of its rate. Copy from the boundary before them (bytes
                    // of the same allocation, never handed out) so both agree.
                    let lead = region.offset % ALIGNMENT;
                    let widened = Region {
                        offset: region.offset - lead,
                        len: region.len + lead,
                    };
                    let slot = stage(allocation, widened);
                    outputs[out].buffers[buffer] = Some(Slot {
                        start: slot.start + lead,
                        len: region.len,
                        ..slot
                    });
                }
                Work::Rows { stored, rows, out } => {
                    schedule(
                        stored,
                        rows,
                        out,
                        &mut outputs,
                        &mut stage,
                        &mut work,
                        &mut after,
                    );
                }
            }
        }
        let mut lease = pool.lease(staged)?;
        if !copies.is_empty() {
            let mut rest = lease.buffer_mut().as_mut_slice();
            stream.copies(|batch| {
                let mut consumed = 0;
                for (allocation, region, slot) in &copies {
                    if slot.len == 0 {
                        continue;
                    }
                    let (_, tail) = std::mem::take(&mut rest).split_at_mut(slot.start - consumed);
                    let (target, tail) = tail.split_at_mut(slot.len);
                    batch.copy_to_host(target, allocation, region.offset)?;
                    rest = tail;
                    consumed = slot.start + slot.len;
                }
                Ok(())
            })?;
            syncs += 1;
        }
        let bytes = lease.buffer_mut().as_mut_slice();
        for step in after {
            match step {
                AfterRound::Strings {
                    offsets,
                    len,
                    width,
                    values,
                    allocation,
                    out,
                } => {
                    let (start, end) = rebase(bytes, offsets, len, width);
                    let region = Region {
                        offset: values.offset + start,
                        len: end - start,
                    };
                    work.push(Work::Bytes {
                        allocation,
                        region,
                        out,
                        buffer: 1,
                    });
                }
                AfterRound::ListChild {
                    offsets,
                    len,
                    width,
                    child,
                    out,
                } => {
                    let (start, end) = rebase(bytes, offsets, len, width);
                    let child_out = outputs[out].children[0];
                    work.push(Work::Rows {
                        stored: child,
                        rows: start..end,
                        out: child_out,
                    });
                }
            }
        }
        leases.push(lease);
    }

    let leases: Vec<Arc<PinnedLease>> = leases.into_iter().map(Arc::new).collect();
    let arrays: Vec<ArrayRef> = roots
        .iter()
        .map(|&root| build(&outputs, root, &leases).map(make_array))
        .collect::<Result<_, _>>()?;
    let options = RecordBatchOptions::new().with_row_count(Some(rows.len()));
    let batch =
        RecordBatch::try_new_with_options(Arc::clone(schema), arrays, &options).map_err(|e| {
            BackendError::Device(format!("rebuilding a batch read from the device: {e}"))
        })?;
    Ok((batch, syncs))
}

/// Reads the first and last of `len + 1` offsets in a slot and rebases them to start at 0.
fn rebase(bytes: &mut [u8], offsets: Slot, len: usize, width: usize) -> (usize, usize) {
    let slot = &mut bytes[offsets.start..offsets.start + offsets.len];
    let start = offset_at(slot, 0, width);
    let end = offset_at(slot, len, width);
    rebase_offsets(slot, len + 1, width, start);
    (start, end)
}

fn new_out(outputs: &mut Vec<OutArray>, array: &DeviceArray) -> usize {
    outputs.push(OutArray {
        data_type: array.data_type.clone(),
        len: 0,
        offset: 0,
        nulls: None,
        buffers: vec![None; array.buffers.len()],
        children: Vec::new(),
    });
    let index = outputs.len() - 1;
    let children: Vec<usize> = array.children.iter().map(|c| new_out(outputs, c)).collect();
    outputs[index].children = children;
    index
}

/// Queues the copies rows `rows` of an array need this round, and what must follow them.
fn schedule<'a>(
    stored: Stored<'a>,
    rows: Range<usize>,
    out: usize,
    outputs: &mut [OutArray],
    stage: &mut impl FnMut(&'a DeviceAllocation, Region) -> Slot,
    work: &mut Vec<Work<'a>>,
    after: &mut Vec<AfterRound<'a>>,
) {
    let array = stored.array;
    let allocation = stored.allocation;
    let (start, len) = (rows.start, rows.len());
    let bytes_of = |bits: Range<usize>| (bits.start / 8, bits.end.div_ceil(8));
    outputs[out].len = len;
    if let Some(validity) = array.validity
        && len > 0
    {
        let (first, end) = bytes_of(rows.clone());
        let slot = stage(
            allocation,
            Region {
                offset: validity.offset + first,
                len: end - first,
            },
        );
        outputs[out].nulls = Some((slot, start % 8));
    }
    match array.kind {
        Kind::Null => {}
        Kind::Fixed(width) => {
            let region = Region {
                offset: array.buffers[0].offset + start * width,
                len: len * width,
            };
            outputs[out].buffers[0] = Some(stage(allocation, region));
        }
        Kind::Bits => {
            let (first, end) = bytes_of(rows.clone());
            let region = Region {
                offset: array.buffers[0].offset + first,
                len: end - first,
            };
            outputs[out].buffers[0] = Some(stage(allocation, region));
            outputs[out].offset = start % 8;
        }
        Kind::VarLen(width) | Kind::List(width) => {
            let region = Region {
                offset: array.buffers[0].offset + start * width,
                len: (len + 1) * width,
            };
            let offsets = stage(allocation, region);
            outputs[out].buffers[0] = Some(offsets);
            after.push(match array.kind {
                Kind::VarLen(_) => AfterRound::Strings {
                    offsets,
                    len,
                    width,
                    values: array.buffers[1],
                    allocation,
                    out,
                },
                _ => AfterRound::ListChild {
                    offsets,
                    len,
                    width,
                    child: stored.child(0),
                    out,
                },
            });
        }
        Kind::FixedList(size) => {
            let child = outputs[out].children[0];
            work.push(Work::Rows {
                stored: stored.child(0),
                rows: start * size..(start + len) * size,
                out: child,
            });
        }
        Kind::Struct => {
            for index in 0..array.children.len() {
                let child_out = outputs[out].children[index];
                work.push(Work::Rows {
                    stored: stored.child(index),
                    rows: rows.clone(),
                    out: child_out,
                });
            }
        }
        Kind::Dictionary(width) => {
            let region = Region {
                offset: array.buffers[0].offset + start * width,
                len: len * width,
            };
            outputs[out].buffers[0] = Some(stage(allocation, region));
            let values = stored.child(0);
            let values_out = outputs[out].children[0];
            work.push(Work::Rows {
                stored: values,
                rows: 0..values.array.len,
                out: values_out,
            });
        }
    }
}

fn slot_buffer(leases: &[Arc<PinnedLease>], slot: Slot) -> Buffer {
    ffi::arrow_buffer(
        Arc::clone(&leases[slot.round]),
        slot.start..slot.start + slot.len,
    )
}

/// Assembles an output array from the pinned slots its rounds filled. Validated like any
/// client input: a device read must never hand the encoder an inconsistent array.
fn build(
    outputs: &[OutArray],
    index: usize,
    leases: &[Arc<PinnedLease>],
) -> Result<ArrayData, BackendError> {
    let out = &outputs[index];
    let buffers = out
        .buffers
        .iter()
        .map(|slot| {
            slot.map_or_else(
                || Buffer::from(Vec::<u8>::new()),
                |s| slot_buffer(leases, s),
            )
        })
        .collect();
    let children = out
        .children
        .iter()
        .map(|&child| build(outputs, child, leases))
        .collect::<Result<Vec<_>, _>>()?;
    let nulls = out.nulls.map(|(slot, bit)| {
        NullBuffer::new(BooleanBuffer::new(slot_buffer(leases, slot), bit, out.len))
    });
    let builder = ArrayDataBuilder::new(out.data_type.clone())
        .len(out.len)
        .offset(out.offset)
        .buffers(buffers)
        .child_data(children)
        .nulls(nulls);
    ffi::read_back_array(builder)
        .map_err(|e| BackendError::Device(format!("rebuilding an array read from the device: {e}")))
}
