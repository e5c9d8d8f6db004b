//! Test fixture: a gpu-flight server in this process on `127.0.0.1:0`, clients for it, and
//! record batch makers shared by the suites.
#![allow(dead_code, unreachable_pub)]

pub mod datadir;
pub mod devices;
pub mod raw;
pub mod wire;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arrow::array::*;
use arrow::buffer::{NullBuffer, OffsetBuffer};
use arrow::datatypes::*;
use arrow::record_batch::RecordBatch;
use arrow_flight::encode::{DictionaryHandling, FlightDataEncoderBuilder};
use arrow_flight::error::FlightError;
use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_flight::{Action, FlightClient, FlightDescriptor, Ticket};
use futures::TryStreamExt;
use gpu_flight::backend::Backend;
use gpu_flight::metrics::Metrics;
use gpu_flight::server::{self, ServeOptions};
use gpu_flight::store::{Store, StoreOptions};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::Code;
use tonic::transport::Channel;

/// With `RUST_LOG` set (`RUST_LOG=gpu_flight=info`), the servers' logs go to the tests'
/// output, which the harness shows for the tests that fail: for a test that fails now and then.
fn log_if_asked() {
    if std::env::var_os("RUST_LOG").is_some() {
        let _already = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
    }
}

/// A server running in this process.
pub struct TestServer {
    pub addr: SocketAddr,
    /// The plain-text health listener, for servers started with one.
    pub health_addr: Option<SocketAddr>,
    pub store: Store,
    /// What the server counts (every test server has metrics, so every test runs them).
    pub metrics: Arc<Metrics>,
    shutdown: Option<oneshot::Sender<()>>,
    handle: JoinHandle<Result<(), tonic::transport::Error>>,
}

impl TestServer {
    pub async fn start(backend: Arc<dyn Backend>) -> Self {
        Self::start_with(backend, StoreOptions::default(), ServeOptions::default()).await
    }

    /// The host backend with default store options and these serving options.
    pub async fn on_host(options: ServeOptions) -> Self {
        Self::start_with(
            Arc::new(gpu_flight::backend::HostBackend::new()),
            StoreOptions::default(),
            options,
        )
        .await
    }

    pub async fn start_with(
        backend: Arc<dyn Backend>,
        store_options: StoreOptions,
        options: ServeOptions,
    ) -> Self {
        Self::launch(backend, store_options, options, false).await
    }

    /// Also serves health alone, in plain text, on a second port ([`Self::health_addr`]).
    pub async fn start_with_health_listener(
        backend: Arc<dyn Backend>,
        store_options: StoreOptions,
        options: ServeOptions,
    ) -> Self {
        Self::launch(backend, store_options, options, true).await
    }

    /// Serves `store` as it is (one opened over a data directory, say).
    pub async fn serve(store: Store, options: ServeOptions) -> Self {
        Self::launch_store(store, options, false).await
    }

    /// Also serves the shared-memory side channel (`shm-read`) on a Unix socket at `socket`.
    pub async fn start_with_shared_memory(
        backend: Arc<dyn Backend>,
        store_options: StoreOptions,
        options: ServeOptions,
        socket: &std::path::Path,
    ) -> Self {
        let listener = server::Listener::bind_unix(socket)
            .await
            .expect("bind the side channel");
        let store = Store::new(backend, store_options);
        Self::launch_with(store, options, false, Some(listener)).await
    }

    async fn launch(
        backend: Arc<dyn Backend>,
        store_options: StoreOptions,
        options: ServeOptions,
        health_listener: bool,
    ) -> Self {
        Self::launch_store(Store::new(backend, store_options), options, health_listener).await
    }

    async fn launch_store(store: Store, options: ServeOptions, health_listener: bool) -> Self {
        Self::launch_with(store, options, health_listener, None).await
    }

