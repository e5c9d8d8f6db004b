//! The concatenation kernel's ABI: everything `kernels/concat.cu` and the host must agree on.
//!
//! The task record the kernel reads ([`ConcatTask`], `struct Task` there) and its kinds, the
//! launch shape ([`BLOCK`], [`TILE`], [`grid`]) and the check that keeps every task inside the
//! allocations it names ([`check_task`]), which `ffi` runs before each launch. Here, not in
//! `concat` (which plans tasks) or `ffi` (which launches them), so that both depend on it and
//! not on each other. A test reads the kernel's source and checks that the two still agree.

use std::ops::Range;

use crate::backend::BackendError;

/// Threads per block: `BLOCK` in the kernel.
pub(super) const BLOCK: u32 = 256;
/// Work units each thread of a tile does: `UNITS_PER_THREAD` in the kernel.
pub(super) const UNITS_PER_THREAD: u64 = 8;
/// Units a block takes at a time: `TILE` in the kernel.
pub(super) const TILE: u64 = BLOCK as u64 * UNITS_PER_THREAD;
/// Most blocks launched; the kernel strides over tiles, so any grid covers any work.
const MAX_GRID: u64 = 1 << 16;

/// Blocks to launch for `total_units` units of work.
pub(super) fn grid(total_units: u64) -> u32 {
    // At most MAX_GRID, which fits in u32.
    total_units.div_ceil(TILE).clamp(1, MAX_GRID) as u32
}

/// One unit of kernel work description: `struct Task` in `kernels/concat.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ConcatTask {
    pub(super) kind: u32,
    /// `COPY_BITS`: [`ConcatTask::ZERO_TAIL`].
    pub(super) flags: u32,
    pub(super) src: u64,
    pub(super) dst: u64,
    pub(super) count: u64,
    pub(super) src_bit: u64,
    pub(super) dst_bit: u64,
    pub(super) base: i64,
    /// `REMAP_KEYS_*`: index of the fragment's key map in the table's maps, and its length.
    pub(super) map: u64,
    pub(super) map_len: u64,
}

impl ConcatTask {
    pub(super) const COPY_BYTES: u32 = 0;
    pub(super) const COPY_BITS: u32 = 1;
    pub(super) const REBASE_OFFSETS_32: u32 = 2;
    pub(super) const REBASE_OFFSETS_64: u32 = 3;
    /// `REMAP_KEYS_8 + k` maps keys of `1 << k` bytes.
    pub(super) const REMAP_KEYS_8: u32 = 4;
    pub(super) const REMAP_KEYS_64: u32 = 7;
    /// Zeroes `count` bytes from `dst` (`src` unused), as `COPY_BYTES` would copy them.
    pub(super) const ZERO_BYTES: u32 = 8;
    /// Flag of the `COPY_BITS` task that writes its bitmap's last bit: it also clears the bits
    /// after that one, to the end of their 32-bit word.
    pub(super) const ZERO_TAIL: u32 = 1;

    pub(super) fn new(kind: u32, src: u64, dst: u64, count: u64) -> Self {
        Self {
            kind,
            flags: 0,
            src,
            dst,
            count,
            src_bit: 0,
            dst_bit: 0,
            base: 0,
            map: 0,
            map_len: 0,
        }
    }

    /// Work units the kernel spends on this task (see the kernel's launch contract).
    /// `dst` must be the final device address: byte copies count 16-byte destination chunks.
    pub(super) fn units(&self) -> u64 {
        match self.kind {
            _ if self.count == 0 => 0,
            Self::COPY_BYTES | Self::ZERO_BYTES => {
                (self.dst + self.count - 1) / 16 - self.dst / 16 + 1
            }
            Self::COPY_BITS => (self.dst_bit + self.count - 1) / 32 - self.dst_bit / 32 + 1,
            Self::REBASE_OFFSETS_32 => self.count.div_ceil(4),
            Self::REBASE_OFFSETS_64 => self.count.div_ceil(2),
            // 16 bytes of keys per unit.
            _ => match self.key_width() {
                Some(width) => self.count.div_ceil(16 / width),
                None => self.count,
            },
        }
    }

    /// Key width in bytes of a `REMAP_KEYS_*` task.
    pub(super) fn key_width(&self) -> Option<u64> {
        (Self::REMAP_KEYS_8..=Self::REMAP_KEYS_64)
            .contains(&self.kind)
            .then(|| 1 << (self.kind - Self::REMAP_KEYS_8))
    }

