//! The conformance suite: the whole Flight protocol, written once and run against every backend.
//!
//! Each scenario is an async function taking a backend; `conformance!` instantiates all of them
//! for one backend. The host backend runs everywhere; the CUDA backend's instantiation is
//! `#[ignore = "needs a CUDA device"]` and runs on the GPU machine with `--include-ignored`.

mod common;

use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, DictionaryArray, Int64Array};
use arrow::datatypes::{DataType, Field, Int32Type, Schema};
use arrow::record_batch::RecordBatch;
use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::error::FlightError;
use arrow_flight::{FlightData, FlightDescriptor, Ticket};
use common::*;
use futures::{StreamExt, TryStreamExt};
use gpu_flight::backend::Backend;
use gpu_flight::flight::FlightOptions;
use gpu_flight::server::ServeOptions;
use gpu_flight::store::StoreOptions;
use prost::Message;
use tonic::Code;

type MakeBackend = fn() -> Arc<dyn Backend>;

macro_rules! conformance {
    ($module:ident, $make:expr $(, #[$attr:meta])*) => {
        mod $module {
            use super::*;
            conformance!(@tests $make, [$(#[$attr])*];
                every_type_round_trips,
                put_modes_create_replace_append,
                append_with_other_fields_leaves_dataset_untouched,
                invalid_descriptors_are_invalid_argument,
                unknown_names_are_not_found,
                tickets_are_checked,
                endpoints_split_rows_and_sizes_are_real,
                memory_limit_is_resource_exhausted_and_others_survive,
                vanished_client_leaves_no_trace,
                malformed_ipc_mid_stream_leaves_no_trace,
                abort_marker_discards_the_put,
                other_app_metadata_is_ignored,
                schema_change_mid_stream_is_refused,
                small_receive_limit_reads_100_mb,
                messages_stay_under_the_limit,
                parallel_clients,
                drop_and_replace_during_a_read_let_it_finish,
                list_flights_and_actions,
                dictionaries_keep_their_encoding,
                appended_dictionaries_are_merged,
                empty_tables_and_zero_row_batches,
                sliced_batches_round_trip,
                shutdown_lets_running_streams_finish,
                puts_end_compacted,
                compaction_beyond_the_limit_fails_cleanly,
                projection_reads_chosen_columns_in_order,
                projection_errors_name_the_columns,
                projected_tickets_are_checked,
            );
        }
    };
    (@tests $make:expr, [$($attr:tt)*]; $test:ident, $($rest:ident,)*) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        $($attr)*
        async fn $test() {
            super::$test($make).await;
        }
        conformance!(@tests $make, [$($attr)*]; $($rest,)*);
    };
    (@tests $make:expr, [$($attr:tt)*];) => {};
}

conformance!(host, || Arc::new(gpu_flight::backend::HostBackend::new()));
conformance!(
    cuda,
    || Arc::new(gpu_flight::backend::CudaBackend::open(0).expect("CUDA device 0")),
    #[ignore = "needs a CUDA device"]
);
conformance!(
    cuda_pinned,
    cuda_with_pinned_host_memory,
    #[ignore = "needs a CUDA device"]
);

/// Device 0 with about 256 MiB of pinned host memory (`--pinned-host-memory`), once it is
/// pinned: puts receive their message bodies there and upload them from there. Not a whole
/// number of pages, as an operator may ask for: the mapping is pinned in whole pages.
fn cuda_with_pinned_host_memory() -> Arc<dyn Backend> {
    let backend = gpu_flight::backend::CudaBackend::open(0)
        .expect("CUDA device 0")
        .with_pinned_host_memory((256 << 20) + 1000);
    for _ in 0..600 {
        if backend.pinned_host_memory().is_some() {
            return Arc::new(backend);
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    panic!("pinned host memory not ready after 30 s");
}

async fn every_type_round_trips(make: MakeBackend) {
    let server = TestServer::start(make()).await;
    let mut client = server.client().await;
    let batches = vec![all_types_batch(100), all_types_batch(37)];
    let summary = put(&mut client, path("types"), batches.clone())
        .await
        .expect("put");
    assert_eq!(summary["name"], "types");
    assert_eq!(summary["rows"], 137);
    assert!(summary["bytes"].as_u64().expect("bytes") > 0);
    assert_same_data(&batches, &get_all(&mut client, "types").await.expect("get"));
    assert_same_data(
        &batches,
        &get_by_name(&mut client, "types")
            .await
            .expect("get by name"),
    );
    let schema = client.get_schema(path("types")).await.expect("schema");
    assert_eq!(&schema, batches[0].schema().as_ref());
    server.shutdown_and_wait().await;
}

async fn put_modes_create_replace_append(make: MakeBackend) {
    let server = TestServer::start(make()).await;
    let mut client = server.client().await;
    let first = int64_batch(100, 3, 0);
    put(&mut client, path("t"), vec![first.clone()])
        .await
        .expect("create");
    let again = put(&mut client, path("t"), vec![first.clone()])
        .await
        .expect_err("taken");
    assert_eq!(code_of(&again), Code::AlreadyExists);
    let again = put(&mut client, cmd("t", "create"), vec![first.clone()])
        .await
        .expect_err("taken");
    assert_eq!(code_of(&again), Code::AlreadyExists);

    let second = int64_batch(50, 3, 1000);
    let summary = put(&mut client, cmd("t", "append"), vec![second.clone()])
        .await
        .expect("append");
    assert_eq!(summary["rows"], 50);
    assert_eq!(summary["total_rows"], 150);
    assert_same_data(
        &[first.clone(), second.clone()],
        &get_all(&mut client, "t").await.expect("get"),
    );

    let replacement = int64_batch(10, 2, 7);
    put(&mut client, cmd("t", "replace"), vec![replacement.clone()])
        .await
        .expect("replace");
    assert_same_data(
        &[replacement],
        &get_all(&mut client, "t").await.expect("get"),
    );

    put(&mut client, cmd("fresh", "append"), vec![first.clone()])
        .await
        .expect("append creates");
    put(&mut client, cmd("fresh2", "replace"), vec![first.clone()])
        .await
        .expect("replace creates");
    assert_eq!(status(&mut client).await["datasets"], 3);
    server.shutdown_and_wait().await;
}

async fn append_with_other_fields_leaves_dataset_untouched(make: MakeBackend) {
    let server = TestServer::start(make()).await;
    let mut client = server.client().await;
    let original = int64_batch(100, 3, 0);
    put(&mut client, path("t"), vec![original.clone()])
        .await
        .expect("create");
    let used = used_bytes(&mut client).await;
    let error = put(&mut client, cmd("t", "append"), vec![int64_batch(10, 4, 0)])
        .await
        .expect_err("other fields");
    assert_eq!(code_of(&error), Code::InvalidArgument);
    assert!(
        error.to_string().contains("append needs identical fields"),
        "{error}"
    );
    assert_same_data(&[original], &get_all(&mut client, "t").await.expect("get"));
    assert_eq!(used_bytes(&mut client).await, used);
    server.shutdown_and_wait().await;
}

async fn invalid_descriptors_are_invalid_argument(make: MakeBackend) {
    let server = TestServer::start(make()).await;
    let mut client = server.client().await;
    let batch = int64_batch(10, 1, 0);
    let two = arrow_flight::FlightDescriptor::new_path(vec!["a".into(), "b".into()]);
    let long = "x".repeat(257);
    for descriptor in [
        two.clone(),
        path(""),
        path("bad\nname"),
        path(&long),
        arrow_flight::FlightDescriptor::new_cmd("{not json"),
        arrow_flight::FlightDescriptor::new_cmd(r#"{"name": "t", "mode": "upsert"}"#),
    ] {
        let error = put(&mut client, descriptor.clone(), vec![batch.clone()])
            .await
            .expect_err("invalid");
        assert_eq!(
            code_of(&error),
            Code::InvalidArgument,
            "{descriptor:?}: {error}"
        );
    }
    let error = client
        .get_flight_info(two.clone())
        .await
        .expect_err("two elements");
    assert_eq!(code_of(&error), Code::InvalidArgument);
    let error = client
        .get_schema(arrow_flight::FlightDescriptor::new_cmd("x"))
        .await
        .expect_err("cmd");
    assert_eq!(code_of(&error), Code::InvalidArgument);
    assert_eq!(status(&mut client).await["datasets"], 0);
    server.shutdown_and_wait().await;
}

async fn unknown_names_are_not_found(make: MakeBackend) {
    let server = TestServer::start(make()).await;
    let mut client = server.client().await;
    let error = client
        .get_flight_info(path("nope"))
        .await
        .expect_err("absent");
    assert_eq!(code_of(&error), Code::NotFound);
    assert!(
        error.to_string().contains("'nope' does not exist"),
        "{error}"
    );
    assert_eq!(
        code_of(&client.get_schema(path("nope")).await.expect_err("absent")),
        Code::NotFound
    );
    assert_eq!(
        code_of(&get_by_name(&mut client, "nope").await.expect_err("absent")),
        Code::NotFound
    );
    let error = action(&mut client, "drop", serde_json::json!({"name": "nope"}))
        .await
        .expect_err("absent");
    assert_eq!(code_of(&error), Code::NotFound);
    server.shutdown_and_wait().await;
}

async fn tickets_are_checked(make: MakeBackend) {
    let server = TestServer::start(make()).await;
    let mut client = server.client().await;
    put(&mut client, path("t"), vec![int64_batch(10, 1, 0)])
        .await
        .expect("put");
    let info = client.get_flight_info(path("t")).await.expect("info");
    let ticket = info.endpoint[0].ticket.clone().expect("ticket");

    for garbage in [
        &b"\0gpu-flight-ticket/1\n{broken"[..],
        b"\0gpu-flight-ticket/2\n{}",
        b"",
        b"\x07",
    ] {
        let error = client.do_get(Ticket::new(garbage.to_vec())).await;
        let error = match error {
            Err(e) => e,
            Ok(stream) => stream
                .try_collect::<Vec<_>>()
                .await
                .expect_err("garbage ticket"),
        };
        assert_eq!(code_of(&error), Code::InvalidArgument, "{garbage:?}");
    }
    // A ticket issued before a replace must not mix versions.
    put(&mut client, cmd("t", "replace"), vec![int64_batch(5, 1, 0)])
        .await
        .expect("replace");
    let error = match client.do_get(ticket).await {
        Err(e) => e,
        Ok(stream) => stream.try_collect::<Vec<_>>().await.expect_err("stale"),
    };
    assert_eq!(code_of(&error), Code::NotFound);
    assert!(error.to_string().contains("GetFlightInfo again"), "{error}");
    server.shutdown_and_wait().await;
}

async fn endpoints_split_rows_and_sizes_are_real(make: MakeBackend) {
    let options = ServeOptions {
        flight: FlightOptions {
            rows_per_endpoint: 1000,
            ..FlightOptions::default()
        },
        ..ServeOptions::default()
    };
    let server = TestServer::start_with(make(), StoreOptions::default(), options).await;
    let mut client = server.client().await;
    let batches = vec![int64_batch(1200, 2, 0), int64_batch(1300, 2, 5)];
    put(&mut client, path("t"), batches.clone())
        .await
        .expect("put");
    let info = client.get_flight_info(path("t")).await.expect("info");
    assert_eq!(info.total_records, 2500);
    // 2 int64 columns, one with a validity bitmap.
    let expected_bytes = 2500 * 16 + 1200_usize.div_ceil(8) + 1300_usize.div_ceil(8);
    assert_eq!(info.total_bytes, expected_bytes as i64);
    assert!(info.ordered);
    assert_eq!(info.endpoint.len(), 3);
    let mut received = Vec::new();
    let mut counts = Vec::new();
    for endpoint in &info.endpoint {
        let part: Vec<RecordBatch> = client
            .do_get(endpoint.ticket.clone().expect("ticket"))
            .await
            .expect("do_get")
            .try_collect()
            .await
            .expect("read");
        counts.push(part.iter().map(|b| b.num_rows()).sum::<usize>());
        received.extend(part);
    }
    assert_eq!(counts, vec![1000, 1000, 500]);
    assert_same_data(&batches, &received);
    server.shutdown_and_wait().await;
}

async fn memory_limit_is_resource_exhausted_and_others_survive(make: MakeBackend) {
    // 8 MiB: room for one small dataset on every backend (a device rounds allocations up to
    // 2 MiB), not for 40 batches of 320 KB.
    let limit = 8 << 20;
    let store_options = StoreOptions {
        memory_limit: Some(limit),
        // The device's limit alone: no host tier to spill to.
        host_memory_limit: Some(0),
        ..StoreOptions::default()
    };
    let server = TestServer::start_with(make(), store_options, ServeOptions::default()).await;
    let mut client = server.client().await;
    let small = int64_batch(10_000, 4, 0);
    put(&mut client, path("small"), vec![small.clone()])
        .await
        .expect("fits");
    let used = used_bytes(&mut client).await;
    let big: Vec<_> = (0..40).map(|i| int64_batch(10_000, 4, i)).collect();
    let error = put(&mut client, path("big"), big)
        .await
        .expect_err("over the limit");
    assert_eq!(code_of(&error), Code::ResourceExhausted);
    assert!(error.to_string().contains("--memory-limit"), "{error}");
    assert_eq!(used_bytes(&mut client).await, used);
    assert_same_data(
        &[small],
        &get_all(&mut client, "small").await.expect("intact"),
    );
    let error = client
        .get_flight_info(path("big"))
        .await
        .expect_err("no trace");
    assert_eq!(code_of(&error), Code::NotFound);
    assert_eq!(
        status(&mut client).await["devices"][0]["limit_bytes"],
        limit
    );
    server.shutdown_and_wait().await;
}

async fn vanished_client_leaves_no_trace(make: MakeBackend) {
    let server = TestServer::start(make()).await;
    let mut observer = server.client().await;
    let baseline = used_bytes(&mut observer).await;

    // A client that sends a few batches, then stalls until its connection is cut.
    let proxy = KillableProxy::start(server.addr).await;
    let mut writer = proxy.client().await;
    let batches: Vec<_> = (0..4).map(|i| int64_batch(50_000, 4, i)).collect();
    let data = FlightDataEncoderBuilder::new()
        .with_flight_descriptor(Some(path("partial")))
        .build(futures::stream::iter(batches.into_iter().map(Ok)))
        .chain(futures::stream::pending());
    let task = tokio::spawn(async move { writer.do_put(data).await.map(|_| ()) });
    wait_until(|| async { used_bytes(&mut server.client().await).await > baseline }).await;
    proxy.kill().await;

    wait_until(|| async { used_bytes(&mut server.client().await).await == baseline }).await;
    task.abort();
    let error = observer
        .get_flight_info(path("partial"))
        .await
        .expect_err("nothing committed");
    assert_eq!(code_of(&error), Code::NotFound);
    assert_eq!(status(&mut observer).await["datasets"], 0);
    server.shutdown_and_wait().await;
}

async fn malformed_ipc_mid_stream_leaves_no_trace(make: MakeBackend) {
    let server = TestServer::start(make()).await;
    let mut client = server.client().await;
    let good: Vec<FlightData> = FlightDataEncoderBuilder::new()
        .with_flight_descriptor(Some(path("bad")))
        .build(futures::stream::iter(vec![Ok(int64_batch(1000, 2, 0))]))
        .try_collect()
        .await
        .expect("encode");
    let mut messages = good;
    messages.push(FlightData {
        data_header: vec![0xde, 0xad, 0xbe, 0xef, 1, 2, 3, 4].into(),
        data_body: vec![0; 64].into(),
        ..FlightData::default()
    });
    let result = client
        .do_put(futures::stream::iter(messages.into_iter().map(Ok)))
        .await;
    let error = match result {
        Err(e) => e,
        Ok(stream) => stream.try_collect::<Vec<_>>().await.expect_err("malformed"),
    };
    assert_eq!(code_of(&error), Code::InvalidArgument, "{error}");
    assert_eq!(used_bytes(&mut client).await, 0);
    assert_eq!(
        code_of(
            &client
                .get_flight_info(path("bad"))
                .await
                .expect_err("absent")
        ),
        Code::NotFound
    );
    server.shutdown_and_wait().await;
}

async fn abort_marker_discards_the_put(make: MakeBackend) {
    let server = TestServer::start(make()).await;
    let mut client = server.client().await;
    let batches: Vec<_> = (0..3).map(|i| int64_batch(20_000, 3, i)).collect();

    let error = put_then_abort(&mut client, path("fresh"), batches.clone(), "reader failed").await;
    assert_eq!(code_of(&error), Code::Aborted, "{error}");
    assert!(
        error
            .to_string()
            .contains("the client abandoned the put: reader failed"),
        "{error}"
    );
    assert_eq!(used_bytes(&mut client).await, 0);
    let absent = client
        .get_flight_info(path("fresh"))
        .await
        .expect_err("absent");
    assert_eq!(code_of(&absent), Code::NotFound);
    assert_eq!(status(&mut client).await["datasets"], 0);

    let kept = int64_batch(100, 3, 99);
    put(&mut client, path("kept"), vec![kept.clone()])
        .await
        .expect("create");
    let baseline = used_bytes(&mut client).await;
    for mode in ["replace", "append"] {
        let long = "x".repeat(100_000);
        let error = put_then_abort(&mut client, cmd("kept", mode), batches.clone(), &long).await;
        assert_eq!(code_of(&error), Code::Aborted, "{mode}: {error}");
        assert!(
            error.to_string().len() < 2_000,
            "{mode}: the reason is bounded"
        );
        assert_eq!(used_bytes(&mut client).await, baseline, "{mode}");
        assert_same_data(
            std::slice::from_ref(&kept),
            &get_all(&mut client, "kept").await.expect("get"),
        );
    }
    // An abort before any batch (right after the schema) discards as well.
    let error = put_then_abort(&mut client, cmd("kept", "replace"), Vec::new(), "").await;
    assert_eq!(code_of(&error), Code::Aborted, "{error}");
    assert_same_data(&[kept], &get_all(&mut client, "kept").await.expect("get"));
    assert_eq!(status(&mut client).await["datasets"], 1);
    assert_eq!(used_bytes(&mut client).await, baseline);
    server.shutdown_and_wait().await;
}

async fn other_app_metadata_is_ignored(make: MakeBackend) {
    let server = TestServer::start(make()).await;
    let mut client = server.client().await;
    let batches: Vec<_> = (0..2).map(|i| int64_batch(1000, 2, i)).collect();
    let mut messages: Vec<FlightData> = FlightDataEncoderBuilder::new()
        .with_flight_descriptor(Some(path("t")))
        .build(futures::stream::iter(batches.clone().into_iter().map(Ok)))
        .try_collect()
        .await
        .expect("encode");
    // Metadata beside a batch, and alone: none of it is the abort marker.
    messages[1].app_metadata = br#"{"abort": "beside a batch"}"#.to_vec().into();
    for metadata in [
        &b"not json"[..],
        br#"{"other": 1}"#,
        br#"{"abort": "x", "other": 1}"#,
        br#"{"abort": 5}"#,
        br#"["abort"]"#,
        br#""abort""#,
    ] {
        messages.insert(
            2,
            FlightData {
                app_metadata: metadata.to_vec().into(),
                ..FlightData::default()
            },
        );
    }
    let summary: serde_json::Value = {
        let replies: Vec<_> = client
            .do_put(futures::stream::iter(messages.into_iter().map(Ok)))
            .await
            .expect("put")
            .try_collect()
            .await
            .expect("committed");
        serde_json::from_slice(&replies[0].app_metadata).expect("summary")
    };
    assert_eq!(summary["rows"], 2000);
    assert_same_data(&batches, &get_all(&mut client, "t").await.expect("get"));
    server.shutdown_and_wait().await;
}

async fn schema_change_mid_stream_is_refused(make: MakeBackend) {
    let server = TestServer::start(make()).await;
    let mut client = server.client().await;
    let first: Vec<FlightData> = FlightDataEncoderBuilder::new()
        .with_flight_descriptor(Some(path("t")))
        .build(futures::stream::iter(vec![Ok(int64_batch(100, 2, 0))]))
        .try_collect()
        .await
        .expect("encode");
    let second: Vec<FlightData> = FlightDataEncoderBuilder::new()
        .build(futures::stream::iter(vec![Ok(string_batch(100, 0))]))
        .try_collect()
        .await
        .expect("encode");
    let messages = first.into_iter().chain(second).map(Ok);
    let error = match client.do_put(futures::stream::iter(messages)).await {
        Err(e) => e,
        Ok(stream) => stream
            .try_collect::<Vec<_>>()
            .await
            .expect_err("schema change"),
    };
    assert_eq!(code_of(&error), Code::InvalidArgument, "{error}");
    assert!(error.to_string().contains("changed its schema"), "{error}");
    assert_eq!(used_bytes(&mut client).await, 0);
    assert_eq!(status(&mut client).await["datasets"], 0);
    server.shutdown_and_wait().await;
}

async fn small_receive_limit_reads_100_mb(make: MakeBackend) {
    let server = TestServer::start(make()).await;
    let mut client = server.client().await;
    // One 100 MB batch, sent whole as pyarrow's writer sends a batch: the server must split
    // it for a client with a 4 MiB receive limit.
    let batch = int64_batch(1_600_000, 8, 0);
    let data = FlightDataEncoderBuilder::new()
        .with_schema(batch.schema())
        .with_flight_descriptor(Some(path("big")))
        .with_max_flight_data_size(128 << 20)
        .build(futures::stream::iter([Ok(batch.clone())]));
    let results: Vec<_> = client
        .do_put(data)
        .await
        .expect("put")
        .try_collect()
        .await
        .expect("put");
    assert_eq!(results.len(), 1);
    let received = get_by_name(&mut client, "big")
        .await
        .expect("a 4 MiB client reads it");
    assert!(
        received.len() >= 25,
        "split into messages under 4 MiB, got {}",
        received.len()
    );
    // And into messages nearly as large as such a client takes, as few as the read's chunks
    // allow: a reader pays per message. (With 2 MiB messages there were 50; with chunks of 16
    // MiB split into five equal messages of 3.15 MiB, 31; 25 would fill every message. Chunks
    // are sized by what the backend charges a row, up to 65 bytes here for 64 of data.)
    let large = received
        .iter()
        .filter(|b| b.num_rows() * 64 > 3584 << 10)
        .count();
    assert!(
        received.len() <= 26 && large >= 24,
        "{large} of {} messages over 3.5 MiB: {:?}",
        received.len(),
        received.iter().map(|b| b.num_rows()).collect::<Vec<_>>()
    );
    assert_same_data(&[batch], &received);
    server.shutdown_and_wait().await;
}

async fn messages_stay_under_the_limit(make: MakeBackend) {
    let limit = 256 * 1024;
    let options = ServeOptions {
        flight: FlightOptions {
            max_message_bytes: limit,
            ..FlightOptions::default()
        },
        ..ServeOptions::default()
    };
    let server = TestServer::start_with(make(), StoreOptions::default(), options).await;
    let mut client = server.client().await;
    let batches = [all_types_batch(5000), string_batch(40_000, 3)];
    put(&mut client, path("mixed"), vec![batches[0].clone()])
        .await
        .expect("put");
    put(&mut client, path("strings"), vec![batches[1].clone()])
        .await
        .expect("put");
    let mut raw = server.raw_client().await;
    for name in ["mixed", "strings"] {
        let messages: Vec<FlightData> = raw
            .do_get(Ticket::new(name.to_owned()))
            .await
            .expect("do_get")
            .into_inner()
            .try_collect()
            .await
            .expect("read");
        assert!(messages.len() > 3, "{name} was split");
        for message in &messages {
            assert!(
                message.encoded_len() <= limit,
                "{name}: a message of {} bytes",
                message.encoded_len()
            );
        }
    }
    server.shutdown_and_wait().await;
}

async fn parallel_clients(make: MakeBackend) {
    let server = TestServer::start(make()).await;
    let mut client = server.client().await;
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let addr = server.addr;
            tokio::spawn(async move {
                let mut client = connect(addr).await;
                let name = format!("q{i}");
                let batches: Vec<_> = (0..4)
                    .map(|k| int64_batch(10_000, 4, i * 100 + k))
                    .collect();
                for batch in &batches {
                    put(&mut client, cmd(&name, "append"), vec![batch.clone()])
                        .await
                        .expect("append");
                }
                for _ in 0..3 {
                    assert_same_data(&batches, &get_all(&mut client, &name).await.expect("get"));
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("client task");
    }
    assert_eq!(status(&mut client).await["datasets"], 8);
    server.shutdown_and_wait().await;
}

async fn drop_and_replace_during_a_read_let_it_finish(make: MakeBackend) {
    let server = TestServer::start(make()).await;
    let mut client = server.client().await;
    let batch = int64_batch(400_000, 4, 0);
    for name in ["dropped", "replaced"] {
        put(&mut client, path(name), vec![batch.clone()])
            .await
            .expect("put");
    }
    for (name, change) in [("dropped", "drop"), ("replaced", "replace")] {
        let mut stream = client
            .do_get(Ticket::new(name.to_owned()))
            .await
            .expect("do_get");
        let first = stream.next().await.expect("a batch").expect("ok");
        let mut other = server.client().await;
        if change == "drop" {
            action(&mut other, "drop", serde_json::json!({"name": name}))
                .await
                .expect("drop");
        } else {
            put(&mut other, cmd(name, "replace"), vec![int64_batch(5, 1, 0)])
                .await
                .expect("replace");
        }
        let mut received = vec![first];
        received.extend(
            stream
                .try_collect::<Vec<_>>()
                .await
                .expect("stream finishes"),
        );
        assert_same_data(std::slice::from_ref(&batch), &received);
    }
    // The dropped and replaced data is released once the readers are done.
    wait_until(|| async {
        let status = status(&mut server.client().await).await;
        status["devices"][0]["used_bytes"] == status["bytes"]
    })
    .await;
    server.shutdown_and_wait().await;
}

async fn list_flights_and_actions(make: MakeBackend) {
    let server = TestServer::start(make()).await;
    let mut client = server.client().await;
    for name in ["sales/2024", "sales/2025", "users"] {
        put(&mut client, path(name), vec![int64_batch(100, 2, 0)])
            .await
            .expect("put");
    }
    let infos: Vec<_> = client
        .list_flights("sales/")
        .await
        .expect("list")
        .try_collect()
        .await
        .expect("list");
    let names: Vec<_> = infos
        .iter()
        .map(|i| i.flight_descriptor.clone().expect("desc").path[0].clone())
        .collect();
    assert_eq!(names, ["sales/2024", "sales/2025"]);
    assert!(
        infos
            .iter()
            .all(|i| i.total_records == 100 && i.total_bytes > 0)
    );
    let all = list_all(&mut client).await;
    assert_eq!(all.len(), 3);

    let actions: Vec<_> = client
        .list_actions()
        .await
        .expect("actions")
        .try_collect()
        .await
        .expect("actions");
    let action_names: Vec<_> = actions.iter().map(|a| a.r#type.as_str()).collect();
    assert!(action_names.contains(&"drop") && action_names.contains(&"status"));
    assert!(actions.iter().all(|a| !a.description.is_empty()));

    let error = action(&mut client, "explode", serde_json::Value::Null)
        .await
        .expect_err("unknown");
    assert_eq!(code_of(&error), Code::Unimplemented);
    let error = action(&mut client, "drop", serde_json::json!({"nom": "x"}))
        .await
        .expect_err("bad body");
    assert_eq!(code_of(&error), Code::InvalidArgument);

    let status = status(&mut client).await;
    assert_eq!(status["datasets"], 3);
    assert_eq!(status["data_bytes"], 3 * (100 * 16 + 13));
    assert_eq!(status["version"], env!("CARGO_PKG_VERSION"));
    assert!(status["backend"].is_string());
    let device = &status["devices"][0];
    assert!(device["ordinal"].is_u64() && device["name"].is_string());
    assert_eq!(device["used_bytes"], status["bytes"]);
    let dropped = action(&mut client, "drop", serde_json::json!({"name": "users"}))
        .await
        .expect("drop");
    assert_eq!(dropped["rows"], 100);
    server.shutdown_and_wait().await;
}

async fn dictionaries_keep_their_encoding(make: MakeBackend) {
    let server = TestServer::start(make()).await;
    let mut client = server.client().await;
    let make_batch = |words: &[&'static str]| {
        let dictionary: DictionaryArray<Int32Type> = words.iter().copied().map(Some).collect();
        RecordBatch::try_from_iter([("d", Arc::new(dictionary) as ArrayRef)]).expect("batch")
    };
    // Two batches with different dictionaries: the second replaces the first on the wire.
    let batches = vec![
        make_batch(&["a", "b", "a"]),
        make_batch(&["x", "y", "z", "x"]),
    ];
    put(&mut client, path("dict"), batches.clone())
        .await
        .expect("put");
    let received = get_all(&mut client, "dict").await.expect("get");
    assert!(matches!(
        received[0].schema().field(0).data_type(),
        DataType::Dictionary(_, _)
    ));
    assert_same_data(&batches, &received);
    server.shutdown_and_wait().await;
}

async fn appended_dictionaries_are_merged(make: MakeBackend) {
    let server = TestServer::start(make()).await;
    let mut client = server.client().await;
    let make_batch = |words: &[Option<&'static str>]| {
        let dictionary: DictionaryArray<Int32Type> = words.iter().copied().collect();
        RecordBatch::try_from_iter_with_nullable([("d", Arc::new(dictionary) as ArrayRef, true)])
            .expect("batch")
    };
    // Batches of one size, so the append's merge takes them (appends of other sizes stay
    // apart).
    let first = make_batch(&[Some("a"), None, Some("b"), Some("a")]);
    let second = make_batch(&[Some("b"), Some("c"), None, Some("c")]);
    put(&mut client, path("cats"), vec![first.clone()])
        .await
        .expect("put");
    put(&mut client, cmd("cats", "append"), vec![second.clone()])
        .await
        .expect("append");
    // Issued while the merge may still be running: the merge keeps the version.
    let info = client.get_flight_info(path("cats")).await.expect("info");
    server.store.compactions_settled().await;
    assert_eq!(
        server.store.get("cats").expect("dataset").num_partitions(),
        1
    );
    let mut received = Vec::new();
    for endpoint in &info.endpoint {
        let ticket = endpoint.ticket.clone().expect("ticket");
        let stream = client
            .do_get(ticket)
            .await
            .expect("a ticket from before the merge");
        received.extend(stream.try_collect::<Vec<_>>().await.expect("read"));
    }
    assert_same_data(&[first, second], &received);
    for batch in &received {
        let values = batch.column(0).as_any_dictionary().values();
        let expected: ArrayRef = Arc::new(arrow::array::StringArray::from(vec!["a", "b", "c"]));
        assert_eq!(values, &expected, "one merged dictionary, each value once");
    }
    server.shutdown_and_wait().await;
}

async fn empty_tables_and_zero_row_batches(make: MakeBackend) {
    let server = TestServer::start(make()).await;
    let mut client = server.client().await;
    let schema = Arc::new(Schema::new(vec![Field::new("x", DataType::Int64, true)]));
    put_with_schema(&mut client, path("empty"), Arc::clone(&schema), vec![])
        .await
        .expect("empty put");
    let info = client.get_flight_info(path("empty")).await.expect("info");
    assert_eq!(info.total_records, 0);
    assert_eq!(info.endpoint.len(), 1);
    let stream = client.do_get(Ticket::new("empty")).await.expect("do_get");
    let batches: Vec<_> = stream.try_collect().await.expect("read");
    assert!(batches.is_empty());
    assert_eq!(
        client.get_schema(path("empty")).await.expect("schema"),
        *schema
    );

    let zero = RecordBatch::new_empty(Arc::clone(&schema));
    let one = RecordBatch::try_new(
        Arc::clone(&schema),
        vec![Arc::new(Int64Array::from(vec![1]))],
    )
    .expect("batch");
    put(
        &mut client,
        path("zeros"),
        vec![zero.clone(), one.clone(), zero],
    )
    .await
    .expect("put");
    assert_same_data(&[one], &get_all(&mut client, "zeros").await.expect("get"));
    server.shutdown_and_wait().await;
}

async fn sliced_batches_round_trip(make: MakeBackend) {
    let server = TestServer::start(make()).await;
    let mut client = server.client().await;
    let whole = all_types_batch(300);
    let slices = vec![
        whole.slice(3, 101),
        whole.slice(150, 1),
        whole.slice(299, 1),
    ];
    put(&mut client, path("sliced"), slices.clone())
        .await
        .expect("put");
    assert_same_data(&slices, &get_all(&mut client, "sliced").await.expect("get"));
    server.shutdown_and_wait().await;
}

async fn shutdown_lets_running_streams_finish(make: MakeBackend) {
    let mut server = TestServer::start(make()).await;
    let mut client = server.client().await;
    let batch = int64_batch(400_000, 4, 0);
    put(&mut client, path("t"), vec![batch.clone()])
        .await
        .expect("put");
    let mut stream = client.do_get(Ticket::new("t")).await.expect("do_get");
    let first = stream.next().await.expect("a batch").expect("ok");
    server.begin_shutdown();
    let mut received = vec![first];
    received.extend(
        stream
            .try_collect::<Vec<_>>()
            .await
            .expect("the running stream finishes"),
    );
    assert_same_data(&[batch], &received);
    server.shutdown_and_wait().await;
}

async fn puts_end_compacted(make: MakeBackend) {
    let server = TestServer::start(make()).await;
    let mut client = server.client().await;
    let batches: Vec<_> = (0..10)
        .map(|i| int64_batch(1000 + i as usize, 3, i * 10_000))
        .collect();
    put(&mut client, path("t"), batches.clone())
        .await
        .expect("put");
    assert_eq!(server.store.get("t").expect("dataset").num_partitions(), 1);
    // A small append is compacted on its own, not merged with the dataset ten times its
    // size (which would copy the whole dataset at every append).
    let more: Vec<_> = (0..5).map(|i| int64_batch(77, 3, -i)).collect();
    put(&mut client, cmd("t", "append"), more.clone())
        .await
        .expect("append");
    server.store.compactions_settled().await;
    assert_eq!(server.store.get("t").expect("dataset").num_partitions(), 2);
    let all: Vec<_> = batches.into_iter().chain(more).collect();
    assert_same_data(&all, &get_all(&mut client, "t").await.expect("get"));
    let status = status(&mut client).await;
    assert_eq!(
        status["devices"][0]["used_bytes"], status["bytes"],
        "the fragments were freed"
    );
    server.shutdown_and_wait().await;
}

async fn compaction_beyond_the_limit_fails_cleanly(make: MakeBackend) {
    let batches: Vec<_> = (0..10).map(|i| int64_batch(10_000, 4, i)).collect();
    let backend = make();
    let uploads: u64 = batches
        .iter()
        .map(|b| backend.stored_size(b).expect("size"))
        .sum();
    // Room for the uploaded batches but not for their compacted copy beside them.
    let store_options = StoreOptions {
        memory_limit: Some(uploads + 1024),
        // The device's limit alone: no host tier to spill to.
        host_memory_limit: Some(0),
        ..StoreOptions::default()
    };
    let server = TestServer::start_with(backend, store_options, ServeOptions::default()).await;
    let mut client = server.client().await;
    let error = put(&mut client, path("t"), batches)
        .await
        .expect_err("compaction does not fit");
    assert_eq!(code_of(&error), Code::ResourceExhausted, "{error}");
    assert_eq!(used_bytes(&mut client).await, 0);
    assert_eq!(
        code_of(&client.get_flight_info(path("t")).await.expect_err("absent")),
        Code::NotFound
    );
    server.shutdown_and_wait().await;
}

/// A GetFlightInfo or GetSchema CMD asking for `columns` of `name`, maybe compressed.
fn projected(name: &str, columns: &[&str], compression: Option<&str>) -> FlightDescriptor {
    let mut command = serde_json::json!({"name": name, "columns": columns});
    if let Some(codec) = compression {
        command["compression"] = codec.into();
    }
    FlightDescriptor::new_cmd(command.to_string())
}

/// Helpers of the projection scenarios (in a module: the scenario count below counts every
/// top-level `async fn`).
mod reads {
    use super::*;

    /// Every endpoint of `info`, read in order.
    pub(crate) async fn read_endpoints(
        client: &mut arrow_flight::FlightClient,
        info: &arrow_flight::FlightInfo,
    ) -> Result<Vec<RecordBatch>, arrow_flight::error::FlightError> {
        let mut batches = Vec::new();
        for endpoint in &info.endpoint {
            let ticket = endpoint.ticket.clone().expect("endpoint has a ticket");
            let mut part: Vec<_> = client.do_get(ticket).await?.try_collect().await?;
            batches.append(&mut part);
        }
        Ok(batches)
    }

    /// The failure of a call that may fail when called or while its reply streams.
    pub(crate) async fn do_get_error(
        client: &mut arrow_flight::FlightClient,
        ticket: Ticket,
    ) -> FlightError {
        match client.do_get(ticket).await {
            Err(e) => e,
            Ok(stream) => stream.try_collect::<Vec<_>>().await.expect_err("refused"),
        }
    }
}
use reads::{do_get_error, read_endpoints};

async fn projection_reads_chosen_columns_in_order(make: MakeBackend) {
    let server = TestServer::start(make()).await;
    let mut client = server.client().await;
    let batches = vec![all_types_batch(100), all_types_batch(37)];
    put(&mut client, path("types"), batches.clone())
        .await
        .expect("put");
    let whole = client.get_flight_info(path("types")).await.expect("info");
    // Reordered, with dictionary, nested and variable-width columns.
    let names = ["dictionary", "i32", "struct", "list", "utf8", "map"];
    let schema = batches[0].schema();
    let indices: Vec<usize> = names
        .iter()
        .map(|n| schema.index_of(n).expect("field"))
        .collect();
    let expected: Vec<RecordBatch> = batches
        .iter()
        .map(|b| b.project(&indices).expect("project"))
        .collect();
    for compression in [None, Some("lz4"), Some("zstd")] {
        let info = client
            .get_flight_info(projected("types", &names, compression))
            .await
            .expect("info");
        assert_eq!(
            &info.clone().try_decode_schema().expect("schema"),
            expected[0].schema().as_ref()
        );
        assert_eq!(info.total_records, 137);
        assert!(
            0 < info.total_bytes && info.total_bytes < whole.total_bytes,
            "{} of {}",
            info.total_bytes,
            whole.total_bytes
        );
        for endpoint in &info.endpoint {
            let ticket = &endpoint.ticket.as_ref().expect("ticket").ticket;
            assert!(ticket.starts_with(b"\0gpu-flight-ticket/3\n"), "{ticket:?}");
        }
        let received = read_endpoints(&mut client, &info).await.expect("read");
        assert_same_data(&expected, &received);
    }
    // One column, and every column in the schema's order: the latter reads as a PATH does.
    let one = client
        .get_flight_info(projected("types", &["i64"], None))
        .await
        .expect("info");
    let i64_only: Vec<RecordBatch> = batches
        .iter()
        .map(|b| {
            b.project(&[schema.index_of("i64").expect("i64")])
                .expect("project")
        })
        .collect();
    assert_same_data(
        &i64_only,
        &read_endpoints(&mut client, &one).await.expect("read"),
    );
    let all: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
    let every = client
        .get_flight_info(projected("types", &all, None))
        .await
        .expect("info");
    assert_eq!(every.total_bytes, whole.total_bytes);
    assert_same_data(
        &batches,
        &read_endpoints(&mut client, &every).await.expect("read"),
    );
    // Without columns nothing changes: the whole schema, format 2 tickets.
    for endpoint in &whole.endpoint {
        let ticket = &endpoint.ticket.as_ref().expect("ticket").ticket;
        assert!(ticket.starts_with(b"\0gpu-flight-ticket/2\n"), "{ticket:?}");
    }
    assert_same_data(
        &batches,
        &read_endpoints(&mut client, &whole).await.expect("read"),
    );
    // GetSchema answers the projected schema.
    let projected_schema = client
        .get_schema(projected("types", &names, None))
        .await
        .expect("schema");
    assert_eq!(&projected_schema, expected[0].schema().as_ref());
    server.shutdown_and_wait().await;
}

async fn projection_errors_name_the_columns(make: MakeBackend) {
    let server = TestServer::start(make()).await;
    let mut client = server.client().await;
    put(&mut client, path("t"), vec![int64_batch(10, 2, 0)])
        .await
        .expect("put");
    let cases: [(&[&str], &[&str]); 5] = [
        (
            &["nope", "c0", "gone"],
            &["'nope'", "'gone'", "[\"c0\", \"c1\"]"],
        ),
        (&["c1", "c1"], &["repeated", "c1"]),
        (&[], &["at least one"]),
        (&["c0", "c1", "c0"], &["repeated", "c0"]),
        (&["C0"], &["'C0'", "[\"c0\", \"c1\"]"]),
    ];
    for (columns, phrases) in cases {
        let info = client
            .get_flight_info(projected("t", columns, None))
            .await
            .expect_err("refused");
        let schema = client
            .get_schema(projected("t", columns, None))
            .await
            .expect_err("refused");
        for error in [info, schema] {
            assert_eq!(
                code_of(&error),
                Code::InvalidArgument,
                "{columns:?}: {error}"
            );
            let FlightError::Tonic(status) = &error else {
                panic!("{error}");
            };
            for phrase in phrases {
                assert!(status.message().contains(phrase), "{phrase}: {error}");
            }
        }
    }
    for bad in [
        r#"{"name": "t", "columns": "c0"}"#,
        r#"{"name": "t", "columns": [0]}"#,
        r#"{"name": "t", "columns": null, "column": ["c0"]}"#,
    ] {
        let error = client
            .get_flight_info(FlightDescriptor::new_cmd(bad.to_owned()))
            .await
            .expect_err("refused");
        assert_eq!(code_of(&error), Code::InvalidArgument, "{bad}: {error}");
    }
    // A missing dataset is still NOT_FOUND, whatever the columns.
    let error = client
        .get_flight_info(projected("missing", &["c0"], None))
        .await
        .expect_err("missing");
    assert_eq!(code_of(&error), Code::NotFound);
    server.shutdown_and_wait().await;
}

async fn projected_tickets_are_checked(make: MakeBackend) {
    let server = TestServer::start(make()).await;
    let mut client = server.client().await;
    let batch = int64_batch(10, 3, 0);
    put(&mut client, path("t"), vec![batch.clone()])
        .await
        .expect("put");
    let info = client
        .get_flight_info(projected("t", &["c2", "c0"], None))
        .await
        .expect("info");
    let ticket = info.endpoint[0].ticket.clone().expect("ticket");
    // The ticket carries indices, and reads the same twice.
    let text = String::from_utf8_lossy(&ticket.ticket).into_owned();
    assert!(text.contains("\"columns\":[2,0]"), "{text}");
    for _ in 0..2 {
        let received: Vec<RecordBatch> = client
            .do_get(ticket.clone())
            .await
            .expect("do_get")
            .try_collect()
            .await
            .expect("read");
        assert_same_data(&[batch.project(&[2, 0]).expect("project")], &received);
    }
    // Altered projections are refused, not read.
    for columns in ["[7]", "[0,0]", "[]", "[-1]", "[\"c0\"]"] {
        let forged = text.replace("[2,0]", columns);
        let error = do_get_error(&mut client, Ticket::new(forged.into_bytes())).await;
        assert_eq!(code_of(&error), Code::InvalidArgument, "{columns}: {error}");
    }
    // A projected ticket of a replaced version is stale like any other.
    put(&mut client, cmd("t", "replace"), vec![int64_batch(5, 3, 1)])
        .await
        .expect("replace");
    let error = do_get_error(&mut client, ticket).await;
    assert_eq!(code_of(&error), Code::NotFound);
    server.shutdown_and_wait().await;

    // Each ticket repeats its column list: a wide projection of a dataset of many endpoints
    // still fits a client's 4 MiB message limit, through fewer endpoints.
    let options = ServeOptions {
        flight: FlightOptions {
            rows_per_endpoint: 1,
            ..FlightOptions::default()
        },
        ..ServeOptions::default()
    };
    let server = TestServer::start_with(make(), StoreOptions::default(), options).await;
    let mut client = server.client().await;
    let columns: Vec<(String, ArrayRef)> = (0..1500)
        .map(|c| {
            let values: ArrayRef = Arc::new(arrow::array::Int8Array::from(vec![c as i8; 5000]));
            (format!("c{c}"), values)
        })
        .collect();
    let wide = RecordBatch::try_from_iter(columns).expect("batch");
    put(&mut client, path("wide"), vec![wide.clone()])
        .await
        .expect("put");
    let names: Vec<String> = (0..1500).rev().map(|c| format!("c{c}")).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let info = client
        .get_flight_info(projected("wide", &names, None))
        .await
        .expect("a reply under 4 MiB");
    assert!(info.endpoint.len() > 1, "{} endpoints", info.endpoint.len());
    assert!(
        info.endpoint.len() < 1000,
        "{} endpoints",
        info.endpoint.len()
    );
    assert!(info.encoded_len() < 2 << 20, "{} bytes", info.encoded_len());
    let reversed: Vec<usize> = (0..1500).rev().collect();
    assert_same_data(
        &[wide.project(&reversed).expect("project")],
        &read_endpoints(&mut client, &info).await.expect("read"),
    );
    server.shutdown_and_wait().await;

    // Reads are chunked by bytes: a projection of one column in ten reads as many bytes per
    // chunk, so as many times fewer chunks (each at least one message), not as many.
    let options = ServeOptions {
        flight: FlightOptions {
            read_chunk_bytes: 16 << 10,
            ..FlightOptions::default()
        },
        ..ServeOptions::default()
    };
    let server = TestServer::start_with(make(), StoreOptions::default(), options).await;
    let mut client = server.client().await;
    let ten = int64_batch(20_000, 10, 0);
    put(&mut client, path("ten"), vec![ten.clone()])
        .await
        .expect("put");
    let whole = get_all(&mut client, "ten").await.expect("read");
    let info = client
        .get_flight_info(projected("ten", &["c4"], None))
        .await
        .expect("info");
    let one = read_endpoints(&mut client, &info).await.expect("read");
    assert_same_data(&[ten.project(&[4]).expect("project")], &one);
    assert!(
        whole.len() >= 50 && one.len() * 4 <= whole.len(),
        "{} batches for all columns, {} for one",
        whole.len(),
        one.len()
    );
    server.shutdown_and_wait().await;
}

#[test]
fn the_host_instantiation_covers_every_scenario() {
    // Guards against a scenario written but never instantiated: keep this list and the macro's
    // in step by counting the functions in this file.
    let source = include_str!("conformance.rs");
    let defined = source.matches("\nasync fn ").count();
    let listed = source
        .split("@tests $make, [$(#[$attr])*];")
        .nth(1)
        .and_then(|rest| rest.split(");").next())
        .map(|list| list.split(',').filter(|s| !s.trim().is_empty()).count())
        .expect("scenario list");
    assert_eq!(defined, listed);
    let _ = Field::new("unused", DataType::Null, true).is_nullable();
    let _: Option<&dyn Array> = None;
}
