//! Whole allocations between host memory and the device, a staging buffer's worth at a time.
//!
//! An upload of a large batch (a restore brings a spilled partition back as one) and a spill's
//! copy of a whole partition ([`host_copy`]) go through staging in pieces of at most
//! [`PIECE_BYTES`], so neither pins more than two pieces however large it is. Two lanes, each
//! with its own staging buffer and stream, take alternate pieces: while one lane's piece
//! crosses the link, the other copies its own on the CPU (into staging for an upload, out of
//! it for a spill), so the link does not wait for each piece's CPU copy.
//!
//! A spill keeps the allocation's bytes as they are: the host copy's arrays lie at the same
//! offsets in one host buffer per allocation, so a restore uploads them in the same layout,
//! into one allocation, without a concatenation.
//!
//! Where the backend has pinned host memory (`--pinned-host-memory`) and a block of it is
//! free, a spill copies the allocation straight into that block instead, with no staging and
//! no CPU copy; an upload whose buffers all lie there (a restore of such a copy, or a `DoPut`
//! batch whose message body lies there) copies them straight to the device, one copy per run
//! of buffers that follow each other without a gap there as on the device
//! (`layout::copy_runs`). Spills through staging reach 15-21 GB/s against the link's 52-55,
//! bound by the cores' copy out of staging (19-26 GB/s alone on the H200 machine), not by
//! faulting in fresh host memory: in huge pages, or faulted in first, they spilled no faster.

use std::mem::MaybeUninit;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arrow::array::{ArrayData, ArrayDataBuilder, make_array};
use arrow::buffer::{BooleanBuffer, Buffer, NullBuffer};
use arrow::record_batch::{RecordBatch, RecordBatchOptions};
use rayon::prelude::*;

use super::ffi::{self, DeviceAllocation, PinnedArena, Span};
use super::layout::{self, DeviceArray, UploadPlan};
use super::{CudaPartition, Shared};
use crate::backend::BackendError;

/// The most bytes one piece of a transfer stages.
pub(super) const PIECE_BYTES: usize = 64 << 20;
/// Pieces in flight at once, each in its own lane.
const LANES: usize = 2;

/// The pieces of `0..len` that lane `lane` of `lanes` takes.
fn lane_pieces(len: usize, lane: usize, lanes: usize) -> impl Iterator<Item = Range<usize>> {
    (0..len)
        .step_by(PIECE_BYTES)
        .skip(lane)
        .step_by(lanes)
        .map(move |start| start..(start + PIECE_BYTES).min(len))
}

/// Runs `lane(0)` here and the other lanes on threads of their own, and gives the first error.
/// A lane that fails raises the flag every lane is given, so the others stop at their next
/// piece instead of finishing a transfer that has already failed.
fn in_lanes(
    lanes: usize,
    lane: impl Fn(usize, &AtomicBool) -> Result<(), BackendError> + Sync,
) -> Result<(), BackendError> {
    let failed = AtomicBool::new(false);
    // The error of the lane that failed first: the others' only say they stopped.
    let first = Mutex::new(None);
    let run = |index: usize| {
        let result = lane(index, &failed);
        if let Err(error) = result {
            if failed.swap(true, Ordering::AcqRel) {
                return Err(error);
            }
            *lock(&first) = Some(error);
            return Err(BackendError::Device("a transfer lane failed".to_owned()));
        }
        Ok(())
    };
    let result = if lanes <= 1 {
        run(0)
    } else {
        all_lanes(lanes, &run)
    };
    match lock(&first).take() {
        Some(error) => Err(error),
        None => result,
    }
}

fn all_lanes(
    lanes: usize,
    run: &(impl Fn(usize) -> Result<(), BackendError> + Sync),
) -> Result<(), BackendError> {
    std::thread::scope(|scope| {
        let others: Vec<_> = (1..lanes)
            .map(|index| scope.spawn(move || run(index)))
            .collect();
        let mut result = run(0);
        for other in others {
            let joined = other.join().unwrap_or_else(|_| {
                Err(BackendError::Device("a transfer lane panicked".to_owned()))
            });
            result = result.and(joined);
        }
        result
    })
}

/// Stops a lane before its next piece when another lane failed.
fn another_failed(failed: &AtomicBool) -> Result<(), BackendError> {
    if failed.load(Ordering::Acquire) {
        return Err(BackendError::Device(
            "another piece of this transfer failed".to_owned(),
        ));
    }
    Ok(())
}

