//! A pool of pinned host buffers for device transfers.
//!
//! Pinning memory costs about a millisecond per 4 MB (faulting the pages in, then registering
//! them: `ffi::PinnedBuffer`), far more than a copy, so buffers are reused:
//! a [`PinnedLease`] returns its buffer to the pool when dropped. Reads hand leases to Arrow as
//! the backing memory of the record batches they return, so a buffer comes back only once
//! nothing holds those batches: for `DoGet`, once h2 has written the last of their bytes to
//! the socket (the reply hands the buffers on without copying them). Sizes are rounded to
//! powers of two so that returned buffers fit later requests; a full cache makes room for a size
//! it holds none of by freeing its oldest buffers (one large transfer's buffer, used once, must
//! not keep every other size from being reused). Buffers are allocated on the
//! GPU's NUMA node where the system reports one (see `backend::numa`).
//!
//! The pinned memory reads lease at once is capped: a reader that stops reading holds its
//! chunks until its stream ends, and pinned memory cannot be paged out, so without a cap
//! enough stalled readers could pin all of the host's memory. A read's lease beyond the cap
//! fails with `StagingExhausted` (RESOURCE_EXHAUSTED) rather than wait on readers that may
//! never move. Spills' whole-partition copies (`pieces::host_copy`, two pieces at a time) lease
//! under the same cap. Uploads and concatenations are not capped: they hold their buffer only
//! for the copy, and the put path already bounds how many run and how large each is (an
//! upload at most two 64 MiB pieces). Buffers pinned ahead of use at startup go straight into
//! the cache and never count as leased.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use arrow::buffer::Buffer;

use super::ffi::{self, ArenaBlock, Context, PinnedArena, PinnedBuffer};
use crate::backend::{BackendError, numa};

/// Where reads stage their device-to-host copies: blocks of the pinned host memory
/// (`--pinned-host-memory`, pinned at start) while the blocks in use hold at most half of it,
/// as spills' may, so that put bodies keep the rest; the pool otherwise. A read staged in
/// that memory pins nothing: the pool pins its buffers as they are first needed, and while the
/// driver pins, every other call to it waits (the first reads after a start pinned their
/// chunks one by one). Readers that stop reading hold their blocks, so the half bounds what
/// they can keep from puts; what they hold of the pool is capped as before.
#[derive(Debug, Clone, Copy)]
pub(super) struct ReadStaging<'a> {
    pub(super) pool: &'a Arc<PinnedPool>,
    pub(super) arena: Option<&'a Arc<PinnedArena>>,
    /// Counts the rounds staged in the pinned host memory.
    pub(super) in_arena: &'a AtomicU64,
}

impl ReadStaging<'_> {
    /// Pinned memory for `bytes` of one read round.
    pub(super) fn lease(&self, bytes: usize) -> Result<ReadBuffer, BackendError> {
        if let Some(arena) = self.arena
            && let Some(block) = arena.take_within(bytes, arena.len() / 2)
        {
            self.in_arena.fetch_add(1, Ordering::Relaxed);
            return Ok(ReadBuffer::Arena(block));
        }
        self.pool.lease_for_read(bytes).map(ReadBuffer::Pool)
    }
}

/// A read round's pinned memory: a buffer of the pool or a block of the pinned host memory.
#[derive(Debug)]
pub(super) enum ReadBuffer {
    Pool(PinnedLease),
    Arena(ArenaBlock),
}

impl ReadBuffer {
    pub(super) fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            Self::Pool(lease) => lease.buffer_mut().as_mut_slice(),
            Self::Arena(block) => block.as_mut_slice(),
        }
    }

    /// Its first `len` bytes (at most what was leased) as one Arrow buffer, which the round's
    /// arrays slice (`ffi::own_slice`); the memory goes back when the last of them is dropped.
    pub(super) fn into_buffer(self, len: usize) -> Buffer {
        match self {
            Self::Pool(lease) => ffi::arrow_buffer(Arc::new(lease), 0..len),
            Self::Arena(block) => block.into_buffer().slice_with_length(0, len),
        }
    }
}

/// Smallest pinned buffer handed out.
const MIN_BUFFER_BYTES: usize = 1 << 20;

#[derive(Debug)]
pub(super) struct PinnedPool {
    context: Arc<Context>,
    /// The CPUs of the GPU's NUMA node, which allocate its buffers; `None` where unknown.
    cpus: Option<Vec<usize>>,
    free: Mutex<Vec<PinnedBuffer>>,
    max_cached_bytes: u64,
    /// The most bytes leased at once when a read asks for more.
    max_leased_bytes: AtomicU64,
    cached_bytes: AtomicU64,
    leased_bytes: AtomicU64,
}

