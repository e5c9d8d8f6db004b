//! Memory tiers on the host backend's pretend devices: datasets spill to a host tier of their
//! own budget when a device has no room, are read from there, come back onto their device for
//! `ipc-export`, and a put fails only when every tier is full.

mod common;

use std::sync::Arc;
use std::time::Duration;

use arrow_flight::FlightDescriptor;
use common::devices::{LIMIT, PretendGpus, batch, put, read_all, rows, store_over, used};
use common::{TestServer, code_of};
use gpu_flight::backend::{Backend, HostBackend};
use gpu_flight::server::ServeOptions;
use gpu_flight::store::{ExportRequest, PutMode, Store, StoreError, StoreOptions};
use tonic::Code;

/// A store of one pretend device of [`LIMIT`] bytes (two batches) over `backend`, with a host
/// tier of `host` bytes.
fn tiered(backend: Arc<dyn Backend>, host: u64) -> Store {
    Store::new(
        backend,
        StoreOptions {
            memory_limit: Some(LIMIT),
            host_memory_limit: Some(host),
            ..StoreOptions::default()
        },
    )
}

fn host_store(host: u64) -> Store {
    tiered(Arc::new(HostBackend::new()), host)
}

/// Bytes of `name` on devices and in the host tier.
fn tiers_of(store: &Store, name: &str) -> (u64, u64) {
    let tiers = store.get(name).expect("dataset").tier_bytes();
    (tiers.device, tiers.host)
}

#[tokio::test]
async fn three_times_the_device_budget_is_stored_and_read_back_whole() {
    let store = host_store(64 << 20);
    let mut sent = Vec::new();
    for i in 0..6 {
        let batches = [batch(i)];
        put(&store, &format!("d{i}"), PutMode::Create, None, &batches)
            .await
            .expect("spills to make room");
        sent.push(batches);
    }
    let status = store.status();
    assert!(status.devices[0].used_bytes <= LIMIT, "the limit holds");
    assert!(status.tiers.spills >= 4, "{:?}", status.tiers);
    assert!(status.tiers.host_bytes >= 4 * 1_600_000);
    for (i, batches) in sent.iter().enumerate() {
        assert_eq!(read_all(&store, &format!("d{i}")).await, rows(batches));
    }
}

#[tokio::test]
async fn one_put_larger_than_the_device_spills_its_own_batches() {
    let store = host_store(64 << 20);
    let batches: Vec<_> = (0..6).map(batch).collect();
    put(&store, "big", PutMode::Create, None, &batches)
        .await
        .expect("a put of three device budgets");
    assert!(used(&store)[0] <= LIMIT);
    let (device, host) = tiers_of(&store, "big");
    assert!(device > 0 && host >= 4 * 1_600_000, "{device} {host}");
    assert_eq!(read_all(&store, "big").await, rows(&batches));
}

#[tokio::test]
async fn the_least_recently_read_dataset_spills_first() {
    let store = host_store(64 << 20);
    put(&store, "old", PutMode::Create, None, &[batch(0)])
        .await
        .expect("put");
    put(&store, "new", PutMode::Create, None, &[batch(1)])
        .await
        .expect("put");
    // Reading "old" makes "new" the least recently used.
    read_all(&store, "old").await;
    put(&store, "third", PutMode::Create, None, &[batch(2)])
        .await
        .expect("put");
    assert_eq!(tiers_of(&store, "old").1, 0, "read lately: stays");
    assert_eq!(tiers_of(&store, "new").0, 0, "spilled");
}

#[tokio::test]
async fn without_a_host_tier_the_device_limit_refuses_as_before() {
    let store = host_store(0);
    put(&store, "a", PutMode::Create, None, &[batch(0), batch(1)])
        .await
        .expect("fits");
    let error = put(&store, "b", PutMode::Create, None, &[batch(2)])
        .await
        .expect_err("no tier to spill to");
    assert!(
        matches!(error, StoreError::MemoryExhausted { .. }),
        "{error}"
    );
    assert_eq!(store.status().tiers.spills, 0);
}

