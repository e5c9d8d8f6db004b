//! One-launch concatenation of many uploaded batches into compact columns
//! (`kernels/concat.cu`).
//!
//! [`plan_table`] lays out a whole table's concatenation on the host: every column's length,
//! where each of its buffers goes (the same 64-byte aligned, depth-first layout as an upload),
//! and one kernel task per fragment of every buffer. Everything the tasks need is known from
//! the fragments' layouts (fragment lengths, string byte lengths), so the whole table costs one
//! task-table copy and one launch, whatever the number of fragments.
//!
//! Dictionary columns are the exception that stays cheap: their dictionaries are merged on the
//! host (`backend::dictionary`, from the host copies uploads keep), the merged dictionary is
//! copied into the column's allocation with the task table, and the keys of every fragment
//! whose dictionary did not stay as it was are mapped on the device by `REMAP_KEYS` tasks.
//!
//! **Where columns go** ([`Arrangement`]): every column of the table, one after another at
//! 64-byte aligned offsets, in one allocation. A co-located consumer then opens one CUDA IPC
//! handle per partition (the driver's `cuIpcOpenMemHandle` costs about 0.1 ms each, more than
//! the rest of an export), a wide table of small columns costs one 2 MiB rounding, and the
//! allocation holds bytes of this one dataset only.
//!
//! Fragments must be compact, which uploads guarantee: offsets start at 0 and children hold
//! exactly the rows their parents reference.

use std::ops::Range;

use arrow::array::ArrayRef;
use arrow::buffer::Buffer;

use super::abi::{ConcatTask, TaskOwners};
use super::layout::{self, DeviceArray, Kind, Region, UploadPlan};
use crate::backend::{BackendError, dictionary};

/// A fragment: one uploaded array, the device address of the allocation it lies in, and that
/// allocation's index in the launch's list of sources.
#[derive(Debug, Clone, Copy)]
pub(super) struct Fragment<'a> {
    pub(super) base: u64,
    pub(super) source: u32,
    pub(super) array: &'a DeviceArray,
}

/// A table's concatenation, before its output allocations exist: columns laid out from offset
/// 0 of their own space, tasks writing to offsets from there.
#[derive(Debug, Default)]
pub(super) struct TablePlan {
    /// Each column's layout, and the bytes its buffers span.
    pub(super) columns: Vec<(DeviceArray, usize)>,
    /// All tasks; `dst` is relative to the start of its column until [`TablePlan::place`].
    pub(super) tasks: Vec<ConcatTask>,
    /// Each task's allocations; destinations are set by [`TablePlan::place`].
    pub(super) owners: Vec<TaskOwners>,
    /// Which tasks fill each column.
    task_ranges: Vec<Range<usize>>,
    /// The key maps `REMAP_KEYS` tasks index.
    pub(super) maps: Vec<u64>,
    /// Host bytes (merged dictionaries) to copy into each column's space, by column.
    pub(super) host_copies: Vec<(usize, Region, Buffer)>,
    /// Where each bitmap the kernel writes ends, by column: the bytes after it, to the end
    /// of its last 32-bit word, are its last task's to clear (`ZERO_TAIL`), not a gap's.
    bitmap_ends: Vec<(usize, usize)>,
}

