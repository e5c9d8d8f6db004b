//! A partition's place in the memory tiers: which [`Tier`] its rows are in, and what pays for
//! them there.
//!
//! A partition's place is a [`Slot`] shared by every dataset version that includes it (appends
//! share their base's partitions), so a spill frees the memory once for all of them. What a
//! slot holds is a [`Resident`]: the data and the reservation that pays for it, swapped as a
//! whole. Readers, exports and copies clone the `Arc<Resident>` they work on, so a spill never
//! frees memory under them: the old resident's memory (and its charge) goes when the last of
//! them is done. Such held partitions are not spilled at all, since that would free nothing.
//! A look at a partition (its tier, its size) borrows its resident instead of cloning it, so
//! that looking never makes a partition look held.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock};

use super::memory::Reservation;
use crate::backend::Partition;

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

/// A partition of a dataset: its place in the memory tiers, which every dataset version
/// including it shares. Opaque outside the store, where it is what an upload of a put
/// resolves to.
#[derive(Clone)]
pub struct StoredPartition {
    pub(crate) slot: Arc<Slot>,
    /// Bytes of Arrow buffers the partition's rows hold (what clients transfer); what it is
    /// charged may be more, by the backend's allocation granularity.
    pub(crate) data_bytes: u64,
}

impl StoredPartition {
    /// The device the partition was stored on, where it is restored to if spilled: the one
    /// whose rows `GetFlightInfo` places it on.
    pub(crate) fn device(&self) -> u32 {
        self.slot.home()
    }

    /// Where its data is now.
    pub(crate) fn tier(&self) -> Tier {
        self.slot.look(|resident| resident.tier)
    }

    pub(crate) fn num_rows(&self) -> usize {
        self.slot.look(|resident| resident.data.num_rows())
    }

    /// Bytes its tier is charged for it now.
    pub(crate) fn memory_bytes(&self) -> u64 {
        self.slot.look(|resident| resident.reservation.bytes())
    }
}

impl fmt::Debug for StoredPartition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoredPartition")
            .field(
                "resident",
                &self.slot.look(|resident| format!("{resident:?}")),
            )
            .field("data_bytes", &self.data_bytes)
            .finish()
    }
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
    /// A partition of `data` paid for by `reservation`, in `tier`, stored on device `home`.
    pub(crate) fn new(
        tier: Tier,
        home: u32,
        data: Arc<dyn Partition>,
        reservation: Reservation,
    ) -> Self {
        Self {
            home,
            last_used: AtomicU64::new(tick()),
            moving: tokio::sync::Mutex::new(()),
            // A partition only on disk is where it goes back to: it is held there as it is.
            on_disk: match tier {
                Tier::Disk => OnceLock::from(Arc::clone(&data)),
                _ => OnceLock::new(),
            },
            resident: RwLock::new(Arc::new(Resident {
                data,
                reservation,
                tier,
            })),
        }
    }

    /// What the partition holds now, held until the returned `Arc` is dropped: a spill
    /// meanwhile frees nothing, so none is made (see [`Slot::movable_from`]).
    pub(crate) fn resident(&self) -> Arc<Resident> {
        Arc::clone(&self.resident.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// `f` of what the partition holds now, without holding it: for a look (its tier, its
    /// size), which must not, even for an instant, make it look held to a request that is
    /// choosing partitions to spill.
    pub(crate) fn look<T>(&self, f: impl FnOnce(&Resident) -> T) -> T {
        f(&self.resident.read().unwrap_or_else(|p| p.into_inner()))
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
    pub(crate) fn held_on_disk(&self, files: Arc<dyn Partition>) {
        let _ = self.on_disk.set(files);
    }

    /// Held by whoever moves the partition between tiers.
    pub(crate) fn moving(&self) -> &tokio::sync::Mutex<()> {
        &self.moving
    }

    pub(crate) fn replace(&self, resident: Arc<Resident>) -> Arc<Resident> {
        let mut current = self.resident.write().unwrap_or_else(|p| p.into_inner());
        std::mem::replace(&mut *current, resident)
    }

    /// When it was last used, on [`tick`]'s clock.
    pub(crate) fn last_used(&self) -> u64 {
        self.last_used.load(Ordering::Relaxed)
    }

    /// Its rows on disk, where the data directory holds them as they are (see
    /// [`Slot::held_on_disk`]).
    pub(crate) fn on_disk(&self) -> Option<&Arc<dyn Partition>> {
        self.on_disk.get()
    }

    /// Whether moving it out of `tier` would free anything: no reader, export or copy holds
    /// the resident.
    pub(crate) fn movable_from(&self, tier: Tier) -> bool {
        let resident = self.resident.read().unwrap_or_else(|p| p.into_inner());
        resident.tier == tier && Arc::strong_count(&resident) == 1
    }
}
