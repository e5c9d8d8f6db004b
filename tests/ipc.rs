//! `ipc-export` and its leases.
//!
//! On the host backend (everywhere): the refusals, with their gRPC codes. On a GPU (ignored
//! elsewhere): a second process, this test binary re-run as [`consumer_process`], maps every
//! column of datasets with nulls, strings, lists, structs, maps, dictionaries, sliced inputs
//! and many put batches through `gpu_flight::consumer`, and checks that its bytes equal what
//! DoGet returns; releases, expiry and a killed consumer give the device memory back.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use arrow::array::Array;
use common::*;
use gpu_flight::backend::{Backend, CudaBackend, HostBackend};
use gpu_flight::consumer::{self, ExportOptions, MappedDataset};
use gpu_flight::server::ServeOptions;
use gpu_flight::store::StoreOptions;
use serde_json::json;
use tonic::Code;

/// Set in the environment of the second process: what it should do, as JSON.
const CHILD_ENV: &str = "GPU_FLIGHT_IPC_CHILD";

fn cuda() -> Arc<dyn Backend> {
    Arc::new(CudaBackend::open(0).expect("CUDA device 0"))
}

#[tokio::test]
async fn host_backend_refuses_export_and_says_why() {
    let server = TestServer::start(Arc::new(HostBackend::new())).await;
    let mut client = server.client().await;
    put(&mut client, path("t"), vec![int64_batch(10, 2, 0)])
        .await
        .expect("put");
    let refused = action(&mut client, "ipc-export", json!({"name": "t"}))
        .await
        .expect_err("host memory cannot be exported");
    assert_eq!(code_of(&refused), Code::FailedPrecondition, "{refused}");
    let message = refused.to_string();
    assert!(
        message.contains("host memory") && message.contains("DoGet"),
        "{message}"
    );
    for (body, code) in [
        (json!({"name": "absent"}), Code::NotFound),
        (
            json!({"name": "t", "lease_seconds": 0}),
            Code::InvalidArgument,
        ),
        (json!({"name": "t", "columns": "c0"}), Code::InvalidArgument),
        (json!({"name": "t", "lease": "nope"}), Code::NotFound),
    ] {
        let error = action(&mut client, "ipc-export", body.clone())
            .await
            .expect_err("refused");
        assert_eq!(code_of(&error), code, "{body}: {error}");
    }
    let error = action(&mut client, "ipc-release", json!({"lease": "nope"}))
        .await
        .expect_err("no such lease");
    assert_eq!(code_of(&error), Code::NotFound, "{error}");
    let status = status(&mut client).await;
    assert_eq!(status["leases"], json!([]), "nothing was granted");
    server.shutdown_and_wait().await;
}

/// Puts the datasets the consumer checks: one of many batches (compacted, dictionaries
/// merged), one single batch and a wide one of large columns (each compacted into one
/// allocation).
async fn put_datasets(client: &mut arrow_flight::FlightClient) -> Vec<&'static str> {
    let many = vec![
        all_types_batch(100),
        all_types_batch(37),
        all_types_batch(500).slice(3, 201),
        all_types_batch(1),
    ];
    put(client, path("many"), many).await.expect("put many");
    put(
        client,
        path("single"),
        vec![all_types_batch(333).slice(5, 300)],
    )
    .await
    .expect("put single");
    let wide: Vec<_> = (0..4).map(|i| int64_batch(300_000, 8, i * 7)).collect();
    put(client, path("wide"), wide).await.expect("put wide");
    vec!["many", "single", "wide"]
}

fn device_bytes(status: &serde_json::Value) -> u64 {
    status["counters"]["device_allocated_bytes"]
        .as_u64()
        .expect("device_allocated_bytes")
}

/// A CUDA server with a 100,000-row dataset `name` put into it, a client, and the device
/// memory allocated before the put.
async fn server_with_dataset(name: &str) -> (TestServer, arrow_flight::FlightClient, u64) {
    let server = TestServer::start(cuda()).await;
    let mut client = server.client().await;
    let start = device_bytes(&status(&mut client).await);
    put(&mut client, path(name), vec![int64_batch(100_000, 4, 0)])
        .await
        .expect("put");
    (server, client, start)
}

/// Waits (up to ten seconds) until no lease is left and device memory is back at `start`.
async fn wait_for_memory_back(server: &TestServer, start: u64) {
    wait_until(|| async {
        let now = status(&mut server.client().await).await;
        device_bytes(&now) == start && now["leases"] == json!([])
    })
    .await;
}

