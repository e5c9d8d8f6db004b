//! The store's counters, in one place: what its components did, for `status` and the metrics.
//!
//! Every component that counts holds the one [`Stats`] of its store; counters only grow, except
//! `pending_writes`, which follows the persistence writer's queue.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// What the store's components did since it started.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    /// Compactions (at commit, on load, in the background), the Arrow bytes they copied and
    /// the time they took.
    pub(crate) compactions: AtomicU64,
    pub(crate) compacted_bytes: AtomicU64,
    pub(crate) compaction_nanos: AtomicU64,
    /// Background compactions of appended partitions, published.
    pub(crate) background_compactions: AtomicU64,
    /// Partitions spilled to the host tier, their bytes there, and the time it took.
    pub(crate) spills: AtomicU64,
    pub(crate) spilled_bytes: AtomicU64,
    pub(crate) spill_nanos: AtomicU64,
    /// Partitions restored onto their devices from the host tier.
    pub(crate) restores: AtomicU64,
    pub(crate) restored_bytes: AtomicU64,
    pub(crate) restore_nanos: AtomicU64,
    /// Partitions loaded from the data directory, and the bytes of their files.
    pub(crate) loads: AtomicU64,
    pub(crate) loaded_bytes: AtomicU64,
    pub(crate) load_nanos: AtomicU64,
    /// Partitions dropped back to the disk tier to free memory.
    pub(crate) evictions: AtomicU64,
    /// Segment files the persistence writer wrote, and their bytes.
    pub(crate) segments_written: AtomicU64,
    pub(crate) written_bytes: AtomicU64,
    /// Changes the disk refused.
    pub(crate) write_failures: AtomicU64,
    /// Changes queued for the disk and not yet done.
    pub(crate) pending_writes: AtomicU64,
}

impl Stats {
    /// Adds `n` to `counter`.
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Adds the time since `started` to `counter` (in nanoseconds).
    pub(crate) fn add_time(counter: &AtomicU64, started: Instant) {
        let nanos = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        counter.fetch_add(nanos, Ordering::Relaxed);
    }

    /// What `counter` holds now.
    pub(crate) fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }

    /// What a counter of nanoseconds holds now, in seconds.
    pub(crate) fn seconds(counter: &AtomicU64) -> f64 {
        Duration::from_nanos(Self::get(counter)).as_secs_f64()
    }
}
