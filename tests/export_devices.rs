//! `ipc-export` of datasets on several devices, on pretend GPUs (see `common::devices`), so
//! CI checks what the document says of every partition, peer access, replicas on the
//! consumer's device and their leases. Mapping the handles for real is the GPU tests' part.

mod common;

use std::sync::Arc;
use std::time::Duration;

use arrow::array::{ArrayRef, Int64Array};
use arrow::datatypes::DataType;
use arrow::record_batch::RecordBatch;
use common::devices::{LIMIT, PretendGpus, ROWS, batch, put, store_over, used};
use common::{TestServer, action, code_of, status};
use gpu_flight::server::ServeOptions;
use gpu_flight::store::{
    Access, ExportRequest, MAX_EXPORT_PARTITIONS, PutMode, Store, StoreError, StoreOptions,
};
use serde_json::json;
use tonic::Code;

fn request(name: &str) -> ExportRequest {
    ExportRequest::new(name, Duration::from_secs(60), "test")
}

/// A request from a consumer on `device`, copying to it or not.
fn request_on(name: &str, device: u32, copy: bool) -> ExportRequest {
    let mut request = request(name);
    request.consumer = Some(device);
    request.copy = copy;
    request
}

/// Pretend GPUs 0 and 1 holding "t", three batches: two on 0, one on 1.
async fn spread_over_two() -> Store {
    let store = store_over(Arc::new(PretendGpus::new(2, true)));
    let batches = [batch(0), batch(1), batch(2)];
    put(&store, "t", PutMode::Create, None, &batches)
        .await
        .expect("spread over both devices");
    store
}

/// One batch on each of devices 0 and 1.
async fn one_batch_per_device(store: &Store) {
    put(store, "t", PutMode::Create, Some(0), &[batch(0)])
        .await
        .expect("put on 0");
    put(store, "t", PutMode::Append, Some(1), &[batch(1)])
        .await
        .expect("append on 1");
}

#[tokio::test]
async fn an_export_describes_every_partition_on_its_device() {
    let store = spread_over_two().await;
    let export = store.export(request("t")).await.expect("export");
    let described: Vec<(u64, u32, Access)> = export
        .partitions
        .iter()
        .map(|p| (p.rows, p.device, p.access))
        .collect();
    let rows = ROWS as u64;
    assert_eq!(
        described,
        [
            (rows, 0, Access::Local),
            (rows, 0, Access::Local),
            (rows, 1, Access::Local)
        ]
    );
    assert_eq!(export.partitions[2].gpu.uuid, PretendGpus::uuid(1));
    let handles: std::collections::HashSet<[u8; 64]> = export
        .partitions
        .iter()
        .map(|p| p.columns[0].handle)
        .collect();
    assert_eq!(handles.len(), 3, "each partition its own memory");

    let mut one = request("t");
    one.one_partition = true;
    let error = store
        .export(one)
        .await
        .expect_err("version 1 has one partition");
    assert!(
        matches!(error, StoreError::NotCompact { partitions: 3, .. }),
        "{error}"
    );
    assert_eq!(
        store.status().leases.len(),
        1,
        "only the first export's lease"
    );
}

#[tokio::test]
async fn a_consumer_elsewhere_gets_peer_access_or_a_replica_its_lease_holds() {
    let store = store_over(Arc::new(PretendGpus::new(2, true)));
    one_batch_per_device(&store).await;
    let before = used(&store);

    let peer = request_on("t", 1, false);
    let export = store.export(peer).await.expect("peer export");
    let access: Vec<(u32, Access)> = export
        .partitions
        .iter()
        .map(|p| (p.device, p.access))
        .collect();
    assert_eq!(access, [(0, Access::Peer), (1, Access::Local)]);
    assert_eq!(used(&store), before, "peer access copies nothing");
    store.release(&export.lease.id, None).expect("release");
    drop(export);

    let copy = request_on("t", 1, true);
    let export = store.export(copy).await.expect("copy export");
    let access: Vec<(u32, Access)> = export
        .partitions
        .iter()
        .map(|p| (p.device, p.access))
        .collect();
    assert_eq!(access, [(1, Access::Replica), (1, Access::Local)]);
    let with_replica = used(&store);
    assert_eq!(with_replica[0], before[0]);
    assert!(
        with_replica[1] >= before[1] + (ROWS as u64) * 8,
        "the replica is paid for on the consumer's device: {before:?} then {with_replica:?}"
    );
    let status = store.status();
    assert_eq!(status.leases[0].device, Some(1));
    assert_eq!(
        status.leases[0].replica_bytes,
        with_replica[1] - before[1],
        "the lease holds the replica"
    );
    assert_eq!(status.leased_only_bytes, status.leases[0].replica_bytes);

    // Dropping the dataset leaves the replica to the lease; releasing it frees both.
    store.remove("t").expect("drop");
    let lease = export.lease.id.clone();
    drop(export);
    store.release(&lease, None).expect("release");
    assert_eq!(used(&store), [0, 0]);
}

