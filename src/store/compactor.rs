//! The compactor: the one place partitions are joined into fewer, contiguous ones. A put's
//! batches at commit, a move's copies on their target, the pieces of a spilled or loaded
//! partition brought back onto a device, and (through `background`) appended partitions in the
//! background are all compacted here, paid for on the device before the backend copies, and
//! counted in the store's [`Stats`].

use std::sync::Arc;

use arrow::datatypes::Schema;
use arrow::record_batch::RecordBatch;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};

use super::error::StoreError;
use super::memory::{Reservation, charge, stored_charge};
use super::slot::{Resident, StoredPartition, Tier};
use super::stats::Stats;
use super::tier::Tiers;
use crate::backend::{Backend, BackendError};

/// Pieces a restore or load uploads at once.
const UPLOADS_AHEAD: usize = 3;

/// Where a compaction finds the memory for its copy when the device is full.
#[derive(Debug)]
pub(crate) enum Room {
    /// Spills other partitions to the host tier: the copy is part of a request (a put, a
    /// move) that asked for it.
    Spill,
    /// Only memory free now: a background compaction is an optimisation, and must not evict
    /// other datasets' partitions for itself.
    Free,
    /// Out of what the caller reserved for it (and, past that, as [`Room::Spill`]): a
    /// restore's room, made before its pieces were uploaded.
    Reserved(Reservation),
}

/// Compacts partitions on their devices, for every component that makes them.
#[derive(Debug)]
pub(crate) struct Compactor {
    backend: Arc<dyn Backend>,
    tiers: Arc<Tiers>,
    stats: Arc<Stats>,
}

impl Compactor {
    pub(crate) fn new(backend: Arc<dyn Backend>, tiers: Arc<Tiers>, stats: Arc<Stats>) -> Self {
        Self {
            backend,
            tiers,
            stats,
        }
    }

    /// Compacts each run of consecutive partitions on one device, on that device, keeping the
    /// runs in row order: a dataset spread across devices stays spread, each part compact.
    pub(crate) async fn compact_runs(
        &self,
        schema: &Schema,
        partitions: Vec<StoredPartition>,
    ) -> Result<Vec<StoredPartition>, StoreError> {
        let mut runs: Vec<(Tier, Vec<StoredPartition>)> = Vec::new();
        for partition in partitions {
            let tier = partition.tier();
            match runs.last_mut() {
                Some((run_tier, run)) if *run_tier == tier => run.push(partition),
                _ => runs.push((tier, vec![partition])),
            }
        }
        let mut compacted = Vec::new();
        for (tier, run) in runs {
            match tier {
                Tier::Device(device) => {
                    compacted.extend(self.compact(schema, run, device, Room::Spill).await?);
                }
                // Spilled while the put ran: compacted if it is ever restored.
                Tier::Host | Tier::Disk => compacted.extend(run),
            }
        }
        Ok(compacted)
    }

    /// Compacts partitions of `device` into one where the backend wants that (see
    /// [`Compactor::compact_always`]).
    pub(crate) async fn compact(
        &self,
        schema: &Schema,
        partitions: Vec<StoredPartition>,
        device: u32,
        room: Room,
    ) -> Result<Vec<StoredPartition>, StoreError> {
        if partitions.len() <= 1 {
            return Ok(partitions);
        }
        let data: Vec<_> = partitions
            .iter()
            .map(|p| p.slot.look(|resident| Arc::clone(&resident.data)))
            .collect();
        if !self.backend.compacts(schema, &data) {
            return Ok(partitions);
        }
        self.compact_always(partitions, device, room).await
    }

