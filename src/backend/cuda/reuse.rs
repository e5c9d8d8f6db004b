//! Device memory kept for reuse instead of freed.
//!
//! `cuMemAlloc` maps fresh memory under the driver's lock, and `cuMemFree` waits for the whole
//! device to go idle: a put that uploads its batches into allocations of their own and then
//! joins them at commit (freeing them) pays both per batch, and on an H100 uploads spent more
//! time allocating than copying. Freed allocations sized in whole granules (2 MiB: how
//! partitions are allocated, see `layout`) are kept here by size, up to a limit, and handed to
//! the next allocation of that size.
//!
//! What is never kept: memory that was exported (`ipc-export`): a consumer that still maps it
//! would see whatever the next dataset writes there. Kept memory is not in any dataset's
//! budget, so an allocation the driver refuses empties the cache and is tried again.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use super::ffi::{Context, DeviceAllocation};
use super::layout::ALLOCATION_GRANULARITY;
use crate::backend::BackendError;

#[derive(Debug)]
pub(super) struct Reuse {
    free: Mutex<HashMap<usize, Vec<DeviceAllocation>>>,
    kept_bytes: AtomicU64,
    limit: AtomicU64,
    /// Allocations served from the cache, and those that went to the driver.
    pub(super) hits: AtomicU64,
    pub(super) misses: AtomicU64,
}

impl Reuse {
    pub(super) fn new(limit: u64) -> Self {
        Self {
            free: Mutex::default(),
            kept_bytes: AtomicU64::new(0),
            limit: AtomicU64::new(limit),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    pub(super) fn set_limit(&self, bytes: u64) {
        self.limit.store(bytes, Ordering::Release);
        if bytes == 0 {
            self.clear();
        }
    }

    fn free(&self) -> std::sync::MutexGuard<'_, HashMap<usize, Vec<DeviceAllocation>>> {
        self.free.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether allocations of `bytes` are kept: whole granules only (odd sizes, such as a
    /// concatenation's task table, are rarely asked for twice).
    fn kept_size(bytes: usize) -> bool {
        bytes >= ALLOCATION_GRANULARITY && bytes.is_multiple_of(ALLOCATION_GRANULARITY)
    }

    /// `bytes` of device memory in `context`: kept memory of that size where there is some,
    /// else new; where the driver has no room, whatever is kept is freed first.
    pub(super) fn allocate(
        &self,
        context: &std::sync::Arc<Context>,
        bytes: usize,
    ) -> Result<DeviceAllocation, BackendError> {
        if Self::kept_size(bytes) {
            let kept = self.free().get_mut(&bytes).and_then(Vec::pop);
            if let Some(allocation) = kept {
                self.kept_bytes.fetch_sub(bytes as u64, Ordering::AcqRel);
                self.hits.fetch_add(1, Ordering::Relaxed);
                return Ok(allocation);
            }
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        match DeviceAllocation::new(context, bytes) {
            // Always tried again: another thread may have just freed what was kept.
            Err(BackendError::OutOfMemory { .. }) => {
                self.clear();
                DeviceAllocation::new(context, bytes)
            }
            result => result,
        }
    }

    /// Takes `allocation` back for reuse, or frees it (exported, of an odd size, or past the
    /// limit).
    pub(super) fn give_back(&self, allocation: DeviceAllocation, exported: bool) {
        let class = allocation.bytes();
        if exported || !allocation.is_exportable() || !Self::kept_size(class) {
            return;
        }
        let limit = self.limit.load(Ordering::Acquire);
        let kept = self
            .kept_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |kept| {
                kept.checked_add(class as u64)
                    .filter(|&total| total <= limit)
            });
        if kept.is_ok() {
            self.free().entry(class).or_default().push(allocation);
        }
    }

    pub(super) fn kept_bytes(&self) -> u64 {
        self.kept_bytes.load(Ordering::Acquire)
    }

    /// Frees everything kept.
    pub(super) fn clear(&self) {
        let freed: Vec<DeviceAllocation> = self.free().drain().flat_map(|(_, v)| v).collect();
        let bytes: u64 = freed.iter().map(|a| a.bytes() as u64).sum();
        self.kept_bytes.fetch_sub(bytes, Ordering::AcqRel);
        drop(freed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_whole_granules_are_kept() {
        assert!(!Reuse::kept_size(0));
        assert!(!Reuse::kept_size(1000));
        assert!(Reuse::kept_size(ALLOCATION_GRANULARITY));
        assert!(!Reuse::kept_size(ALLOCATION_GRANULARITY + 64));
        assert!(Reuse::kept_size(5 * ALLOCATION_GRANULARITY));
    }
}