#[tokio::test]
async fn a_replica_that_does_not_fit_fails_and_grants_nothing() {
    let store = spread_over_two().await;
    let before = used(&store);
    let copy = request_on("t", 1, true);
    let error = store
        .export(copy)
        .await
        .expect_err("two batches do not fit beside one");
    assert!(
        matches!(error, StoreError::MemoryExhausted { device: 1, .. }),
        "{error}"
    );
    assert_eq!(used(&store), before, "no replica kept");
    assert!(store.status().leases.is_empty(), "no lease granted");
    assert!(before[1] < LIMIT);
}

#[tokio::test]
async fn without_peer_access_only_a_copy_reaches_another_device() {
    let store = store_over(Arc::new(PretendGpus::new(2, false)));
    one_batch_per_device(&store).await;
    let peer = request_on("t", 0, false);
    let error = store
        .export(peer)
        .await
        .expect_err("device 0 cannot reach 1");
    assert!(
        matches!(
            error,
            StoreError::NoPeerAccess {
                holder: 1,
                consumer: 0,
                ..
            }
        ),
        "{error}"
    );
    assert!(error.to_string().contains("\"copy\": true"), "{error}");
    assert!(store.status().leases.is_empty());
    let copy = request_on("t", 0, true);
    let export = store
        .export(copy)
        .await
        .expect("a copy needs no peer access");
    assert!(export.partitions.iter().all(|p| p.device == 0));

    let unknown = request_on("t", 2, false);
    let error = store.export(unknown).await.expect_err("no device 2");
    assert!(
        matches!(error, StoreError::UnknownDevice { device: 2, .. }),
        "{error}"
    );
}

#[tokio::test]
async fn a_renewal_keeps_the_terms_it_was_granted() {
    let store = store_over(Arc::new(PretendGpus::new(2, true)));
    one_batch_per_device(&store).await;
    let copy = request_on("t", 1, true);
    let granted = store.export(copy).await.expect("export");
    let held = used(&store);
    let renewal = |consumer, copy, columns: Option<Vec<String>>| {
        let mut renew = request("t");
        renew.renew = Some(granted.lease.id.clone());
        renew.consumer = consumer;
        renew.copy = copy;
        renew.columns = columns;
        renew
    };
    let renewed = store
        .export(renewal(None, false, None))
        .await
        .expect("a plain renewal");
    let handles = |export: &gpu_flight::store::Export| -> Vec<[u8; 64]> {
        export
            .partitions
            .iter()
            .map(|p| p.columns[0].handle)
            .collect()
    };
    assert_eq!(handles(&renewed), handles(&granted), "the same replica");
    assert_eq!(used(&store), held, "no second replica");
    store
        .export(renewal(Some(1), true, Some(vec!["x".to_owned()])))
        .await
        .expect("a renewal repeating its terms");
    let expires_at = store.status().leases[0].expires_at;
    let mut version_1 = renewal(None, false, None);
    version_1.one_partition = true;
    for (changed, version) in [
        (renewal(Some(0), false, None), false),
        (renewal(None, false, Some(vec![])), false),
        (version_1, true),
    ] {
        let error = store.export(changed).await.expect_err("refused");
        assert!(
            matches!(
                (&error, version),
                (StoreError::RenewalChangesTerms { .. }, false)
                    | (StoreError::NotCompact { .. }, true)
            ),
            "{error}"
        );
    }
    assert_eq!(
        store.status().leases[0].expires_at,
        expires_at,
        "a refused renewal does not extend the lease"
    );
    let (lease, replica_bytes) = (
        granted.lease.id.clone(),
        granted.lease.terms.replica_bytes(),
    );
    drop((granted, renewed));
    store.release(&lease, None).expect("release");
    assert_eq!(used(&store)[1], held[1] - replica_bytes);
}