    /// Compacts partitions of `device` into one, reserving its memory first (as `room`
    /// allows): the inputs stay reserved until they are dropped, so the budget covers the
    /// transient peak. Partitions are returned unchanged where the compacted copy does not
    /// fit beside them, or the backend cannot compact them (a merged dictionary its keys
    /// cannot index).
    pub(crate) async fn compact_always(
        &self,
        partitions: Vec<StoredPartition>,
        device: u32,
        room: Room,
    ) -> Result<Vec<StoredPartition>, StoreError> {
        if partitions.len() <= 1 {
            return Ok(partitions);
        }
        let backend = &self.backend;
        // Held for the copy: a spill meanwhile must not free them.
        let residents: Vec<_> = partitions.iter().map(|p| p.slot.resident()).collect();
        // Spilled, or gone back to disk, since the caller looked: not the device's to copy
        // now (they are compacted if they are ever brought back).
        if residents.iter().any(|r| r.tier != Tier::Device(device)) {
            return Ok(partitions);
        }
        let data: Vec<_> = residents.iter().map(|r| Arc::clone(&r.data)).collect();
        let size = match backend.compacted_size(&data) {
            Ok(size) => size,
            Err(
                error @ (BackendError::UnsupportedType { .. } | BackendError::CannotCompact { .. }),
            ) => {
                tracing::info!(%error, "dataset kept in its uploaded batches");
                return Ok(partitions);
            }
            Err(error) => return Err(error.into()),
        };
        let rows = partitions.iter().map(|p| p.num_rows() as u64).sum();
        let cost = charge(size, rows);
        let reserved = match room {
            Room::Spill => self.tiers.reserve_on(device, cost).await,
            Room::Free => self.tiers.budget().try_reserve(device, cost),
            Room::Reserved(mut room) => match room.take(cost) {
                Ok(taken) => Ok(taken),
                Err(_) => {
                    drop(room);
                    self.tiers.reserve_on(device, cost).await
                }
            },
        };
        let reservation = match reserved {
            Ok(reservation) => reservation,
            Err(
                StoreError::MemoryExhausted {
                    requested,
                    used,
                    limit,
                    ..
                }
                | StoreError::TiersExhausted {
                    requested,
                    used,
                    limit,
                    ..
                },
            ) => {
                // The rows are stored and paid for already; only the compact copy does not
                // fit beside them. Keep the batches as they are rather than fail a put whose
                // data fits (reads and ipc-export serve them as they are).
                tracing::info!(
                    device,
                    partitions = partitions.len(),
                    requested,
                    used,
                    limit,
                    "batches kept uncompacted: no room for their compact copy"
                );
                return Ok(partitions);
            }
            Err(error) => return Err(error),
        };
        let data_bytes = partitions.iter().map(|p| p.data_bytes).sum();
        let started = std::time::Instant::now();
        let compacted = backend.compact(data).await?;
        drop(residents);
        let stats = &self.stats;
        Stats::add(&stats.compactions, 1);
        Stats::add(&stats.compacted_bytes, data_bytes);
        Stats::add_time(&stats.compaction_nanos, started);
        Ok(vec![self.tiers.hold(compacted, reservation, data_bytes)])
    }