/// Time an upload spent filling staging and waiting for its copies, summed over its lanes.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct UploadTimes {
    pub(super) fill: Duration,
    pub(super) copy: Duration,
    /// Stream synchronizations the upload waited for.
    pub(super) syncs: u64,
}

/// Copies `plan`'s host bytes into `allocation` from its start, in pieces (see the module
/// docs).
pub(super) fn upload(
    shared: &Shared,
    plan: &UploadPlan,
    allocation: &DeviceAllocation,
) -> Result<UploadTimes, BackendError> {
    if let Some(arena) = shared.pinned.ready()
        && let Some(runs) = direct_runs(arena, plan)
    {
        return upload_pinned(shared, plan, &runs, allocation);
    }
    let len = plan.used_bytes;
    if len == 0 {
        // No piece to end with the tail: all of it is tail.
        shared.with_stream(|stream| stream.copies(|batch| zero_tail(batch, allocation, 0)))?;
        return Ok(UploadTimes {
            syncs: 1,
            ..UploadTimes::default()
        });
    }
    let lanes = if len > PIECE_BYTES { LANES } else { 1 };
    let times = std::sync::Mutex::new(UploadTimes::default());
    in_lanes(lanes, |lane, failed| {
        let mut staging = shared.pool.lease(len.min(PIECE_BYTES))?;
        let mut spent = UploadTimes::default();
        for piece in lane_pieces(len, lane, lanes) {
            another_failed(failed)?;
            let started = Instant::now();
            layout::fill_staging(plan, piece.clone(), staging.buffer_mut().as_mut_slice());
            let filled = Instant::now();
            shared.with_stream(|stream| {
                stream.copies(|batch| {
                    batch.copy_to_device(
                        allocation,
                        piece.start,
                        staging.as_ref(),
                        0..piece.len(),
                    )?;
                    if piece.end == len {
                        zero_tail(batch, allocation, len)?;
                    }
                    Ok(())
                })
            })?;
            spent.fill += filled - started;
            spent.copy += filled.elapsed();
        }
        let mut total = times.lock().unwrap_or_else(|p| p.into_inner());
        total.fill += spent.fill;
        total.copy += spent.copy;
        Ok(())
    })?;
    let mut times = times.into_inner().unwrap_or_else(|p| p.into_inner());
    times.syncs = len.div_ceil(PIECE_BYTES) as u64;
    Ok(times)
}

/// Zeroes `allocation` past `end`: the rounding of its size, which `ipc-export` consumers map
/// with the rest, must not show what the memory held before.
fn zero_tail<'a>(
    batch: &mut ffi::CopyBatch<'a>,
    allocation: &'a DeviceAllocation,
    end: usize,
) -> Result<(), BackendError> {
    let len = allocation.bytes().saturating_sub(end);
    if len == 0 {
        return Ok(());
    }
    batch.zero(Span {
        allocation,
        offset: end,
        len,
    })
}

/// Zeroes whatever of `allocation` lies outside `arrays` (each with the offset it lies at
/// there): the gaps between their regions and the allocation's tail (`layout::gaps`), which
/// would otherwise show what the memory held before to a consumer that maps it.
pub(super) fn zero_gaps<'a>(
    batch: &mut ffi::CopyBatch<'a>,
    allocation: &'a DeviceAllocation,
    arrays: &[(&DeviceArray, usize)],
) -> Result<(), BackendError> {
    let mut regions = Vec::new();
    for (array, at) in arrays {
        let start = regions.len();
        array.collect_regions(&mut regions);
        for region in &mut regions[start..] {
            region.offset += at;
        }
    }
    for gap in layout::gaps(&mut regions, allocation.bytes()) {
        batch.zero(Span {
            allocation,
            offset: gap.offset,
            len: gap.len,
        })?;
    }
    Ok(())
}

/// Copies smaller than this, on average, are staged even from pinned memory: each copy of its
/// own costs the driver microseconds, more than staging so few bytes does.
const DIRECT_MIN_AVERAGE_BYTES: usize = 64 << 10;