#[tokio::test]
async fn the_export_document_describes_partitions_by_version() {
    let backend = Arc::new(PretendGpus::new(2, true));
    let options = StoreOptions {
        memory_limit: Some(LIMIT),
        host_memory_limit: Some(0),
        ..StoreOptions::default()
    };
    let server = TestServer::start_with(backend, options, ServeOptions::default()).await;
    let mut client = server.client().await;
    common::put(&mut client, common::path("one"), vec![batch(0)])
        .await
        .expect("put");
    // Version 1, what a client gets by default: one partition at the top level.
    let v1 = action(&mut client, "ipc-export", json!({"name": "one"}))
        .await
        .expect("export");
    assert_eq!(v1["version"], 1);
    assert_eq!(v1["columns"].as_array().map(Vec::len), Some(1));
    assert!(
        v1["device"]["uuid"].is_string() && v1.get("partitions").is_none(),
        "{v1}"
    );

    let store = &server.store;
    put(store, "t", PutMode::Create, Some(0), &[batch(0)])
        .await
        .expect("put on 0");
    put(store, "t", PutMode::Append, Some(1), &[batch(1)])
        .await
        .expect("append on 1");
    let refused = action(&mut client, "ipc-export", json!({"name": "t"}))
        .await
        .expect_err("version 1 cannot describe two partitions");
    assert_eq!(code_of(&refused), Code::FailedPrecondition, "{refused}");
    assert!(refused.to_string().contains("version"), "{refused}");

    let body = json!({"name": "t", "version": 2, "device": PretendGpus::uuid(1)});
    let v2 = action(&mut client, "ipc-export", body)
        .await
        .expect("export");
    assert_eq!(v2["version"], 2);
    assert_eq!(v2["num_rows"], 2 * ROWS);
    assert_eq!(v2["consumer_device"]["device"], 1);
    assert_eq!(v2["consumer_device"]["uuid"], PretendGpus::uuid(1));
    let partitions = v2["partitions"].as_array().expect("partitions");
    let described: Vec<(serde_json::Value, serde_json::Value, serde_json::Value)> = partitions
        .iter()
        .map(|p| {
            (
                p["device"]["device"].clone(),
                p["access"].clone(),
                p["num_rows"].clone(),
            )
        })
        .collect();
    assert_eq!(
        described,
        [
            (json!(0), json!("peer"), json!(ROWS)),
            (json!(1), json!("local"), json!(ROWS))
        ]
    );
    assert_eq!(partitions[0]["columns"][0]["name"], "x");
    let status = status(&mut client).await;
    assert_eq!(status["leases"][1]["device"], 1, "{status}");

    for (body, code) in [
        (
            json!({"name": "t", "version": 2, "copy": true}),
            Code::InvalidArgument,
        ),
        (json!({"name": "t", "version": 3}), Code::InvalidArgument),
        (
            json!({"name": "t", "version": 2, "device": 7}),
            Code::InvalidArgument,
        ),
        (
            json!({"name": "t", "version": 2, "device": "GPU-nope"}),
            Code::InvalidArgument,
        ),
    ] {
        let error = action(&mut client, "ipc-export", body.clone())
            .await
            .expect_err("refused");
        assert_eq!(code_of(&error), code, "{body}: {error}");
    }
    server.shutdown_and_wait().await;
}

#[tokio::test]
async fn memory_that_cannot_be_exported_is_refused_before_anything_is_copied() {
    // Host memory: device 1 has no room for a replica, but that is not what is wrong.
    let store = store_over(Arc::new(
        gpu_flight::backend::HostBackend::new().with_devices(2),
    ));
    put(&store, "t", PutMode::Create, Some(0), &[batch(0), batch(1)])
        .await
        .expect("put on 0");
    put(
        &store,
        "full",
        PutMode::Create,
        Some(1),
        &[batch(2), batch(3)],
    )
    .await
    .expect("fill 1");
    let copy = request_on("t", 1, true);
    let error = store.export(copy).await.expect_err("host memory");
    assert!(error.to_string().contains("host"), "{error}");
    assert!(store.status().leases.is_empty());
}

