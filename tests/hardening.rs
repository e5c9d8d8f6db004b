//! What a faulty or hostile client can do, and what the server must do about it: nothing a
//! client sends may crash it, panic a handler, commit part of a put, or hold memory the budget
//! did not pay for. Each test here failed before the hardening it covers.

mod common;

use std::sync::Arc;
use std::time::Duration;

use arrow::array::{ArrayRef, Decimal128Array, Int64Array, NullArray};
use arrow::datatypes::{DataType, Field, Schema};
use arrow::record_batch::{RecordBatch, RecordBatchOptions};
use arrow_flight::{Action, FlightData, FlightDescriptor, Ticket};
use bytes::Bytes;
use common::wire::{self, End};
use common::*;
use futures::TryStreamExt;
use gpu_flight::backend::{Backend, BackendError, DeviceInfo, HostBackend, Partition};
use gpu_flight::server::{ConnectionLimits, ServeOptions};
use gpu_flight::store::StoreOptions;
use prost::Message;
use tokio::io::AsyncReadExt;
use tonic::Code;

const WAIT: Duration = Duration::from_secs(10);

fn host() -> Arc<dyn Backend> {
    Arc::new(HostBackend::new())
}

fn limited(bytes: u64) -> StoreOptions {
    StoreOptions {
        memory_limit: Some(bytes),
        host_memory_limit: Some(0),
        ..StoreOptions::default()
    }
}

fn null_batch(rows: usize) -> RecordBatch {
    let column: ArrayRef = Arc::new(NullArray::new(rows));
    RecordBatch::try_from_iter([("n", column)]).expect("batch")
}

fn one_int64_schema() -> Schema {
    Schema::new(vec![Field::new("x", DataType::Int64, false)])
}

/// Sends `messages` as a DoPut over a raw connection and returns the outcome.
async fn raw_put(server: &TestServer, messages: &[FlightData], end: End) -> Option<wire::Outcome> {
    let mut client = wire::h2_connect(server.addr).await;
    wire::call(&mut client, "DoPut", wire::frames(messages), end, WAIT).await
}

#[tokio::test]
async fn rows_without_bytes_are_paid_for_and_cannot_crash_planning() {
    let server = TestServer::start_with(host(), limited(2 << 30), ServeOptions::default()).await;
    let mut client = server.client().await;

    // Nine batches of 2^31-1 null rows declare 2^34 rows in a few hundred bytes; at one bit a
    // row that is over 2 GiB, over the budget.
    let huge = vec![null_batch(i32::MAX as usize); 9];
    let refused = put(&mut client, path("nulls"), huge)
        .await
        .expect_err("refused");
    assert_eq!(code_of(&refused), Code::ResourceExhausted);
    assert_eq!(used_bytes(&mut client).await, 0);

    // Within the budget: accepted, charged, and every read path stays bounded.
    let rows = 3 * (i32::MAX as usize);
    let summary = put(
        &mut client,
        path("nulls"),
        vec![null_batch(i32::MAX as usize); 3],
    )
    .await
    .expect("put");
    assert_eq!(summary["total_rows"], rows as u64);
    assert!(used_bytes(&mut client).await >= rows as u64 / 8);
    let info = client.get_flight_info(path("nulls")).await.expect("info");
    assert!(
        info.endpoint.len() <= 4096,
        "{} endpoints",
        info.endpoint.len()
    );
    assert_eq!(info.total_records, rows as i64);
    let listed = list_all(&mut client).await;
    assert_eq!(listed.len(), 1);
    let batches = get_by_name(&mut client, "nulls").await.expect("read");
    assert_eq!(batches.iter().map(|b| b.num_rows()).sum::<usize>(), rows);

    // Zero columns, many rows: the same rule.
    let empty = Arc::new(Schema::empty());
    let options = RecordBatchOptions::new().with_row_count(Some(1 << 20));
    let no_columns =
        RecordBatch::try_new_with_options(Arc::clone(&empty), vec![], &options).expect("batch");
    put_with_schema(&mut client, path("empty"), empty, vec![no_columns])
        .await
        .expect("zero-column put");
    let read = get_by_name(&mut client, "empty").await.expect("read");
    assert_eq!(read.iter().map(|b| b.num_rows()).sum::<usize>(), 1 << 20);
    server.shutdown_and_wait().await;
}

#[tokio::test]
async fn impossible_lengths_are_invalid_argument() {
    let server = TestServer::start(host()).await;
    let schema = wire::schema_message(&one_int64_schema(), path("bad"));
    let body = vec![0u8; 64];
    let cases = [
        (
            "negative rows",
            wire::batch_message(-1, &[(-1, 0)], &[(0, 0), (0, 8)], body.clone()),
        ),
        (
            "more rows than a batch may hold",
            wire::batch_message(1 << 40, &[(1 << 40, 0)], &[(0, 0), (0, 64)], body.clone()),
        ),
        (
            "a buffer past the end of the body (truncated by 8 bytes)",
            wire::batch_message(8, &[(8, 0)], &[(0, 0), (0, 72)], body.clone()),
        ),
        (
            "a negative buffer offset",
            wire::batch_message(1, &[(1, 0)], &[(0, 0), (-8, 8)], body.clone()),
        ),
        (
            "more nulls than values",
            wire::batch_message(1, &[(1, 5)], &[(0, 1), (8, 8)], body.clone()),
        ),
        (
            "a buffer too short for its rows",
            wire::batch_message(8, &[(8, 0)], &[(0, 0), (0, 16)], body.clone()),
        ),
    ];
    for (what, batch) in cases {
        let outcome = raw_put(&server, &[schema.clone(), batch], End::Clean)
            .await
            .unwrap_or_else(|| panic!("{what}: no answer"));
        assert_eq!(
            outcome.code,
            Code::InvalidArgument as i32,
            "{what}: {outcome:?}"
        );
    }
    let mut client = server.client().await;
    assert_eq!(used_bytes(&mut client).await, 0);
    assert!(status(&mut client).await["datasets"] == 0);
    server.shutdown_and_wait().await;
}