    async fn launch_with(
        store: Store,
        mut options: ServeOptions,
        health_listener: bool,
        shared_memory: Option<server::Listener>,
    ) -> Self {
        log_if_asked();
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind port 0");
        let addr = listener.local_addr().expect("local addr");
        let health = match health_listener {
            true => Some(TcpListener::bind("127.0.0.1:0").await.expect("bind port 0")),
            false => None,
        };
        let health_addr = health.as_ref().map(|l| l.local_addr().expect("local addr"));
        let listeners = server::Listeners {
            flight: vec![listener.into()],
            health,
            shared_memory,
        };
        let metrics = Arc::clone(
            options
                .metrics
                .get_or_insert_with(|| Metrics::new(store.clone())),
        );
        let (tx, rx) = oneshot::channel::<()>();
        let handle = tokio::spawn(server::run(listeners, store.clone(), options, async {
            let _ = rx.await;
        }));
        Self {
            addr,
            health_addr,
            store,
            metrics,
            shutdown: Some(tx),
            handle,
        }
    }

    pub async fn channel(&self) -> Channel {
        Channel::from_shared(format!("http://{}", self.addr))
            .expect("uri")
            .connect()
            .await
            .expect("connect")
    }

    /// A client with gRPC's default 4 MiB receive limit, as most clients keep it.
    pub async fn client(&self) -> FlightClient {
        connect(self.addr).await
    }

    pub async fn raw_client(&self) -> FlightServiceClient<Channel> {
        FlightServiceClient::new(self.channel().await)
    }

    /// Begins shutdown without waiting for it.
    pub fn begin_shutdown(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }

    pub async fn shutdown_and_wait(mut self) {
        self.begin_shutdown();
        tokio::time::timeout(Duration::from_secs(30), self.handle)
            .await
            .expect("server stops in time")
            .expect("server task")
            .expect("server ran cleanly");
    }
}

/// A client of the server at `addr`, on its own connection.
pub async fn connect(addr: SocketAddr) -> FlightClient {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .expect("uri")
        .connect()
        .await
        .expect("connect");
    FlightClient::new(channel)
}

/// The gRPC code of a failed client call.
pub fn code_of(error: &FlightError) -> Code {
    match error {
        FlightError::Tonic(status) => status.code(),
        other => panic!("expected a gRPC status, got {other:?}"),
    }
}

pub fn path(name: &str) -> FlightDescriptor {
    FlightDescriptor::new_path(vec![name.to_owned()])
}

pub fn cmd(name: &str, mode: &str) -> FlightDescriptor {
    FlightDescriptor::new_cmd(serde_json::json!({"name": name, "mode": mode}).to_string())
}

/// Puts `batches` under `descriptor`; returns the server's JSON summary.
pub async fn put(
    client: &mut FlightClient,
    descriptor: FlightDescriptor,
    batches: Vec<RecordBatch>,
) -> Result<serde_json::Value, FlightError> {
    let schema = batches
        .first()
        .map(|b| b.schema())
        .unwrap_or_else(|| Arc::new(Schema::empty()));
    put_with_schema(client, descriptor, schema, batches).await
}

/// Sends `batches` (of three Int64 columns) under `descriptor`, then the abort marker with `reason`; the put's error.
pub async fn put_then_abort(
    client: &mut FlightClient,
    descriptor: FlightDescriptor,
    batches: Vec<RecordBatch>,
    reason: &str,
) -> FlightError {
    let mut messages: Vec<arrow_flight::FlightData> = FlightDataEncoderBuilder::new()
        .with_schema(int64_batch(1, 3, 0).schema())
        .with_flight_descriptor(Some(descriptor))
        .build(futures::stream::iter(batches.into_iter().map(Ok)))
        .try_collect()
        .await
        .expect("encode");
    messages.push(arrow_flight::FlightData {
        app_metadata: serde_json::json!({ "abort": reason }).to_string().into(),
        ..arrow_flight::FlightData::default()
    });
    match client
        .do_put(futures::stream::iter(messages.into_iter().map(Ok)))
        .await
    {
        Err(e) => e,
        Ok(stream) => stream.try_collect::<Vec<_>>().await.expect_err("abandoned"),
    }
}