impl PinnedPool {
    pub(super) fn new(
        context: Arc<Context>,
        cpus: Option<Vec<usize>>,
        max_cached_bytes: u64,
        max_leased_bytes: u64,
    ) -> Arc<Self> {
        Arc::new(Self {
            context,
            cpus,
            free: Mutex::new(Vec::new()),
            max_cached_bytes,
            max_leased_bytes: AtomicU64::new(max_leased_bytes),
            cached_bytes: AtomicU64::new(0),
            leased_bytes: AtomicU64::new(0),
        })
    }

    /// A buffer of at least `bytes` bytes, reused when one is free, for a transfer that
    /// returns it as soon as its copy is done.
    pub(super) fn lease(self: &Arc<Self>, bytes: usize) -> Result<PinnedLease, BackendError> {
        self.lease_within(bytes, u64::MAX)
    }

    /// As [`PinnedPool::lease`], for a read, whose buffer its reader may hold indefinitely:
    /// refused where it would take the leased bytes past the cap.
    pub(super) fn lease_for_read(
        self: &Arc<Self>,
        bytes: usize,
    ) -> Result<PinnedLease, BackendError> {
        self.lease_within(bytes, self.max_leased_bytes.load(Ordering::Acquire))
    }

    fn lease_within(
        self: &Arc<Self>,
        bytes: usize,
        limit: u64,
    ) -> Result<PinnedLease, BackendError> {
        let class = bytes.max(MIN_BUFFER_BYTES).next_power_of_two();
        self.reserve(class as u64, limit)?;
        let leased = self.take_or_allocate(class);
        if leased.is_err() {
            self.leased_bytes.fetch_sub(class as u64, Ordering::AcqRel);
        }
        Ok(PinnedLease {
            buffer: Some(leased?),
            pool: Arc::clone(self),
        })
    }

    /// Counts `bytes` as leased, if that stays within `limit`.
    fn reserve(&self, bytes: u64, limit: u64) -> Result<(), BackendError> {
        self.leased_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |in_use| {
                in_use.checked_add(bytes).filter(|&total| total <= limit)
            })
            .map(|_| ())
            .map_err(|in_use| BackendError::StagingExhausted {
                device: self.context.ordinal() as u32,
                requested: bytes,
                in_use,
                limit,
            })
    }

    /// Sets the cap on bytes leased at once.
    pub(super) fn set_max_leased_bytes(&self, bytes: u64) {
        self.max_leased_bytes.store(bytes, Ordering::Release);
    }

    fn take_or_allocate(&self, class: usize) -> Result<PinnedBuffer, BackendError> {
        let reused = {
            let mut free = self
                .free
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            let reused = free
                .iter()
                .position(|b| b.len() == class)
                .map(|i| free.remove(i));
            // Under the lock, as every change of the cache and its count.
            if let Some(buffer) = &reused {
                self.cached_bytes
                    .fetch_sub(buffer.len() as u64, Ordering::AcqRel);
            }
            reused
        };
        match reused {
            Some(buffer) => Ok(buffer),
            None => self.allocate(class),
        }
    }

    /// A new pinned buffer of `class` bytes, on the GPU's NUMA node where known.
    fn allocate(&self, class: usize) -> Result<PinnedBuffer, BackendError> {
        match &self.cpus {
            Some(cpus) => numa::on_cpus(cpus, || PinnedBuffer::new(&self.context, class)),
            None => PinnedBuffer::new(&self.context, class),
        }
    }

    /// Pins buffers of `sizes` on a thread of its own and keeps them in the cache: pinning
    /// host memory runs at about 4 GB/s a thread, which the first transfers of those sizes
    /// would otherwise wait for.
    pub(super) fn warm_in_background(self: &Arc<Self>, sizes: Vec<usize>) {
        let pool = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name("gpu-flight-pin".to_owned())
            .spawn(move || {
                for bytes in sizes {
                    let class = bytes.max(MIN_BUFFER_BYTES).next_power_of_two();
                    match pool.allocate(class) {
                        // Never leased: straight into the cache, as a returned buffer goes.
                        Ok(buffer) => pool.keep(buffer),
                        Err(error) => {
                            tracing::warn!(%error, bytes, "pinning staging ahead of use failed");
                        }
                    }
                }
            });
        if let Err(error) = spawned {
            tracing::warn!(%error, "no thread to pin staging ahead of use");
        }
    }

    /// Pinned bytes held by leases now.
    pub(super) fn leased_bytes(&self) -> u64 {
        self.leased_bytes.load(Ordering::Acquire)
    }

    /// Pinned bytes kept for reuse.
    pub(super) fn cached_bytes(&self) -> u64 {
        self.cached_bytes.load(Ordering::Acquire)
    }

    fn give_back(&self, buffer: PinnedBuffer) {
        self.leased_bytes
            .fetch_sub(buffer.len() as u64, Ordering::AcqRel);
        self.keep(buffer);
    }

    /// Caches `buffer` (no longer leased) for reuse, or frees it where the cache is full.
    fn keep(&self, buffer: PinnedBuffer) {
        let bytes = buffer.len() as u64;
        let mut free = self
            .free
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        // The common case, a buffer that fits, costs no list of sizes (this runs for every
        // chunk a read hands back).
        let cached = self.cached_bytes.load(Ordering::Acquire);
        if cached + bytes <= self.max_cached_bytes {
            free.push(buffer);
            self.cached_bytes.store(cached + bytes, Ordering::Release);
            return;
        }
        let sizes: Vec<usize> = free.iter().map(PinnedBuffer::len).collect();
        let Some(evicted) = make_room(&sizes, buffer.len(), self.max_cached_bytes) else {
            drop(free);
            free_off_task(vec![buffer]);
            return;
        };
        // Highest index first, so that the indices still name the same buffers; `remove`
        // keeps the rest in the order they came back.
        let evicted: Vec<PinnedBuffer> = evicted
            .into_iter()
            .rev()
            .map(|index| free.remove(index))
            .collect();
        free.push(buffer);
        let cached: u64 = free.iter().map(|b| b.len() as u64).sum();
        self.cached_bytes.store(cached, Ordering::Release);
        drop(free);
        free_off_task(evicted);
    }
}