#[tokio::test]
async fn decimals_beyond_their_precision_are_refused() {
    let server = TestServer::start(host()).await;
    let mut client = server.client().await;
    let values = Decimal128Array::from(vec![12345_i128])
        .with_precision_and_scale(3, 0)
        .expect("type");
    let column: ArrayRef = Arc::new(values);
    let batch = RecordBatch::try_from_iter([("d", column)]).expect("batch");
    let error = put(&mut client, path("d"), vec![batch])
        .await
        .expect_err("refused");
    assert_eq!(code_of(&error), Code::InvalidArgument);
    assert!(error.to_string().contains("precision"), "{error}");
    server.shutdown_and_wait().await;
}

#[tokio::test]
async fn doget_and_doput_compressed_as_a_whole_are_unimplemented() {
    let server = TestServer::start(host()).await;
    let messages: Vec<FlightData> = arrow_flight::encode::FlightDataEncoderBuilder::new()
        .with_flight_descriptor(Some(path("gzipped")))
        .build(futures::stream::iter([Ok(int64_batch(100, 1, 0))]))
        .try_collect()
        .await
        .expect("encode");
    let ticket = Ticket::new(Bytes::from_static(b"gzipped"));
    for (method, body) in [
        ("DoPut", wire::frames(&messages)),
        ("DoGet", wire::frames(&[ticket])),
    ] {
        let mut client = wire::h2_connect(server.addr).await;
        let outcome = wire::call_with(
            &mut client,
            method,
            &[("grpc-encoding", "gzip")],
            body,
            End::Clean,
            WAIT,
        )
        .await
        .expect("an answer");
        assert_eq!(
            outcome.code,
            Code::Unimplemented as i32,
            "{method}: {outcome:?}"
        );
        assert!(
            outcome.message.contains("\"gzip\""),
            "{method}: {outcome:?}"
        );
    }
    // Nothing was put.
    let missing = server
        .client()
        .await
        .get_flight_info(path("gzipped"))
        .await
        .expect_err("absent");
    assert_eq!(code_of(&missing), Code::NotFound);
    server.shutdown_and_wait().await;
}

#[tokio::test]
async fn a_put_reset_with_no_error_commits_nothing() {
    let server = TestServer::start(host()).await;
    let batch = int64_batch(1000, 2, 0);
    let messages: Vec<FlightData> = arrow_flight::encode::FlightDataEncoderBuilder::new()
        .with_flight_descriptor(Some(path("half")))
        .build(futures::stream::iter([Ok(batch)]))
        .try_collect()
        .await
        .expect("encode");
    // Every message arrives whole, then the client resets the stream instead of ending it.
    let outcome = raw_put(&server, &messages, End::ResetNoError).await;
    assert!(
        outcome.as_ref().is_none_or(|o| o.code != 0),
        "a reset put must not succeed: {outcome:?}"
    );
    let mut client = server.client().await;
    let addr = server.addr;
    wait_until(|| async move { used_bytes(&mut connect(addr).await).await == 0 }).await;
    let missing = client
        .get_flight_info(path("half"))
        .await
        .expect_err("absent");
    assert_eq!(code_of(&missing), Code::NotFound);
    server.shutdown_and_wait().await;
}

#[tokio::test]
async fn trailers_in_the_middle_of_a_message_commit_nothing() {
    let server = TestServer::start(host()).await;
    let batch = int64_batch(1000, 2, 0);
    let messages: Vec<FlightData> = arrow_flight::encode::FlightDataEncoderBuilder::new()
        .with_flight_descriptor(Some(path("cut")))
        .build(futures::stream::iter([Ok(batch.clone()), Ok(batch)]))
        .try_collect()
        .await
        .expect("encode");
    // Whole messages, then half of the last one, then trailers (which tonic takes for the end).
    let mut body = wire::frames(&messages).to_vec();
    let last = wire::frame(&messages[messages.len() - 1].encode_to_vec());
    body.truncate(body.len() - last.len() / 2);
    let mut raw = wire::h2_connect(server.addr).await;
    let outcome = wire::call(&mut raw, "DoPut", body.into(), End::Trailers, WAIT)
        .await
        .expect("answer");
    assert_eq!(outcome.code, Code::InvalidArgument as i32, "{outcome:?}");
    let mut client = server.client().await;
    assert_eq!(status(&mut client).await["datasets"], 0);
    assert_eq!(used_bytes(&mut client).await, 0);
    server.shutdown_and_wait().await;
}

