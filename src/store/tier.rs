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
//! it is first read (see `load`).
//!
//! [`Tiers`] owns the devices' budgets and the host tier's: it reserves on a device, spilling
//! there to make room, and says where a put's message is paid for.
//!
//! Each partition's place in the tiers is a `Slot` (see `slot`); a partition held by a reader,
//! an export or a copy is not spilled, since that would free nothing.

use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use arrow::record_batch::RecordBatch;
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt, TryStreamExt};

use super::error::StoreError;
use super::memory::{MemoryBudget, Reservation, charge};
use super::slot::{Resident, Slot, StoredPartition, Tier};
use super::stats::Stats;
use crate::backend::{Backend, BackendError, Partition, SpilledPartition, spilled};

/// Most bytes a spill reads back at once: a staging buffer's worth, never the whole partition.
const SPILL_PIECE_BYTES: u64 = 64 << 20;

/// Pieces a spill reads ahead of its copies, and copies out of staging memory it runs at once,
/// so that the device-to-host copies overlap the host copies and those use several cores. At
/// most this many pieces of staging memory are held: 320 MiB, well inside the pool.
const SPILL_READS_AHEAD: usize = 2;
const SPILL_COPIES: usize = 3;

/// A received message's charge, once its batch found no room ([`Tiers::message_yields`]).
#[derive(Debug)]
pub(crate) enum MessageYields {
    /// Still paid for beside the batch's charge, until the batch is uploaded.
    Beside(Reservation),
    /// The batch's own memory: to count as part of the batch's charge.
    Within(Reservation),
}

/// The memory tiers: the devices' budget, the host tier's, what the disk tier holds, and
/// every partition that may move between them.
#[derive(Debug)]
pub(crate) struct Tiers {
    backend: Arc<dyn Backend>,
    /// The devices' budgets.
    budget: Arc<MemoryBudget>,
    /// The host tier's budget, as one device.
    host: Arc<MemoryBudget>,
    /// What partitions only on disk hold there, unbounded: for `status`.
    disk: Arc<MemoryBudget>,
    slots: Mutex<Vec<Weak<Slot>>>,
    /// One turn per device at making room there. Two requests at once (two clients' puts on
    /// a full device, say) would each find the partitions the other is spilling held (by that
    /// spill) and could give up, though the spill is about to free what they need.
    room_turns: Box<[tokio::sync::Mutex<()>]>,
    stats: Arc<Stats>,
}

impl Tiers {
    /// Tiers over `backend`'s devices (budgeted by `budget`) and a host tier of `host_limit`
    /// bytes (0: none, nothing is spilled).
    pub(crate) fn new(
        backend: Arc<dyn Backend>,
        budget: Arc<MemoryBudget>,
        host_limit: u64,
        stats: Arc<Stats>,
    ) -> Self {
        let room_turns = (0..budget.devices())
            .map(|_| tokio::sync::Mutex::new(()))
            .collect();
        Self {
            backend,
            budget,
            host: MemoryBudget::new(vec![Some(host_limit)]),
            disk: MemoryBudget::new(vec![None]),
            slots: Mutex::new(Vec::new()),
            room_turns,
            stats,
        }
    }