/// The buffers `plan` uploads, grouped into one copy per run of them that follow each other
/// without a gap in pinned host memory as on the device (`layout::copy_runs`): `None` unless
/// every buffer lies in a block of the pinned memory in use and the copies are large enough on
/// average to be made one by one.
fn direct_runs<'p>(arena: &PinnedArena, plan: &'p UploadPlan) -> Option<Vec<Run<'p>>> {
    let sources = plan
        .sources
        .iter()
        .filter(|(region, _)| region.len > 0)
        .map(|(region, source)| {
            let bytes = source.as_slice().get(..region.len)?;
            arena.holds(bytes).then_some((*region, bytes))
        })
        .collect::<Option<Vec<_>>>()?;
    let addresses: Vec<(layout::Region, usize)> = sources
        .iter()
        .map(|(region, bytes)| (*region, bytes.as_ptr() as usize))
        .collect();
    let runs = layout::copy_runs(&addresses, |span| arena.holds_addresses(span));
    if runs.is_empty() || plan.used_bytes < runs.len().saturating_mul(DIRECT_MIN_AVERAGE_BYTES) {
        return None;
    }
    runs.into_iter()
        .map(|run| {
            let (first_region, first) = sources[run.start];
            let (last_region, last) = sources[run.end - 1];
            Some(Run {
                offset: first_region.offset,
                end: last_region.offset + last_region.len,
                bytes: arena.span(first, last)?,
            })
        })
        .collect()
}

/// One host-to-device copy of an upload from pinned memory: `bytes` to `offset..end`.
struct Run<'p> {
    offset: usize,
    end: usize,
    bytes: &'p [u8],
}