#[tokio::test]
async fn requests_without_a_body_are_invalid_argument() {
    let server = TestServer::start(host()).await;
    let mut raw = wire::h2_connect(server.addr).await;
    for method in [
        "GetFlightInfo",
        "GetSchema",
        "DoGet",
        "DoAction",
        "ListFlights",
    ] {
        for end in [End::OnHeaders, End::Trailers] {
            let outcome = wire::call(&mut raw, method, Bytes::new(), end, WAIT)
                .await
                .unwrap_or_else(|| panic!("{method}: no answer"));
            assert_eq!(
                outcome.code,
                Code::InvalidArgument as i32,
                "{method} {end:?}: {outcome:?}"
            );
        }
    }
    server.shutdown_and_wait().await;
}

fn quick_keepalive() -> ServeOptions {
    ServeOptions {
        keepalive_interval: Duration::from_secs(1),
        keepalive_timeout: Duration::from_secs(1),
        ..ServeOptions::default()
    }
}

/// On several worker threads, as in the server binary: the handler and the task receiving its
/// stream then race when a keepalive ping goes unanswered, and before the fix the put
/// committed whenever the handler saw the stream's (NO_ERROR) end first.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_frozen_client_never_gets_a_partial_put_committed() {
    let server = TestServer::start_with(host(), StoreOptions::default(), quick_keepalive()).await;
    let proxy = FreezableProxy::start(server.addr).await;
    let mut frozen = proxy.client().await;
    let (batches, receiver) = tokio::sync::mpsc::channel(4);
    let input = tokio_stream::wrappers::ReceiverStream::new(receiver);
    let data = arrow_flight::encode::FlightDataEncoderBuilder::new()
        .with_flight_descriptor(Some(path("frozen")))
        .build(input);
    let put = tokio::spawn(async move { frozen.do_put(data).await.map(|_| ()) });
    for seed in 0..4 {
        batches
            .send(Ok(int64_batch(100_000, 4, seed)))
            .await
            .expect("send");
    }
    let mut client = server.client().await;
    let addr = server.addr;
    wait_until(|| async move { used_bytes(&mut connect(addr).await).await > 0 }).await;
    proxy.freeze();
    // Keepalive gives up within a couple of seconds; what the put had uploaded is returned.
    let addr = server.addr;
    wait_until(|| async move { used_bytes(&mut connect(addr).await).await == 0 }).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let missing = client
        .get_flight_info(path("frozen"))
        .await
        .expect_err("absent");
    assert_eq!(code_of(&missing), Code::NotFound);
    drop(batches);
    put.abort();
    server.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_frozen_reader_lets_go_of_a_dropped_dataset() {
    let server = TestServer::start_with(host(), StoreOptions::default(), quick_keepalive()).await;
    let mut client = server.client().await;
    put(&mut client, path("big"), vec![int64_batch(1 << 20, 8, 0)])
        .await
        .expect("put");
    let proxy = FreezableProxy::start(server.addr).await;
    let mut reader = proxy.client().await;
    let mut stream = reader.do_get(Ticket::new("big")).await.expect("do_get");
    stream
        .try_next()
        .await
        .expect("first batch")
        .expect("a batch");
    proxy.freeze();
    action(&mut client, "drop", serde_json::json!({"name": "big"}))
        .await
        .expect("drop");
    let addr = server.addr;
    wait_until(|| async move { used_bytes(&mut connect(addr).await).await == 0 }).await;
    drop(stream);
    server.shutdown_and_wait().await;
}

#[tokio::test]
async fn oversized_messages_are_refused_at_their_length_prefix() {
    let options = ServeOptions {
        flight: gpu_flight::flight::FlightOptions {
            max_put_message_bytes: 1 << 20,
            ..Default::default()
        },
        ..ServeOptions::default()
    };
    let server = TestServer::start_with(host(), StoreOptions::default(), options).await;
    let mut client = server.client().await;

    let big = int64_batch(1 << 17, 4, 0); // 4 MiB in one message
    let error = put(&mut client, path("big"), vec![big])
        .await
        .expect_err("refused");
    assert_eq!(code_of(&error), Code::ResourceExhausted);
    assert!(
        error.to_string().contains("--max-put-message-bytes"),
        "{error}"
    );

    // A prefix announcing 4 GiB, and nothing after it: refused at once, nothing reserved.
    let mut raw = wire::h2_connect(server.addr).await;
    let prefix = Bytes::from_static(&[0, 0xff, 0xff, 0xff, 0xff, 0]);
    let outcome = wire::call(&mut raw, "DoPut", prefix, End::Open, WAIT)
        .await
        .expect("an answer without the body");
    assert_eq!(outcome.code, Code::ResourceExhausted as i32, "{outcome:?}");

    // Tickets and action bodies are small.
    let ticket = client
        .do_get(Ticket::new(vec![b'x'; 5 << 20]))
        .await
        .expect_err("refused");
    assert_eq!(code_of(&ticket), Code::InvalidArgument);
    assert!(
        ticket.to_string().contains("--max-request-bytes"),
        "{ticket}"
    );
    let body = match client
        .do_action(Action::new("drop", vec![b' '; 1 << 20]))
        .await
    {
        Ok(_) => panic!("a 1 MiB action body is refused"),
        Err(error) => error,
    };
    assert_eq!(code_of(&body), Code::InvalidArgument);
    assert_eq!(used_bytes(&mut client).await, 0);
    server.shutdown_and_wait().await;
}

