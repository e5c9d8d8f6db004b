//! Memory tiers: where each partition lives, and moving partitions between them.
//!
//! A partition lives on a device (its GPU, or a pretend device of the host backend) or, once
//! spilled, in the host tier: pageable host memory with a budget of its own
//! (`--host-memory-limit`). When device memory is needed (a put, a compaction, a copy, a
//! restore) and the device has no room, the least recently used partitions on it that nobody
//! else holds are spilled: read back through the staging path a piece at a time, kept in host
//! memory, and the device memory returned. Reads serve a spilled partition from host memory as
//! it is; `ipc-export` restores it onto its device first, since other processes can map only
//! device memory.
//!
//! With `--data-dir`, a dataset the server started with is in a third tier, the disk, until
//! it is first read (see `disk`).
//!
//! A partition's place is a [`Slot`] shared by every dataset version that includes it (appends
//! share their base's partitions), so a spill frees the memory once for all of them. What a
//! slot holds is a [`Resident`]: the data and the reservation that pays for it, swapped as a
//! whole. Readers, exports and copies clone the `Arc<Resident>` they work on, so a spill never
//! frees memory under them: the old resident's memory (and its charge) goes when the last of
//! them is done. Such held partitions are not spilled at all, since that would free nothing.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};
use std::time::Instant;

use arrow::record_batch::RecordBatch;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};

use super::dataset::StoredPartition;
use super::disk::DiskPartition;
use super::memory::{MemoryBudget, Reservation};
use super::{Store, StoreError};
use crate::backend::{BackendError, Partition, SpilledPartition, spilled};

/// Most bytes a spill reads back at once: a staging buffer's worth, never the whole partition.
const SPILL_PIECE_BYTES: u64 = 64 << 20;

/// Pieces a spill reads ahead of its copies, and copies out of staging memory it runs at once,
/// so that the device-to-host copies overlap the host copies and those use several cores. At
/// most this many pieces of staging memory are held: 320 MiB, well inside the pool.
const SPILL_READS_AHEAD: usize = 2;
const SPILL_COPIES: usize = 3;

/// Pieces a restore or load uploads at once.
const UPLOADS_AHEAD: usize = 3;

/// Where a partition's data lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    /// On this device, where it can be exported.
    Device(u32),
    /// Spilled to host memory, or loaded there from the data directory.
    Host,
    /// Only in the data directory's files, not loaded since the server started.
    Disk,
}

/// A partition's data and what pays for it, in one tier.
pub(crate) struct Resident {
    pub(crate) data: Arc<dyn Partition>,
    pub(crate) reservation: Reservation,
    pub(crate) tier: Tier,
}

impl fmt::Debug for Resident {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Resident")
            .field("tier", &self.tier)
            .field("rows", &self.data.num_rows())
            .field("bytes", &self.reservation.bytes())
            .finish()
    }
}

/// One partition's place in the tiers.
#[derive(Debug)]
pub(crate) struct Slot {
    resident: RwLock<Arc<Resident>>,
    /// The device the partition was stored on: where a restore brings it back.
    home: u32,
    /// When it was last read or exported, on [`tick`]'s clock.
    last_used: AtomicU64,
    /// Held by whoever moves the partition between tiers, so that one move runs at a time.
    moving: tokio::sync::Mutex<()>,
    /// For a partition the data directory holds as it is (one loaded from there, or one
    /// whose put the writer has made durable): its rows on disk, where it goes back rather
    /// than be copied when memory is needed.
    on_disk: OnceLock<Arc<dyn Partition>>,
}

/// A clock for least-recently-used order: any counter all slots share will do.
fn tick() -> u64 {
    static CLOCK: AtomicU64 = AtomicU64::new(0);
    CLOCK.fetch_add(1, Ordering::Relaxed)
}