    /// `pieces` (consecutive rows of one schema) uploaded onto `device` and compacted
    /// there into one partition. Room for `peak` bytes is reserved first, where moving others
    /// can give it; else the pieces are joined on the host first where it has the memory for
    /// that ([`host_can_join`]), so that the device holds their rows only once (and room for
    /// that is reserved), or else room for `data_bytes`. Each piece is paid for out of that
    /// room (and beyond it, where it holds too little) before it is uploaded, and is held
    /// until compacted, so that no request for room spills it meanwhile.
    pub(crate) async fn upload_pieces(
        &self,
        pieces: BoxStream<'static, Result<RecordBatch, StoreError>>,
        peak: u64,
        device: u32,
        data_bytes: u64,
    ) -> Result<StoredPartition, StoreError> {
        let tiers = &self.tiers;
        let started = std::time::Instant::now();
        // Reserved, not only made: another request could take room only made.
        let (mut room, pieces) = match tiers.reserve_on(device, peak).await {
            Ok(room) => (room, pieces),
            Err(_) if host_can_join(peak) => {
                // No room for the pieces and their compacted copy beside them: joined on the
                // host first, they need room for their rows once.
                let pieces = joined_on_the_host(pieces).await?;
                let charge = match &pieces {
                    Joined::One(joined) => stored_charge(self.backend.as_ref(), joined)?,
                    Joined::Apart(_) => data_bytes.min(peak),
                };
                let room = match tiers.reserve_on(device, charge).await {
                    Ok(room) => room,
                    Err(_) => tiers.budget().try_reserve(device, 0)?,
                };
                (room, pieces.stream())
            }
            Err(_) => {
                // Nor on the host: uploaded as they come, and compacted where that fits.
                let room = match tiers.reserve_on(device, data_bytes.min(peak)).await {
                    Ok(room) => room,
                    Err(_) => tiers.budget().try_reserve(device, 0)?,
                };
                (room, pieces)
            }
        };
        let room_made = started.elapsed();
        let tiers = Arc::clone(tiers);
        let backend = &self.backend;
        let uploaded: Vec<(StoredPartition, Arc<Resident>)> = pieces
            // Each paid for in order, before its upload starts.
            .map(|piece| {
                let piece = piece?;
                let charge = stored_charge(backend.as_ref(), &piece)?;
                let reservation = room.take(charge).map_err(|error| tiers.tiers_full(error))?;
                let upload = tiers.upload(piece, reservation, None);
                Ok(async move {
                    let stored = upload.await?;
                    let held = stored.slot.resident();
                    Ok::<_, StoreError>((stored, held))
                })
            })
            .try_buffered(UPLOADS_AHEAD)
            .try_collect()
            .await?;
        let (uploaded, held): (Vec<_>, Vec<_>) = uploaded.into_iter().unzip();
        let total: u64 = uploaded.iter().map(StoredPartition::memory_bytes).sum();
        let pieces = uploaded.len();
        let uploaded_at = started.elapsed();
        if uploaded.is_empty() {
            return Err(
                BackendError::Device("a partition without rows to upload".to_owned()).into(),
            );
        }
        // Compacted whether or not the backend compacts puts (a slot holds one partition),
        // out of what is left of the room.
        let mut compacted = self
            .compact_always(uploaded, device, Room::Reserved(room))
            .await?;
        drop(held);
        tracing::debug!(
            pieces,
            room_ms = room_made.as_secs_f64() * 1e3,
            upload_ms = (uploaded_at - room_made).as_secs_f64() * 1e3,
            compact_ms = (started.elapsed() - uploaded_at).as_secs_f64() * 1e3,
            "pieces uploaded as one partition"
        );
        match (compacted.pop(), compacted.is_empty()) {
            (Some(mut partition), true) => {
                partition.data_bytes = data_bytes;
                Ok(partition)
            }
            _ => Err(self.tiers.tiers_full(StoreError::MemoryExhausted {
                device,
                requested: total,
                used: self.tiers.budget().used(device),
                limit: self.tiers.budget().limit(device).unwrap_or(u64::MAX),
                host_backend: false,
            })),
        }
    }
}

/// Pieces read onto the host to be uploaded: joined into one batch, or left apart where they
/// cannot be joined (a string column past Arrow's 2 GiB of 32-bit offsets).
enum Joined {
    One(RecordBatch),
    Apart(Vec<RecordBatch>),
}

impl Joined {
    fn stream(self) -> BoxStream<'static, Result<RecordBatch, StoreError>> {
        let batches = match self {
            Joined::One(joined) => vec![joined],
            Joined::Apart(pieces) => pieces,
        };
        futures::stream::iter(batches.into_iter().map(Ok)).boxed()
    }
}

/// Whether the host may join pieces that a device needs `peak` bytes to compact: the join
/// holds them all and their joined copy (about `peak`) in host memory that no budget pays
/// for, so only where the host has twice that available, and never its last memory.
fn host_can_join(peak: u64) -> bool {
    crate::backend::host_memory_available().is_some_and(|available| available / 2 >= peak)
}