/// Plans the concatenation of `fragments`: for each partition, its columns as fragments.
pub(super) fn plan_table(partitions: &[Vec<Fragment<'_>>]) -> Result<TablePlan, BackendError> {
    let first = partitions
        .first()
        .ok_or_else(|| BackendError::Device("nothing to concatenate".to_owned()))?;
    let mut plan = TablePlan::default();
    // A task per fragment of each buffer (values and validity, for most columns), and room
    // for the tasks that zero the gaps between buffers (`TablePlan::zero_gaps`).
    let tasks = partitions
        .len()
        .saturating_mul(first.len())
        .saturating_mul(2)
        .saturating_add(first.len().saturating_mul(4) + 1);
    plan.tasks.reserve(tasks);
    plan.owners.reserve(tasks);
    for column in 0..first.len() {
        let fragments: Vec<Fragment<'_>> = partitions.iter().map(|p| p[column]).collect();
        let start = plan.tasks.len();
        let mut space = ColumnSpace {
            column,
            used: 0,
            plan: &mut plan,
        };
        let array = space.plan_array(&fragments)?;
        let used = space.used;
        plan.columns.push((array, used));
        plan.task_ranges.push(start..plan.tasks.len());
    }
    Ok(plan)
}

impl TablePlan {
    /// Moves column `column` to `by` bytes into allocation `destination` (the launch's
    /// destination index) at device address `base`: its layout, its tasks' destinations and
    /// its host copies.
    pub(super) fn place(&mut self, column: usize, destination: u32, base: u64, by: usize) {
        self.columns[column].0.shift(by);
        let range = self.task_ranges[column].clone();
        for task in &mut self.tasks[range.clone()] {
            task.dst += base + by as u64;
        }
        for owners in &mut self.owners[range] {
            owners.destination = destination;
        }
        for (owner, region, _) in &mut self.host_copies {
            if *owner == column {
                region.offset += by;
            }
        }
        for (owner, end) in &mut self.bitmap_ends {
            if *owner == column {
                *end += by;
            }
        }
    }

    /// Queues tasks that zero every byte of allocation `destination` (at device address
    /// `base`, `bytes` long) that no column placed there covers: the alignment gaps between
    /// buffers and the allocation's rounding, which would otherwise keep whatever the memory
    /// held before (another dataset's bytes, for an `ipc-export` consumer who maps the whole
    /// allocation). Call it once every column is placed; `placed` says which are there.
    pub(super) fn zero_gaps(
        &mut self,
        destination: u32,
        base: u64,
        bytes: usize,
        placed: impl Fn(usize) -> bool,
    ) {
        let mut regions = Vec::new();
        let mut bitmap_ends = Vec::new();
        for (column, (array, _)) in self.columns.iter().enumerate() {
            if placed(column) {
                array.collect_regions(&mut regions);
            }
        }
        for &(column, end) in &self.bitmap_ends {
            if placed(column) {
                bitmap_ends.push(end);
            }
        }
        bitmap_ends.sort_unstable();
        for gap in layout::gaps(&mut regions, bytes) {
            // Gaps end where a buffer starts (64-byte aligned) or at the allocation's end,
            // so rounding a start up never passes its end.
            let start = if bitmap_ends.binary_search(&gap.offset).is_ok() {
                gap.offset.next_multiple_of(4)
            } else {
                gap.offset
            };
            let end = gap.offset + gap.len;
            if start < end {
                self.tasks.push(ConcatTask::new(
                    ConcatTask::ZERO_BYTES,
                    0,
                    base + start as u64,
                    (end - start) as u64,
                ));
                self.owners.push(TaskOwners {
                    source: 0,
                    destination,
                });
            }
        }
    }
}

/// Where each column of a table goes: one allocation, and each column's offset there.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Arrangement {
    /// Bytes of each allocation (rounded to the allocation granularity): one, or none for a
    /// table without columns.
    pub(super) allocations: Vec<usize>,
    /// For each column: its allocation and its offset there.
    pub(super) columns: Vec<(usize, usize)>,
}

impl Arrangement {
    /// Arranges columns spanning `column_bytes` (see the module docs for the rule).
    pub(super) fn new(column_bytes: &[usize]) -> Self {
        let mut end = 0_usize;
        let columns: Vec<(usize, usize)> = column_bytes
            .iter()
            .map(|&used| {
                let offset = end.next_multiple_of(layout::ALIGNMENT);
                end = offset + used;
                (0, offset)
            })
            .collect();
        let allocations = if columns.is_empty() {
            Vec::new()
        } else {
            vec![layout::allocation_bytes(end)]
        };
        Self {
            allocations,
            columns,
        }
    }

