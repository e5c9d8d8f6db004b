//! Placement across devices, tested on the host backend split into pretend devices (each with
//! a budget of its own), so every commit checks the policy a multi-GPU server runs.

mod common;

use arrow::record_batch::RecordBatch;
use common::devices::{LIMIT, ROWS, batch, put, read_all, rows, store, used};
use gpu_flight::store::{PutMode, StoreError};

#[tokio::test]
async fn a_dataset_larger_than_any_device_is_spread_across_them() {
    let store = store(2);
    let batches: Vec<RecordBatch> = (0..3).map(batch).collect();
    put(&store, "big", PutMode::Create, None, &batches)
        .await
        .expect("three batches fit two devices together");
    let dataset = store.get("big").expect("dataset");
    let rows_per_batch = ROWS as u64;
    assert_eq!(
        dataset.device_runs(),
        [
            (0..2 * rows_per_batch, 0),
            (2 * rows_per_batch..3 * rows_per_batch, 1)
        ]
    );
    assert_eq!(read_all(&store, "big").await, self::rows(&batches));
    let used = used(&store);
    assert!(
        used.iter().all(|&u| u > 0),
        "both devices hold rows: {used:?}"
    );
}

#[tokio::test]
async fn a_put_starts_on_the_device_with_the_most_free_memory() {
    let store = store(3);
    put(&store, "a", PutMode::Create, Some(0), &[batch(0)])
        .await
        .expect("put");
    put(&store, "b", PutMode::Create, Some(1), &[batch(1), batch(2)])
        .await
        .expect("put");
    put(&store, "c", PutMode::Create, None, &[batch(3)])
        .await
        .expect("put");
    assert_eq!(store.get("c").expect("c").device_runs()[0].1, 2);
}

#[tokio::test]
async fn a_put_on_a_named_device_stays_there_or_fails() {
    let store = store(2);
    let batches: Vec<RecordBatch> = (0..3).map(batch).collect();
    put(&store, "kept", PutMode::Create, Some(1), &batches[..1])
        .await
        .expect("put");
    let error = put(&store, "too-big", PutMode::Create, Some(1), &batches)
        .await
        .expect_err("device 1 alone cannot hold three batches");
    assert!(
        matches!(error, StoreError::MemoryExhausted { device: 1, .. }),
        "{error}"
    );
    assert!(store.get("too-big").is_err());
    assert_eq!(read_all(&store, "kept").await, batch(0));
    let error = put(&store, "nowhere", PutMode::Create, Some(2), &batches[..1])
        .await
        .expect_err("no device 2");
    assert!(
        matches!(
            error,
            StoreError::UnknownDevice {
                device: 2,
                devices: 2
            }
        ),
        "{error}"
    );
}

#[tokio::test]
async fn a_put_that_fits_nowhere_fails_and_leaves_the_rest_intact() {
    let store = store(2);
    put(&store, "kept", PutMode::Create, None, &[batch(0)])
        .await
        .expect("put");
    let batches: Vec<RecordBatch> = (1..6).map(batch).collect();
    let error = put(&store, "huge", PutMode::Create, None, &batches)
        .await
        .expect_err("five batches do not fit in the room left");
    assert!(
        matches!(error, StoreError::MemoryExhausted { .. }),
        "{error}"
    );
    assert!(store.get("huge").is_err());
    assert_eq!(read_all(&store, "kept").await, batch(0));
    let used: u64 = store.status().devices.iter().map(|d| d.used_bytes).sum();
    assert!(
        used < LIMIT,
        "the failed put gave back what it held: {used}"
    );
}

#[tokio::test]
async fn appends_and_replaces_work_across_devices() {
    let store = store(3);
    let first: Vec<RecordBatch> = (0..3).map(batch).collect();
    put(&store, "t", PutMode::Create, None, &first)
        .await
        .expect("put");
    put(&store, "t", PutMode::Append, None, &[batch(3)])
        .await
        .expect("append");
    let all: Vec<RecordBatch> = (0..4).map(batch).collect();
    assert_eq!(read_all(&store, "t").await, rows(&all));
    let r = ROWS as u64;
    assert_eq!(
        store.get("t").expect("t").device_runs(),
        [(0..2 * r, 0), (2 * r..3 * r, 1), (3 * r..4 * r, 2)],
        "the append went to the emptiest device"
    );
    put(&store, "t", PutMode::Replace, None, &[batch(9)])
        .await
        .expect("replace");
    assert_eq!(read_all(&store, "t").await, batch(9));
    assert_eq!(store.get("t").expect("t").device_runs().len(), 1);
}