    /// The devices' budgets.
    pub(crate) fn budget(&self) -> &Arc<MemoryBudget> {
        &self.budget
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

    /// Reserves `bytes` of host memory the store hands to other processes (a shared-memory
    /// read's file), grown with [`Tiers::grow_host_copy`]. A backend of host memory pays from
    /// its device with the most free memory (its devices are host memory); a backend of device
    /// memory from the host tier (`--host-memory-limit`), whose budget is the host memory the
    /// server may hold beside its devices. Nothing spills to make room (the caller is told),
    /// but partitions the data directory holds make way, as for a put.
    pub(crate) fn reserve_host_copy(&self, bytes: u64) -> Result<Reservation, StoreError> {
        if self.backend.holds_host_memory() {
            self.budget.try_reserve(self.budget.freest_device(), bytes)
        } else {
            self.try_reserve_host(bytes)
        }
    }

    /// Grows `copy` (from [`Tiers::reserve_host_copy`]) by `bytes`; where its budget has no
    /// room, partitions the data directory holds go back there first (synchronously:
    /// nothing is copied), on its device or in the host tier, whichever pays for it.
    pub(crate) fn grow_host_copy(
        &self,
        copy: &mut Reservation,
        bytes: u64,
    ) -> Result<(), StoreError> {
        match copy.try_grow(bytes) {
            Err(error @ StoreError::MemoryExhausted { .. }) => {
                if self.grow_by_evicting(copy, bytes) {
                    return Ok(());
                }
                Err(error)
            }
            grown => grown,
        }
    }

    /// Bytes partitions only on disk hold there.
    pub(crate) fn disk_used(&self) -> u64 {
        self.disk.used(0)
    }

    /// A charge of `bytes` on disk, which never fails: the files are there already.
    pub(crate) fn reserve_disk(&self, bytes: u64) -> Reservation {
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

    /// `batch` uploaded onto the device `reservation` is for, and held there (see
    /// [`Tiers::hold`]). The backend may upload on a task of its own (the cuda backend does),
    /// which goes on when the caller drops this future (a failed put or restore): so what
    /// pays for the upload (`reservation`, and `beside`, a charge to give back once the
    /// upload is done) goes on a task with it, and the memory stays paid for until then. An
    /// upload done at once (the host backend's) is held at once: a partition that requests
    /// for room can spill, not a reservation nobody can move until its put looks again.
    pub(crate) fn upload(
        self: &Arc<Self>,
        batch: RecordBatch,
        reservation: Reservation,
        beside: Option<Reservation>,
    ) -> BoxFuture<'static, Result<StoredPartition, StoreError>> {
        let data_bytes = crate::arrays::batch_bytes(&batch);
        let mut uploading = self.backend.upload(reservation.device(), batch);
        if let Some(data) = (&mut uploading).now_or_never() {
            drop(beside);
            let held = data
                .map(|data| self.hold(data, reservation, data_bytes))
                .map_err(StoreError::from);
            return futures::future::ready(held).boxed();
        }
        let task = tokio::spawn(async move {
            let data = uploading.await;
            drop(beside);
            (data, reservation)
        });
        let tiers = Arc::clone(self);
        async move {
            let (data, reservation) = task
                .await
                .map_err(|e| BackendError::Device(format!("an upload task failed: {e}")))?;
            Ok(tiers.hold(data?, reservation, data_bytes))
        }
        .boxed()
    }

    /// A partition only on disk, loaded onto (or by way of the host tier for) `home`.
    pub(crate) fn hold_on_disk(
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
        let slot = Arc::new(Slot::new(tier, home, data, reservation));
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
            .filter(|slot| (!on_disk || slot.on_disk().is_some()) && slot.movable_from(tier))
            .collect();
        drop(slots);
        // Readers touch slots while this sorts: each key is read once, so the order is one
        // snapshot's (a key read per comparison can change mid-sort, and sort panics).
        candidates.sort_by_cached_key(|slot| slot.last_used());
        candidates
    }
}

impl Tiers {
    /// Reserves `bytes` on `device`, spilling partitions there to the host tier if that makes
    /// room. Fails, saying what every tier holds, when nothing does.
    pub(crate) async fn reserve_on(
        &self,
        device: u32,
        bytes: u64,
    ) -> Result<Reservation, StoreError> {
        let budget = &self.budget;
        match budget.try_reserve(device, bytes) {
            Err(StoreError::MemoryExhausted { .. }) => {}
            reserved => return reserved,
        }
        // Reserved in the same turn, so that no request waiting for the turn takes the room
        // made (one that reserves without making room still may: it is within the budget).
        let _turn = self.room_turn(device).await;
        self.make_room_in_turn(device, bytes).await;
        budget
            .try_reserve(device, bytes)
            .map_err(|error| self.tiers_full(error))
    }

    /// Waits for `device`'s turn at making room (none for a device the budget does not know,
    /// which has no room to make).
    pub(super) async fn room_turn(&self, device: u32) -> Option<tokio::sync::MutexGuard<'_, ()>> {
        let turn = self.room_turns.get(usize::try_from(device).ok()?)?;
        Some(turn.lock().await)
    }