#[tokio::test]
async fn undecodable_requests_are_invalid_argument() {
    let server = TestServer::start(host()).await;
    let mut raw = wire::h2_connect(server.addr).await;
    let garbage = wire::frame(&[0xff, 0xff, 0xff, 0xff, 0x0f]);
    for method in ["GetFlightInfo", "DoGet", "DoAction", "DoPut", "ListFlights"] {
        let outcome = wire::call(&mut raw, method, garbage.clone(), End::Clean, WAIT)
            .await
            .unwrap_or_else(|| panic!("{method}: no answer"));
        assert_eq!(
            outcome.code,
            Code::InvalidArgument as i32,
            "{method}: {outcome:?}"
        );
    }
    // A path element that is not UTF-8: protobuf strings must be.
    let mut descriptor = FlightDescriptor::new_path(vec!["x".to_owned()]).encode_to_vec();
    let last = descriptor.len() - 1;
    descriptor[last] = 0xff;
    let outcome = wire::call(
        &mut raw,
        "GetFlightInfo",
        wire::frame(&descriptor),
        End::Clean,
        WAIT,
    )
    .await
    .expect("answer");
    assert_eq!(outcome.code, Code::InvalidArgument as i32, "{outcome:?}");
    // JSON arrays are not commands.
    let mut client = server.client().await;
    let command = FlightDescriptor::new_cmd(r#"["t", "create"]"#);
    let error = put(&mut client, command, vec![int64_batch(10, 1, 0)])
        .await
        .expect_err("refused");
    assert_eq!(code_of(&error), Code::InvalidArgument);
    assert_eq!(status(&mut client).await["datasets"], 0);
    server.shutdown_and_wait().await;
}

fn connection_limits(max_connections: usize, handshake_seconds: u64) -> ServeOptions {
    ServeOptions {
        connections: ConnectionLimits {
            max_connections,
            handshake_timeout: Duration::from_secs(handshake_seconds),
            idle_timeout: Duration::from_secs(2),
            ..ConnectionLimits::default()
        },
        ..ServeOptions::default()
    }
}

/// Waits for the server to close `socket`, reading past the SETTINGS it sends first.
async fn closed_by_server(socket: &mut tokio::net::TcpStream) -> bool {
    let mut received = Vec::new();
    tokio::time::timeout(WAIT, socket.read_to_end(&mut received))
        .await
        .is_ok()
}

#[tokio::test]
async fn silent_and_idle_connections_are_closed() {
    let options = connection_limits(100, 1);
    let server = TestServer::start_with(host(), StoreOptions::default(), options).await;
    // Never sends the HTTP/2 preface: closed after the handshake timeout.
    let mut silent = tokio::net::TcpStream::connect(server.addr)
        .await
        .expect("connect");
    assert!(closed_by_server(&mut silent).await);
    // Handshakes, then makes no call: closed after the idle timeout.
    let tcp = tokio::net::TcpStream::connect(server.addr)
        .await
        .expect("connect");
    let (_h2, connection) = h2::client::handshake(tcp).await.expect("handshake");
    let ended = tokio::time::timeout(WAIT, connection).await;
    assert!(ended.is_ok(), "an idle connection is closed by the server");
    server.shutdown_and_wait().await;
}

#[tokio::test]
async fn silent_sockets_cannot_lock_clients_out_and_busy_connections_are_kept() {
    // A long handshake timeout: only eviction can make room here.
    let server =
        TestServer::start_with(host(), StoreOptions::default(), connection_limits(4, 60)).await;
    let mut silent = Vec::new();
    for _ in 0..4 {
        silent.push(
            tokio::net::TcpStream::connect(server.addr)
                .await
                .expect("connect"),
        );
    }
    // Every slot is held by a socket that said nothing; a real client still gets in, at the
    // expense of the oldest of them.
    let mut client = server.client().await;
    assert_eq!(status(&mut client).await["datasets"], 0);
    assert!(
        closed_by_server(&mut silent[0]).await,
        "the oldest silent socket was evicted"
    );
    drop(silent);
    drop(client);

    // Four connections, each with a put in progress: nothing to evict, so a fifth is refused.
    let mut senders = Vec::new();
    let mut puts = Vec::new();
    for index in 0..4 {
        let mut busy = connect(server.addr).await;
        let (sender, receiver) = tokio::sync::mpsc::channel(1);
        let data = arrow_flight::encode::FlightDataEncoderBuilder::new()
            .with_flight_descriptor(Some(path(&format!("busy{index}"))))
            .build(tokio_stream::wrappers::ReceiverStream::new(receiver));
        sender
            .send(Ok(int64_batch(10, 1, index)))
            .await
            .expect("send");
        puts.push(tokio::spawn(
            async move { busy.do_put(data).await.map(|_| ()) },
        ));
        senders.push(sender);
    }
    // All four have uploaded their batch and wait for more: exactly four batches and four
    // schemas are charged. (Asked of the store directly: a status call would need a connection
    // of its own.)
    let store = server.store.clone();
    let batch = int64_batch(10, 1, 0);
    let one_put =
        80 + gpu_flight::store::ARRAY_OVERHEAD + gpu_flight::arrays::schema_bytes(&batch.schema());
    wait_until(|| {
        let used = store.status().devices[0].used_bytes;
        async move { used == 4 * one_put }
    })
    .await;
    let mut refused = tokio::net::TcpStream::connect(server.addr)
        .await
        .expect("connect");
    let mut byte = [0u8; 1];
    let closed = tokio::time::timeout(WAIT, refused.read(&mut byte)).await;
    assert!(matches!(closed, Ok(Ok(0)) | Ok(Err(_))), "{closed:?}");
    drop(senders);
    for put in puts {
        put.await
            .expect("task")
            .expect("the busy puts were not disturbed");
    }
    server.shutdown_and_wait().await;
}

/// The host backend, except that reading panics: a stand-in for any bug below the protocol.
#[derive(Debug)]
struct PanickingReads(HostBackend);

#[derive(Debug)]
struct PanickingPartition(Arc<dyn Partition>);

impl Partition for PanickingPartition {
    fn num_rows(&self) -> usize {
        self.0.num_rows()
    }
    fn bytes(&self) -> u64 {
        self.0.bytes()
    }
    fn read(
        &self,
        _offset: usize,
        _len: usize,
        _columns: Option<&[usize]>,
    ) -> futures::future::BoxFuture<'static, Result<RecordBatch, BackendError>> {
        panic!("a bug in a backend")
    }
    fn export(
        &self,
        columns: &[usize],
    ) -> Result<
        (
            gpu_flight::backend::ExportDevice,
            Vec<gpu_flight::backend::ExportedColumn>,
        ),
        BackendError,
    > {
        self.0.export(columns)
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Backend for PanickingReads {
    fn name(&self) -> &'static str {
        "panicking"
    }
    fn devices(&self) -> Vec<DeviceInfo> {
        self.0.devices()
    }
    fn stored_size(&self, batch: &RecordBatch) -> Result<u64, BackendError> {
        self.0.stored_size(batch)
    }
    fn upload(
        &self,
        device: u32,
        batch: RecordBatch,
    ) -> futures::future::BoxFuture<'static, Result<Arc<dyn Partition>, BackendError>> {
        use futures::FutureExt;
        self.0
            .upload(device, batch)
            .map(|uploaded| uploaded.map(|p| Arc::new(PanickingPartition(p)) as Arc<dyn Partition>))
            .boxed()
    }
    fn compacted_size(&self, _partitions: &[Arc<dyn Partition>]) -> Result<u64, BackendError> {
        Err(BackendError::CannotCompact {
            reason: "not in this test".to_owned(),
        })
    }
    fn compact(
        &self,
        _partitions: Vec<Arc<dyn Partition>>,
    ) -> futures::future::BoxFuture<'static, Result<Arc<dyn Partition>, BackendError>> {
        unreachable!("compacted_size refuses")
    }
    fn copied_size(
        &self,
        _partition: &Arc<dyn Partition>,
        _columns: &[usize],
    ) -> Result<u64, BackendError> {
        Err(BackendError::Device("not in this test".to_owned()))
    }
    fn copy_to(
        &self,
        _partition: Arc<dyn Partition>,
        _columns: Vec<usize>,
        _device: u32,
    ) -> futures::future::BoxFuture<'static, Result<Arc<dyn Partition>, BackendError>> {
        unreachable!("copied_size refuses")
    }
}

