//! CUDA-only behaviour: transfer synchronization counts and leak checks. Run on a GPU machine
//! with `--include-ignored`; the protocol itself is covered by the conformance suite.

mod common;

use std::sync::Arc;
use std::time::Duration;

use arrow::record_batch::RecordBatch;
use common::*;
use futures::{StreamExt, TryStreamExt};
use gpu_flight::backend::{Backend, CudaBackend};
use gpu_flight::flight::FlightOptions;
use gpu_flight::server::ServeOptions;
use gpu_flight::store::StoreOptions;
use serde_json::Value;
use tonic::Code;

fn cuda() -> Arc<dyn Backend> {
    Arc::new(CudaBackend::open(0).expect("CUDA device 0"))
}

fn counter(status: &Value, name: &str) -> u64 {
    status["counters"][name]
        .as_u64()
        .unwrap_or_else(|| panic!("counter {name} in {status}"))
}

/// `rows` rows of `ints` int64 columns (every other one with nulls, `int64_batch`) followed
/// by the first `strings` columns of `string_batch` (varied strings "s", then ids "id").
fn ints_and_strings(rows: usize, ints: usize, strings: usize) -> RecordBatch {
    let numbers = int64_batch(rows, ints, 0);
    let words = string_batch(rows, 0);
    let columns = numbers
        .columns()
        .iter()
        .chain(words.columns().iter().take(strings))
        .cloned()
        .collect();
    let fields: Vec<_> = numbers
        .schema()
        .fields()
        .iter()
        .chain(words.schema().fields().iter().take(strings))
        .cloned()
        .collect();
    RecordBatch::try_new(Arc::new(arrow::datatypes::Schema::new(fields)), columns).expect("batch")
}