impl Slot {
    /// What the partition holds now.
    pub(crate) fn resident(&self) -> Arc<Resident> {
        Arc::clone(&self.resident.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// Marks the partition as just used, for the spill order.
    pub(crate) fn touch(&self) {
        self.last_used.store(tick(), Ordering::Relaxed);
    }

    pub(crate) fn home(&self) -> u32 {
        self.home
    }

    /// Records that the data directory now holds the partition's rows as they are, in
    /// `files`: when its memory is needed it goes back there instead of being copied.
    pub(super) fn held_on_disk(&self, files: Arc<dyn Partition>) {
        let _ = self.on_disk.set(files);
    }

    /// Held by whoever moves the partition between tiers.
    pub(super) fn moving(&self) -> &tokio::sync::Mutex<()> {
        &self.moving
    }

    pub(super) fn replace(&self, resident: Arc<Resident>) -> Arc<Resident> {
        let mut current = self.resident.write().unwrap_or_else(|p| p.into_inner());
        std::mem::replace(&mut *current, resident)
    }

    /// Whether moving it out of `tier` would free anything: no reader, export or copy holds
    /// the resident.
    fn movable_from(&self, tier: Tier) -> bool {
        let resident = self.resident.read().unwrap_or_else(|p| p.into_inner());
        resident.tier == tier && Arc::strong_count(&resident) == 1
    }
}

/// The host tier and the partitions that may be spilled to it.
#[derive(Debug)]
pub(crate) struct Tiers {
    /// The host tier's budget, as one device.
    host: Arc<MemoryBudget>,
    /// What partitions only on disk hold there, unbounded: for `status`.
    disk: Arc<MemoryBudget>,
    slots: Mutex<Vec<Weak<Slot>>>,
    pub(crate) spills: AtomicU64,
    pub(crate) spilled_bytes: AtomicU64,
    pub(crate) spill_nanos: AtomicU64,
    pub(crate) restores: AtomicU64,
    /// Turns for loads from disk (see `Store::load`).
    pub(super) loading: tokio::sync::Semaphore,
    pub(crate) restored_bytes: AtomicU64,
    pub(crate) restore_nanos: AtomicU64,
    pub(crate) loads: AtomicU64,
    /// Partitions dropped back to the disk tier to free memory.
    pub(crate) evictions: AtomicU64,
    /// Bytes of the files loaded.
    pub(crate) loaded_bytes: AtomicU64,
    pub(crate) load_nanos: AtomicU64,
}

impl Tiers {
    /// A host tier of `limit` bytes (0: none, nothing is spilled).
    pub(crate) fn new(limit: u64) -> Self {
        Self {
            host: MemoryBudget::new(vec![Some(limit)]),
            disk: MemoryBudget::new(vec![None]),
            slots: Mutex::new(Vec::new()),
            spills: AtomicU64::new(0),
            spilled_bytes: AtomicU64::new(0),
            spill_nanos: AtomicU64::new(0),
            restores: AtomicU64::new(0),
            loading: tokio::sync::Semaphore::new(super::disk::LOADS_AT_ONCE),
            restored_bytes: AtomicU64::new(0),
            restore_nanos: AtomicU64::new(0),
            loads: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
            loaded_bytes: AtomicU64::new(0),
            load_nanos: AtomicU64::new(0),
        }
    }

    pub(crate) fn host_used(&self) -> u64 {
        self.host.used(0)
    }

    pub(crate) fn host_limit(&self) -> u64 {
        self.host.limit(0).unwrap_or(0)
    }

    /// Reserves `bytes` of host memory for bytes received from a client, which live there
    /// whatever the backend: where the device has no room for them, the host tier may.
    pub(crate) fn try_reserve_host(&self, bytes: u64) -> Result<Reservation, StoreError> {
        self.host.try_reserve(0, bytes)
    }

    /// Bytes partitions only on disk hold there.
    pub(crate) fn disk_used(&self) -> u64 {
        self.disk.used(0)
    }

    /// A charge of `bytes` on disk, which never fails: the files are there already.
    pub(super) fn reserve_disk(&self, bytes: u64) -> Reservation {
        self.disk
            .try_reserve(0, bytes)
            .unwrap_or_else(|_| unreachable!("the disk budget has no limit"))
    }

    /// A new partition on the device `reservation` is for, which may later be spilled.
    pub(crate) fn hold(
        &self,
        data: Arc<dyn Partition>,
        reservation: Reservation,
        data_bytes: u64,
    ) -> StoredPartition {
        let home = reservation.device();
        self.hold_in(Tier::Device(home), home, data, reservation, data_bytes)
    }

    /// A partition only on disk, loaded onto (or by way of the host tier for) `home`.
    pub(super) fn hold_on_disk(
        &self,
        data: Arc<dyn Partition>,
        reservation: Reservation,
        home: u32,
        data_bytes: u64,
    ) -> StoredPartition {
        self.hold_in(Tier::Disk, home, data, reservation, data_bytes)
    }

    fn hold_in(
        &self,
        tier: Tier,
        home: u32,
        data: Arc<dyn Partition>,
        reservation: Reservation,
        data_bytes: u64,
    ) -> StoredPartition {
        let slot = Arc::new(Slot {
            home,
            last_used: AtomicU64::new(tick()),
            moving: tokio::sync::Mutex::new(()),
            on_disk: match tier {
                Tier::Disk => OnceLock::from(Arc::clone(&data)),
                _ => OnceLock::new(),
            },
            resident: RwLock::new(Arc::new(Resident {
                data,
                reservation,
                tier,
            })),
        });
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        // Forget dropped partitions now and then, so the list follows what is stored.
        if slots.len() >= 64 && slots.len().is_power_of_two() {
            slots.retain(|slot| slot.strong_count() > 0);
        }
        slots.push(Arc::downgrade(&slot));
        drop(slots);
        StoredPartition { slot, data_bytes }
    }

    /// Partitions in `tier` whose moving out would free memory, least recently used first;
    /// with `on_disk`, only those the data directory holds.
    fn spill_candidates(&self, tier: Tier, on_disk: bool) -> Vec<Arc<Slot>> {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        slots.retain(|slot| slot.strong_count() > 0);
        let mut candidates: Vec<Arc<Slot>> = slots
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|slot| (!on_disk || slot.on_disk.get().is_some()) && slot.movable_from(tier))
            .collect();
        drop(slots);
        // Readers touch slots while this sorts: each key is read once, so the order is one
        // snapshot's (a key read per comparison can change mid-sort, and sort panics).
        candidates.sort_by_cached_key(|slot| slot.last_used.load(Ordering::Relaxed));
        candidates
    }
}

pub(super) fn elapsed_nanos(started: Instant) -> u64 {
    u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

impl Store {
    /// Reserves `bytes` on `device`, spilling partitions there to the host tier if that makes
    /// room. Fails, saying what every tier holds, when nothing does.
    pub(super) async fn reserve_on(
        &self,
        device: u32,
        bytes: u64,
    ) -> Result<Reservation, StoreError> {
        let budget = &self.inner.budget;
        match budget.try_reserve(device, bytes) {
            Err(StoreError::MemoryExhausted { .. }) => {}
            reserved => return reserved,
        }
        self.make_room(device, bytes).await;
        budget
            .try_reserve(device, bytes)
            .map_err(|error| self.tiers_full(error))
    }

    /// `error` (the device's refusal), saying what the host tier holds where there is one.
    pub(super) fn tiers_full(&self, error: StoreError) -> StoreError {
        let tiers = &self.inner.tiers;
        match error {
            StoreError::MemoryExhausted {
                device,
                requested,
                used,
                limit,
                ..
            } if tiers.host_limit() == 0 => StoreError::MemoryExhausted {
                device,
                requested,
                used,
                limit,
                host_backend: self.inner.backend.name() == "host",
            },
            StoreError::MemoryExhausted {
                device,
                requested,
                used,
                limit,
                ..
            } if tiers.host_limit() > 0 => StoreError::TiersExhausted {
                device,
                requested,
                used,
                limit,
                host_used: tiers.host_used(),
                host_limit: tiers.host_limit(),
            },
            error => error,
        }
    }

    /// Spills least recently used partitions off `device` until `bytes` are free there, or
    /// nothing more can go. Returns whether `bytes` are free. Without a host tier, only
    /// partitions the data directory holds go (back there).
    pub(super) async fn make_room(&self, device: u32, bytes: u64) -> bool {
        let budget = &self.inner.budget;
        let to_disk_only = self.inner.tiers.host_limit() == 0;
        if !self.room_is_possible(device, bytes, to_disk_only) {
            return budget.free(device) >= bytes;
        }
        loop {
            if budget.free(device) >= bytes {
                return true;
            }
            let candidates = self
                .inner
                .tiers
                .spill_candidates(Tier::Device(device), to_disk_only);
            let mut spilled_any = false;
            for slot in candidates {
                if budget.free(device) >= bytes {
                    return true;
                }
                match self.spill(&slot).await {
                    Ok(spilled) => spilled_any |= spilled,
                    Err(error) => {
                        tracing::info!(device, %error, "cannot spill to the host tier");
                        return budget.free(device) >= bytes;
                    }
                }
            }
            if !spilled_any {
                return budget.free(device) >= bytes;
            }
        }
    }

    /// Whether moving what can move off `device` would free `bytes` there, the host tier
    /// taking what it must: a request that cannot fit however much moves must not displace
    /// anything (other threads change the tiers meanwhile, so this is an estimate; it errs
    /// only where they free or take memory while it runs).
    fn room_is_possible(&self, device: u32, bytes: u64, to_disk_only: bool) -> bool {
        let budget = &self.inner.budget;
        if budget.limit(device).is_some_and(|limit| bytes > limit) {
            return false;
        }
        let tiers = &self.inner.tiers;
        let mut free = budget.free(device);
        let mut to_host = 0u64;
        for slot in tiers.spill_candidates(Tier::Device(device), to_disk_only) {
            if free >= bytes {
                break;
            }
            let moved = slot.resident().reservation.bytes();
            free = free.saturating_add(moved);
            if slot.on_disk.get().is_none() {
                to_host = to_host.saturating_add(moved);
            }
        }
        if free < bytes {
            return false;
        }
        if to_host == 0 {
            return true;
        }
        let evictable = tiers
            .spill_candidates(Tier::Host, true)
            .iter()
            .fold(0u64, |sum, slot| {
                sum.saturating_add(slot.resident().reservation.bytes())
            });
        let host_free = tiers.host_limit().saturating_sub(tiers.host_used());
        to_host <= host_free.saturating_add(evictable)
    }

    /// Moves `slot`'s partition from its device to the host tier, or back to the disk tier
    /// where the data directory holds it as it is. `Ok(false)` when another move of it is
    /// under way or it is no longer on a device.
    async fn spill(&self, slot: &Slot) -> Result<bool, StoreError> {
        let Ok(_moving) = slot.moving.try_lock() else {
            return Ok(false);
        };
        let resident = slot.resident();
        let Tier::Device(device) = resident.tier else {
            return Ok(false);
        };
        if self.evict(slot, &resident) {
            return Ok(true);
        }
        let tiers = &self.inner.tiers;
        // Paid for in the host tier before anything is read: the device layout's size, then
        // trued up to what the pieces hold. Partitions there that the data directory holds
        // go back to it to make room.
        let needed = resident.reservation.bytes();
        let mut host = match tiers.host.try_reserve(0, needed) {
            Ok(host) => host,
            Err(_) => {
                self.evict_from_host(needed);
                tiers.host.try_reserve(0, needed)?
            }
        };
        let started = Instant::now();
        let rows = resident.data.num_rows();
        let per_row = resident
            .reservation
            .bytes()
            .div_ceil(rows.max(1) as u64)
            .max(1);
        let rows_per_piece = usize::try_from((SPILL_PIECE_BYTES / per_row).max(1)).unwrap_or(1);
        let data = Arc::clone(&resident.data);
        let pieces: Vec<RecordBatch> = futures::stream::iter((0..rows).step_by(rows_per_piece))
            .map(move |offset| data.read(offset, rows_per_piece.min(rows - offset)))
            .buffered(SPILL_READS_AHEAD)
            .map_err(StoreError::from)
            // Each copied out of staging memory as soon as it is read, which then goes back
            // to the pool; CPU work, so on threads of its own, several at once.
            .map_ok(|piece| async move {
                tokio::task::spawn_blocking(move || spilled::copied(&piece))
                    .await
                    .map_err(|e| BackendError::Device(format!("a spill task failed: {e}")))?
                    .map_err(StoreError::from)
            })
            .try_buffered(SPILL_COPIES)
            .try_collect()
            .await?;
        let spilled = SpilledPartition::of_copies(pieces);
        let bytes = super::charge(spilled.bytes(), rows as u64);
        host.resize(bytes)?;
        slot.replace(Arc::new(Resident {
            data: Arc::new(spilled),
            reservation: host,
            tier: Tier::Host,
        }));
        let device_bytes = resident.reservation.bytes();
        drop(resident);
        tiers.spills.fetch_add(1, Ordering::Relaxed);
        tiers.spilled_bytes.fetch_add(bytes, Ordering::Relaxed);
        tiers
            .spill_nanos
            .fetch_add(elapsed_nanos(started), Ordering::Relaxed);
        tracing::info!(
            device,
            rows,
            device_bytes,
            host_bytes = bytes,
            "partition spilled to host memory"
        );
        Ok(true)
    }

    /// Puts `slot`'s partition, held as `resident`, back in the disk tier if the data
    /// directory holds it as it is: nothing is copied, the memory is freed. The caller holds
    /// the slot's `moving` lock. Returns whether it did.
    fn evict(&self, slot: &Slot, resident: &Resident) -> bool {
        let Some(on_disk) = slot.on_disk.get() else {
            return false;
        };
        let tiers = &self.inner.tiers;
        let file_bytes = on_disk.bytes();
        slot.replace(Arc::new(Resident {
            data: Arc::clone(on_disk),
            reservation: tiers.reserve_disk(file_bytes),
            tier: Tier::Disk,
        }));
        tiers.evictions.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            tier = ?resident.tier,
            bytes = resident.reservation.bytes(),
            "partition dropped back to the data directory's files"
        );
        true
    }

    /// Puts least recently used host-tier partitions that the data directory holds back in
    /// the disk tier until `bytes` are free in the host tier, or none is left.
    fn evict_from_host(&self, bytes: u64) {
        let tiers = &self.inner.tiers;
        for slot in tiers.spill_candidates(Tier::Host, true) {
            if tiers.host_limit().saturating_sub(tiers.host_used()) >= bytes {
                return;
            }
            let Ok(_moving) = slot.moving.try_lock() else {
                continue;
            };
            let resident = slot.resident();
            if resident.tier == Tier::Host {
                self.evict(&slot, &resident);
            }
        }
    }

    /// `partition` on a device: restored from the host tier, or loaded from disk, onto the
    /// device it was stored on where it is not on one. The returned resident holds the device
    /// memory for the caller.
    pub(super) async fn restore(
        &self,
        partition: &StoredPartition,
    ) -> Result<Arc<Resident>, StoreError> {
        let slot = &partition.slot;
        let resident = slot.resident();
        match resident.tier {
            Tier::Device(_) => return Ok(resident),
            Tier::Disk => return self.load(slot, true).await,
            Tier::Host => {}
        }
        // On a task of its own, like a load (see `Store::load`): a caller that goes away
        // mid-restore frees nothing still in use.
        let (store, slot, data_bytes) = (self.clone(), Arc::clone(slot), partition.data_bytes);
        tokio::spawn(async move { store.restore_now(&slot, data_bytes).await })
            .await
            .map_err(|e| BackendError::Device(format!("a restore task failed: {e}")))?
    }

    async fn restore_now(&self, slot: &Slot, data_bytes: u64) -> Result<Arc<Resident>, StoreError> {
        let _moving = slot.moving.lock().await;
        let resident = slot.resident();
        if resident.tier != Tier::Host {
            // Restored meanwhile; or, loaded onto its device, on it.
            return Ok(resident);
        }
        let started = Instant::now();
        let restored = self
            .upload_resident(&resident, slot.home, data_bytes)
            .await?;
        let restored = restored.slot.resident();
        slot.replace(Arc::clone(&restored));
        let tiers = &self.inner.tiers;
        tiers.restores.fetch_add(1, Ordering::Relaxed);
        tiers
            .restored_bytes
            .fetch_add(restored.reservation.bytes(), Ordering::Relaxed);
        tiers
            .restore_nanos
            .fetch_add(elapsed_nanos(started), Ordering::Relaxed);
        tracing::info!(
            device = slot.home,
            rows = restored.data.num_rows(),
            bytes = restored.reservation.bytes(),
            "partition restored from host memory"
        );
        Ok(restored)
    }

    /// A compact copy on `device` of a partition off the devices (spilled to the host tier,
    /// or only on disk).
    pub(super) async fn upload_resident(
        &self,
        resident: &Resident,
        device: u32,
        data_bytes: u64,
    ) -> Result<StoredPartition, StoreError> {
        if let Some(disk) = DiskPartition::of(resident) {
            let peak = disk.file_bytes().saturating_mul(2);
            return self
                .upload_pieces(disk.pieces(), peak, device, data_bytes)
                .await;
        }
        let Some(spilled) = resident.data.as_any().downcast_ref::<SpilledPartition>() else {
            return Err(BackendError::Device(
                "a host-tier partition of an unknown kind".to_owned(),
            )
            .into());
        };
        let pieces = spilled.pieces().to_vec();
        let total = pieces
            .iter()
            .map(|piece| self.stored_charge(piece))
            .sum::<Result<u64, _>>()?;
        // Room for the pieces and, where there are several, their concatenation beside them.
        let peak = if pieces.len() > 1 { 2 * total } else { total };
        let pieces = futures::stream::iter(pieces).map(Ok).boxed();
        self.upload_pieces(pieces, peak, device, data_bytes).await
    }

    /// `pieces` (consecutive rows of one schema) uploaded onto `device` and concatenated
    /// there into one compact partition. Room for `peak` bytes is made first; each piece is
    /// paid for before it is uploaded.
    pub(super) async fn upload_pieces(
        &self,
        pieces: BoxStream<'static, Result<RecordBatch, StoreError>>,
        peak: u64,
        device: u32,
        data_bytes: u64,
    ) -> Result<StoredPartition, StoreError> {
        // The peak where moving others can give it; else at least room for the rows.
        if !self.make_room(device, peak).await {
            self.make_room(device, data_bytes).await;
        }
        let store = self.clone();
        let uploaded: Vec<StoredPartition> = pieces
            // Each paid for in order, before its upload starts.
            .map(move |piece| {
                let piece = piece?;
                let charge = store.stored_charge(&piece)?;
                let reservation = store
                    .inner
                    .budget
                    .try_reserve(device, charge)
                    .map_err(|error| store.tiers_full(error))?;
                let piece_bytes = crate::arrays::batch_bytes(&piece);
                let upload = store.inner.backend.upload(device, piece);
                let inner = Arc::clone(&store.inner);
                Ok(async move {
                    Ok::<_, StoreError>(inner.tiers.hold(upload.await?, reservation, piece_bytes))
                })
            })
            .try_buffered(UPLOADS_AHEAD)
            .try_collect()
            .await?;
        let total: u64 = uploaded.iter().map(StoredPartition::memory_bytes).sum();
        if uploaded.is_empty() {
            return Err(
                BackendError::Device("a partition without rows to upload".to_owned()).into(),
            );
        }
        // Concatenated whether or not the backend compacts puts: a slot holds one partition.
        let mut compacted = self
            .concatenate(uploaded, device, super::put::Room::Spill)
            .await?;
        match (compacted.pop(), compacted.is_empty()) {
            (Some(mut partition), true) => {
                partition.data_bytes = data_bytes;
                Ok(partition)
            }
            _ => Err(self.tiers_full(StoreError::MemoryExhausted {
                device,
                requested: total,
                used: self.inner.budget.used(device),
                limit: self.inner.budget.limit(device).unwrap_or(u64::MAX),
                host_backend: false,
            })),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::panic::AssertUnwindSafe;
    use std::sync::atomic::AtomicBool;

    use super::*;
    use crate::backend::{Backend, HostBackend};

    /// Readers touch partitions while a put looks for ones to spill; the spill order must be
    /// decided over one snapshot of the clock, or the sort sees a comparison that changes
    /// under it (and Rust's sort may panic on such an order).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_spill_order_holds_while_partitions_are_used() {
        let backend = HostBackend::new();
        let batch = crate::store::testing::batch(0..1);
        let data = backend.upload(0, batch).await.expect("upload");
        let budget = MemoryBudget::new(vec![None]);
        let tiers = Tiers::new(1 << 30);
        let stored: Vec<StoredPartition> = (0..4096)
            .map(|_| {
                let charge = budget.try_reserve(0, 1).expect("unlimited");
                tiers.hold(Arc::clone(&data), charge, 1)
            })
            .collect();
        let stop = AtomicBool::new(false);
        std::thread::scope(|scope| {
            for offset in [0usize, 7] {
                let (stored, stop) = (&stored, &stop);
                scope.spawn(move || {
                    let mut i = offset;
                    while !stop.load(Ordering::Relaxed) {
                        stored[(i * 2_654_435_761) % stored.len()].slot.touch();
                        i = i.wrapping_add(1);
                    }
                });
            }
            let sorted = std::panic::catch_unwind(AssertUnwindSafe(|| {
                for _ in 0..300 {
                    let candidates = tiers.spill_candidates(Tier::Device(0), false);
                    assert_eq!(candidates.len(), stored.len());
                }
            }));
            stop.store(true, Ordering::Relaxed);
            assert!(sorted.is_ok(), "the spill order panicked");
        });
    }
}
