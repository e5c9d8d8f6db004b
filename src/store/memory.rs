//! Memory accounting: a byte budget per device, RAII reservations against it, and what a
//! batch is charged.
//!
//! Every byte a dataset (or a put still in flight) holds is covered by a [`Reservation`]. The
//! reservation is released when it is dropped, so a put that fails or a client that vanishes
//! returns its memory by construction, with no cleanup path to forget. Counters are atomics:
//! reservations are taken per incoming batch on many tasks and must never block.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arrow::record_batch::RecordBatch;

use super::error::StoreError;
use crate::arrays::array_count;
use crate::backend::Backend;

/// What each array of a stored batch costs beyond its buffers (headers, `Arc`s, allocator
/// rounding): a batch of ten thousand one-row columns is not ten thousand bytes.
pub const ARRAY_OVERHEAD: u64 = 256;

/// What a partition of `rows` rows whose backend memory is `bytes` is charged: never less than
/// one bit a row. Null columns and zero-column batches hold no bytes yet may declare any
/// number of rows, and reading, planning and listing a dataset all do work per row; charging
/// the rows makes the memory limit bound that work too.
pub(crate) fn charge(bytes: u64, rows: u64) -> u64 {
    bytes.max(rows.div_ceil(8))
}

/// What keeping `batch` in `backend` is charged: its stored size (at least a bit a row) and
/// an overhead per array. Paid before the batch is uploaded anywhere.
pub(crate) fn stored_charge(backend: &dyn Backend, batch: &RecordBatch) -> Result<u64, StoreError> {
    let stored = backend.stored_size(batch)?;
    Ok(charge(stored, batch.num_rows() as u64)
        .saturating_add(ARRAY_OVERHEAD.saturating_mul(array_count(batch))))
}

/// Byte budgets for each device of the backend.
#[derive(Debug)]
pub struct MemoryBudget {
    devices: Vec<DeviceBudget>,
}

#[derive(Debug)]
struct DeviceBudget {
    limit: Option<u64>,
    used: AtomicU64,
}

impl MemoryBudget {
    /// One budget per device; `limits[i]` is device i's limit (`None`: unlimited).
    pub fn new(limits: Vec<Option<u64>>) -> Arc<Self> {
        Arc::new(Self {
            devices: limits
                .into_iter()
                .map(|limit| DeviceBudget {
                    limit,
                    used: AtomicU64::new(0),
                })
                .collect(),
        })
    }

    /// Reserves `bytes` on `device`, or fails without reserving anything.
    pub fn try_reserve(
        self: &Arc<Self>,
        device: u32,
        bytes: u64,
    ) -> Result<Reservation, StoreError> {
        let budget = self.device(device)?;
        let mut used = budget.used.load(Ordering::Relaxed);
        loop {
            let wanted = used.saturating_add(bytes);
            if let Some(limit) = budget.limit
                && wanted > limit
            {
                return Err(StoreError::MemoryExhausted {
                    device,
                    requested: bytes,
                    used,
                    limit,
                    host_backend: false,
                });
            }
            match budget.used.compare_exchange_weak(
                used,
                wanted,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    return Ok(Reservation {
                        budget: Arc::clone(self),
                        device,
                        bytes,
                    });
                }
                Err(actual) => used = actual,
            }
        }
    }

    /// Bytes reserved on `device` now: committed datasets plus puts in flight.
    pub fn used(&self, device: u32) -> u64 {
        self.devices
            .get(device as usize)
            .map_or(0, |d| d.used.load(Ordering::Acquire))
    }

    /// The limit of `device`, if any.
    pub fn limit(&self, device: u32) -> Option<u64> {
        self.devices.get(device as usize).and_then(|d| d.limit)
    }

    /// Bytes `device` can still reserve now (`u64::MAX` without a limit; 0 for no device).
    pub fn free(&self, device: u32) -> u64 {
        self.devices.get(device as usize).map_or(0, |d| {
            d.limit.map_or(u64::MAX, |limit| {
                limit.saturating_sub(d.used.load(Ordering::Acquire))
            })
        })
    }

    /// How many devices have budgets.
    pub fn devices(&self) -> u32 {
        self.devices.len() as u32
    }

    /// Fails for a device the backend does not have.
    pub fn check_device(&self, device: u32) -> Result<(), StoreError> {
        self.device(device).map(|_| ())
    }

    /// The device with the most free memory (the lowest number on a tie).
    pub fn freest_device(&self) -> u32 {
        (0..self.devices())
            .rev()
            .max_by_key(|&d| self.free(d))
            .unwrap_or(0)
    }

    /// Every device, the one with the most free memory first (the lower ordinal on a tie).
    pub fn freest_devices(&self) -> Vec<u32> {
        let mut devices: Vec<u32> = (0..self.devices().max(1)).collect();
        // Free bytes change as other puts reserve: read each once (see `spill_candidates`).
        devices.sort_by_cached_key(|&d| std::cmp::Reverse(self.free(d)));
        devices
    }

    fn device(&self, device: u32) -> Result<&DeviceBudget, StoreError> {
        self.devices
            .get(device as usize)
            .ok_or(StoreError::UnknownDevice {
                device,
                devices: self.devices(),
            })
    }
}

