//! Which ranges of the pinned host memory are in use ([`Ranges`]): the bookkeeping behind
//! `ffi::PinnedArena`, kept apart from the memory so that it can be tested without a GPU.
//!
//! `DoPut` message bodies are copied into blocks of the arena and their arrays uploaded
//! straight from there; spills copy a partition's allocation whole into one block, straight
//! from the device (no staging copy, no fresh pages to fault in), and a restore uploads the
//! arrays of such a copy straight from it. Blocks are handed out best-fit by `range-alloc`,
//! which merges neighbours as they come back; this adds what the memory side needs: every
//! block starts at a 64-byte boundary (Arrow's alignment), a cap on what one kind of user may
//! hold (spills: half), and a lookup of the block a host range lies in, so an upload can tell
//! arrays that lie in pinned memory from those that do not.

use std::collections::BTreeMap;
use std::ops::Range;

use range_alloc::RangeAllocator;

/// Where every block starts, relative to the arena's base (which the driver page-aligns).
pub(super) const BLOCK_ALIGNMENT: usize = 64;

/// The blocks of an arena of `len` bytes: those in use, and room for more.
#[derive(Debug)]
pub(super) struct Ranges {
    free: RangeAllocator<usize>,
    /// The blocks in use, by their start: each block's length.
    live: BTreeMap<usize, usize>,
    used: usize,
}

impl Ranges {
    pub(super) fn new(len: usize) -> Self {
        Self {
            free: RangeAllocator::new(0..len),
            live: BTreeMap::new(),
            used: 0,
        }
    }

    /// A block of `len` bytes (rounded up to the alignment), or `None` where no free range
    /// holds one, `len` is 0, or the blocks in use would then hold more than `most` bytes.
    pub(super) fn take(&mut self, len: usize, most: usize) -> Option<Range<usize>> {
        let rounded = len.checked_next_multiple_of(BLOCK_ALIGNMENT)?;
        if rounded == 0 || self.used.checked_add(rounded)? > most {
            return None;
        }
        let range = self
            .free
            .allocate_range_aligned(rounded, BLOCK_ALIGNMENT)
            .ok()?;
        self.live.insert(range.start, range.len());
        self.used += range.len();
        Some(range)
    }

    /// Gives back a block [`take`](Self::take) handed out. A range that is not a live block
    /// is ignored (and reported): giving it to the allocator could hand out memory in use.
    pub(super) fn give_back(&mut self, range: Range<usize>) {
        if self.live.get(&range.start) != Some(&range.len()) {
            tracing::error!(
                ?range,
                "a pinned host memory block given back twice or never taken"
            );
            return;
        }
        self.live.remove(&range.start);
        self.used -= range.len();
        self.free.free_range(range);
    }

    /// The live block that `range` (relative to the arena's base) lies in, if any.
    pub(super) fn block_holding(&self, range: &Range<usize>) -> Option<Range<usize>> {
        let (&start, &len) = self.live.range(..=range.start).next_back()?;
        let block = start..start + len;
        (range.start >= block.start && range.end <= block.end && range.start <= range.end)
            .then_some(block)
    }

    pub(super) fn used(&self) -> usize {
        self.used
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: usize = usize::MAX;

    #[test]
    fn blocks_are_aligned_disjoint_and_come_back_whole() {
        let mut ranges = Ranges::new(1 << 20);
        let a = ranges.take(100, ALL).expect("room");
        let b = ranges.take(1, ALL).expect("room");
        let c = ranges.take(4096, ALL).expect("room");
        for block in [&a, &b, &c] {
            assert_eq!(block.start % BLOCK_ALIGNMENT, 0, "{block:?}");
            assert_eq!(block.len() % BLOCK_ALIGNMENT, 0, "{block:?}");
        }
        assert_eq!(a.len(), 128);
        assert!(a.end <= b.start || b.end <= a.start);
        assert!(b.end <= c.start || c.end <= b.start);
        assert_eq!(ranges.used(), 128 + 64 + 4096);
        ranges.give_back(b.clone());
        // Given back twice: ignored, nothing is handed out twice.
        ranges.give_back(b);
        assert_eq!(ranges.used(), 128 + 4096);
        ranges.give_back(a);
        ranges.give_back(c);
        assert_eq!(ranges.used(), 0);
        // The whole arena is one free range again.
        assert_eq!(ranges.take(1 << 20, ALL), Some(0..1 << 20));
    }

    #[test]
    fn a_block_that_would_pass_the_share_allowed_is_refused() {
        let mut ranges = Ranges::new(1 << 20);
        let half = 1 << 19;
        let a = ranges.take(half - 64, half).expect("within half");
        assert_eq!(ranges.take(128, half), None, "past half");
        assert!(ranges.take(64, half).is_some(), "exactly half");
        // Others may still take the rest.
        assert!(ranges.take(1 << 18, ALL).is_some());
        ranges.give_back(a);
        // 64 + 256 KiB in use: another 128 KiB keeps within half, 256 KiB would not.
        assert_eq!(ranges.take(1 << 18, half), None);
        assert!(ranges.take(1 << 17, half).is_some());
    }

    #[test]
    fn a_block_too_large_for_any_free_range_is_refused() {
        let mut ranges = Ranges::new(1024);
        assert_eq!(ranges.take(0, ALL), None);
        assert_eq!(ranges.take(1025, ALL), None);
        assert_eq!(ranges.take(usize::MAX, ALL), None);
        let a = ranges.take(512, ALL).expect("room");
        let _b = ranges.take(512, ALL).expect("room");
        ranges.give_back(a);
        assert_eq!(ranges.take(513, ALL), None, "512 bytes free");
        assert!(ranges.take(512, ALL).is_some());
    }

    #[test]
    fn a_range_is_found_in_the_block_it_lies_in_only() {
        let mut ranges = Ranges::new(1 << 16);
        let a = ranges.take(1000, ALL).expect("room");
        let b = ranges.take(1000, ALL).expect("room");
        assert_eq!(
            ranges.block_holding(&(a.start..a.start + 10)),
            Some(a.clone())
        );
        assert_eq!(ranges.block_holding(&(b.start + 5..b.end)), Some(b.clone()));
        assert_eq!(ranges.block_holding(&(b.end - 1..b.end)), Some(b.clone()));
        // Across two blocks, past the last one, or in free space: none.
        assert_eq!(ranges.block_holding(&(a.end - 1..b.start + 1)), None);
        assert_eq!(ranges.block_holding(&(b.end..b.end + 1)), None);
        ranges.give_back(a.clone());
        assert_eq!(ranges.block_holding(&(a.start..a.start + 10)), None);
    }
}