/// Reads `name` whole and returns how many chunks and stream synchronizations it took.
async fn read_counting(server: &TestServer, name: &str, expected: &[RecordBatch]) -> (u64, u64) {
    let mut client = server.client().await;
    let before = status(&mut client).await;
    assert_same_data(
        expected,
        &get_by_name(&mut client, name).await.expect("get"),
    );
    let after = status(&mut client).await;
    (
        counter(&after, "read_chunks") - counter(&before, "read_chunks"),
        counter(&after, "read_syncs") - counter(&before, "read_syncs"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA device"]
async fn one_sync_per_chunk_for_fixed_width_two_with_strings() {
    let options = ServeOptions {
        flight: FlightOptions {
            read_chunk_bytes: 1 << 20,
            ..FlightOptions::default()
        },
        ..ServeOptions::default()
    };
    let server = TestServer::start_with(cuda(), StoreOptions::default(), options).await;
    let mut client = server.client().await;
    let fixed = vec![int64_batch(200_000, 4, 0)];
    let strings = vec![string_batch(200_000, 0)];
    put(&mut client, path("fixed"), fixed.clone())
        .await
        .expect("put");
    put(&mut client, path("strings"), strings.clone())
        .await
        .expect("put");

    let (chunks, syncs) = read_counting(&server, "fixed", &fixed).await;
    assert!(chunks > 1, "the read was chunked ({chunks})");
    assert_eq!(syncs, chunks, "one synchronization per fixed-width chunk");
    let (chunks, syncs) = read_counting(&server, "strings", &strings).await;
    assert!(chunks > 1, "the read was chunked ({chunks})");
    assert_eq!(
        syncs,
        2 * chunks,
        "two synchronizations per chunk with strings"
    );
    server.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA device"]
async fn device_and_pinned_memory_return_after_puts_gets_failures_and_drops() {
    let store_options = StoreOptions {
        memory_limit: Some(64 << 20),
        host_memory_limit: Some(0),
        ..StoreOptions::default()
    };
    let server = TestServer::start_with(cuda(), store_options, ServeOptions::default()).await;
    let mut client = server.client().await;
    let baseline = status(&mut client).await;
    assert_eq!(counter(&baseline, "device_allocated_bytes"), 0);

    for round in 0..3 {
        let batches = vec![all_types_batch(3000), all_types_batch(10).slice(3, 5)];
        put(&mut client, path("a"), batches.clone())
            .await
            .expect("put");
        put(&mut client, path("b"), vec![string_batch(50_000, round)])
            .await
            .expect("put");
        assert_same_data(&batches, &get_all(&mut client, "a").await.expect("get"));
        // Over the 64 MiB limit: refused, nothing kept.
        let big: Vec<_> = (0..40).map(|i| int64_batch(100_000, 2, i)).collect();
        let error = put(&mut client, path("too-big"), big)
            .await
            .expect_err("over the limit");
        assert_eq!(code_of(&error), Code::ResourceExhausted);
        // A malformed append: refused, nothing kept.
        let error = put(&mut client, cmd("a", "append"), vec![int64_batch(10, 1, 0)])
            .await
            .expect_err("schema");
        assert_eq!(code_of(&error), Code::InvalidArgument);
        for name in ["a", "b"] {
            action(&mut client, "drop", serde_json::json!({ "name": name }))
                .await
                .expect("drop");
        }
    }

    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let now = status(&mut client).await;
        let device = counter(&now, "device_allocated_bytes");
        let pinned = counter(&now, "pinned_leased_bytes");
        let used = now["devices"][0]["used_bytes"].as_u64().expect("used");
        if device == 0 && pinned == 0 && used == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "memory still held: device {device}, pinned {pinned}, budget {used}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    server.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA device"]
async fn status_reports_the_gpu() {
    let server = TestServer::start(cuda()).await;
    let mut client = server.client().await;
    let status = status(&mut client).await;
    assert_eq!(status["backend"], "cuda");
    let device = &status["devices"][0];
    assert!(device["name"].as_str().is_some_and(|n| !n.is_empty()));
    assert!(device["total_bytes"].as_u64().is_some_and(|t| t > 1 << 30));
    assert!(counter(&status, "device_free_bytes") > 0);
    server.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA device"]
async fn pinned_staging_is_capped_and_a_read_beyond_the_cap_is_refused() {
    let backend = CudaBackend::open(0)
        .expect("CUDA device 0")
        .with_pinned_limit(16 << 20);
    // The cap is on reads: a 32 MB batch uploads past it; reads of 32 MiB chunks are refused,
    // 1 MiB ones are not.
    let big = ServeOptions {
        flight: FlightOptions {
            read_chunk_bytes: 32 << 20,
            ..FlightOptions::default()
        },
        ..ServeOptions::default()
    };
    let server = TestServer::start_with(Arc::new(backend), StoreOptions::default(), big).await;
    let mut client = server.client().await;
    let data = vec![int64_batch(1_000_000, 4, 0)];
    put(&mut client, path("t"), data.clone())
        .await
        .expect("put: uploads are not refused");
    let error = get_by_name(&mut client, "t")
        .await
        .expect_err("a 32 MiB chunk is over the cap");
    assert_eq!(code_of(&error), Code::ResourceExhausted, "{error}");
    assert!(error.to_string().contains("pinned staging"), "{error}");
    // What the stream had read before the refusal (its first row, for the schema) is given
    // back once the reply is done with it.
    wait_until(|| async {
        counter(
            &status(&mut server.client().await).await,
            "pinned_leased_bytes",
        ) == 0
    })
    .await;
    server.shutdown_and_wait().await;

    let small = ServeOptions {
        flight: FlightOptions {
            read_chunk_bytes: 1 << 20,
            ..FlightOptions::default()
        },
        ..ServeOptions::default()
    };
    let backend = CudaBackend::open(0)
        .expect("CUDA device 0")
        .with_pinned_limit(16 << 20);
    let server = TestServer::start_with(Arc::new(backend), StoreOptions::default(), small).await;
    let mut client = server.client().await;
    put(&mut client, path("t"), data.clone())
        .await
        .expect("put");
    assert_same_data(
        &data,
        &get_by_name(&mut client, "t")
            .await
            .expect("1 MiB chunks fit"),
    );
    server.shutdown_and_wait().await;
}

#[tokio::test]
#[ignore = "needs a CUDA device"]
async fn spilled_data_gives_its_staging_memory_back() {
    // Spills read through the pinned staging pool: 256 MB spilled through a 128 MiB cap works
    // only if each spilled piece leaves the pool once copied to host memory.
    let backend = CudaBackend::open(0)
        .expect("CUDA device 0")
        .with_pinned_limit(128 << 20);
    let options = StoreOptions {
        memory_limit: Some(64 << 20),
        host_memory_limit: Some(1 << 30),
        ..StoreOptions::default()
    };
    let server = TestServer::start_with(Arc::new(backend), options, ServeOptions::default()).await;
    let mut client = server.client().await;
    let tables: Vec<RecordBatch> = (0..10)
        .map(|seed| int64_batch(1_000_000, 4, seed))
        .collect();
    for (seed, table) in tables.iter().enumerate() {
        put(&mut client, path(&format!("d{seed}")), vec![table.clone()])
            .await
            .expect("spills to make room");
    }
    let status = status(&mut client).await;
    assert!(
        status["tiers"]["spilled_bytes"].as_u64() > Some(200_000_000),
        "{}",
        status["tiers"]
    );
    assert!(counter(&status, "pinned_leased_bytes") < 128 << 20);
    for (seed, table) in tables.iter().enumerate() {
        let got = get_by_name(&mut client, &format!("d{seed}"))
            .await
            .expect("read");
        assert_same_data(std::slice::from_ref(table), &got);
    }
    server.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA device"]
async fn projected_reads_copy_only_the_chosen_columns_off_the_device() {
    let server = TestServer::start(cuda()).await;
    let mut client = server.client().await;
    // Four int64 columns, two with validity bitmaps, and a string column.
    let batch = ints_and_strings(100_000, 4, 1);
    put(&mut client, path("t"), vec![batch.clone()])
        .await
        .expect("put");
    let copied = |status: &Value| counter(status, "read_bytes");
    let mut read = async |columns: Option<&[&str]>| {
        let descriptor = match columns {
            Some(columns) => arrow_flight::FlightDescriptor::new_cmd(
                serde_json::json!({"name": "t", "columns": columns}).to_string(),
            ),
            None => path("t"),
        };
        let before = status(&mut client).await;
        let info = client.get_flight_info(descriptor).await.expect("info");
        let mut batches = Vec::new();
        for endpoint in info.endpoint {
            let ticket = endpoint.ticket.expect("ticket");
            let part: Vec<RecordBatch> =
                futures::TryStreamExt::try_collect(client.do_get(ticket).await.expect("do_get"))
                    .await
                    .expect("read");
            batches.extend(part);
        }
        let after = status(&mut client).await;
        (batches, copied(&after) - copied(&before))
    };
    let (whole, all_bytes) = read(None).await;
    assert_same_data(std::slice::from_ref(&batch), &whole);
    let (one, one_bytes) = read(Some(&["c0"])).await;
    assert_same_data(&[batch.project(&[0]).expect("project")], &one);
    // c0 is 800 kB of the batch's 3.2 MB of integers (plus the strings): only it crosses
    // the bus, with at most a bitmap and alignment besides.
    assert!(
        (8 * 100_000..=8 * 100_000 + 100_000 / 8 + 4096).contains(&one_bytes),
        "c0 alone: {one_bytes} ({all_bytes} for all)"
    );
    let (two, two_bytes) = read(Some(&["s", "c1"])).await;
    assert_same_data(&[batch.project(&[4, 1]).expect("project")], &two);
    assert!(
        two_bytes + 3 * 8 * 100_000 <= all_bytes,
        "{two_bytes} of {all_bytes}"
    );
    server.shutdown_and_wait().await;
}

/// Freed device memory is kept for the next allocation of its size, except memory that was
/// exported: a consumer still mapping it would see the next dataset's bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA device"]
async fn freed_device_memory_is_reused_unless_it_was_exported() {
    let server =
        TestServer::start_with(cuda(), StoreOptions::default(), ServeOptions::default()).await;
    let mut client = server.client().await;
    let batches: Vec<_> = (0..4).map(|i| int64_batch(300_000, 4, i)).collect();
    let kept = |status: &Value| counter(status, "device_kept_bytes");

    // Four uploads, joined at commit: their memory is freed, and kept.
    put(&mut client, path("a"), batches.clone())
        .await
        .expect("put");
    let after_first = status(&mut client).await;
    assert!(kept(&after_first) > 0, "{after_first}");
    // The next put of the same shape takes it instead of asking the driver.
    put(&mut client, path("b"), batches.clone())
        .await
        .expect("put");
    let after_second = status(&mut client).await;
    assert!(
        counter(&after_second, "device_reused_allocations")
            >= counter(&after_first, "device_reused_allocations") + 4,
        "{after_second}"
    );
    assert_same_data(&batches, &get_all(&mut client, "b").await.expect("get"));

    // Dropping a dataset nobody exported keeps its memory...
    let before = kept(&status(&mut client).await);
    action(&mut client, "drop", serde_json::json!({"name": "b"}))
        .await
        .expect("drop");
    let after_plain_drop = kept(&status(&mut client).await);
    assert!(after_plain_drop > before, "{before} -> {after_plain_drop}");

    // ...but an exported one's memory goes back to the driver.
    let export = action(&mut client, "ipc-export", serde_json::json!({"name": "a"}))
        .await
        .expect("export");
    let lease = export["lease"].as_str().expect("lease").to_owned();
    action(
        &mut client,
        "ipc-release",
        serde_json::json!({"lease": lease}),
    )
    .await
    .expect("release");
    action(&mut client, "drop", serde_json::json!({"name": "a"}))
        .await
        .expect("drop");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let now = status(&mut client).await;
        if counter(&now, "device_allocated_bytes") == 0 {
            assert_eq!(
                kept(&now),
                after_plain_drop,
                "exported memory was kept: {now}"
            );
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "memory still held: {now}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    server.shutdown_and_wait().await;
}

/// Puts whose clients stop after one batch (and keep their streams open) do not hold the GPU's
/// upload turns: another put still completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA device"]
async fn stalled_puts_do_not_hold_the_upload_turns() {
    let server =
        TestServer::start_with(cuda(), StoreOptions::default(), ServeOptions::default()).await;
    let stalled = gpu_flight::backend::UPLOADS_AT_ONCE + 2;
    let mut held = Vec::new();
    for i in 0..stalled {
        let mut client = server.client().await;
        let batch = int64_batch(1_000_000, 2, i as i64);
        let messages: Vec<arrow_flight::FlightData> =
            arrow_flight::encode::FlightDataEncoderBuilder::new()
                .with_schema(batch.schema())
                .with_flight_descriptor(Some(path(&format!("stalled-{i}"))))
                .build(futures::stream::iter([Ok(batch)]))
                .try_collect()
                .await
                .expect("encode");
        // One batch, then nothing more: the stream stays open.
        let stream =
            futures::stream::iter(messages.into_iter().map(Ok)).chain(futures::stream::pending());
        held.push(tokio::spawn(async move {
            let _answer = client.do_put(stream).await;
            futures::future::pending::<()>().await;
        }));
    }
    // Every stalled put has had time to upload its batch.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut client = server.client().await;
    let batches = vec![int64_batch(100_000, 2, 99)];
    let put = tokio::time::timeout(
        Duration::from_secs(20),
        put(&mut client, path("moving"), batches.clone()),
    )
    .await;
    assert!(put.is_ok(), "a put waited behind stalled ones");
    put.unwrap_or_else(|_| unreachable!()).expect("put");
    assert_same_data(
        &batches,
        &get_all(&mut client, "moving").await.expect("get"),
    );
    for task in held {
        task.abort();
    }
    server.shutdown_and_wait().await;
}

/// The store options of [`spill_and_restore_every_type`]: 160 MiB of device memory.
fn spilling() -> StoreOptions {
    StoreOptions {
        memory_limit: Some(160 << 20),
        host_memory_limit: Some(1 << 30),
        ..StoreOptions::default()
    }
}

/// The datasets [`spill_and_restore_every_type`] puts.
const SPILLED: [&str; 6] = [
    "typed", "strings", "filler0", "filler1", "filler2", "filler3",
];

/// Puts every type, and strings, then enough to spill them (with [`spilling`]'s options);
/// reads them from host memory, exports them (which restores them) and reads them again.
/// Returns the status before the restores and after.
async fn spill_and_restore_every_type(server: &TestServer) -> (Value, Value) {
    let mut client = server.client().await;
    let typed = vec![
        all_types_batch(1000),
        all_types_batch(37),
        all_types_batch(300).slice(7, 250),
    ];
    put(&mut client, path("typed"), typed.clone())
        .await
        .expect("put");
    let strings = vec![string_batch(1_500_000, 3)];
    put(&mut client, path("strings"), strings.clone())
        .await
        .expect("put");
    // 32 MB each: the two datasets above, least recently used, spill.
    for seed in 0..4 {
        put(
            &mut client,
            path(&format!("filler{seed}")),
            vec![int64_batch(1_000_000, 4, seed)],
        )
        .await
        .expect("spills to make room");
    }
    let before = status(&mut client).await;
    assert!(
        before["tiers"]["spills"].as_u64() >= Some(2),
        "{}",
        before["tiers"]
    );
    for (name, sent) in [("typed", &typed), ("strings", &strings)] {
        let got = get_by_name(&mut client, name)
            .await
            .expect("read from host memory");
        assert_same_data(sent, &got);
    }
    for name in ["typed", "strings"] {
        let document = action(
            &mut client,
            "ipc-export",
            serde_json::json!({"name": name, "version": 2}),
        )
        .await
        .expect("an export restores the dataset");
        let lease = document["lease"].as_str().expect("lease").to_owned();
        action(
            &mut client,
            "ipc-release",
            serde_json::json!({"lease": lease}),
        )
        .await
        .expect("release");
    }
    let after = status(&mut client).await;
    assert!(
        after["tiers"]["restores"].as_u64() >= before["tiers"]["restores"].as_u64().map(|r| r + 2),
        "{}",
        after["tiers"]
    );
    assert_eq!(
        counter(&after, "concat_launches"),
        counter(&before, "concat_launches"),
        "a restore uploads the spilled copy as it is"
    );
    for (name, sent) in [("typed", &typed), ("strings", &strings)] {
        let got = get_by_name(&mut client, name)
            .await
            .expect("read after the restore");
        assert_same_data(sent, &got);
    }
    (before, after)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA device"]
async fn every_type_spills_whole_and_comes_back_as_it_was() {
    // A spill copies the partition's allocation as it is and rebuilds its arrays over the host
    // copy at the same offsets; a restore uploads that copy into one allocation again, with no
    // concatenation (a spill in 64 MiB pieces of rows had the 90 MB dataset concatenated).
    let server = TestServer::start_with(cuda(), spilling(), ServeOptions::default()).await;
    let (before, after) = spill_and_restore_every_type(&server).await;
    assert_eq!(counter(&before, "pinned_spill_copies"), 0, "none pinned");
    assert_eq!(counter(&after, "pinned_upload_copies"), 0);
    server.shutdown_and_wait().await;
}

/// Device 0 with `bytes` of pinned host memory, once it is pinned.
async fn with_pinned_host_memory(bytes: u64) -> Arc<CudaBackend> {
    let backend = Arc::new(
        CudaBackend::open(0)
            .expect("CUDA device 0")
            .with_pinned_host_memory(bytes),
    );
    for _ in 0..600 {
        if backend.pinned_host_memory().is_some() {
            return backend;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{bytes} bytes of pinned host memory not ready after 30 s");
}

/// A server over `backend`, which keeps its pinned host memory, with `options`.
async fn serve_pinned(backend: &Arc<CudaBackend>, options: StoreOptions) -> TestServer {
    TestServer::start_with(
        Arc::clone(backend) as Arc<dyn Backend>,
        options,
        ServeOptions::default(),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA device"]
async fn spills_go_straight_into_pinned_host_memory_and_restores_come_from_it() {
    let backend = with_pinned_host_memory(512 << 20).await;
    let server = serve_pinned(&backend, spilling()).await;
    let (before, after) = spill_and_restore_every_type(&server).await;
    let spills = before["tiers"]["spills"].as_u64().expect("spills");
    assert_eq!(
        counter(&before, "pinned_spill_copies"),
        spills,
        "every spill copied into pinned memory: {}",
        before["counters"]
    );
    // The strings' partition is restored straight from pinned memory (the small typed ones,
    // of many small buffers, through staging).
    assert!(
        counter(&after, "pinned_upload_copies") > counter(&before, "pinned_upload_copies"),
        "a restore uploaded from pinned memory: {}",
        after["counters"]
    );
    // Every block comes back once nothing holds the copies in it.
    let mut client = server.client().await;
    for name in SPILLED {
        action(&mut client, "drop", serde_json::json!({"name": name}))
            .await
            .expect("drop");
    }
    assert_eq!(
        pinned_in_use(&backend).await,
        Some((512 << 20, 0)),
        "pinned host memory in use"
    );
    server.shutdown_and_wait().await;
}

/// The backend's pinned host memory and the bytes of it in use, once nothing is (or after
/// 5 s).
async fn pinned_in_use(backend: &CudaBackend) -> Option<(u64, u64)> {
    let mut pinned = backend.pinned_host_memory();
    for _ in 0..100 {
        if pinned.is_some_and(|(_, used)| used == 0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        pinned = backend.pinned_host_memory();
    }
    pinned
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA device"]
async fn put_bodies_are_received_into_pinned_host_memory_and_uploaded_from_it() {
    let backend = with_pinned_host_memory(256 << 20).await;
    let server = serve_pinned(&backend, StoreOptions::default()).await;
    let mut client = server.client().await;
    // Nulls and strings in 2 MiB messages, a slice (its messages start past row 0), and a
    // batch too small for pinned memory.
    let batches = vec![
        ints_and_strings(400_000, 4, 2),
        ints_and_strings(300_000, 4, 2).slice(1000, 250_000),
        ints_and_strings(1_000, 4, 2),
    ];
    put(&mut client, path("pinned"), batches.clone())
        .await
        .expect("put");
    let after = status(&mut client).await;
    assert!(
        counter(&after, "pinned_put_bodies") > 0 && counter(&after, "pinned_upload_copies") > 0,
        "bodies copied into pinned memory and uploaded from there: {}",
        after["counters"]
    );
    assert_same_data(
        &batches,
        &get_by_name(&mut client, "pinned").await.expect("get"),
    );
    assert_eq!(
        pinned_in_use(&backend).await,
        Some((256 << 20, 0)),
        "the bodies were let go once uploaded"
    );
    server.shutdown_and_wait().await;
}

/// Puts `batch` on a server whose backend has `pinned` bytes of pinned host memory, reads it
/// back whole, and returns the chunks and the rounds staged in that memory the read took,
/// once every block of it is back.
async fn read_rounds_in_pinned_memory(pinned: u64, batch: RecordBatch) -> (u64, u64) {
    let backend = with_pinned_host_memory(pinned).await;
    let server = serve_pinned(&backend, StoreOptions::default()).await;
    let mut client = server.client().await;
    put(&mut client, path("read"), vec![batch.clone()])
        .await
        .expect("put");
    let before = status(&mut client).await;
    let got = get_by_name(&mut client, "read").await.expect("get");
    let after = status(&mut client).await;
    assert_same_data(&[batch], &got);
    assert_eq!(
        pinned_in_use(&backend).await,
        Some((pinned, 0)),
        "the blocks came back once the reply was written"
    );
    server.shutdown_and_wait().await;
    let grew = |name: &str| counter(&after, name) - counter(&before, name);
    (grew("read_chunks"), grew("read_pinned_rounds"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA device"]
async fn reads_stage_in_the_pinned_host_memory_and_give_it_back() {
    // About 57 MB with nulls and strings: four chunks, each two rounds (offsets, then the
    // strings they address).
    let (chunks, pinned) =
        read_rounds_in_pinned_memory(256 << 20, ints_and_strings(600_000, 4, 2)).await;
    assert!(
        chunks >= 3 && pinned >= 2 * chunks,
        "{pinned} rounds of {chunks} chunks staged in the pinned host memory"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA device"]
async fn reads_beyond_half_the_pinned_host_memory_stage_in_the_pool() {
    // 16 MiB: each of the two chunks (about 16 and 10 MB) is larger than half of it.
    let (chunks, pinned) =
        read_rounds_in_pinned_memory(16 << 20, ints_and_strings(400_000, 8, 0)).await;
    assert!(chunks >= 2, "{chunks} chunks");
    assert_eq!(pinned, 0, "rounds staged in the pinned host memory");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA device"]
async fn a_body_laid_out_as_on_the_device_is_uploaded_in_one_copy() {
    let backend = with_pinned_host_memory(256 << 20).await;
    let server = serve_pinned(&backend, StoreOptions::default()).await;
    let mut client = server.client().await;
    // arrow-rs writes buffers 64-byte aligned, as the device layout places them: 8 columns
    // of 128 KiB lie in each 1 MiB body as they will on the device.
    let batches: Vec<RecordBatch> = (0..4).map(|_| ints_and_strings(16_384, 8, 0)).collect();
    let before = status(&mut client).await;
    put(&mut client, path("runs"), batches.clone())
        .await
        .expect("put");
    let after = status(&mut client).await;
    let grew = |name: &str| counter(&after, name) - counter(&before, name);
    assert_eq!(grew("pinned_upload_copies"), 4, "{}", after["counters"]);
    assert_eq!(
        grew("pinned_upload_runs"),
        4,
        "one copy per body: {}",
        after["counters"]
    );
    assert_same_data(
        &batches,
        &get_by_name(&mut client, "runs").await.expect("get"),
    );
    server.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA device"]
async fn spills_too_large_for_the_pinned_host_memory_go_through_staging() {
    // 4 MiB: the small datasets' partitions fit, the 32 MB ones do not.
    let backend = with_pinned_host_memory(4 << 20).await;
    let server = serve_pinned(&backend, spilling()).await;
    let (before, _) = spill_and_restore_every_type(&server).await;
    let spills = before["tiers"]["spills"].as_u64().expect("spills");
    let pinned = counter(&before, "pinned_spill_copies");
    assert!(pinned < spills, "{pinned} of {spills} spills pinned");
    server.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA device"]
async fn a_batch_larger_than_a_staging_piece_uploads_in_pieces() {
    // 2,000,000 rows of 4 int64 columns with nulls and a string column: about 160 MB in one
    // batch, whose buffers straddle the 64 MiB pieces an upload stages at a time.
    let server = TestServer::start(cuda()).await;
    let mut client = server.client().await;
    let batch = ints_and_strings(2_000_000, 4, 2);
    let before = status(&mut client).await;
    put(&mut client, path("wide"), vec![batch.clone()])
        .await
        .expect("put");
    let after = status(&mut client).await;
    assert!(
        counter(&after, "upload_syncs") >= counter(&before, "upload_syncs") + 2,
        "one synchronization per piece"
    );
    let got = get_by_name(&mut client, "wide").await.expect("get");
    assert_same_data(&[batch], &got);
    server.shutdown_and_wait().await;
}