    /// `error` (the device's refusal), saying what the host tier holds where there is one.
    pub(crate) fn tiers_full(&self, error: StoreError) -> StoreError {
        let tiers = self;
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
                host_backend: self.backend.name() == "host",
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

    /// Reserves `bytes` for a `DoPut` message being received (grown with
    /// [`Reservation::try_grow`] as its bytes arrive): bytes a client has sent but no dataset
    /// holds yet count against the budget like any other. They are charged to the device with
    /// the most free memory, where the store places the batches it cannot fit elsewhere: a
    /// message must not fail for lack of room on a device its batch will not go to.
    ///
    /// The message itself is in host memory: where no device has room for it, the host tier
    /// may pay for it instead, and the batch makes room on its device when it is uploaded.
    /// Where the host tier has no room either, partitions the data directory holds make way
    /// on a device ([`Tiers::evict_on`]).
    pub(crate) fn reserve_message(&self, bytes: u64) -> Result<Reservation, StoreError> {
        match self.budget.try_reserve(self.budget.freest_device(), bytes) {
            Err(error @ StoreError::MemoryExhausted { .. }) => {
                if let Ok(host) = self.try_reserve_host(bytes) {
                    return Ok(host);
                }
                for device in self.budget.freest_devices() {
                    if self.evict_on(device, bytes)
                        && let Ok(reserved) = self.budget.try_reserve(device, bytes)
                    {
                        return Ok(reserved);
                    }
                }
                Err(self.tiers_full(error))
            }
            reserved => reserved,
        }
    }

    /// Grows `message` (from [`Tiers::reserve_message`]) by `bytes` as more of it arrives;
    /// where its device has no room, the whole message moves to the host tier, or else
    /// partitions the data directory holds make way on its device.
    pub(crate) fn grow_message(
        &self,
        message: &mut Reservation,
        bytes: u64,
    ) -> Result<(), StoreError> {
        match message.try_grow(bytes) {
            Err(StoreError::MemoryExhausted {
                device,
                used,
                limit,
                host_backend,
                ..
            }) => {
                let total = message.bytes().saturating_add(bytes);
                // Said of the whole message, beside what else is in use: "1048576 more" of
                // an 8 MiB message only confuses.
                let error = StoreError::MemoryExhausted {
                    device,
                    requested: total,
                    used: used.saturating_sub(message.bytes()),
                    limit,
                    host_backend,
                };
                if let Ok(host) = self.try_reserve_host(total) {
                    *message = host;
                    return Ok(());
                }
                // Where it is paid for now: a device, or the host tier since an earlier part
                // of it found no device with room.
                if self.grow_by_evicting(message, bytes) {
                    return Ok(());
                }
                Err(self.tiers_full(error))
            }
            grown => grown,
        }
    }

    /// What becomes of a received message's charge when its batch finds no room on
    /// `device`. A backend that keeps the decoded arrays keeps the message's memory as the
    /// batch: a charge on `device` becomes part of the batch's (the two would otherwise count
    /// it twice there); one on another device stays beside the batch's until the upload is
    /// done (the memory is counted on both devices meanwhile, never on neither). Any other's
    /// message is host memory that a device's budget stood in for: it moves to the host tier
    /// where that has room, and otherwise stays where it is, beside the batch. A charge to the
    /// host tier stays as it is.
    pub(crate) fn message_yields(&self, message: Reservation, device: u32) -> MessageYields {
        if !message.is_of(&self.budget) {
            return MessageYields::Beside(message);
        }
        if self.backend.keeps_decoded_arrays() {
            if message.device() == device {
                return MessageYields::Within(message);
            }
            return MessageYields::Beside(message);
        }
        match self.try_reserve_host(message.bytes()) {
            Ok(host) => MessageYields::Beside(host),
            Err(_) => MessageYields::Beside(message),
        }
    }

    /// Spills least recently used partitions off `device` until `bytes` are free there, or
    /// nothing more can go; the caller holds `device`'s turn (see [`Tiers::reserve_on`]).
    /// Returns whether `bytes` are free. Without a host tier, only partitions the data
    /// directory holds go (back there).
    async fn make_room_in_turn(&self, device: u32, bytes: u64) -> bool {
        let budget = &self.budget;
        // The turn's last holder may have freed enough.
        if budget.free(device) >= bytes {
            return true;
        }
        let to_disk_only = self.host_limit() == 0;
        if !self.room_is_possible(device, bytes, to_disk_only) {
            return budget.free(device) >= bytes;
        }
        loop {
            if budget.free(device) >= bytes {
                return true;
            }
            let candidates = self.spill_candidates(Tier::Device(device), to_disk_only);
            let mut spilled_any = false;
            for slot in candidates {
                if budget.free(device) >= bytes {
                    return true;
                }
                // One that cannot go (too large for the host tier's room, say) leaves the
                // rest to try.
                match self.spill(&slot).await {
                    Ok(spilled) => spilled_any |= spilled,
                    Err(error) => tracing::info!(device, %error, "cannot spill to the host tier"),
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
    /// only where they free or take memory while it runs). Counts candidates in the order a
    /// request spills them, leaving out those the host tier's room left cannot take, as the
    /// request does.
    fn room_is_possible(&self, device: u32, bytes: u64, to_disk_only: bool) -> bool {
        let budget = &self.budget;
        if budget.limit(device).is_some_and(|limit| bytes > limit) {
            return false;
        }
        let tiers = self;
        let mut free = budget.free(device);
        let mut to_host = 0u64;
        let mut host_room = None;
        for slot in tiers.spill_candidates(Tier::Device(device), to_disk_only) {
            if free >= bytes {
                break;
            }
            let moved = slot.look(|resident| resident.reservation.bytes());
            if slot.on_disk().is_none() {
                let room = *host_room.get_or_insert_with(|| {
                    let evictable =
                        tiers
                            .spill_candidates(Tier::Host, true)
                            .iter()
                            .fold(0u64, |sum, slot| {
                                sum.saturating_add(
                                    slot.look(|resident| resident.reservation.bytes()),
                                )
                            });
                    let host_free = tiers.host_limit().saturating_sub(tiers.host_used());
                    host_free.saturating_add(evictable)
                });
                if to_host.saturating_add(moved) > room {
                    continue;
                }
                to_host = to_host.saturating_add(moved);
            }
            free = free.saturating_add(moved);
        }
        free >= bytes
    }

    /// Moves `slot`'s partition from its device to the host tier, or back to the disk tier
    /// where the data directory holds it as it is. `Ok(false)` when another move of it is
    /// under way, it is no longer on a device, or someone took it since it was chosen.
    async fn spill(&self, slot: &Slot) -> Result<bool, StoreError> {
        let Ok(_moving) = slot.moving().try_lock() else {
            return Ok(false);
        };
        let resident = slot.resident();
        let Tier::Device(device) = resident.tier else {
            return Ok(false);
        };
        // Held by the slot and by this spill alone, as when it was chosen: a reader, an export
        // or a copy that took it since keeps its memory, so moving it would charge the host
        // tier for a copy and free nothing.
        if Arc::strong_count(&resident) > 2 {
            return Ok(false);
        }
        if self.evict(slot, &resident) {
            return Ok(true);
        }
        let tiers = self;
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
        let pieces: Vec<RecordBatch> = if let Some(copy) = self.backend.host_copy(&data) {
            // One piece in the device's own layout, which a restore uploads into one
            // allocation as it is, with no concatenation and no room for one.
            vec![copy.await?]
        } else {
            futures::stream::iter((0..rows).step_by(rows_per_piece))
                .map(move |offset| data.read(offset, rows_per_piece.min(rows - offset), None))
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
                .await?
        };
        let copied = started.elapsed();
        let spilled = SpilledPartition::of_copies(pieces);
        let bytes = charge(spilled.bytes(), rows as u64);
        host.resize(bytes)?;
        slot.replace(Arc::new(Resident {
            data: Arc::new(spilled),
            reservation: host,
            tier: Tier::Host,
        }));
        let device_bytes = resident.reservation.bytes();
        drop(resident);
        let stats = &self.stats;
        Stats::add(&stats.spills, 1);
        Stats::add(&stats.spilled_bytes, bytes);
        Stats::add_time(&stats.spill_nanos, started);
        tracing::info!(
            device,
            rows,
            device_bytes,
            host_bytes = bytes,
            copied_ms = copied.as_secs_f64() * 1e3,
            total_ms = started.elapsed().as_secs_f64() * 1e3,
            "partition spilled to host memory"
        );
        Ok(true)
    }

    /// Puts `slot`'s partition, held as `resident`, back in the disk tier if the data
    /// directory holds it as it is: nothing is copied, the memory is freed. The caller holds
    /// the slot's `moving` lock. Returns whether it did.
    fn evict(&self, slot: &Slot, resident: &Resident) -> bool {
        let Some(on_disk) = slot.on_disk() else {
            return false;
        };
        let file_bytes = on_disk.bytes();
        slot.replace(Arc::new(Resident {
            data: Arc::clone(on_disk),
            reservation: self.reserve_disk(file_bytes),
            tier: Tier::Disk,
        }));
        Stats::add(&self.stats.evictions, 1);
        tracing::info!(
            tier = ?resident.tier,
            bytes = resident.reservation.bytes(),
            "partition dropped back to the data directory's files"
        );
        true
    }

    /// Grows `reservation` by `bytes` after putting partitions the data directory holds back
    /// there, on the device or in the host tier, whichever pays for it; whether it grew.
    fn grow_by_evicting(&self, reservation: &mut Reservation, bytes: u64) -> bool {
        let evicted = if reservation.is_of(&self.budget) {
            self.evict_on(reservation.device(), bytes)
        } else {
            self.evict_from_host(bytes)
        };
        evicted && reservation.try_grow(bytes).is_ok()
    }

    /// Puts least recently used partitions on `device` that the data directory holds back in
    /// the disk tier until `bytes` are free there; none where all of them together would not
    /// free enough. Returns whether `bytes` are free. Nothing is copied, so this suits a
    /// caller that cannot wait (a message being charged as its bytes arrive).
    fn evict_on(&self, device: u32, bytes: u64) -> bool {
        let budget = &self.budget;
        let candidates = self.spill_candidates(Tier::Device(device), true);
        let evictable = candidates.iter().fold(0u64, |sum, slot| {
            sum.saturating_add(slot.look(|resident| resident.reservation.bytes()))
        });
        if budget.free(device).saturating_add(evictable) < bytes {
            return false;
        }
        for slot in candidates {
            if budget.free(device) >= bytes {
                break;
            }
            let Ok(_moving) = slot.moving().try_lock() else {
                continue;
            };
            let resident = slot.resident();
            // As a spill: not one someone took since it was chosen.
            if resident.tier == Tier::Device(device) && Arc::strong_count(&resident) <= 2 {
                self.evict(&slot, &resident);
            }
        }
        budget.free(device) >= bytes
    }

    /// Puts least recently used host-tier partitions that the data directory holds back in
    /// the disk tier until `bytes` are free in the host tier, or none is left; none where
    /// all of them together would not free enough. Returns whether `bytes` are free.
    fn evict_from_host(&self, bytes: u64) -> bool {
        let tiers = self;
        let candidates = tiers.spill_candidates(Tier::Host, true);
        let evictable = candidates.iter().fold(0u64, |sum, slot| {
            sum.saturating_add(slot.look(|resident| resident.reservation.bytes()))
        });
        let free = || tiers.host_limit().saturating_sub(tiers.host_used());
        if free().saturating_add(evictable) < bytes {
            return false;
        }
        for slot in candidates {
            if free() >= bytes {
                break;
            }
            let Ok(_moving) = slot.moving().try_lock() else {
                continue;
            };
            let resident = slot.resident();
            if resident.tier == Tier::Host {
                self.evict(&slot, &resident);
            }
        }
        free() >= bytes
    }
}

#[cfg(test)]
mod tests {
    use std::panic::AssertUnwindSafe;
    use std::sync::atomic::{AtomicBool, Ordering};

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
        let tiers = Tiers::new(
            Arc::new(HostBackend::new()),
            Arc::clone(&budget),
            1 << 30,
            Arc::default(),
        );
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

    /// Tiers over the host backend with one device of 1,000 bytes and a host tier of 1 GiB.
    struct SmallDevice {
        backend: Arc<dyn Backend>,
        budget: Arc<MemoryBudget>,
        tiers: Tiers,
    }

    impl SmallDevice {
        fn new() -> Self {
            Self::with_host_tier(1 << 30)
        }

        /// The same device, and a host tier of `host_limit` bytes.
        fn with_host_tier(host_limit: u64) -> Self {
            let backend: Arc<dyn Backend> = Arc::new(HostBackend::new());
            let budget = MemoryBudget::new(vec![Some(1000)]);
            let tiers = Tiers::new(
                Arc::clone(&backend),
                Arc::clone(&budget),
                host_limit,
                Arc::default(),
            );
            Self {
                backend,
                budget,
                tiers,
            }
        }

        /// A partition of `rows` rows charged `charge` bytes of the device.
        async fn holding(&self, rows: i64, charge: u64) -> StoredPartition {
            let data = self
                .backend
                .upload(0, crate::store::testing::batch(0..rows))
                .await
                .expect("upload");
            let reservation = self.budget.try_reserve(0, charge).expect("fits");
            self.tiers.hold(data, reservation, charge)
        }

        /// A partition like [`SmallDevice::holding`]'s, spilled to the host tier and held by
        /// the data directory too (its own rows standing in for the files).
        async fn spilled_and_on_disk(&self, rows: i64, charge: u64) -> StoredPartition {
            let stored = self.holding(rows, charge).await;
            let data = Arc::clone(&stored.slot.resident().data);
            assert!(self.tiers.spill(&stored.slot).await.expect("spill"));
            stored.slot.held_on_disk(data);
            stored
        }

        /// A partition charged the whole device.
        async fn filled(&self) -> StoredPartition {
            let data = self
                .backend
                .upload(0, crate::store::testing::batch(0..100))
                .await
                .expect("upload");
            let charge = self.budget.try_reserve(0, 1000).expect("fits");
            self.tiers.hold(data, charge, 800)
        }
    }

    /// Looking at a partition (its tier and size, as `status`, the listings and a commit do)
    /// must not make it look held to a request choosing what to spill, or that request fails
    /// with RESOURCE_EXHAUSTED though the partition could go.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn looking_at_a_partition_does_not_keep_it_from_being_spilled() {
        let small = SmallDevice::new();
        for round in 0..200 {
            let stored = small.filled().await;
            let (looking, stop) = (
                Arc::new(AtomicBool::new(false)),
                Arc::new(AtomicBool::new(false)),
            );
            let looker = {
                let (stored, looking, stop) =
                    (stored.clone(), Arc::clone(&looking), Arc::clone(&stop));
                std::thread::spawn(move || {
                    let mut seen = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        seen = seen.wrapping_add(stored.memory_bytes());
                        seen = seen.wrapping_add(stored.num_rows() as u64);
                        looking.store(true, Ordering::Relaxed);
                    }
                    seen
                })
            };
            while !looking.load(Ordering::Relaxed) {
                std::hint::spin_loop();
            }
            let room = small.tiers.reserve_on(0, 1000).await;
            stop.store(true, Ordering::Relaxed);
            looker.join().expect("the looking thread");
            room.unwrap_or_else(|e| panic!("round {round}: {e}"));
            assert_eq!(stored.tier(), Tier::Host, "round {round}");
        }
    }

    /// A partition a reader took after a request for room chose it is not spilled: the copy
    /// would be charged to the host tier and free nothing while the reader holds it.
    #[tokio::test]
    async fn a_partition_taken_since_it_was_chosen_is_not_spilled() {
        let small = SmallDevice::new();
        let stored = small.filled().await;
        let tiers = &small.tiers;
        let reader = stored.slot.resident();
        assert!(!tiers.spill(&stored.slot).await.expect("spill"));
        assert_eq!(stored.tier(), Tier::Device(0));
        assert_eq!(tiers.host_used(), 0);
        drop(reader);
        assert!(tiers.spill(&stored.slot).await.expect("spill"));
        assert_eq!(stored.tier(), Tier::Host);
        assert_eq!(small.budget.used(0), 0);
    }

    /// A replica made for an `ipc-export` lease is mapped by the lease's consumers: a request
    /// for room must not spill it (which frees its device memory) while the lease holds it,
    /// and its memory returns once the lease lets it go.
    #[tokio::test]
    async fn a_replica_a_lease_holds_is_never_spilled() {
        let small = SmallDevice::new();
        let replica = crate::store::lease::replica_held(small.filled().await);
        let tiers = &small.tiers;
        let refused = tiers.reserve_on(0, 1000).await;
        assert!(refused.is_err(), "the replica was spilled to make room");
        assert_eq!(replica.tier, Tier::Device(0));
        assert_eq!(small.budget.used(0), 1000);
        drop(replica);
        tiers
            .reserve_on(0, 1000)
            .await
            .expect("room once the lease ends");
    }

    /// Two requests need room on a full device at once, and spilling its one partition makes
    /// room for both. The second finds that partition held by the first's spill: it must wait
    /// for that spill, not fail.
    #[tokio::test]
    async fn a_request_for_room_waits_for_the_spill_another_is_making() {
        let backend: Arc<dyn Backend> = Arc::new(HostBackend::new());
        let data = backend
            .upload(0, crate::store::testing::batch(0..1000))
            .await
            .expect("upload");
        let budget = MemoryBudget::new(vec![Some(1000)]);
        let tiers = Tiers::new(backend, Arc::clone(&budget), 1 << 20, Arc::default());
        let charge = budget.try_reserve(0, 1000).expect("fits");
        let stored = tiers.hold(data, charge, 8000);
        let (first, second) = tokio::join!(tiers.reserve_on(0, 500), tiers.reserve_on(0, 500));
        first.expect("the first request's room");
        second.expect("the second request's room, from the same spill");
        assert_eq!(stored.tier(), Tier::Host);
    }

    /// The least recently used partition is too large for the host tier, a newer one is not:
    /// a request for room spills the newer one rather than giving up at the first.
    #[tokio::test]
    async fn a_partition_too_large_for_the_host_tier_does_not_stop_smaller_ones_going() {
        let small = SmallDevice::with_host_tier(700);
        let tiers = &small.tiers;
        let held = [small.holding(100, 800).await, small.holding(25, 200).await];
        let room = tiers.reserve_on(0, 200).await;
        assert_eq!(
            (held[0].tier(), held[1].tier()),
            (Tier::Device(0), Tier::Host)
        );
        room.expect("room from the smaller partition");
        assert!(
            tiers.reserve_on(0, 900).await.is_err(),
            "the larger cannot go"
        );
        assert_eq!(held[0].tier(), Tier::Device(0));
    }

    /// A partition too large for the host tier is passed over for a smaller one; the host
    /// tier's partitions that the data directory holds must not be evicted for it first,
    /// when evicting them all would not make it fit either.
    #[tokio::test]
    async fn nothing_is_evicted_from_the_host_tier_for_a_partition_that_cannot_fit_it() {
        let small = SmallDevice::with_host_tier(700);
        let tiers = &small.tiers;
        let held = [
            small.spilled_and_on_disk(25, 200).await,
            small.holding(100, 800).await,
            small.holding(20, 150).await,
        ];
        tiers
            .reserve_on(0, 200)
            .await
            .expect("room from the smallest");
        let placed: Vec<Tier> = held.iter().map(StoredPartition::tier).collect();
        assert_eq!(placed, [Tier::Host, Tier::Device(0), Tier::Host]);
    }

    /// A message the host tier pays for (no device had room for it) grows by evicting the
    /// host tier's partitions that the data directory holds, as one a device pays for
    /// evicts that device's.
    #[tokio::test]
    async fn a_message_in_the_host_tier_grows_by_evicting_what_the_disk_holds() {
        let small = SmallDevice::with_host_tier(700);
        let (tiers, budget) = (&small.tiers, &small.budget);
        let on_disk = small.spilled_and_on_disk(25, 200).await;
        let _full = budget.try_reserve(0, 1000).expect("the whole device");
        let mut message = tiers.reserve_message(100).expect("in the host tier");
        assert!(!message.is_of(budget));
        tiers
            .grow_message(&mut message, 450)
            .expect("room made by evicting");
        assert_eq!(on_disk.tier(), Tier::Disk);
        assert_eq!(message.bytes(), 550);
    }

    /// A shared-memory read's file grows by evicting partitions the data directory holds,
    /// as a put does: data on disk does not stand in the way of a copy handed out either.
    #[tokio::test]
    async fn a_host_copy_grows_by_evicting_what_the_disk_holds() {
        let small = SmallDevice::new();
        let on_disk = small.holding(25, 800).await;
        let data = Arc::clone(&on_disk.slot.resident().data);
        on_disk.slot.held_on_disk(data);
        let tiers = &small.tiers;
        let mut copy = tiers.reserve_host_copy(0).expect("nothing yet");
        tiers
            .grow_host_copy(&mut copy, 500)
            .expect("room made by evicting");
        assert_eq!(on_disk.tier(), Tier::Disk);
        assert_eq!(copy.bytes(), 500);
        assert!(
            tiers.grow_host_copy(&mut copy, 600).is_err(),
            "nothing more to evict"
        );
    }

    /// The host backend's uploads are done at once: held as partitions at once, they can be
    /// spilled by the next request for room, where a reservation waiting on a task for its
    /// put to look again could not (a put of three times a small device's budget failed).
    #[tokio::test]
    async fn an_upload_done_at_once_is_held_at_once() {
        let small = SmallDevice::new();
        let tiers = Arc::new(small.tiers);
        let reservation = small.budget.try_reserve(0, 800).expect("fits");
        let upload = tiers.upload(crate::store::testing::batch(0..100), reservation, None);
        let held = upload
            .now_or_never()
            .expect("held at once")
            .expect("uploaded");
        assert_eq!(held.tier(), Tier::Device(0));
    }
}