pub async fn put_with_schema(
    client: &mut FlightClient,
    descriptor: FlightDescriptor,
    schema: SchemaRef,
    batches: Vec<RecordBatch>,
) -> Result<serde_json::Value, FlightError> {
    let data = FlightDataEncoderBuilder::new()
        .with_schema(schema)
        .with_flight_descriptor(Some(descriptor))
        .with_dictionary_handling(DictionaryHandling::Resend)
        .build(futures::stream::iter(batches.into_iter().map(Ok)));
    let results: Vec<_> = client.do_put(data).await?.try_collect().await?;
    assert_eq!(results.len(), 1, "one PutResult per committed put");
    Ok(serde_json::from_slice(&results[0].app_metadata).expect("put summary is JSON"))
}

/// Reads a dataset through GetFlightInfo and every endpoint, in order.
pub async fn get_all(
    client: &mut FlightClient,
    name: &str,
) -> Result<Vec<RecordBatch>, FlightError> {
    let info = client.get_flight_info(path(name)).await?;
    let mut batches = Vec::new();
    for endpoint in info.endpoint {
        let ticket = endpoint.ticket.expect("endpoint has a ticket");
        let mut part: Vec<_> = client.do_get(ticket).await?.try_collect().await?;
        batches.append(&mut part);
    }
    Ok(batches)
}

/// Every dataset's FlightInfo, through ListFlights.
pub async fn list_all(client: &mut FlightClient) -> Vec<arrow_flight::FlightInfo> {
    client
        .list_flights("")
        .await
        .expect("list")
        .try_collect()
        .await
        .expect("list")
}

/// Reads a dataset with a bare-name ticket.
pub async fn get_by_name(
    client: &mut FlightClient,
    name: &str,
) -> Result<Vec<RecordBatch>, FlightError> {
    client
        .do_get(Ticket::new(name.to_owned()))
        .await?
        .try_collect()
        .await
}

pub async fn action(
    client: &mut FlightClient,
    name: &str,
    body: serde_json::Value,
) -> Result<serde_json::Value, FlightError> {
    let body = if body.is_null() {
        Vec::new()
    } else {
        body.to_string().into_bytes()
    };
    let results: Vec<_> = client
        .do_action(Action::new(name, body))
        .await?
        .try_collect()
        .await?;
    assert_eq!(results.len(), 1, "one result per action");
    Ok(serde_json::from_slice(&results[0]).expect("action result is JSON"))
}

pub async fn status(client: &mut FlightClient) -> serde_json::Value {
    action(client, "status", serde_json::Value::Null)
        .await
        .expect("status")
}

/// Bytes reserved on device 0, committed and in flight.
pub async fn used_bytes(client: &mut FlightClient) -> u64 {
    status(client).await["devices"][0]["used_bytes"]
        .as_u64()
        .expect("used_bytes")
}

/// Concatenates batches into one (for comparisons independent of chunking).
pub fn concat(schema: &SchemaRef, batches: &[RecordBatch]) -> RecordBatch {
    arrow::compute::concat_batches(schema, batches).expect("concat")
}

/// Asserts that what came back equals what went in, schema and metadata included.
pub fn assert_same_data(sent: &[RecordBatch], received: &[RecordBatch]) {
    let schema = sent[0].schema();
    let received_schema = received
        .first()
        .map(|b| b.schema())
        .expect("received batches");
    assert_eq!(received_schema, schema, "schema round-trips exactly");
    assert_eq!(concat(&schema, received), concat(&schema, sent));
}