/// `pieces`, read, and joined on the host where they can be.
async fn joined_on_the_host(
    pieces: BoxStream<'static, Result<RecordBatch, StoreError>>,
) -> Result<Joined, StoreError> {
    let pieces: Vec<RecordBatch> = pieces.try_collect().await?;
    if pieces.len() <= 1 {
        return Ok(Joined::Apart(pieces));
    }
    let joined = tokio::task::spawn_blocking(move || {
        let schema = pieces[0].schema();
        match arrow::compute::concat_batches(&schema, &pieces) {
            Ok(joined) => Joined::One(joined),
            Err(error) => {
                tracing::info!(%error, "pieces kept apart: they do not join");
                Joined::Apart(pieces)
            }
        }
    })
    .await
    .map_err(|e| BackendError::Device(format!("a join task failed: {e}")))?;
    Ok(joined)
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::backend::HostBackend;
    use crate::store::memory::MemoryBudget;
    use crate::store::testing::batch;

    /// A compactor over the host backend with one device of 64 KiB and a host tier of 1 GiB.
    fn small_device() -> (Arc<dyn Backend>, Arc<MemoryBudget>, Arc<Tiers>, Compactor) {
        let backend: Arc<dyn Backend> = Arc::new(HostBackend::new());
        let budget = MemoryBudget::new(vec![Some(64 << 10)]);
        let stats = Arc::new(Stats::default());
        let tiers = Arc::new(Tiers::new(
            Arc::clone(&backend),
            Arc::clone(&budget),
            1 << 30,
            Arc::clone(&stats),
        ));
        let compactor = Compactor::new(Arc::clone(&backend), Arc::clone(&tiers), stats);
        (backend, budget, tiers, compactor)
    }

    /// A restore makes room for its pieces by spilling others. Another request that takes
    /// memory while the pieces upload must not take that room: the pieces would find none.
    #[tokio::test]
    async fn the_room_made_for_pieces_is_theirs_while_they_upload() {
        let (backend, budget, tiers, compactor) = small_device();
        let filler = backend.upload(0, batch(0..10)).await.expect("upload");
        let charge = budget.try_reserve(0, budget.free(0)).expect("the rest");
        let filler = tiers.hold(filler, charge, 80);

        // The other request takes all that is free as the second piece comes.
        let taken = Arc::new(Mutex::new(None));
        let pieces = futures::stream::iter([batch(0..1000), batch(1000..2000)])
            .enumerate()
            .map({
                let (budget, taken) = (Arc::clone(&budget), Arc::clone(&taken));
                move |(index, piece)| {
                    if index == 1 {
                        let free = budget.free(0);
                        *taken.lock().expect("lock") = budget.try_reserve(0, free).ok();
                    }
                    Ok(piece)
                }
            })
            .boxed();
        let charge = stored_charge(backend.as_ref(), &batch(0..1000)).expect("charge");
        let restored = compactor
            .upload_pieces(pieces, 4 * charge, 0, 16_000)
            .await
            .expect("the pieces had the room made for them");
        assert_eq!(restored.num_rows(), 2000);
        assert_eq!(filler.tier(), Tier::Host, "spilled to make the room");
        assert!(
            taken.lock().expect("lock").is_some(),
            "the other request ran"
        );
    }

    /// A restore's compaction takes its memory out of the room reserved before the pieces
    /// were uploaded: what is left of that room is never free for another request to take
    /// between the uploads and the compaction.
    #[tokio::test]
    async fn a_compaction_out_of_reserved_room_needs_nothing_free() {
        let (backend, budget, tiers, compactor) = small_device();
        let mut pieces = Vec::new();
        for rows in [0..1000, 1000..2000] {
            let piece = batch(rows);
            let charge = stored_charge(backend.as_ref(), &piece).expect("charge");
            let reservation = budget.try_reserve(0, charge).expect("fits");
            pieces.push(
                tiers
                    .upload(piece, reservation, None)
                    .await
                    .expect("upload"),
            );
        }
        let held: Vec<_> = pieces.iter().map(|p| p.slot.resident()).collect();
        let room = budget.try_reserve(0, 20_000).expect("fits");
        let _everything_else = budget.try_reserve(0, budget.free(0)).expect("the rest");
        let compacted = compactor
            .compact_always(pieces.clone(), 0, Room::Spill)
            .await
            .expect("kept as they are");
        assert_eq!(compacted.len(), 2, "no room beside the room reserved");
        let compacted = compactor
            .compact_always(pieces, 0, Room::Reserved(room))
            .await
            .expect("compacted");
        assert_eq!(compacted.len(), 1, "out of the room reserved");
        assert_eq!(compacted[0].num_rows(), 2000);
        drop(held);
    }
}