/// Runs the consumer process on `task` to the end; it must verify what it was given.
async fn run_consumer(task: serde_json::Value) {
    let described = task.to_string();
    let output = tokio::task::spawn_blocking(move || consumer_command(task).output())
        .await
        .expect("join")
        .expect("run the consumer");
    let log = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && log.contains("verified"),
        "consumer {described} failed:\n{log}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Runs this test binary again as the consumer process, doing `task`.
fn consumer_command(task: serde_json::Value) -> Command {
    let mut command = Command::new(std::env::current_exe().expect("test binary"));
    command
        .args([
            "consumer_process",
            "--exact",
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, task.to_string());
    command
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA device"]
async fn a_second_process_maps_every_column_and_reads_what_do_get_returns() {
    let server = TestServer::start(cuda()).await;
    let mut client = server.client().await;
    let names = put_datasets(&mut client).await;
    let task = json!({"mode": "verify", "addr": server.addr.to_string(), "names": names});
    run_consumer(task).await;
    let status = status(&mut client).await;
    assert_eq!(status["leases"], json!([]), "the consumer released");
    server.shutdown_and_wait().await;
}

/// Two devices of the server: GPUs 0 and 1 where this node has two, else GPU 0 opened twice
/// (one memory, two budgets), so that every path across devices runs on one GPU too: peer
/// copies, peer access and replicas.
fn two_devices() -> Arc<dyn Backend> {
    let visible = CudaBackend::visible_devices().expect("CUDA").len();
    let ordinals = if visible >= 2 { [0, 1] } else { [0, 0] };
    Arc::new(CudaBackend::open_all(&ordinals).expect("CUDA devices"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA device"]
async fn a_dataset_spread_over_two_devices_maps_from_either() {
    // Batches of 1.6 MB (four int64 columns), 2 MiB on a GPU; a device holds fifteen, and
    // puts keep room for the messages and uploads in flight beside what they hold.
    let options = StoreOptions {
        memory_limit: Some(32 << 20),
        host_memory_limit: Some(0),
        ..StoreOptions::default()
    };
    let server = TestServer::start_with(two_devices(), options, ServeOptions::default()).await;
    let mut client = server.client().await;
    // One batch on each device; then eighteen more, which no one device holds.
    for (device, mode) in [(0, "create"), (1, "append")] {
        let command = json!({"name": "pair", "mode": mode, "device": device});
        let descriptor = arrow_flight::FlightDescriptor::new_cmd(command.to_string());
        put(
            &mut client,
            descriptor,
            vec![int64_batch(50_000, 4, device)],
        )
        .await
        .expect("put on a device");
    }
    let batches: Vec<_> = (0..18).map(|i| int64_batch(50_000, 4, i * 3)).collect();
    put(&mut client, path("spread"), batches)
        .await
        .expect("put");
    let used = |status: &serde_json::Value| -> Vec<u64> {
        status["devices"]
            .as_array()
            .expect("devices")
            .iter()
            .map(|d| d["used_bytes"].as_u64().expect("used"))
            .collect()
    };
    let placed = status(&mut client).await;
    let ordinals: Vec<u64> = placed["devices"]
        .as_array()
        .expect("devices")
        .iter()
        .map(|d| d["ordinal"].as_u64().expect("ordinal"))
        .collect();
    let expected = get_all(&mut client, "spread").await.expect("DoGet");
    // Mapped where each partition lies; from device 1's GPU (peer access); then, with room
    // made, copied onto it.
    for (names, device, copy) in [
        (json!(["spread", "pair"]), None, false),
        (json!(["spread", "pair"]), Some(ordinals[1]), false),
        (json!(["pair"]), Some(ordinals[1]), true),
    ] {
        if copy {
            action(&mut client, "drop", json!({"name": "spread"}))
                .await
                .expect("drop");
        }
        let before = used(&status(&mut client).await);
        let task = json!({
            "mode": "verify",
            "addr": server.addr.to_string(),
            "names": names,
            "device_ordinal": device,
            "copy": copy,
        });
        run_consumer(task).await;
        let after = status(&mut client).await;
        assert_eq!(after["leases"], json!([]), "the consumer released");
        assert_eq!(used(&after), before, "replicas freed with their lease");
    }
    // A move copies between the devices' memory directly and reads back the same.
    let batches: Vec<_> = (0..18).map(|i| int64_batch(50_000, 4, i * 3)).collect();
    put(&mut client, path("spread"), batches)
        .await
        .expect("put again");
    action(&mut client, "drop", json!({"name": "pair"}))
        .await
        .expect("drop");
    for device in [0, 1, 0] {
        let error = action(
            &mut client,
            "move",
            json!({"name": "spread", "device": device}),
        )
        .await
        .expect_err("no one device holds it");
        assert_eq!(code_of(&error), Code::ResourceExhausted, "{error}");
    }
    put(&mut client, path("small"), vec![int64_batch(10_000, 2, 1)])
        .await
        .expect("put small");
    for device in [0, 1, 0] {
        action(
            &mut client,
            "move",
            json!({"name": "small", "device": device}),
        )
        .await
        .expect("move");
    }
    let moved = get_all(&mut client, "small").await.expect("DoGet");
    assert_eq!(
        concat(&moved[0].schema(), &moved),
        int64_batch(10_000, 2, 1)
    );
    let copied = action(
        &mut client,
        "copy",
        json!({"name": "small", "as": "small-copy", "device": 1}),
    )
    .await
    .expect("copy");
    assert_eq!(copied["device"], 1);
    let copy = get_all(&mut client, "small-copy").await.expect("DoGet");
    assert_eq!(concat(&copy[0].schema(), &copy), int64_batch(10_000, 2, 1));
    let counters = &status(&mut client).await["counters"];
    assert!(
        counters["device0_peer_copies"].as_u64() >= Some(1)
            && counters["device1_peer_copies"].as_u64() >= Some(1),
        "{counters}"
    );
    let again = get_all(&mut client, "spread").await.expect("DoGet");
    assert_eq!(
        concat(&again[0].schema(), &again),
        concat(&expected[0].schema(), &expected),
        "the failed moves left it as it was"
    );
    server.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA device"]
async fn release_and_expiry_free_the_memory_of_dropped_datasets() {
    // Dropped while leased: out of the catalog at once, memory held until the release.
    let (server, mut client, start) = server_with_dataset("t").await;
    let exported = action(&mut client, "ipc-export", json!({"name": "t"}))
        .await
        .expect("export");
    let lease = exported["lease"].as_str().expect("lease").to_owned();
    action(&mut client, "drop", json!({"name": "t"}))
        .await
        .expect("drop");
    let held = status(&mut client).await;
    assert_eq!(held["datasets"], 0);
    assert!(device_bytes(&held) > start, "{held}");
    assert!(
        held["leased_only_bytes"].as_u64().expect("bytes") > 0,
        "{held}"
    );
    assert_eq!(held["leases"][0]["lease"], lease.as_str());
    assert_eq!(held["leases"][0]["in_catalog"], false);
    // Renewing keeps the old version's handles, even though the name is gone.
    let renewed = action(
        &mut client,
        "ipc-export",
        json!({"name": "t", "lease": lease, "lease_seconds": 60}),
    )
    .await
    .expect("renew");
    assert_eq!(renewed["lease"], exported["lease"]);
    assert_eq!(renewed["columns"], exported["columns"]);
    action(&mut client, "ipc-release", json!({"lease": lease}))
        .await
        .expect("release");
    assert_eq!(device_bytes(&status(&mut client).await), start);

    // Replaced while leased, and never released: the lease expires by itself.
    put(&mut client, path("u"), vec![int64_batch(100_000, 4, 0)])
        .await
        .expect("put");
    action(
        &mut client,
        "ipc-export",
        json!({"name": "u", "lease_seconds": 1}),
    )
    .await
    .expect("export");
    put(
        &mut client,
        cmd("u", "replace"),
        vec![int64_batch(10, 1, 0)],
    )
    .await
    .expect("replace");
    action(&mut client, "drop", json!({"name": "u"}))
        .await
        .expect("drop");
    assert!(device_bytes(&status(&mut client).await) > start);
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let after = status(&mut client).await;
    assert_eq!(after["leases"], json!([]), "{after}");
    assert_eq!(device_bytes(&after), start, "{after}");
    server.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA device"]
async fn a_killed_consumer_leaks_nothing_past_its_lease() {
    let (server, mut client, start) = server_with_dataset("t").await;
    let task = json!({"mode": "hold", "addr": server.addr.to_string(), "names": ["t"]});
    let mut child = consumer_command(task)
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the consumer");
    let stdout = child.stdout.take().expect("stdout");
    let mapped = tokio::task::spawn_blocking(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .any(|line| line.contains("mapped, holding"))
    })
    .await
    .expect("join");
    assert!(mapped, "the consumer mapped the dataset");
    child.kill().expect("kill the consumer");
    child.wait().expect("reap the consumer");
    action(&mut client, "drop", json!({"name": "t"}))
        .await
        .expect("drop");
    wait_for_memory_back(&server, start).await;
    server.shutdown_and_wait().await;
}

/// The second process of the GPU tests; does nothing unless started by one of them.
#[test]
#[ignore = "needs a CUDA device"]
fn consumer_process() {
    let Ok(task) = std::env::var(CHILD_ENV) else {
        return;
    };
    let task: serde_json::Value = serde_json::from_str(&task).expect("task");
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async move {
        let addr = task["addr"].as_str().expect("addr");
        let mut client = connect(addr.parse().expect("address")).await;
        let names: Vec<&str> = task["names"]
            .as_array()
            .expect("names")
            .iter()
            .filter_map(|n| n.as_str())
            .collect();
        match task["mode"].as_str() {
            Some("hold") => {
                let options = ExportOptions {
                    lease_seconds: 2,
                    ..ExportOptions::default()
                };
                let document = consumer::export(&mut client, names[0], &options)
                    .await
                    .expect("export");
                let _mapped = MappedDataset::open(&document).expect("map");
                println!("mapped, holding");
                std::thread::sleep(Duration::from_secs(600));
            }
            _ => {
                let mut options = ExportOptions {
                    lease_seconds: 60,
                    ..ExportOptions::default()
                };
                if let Some(ordinal) = task["device_ordinal"].as_u64() {
                    options = options
                        .on_device(ordinal as u32)
                        .expect("the consumer's GPU");
                    options.copy = task["copy"].as_bool().unwrap_or(false);
                }
                for name in names {
                    verify(&mut client, name, &options).await;
                }
                println!("verified");
            }
        }
    });
}

/// Maps every column of `name`, checks it against DoGet, maps a subset, releases.
async fn verify(client: &mut arrow_flight::FlightClient, name: &str, options: &ExportOptions) {
    let document = consumer::export(client, name, options)
        .await
        .expect("export");
    let mapped = MappedDataset::open(&document).expect("map every column");
    // A second mapping of the same handles in this process works too.
    let again = MappedDataset::open(&document).expect("map again");
    let expected = get_all(client, name).await.expect("DoGet");
    let expected = concat(&expected[0].schema(), &expected);
    assert_eq!(mapped.schema().fields(), expected.schema().fields());
    assert_eq!(mapped.num_rows(), expected.num_rows() as u64);
    for (index, field) in expected.schema().fields().iter().enumerate() {
        let column = mapped.read_column(index).expect("read column");
        assert_eq!(
            column.as_ref(),
            expected.column(index).as_ref(),
            "{name}.{}",
            field.name()
        );
        let null_count: u64 = document
            .partitions
            .iter()
            .map(|p| p.columns[index].array.null_count)
            .sum();
        assert_eq!(
            null_count,
            column.null_count() as u64,
            "{name}.{} null count",
            field.name()
        );
        for partition in mapped.partitions() {
            let buffers = partition.column_buffers(index).expect("buffers");
            assert!(!buffers.is_empty() || field.data_type().is_nested());
        }
    }
    let columns = expected.num_columns();
    assert!(mapped.read_column(columns).is_err(), "no such column");
    assert!(mapped.partitions()[0].column_buffers(columns).is_err());
    drop(again);
    println!(
        "{name}: {} columns in {} allocations match DoGet",
        expected.num_columns(),
        mapped.mapped_allocations()
    );
    drop(mapped);
    consumer::release(client, &document.lease)
        .await
        .expect("release");

    let first = expected.schema().field(0).name().clone();
    let options = ExportOptions {
        columns: Some(vec![first]),
        ..options.clone()
    };
    let subset = consumer::export(client, name, &options)
        .await
        .expect("export one column");
    assert!(subset.partitions.iter().all(|p| p.columns.len() == 1));
    let mapped = MappedDataset::open(&subset).expect("map one column");
    assert_eq!(
        mapped.read_column(0).expect("read").as_ref(),
        expected.column(0).as_ref()
    );
    drop(mapped);
    consumer::release(client, &subset.lease)
        .await
        .expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA device"]
async fn a_replica_of_some_columns_copies_only_those() {
    // The columns of a compacted partition share one allocation; a replica of one of eight
    // 8 MB columns must copy (and charge) that column, not the allocation.
    use gpu_flight::store::{ExportRequest, PutMode, Store};
    let store = Store::new(two_devices(), StoreOptions::default());
    let batches: Vec<_> = (0..4).map(|i| int64_batch(250_000, 8, i)).collect();
    common::devices::put(&store, "wide", PutMode::Create, Some(0), &batches)
        .await
        .expect("put on device 0");
    let used = |store: &Store| store.status().devices[1].used_bytes;
    let before = used(&store);
    let mut request = ExportRequest::new("wide", Duration::from_secs(60), "test");
    request.consumer = Some(1);
    request.copy = true;
    request.columns = Some(vec!["c3".to_owned()]);
    let export = store.export(request).await.expect("a replica on device 1");
    let charged = used(&store) - before;
    assert!(
        (8_000_000..=12 << 20).contains(&charged),
        "one 8 MB column and its rounding, not 64 MB: {charged}"
    );
    assert_eq!(export.partitions[0].columns.len(), 1);
    store.release(&export.lease.id, None).expect("release");
    drop(export); // the description holds the lease's terms, the replica among them
    assert_eq!(used(&store), before, "the replica goes with its lease");
}