#[tokio::test]
async fn a_panic_below_a_handler_is_internal_and_the_server_stays_up() {
    let server = TestServer::start(Arc::new(PanickingReads(HostBackend::new()))).await;
    let mut client = server.client().await;
    put(&mut client, path("t"), vec![int64_batch(100, 1, 0)])
        .await
        .expect("put");
    let error = get_by_name(&mut client, "t")
        .await
        .expect_err("the read fails");
    assert_eq!(code_of(&error), Code::Internal, "{error}");
    assert_eq!(status(&mut client).await["datasets"], 1, "still serving");
    server.shutdown_and_wait().await;
}

#[tokio::test]
async fn a_one_row_batch_keeps_none_of_the_padding_it_came_with() {
    let server = TestServer::start(host()).await;
    let schema = wire::schema_message(&one_int64_schema(), path("padded"));
    // One int64 value, then 16 MiB the batch does not use; and a buffer declared 16 MiB long.
    let mut trailing = vec![0u8; 16 << 20];
    trailing[..8].copy_from_slice(&42_i64.to_le_bytes());
    let padded = wire::batch_message(1, &[(1, 0)], &[(0, 0), (0, 8)], trailing.clone());
    let oversized = wire::batch_message(1, &[(1, 0)], &[(0, 0), (0, 16 << 20)], trailing);
    let outcome = raw_put(&server, &[schema, padded, oversized], End::Clean)
        .await
        .expect("answer");
    assert_eq!(outcome.code, 0, "{outcome:?}");
    let mut client = server.client().await;
    let used = used_bytes(&mut client).await;
    assert!(used < 4096, "the dataset is charged {used} bytes");
    let batches = get_by_name(&mut client, "padded").await.expect("read");
    let values: Vec<i64> = batches
        .iter()
        .flat_map(|b| {
            let column = b
                .column(0)
                .as_any()
                .downcast_ref::<Int64Array>()
                .expect("int64");
            column.values().to_vec()
        })
        .collect();
    assert_eq!(values, vec![42, 42]);
    server.shutdown_and_wait().await;
}

/// The real binary, for what only a separate process shows: its resident memory.
struct Binary {
    process: std::process::Child,
    addr: std::net::SocketAddr,
}

