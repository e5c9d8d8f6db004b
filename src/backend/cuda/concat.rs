//! One-launch concatenation of many uploaded batches into compact columns
//! (`kernels/concat.cu`).
//!
//! [`plan_column`] lays out one column's concatenation: the total length, where each buffer of
//! the result sits in the column's new allocation (the same 64-byte aligned layout as an
//! upload), and one kernel task per fragment of every buffer. Everything the tasks need is
//! known on the host from the fragments' layouts (fragment lengths, string byte lengths), so
//! the whole table costs one task-table copy and one launch, whatever the number of fragments.
//!
//! Fragments must be compact, which uploads guarantee: offsets start at 0 and children hold
//! exactly the rows their parents reference.

use super::layout::{DeviceArray, Kind, Region};
use crate::backend::BackendError;

/// One unit of kernel work description; must match `struct Task` in `kernels/concat.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ConcatTask {
    pub(super) kind: u32,
    pub(super) reserved: u32,
    pub(super) src: u64,
    pub(super) dst: u64,
    pub(super) count: u64,
    pub(super) src_bit: u64,
    pub(super) dst_bit: u64,
    pub(super) base: i64,
}

impl ConcatTask {
    pub(super) const COPY_BYTES: u32 = 0;
    pub(super) const COPY_BITS: u32 = 1;
    pub(super) const REBASE_OFFSETS_32: u32 = 2;
    pub(super) const REBASE_OFFSETS_64: u32 = 3;

    fn new(kind: u32, src: u64, dst: u64, count: u64) -> Self {
        Self {
            kind,
            reserved: 0,
            src,
            dst,
            count,
            src_bit: 0,
            dst_bit: 0,
            base: 0,
        }
    }

    /// Work units the kernel spends on this task (see the kernel's launch contract).
    pub(super) fn units(&self) -> u64 {
        match self.kind {
            Self::COPY_BYTES => self.count.div_ceil(16),
            Self::COPY_BITS if self.count == 0 => 0,
            Self::COPY_BITS => (self.dst_bit + self.count - 1) / 32 - self.dst_bit / 32 + 1,
            _ => self.count,
        }
    }
}

/// The exclusive scan of the tasks' work units, with the total as last entry.
pub(super) fn unit_starts(tasks: &[ConcatTask]) -> Vec<u64> {
    let mut starts = Vec::with_capacity(tasks.len() + 1);
    let mut total = 0;
    starts.push(0);
    for task in tasks {
        total += task.units();
        starts.push(total);
    }
    starts
}

/// A fragment: one uploaded array and the device address of its partition's allocation.
#[derive(Debug, Clone, Copy)]
pub(super) struct Fragment<'a> {
    pub(super) base: u64,
    pub(super) array: &'a DeviceArray,
}

/// Lays out the concatenation of `fragments` (all of one type) into a new allocation starting
/// at offset `*used`, and returns the result's layout. Tasks are made by [`column_tasks`] once
/// the allocation's address is known.
pub(super) fn plan_column(
    fragments: &[Fragment<'_>],
    used: &mut usize,
) -> Result<DeviceArray, BackendError> {
    let first = fragments
        .first()
        .ok_or_else(|| BackendError::Device("nothing to concatenate".to_owned()))?
        .array;
    let len: usize = fragments.iter().map(|f| f.array.len).sum();
    let mut region = |bytes: usize| {
        let offset = used.next_multiple_of(super::layout::ALIGNMENT);
        *used = offset + bytes;
        Region { offset, len: bytes }
    };
    let validity = fragments
        .iter()
        .any(|f| f.array.validity.is_some())
        .then(|| region(len.div_ceil(8)));
    let mut buffers = Vec::new();
    let mut children = Vec::new();
    match first.kind {
        Kind::Null => {}
        Kind::Fixed(width) => buffers.push(region(len * width)),
        Kind::Bits => buffers.push(region(len.div_ceil(8))),
        Kind::VarLen(width) => {
            buffers.push(region((len + 1) * width));
            let bytes = fragments.iter().map(|f| f.array.buffers[1].len).sum();
            buffers.push(region(bytes));
        }
        Kind::List(width) => {
            buffers.push(region((len + 1) * width));
            children.push(plan_children(fragments, 0, used)?);
        }
        Kind::FixedList(_) => children.push(plan_children(fragments, 0, used)?),
        Kind::Struct => {
            for index in 0..first.children.len() {
                children.push(plan_children(fragments, index, used)?);
            }
        }
        Kind::Dictionary(_) => {
            return Err(BackendError::UnsupportedType {
                backend: "cuda concatenation",
                data_type: first.data_type.to_string(),
            });
        }
    }
    Ok(DeviceArray::new(
        first.data_type.clone(),
        first.kind,
        len,
        validity,
        buffers,
        children,
    ))
}

fn plan_children(
    fragments: &[Fragment<'_>],
    index: usize,
    used: &mut usize,
) -> Result<DeviceArray, BackendError> {
    plan_column(&children_of(fragments, index), used)
}

/// Child `index` of every fragment, in the fragments' allocations.
fn children_of<'a>(fragments: &[Fragment<'a>], index: usize) -> Vec<Fragment<'a>> {
    fragments
        .iter()
        .map(|f| Fragment {
            base: f.base,
            array: &f.array.children[index],
        })
        .collect()
}

