//! Reading rows of a partition back from the device into pinned host memory.
//!
//! **Reading rows `s..e`** copies only what those rows need (see `layout` for where they lie),
//! into pinned memory, in rounds: the first round copies validity bytes, fixed-width values
//! and offsets; once the stream has synchronized, offsets give the byte ranges of string data
//! and the row ranges of list children, which the next round copies. Fixed-width tables take
//! one synchronization per chunk, flat strings two, and each further level of list nesting one
//! more. Bitmaps are copied from byte `s / 8` and addressed with a bit offset, so no bits are
//! shifted on the CPU; offsets are rebased to start at zero in pinned memory before Arrow sees
//! them. The arrays returned use the pinned buffers directly (of the pool, or of the pinned
//! host memory: `staging::ReadStaging`), which go back when the last of them is dropped.

use std::ops::Range;
use std::sync::Arc;

use arrow::array::{ArrayData, ArrayDataBuilder, ArrayRef, make_array};
use arrow::buffer::{BooleanBuffer, Buffer, NullBuffer};
use arrow::datatypes::{DataType, SchemaRef};
use arrow::record_batch::{RecordBatch, RecordBatchOptions};

use super::ffi::{self, DeviceAllocation, Stream};
use super::layout::{ALIGNMENT, DeviceArray, Kind, Region, offset_at, rebase_offsets};
use super::staging::{ReadBuffer, ReadStaging};
use crate::backend::BackendError;

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

/// Copies rows `rows` of a partition's columns (those chosen: `schema` describes them) back
/// into a host record batch. Returns the batch, the number of stream synchronizations it took
/// and the bytes copied from the device.
pub(super) fn read_rows(
    columns: &[Stored<'_>],
    schema: &SchemaRef,
    rows: Range<usize>,
    stream: &mut Stream,
    staging: ReadStaging<'_>,
) -> Result<(RecordBatch, u64, u64), BackendError> {
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

    // Each round's pinned memory, and the bytes of it the round staged.
    let mut leases: Vec<(Option<ReadBuffer>, usize)> = Vec::new();
    let mut syncs = 0;
    let mut copied = 0u64;
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
        // A round whose slots are all empty (null columns, empty strings) leases nothing.
        let mut lease = match staged {
            0 => None,
            _ => Some(staging.lease(staged)?),
        };
        if let Some(lease) = lease.as_mut()
            && !copies.is_empty()
        {
            let mut rest = lease.as_mut_slice();
            stream.copies(|batch| {
                let mut consumed = 0;
                for (allocation, region, slot) in &copies {
                    if slot.len == 0 {
                        continue;
                    }
                    let (gap, tail) = std::mem::take(&mut rest).split_at_mut(slot.start - consumed);
                    // Alignment padding: nothing of a buffer used before shows through.
                    gap.fill(0);
                    let (target, tail) = tail.split_at_mut(slot.len);
                    batch.copy_to_host(target, allocation, region.offset)?;
                    rest = tail;
                    consumed = slot.start + slot.len;
                }
                // And after the last: empty slots there are aligned past it too.
                rest[..staged - consumed].fill(0);
                Ok(())
            })?;
            syncs += 1;
            copied += copies
                .iter()
                .map(|(_, region, _)| region.len as u64)
                .sum::<u64>();
        }
        let bytes: &mut [u8] = match lease.as_mut() {
            Some(lease) => lease.as_mut_slice(),
            None => &mut [],
        };
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
        leases.push((lease, staged));
    }

    let leases: Vec<Buffer> = leases
        .into_iter()
        .map(|(lease, staged)| match lease {
            Some(lease) => lease.into_buffer(staged),
            None => Buffer::from(Vec::<u8>::new()),
        })
        .collect();
    let arrays: Vec<ArrayRef> = roots
        .iter()
        .map(|&root| build(&outputs, root, &leases).map(make_array))
        .collect::<Result<_, _>>()?;
    let options = RecordBatchOptions::new().with_row_count(Some(rows.len()));
    let batch =
        RecordBatch::try_new_with_options(Arc::clone(schema), arrays, &options).map_err(|e| {
            BackendError::Device(format!("rebuilding a batch read from the device: {e}"))
        })?;
    Ok((batch, syncs, copied))
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

/// A slot as a buffer of its own (see `ffi::own_slice`), sharing its round's memory.
fn slot_buffer(rounds: &[Buffer], slot: Slot) -> Buffer {
    ffi::own_slice(&rounds[slot.round], slot.start..slot.start + slot.len)
}

/// Assembles an output array from the pinned slots its rounds filled, checked for structure
/// (see [`ffi::read_back_array`]).
fn build(outputs: &[OutArray], index: usize, leases: &[Buffer]) -> Result<ArrayData, BackendError> {
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