/// Bytes held against a device budget until dropped.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<MemoryBudget>,
    device: u32,
    bytes: u64,
}

impl Reservation {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The device whose budget pays for this reservation.
    pub fn device(&self) -> u32 {
        self.device
    }

    /// Whether `budget` pays for this reservation.
    pub fn is_of(&self, budget: &Arc<MemoryBudget>) -> bool {
        Arc::ptr_eq(&self.budget, budget)
    }

    /// Adds `bytes` to the reservation, or fails leaving it as it was.
    pub fn try_grow(&mut self, bytes: u64) -> Result<(), StoreError> {
        let mut more = self.budget.try_reserve(self.device, bytes)?;
        // The two now count as one: `more` must not give its bytes back when it goes.
        self.bytes += std::mem::take(&mut more.bytes);
        Ok(())
    }

    /// `bytes` of this reservation as one of their own, as far as it holds them, and the rest
    /// of `bytes` reserved anew (failing, with this one unchanged, where that does not fit).
    pub fn take(&mut self, bytes: u64) -> Result<Reservation, StoreError> {
        let moved = bytes.min(self.bytes);
        let mut taken = Reservation {
            budget: Arc::clone(&self.budget),
            device: self.device,
            bytes: moved,
        };
        self.bytes -= moved;
        if let Err(error) = taken.try_grow(bytes - moved) {
            self.bytes += moved;
            taken.bytes = 0;
            return Err(error);
        }
        Ok(taken)
    }

    /// Makes `other` part of this reservation, where both are of one budget and device;
    /// gives it back otherwise.
    pub fn absorb(&mut self, mut other: Reservation) -> Result<(), Reservation> {
        if !Arc::ptr_eq(&self.budget, &other.budget) || self.device != other.device {
            return Err(other);
        }
        // Its bytes are now this one's to give back.
        self.bytes = self.bytes.saturating_add(std::mem::take(&mut other.bytes));
        Ok(())
    }
}