/// Uploads `runs` of a plan whose buffers all lie in pinned host memory straight from there:
/// one copy per run, the gaps between runs (and the allocation's tail) zeroed on the device,
/// as staging would have, all on one stream with one synchronization.
fn upload_pinned(
    shared: &Shared,
    plan: &UploadPlan,
    runs: &[Run<'_>],
    allocation: &DeviceAllocation,
) -> Result<UploadTimes, BackendError> {
    let started = Instant::now();
    shared.with_stream(|stream| {
        stream.copies(|batch| {
            let mut at = 0;
            for run in runs {
                if run.offset > at {
                    batch.zero(Span {
                        allocation,
                        offset: at,
                        len: run.offset - at,
                    })?;
                }
                if run.bytes.len() != run.end - run.offset {
                    return Err(BackendError::Device(
                        "an upload's run of buffers does not span its regions".to_owned(),
                    ));
                }
                batch.copy_arena_to_device(allocation, run.offset, run.bytes)?;
                at = at.max(run.end);
            }
            zero_tail(batch, allocation, at)
        })
    })?;
    let counters = &shared.counters;
    counters
        .pinned_upload_copies
        .fetch_add(1, Ordering::Relaxed);
    counters
        .pinned_upload_runs
        .fetch_add(runs.len() as u64, Ordering::Relaxed);
    counters
        .pinned_upload_bytes
        .fetch_add(plan.used_bytes as u64, Ordering::Relaxed);
    Ok(UploadTimes {
        fill: Duration::ZERO,
        copy: started.elapsed(),
        syncs: 1,
    })
}

/// `partition` in host memory: each allocation's bytes up to the last one an array uses,
/// copied in pieces (see the module docs) into one host buffer, and the columns as arrays at
/// the same offsets there.
///
/// `cancelled` stops the copy between pieces: its caller went away, and nothing would keep
/// or pay for the copy.
pub(super) fn host_copy(
    shared: &Shared,
    partition: &CudaPartition,
    cancelled: &AtomicBool,
) -> Result<RecordBatch, BackendError> {
    let images = partition
        .allocations
        .iter()
        .enumerate()
        .map(|(index, allocation)| {
            let used = partition
                .columns
                .iter()
                .filter(|(at, _)| *at == index)
                .map(|(_, array)| end_of(array))
                .max()
                .unwrap_or(0);
            download(shared, &allocation.inner, used, cancelled)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let columns = partition
        .columns
        .iter()
        .map(|(allocation, array)| host_array(array, &images[*allocation]).map(make_array))
        .collect::<Result<Vec<_>, _>>()?;
    RecordBatch::try_new_with_options(
        Arc::clone(&partition.schema),
        columns,
        &RecordBatchOptions::new().with_row_count(Some(partition.rows)),
    )
    .map_err(|e| BackendError::Device(format!("rebuilding a partition copied to the host: {e}")))
}

/// The first byte past every region of `array` (its children's included).
fn end_of(array: &DeviceArray) -> usize {
    let own = array
        .validity
        .iter()
        .chain(&array.buffers)
        .map(|region| region.offset + region.len)
        .max()
        .unwrap_or(0);
    array.children.iter().map(end_of).fold(own, usize::max)
}

/// A lane's pieces of a host buffer: where each starts in the allocation, and its bytes.
type LaneTargets<'a> = Vec<(usize, &'a mut [MaybeUninit<u8>])>;

/// The first `len` bytes of `allocation` in a host buffer of their own, written without
/// being zeroed first (`ffi::host_buffer_written`).
pub(super) fn download(
    shared: &Shared,
    allocation: &DeviceAllocation,
    len: usize,
    cancelled: &AtomicBool,
) -> Result<Buffer, BackendError> {
    // Spills hold their blocks until restored: at most half of the memory, so that message
    // bodies always find room.
    let block = shared
        .pinned
        .ready()
        .and_then(|arena| arena.take_within(len, arena.len() / 2));
    if let Some(mut block) = block {
        // Straight into pinned memory: a piece at a time only so that a caller that went
        // away stops it early.
        shared.with_stream(|stream| {
            for (index, piece) in block.as_mut_slice().chunks_mut(PIECE_BYTES).enumerate() {
                stop_if_cancelled(cancelled)?;
                stream
                    .copies(|batch| batch.copy_to_host(piece, allocation, index * PIECE_BYTES))?;
            }
            Ok(())
        })?;
        let counters = &shared.counters;
        counters.pinned_spill_copies.fetch_add(1, Ordering::Relaxed);
        counters
            .pinned_spill_bytes
            .fetch_add(len as u64, Ordering::Relaxed);
        return Ok(block.into_buffer());
    }
    let lanes = if len > PIECE_BYTES { LANES } else { 1 };
    let times = Mutex::new(SpillTimes::default());
    let image = ffi::host_buffer_written(
        len,
        |image| {
            let mut targets: Vec<LaneTargets<'_>> = (0..lanes).map(|_| Vec::new()).collect();
            for (index, chunk) in image.chunks_mut(PIECE_BYTES).enumerate() {
                targets[index % lanes].push((index * PIECE_BYTES, chunk));
            }
            // Each lane takes its own list once, and hands back what it wrote.
            let targets: Vec<Mutex<Vec<_>>> = targets.into_iter().map(Mutex::new).collect();
            let written = Mutex::new(Vec::new());
            in_lanes(lanes, |lane, failed| {
                let pieces = std::mem::take(&mut *lock(&targets[lane]));
                let Some(largest) = pieces.iter().map(|(_, target)| target.len()).max() else {
                    return Ok(());
                };
                let mut spent = SpillTimes::default();
                let started = Instant::now();
                // Under the read cap, like the reads a spill made before.
                let mut staging = shared.pool.lease_for_read(largest)?;
                spent.lease += started.elapsed();
                for (start, target) in pieces {
                    another_failed(failed)?;
                    stop_if_cancelled(cancelled)?;
                    let started = Instant::now();
                    let staged = &mut staging.buffer_mut().as_mut_slice()[..target.len()];
                    shared.with_stream(|stream| {
                        stream.copies(|batch| batch.copy_to_host(staged, allocation, start))
                    })?;
                    let copied = Instant::now();
                    let written_now =
                        write_all(&staging.as_ref().as_slice()[..target.len()], target);
                    spent.copy += copied - started;
                    spent.write += copied.elapsed();
                    lock(&written).extend(written_now);
                }
                lock(&times).add(&spent);
                Ok(())
            })?;
            Ok(written.into_inner().unwrap_or_else(|p| p.into_inner()))
        },
        || BackendError::Device("a host copy was left incomplete".to_owned()),
    )?;
    // Counted once the whole copy is done, as uploads are: times of a copy that failed would
    // stand beside no bytes.
    let times = times.into_inner().unwrap_or_else(|p| p.into_inner());
    times.add_to(&shared.counters, len);
    Ok(image)
}

/// Time a spill through staging spent, summed over its lanes: leasing staging buffers,
/// waiting for the device-to-host copies, and writing out of staging into the host buffer.
#[derive(Debug, Default)]
struct SpillTimes {
    lease: Duration,
    copy: Duration,
    write: Duration,
}

impl SpillTimes {
    fn add(&mut self, lane: &SpillTimes) {
        self.lease += lane.lease;
        self.copy += lane.copy;
        self.write += lane.write;
    }

    /// Adds one allocation's copy of `bytes` to the backend's counters.
    fn add_to(&self, counters: &super::Counters, bytes: usize) {
        use super::add_time as add;
        counters.staged_spill_copies.fetch_add(1, Ordering::Relaxed);
        counters
            .staged_spill_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
        add(&counters.staged_spill_lease_ns, self.lease);
        add(&counters.staged_spill_copy_ns, self.copy);
        add(&counters.staged_spill_write_ns, self.write);
    }
}

fn stop_if_cancelled(cancelled: &AtomicBool) -> Result<(), BackendError> {
    if cancelled.load(Ordering::Acquire) {
        return Err(BackendError::Device(
            "a host copy was given up by its caller".to_owned(),
        ));
    }
    Ok(())
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// Writes `source` into `target` (of its length), on several cores where it is large; the
/// written pieces.
fn write_all<'a>(source: &[u8], target: &'a mut [MaybeUninit<u8>]) -> Vec<&'a mut [u8]> {
    const SPLIT: usize = 2 << 20;
    if source.len() < 2 * SPLIT {
        return vec![ffi::write_bytes(target, source)];
    }
    source
        .par_chunks(SPLIT)
        .zip(target.par_chunks_mut(SPLIT))
        .map(|(from, to)| ffi::write_bytes(to, from))
        .collect()
}

/// `array` as Arrow data over `image`, which holds its allocation's bytes at their offsets.
fn host_array(array: &DeviceArray, image: &Buffer) -> Result<ArrayData, BackendError> {
    let slice = |region: &layout::Region| {
        if region.offset + region.len > image.len() {
            return Err(BackendError::Device(format!(
                "a region at {}..{} lies past the {} bytes copied",
                region.offset,
                region.offset + region.len,
                image.len()
            )));
        }
        Ok(image.slice_with_length(region.offset, region.len))
    };
    let buffers = array.buffers.iter().map(slice).collect::<Result<_, _>>()?;
    let nulls = match &array.validity {
        Some(region) if region.len < array.len.div_ceil(8) => {
            return Err(BackendError::Device(format!(
                "a validity bitmap of {} bytes for {} rows",
                region.len, array.len
            )));
        }
        Some(region) => Some(NullBuffer::new(BooleanBuffer::new(
            slice(region)?,
            0,
            array.len,
        ))),
        None => None,
    };
    let children = array
        .children
        .iter()
        .map(|child| host_array(child, image))
        .collect::<Result<Vec<_>, _>>()?;
    let builder = ArrayDataBuilder::new(array.data_type.clone())
        .len(array.len)
        .buffers(buffers)
        .child_data(children)
        .nulls(nulls);
    ffi::read_back_array(builder)
        .map_err(|e| BackendError::Device(format!("rebuilding an array copied to the host: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_lane_stops_the_others_at_their_next_piece() {
        use std::sync::atomic::AtomicUsize;
        let done = AtomicUsize::new(0);
        let result = in_lanes(2, |lane, failed| {
            if lane == 1 {
                return Err(BackendError::Device("lane 1 failed".to_owned()));
            }
            // Lane 0's pieces: it stops at the first one after lane 1 failed.
            for _ in 0..10_000 {
                another_failed(failed)?;
                done.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            Ok(())
        });
        let error = result.expect_err("a lane failed");
        assert!(
            error.to_string().contains("lane 1 failed"),
            "the first error: {error}"
        );
        assert!(
            done.load(Ordering::Relaxed) < 10_000,
            "lane 0 stopped early"
        );
        assert!(in_lanes(2, |_, _| Ok(())).is_ok());
        assert!(in_lanes(1, |_, failed| another_failed(failed)).is_ok());
    }

    #[test]
    fn lanes_take_alternate_pieces_that_cover_the_range_once() {
        let len = 5 * PIECE_BYTES + 3;
        let mut all: Vec<Range<usize>> = (0..LANES)
            .flat_map(|lane| lane_pieces(len, lane, LANES))
            .collect();
        assert_eq!(
            lane_pieces(len, 1, LANES)
                .map(|r| r.start)
                .collect::<Vec<_>>(),
            vec![PIECE_BYTES, 3 * PIECE_BYTES, 5 * PIECE_BYTES]
        );
        all.sort_by_key(|r| r.start);
        let mut at = 0;
        for piece in all {
            assert_eq!(piece.start, at);
            assert!(piece.len() <= PIECE_BYTES);
            at = piece.end;
        }
        assert_eq!(at, len);
        assert_eq!(lane_pieces(0, 0, 1).count(), 0);
        assert_eq!(lane_pieces(10, 0, 1).collect::<Vec<_>>(), vec![0..10]);
    }
}