#[tokio::test]
async fn a_full_host_tier_refuses_saying_what_each_tier_holds() {
    // Room for one spilled batch only.
    let store = host_store(2_000_000);
    for i in 0..3 {
        put(&store, &format!("d{i}"), PutMode::Create, None, &[batch(i)])
            .await
            .expect("the device, then one spill");
    }
    let error = put(&store, "d3", PutMode::Create, None, &[batch(3)])
        .await
        .expect_err("both tiers full");
    let message = error.to_string();
    assert!(
        matches!(error, StoreError::TiersExhausted { .. }),
        "{message}"
    );
    assert!(message.contains("--host-memory-limit"), "{message}");
    assert!(store.get("d3").is_err(), "nothing committed");
    for i in 0..3 {
        assert_eq!(read_all(&store, &format!("d{i}")).await, batch(i));
    }
}

#[tokio::test]
async fn datasets_being_read_are_not_spilled() {
    let store = host_store(64 << 20);
    put(&store, "a", PutMode::Create, None, &[batch(0), batch(1)])
        .await
        .expect("fills the device");
    let dataset = store.get("a").expect("a");
    // A reader that has started and holds the first partition's memory.
    let mut reading = dataset.read(0..dataset.num_rows(), 64, 1).expect("read");
    let first = futures::StreamExt::next(&mut reading).await;
    assert!(first.is_some());
    put(&store, "b", PutMode::Create, None, &[batch(2)])
        .await
        .expect("spills what is not being read");
    assert!(used(&store)[0] <= LIMIT);
    drop(reading);
    assert_eq!(read_all(&store, "a").await, rows(&[batch(0), batch(1)]));
}

#[tokio::test]
async fn exported_partitions_stay_and_spilled_ones_come_back_to_be_exported() {
    let store = tiered(Arc::new(PretendGpus::new(1, true)), 64 << 20);
    put(&store, "leased", PutMode::Create, None, &[batch(0)])
        .await
        .expect("put");
    let export = store
        .export(ExportRequest::new(
            "leased",
            Duration::from_secs(60),
            "test",
        ))
        .await
        .expect("export");
    put(&store, "other", PutMode::Create, None, &[batch(1)])
        .await
        .expect("put");
    put(&store, "third", PutMode::Create, None, &[batch(2)])
        .await
        .expect("spills what is not leased");
    assert_eq!(tiers_of(&store, "leased").1, 0, "a leased partition stays");
    assert!(
        tiers_of(&store, "other").1 > 0,
        "the other one went to the host tier"
    );
    let restores = store.status().tiers.restores;
    store.release(&export.lease.id, None).expect("release");

    let again = store
        .export(ExportRequest::new("other", Duration::from_secs(60), "test"))
        .await
        .expect("a spilled dataset is brought back to be exported");
    assert_eq!(again.partitions.len(), 1);
    assert_eq!(tiers_of(&store, "other").1, 0, "back on the device");
    assert_eq!(store.status().tiers.restores, restores + 1);
    assert!(used(&store)[0] <= LIMIT);
    for (name, index) in [("leased", 0), ("other", 1), ("third", 2)] {
        assert_eq!(read_all(&store, name).await, batch(index), "{name}");
    }
}

#[tokio::test]
async fn spilled_datasets_move_and_copy() {
    let backend = Arc::new(HostBackend::new().with_devices(2));
    let store = tiered(backend, 64 << 20);
    for i in 0..3 {
        put(
            &store,
            &format!("d{i}"),
            PutMode::Create,
            Some(0),
            &[batch(i)],
        )
        .await
        .expect("put");
    }
    assert!(tiers_of(&store, "d0").1 > 0, "spilled");
    store.move_dataset("d0", 1).await.expect("move");
    assert_eq!(tiers_of(&store, "d0").1, 0);
    store.copy_dataset("d1", "copy", 1).await.expect("copy");
    assert_eq!(read_all(&store, "d0").await, batch(0));
    assert_eq!(read_all(&store, "copy").await, batch(1));
}