impl Binary {
    fn start(flags: &[&str]) -> Self {
        use std::io::BufRead;
        // GPU_FLIGHT_BIN where the test binary runs away from its build (the GPU machine).
        let binary = std::env::var("GPU_FLIGHT_BIN")
            .unwrap_or_else(|_| env!("CARGO_BIN_EXE_gpu-flight").to_owned());
        let mut process = std::process::Command::new(binary)
            .args(["serve", "--backend", "host", "--listen", "127.0.0.1:0"])
            .args(flags)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start gpu-flight");
        let stdout = process.stdout.take().expect("stdout");
        let mut line = String::new();
        std::io::BufReader::new(stdout)
            .read_line(&mut line)
            .expect("first line");
        let addr = line
            .split("grpc://")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|addr| addr.parse().ok())
            .unwrap_or_else(|| panic!("no address in {line:?}"));
        Self { process, addr }
    }

    fn resident_bytes(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.process.id()))
            .expect("/proc status");
        let kib: u64 = status
            .lines()
            .find_map(|line| line.strip_prefix("VmRSS:"))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|kib| kib.parse().ok())
            .expect("VmRSS");
        kib * 1024
    }
}

impl Drop for Binary {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

/// Resident memory the server may use beyond its budget: the runtime, the allocator's pools,
/// and messages being decoded (stated in the README's Configuration section).
const FIXED_OVERHEAD: u64 = 96 << 20;

#[tokio::test]
async fn padding_attacks_stay_within_the_memory_limit() {
    const LIMIT: u64 = 64 << 20;
    let server = Binary::start(&["--memory-limit", "64MiB"]);
    let baseline = server.resident_bytes();
    let mut raw = wire::h2_connect(server.addr).await;
    // Forty one-row batches, each carrying 8 MiB the row does not need: 320 MiB sent.
    for index in 0..40 {
        let schema = wire::schema_message(&one_int64_schema(), path(&format!("pad{index}")));
        let batch = wire::batch_message(1, &[(1, 0)], &[(0, 0), (0, 8)], vec![1u8; 8 << 20]);
        let outcome = wire::call(
            &mut raw,
            "DoPut",
            wire::frames(&[schema, batch]),
            End::Clean,
            WAIT,
        )
        .await
        .expect("answer");
        assert_eq!(outcome.code, 0, "{outcome:?}");
    }
    // Schemas with 1.5 MiB of metadata each: charged, so refused once the budget is full.
    let mut refused = 0;
    for index in 0..60 {
        let metadata = std::collections::HashMap::from([("junk".to_owned(), "m".repeat(3 << 19))]);
        let schema = one_int64_schema().with_metadata(metadata);
        let message = wire::schema_message(&schema, path(&format!("meta{index}")));
        let outcome = wire::call(
            &mut raw,
            "DoPut",
            wire::frames(&[message]),
            End::Clean,
            WAIT,
        )
        .await
        .expect("answer");
        if outcome.code == Code::ResourceExhausted as i32 {
            refused += 1;
        } else {
            assert_eq!(outcome.code, 0, "{outcome:?}");
        }
    }
    assert!(refused > 0, "64 MiB cannot hold 90 MiB of schema metadata");
    let resident = server.resident_bytes();
    println!(
        "resident {} MiB after the attacks (baseline {} MiB, limit 64 MiB)",
        resident >> 20,
        baseline >> 20
    );
    assert!(
        resident <= baseline.max(32 << 20) + LIMIT + FIXED_OVERHEAD,
        "resident {} MiB (baseline {} MiB) with a 64 MiB limit",
        resident >> 20,
        baseline >> 20
    );
}

fn wide_batch(columns: usize, rows: usize) -> RecordBatch {
    let arrays: Vec<(String, ArrayRef)> = (0..columns)
        .map(|c| {
            let values =
                arrow::array::Int8Array::from_iter_values((0..rows).map(|r| (r + c) as i8));
            (format!("c{c}"), Arc::new(values) as ArrayRef)
        })
        .collect();
    RecordBatch::try_from_iter(arrays).expect("wide batch")
}

/// A batch of 5,000 int64 rows whose schema carries `bytes` of metadata.
fn batch_with_schema_of(bytes: usize) -> RecordBatch {
    let schema = Schema::new(vec![Field::new("v", DataType::Int64, false)]).with_metadata(
        std::collections::HashMap::from([("pad".to_owned(), "x".repeat(bytes))]),
    );
    let values: ArrayRef = Arc::new(Int64Array::from_iter_values(0..5000));
    RecordBatch::try_new(Arc::new(schema), vec![values]).expect("batch")
}

#[tokio::test]
async fn a_schema_leaves_room_for_the_replies_that_carry_it() {
    // One row per endpoint: a GetFlightInfo reply lists as many endpoints as it may.
    let options = ServeOptions {
        flight: gpu_flight::flight::FlightOptions {
            rows_per_endpoint: 1,
            ..Default::default()
        },
        ..ServeOptions::default()
    };
    let server = TestServer::start_with(host(), StoreOptions::default(), options).await;
    let mut client = server.client().await;

    // A schema of 3.8 MiB fits the default 4032 KiB DoGet message, but GetFlightInfo adds
    // its endpoints (here about 250 KB of them), past what a client with gRPC's default
    // 4 MiB limit takes: refused.
    let error = put(
        &mut client,
        path("big"),
        vec![batch_with_schema_of((4 << 20) - (200 << 10))],
    )
    .await
    .expect_err("refused");
    assert_eq!(code_of(&error), Code::InvalidArgument);
    assert!(error.to_string().contains("--max-message-bytes"), "{error}");

    // Just under 2 MiB: kept, and its FlightInfo, endpoints and all, reaches such a client.
    put(
        &mut client,
        path("kept"),
        vec![batch_with_schema_of((2 << 20) - (16 << 10))],
    )
    .await
    .expect("put");
    let info = client
        .get_flight_info(path("kept"))
        .await
        .expect("a reply under 4 MiB");
    assert!(
        info.endpoint.len() >= 2000,
        "{} endpoints",
        info.endpoint.len()
    );
    server.shutdown_and_wait().await;
}

#[tokio::test]
async fn wide_schemas_keep_the_reply_ceiling_or_say_why_they_cannot() {
    const CEILING: usize = 1 << 20;
    let options = ServeOptions {
        flight: gpu_flight::flight::FlightOptions {
            max_message_bytes: CEILING,
            ..Default::default()
        },
        ..ServeOptions::default()
    };
    let server = TestServer::start_with(host(), StoreOptions::default(), options).await;
    let mut client = server.client().await;

    // 2,000 columns: each message's metadata and padding are large, but a few rows fit.
    put(&mut client, path("wide"), vec![wide_batch(2_000, 500)])
        .await
        .expect("put");
    let mut raw = server.raw_client().await;
    let mut replies = raw
        .do_get(Ticket::new("wide"))
        .await
        .expect("do_get")
        .into_inner();
    let mut rows = 0;
    while let Some(message) = replies.message().await.expect("message") {
        assert!(
            message.encoded_len() <= CEILING,
            "a message of {} bytes",
            message.encoded_len()
        );
        rows += 1;
    }
    assert!(rows > 2, "the batch was split");
    assert_eq!(
        get_by_name(&mut client, "wide")
            .await
            .expect("read")
            .iter()
            .map(|b| b.num_rows())
            .sum::<usize>(),
        500
    );

    // 15,000 columns: one row's metadata and padding alone are over the ceiling, so no row
    // could be read back: the put is refused, and says why.
    let error = put(&mut client, path("wider"), vec![wide_batch(15_000, 2)])
        .await
        .expect_err("too wide");
    assert_eq!(code_of(&error), Code::InvalidArgument);
    assert!(error.to_string().contains("--max-message-bytes"), "{error}");
    let missing = client
        .get_flight_info(path("wider"))
        .await
        .expect_err("nothing stored");
    assert_eq!(code_of(&missing), Code::NotFound);
    server.shutdown_and_wait().await;
}

/// One row of `columns` columns: int64 (null), strings and lists of int32, in turn.
fn mixed_row(columns: usize) -> RecordBatch {
    let arrays: Vec<(String, ArrayRef)> = (0..columns)
        .map(|c| {
            let array: ArrayRef = match c % 3 {
                0 => Arc::new(Int64Array::from(vec![None])),
                1 => Arc::new(arrow::array::StringArray::from(vec!["x".repeat(c % 70)])),
                _ => Arc::new(arrow::array::ListArray::from_iter_primitive::<
                    arrow::datatypes::Int32Type,
                    _,
                    _,
                >([Some(
                    (0..c % 20).map(|v| Some(v as i32)),
                )])),
            };
            (format!("c{c}"), array)
        })
        .collect();
    RecordBatch::try_from_iter(arrays).expect("mixed row")
}

#[tokio::test]
async fn a_put_no_row_of_which_could_be_read_back_is_refused_and_the_widest_accepted_reads_back() {
    const CEILING: usize = 64 << 10;
    let options = ServeOptions {
        flight: gpu_flight::flight::FlightOptions {
            max_message_bytes: CEILING,
            ..Default::default()
        },
        ..ServeOptions::default()
    };
    let server = TestServer::start_with(host(), StoreOptions::default(), options).await;
    let mut client = server.client().await;

    // 600 columns: the schema message fits in 64 KiB; one row's message does not.
    let (mut accepted, mut refused) = (1, 600);
    let error = put(&mut client, path("too wide"), vec![mixed_row(refused)])
        .await
        .expect_err("refused");
    assert_eq!(code_of(&error), Code::InvalidArgument, "{error}");
    let message = error.to_string();
    assert!(message.contains("--max-message-bytes"), "{message}");
    assert!(message.contains(&CEILING.to_string()), "{message}");
    assert!(
        message.contains("no row of it could be read back"),
        "{message}"
    );
    assert!(list_all(&mut client).await.is_empty(), "nothing stored");
    assert_eq!(used_bytes(&mut client).await, 0);

    // The widest put accepted (acceptance falls with width: search for the edge)...
    put(&mut client, path("w1"), vec![mixed_row(accepted)])
        .await
        .expect("one column");
    while refused - accepted > 1 {
        let columns = (accepted + refused) / 2;
        let name = format!("w{columns}");
        match put(&mut client, path(&name), vec![mixed_row(columns)]).await {
            Ok(_) => accepted = columns,
            Err(error) => {
                assert_eq!(code_of(&error), Code::InvalidArgument, "{error}");
                refused = columns;
            }
        }
    }
    // ...reads back, with and without compression.
    let name = format!("w{accepted}");
    let sent = vec![mixed_row(accepted)];
    assert_same_data(&sent, &get_all(&mut client, &name).await.expect("read"));
    let compressed = FlightDescriptor::new_cmd(
        serde_json::json!({"name": name, "compression": "zstd"}).to_string(),
    );
    let info = client.get_flight_info(compressed).await.expect("info");
    let mut received = Vec::new();
    for endpoint in info.endpoint {
        let ticket = endpoint.ticket.expect("ticket");
        let mut part: Vec<RecordBatch> = client
            .do_get(ticket)
            .await
            .expect("do_get")
            .try_collect()
            .await
            .expect("read compressed");
        received.append(&mut part);
    }
    assert_same_data(&sent, &received);
    server.shutdown_and_wait().await;
}

#[tokio::test]
async fn the_longest_names_on_the_most_endpoints_fit_a_clients_message_limit() {
    // Every ticket repeats the dataset's name: at the most endpoints a reply lists, a name of
    // the most bytes a name may have still leaves the reply far under a client's 4 MiB.
    let options = ServeOptions {
        flight: gpu_flight::flight::FlightOptions {
            rows_per_endpoint: 1,
            ..gpu_flight::flight::FlightOptions::default()
        },
        ..ServeOptions::default()
    };
    let server = TestServer::start_with(host(), limited(1 << 30), options).await;
    let mut client = server.client().await;
    let name = "n".repeat(gpu_flight::flight::descriptor::MAX_NAME_BYTES);
    put(&mut client, path(&name), vec![null_batch(4096 * 25)])
        .await
        .expect("put");
    let info = client.get_flight_info(path(&name)).await.expect("info");
    assert_eq!(info.endpoint.len(), 4096);
    assert!(info.encoded_len() < 2 << 20, "{} bytes", info.encoded_len());
    server.shutdown_and_wait().await;
}

/// `ipc-export` describes every column it names in every partition: a list that repeats one
/// column thousands of times made one short request build a document of gigabytes. A list
/// names each column at most once, and at least one, as reads' lists do.
#[tokio::test]
async fn export_column_lists_are_refused_when_they_repeat_or_are_empty() {
    let server = TestServer::start(host()).await;
    let mut client = server.client().await;
    put(&mut client, path("t"), vec![int64_batch(10, 2, 0)])
        .await
        .expect("put");
    let repeated = vec!["c0"; 3000];
    for (columns, says) in [
        (serde_json::json!(repeated), "at most once"),
        (serde_json::json!([]), "at least one"),
    ] {
        let refused = action(
            &mut client,
            "ipc-export",
            serde_json::json!({"name": "t", "columns": columns}),
        )
        .await
        .expect_err("refused");
        let status = code_of(&refused);
        assert_eq!(status, Code::InvalidArgument, "{refused}");
        assert!(refused.to_string().contains(says), "{refused}");
    }
    server.shutdown_and_wait().await;
}

/// The host backend, but each upload runs on a task of its own for a while, as the cuda
/// backend's do: a put that fails meanwhile cannot stop them.
#[derive(Debug)]
struct SlowUploads(HostBackend);

impl Backend for SlowUploads {
    fn name(&self) -> &'static str {
        "slow uploads"
    }
    fn devices(&self) -> Vec<DeviceInfo> {
        self.0.devices()
    }
    fn stored_size(&self, batch: &RecordBatch) -> Result<u64, BackendError> {
        self.0.stored_size(batch)
    }
    fn upload(
        &self,
        device: u32,
        batch: RecordBatch,
    ) -> futures::future::BoxFuture<'static, Result<Arc<dyn Partition>, BackendError>> {
        use futures::FutureExt;
        let upload = self.0.upload(device, batch);
        let task = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            upload.await
        });
        task.map(|joined| joined.unwrap_or_else(|e| Err(BackendError::Device(e.to_string()))))
            .boxed()
    }
    fn compacted_size(&self, partitions: &[Arc<dyn Partition>]) -> Result<u64, BackendError> {
        self.0.compacted_size(partitions)
    }
    fn compact(
        &self,
        partitions: Vec<Arc<dyn Partition>>,
    ) -> futures::future::BoxFuture<'static, Result<Arc<dyn Partition>, BackendError>> {
        self.0.compact(partitions)
    }
    fn copied_size(
        &self,
        partition: &Arc<dyn Partition>,
        columns: &[usize],
    ) -> Result<u64, BackendError> {
        self.0.copied_size(partition, columns)
    }
    fn copy_to(
        &self,
        partition: Arc<dyn Partition>,
        columns: Vec<usize>,
        device: u32,
    ) -> futures::future::BoxFuture<'static, Result<Arc<dyn Partition>, BackendError>> {
        self.0.copy_to(partition, columns, device)
    }
}

/// A put that fails while uploads it started are still running answers once they are done:
/// the memory they use is paid for until then, and free when the client hears of the failure.
#[tokio::test]
async fn a_failed_put_answers_once_its_uploads_are_done_and_their_memory_free() {
    let server = TestServer::start(Arc::new(SlowUploads(HostBackend::new()))).await;
    let mut client = server.client().await;
    let batches: Vec<_> = (0..3).map(|i| int64_batch(20_000, 3, i)).collect();
    let error = put_then_abort(&mut client, path("t"), batches, "gave up").await;
    assert_eq!(code_of(&error), Code::Aborted, "{error}");
    assert_eq!(
        used_bytes(&mut client).await,
        0,
        "still paid for on answering"
    );
    server.shutdown_and_wait().await;
}