/// `columns` int64 columns of `rows` rows, every 7th value null in odd columns.
pub fn int64_batch(rows: usize, columns: usize, seed: i64) -> RecordBatch {
    let arrays: Vec<(String, ArrayRef)> = (0..columns)
        .map(|c| {
            let array: ArrayRef = Arc::new(Int64Array::from_iter((0..rows).map(|r| {
                let v = seed + (r * columns + c) as i64;
                (c % 2 == 0 || r % 7 != 0).then_some(v)
            })));
            (format!("c{c}"), array)
        })
        .collect();
    RecordBatch::try_from_iter(arrays).expect("batch")
}

/// Strings of varied lengths plus an id column.
pub fn string_batch(rows: usize, seed: usize) -> RecordBatch {
    let strings: ArrayRef = Arc::new(StringArray::from_iter((0..rows).map(|r| {
        let n = (r + seed) % 97;
        (!n.is_multiple_of(11)).then(|| format!("{}-{}", "s".repeat(n), r + seed))
    })));
    let ids: ArrayRef = Arc::new(UInt64Array::from_iter_values(
        (0..rows).map(|r| (r + seed) as u64),
    ));
    RecordBatch::try_from_iter([("s", strings), ("id", ids)]).expect("batch")
}

/// One batch with a column of (nearly) every Arrow type a pyarrow table can hold, with nulls,
/// schema and field metadata.
pub fn all_types_batch(rows: usize) -> RecordBatch {
    let valid = |r: usize| r % 5 != 3;
    let nulls = NullBuffer::from_iter((0..rows).map(valid));
    let mut columns: Vec<(&str, ArrayRef)> = vec![
        (
            "i8",
            Arc::new(Int8Array::from_iter(
                (0..rows).map(|r| valid(r).then_some(r as i8)),
            )),
        ),
        (
            "i16",
            Arc::new(Int16Array::from_iter(
                (0..rows).map(|r| valid(r).then_some(r as i16)),
            )),
        ),
        (
            "i32",
            Arc::new(Int32Array::from_iter(
                (0..rows).map(|r| valid(r).then_some(r as i32)),
            )),
        ),
        (
            "i64",
            Arc::new(Int64Array::from_iter(
                (0..rows).map(|r| valid(r).then_some(-(r as i64))),
            )),
        ),
        (
            "u8",
            Arc::new(UInt8Array::from_iter(
                (0..rows).map(|r| valid(r).then_some(r as u8)),
            )),
        ),
        (
            "u16",
            Arc::new(UInt16Array::from_iter(
                (0..rows).map(|r| valid(r).then_some(r as u16)),
            )),
        ),
        (
            "u32",
            Arc::new(UInt32Array::from_iter(
                (0..rows).map(|r| valid(r).then_some(r as u32)),
            )),
        ),
        (
            "u64",
            Arc::new(UInt64Array::from_iter(
                (0..rows).map(|r| valid(r).then_some(u64::MAX - r as u64)),
            )),
        ),
        (
            "f16",
            Arc::new(Float16Array::from_iter(
                (0..rows).map(|r| valid(r).then(|| half::f16::from_f32(r as f32 / 4.0))),
            )),
        ),
        (
            "f32",
            Arc::new(Float32Array::from_iter(
                (0..rows).map(|r| valid(r).then_some(r as f32 * 0.5)),
            )),
        ),
        (
            "f64",
            Arc::new(Float64Array::from_iter(
                (0..rows).map(|r| valid(r).then_some(r as f64 * 0.25)),
            )),
        ),
        (
            "bool",
            Arc::new(BooleanArray::from_iter(
                (0..rows).map(|r| valid(r).then_some(r % 3 == 0)),
            )),
        ),
        (
            "utf8",
            Arc::new(StringArray::from_iter(
                (0..rows).map(|r| valid(r).then(|| format!("é{r}"))),
            )),
        ),
        (
            "large_utf8",
            Arc::new(LargeStringArray::from_iter(
                (0..rows).map(|r| valid(r).then(|| "x".repeat(r % 13))),
            )),
        ),
        (
            "binary",
            Arc::new(BinaryArray::from_iter(
                (0..rows).map(|r| valid(r).then(|| vec![r as u8; r % 4])),
            )),
        ),
        (
            "large_binary",
            Arc::new(LargeBinaryArray::from_iter(
                (0..rows).map(|r| valid(r).then(|| vec![1u8; r % 3])),
            )),
        ),
        (
            "fixed_binary",
            Arc::new(
                FixedSizeBinaryArray::try_from_sparse_iter_with_size(
                    (0..rows).map(|r| valid(r).then_some([r as u8; 4])),
                    4,
                )
                .expect("fsb"),
            ),
        ),
        (
            "date32",
            Arc::new(Date32Array::from_iter(
                (0..rows).map(|r| valid(r).then_some(r as i32)),
            )),
        ),
        (
            "date64",
            Arc::new(Date64Array::from_iter(
                (0..rows).map(|r| valid(r).then_some(r as i64 * 86_400_000)),
            )),
        ),
        (
            "time32",
            Arc::new(Time32MillisecondArray::from_iter(
                (0..rows).map(|r| valid(r).then_some(r as i32)),
            )),
        ),
        (
            "time64",
            Arc::new(Time64NanosecondArray::from_iter(
                (0..rows).map(|r| valid(r).then_some(r as i64)),
            )),
        ),
        (
            "timestamp_tz",
            Arc::new(
                TimestampMicrosecondArray::from_iter(
                    (0..rows).map(|r| valid(r).then_some(r as i64)),
                )
                .with_timezone("Europe/Paris"),
            ),
        ),
        (
            "duration",
            Arc::new(DurationSecondArray::from_iter(
                (0..rows).map(|r| valid(r).then_some(r as i64)),
            )),
        ),
        (
            "decimal128",
            Arc::new(
                Decimal128Array::from_iter((0..rows).map(|r| valid(r).then_some(r as i128 * 1001)))
                    .with_precision_and_scale(20, 3)
                    .expect("decimal128"),
            ),
        ),
        (
            "decimal256",
            Arc::new(
                Decimal256Array::from_iter(
                    (0..rows).map(|r| valid(r).then(|| i256::from_i128(r as i128))),
                )
                .with_precision_and_scale(50, 5)
                .expect("decimal256"),
            ),
        ),
        (
            "list",
            Arc::new(ListArray::from_iter_primitive::<Int32Type, _, _>(
                (0..rows).map(|r| valid(r).then(|| vec![Some(r as i32), None])),
            )),
        ),
        (
            "large_list",
            Arc::new(LargeListArray::from_iter_primitive::<Int64Type, _, _>(
                (0..rows).map(|r| valid(r).then(|| vec![Some(r as i64); r % 3])),
            )),
        ),
        (
            "fixed_list",
            Arc::new(FixedSizeListArray::from_iter_primitive::<Int16Type, _, _>(
                (0..rows).map(|r| valid(r).then(|| vec![Some(r as i16), Some(1)])),
                2,
            )),
        ),
    ];
    let struct_array = StructArray::new(
        Fields::from(vec![
            Field::new("a", DataType::Int32, true),
            Field::new("b", DataType::Utf8, true),
        ]),
        vec![
            Arc::new(Int32Array::from_iter((0..rows).map(|r| Some(r as i32)))) as ArrayRef,
            Arc::new(StringArray::from_iter(
                (0..rows).map(|r| (r % 2 == 0).then(|| r.to_string())),
            )),
        ],
        Some(nulls),
    );
    columns.push(("struct", Arc::new(struct_array)));
    let keys = StringArray::from_iter_values((0..rows * 2).map(|i| format!("k{}", i % 2)));
    let values = Int64Array::from_iter((0..rows * 2).map(|i| (i % 3 != 0).then_some(i as i64)));
    let entries = StructArray::new(
        Fields::from(vec![
            Field::new("keys", DataType::Utf8, false),
            Field::new("values", DataType::Int64, true),
        ]),
        vec![Arc::new(keys) as ArrayRef, Arc::new(values)],
        None,
    );
    let map = MapArray::new(
        Arc::new(Field::new("entries", entries.data_type().clone(), false)),
        OffsetBuffer::from_lengths(std::iter::repeat_n(2, rows)),
        entries,
        None,
        false,
    );
    columns.push(("map", Arc::new(map)));
    let dictionary: DictionaryArray<Int32Type> = (0..rows)
        .map(|r| valid(r).then(|| ["red", "green", "blue"][r % 3]))
        .collect();
    columns.push(("dictionary", Arc::new(dictionary)));

    let fields: Vec<Field> = columns
        .iter()
        .map(|(name, array)| {
            Field::new(*name, array.data_type().clone(), true).with_metadata(
                std::collections::HashMap::from([("origin".to_owned(), format!("column {name}"))]),
            )
        })
        .collect();
    let schema = Schema::new(fields).with_metadata(std::collections::HashMap::from([(
        "pandas".to_owned(),
        "{\"index_columns\": []}".to_owned(),
    )]));
    RecordBatch::try_new(
        Arc::new(schema),
        columns.into_iter().map(|(_, a)| a).collect(),
    )
    .expect("all-types batch")
}