    /// The task's bytes exactly as the kernel reads its `struct Task` (little-endian, no
    /// padding).
    pub(super) fn to_le_bytes(self) -> [u8; std::mem::size_of::<Self>()] {
        let mut bytes = [0; std::mem::size_of::<Self>()];
        let mut fields = bytes.chunks_exact_mut(8);
        let mut put = |value: [u8; 8]| {
            if let Some(field) = fields.next() {
                field.copy_from_slice(&value);
            }
        };
        let mut head = [0; 8];
        head[..4].copy_from_slice(&self.kind.to_le_bytes());
        head[4..].copy_from_slice(&self.flags.to_le_bytes());
        put(head);
        for field in [self.src, self.dst, self.count, self.src_bit, self.dst_bit] {
            put(field.to_le_bytes());
        }
        put(self.base.to_le_bytes());
        put(self.map.to_le_bytes());
        put(self.map_len.to_le_bytes());
        bytes
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

/// The allocations a task reads and writes: indices into the launch's sources and
/// destinations, so the launch checks each task's ranges against exactly one allocation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct TaskOwners {
    pub(super) source: u32,
    pub(super) destination: u32,
}

/// Checks that a task reads only from `source` (and its key map from the table's
/// `map_entries`) and writes only into `destination`, the address ranges of the allocations
/// the task names; a missing allocation fails the task.
pub(super) fn check_task(
    task: &ConcatTask,
    source: Option<Range<u64>>,
    destination: Option<Range<u64>>,
    map_entries: u64,
) -> Result<(), BackendError> {
    let inside = |allocation: &Option<Range<u64>>, address: u64, len: u64| {
        allocation.as_ref().is_some_and(|a| {
            address >= a.start && address.checked_add(len).is_some_and(|end| end <= a.end)
        })
    };
    let reads = |address: u64, len: u64| inside(&source, address, len);
    let writes = |address: u64, len: u64| inside(&destination, address, len);
    let bytes = |count: u64, width: u64| count.saturating_mul(width);
    let ok = match task.kind {
        // Misaligned sources are read as the aligned 16-byte blocks around them (whole tiles)
        // or the 32-bit words around them (single units).
        ConcatTask::COPY_BYTES => {
            let first = task.src & !15;
            let end = task
                .src
                .checked_add(task.count)
                .and_then(|end| end.checked_next_multiple_of(16));
            (task.count == 0 || end.is_some_and(|end| reads(first, end - first)))
                && writes(task.dst, task.count)
        }
        ConcatTask::ZERO_BYTES => writes(task.dst, task.count),
        ConcatTask::COPY_BITS => {
            let end_bit = task.dst_bit.saturating_add(task.count);
            let first_word = (task.dst_bit / 32) * 4;
            let words_end = end_bit.div_ceil(32) * 4;
            // Whole tiles read the source as aligned 32-bit words.
            let src_ok = task.src == 0 || {
                let first = (task.src_bit / 32) * 4;
                reads(
                    task.src + first,
                    task.src_bit.saturating_add(task.count).div_ceil(32) * 4 - first,
                )
            };
            src_ok && writes(task.dst + first_word, words_end - first_word)
        }
        ConcatTask::REBASE_OFFSETS_32 | ConcatTask::REBASE_OFFSETS_64 => {
            let width = if task.kind == ConcatTask::REBASE_OFFSETS_32 {
                4
            } else {
                8
            };
            reads(task.src, bytes(task.count.max(1), width))
                && writes(task.dst, bytes(task.count, width))
        }
        _ => match task.key_width() {
            Some(width) => {
                reads(task.src, bytes(task.count, width))
                    && writes(task.dst, bytes(task.count, width))
                    && task
                        .map
                        .checked_add(task.map_len)
                        .is_some_and(|end| end <= map_entries)
            }
            None => false,
        },
    };
    if ok {
        Ok(())
    } else {
        Err(BackendError::Device(format!(
            "concatenation task outside its buffers: {task:?}"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KERNEL: &str = include_str!("../../../kernels/concat.cu");

    /// The value of `name` in the kernel's source: an enumerator or a constexpr.
    fn kernel_constant(name: &str) -> u64 {
        KERNEL
            .lines()
            .map(str::trim)
            .find_map(|line| {
                let line = line.strip_prefix("constexpr u32 ").unwrap_or(line);
                let value = line.strip_prefix(name)?.trim_start().strip_prefix('=')?;
                value
                    .trim()
                    .trim_end_matches([',', ';'])
                    .trim()
                    .parse()
                    .ok()
            })
            .unwrap_or_else(|| panic!("{name} not found in kernels/concat.cu"))
    }

    #[test]
    fn kinds_and_launch_shape_match_the_kernel() {
        let kinds = [
            ("COPY_BYTES", ConcatTask::COPY_BYTES),
            ("COPY_BITS", ConcatTask::COPY_BITS),
            ("REBASE_OFFS32", ConcatTask::REBASE_OFFSETS_32),
            ("REBASE_OFFS64", ConcatTask::REBASE_OFFSETS_64),
            ("REMAP_KEYS8", ConcatTask::REMAP_KEYS_8),
            ("REMAP_KEYS16", ConcatTask::REMAP_KEYS_8 + 1),
            ("REMAP_KEYS32", ConcatTask::REMAP_KEYS_8 + 2),
            ("REMAP_KEYS64", ConcatTask::REMAP_KEYS_64),
            ("ZERO_BYTES", ConcatTask::ZERO_BYTES),
            ("ZERO_TAIL", ConcatTask::ZERO_TAIL),
        ];
        for (name, value) in kinds {
            assert_eq!(kernel_constant(name), u64::from(value), "{name}");
        }
        assert_eq!(kernel_constant("BLOCK"), u64::from(BLOCK));
        assert_eq!(kernel_constant("UNITS_PER_THREAD"), UNITS_PER_THREAD);
    }

    #[test]
    fn the_task_record_matches_the_kernel() {
        let start = KERNEL.find("struct Task {").expect("struct Task");
        let end = start + KERNEL[start..].find("};").expect("end of struct Task");
        let fields: Vec<String> = KERNEL[start..end]
            .lines()
            .skip(1)
            .filter_map(|line| line.split(';').next())
            .map(|field| field.split_whitespace().collect::<Vec<_>>().join(" "))
            .filter(|field| !field.is_empty())
            .collect();
        let expected = [
            "u32 kind",
            "u32 flags",
            "u64 src",
            "u64 dst",
            "u64 count",
            "u64 src_bit",
            "u64 dst_bit",
            "i64 base",
            "u64 map",
            "u64 map_len",
        ];
        assert_eq!(fields, expected);
        assert_eq!(std::mem::size_of::<ConcatTask>(), 72);
    }

    #[test]
    fn grids_cover_the_work_within_the_limit() {
        assert_eq!(grid(1), 1);
        assert_eq!(grid(TILE), 1);
        assert_eq!(grid(TILE + 1), 2);
        assert_eq!(grid(u64::MAX), 1 << 16);
    }

    #[test]
    fn tasks_stay_inside_the_allocations_they_name() {
        let task = ConcatTask::new(ConcatTask::COPY_BYTES, 1008, 5000, 100);
        // The 16-byte blocks around 1008..1108.
        let source = Some(1008..1120);
        assert!(
            check_task(&task, Some(1008..1119), Some(5000..5100), 0).is_err(),
            "the last block reaches past the source"
        );
        assert!(check_task(&task, source.clone(), Some(5000..5100), 0).is_ok());
        assert!(check_task(&task, source.clone(), Some(5000..5099), 0).is_err());
        assert!(check_task(&task, source, None, 0).is_err());
        // 33 bits from bit 3 are read as the two 32-bit words that hold them.
        let mut bits = ConcatTask::new(ConcatTask::COPY_BITS, 1000, 5000, 33);
        bits.src_bit = 3;
        assert!(check_task(&bits, Some(1000..1008), Some(5000..5008), 0).is_ok());
        assert!(check_task(&bits, Some(1000..1007), Some(5000..5008), 0).is_err());
        let mut remap = ConcatTask::new(ConcatTask::REMAP_KEYS_8, 0, 64, 8);
        remap.map_len = 4;
        assert!(check_task(&remap, Some(0..8), Some(64..72), 4).is_ok());
        assert!(
            check_task(&remap, Some(0..8), Some(64..72), 3).is_err(),
            "map past the table"
        );
    }

    #[test]
    fn a_key_remap_unit_is_sixteen_bytes_of_keys() {
        let remap = |width_log2: u32, count| {
            ConcatTask::new(ConcatTask::REMAP_KEYS_8 + width_log2, 0, 0, count).units()
        };
        assert_eq!(remap(0, 17), 2, "16 one-byte keys a unit");
        assert_eq!(remap(1, 8), 1);
        assert_eq!(
            remap(2, 10),
            3,
            "4 four-byte keys a unit, the last one partial"
        );
        assert_eq!(remap(3, 3), 2);
        assert_eq!(remap(2, 0), 0);
    }

    #[test]
    fn tasks_serialize_as_the_kernel_reads_them() {
        let mut task = ConcatTask::new(ConcatTask::REMAP_KEYS_8 + 1, 1, 2, 3);
        task.map = 9;
        task.map_len = 10;
        task.base = -1;
        let bytes = task.to_le_bytes();
        assert_eq!(bytes.len(), 72);
        assert_eq!(&bytes[..4], &5u32.to_le_bytes());
        assert_eq!(&bytes[8..16], &1u64.to_le_bytes());
        assert_eq!(&bytes[48..56], &(-1i64).to_le_bytes());
        assert_eq!(&bytes[56..64], &9u64.to_le_bytes());
        assert_eq!(&bytes[64..72], &10u64.to_le_bytes());
        assert_eq!(task.key_width(), Some(2));
        assert_eq!(
            ConcatTask::new(ConcatTask::COPY_BYTES, 0, 0, 0).key_width(),
            None
        );
    }
}