/// What to free so that a returned buffer of `returning` bytes can be kept beside cached
/// buffers of `sizes` (oldest first: the order they were given back in), within `max` bytes:
/// nothing where it fits; else, where no buffer of its size is cached, the oldest cached ones
/// until it fits (indices ascending), so that one transfer's buffer, used once, cannot keep
/// every other size from being cached; `None` where the returned buffer itself should be freed.
fn make_room(sizes: &[usize], returning: usize, max: u64) -> Option<Vec<usize>> {
    let cached: u64 = sizes.iter().map(|&s| s as u64).sum();
    if cached + returning as u64 <= max {
        return Some(Vec::new());
    }
    if returning as u64 > max || sizes.contains(&returning) {
        return None;
    }
    let (mut left, mut evicted) = (cached, Vec::new());
    for (index, &size) in sizes.iter().enumerate() {
        if left + returning as u64 <= max {
            break;
        }
        left -= size as u64;
        evicted.push(index);
    }
    Some(evicted)
}

/// Frees pinned buffers off the caller's task: unregistering and unmapping them
/// (`cuMemHostUnregister`, `munmap`) can take milliseconds, and the last reference to a read's
/// buffer is often dropped on a connection's task (once h2 has written it).
fn free_off_task(buffers: Vec<PinnedBuffer>) {
    if buffers.is_empty() {
        return;
    }
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => drop(runtime.spawn_blocking(move || drop(buffers))),
        Err(_) => drop(buffers),
    }
}

#[cfg(test)]
mod tests {
    use super::make_room;

    const MIB: usize = 1 << 20;

    #[test]
    fn a_buffer_that_fits_is_kept_and_nothing_is_freed() {
        assert_eq!(
            make_room(&[MIB, 2 * MIB], MIB, 8 * MIB as u64),
            Some(vec![])
        );
    }

    #[test]
    fn one_large_buffer_makes_room_for_a_size_not_cached() {
        // A 1 GiB upload's buffer filled the cache; a 1 MiB one comes back.
        let sizes = [1024 * MIB];
        assert_eq!(make_room(&sizes, MIB, 1024 * MIB as u64), Some(vec![0]));
        // The oldest go first, only as many as needed.
        let sizes = [4 * MIB, 16 * MIB, MIB, 8 * MIB];
        assert_eq!(make_room(&sizes, 2 * MIB, 29 * MIB as u64), Some(vec![0]));
        assert_eq!(
            make_room(&sizes, 2 * MIB, 26 * MIB as u64),
            Some(vec![0, 1])
        );
    }

    #[test]
    fn a_size_already_cached_or_larger_than_the_cache_is_freed_instead() {
        assert_eq!(make_room(&[MIB, 4 * MIB], MIB, 5 * MIB as u64), None);
        assert_eq!(make_room(&[], 8 * MIB, 4 * MIB as u64), None);
    }
}

/// A pinned buffer on loan from the pool.
#[derive(Debug)]
pub(super) struct PinnedLease {
    buffer: Option<PinnedBuffer>,
    pool: Arc<PinnedPool>,
}

impl PinnedLease {
    pub(super) fn buffer_mut(&mut self) -> &mut PinnedBuffer {
        self.buffer
            .as_mut()
            .expect("a lease holds its buffer until dropped")
    }
}

impl AsRef<PinnedBuffer> for PinnedLease {
    fn as_ref(&self) -> &PinnedBuffer {
        self.buffer
            .as_ref()
            .expect("a lease holds its buffer until dropped")
    }
}

impl std::panic::RefUnwindSafe for PinnedLease {}

impl Drop for PinnedLease {
    fn drop(&mut self) {
        if let Some(buffer) = self.buffer.take() {
            self.pool.give_back(buffer);
        }
    }
}