/// A TCP proxy in front of the server whose connections can be cut at once, as when a client
/// process is killed: the server sees its connection reset, not a clean end of stream.
pub struct KillableProxy {
    pub addr: SocketAddr,
    task: JoinHandle<()>,
}

impl KillableProxy {
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy addr");
        let task = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            while let Ok((mut inbound, _)) = listener.accept().await {
                connections.spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        });
        Self { addr, task }
    }

    pub async fn client(&self) -> FlightClient {
        let channel = Channel::from_shared(format!("http://{}", self.addr))
            .expect("uri")
            .connect()
            .await
            .expect("connect through proxy");
        FlightClient::new(channel)
    }

    /// Drops every proxied connection (the JoinSet aborts its tasks when dropped).
    pub async fn kill(self) {
        self.task.abort();
        let _ = self.task.await;
    }
}

/// A TCP proxy that can freeze: it stops forwarding in both directions but keeps every socket
/// open, as a stopped client process or a hung node does. The server sees no error, only
/// silence, and has to notice by itself.
pub struct FreezableProxy {
    pub addr: SocketAddr,
    frozen: tokio::sync::watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl FreezableProxy {
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy addr");
        let (frozen, watch) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            while let Ok((inbound, _)) = listener.accept().await {
                let Ok(outbound) = tokio::net::TcpStream::connect(target).await else {
                    continue;
                };
                let (in_read, in_write) = inbound.into_split();
                let (out_read, out_write) = outbound.into_split();
                connections.spawn(forward(in_read, out_write, watch.clone()));
                connections.spawn(forward(out_read, in_write, watch.clone()));
            }
        });
        Self { addr, frozen, task }
    }

    pub async fn client(&self) -> FlightClient {
        connect(self.addr).await
    }

    /// Stops forwarding, for good; the sockets stay open until the proxy is dropped.
    pub fn freeze(&self) {
        let _ = self.frozen.send(true);
    }
}

impl Drop for FreezableProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn forward(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut frozen: tokio::sync::watch::Receiver<bool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buffer = vec![0u8; 64 << 10];
    loop {
        if *frozen.borrow() {
            // Hold both sockets, read nothing, send nothing.
            let _hold = (&from, &to);
            std::future::pending::<()>().await;
        }
        tokio::select! {
            read = from.read(&mut buffer) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if *frozen.borrow() {
                        continue;
                    }
                    if to.write_all(&buffer[..n]).await.is_err() {
                        return;
                    }
                }
            },
            _ = frozen.changed() => {}
        }
    }
}

/// Polls `condition` until it holds, failing after ten seconds.
pub async fn wait_until<F, Fut>(mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !condition().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "condition not reached in 10 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