#[tokio::test]
async fn a_dataset_moves_to_another_device_whole() {
    let store = store(2);
    let batches: Vec<RecordBatch> = (0..3).map(batch).collect();
    put(&store, "t", PutMode::Create, None, &batches)
        .await
        .expect("spread over both devices");
    let before = store.get("t").expect("t");
    // Device 0 cannot take it all (3 batches, room for 2): nothing changes.
    let error = store.move_dataset("t", 0).await.expect_err("no room");
    assert!(
        matches!(error, StoreError::MemoryExhausted { device: 0, .. }),
        "{error}"
    );
    assert_eq!(store.get("t").expect("t").version(), before.version());
    // Free device 1 of what device 0 held, then move everything there.
    drop(before);
    store.remove("t").expect("drop");
    put(&store, "t", PutMode::Create, Some(0), &batches[..2])
        .await
        .expect("put on device 0");
    let reader = store.get("t").expect("a reader of the old version");
    let summary = store.move_dataset("t", 1).await.expect("move");
    assert_eq!(
        (summary.device, summary.moved_bytes),
        (1, 2 * 8 * ROWS as u64)
    );
    let moved = store.get("t").expect("t");
    assert_eq!(moved.device_runs(), [(0..2 * ROWS as u64, 1)]);
    assert_eq!(read_all(&store, "t").await, rows(&batches[..2]));
    // The reader keeps the old version until it is done; then device 0 is empty again.
    assert_eq!(reader.device_runs()[0].1, 0);
    drop(reader);
    let used = store.status().devices[0].used_bytes;
    assert!(used < 10_000, "only the schema's charge, no batch: {used}");
    let again = store.move_dataset("t", 1).await.expect("already there");
    assert_eq!(again.moved_bytes, 0);
    assert!(matches!(
        store.move_dataset("t", 5).await,
        Err(StoreError::UnknownDevice { device: 5, .. })
    ));
}

#[tokio::test]
async fn a_put_that_fits_commits_where_its_compact_copy_would_not() {
    // Small batches, which the host backend concatenates at commit when there is room: 3.2
    // MB of them under a 4 MB limit leave no room for a copy.
    let store = store(1);
    let small: Vec<RecordBatch> = (0..20)
        .map(|i| batch(i).slice(0, (ROWS / 10) as usize))
        .collect();
    put(&store, "t", PutMode::Create, None, &small)
        .await
        .expect("the rows fit, so the put commits");
    let dataset = store.get("t").expect("dataset");
    // Not one compact partition; pairs of them were merged while there was room.
    assert!(dataset.num_partitions() > 1, "not compacted into one");
    assert_eq!(read_all(&store, "t").await, rows(&small));
    // With room, the same batches are compacted.
    drop(dataset);
    store.remove("t").expect("drop");
    put(&store, "t", PutMode::Create, None, &small[..10])
        .await
        .expect("put");
    assert_eq!(store.get("t").expect("dataset").num_partitions(), 1);
}

#[tokio::test]
async fn a_dataset_copies_to_a_new_name_on_a_device() {
    let store = store(2);
    let batches: Vec<RecordBatch> = (0..2).map(batch).collect();
    put(&store, "t", PutMode::Create, Some(0), &batches)
        .await
        .expect("put on device 0");
    let before = used(&store);
    let summary = store.copy_dataset("t", "u", 1).await.expect("copy");
    assert_eq!(
        (summary.device, summary.copied_bytes, summary.copy.as_str()),
        (1, 2 * 8 * ROWS as u64, "u")
    );
    let copy = store.get("u").expect("the copy");
    assert_eq!(copy.device_runs(), [(0..2 * ROWS as u64, 1)]);
    assert_eq!(read_all(&store, "u").await, rows(&batches));
    let after = used(&store);
    assert_eq!(after[0], before[0], "the original is untouched");
    assert!(after[1] >= before[1] + 2 * 8 * ROWS as u64, "{after:?}");
    // The copy is its own memory: dropping the original leaves it readable.
    store.remove("t").expect("drop the original");
    assert_eq!(read_all(&store, "u").await, rows(&batches));
    // Refusals change nothing.
    put(&store, "t", PutMode::Create, Some(0), &batches[..1])
        .await
        .expect("put again");
    let before = used(&store);
    for (copy, device, expected) in [
        ("u", 0, "AlreadyExists"),
        ("v", 1, "MemoryExhausted"),
        ("v", 9, "UnknownDevice"),
    ] {
        let error = store
            .copy_dataset("t", copy, device)
            .await
            .expect_err("refused");
        assert!(format!("{error:?}").starts_with(expected), "{error:?}");
    }
    assert!(store.get("v").is_err());
    let after = used(&store);
    assert_eq!(after, before, "nothing of a refused copy is kept");
    assert!(matches!(
        store.copy_dataset("absent", "w", 0).await,
        Err(StoreError::NotFound { .. })
    ));
}