impl Reservation {
    /// Makes the reservation exactly `bytes`: gives back what it holds beyond them, or adds
    /// what is missing (failing, unchanged, where that does not fit).
    pub fn resize(&mut self, bytes: u64) -> Result<(), StoreError> {
        if bytes > self.bytes {
            return self.try_grow(bytes - self.bytes);
        }
        if let Some(budget) = self.budget.devices.get(self.device as usize) {
            budget.used.fetch_sub(self.bytes - bytes, Ordering::AcqRel);
        }
        self.bytes = bytes;
        Ok(())
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if let Some(budget) = self.budget.devices.get(self.device as usize) {
            budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_respect_the_limit_and_return_on_drop() {
        let budget = MemoryBudget::new(vec![Some(100)]);
        let a = budget.try_reserve(0, 60).expect("fits");
        assert!(matches!(
            budget.try_reserve(0, 50),
            Err(StoreError::MemoryExhausted {
                used: 60,
                limit: 100,
                ..
            })
        ));
        assert_eq!(budget.used(0), 60);
        drop(a);
        assert_eq!(budget.used(0), 0);
        let _b = budget.try_reserve(0, 100).expect("fits after release");
    }

    #[test]
    fn an_absorbed_reservation_is_given_back_once_with_its_new_owner() {
        let budget = MemoryBudget::new(vec![Some(100), Some(100)]);
        let mut a = budget.try_reserve(0, 30).expect("fits");
        a.absorb(budget.try_reserve(0, 20).expect("fits"))
            .expect("same device");
        assert_eq!((a.bytes(), budget.used(0)), (50, 50));
        let elsewhere = a
            .absorb(budget.try_reserve(1, 10).expect("fits"))
            .expect_err("another device's");
        assert_eq!((a.bytes(), budget.used(1)), (50, 10));
        drop((a, elsewhere));
        assert_eq!((budget.used(0), budget.used(1)), (0, 0));
    }

    #[test]
    fn a_reservation_taken_from_another_moves_its_bytes_and_reserves_the_rest() {
        let budget = MemoryBudget::new(vec![Some(100)]);
        let mut room = budget.try_reserve(0, 50).expect("fits");
        let piece = room.take(30).expect("within the room");
        assert_eq!((piece.bytes(), room.bytes(), budget.used(0)), (30, 20, 50));
        let beyond = room.take(40).expect("20 of the room and 20 more");
        assert_eq!((beyond.bytes(), room.bytes(), budget.used(0)), (40, 0, 70));
        let _other = budget.try_reserve(0, 30).expect("fits");
        assert!(room.take(1).is_err(), "nothing left anywhere");
        assert_eq!((room.bytes(), budget.used(0)), (0, 100));
        drop((piece, beyond));
        assert_eq!(budget.used(0), 30);
    }

    #[test]
    fn reservations_grown_absorbed_or_taken_leave_their_budget_free_to_go() {
        let budget = MemoryBudget::new(vec![Some(100)]);
        let mut a = budget.try_reserve(0, 10).expect("fits");
        a.try_grow(10).expect("fits");
        a.absorb(budget.try_reserve(0, 10).expect("fits"))
            .expect("same device");
        let b = a.take(40).expect("fits");
        drop((a, b));
        assert_eq!(budget.used(0), 0);
        assert_eq!(
            Arc::strong_count(&budget),
            1,
            "a reservation leaked its budget"
        );
    }

    #[test]
    fn reservations_grow_within_the_limit() {
        let budget = MemoryBudget::new(vec![Some(100)]);
        let mut a = budget.try_reserve(0, 10).expect("fits");
        a.try_grow(80).expect("fits");
        assert!(a.try_grow(20).is_err());
        assert_eq!((a.bytes(), budget.used(0)), (90, 90));
        drop(a);
        assert_eq!(budget.used(0), 0);
    }

    #[test]
    fn reservations_resize_both_ways() {
        let budget = MemoryBudget::new(vec![Some(100)]);
        let mut a = budget.try_reserve(0, 50).expect("fits");
        a.resize(20).expect("shrinks");
        assert_eq!((a.bytes(), budget.used(0)), (20, 20));
        a.resize(90).expect("grows");
        assert!(a.resize(101).is_err(), "past the limit");
        assert_eq!((a.bytes(), budget.used(0)), (90, 90));
        drop(a);
        assert_eq!(budget.used(0), 0);
    }

    #[test]
    fn free_bytes_follow_each_device() {
        let budget = MemoryBudget::new(vec![Some(100), None]);
        let held = budget.try_reserve(0, 30).expect("fits");
        assert_eq!(
            (budget.free(0), budget.free(1), budget.free(2)),
            (70, u64::MAX, 0)
        );
        assert_eq!((held.device(), budget.devices()), (0, 2));
    }

    #[test]
    fn unknown_device_is_an_error() {
        let budget = MemoryBudget::new(vec![None]);
        assert!(matches!(
            budget.try_reserve(3, 1),
            Err(StoreError::UnknownDevice {
                device: 3,
                devices: 1
            })
        ));
    }
}