#[tokio::test]
async fn flight_reports_tiers_and_refuses_with_resource_exhausted() {
    let server = TestServer::start_with(
        Arc::new(HostBackend::new()),
        StoreOptions {
            memory_limit: Some(LIMIT),
            // A spilled batch, and a batch's message received while the device is full.
            host_memory_limit: Some(4_000_000),
            ..StoreOptions::default()
        },
        ServeOptions::default(),
    )
    .await;
    let mut client = server.client().await;
    for i in 0..3 {
        common::put(&mut client, common::path(&format!("d{i}")), vec![batch(i)])
            .await
            .expect("put");
    }
    let error = common::put(&mut client, common::path("full"), vec![batch(3)])
        .await
        .expect_err("every tier is full");
    assert_eq!(code_of(&error), Code::ResourceExhausted, "{error}");

    let status = common::status(&mut client).await;
    let tiers = &status["tiers"];
    assert_eq!(tiers["host_limit_bytes"], 4_000_000);
    assert!(tiers["spills"].as_u64() >= Some(1), "{tiers}");
    assert!(tiers["host_bytes"].as_u64() > Some(0), "{tiers}");

    let mut spilled = 0;
    for i in 0..3 {
        let info = client
            .get_flight_info(FlightDescriptor::new_path(vec![format!("d{i}")]))
            .await
            .expect("info");
        let metadata: serde_json::Value =
            serde_json::from_slice(&info.app_metadata).expect("JSON app_metadata");
        let host = metadata["tiers"]["host"].as_u64().expect("host bytes");
        let device = metadata["tiers"]["device"].as_u64().expect("device bytes");
        assert!(host + device > 0, "{metadata}");
        spilled += u64::from(host > 0);
        let got = common::get_all(&mut client, &format!("d{i}"))
            .await
            .expect("read");
        common::assert_same_data(&[batch(i)], &got);
    }
    assert!(spilled >= 1, "datasets are in the host tier");
    let metrics = server.metrics.encode().expect("metrics");
    assert!(metrics.contains("gpu_flight_spills_total"), "{metrics}");
    server.shutdown_and_wait().await;
}

#[test]
fn the_host_tier_defaults_to_none_for_the_host_backend() {
    let store = store_over(Arc::new(HostBackend::new()));
    assert_eq!(store.status().tiers.host_limit_bytes, 0);
    let gpus = Store::new(Arc::new(PretendGpus::new(1, true)), StoreOptions::default());
    assert!(
        gpus.status().tiers.host_limit_bytes > 0,
        "a device backend spills to half the host's memory"
    );
}

/// A put that cannot fit however much is spilled moves nothing: what was on the device stays
/// there (a batch larger than the whole device spilled the others before it was refused).
#[tokio::test]
async fn a_put_that_cannot_fit_displaces_nothing() {
    let store = host_store(64 << 20);
    put(&store, "small", PutMode::Create, None, &[batch(0)])
        .await
        .expect("small");
    let before = tiers_of(&store, "small");
    assert_eq!(before.1, 0, "on the device");
    // One batch of three device budgets: no spill can make room for it.
    let column: arrow::array::ArrayRef = Arc::new(arrow::array::Int64Array::from_iter_values(
        0..(3 * LIMIT as i64 / 8),
    ));
    let huge = arrow::record_batch::RecordBatch::try_from_iter([("x", column)]).expect("batch");
    let error = put(&store, "huge", PutMode::Create, None, &[huge])
        .await
        .expect_err("larger than the device");
    assert!(
        matches!(
            error,
            StoreError::MemoryExhausted { .. } | StoreError::TiersExhausted { .. }
        ),
        "{error}"
    );
    assert_eq!(tiers_of(&store, "small"), before, "nothing was moved");
    assert_eq!(store.status().tiers.spills, 0);
}

/// A message that does not fit is reported whole, and on the host backend as host memory:
/// "1048576 more bytes are needed on device 0" for an 8 MiB put misled.
#[tokio::test]
async fn a_message_that_does_not_fit_is_reported_whole_and_as_host_memory() {
    let store = Store::new(
        Arc::new(HostBackend::new()),
        StoreOptions {
            memory_limit: Some(10 << 20),
            host_memory_limit: Some(0),
            ..StoreOptions::default()
        },
    );
    let held = store.reserve_message(3 << 20).expect("3 MiB");
    let mut message = store.reserve_message(0).expect("an empty message");
    let mut refused = None;
    for _ in 0..8 {
        if let Err(error) = store.grow_message(&mut message, 1 << 20) {
            refused = Some(error);
            break;
        }
    }
    let error = refused.expect("8 MiB beside 3 MiB exceeds 10 MiB");
    let text = error.to_string();
    assert!(text.contains("host memory"), "{text}");
    assert!(
        text.contains(&format!("{} more bytes", 8u64 << 20)),
        "{text}"
    );
    assert!(
        text.contains(&format!("{} of {}", 3u64 << 20, 10u64 << 20)),
        "{text}"
    );
    drop(held);
}