    pub(super) fn total_bytes(&self) -> u64 {
        self.allocations.iter().map(|&b| b as u64).sum()
    }
}

/// One column's space while it is planned.
struct ColumnSpace<'p> {
    column: usize,
    used: usize,
    plan: &'p mut TablePlan,
}

impl ColumnSpace<'_> {
    fn region(&mut self, bytes: usize) -> Region {
        let offset = self.used.next_multiple_of(layout::ALIGNMENT);
        self.used = offset + bytes;
        Region { offset, len: bytes }
    }

    /// Queues `task`, which reads from `fragment`'s allocation.
    fn task(&mut self, task: ConcatTask, fragment: &Fragment<'_>) {
        self.plan.tasks.push(task);
        self.plan.owners.push(TaskOwners {
            source: fragment.source,
            destination: 0,
        });
    }

    /// Lays out the concatenation of `fragments` (all of one type) and queues its tasks.
    fn plan_array(&mut self, fragments: &[Fragment<'_>]) -> Result<DeviceArray, BackendError> {
        let first = fragments
            .first()
            .ok_or_else(|| BackendError::Device("nothing to concatenate".to_owned()))?
            .array;
        let len: usize = fragments.iter().map(|f| f.array.len).sum();
        let null_count = fragments.iter().map(|f| f.array.null_count).sum();
        let validity = fragments
            .iter()
            .any(|f| f.array.validity.is_some())
            .then(|| self.region(len.div_ceil(8)));
        if let Some(validity) = validity {
            self.bit_tasks(fragments, validity, |array| array.validity);
        }
        let mut buffers = Vec::new();
        let mut children = Vec::new();
        let mut dictionary = None;
        match first.kind {
            Kind::Null => {}
            Kind::Fixed(width) => {
                let values = self.region(len * width);
                self.byte_tasks(fragments, values, width);
                buffers.push(values);
            }
            Kind::Bits => {
                let values = self.region(len.div_ceil(8));
                self.bit_tasks(fragments, values, |array| array.buffers.first().copied());
                buffers.push(values);
            }
            Kind::VarLen(width) => {
                let offsets = self.region((len + 1) * width);
                let bytes = fragments.iter().map(|f| f.array.buffers[1].len).sum();
                let values = self.region(bytes);
                self.offset_tasks(fragments, offsets, width, |f| f.array.buffers[1].len);
                let mut at = 0;
                for fragment in fragments {
                    let source = fragment.array.buffers[1];
                    self.task(
                        ConcatTask::new(
                            ConcatTask::COPY_BYTES,
                            fragment.base + source.offset as u64,
                            (values.offset + at) as u64,
                            source.len as u64,
                        ),
                        fragment,
                    );
                    at += source.len;
                }
                buffers.extend([offsets, values]);
            }
            Kind::List(width) => {
                let offsets = self.region((len + 1) * width);
                self.offset_tasks(fragments, offsets, width, |f| f.array.children[0].len);
                buffers.push(offsets);
                children.push(self.plan_array(&children_of(fragments, 0))?);
            }
            Kind::FixedList(_) | Kind::Struct => {
                for index in 0..first.children.len() {
                    children.push(self.plan_array(&children_of(fragments, index))?);
                }
            }
            Kind::Dictionary(width) => {
                let keys = self.region(len * width);
                buffers.push(keys);
                let (values, merged) = self.plan_dictionary(fragments, keys, width)?;
                children.push(values);
                dictionary = Some(merged);
            }
        }
        Ok(DeviceArray {
            data_type: first.data_type.clone(),
            kind: first.kind,
            len,
            null_count,
            validity,
            buffers,
            children,
            dictionary,
        })
    }

    /// Copies each fragment's `width`-byte values into `out`, one after another.
    fn byte_tasks(&mut self, fragments: &[Fragment<'_>], out: Region, width: usize) {
        let mut row = 0;
        for fragment in fragments {
            let source = fragment.array.buffers[0];
            let bytes = fragment.array.len * width;
            self.task(
                ConcatTask::new(
                    ConcatTask::COPY_BYTES,
                    fragment.base + source.offset as u64,
                    (out.offset + row * width) as u64,
                    bytes as u64,
                ),
                fragment,
            );
            row += fragment.array.len;
        }
    }

    /// Copies each fragment's bitmap (where `bitmap` finds one; all ones where it does not)
    /// into `out` from the fragment's first row on.
    fn bit_tasks(
        &mut self,
        fragments: &[Fragment<'_>],
        out: Region,
        bitmap: impl Fn(&DeviceArray) -> Option<Region>,
    ) {
        let mut row = 0u64;
        let first = self.plan.tasks.len();
        for fragment in fragments {
            let rows = fragment.array.len as u64;
            let mut task = ConcatTask::new(
                ConcatTask::COPY_BITS,
                bitmap(fragment.array).map_or(0, |r| fragment.base + r.offset as u64),
                out.offset as u64,
                rows,
            );
            task.dst_bit = row;
            self.task(task, fragment);
            row += rows;
        }
        if let Some(last) = self.plan.tasks[first..].iter_mut().rfind(|t| t.count > 0) {
            last.flags |= ConcatTask::ZERO_TAIL;
        }
        self.plan
            .bitmap_ends
            .push((self.column, out.offset + out.len));
    }

    /// Rebases each fragment's offsets by the running total of what the fragments before it
    /// address (`extent` of each: string bytes or child rows).
    fn offset_tasks(
        &mut self,
        fragments: &[Fragment<'_>],
        out: Region,
        width: usize,
        extent: impl Fn(&Fragment<'_>) -> usize,
    ) {
        let kind = if width == 4 {
            ConcatTask::REBASE_OFFSETS_32
        } else {
            ConcatTask::REBASE_OFFSETS_64
        };
        let (mut row, mut total) = (0, 0);
        let last = fragments.len().saturating_sub(1);
        for (index, fragment) in fragments.iter().enumerate() {
            let rows = fragment.array.len;
            // Each fragment writes its rows' offsets; the last also writes the final one.
            let count = rows + usize::from(index == last);
            let mut task = ConcatTask::new(
                kind,
                fragment.base + fragment.array.buffers[0].offset as u64,
                (out.offset + row * width) as u64,
                count as u64,
            );
            task.base = i64::try_from(total).unwrap_or(i64::MAX);
            self.task(task, fragment);
            row += rows;
            total += extent(fragment);
        }
    }

    /// Merges the fragments' dictionaries, places the merged one after the keys (copied from
    /// the host) and queues each fragment's keys: copied where its dictionary is unchanged,
    /// mapped otherwise.
    fn plan_dictionary(
        &mut self,
        fragments: &[Fragment<'_>],
        keys: Region,
        width: usize,
    ) -> Result<(DeviceArray, ArrayRef), BackendError> {
        let dictionaries = fragments
            .iter()
            .map(|f| {
                f.array.dictionary.clone().ok_or_else(|| {
                    BackendError::Device("a dictionary fragment without its host copy".to_owned())
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let key_type = match &fragments[0].array.data_type {
            arrow::datatypes::DataType::Dictionary(key, _) => key.as_ref().clone(),
            other => {
                return Err(BackendError::Device(format!("{other} is not a dictionary")));
            }
        };
        let merged = dictionary::merge(&dictionaries, &key_type)?;
        let remap = match width {
            1 => ConcatTask::REMAP_KEYS_8,
            2 => ConcatTask::REMAP_KEYS_8 + 1,
            4 => ConcatTask::REMAP_KEYS_8 + 2,
            8 => ConcatTask::REMAP_KEYS_64,
            other => {
                return Err(BackendError::Device(format!(
                    "{other}-byte dictionary keys"
                )));
            }
        };
        let mut row = 0;
        for (index, fragment) in fragments.iter().enumerate() {
            let source = fragment.array.buffers[0];
            let rows = fragment.array.len;
            let src = fragment.base + source.offset as u64;
            let dst = (keys.offset + row * width) as u64;
            if merged.keeps_keys(index) {
                self.task(
                    ConcatTask::new(ConcatTask::COPY_BYTES, src, dst, (rows * width) as u64),
                    fragment,
                );
            } else {
                let map = &merged.key_maps[index];
                let mut task = ConcatTask::new(remap, src, dst, rows as u64);
                task.map = self.plan.maps.len() as u64;
                task.map_len = map.len() as u64;
                self.plan.maps.extend_from_slice(map);
                self.task(task, fragment);
            }
            row += rows;
        }
        let mut placement = UploadPlan::starting_at(self.used);
        let values = placement.place(&merged.values.to_data())?;
        self.used = placement.used_bytes;
        let column = self.column;
        self.plan.host_copies.extend(
            placement
                .sources
                .into_iter()
                .map(|(region, bytes)| (column, region, bytes)),
        );
        Ok((values, merged.values))
    }
}

/// Child `index` of every fragment, in the fragments' allocations.
fn children_of<'a>(fragments: &[Fragment<'a>], index: usize) -> Vec<Fragment<'a>> {
    fragments
        .iter()
        .map(|f| Fragment {
            array: &f.array.children[index],
            ..*f
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{BooleanArray, Int8Array, Int64Array, StringArray};
    use arrow::record_batch::RecordBatch;

    use super::*;

    const MIB: usize = 1 << 20;

    /// The table's whole plan for `batches`, each uploaded at address `(index + 1) << 32`,
    /// placed by its arrangement into one allocation at `1 << 40`.
    fn planned(batches: &[RecordBatch]) -> (TablePlan, usize) {
        let layouts: Vec<UploadPlan> = batches
            .iter()
            .map(|b| UploadPlan::new(b).expect("layout"))
            .collect();
        let partitions: Vec<Vec<Fragment<'_>>> = layouts
            .iter()
            .enumerate()
            .map(|(index, layout)| {
                layout
                    .columns
                    .iter()
                    .map(|array| Fragment {
                        base: (index as u64 + 1) << 32,
                        source: index as u32,
                        array,
                    })
                    .collect()
            })
            .collect();
        let mut plan = plan_table(&partitions).expect("plan");
        let used: Vec<usize> = plan.columns.iter().map(|(_, used)| *used).collect();
        let arrangement = Arrangement::new(&used);
        for (column, &(_, offset)) in arrangement.columns.iter().enumerate() {
            plan.place(column, 0, 1 << 40, offset);
        }
        let bytes = arrangement.allocations[0];
        plan.zero_gaps(0, 1 << 40, bytes, |_| true);
        (plan, bytes)
    }

    #[test]
    fn every_byte_of_the_output_is_written_once_by_exactly_one_task() {
        let batch = |rows: usize, seed: usize| {
            let ints =
                Int64Array::from_iter((0..rows).map(|i| (i % 3 != seed).then_some(i as i64)));
            let words =
                StringArray::from_iter_values((0..rows).map(|i| "w".repeat((i + seed) % 7)));
            let flags = BooleanArray::from_iter((0..rows).map(|i| Some(i % 5 == seed)));
            RecordBatch::try_from_iter([
                ("n", Arc::new(ints) as ArrayRef),
                ("s", Arc::new(words) as ArrayRef),
                ("b", Arc::new(flags) as ArrayRef),
            ])
            .expect("batch")
        };
        // 1001 + 1038 + 77 rows: bitmaps of 265 bytes, which end 1 byte into a 32-bit word.
        let (plan, bytes) = planned(&[batch(1001, 0), batch(1038, 1), batch(77, 2)]);
        let tails = plan
            .tasks
            .iter()
            .filter(|t| t.flags & ConcatTask::ZERO_TAIL != 0)
            .count();
        assert_eq!(
            tails, 2,
            "one tail per bitmap: the ints' validity and the booleans"
        );
        assert!(
            plan.tasks.iter().any(|t| t.kind == ConcatTask::ZERO_BYTES),
            "gaps and rounding are zeroed"
        );
        assert_each_byte_written_once(&plan, bytes);
    }

    /// Counts, for each byte of the output, the tasks (and host copies) that write it, as the
    /// kernel does: a bit task with rows writes the bytes from its first whole one to its last
    /// bit's, and with `ZERO_TAIL` to the end of that bit's 32-bit word. Also checks that no
    /// other task writes a byte of a 32-bit word a bit task updates (with atomics, which plain
    /// stores to the same word would race with).
    fn assert_each_byte_written_once(plan: &TablePlan, bytes: usize) {
        let base = 1_u64 << 40;
        let mut writes = vec![0_u8; bytes];
        let mut bit_words = vec![false; bytes.div_ceil(4)];
        let mut byte_writes = Vec::new();
        let mut mark = |from: u64, to: u64| {
            for at in from..to {
                writes[(at - base) as usize] += 1;
            }
        };
        for task in &plan.tasks {
            let bytes_written = match task.kind {
                ConcatTask::COPY_BITS if task.count > 0 => {
                    let end_bit = task.dst_bit + task.count;
                    let end = if task.flags & ConcatTask::ZERO_TAIL != 0 {
                        end_bit.div_ceil(32) * 4
                    } else {
                        end_bit.div_ceil(8)
                    };
                    // Bit tasks share boundary bytes; count each byte from the first bit on.
                    mark(task.dst + task.dst_bit.div_ceil(8), task.dst + end);
                    let words = (task.dst - base) / 4 + task.dst_bit / 32
                        ..=(task.dst - base) / 4 + (end_bit - 1) / 32;
                    words.for_each(|word| bit_words[word as usize] = true);
                    continue;
                }
                ConcatTask::COPY_BITS => continue,
                ConcatTask::COPY_BYTES | ConcatTask::ZERO_BYTES => task.count,
                ConcatTask::REBASE_OFFSETS_32 => task.count * 4,
                ConcatTask::REBASE_OFFSETS_64 => task.count * 8,
                _ => task.count * task.key_width().expect("a key remap"),
            };
            mark(task.dst, task.dst + bytes_written);
            byte_writes.push((task.dst - base)..(task.dst - base + bytes_written));
        }
        let shared: Vec<u64> = byte_writes
            .into_iter()
            .flatten()
            .filter(|&at| bit_words[(at / 4) as usize])
            .collect();
        assert!(
            shared.is_empty(),
            "bytes stored into words bit tasks update: {:?}",
            &shared[..shared.len().min(20)]
        );
        for (_, region, _) in &plan.host_copies {
            mark(
                base + region.offset as u64,
                base + (region.offset + region.len) as u64,
            );
        }
        let wrong: Vec<usize> = (0..bytes).filter(|&at| writes[at] != 1).collect();
        assert!(
            wrong.is_empty(),
            "bytes written other than once: {:?}",
            &wrong[..wrong.len().min(20)]
        );
    }

    #[test]
    fn tables_of_every_kind_of_column_are_written_once_whole() {
        use arrow::array::{
            DictionaryArray, Int16Array, Int32Array, LargeStringArray, ListArray, StructArray,
        };
        use arrow::datatypes::{DataType, Field, Int8Type, Int32Type};
        use rand::rngs::StdRng;
        use rand::{Rng, SeedableRng};

        let mut rng = StdRng::seed_from_u64(26);
        for _ in 0..60 {
            let partitions = rng.random_range(1..6);
            let batches: Vec<RecordBatch> = (0..partitions)
                .map(|_| {
                    let rows: usize = match rng.random_range(0..4) {
                        0 => rng.random_range(0..3),
                        1 => rng.random_range(0..70),
                        _ => rng.random_range(0..3000),
                    };
                    let null = |rng: &mut StdRng| rng.random_bool(0.2);
                    let ints: ArrayRef = Arc::new(Int64Array::from_iter(
                        (0..rows).map(|i| (!null(&mut rng)).then_some(i as i64)),
                    ));
                    let words: ArrayRef = Arc::new(StringArray::from_iter(
                        (0..rows).map(|i| (!null(&mut rng)).then(|| "w".repeat(i % 9))),
                    ));
                    let large: ArrayRef = Arc::new(LargeStringArray::from_iter_values(
                        (0..rows).map(|i| "x".repeat(i % 3)),
                    ));
                    let flags: ArrayRef = Arc::new(BooleanArray::from_iter(
                        (0..rows).map(|i| (!null(&mut rng)).then_some(i % 3 == 0)),
                    ));
                    let keys = Int8Array::from_iter(
                        (0..rows).map(|i| (!null(&mut rng)).then_some((i % 4) as i8)),
                    );
                    let shift = rng.random_range(0..8);
                    let values =
                        StringArray::from_iter_values((0..4).map(|v| format!("c{}", v + shift)));
                    let codes: ArrayRef = Arc::new(
                        DictionaryArray::<Int8Type>::try_new(keys, Arc::new(values))
                            .expect("dictionary"),
                    );
                    let wide_keys = Int32Array::from_iter_values((0..rows).map(|i| (i % 5) as i32));
                    let wide_values =
                        Int16Array::from_iter_values((0..5).map(|v| v + shift as i16));
                    let wide: ArrayRef = Arc::new(
                        DictionaryArray::<Int32Type>::try_new(wide_keys, Arc::new(wide_values))
                            .expect("dictionary"),
                    );
                    let lists: ArrayRef = Arc::new(
                        ListArray::from_iter_primitive::<Int32Type, _, _>((0..rows).map(|i| {
                            (!null(&mut rng))
                                .then(|| (0..i % 4).map(|v| Some(v as i32)).collect::<Vec<_>>())
                        })),
                    );
                    let pairs: ArrayRef = Arc::new(StructArray::from(vec![
                        (
                            Arc::new(Field::new("a", DataType::Int16, true)),
                            Arc::new(Int16Array::from_iter(
                                (0..rows).map(|i| (i % 7 != 0).then_some(i as i16)),
                            )) as ArrayRef,
                        ),
                        (
                            Arc::new(Field::new("b", DataType::Boolean, false)),
                            Arc::new(BooleanArray::from_iter((0..rows).map(|i| Some(i % 2 == 0))))
                                as ArrayRef,
                        ),
                    ]));
                    RecordBatch::try_from_iter([
                        ("ints", ints),
                        ("words", words),
                        ("large", large),
                        ("flags", flags),
                        ("codes", codes),
                        ("wide", wide),
                        ("lists", lists),
                        ("pairs", pairs),
                    ])
                    .expect("batch")
                })
                .collect();
            let (plan, bytes) = planned(&batches);
            assert_each_byte_written_once(&plan, bytes);
        }
    }

    #[test]
    fn every_column_lies_in_one_allocation_at_aligned_offsets() {
        let arrangement = Arrangement::new(&[30 * MIB, 1000, 3 * MIB, 0, 100, 20 * MIB - 1]);
        let after_strings = (30 * MIB + 1024) + 3 * MIB;
        assert_eq!(
            arrangement.columns,
            vec![
                (0, 0),
                (0, 30 * MIB),
                (0, 30 * MIB + 1024),
                (0, after_strings),
                (0, after_strings),
                (0, after_strings + 128),
            ]
        );
        // 53 MiB + 1152 bytes, rounded up to the 2 MiB granularity.
        assert_eq!(arrangement.allocations, vec![54 * MIB], "{arrangement:?}");
        assert_eq!(arrangement.total_bytes(), 54 * MIB as u64);
        assert_eq!(Arrangement::new(&[]).allocations, Vec::<usize>::new());
        assert_eq!(Arrangement::new(&[0]).allocations, vec![2 * MIB]);
    }
}