/// The kernel tasks that fill `out` (laid out by [`plan_column`] in the allocation at `out_base`)
/// from `fragments`.
pub(super) fn column_tasks(
    fragments: &[Fragment<'_>],
    out: &DeviceArray,
    out_base: u64,
    tasks: &mut Vec<ConcatTask>,
) {
    let address = |base: u64, region: Region| base + region.offset as u64;
    let mut row = 0u64;
    let mut bytes = 0u64;
    let last = fragments.len().saturating_sub(1);
    for (index, fragment) in fragments.iter().enumerate() {
        let array = fragment.array;
        let rows = array.len as u64;
        if let Some(validity) = out.validity {
            let mut task = ConcatTask::new(
                ConcatTask::COPY_BITS,
                array.validity.map_or(0, |v| address(fragment.base, v)),
                address(out_base, validity),
                rows,
            );
            task.dst_bit = row;
            tasks.push(task);
        }
        match out.kind {
            Kind::Null | Kind::Dictionary(_) | Kind::FixedList(_) | Kind::Struct => {}
            Kind::Fixed(width) => tasks.push(ConcatTask::new(
                ConcatTask::COPY_BYTES,
                address(fragment.base, array.buffers[0]),
                address(out_base, out.buffers[0]) + row * width as u64,
                rows * width as u64,
            )),
            Kind::Bits => {
                let mut task = ConcatTask::new(
                    ConcatTask::COPY_BITS,
                    address(fragment.base, array.buffers[0]),
                    address(out_base, out.buffers[0]),
                    rows,
                );
                task.dst_bit = row;
                tasks.push(task);
            }
            Kind::VarLen(width) | Kind::List(width) => {
                let kind = if width == 4 {
                    ConcatTask::REBASE_OFFSETS_32
                } else {
                    ConcatTask::REBASE_OFFSETS_64
                };
                // Each fragment writes its rows' offsets; the last also writes the final one.
                let count = rows + u64::from(index == last);
                let mut task = ConcatTask::new(
                    kind,
                    address(fragment.base, array.buffers[0]),
                    address(out_base, out.buffers[0]) + row * width as u64,
                    count,
                );
                task.base = i64::try_from(bytes).unwrap_or(i64::MAX);
                tasks.push(task);
                if out.kind == Kind::VarLen(width) {
                    let values = array.buffers[1];
                    tasks.push(ConcatTask::new(
                        ConcatTask::COPY_BYTES,
                        address(fragment.base, values),
                        address(out_base, out.buffers[1]) + bytes,
                        values.len as u64,
                    ));
                    bytes += values.len as u64;
                } else {
                    bytes += array.children[0].len as u64;
                }
            }
        }
        row += rows;
    }
    for (index, child) in out.children.iter().enumerate() {
        column_tasks(&children_of(fragments, index), child, out_base, tasks);
    }
}