#[tokio::test]
async fn an_export_of_more_partitions_than_a_document_describes_is_refused() {
    // Appends alternating between two devices: partitions on different devices never merge.
    let rows = 10;
    let count = MAX_EXPORT_PARTITIONS + 1;
    let store = Store::new(Arc::new(PretendGpus::new(2, true)), StoreOptions::default());
    for i in 0..count {
        let start = (i * rows) as i64;
        let column: ArrayRef = Arc::new(Int64Array::from_iter_values(start..start + rows as i64));
        let batch = RecordBatch::try_from_iter([("x", column)]).expect("batch");
        let mode = if i == 0 {
            PutMode::Create
        } else {
            PutMode::Append
        };
        put(&store, "t", mode, Some((i % 2) as u32), &[batch])
            .await
            .expect("append");
    }
    assert_eq!(store.get("t").expect("t").num_partitions(), count);
    let error = store.export(request("t")).await.expect_err("too many");
    assert!(
        matches!(error, StoreError::TooManyPartitions { max, .. } if max == MAX_EXPORT_PARTITIONS),
        "{error}"
    );
    assert!(store.status().leases.is_empty());
}

#[tokio::test]
async fn a_replica_is_charged_for_every_array_of_its_columns() {
    // One row of a struct of twenty columns: the arrays, not the bytes, are what it costs.
    let children: Vec<(Arc<arrow::datatypes::Field>, ArrayRef)> = (0..20)
        .map(|i| {
            let field = arrow::datatypes::Field::new(format!("c{i}"), DataType::Int64, false);
            (
                Arc::new(field),
                Arc::new(Int64Array::from(vec![i])) as ArrayRef,
            )
        })
        .collect();
    let wide: ArrayRef = Arc::new(arrow::array::StructArray::from(children));
    let batch = RecordBatch::try_from_iter([("s", wide)]).expect("batch");
    let store = store_over(Arc::new(PretendGpus::new(2, true)));
    put(&store, "t", PutMode::Create, Some(0), &[batch])
        .await
        .expect("put");
    let export = store
        .export(request_on("t", 1, true))
        .await
        .expect("export");
    assert!(
        export.lease.terms.replica_bytes() >= 21 * gpu_flight::store::ARRAY_OVERHEAD,
        "{} bytes for 21 arrays",
        export.lease.terms.replica_bytes()
    );
}

#[tokio::test]
async fn memory_only_leases_hold_is_what_the_catalog_no_longer_holds() {
    let store = Store::new(Arc::new(PretendGpus::new(1, true)), StoreOptions::default());
    // Small enough to merge with each other, too small to merge with the first.
    let eighth = |i: i64| batch(i).slice(0, ROWS as usize / 8);
    put(&store, "t", PutMode::Create, None, &[batch(0)])
        .await
        .expect("put");
    let created = store.get("t").expect("t").memory_bytes();
    let first = store.export(request("t")).await.expect("export");
    put(&store, "t", PutMode::Append, None, &[eighth(1)])
        .await
        .expect("append");
    store.compactions_settled().await;
    assert_eq!(
        store.status().leased_only_bytes,
        0,
        "the append's version shares the leased partition"
    );

    let appended = store.get("t").expect("t").memory_bytes() - created;
    let second = store.export(request("t")).await.expect("export");
    put(&store, "t", PutMode::Append, None, &[eighth(2)])
        .await
        .expect("append");
    store.compactions_settled().await;
    let status = store.status();
    assert_eq!(status.merges, 1);
    assert_eq!(
        status.leased_only_bytes, appended,
        "the first append's partition, merged away, is held by the second lease alone"
    );
    for export in [first, second] {
        store.release(&export.lease.id, None).expect("release");
    }
    let status = store.status();
    assert_eq!(status.leased_only_bytes, 0);
    assert_eq!(status.devices[0].used_bytes, status.bytes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_partition_export_right_after_an_append_waits_for_its_merge() {
    // The append leaves its rows to a background merge; an export that needs the dataset
    // in one partition lets the merge finish rather than refuse it.
    let store = Store::new(Arc::new(PretendGpus::new(1, true)), StoreOptions::default());
    let rows = |i: i64| batch(i).slice(0, 1000);
    put(&store, "t", PutMode::Create, None, &[rows(0)])
        .await
        .expect("put");
    put(&store, "t", PutMode::Append, None, &[rows(1)])
        .await
        .expect("append");
    let mut one = request("t");
    one.one_partition = true;
    let export = store.export(one).await.expect("one partition");
    assert_eq!(export.partitions.len(), 1);
    store.release(&export.lease.id, None).expect("release");
}
