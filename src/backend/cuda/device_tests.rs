//! Tests that need a CUDA device and the backend's internals: what an allocation holds
//! outside its arrays, which `ipc-export` consumers map but no public interface reads.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use arrow::array::{ArrayRef, BooleanArray, Int64Array, StringArray, UInt8Array};
use arrow::record_batch::RecordBatch;

use super::*;

/// Rows whose buffers are no multiple of 64 bytes: nulls, odd string lengths, booleans.
fn odd_batch(rows: usize) -> RecordBatch {
    let ints: ArrayRef = Arc::new(Int64Array::from_iter(
        (0..rows).map(|i| (i % 3 != 0).then_some(i as i64)),
    ));
    let words: ArrayRef = Arc::new(StringArray::from_iter_values(
        (0..rows).map(|i| "w".repeat(i % 7)),
    ));
    let flags: ArrayRef = Arc::new(BooleanArray::from_iter((0..rows).map(|i| Some(i % 5 == 0))));
    RecordBatch::try_from_iter([("n", ints), ("s", words), ("b", flags)]).expect("batch")
}

/// Each allocation of `partition`, read back whole, with the arrays that lie in it.
fn allocation_images(partition: &Arc<dyn Partition>) -> Vec<(Vec<u8>, Vec<&DeviceArray>)> {
    let part = partition
        .as_any()
        .downcast_ref::<CudaPartition>()
        .expect("a cuda partition");
    part.allocations
        .iter()
        .enumerate()
        .map(|(index, allocation)| {
            let image = pieces::download(
                &part.shared,
                &allocation.inner,
                allocation.inner.bytes(),
                &AtomicBool::new(false),
            )
            .expect("the allocation read back");
            let arrays = part
                .columns
                .iter()
                .filter(|(at, _)| *at == index)
                .map(|(_, array)| array)
                .collect();
            (image.as_slice().to_vec(), arrays)
        })
        .collect()
}

/// Every byte of `partition`'s allocations that no array of it covers.
fn bytes_outside_arrays(partition: &Arc<dyn Partition>) -> Vec<u8> {
    let mut outside = Vec::new();
    for (image, arrays) in allocation_images(partition) {
        let mut regions = Vec::new();
        arrays.iter().for_each(|a| a.collect_regions(&mut regions));
        for gap in layout::gaps(&mut regions, image.len()) {
            outside.extend_from_slice(&image[gap.offset..gap.offset + gap.len]);
        }
    }
    outside
}

/// The bits of each bitmap's last byte after its last row, for every array of `partition`
/// (one byte per bitmap whose rows are no multiple of 8).
fn bits_past_bitmaps(partition: &Arc<dyn Partition>) -> Vec<u8> {
    fn collect(array: &DeviceArray, image: &[u8], out: &mut Vec<u8>) {
        let bits = array.validity.iter().chain(match array.kind {
            Kind::Bits => array.buffers.first(),
            _ => None,
        });
        for region in bits.filter(|r| r.len > 0 && !array.len.is_multiple_of(8)) {
            out.push(image[region.offset + region.len - 1] >> (array.len % 8));
        }
        array.children.iter().for_each(|c| collect(c, image, out));
    }
    let mut out = Vec::new();
    for (image, arrays) in allocation_images(partition) {
        arrays.iter().for_each(|a| collect(a, &image, &mut out));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a CUDA device"]
async fn concatenations_and_copies_show_nothing_outside_their_arrays() {
    // Concatenation outputs are filled with 0xAB before the kernel runs: any gap the kernel
    // does not write, and nothing zeroes, shows it.
    let backend = CudaBackend::open(0)
        .expect("a CUDA device")
        .with_poisoned_outputs();
    let mut partitions = Vec::new();
    for rows in [1001, 1038, 77, 4000] {
        partitions.push(backend.upload(0, odd_batch(rows)).await.expect("upload"));
    }
    for partition in &partitions {
        assert!(
            bytes_outside_arrays(partition).iter().all(|&b| b == 0),
            "an upload"
        );
    }
    let compact = backend.compact(partitions).await.expect("concatenate");
    let outside = bytes_outside_arrays(&compact);
    assert!(!outside.is_empty());
    assert!(outside.iter().all(|&b| b == 0), "a concatenation");
    let past = bits_past_bitmaps(&compact);
    assert!(!past.is_empty());
    assert!(
        past.iter().all(|&b| b == 0),
        "bits after a concatenated bitmap's last row: {past:?}"
    );

    // A copy of some columns into memory that held another dataset's bytes: an upload of
    // 0xFF bytes, dropped, leaves its allocation (of the copy's size) in the reuse cache.
    let dirty: ArrayRef = Arc::new(UInt8Array::from(vec![0xFF_u8; 1 << 20]));
    let dirty = RecordBatch::try_from_iter([("x", dirty)]).expect("batch");
    drop(backend.upload(0, dirty).await.expect("upload"));
    let shared = &backend.devices[0].shared;
    let source = compact
        .as_any()
        .downcast_ref::<CudaPartition>()
        .expect("a cuda partition");
    let hits = shared.reuse.hits.load(Ordering::Relaxed);
    let copy = shared.copy_from(source, &[1]).expect("copy a column");
    assert_eq!(
        shared.reuse.hits.load(Ordering::Relaxed),
        hits + 1,
        "the copy went into the dropped upload's memory"
    );
    assert!(
        bytes_outside_arrays(&copy).iter().all(|&b| b == 0),
        "a copy"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a CUDA device"]
async fn read_arrays_report_their_own_memory_not_their_rounds() {
    // A read's columns share one pinned buffer per round; each must still report its own bytes
    // (arrow-flight's encoder splits batches by what they report). Staged in the pool, then in
    // the pinned host memory.
    let rows = 100_000;
    let columns: Vec<(String, ArrayRef)> = (0..8)
        .map(|c| {
            let values = Int64Array::from_iter((0..rows).map(|r| (r % 7 != c).then_some(r as i64)));
            (format!("c{c}"), Arc::new(values) as ArrayRef)
        })
        .collect();
    let batch = RecordBatch::try_from_iter(columns).expect("batch");
    for pinned in [0, 64 << 20] {
        let backend = CudaBackend::open(0)
            .expect("a CUDA device")
            .with_pinned_host_memory(pinned);
        for _ in 0..600 {
            if pinned == 0 || backend.pinned_host_memory().is_some() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        let partition = backend.upload(0, batch.clone()).await.expect("upload");
        let read = partition.read(0, rows, None).await.expect("read");
        assert_eq!(read, batch);
        let in_arena = backend.devices[0]
            .shared
            .counters
            .read_pinned_rounds
            .load(Ordering::Relaxed);
        assert_eq!(in_arena > 0, pinned > 0, "staged in the pinned host memory");
        for column in read.columns() {
            // Values and a validity bitmap, no more.
            let own = rows * 8 + rows.div_ceil(8);
            assert!(
                column.get_buffer_memory_size() <= own,
                "a column of {own} bytes reports {}",
                column.get_buffer_memory_size()
            );
        }
    }
}
