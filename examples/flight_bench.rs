//! DoPut and DoGet throughput of gpu-flight against a pyarrow.flight host-memory server, on the
//! same data, with the same client, in one run.
//!
//! ```text
//! cargo run --release --example flight_bench -- [--gib 1] [--backend host] [--repeat 3]
//!     [--server target/release/gpu-flight] [--python python3]
//! ```
//!
//! Both servers run as separate processes on loopback. The client pre-encodes the tables once
//! (so the figures measure the servers, not the client's encoder), then times DoPut and DoGet
//! of each table on each server, best of `--repeat` runs, and prints GB/s and the ratio. With
//! `--streams N`, N clients do the same at once, each with its own copy, and the figures are
//! the aggregate rate.
//! Tables: `int64`, 8 int64 columns of `--gib` GiB; `strings`, a utf8 column of 16-48
//! character strings plus an int64 id, of about `--gib` GiB.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow::array::{ArrayRef, Int64Array, StringArray};
use arrow::record_batch::RecordBatch;
use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::{Action, FlightClient, FlightData, FlightDescriptor};
use clap::Parser;
use futures::TryStreamExt;
use tonic::transport::{Channel, Endpoint};

#[derive(Debug, Parser)]
struct Args {
    /// Approximate size of each table in GiB.
    #[arg(long, default_value_t = 1.0)]
    gib: f64,
    /// gpu-flight backend to benchmark.
    #[arg(long, default_value = "host")]
    backend: String,
    /// Timed runs per measurement; the best is reported.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// The gpu-flight binary.
    #[arg(long, default_value = "target/release/gpu-flight")]
    server: String,
    /// Python with pyarrow, for examples/pyarrow_server.py.
    #[arg(long, default_value = "python3")]
    python: String,
    /// Rows per record batch the client sends.
    #[arg(long, default_value_t = 131_072)]
    batch_rows: usize,
    /// Concurrent clients, each on its own connection putting and getting its own copy of
    /// the table, as Spark or Dask tasks do with partitions; figures are aggregate.
    #[arg(long, default_value_t = 1)]
    streams: usize,
}

struct Server {
    child: Child,
    url: String,
}

impl Server {
    fn spawn(mut command: Command) -> Self {
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start server");
        let stdout = child.stdout.take().expect("stdout");
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line)
            .expect("read address line");
        let url = line
            .split_whitespace()
            .find(|w| w.starts_with("grpc://"))
            .unwrap_or_else(|| panic!("no address in {line:?}"))
            .replace("grpc://", "http://");
        Self { child, url }
    }

    async fn client(&self) -> FlightClient {
        let channel: Channel = Endpoint::from_shared(self.url.clone())
            .expect("url")
            .initial_stream_window_size(16 << 20)
            .initial_connection_window_size(64 << 20)
            .tcp_nodelay(true)
            .connect()
            .await
            .expect("connect");
        let inner = arrow_flight::flight_service_client::FlightServiceClient::new(channel)
            .max_decoding_message_size(usize::MAX)
            .max_encoding_message_size(usize::MAX);
        FlightClient::new_from_inner(inner)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn int64_table(gib: f64, batch_rows: usize) -> Vec<RecordBatch> {
    let rows = (gib * (1u64 << 30) as f64 / 64.0) as usize;
    batches(rows, batch_rows, |start, len| {
        (0..8)
            .map(|c| {
                let array: ArrayRef = Arc::new(Int64Array::from_iter_values(
                    (start..start + len).map(|r| (r as i64) * 8 + c),
                ));
                (format!("c{c}"), array)
            })
            .collect()
    })
}

fn string_table(gib: f64, batch_rows: usize) -> Vec<RecordBatch> {
    // About 32 characters + 4 offset bytes + 8 id bytes per row.
    let rows = (gib * (1u64 << 30) as f64 / 44.0) as usize;
    batches(rows, batch_rows, |start, len| {
        let strings: ArrayRef = Arc::new(StringArray::from_iter_values(
            (start..start + len).map(|r| format!("{:0width$}", r, width = 16 + r % 33)),
        ));
        let ids: ArrayRef = Arc::new(Int64Array::from_iter_values(
            (start..start + len).map(|r| r as i64),
        ));
        vec![("s".to_owned(), strings), ("id".to_owned(), ids)]
    })
}

fn batches(
    rows: usize,
    batch_rows: usize,
    make: impl Fn(usize, usize) -> Vec<(String, ArrayRef)>,
) -> Vec<RecordBatch> {
    (0..rows)
        .step_by(batch_rows)
        .map(|start| {
            let len = batch_rows.min(rows - start);
            RecordBatch::try_from_iter(make(start, len)).expect("batch")
        })
        .collect()
}

fn table_bytes(batches: &[RecordBatch]) -> u64 {
    batches
        .iter()
        .map(gpu_flight::batch_size::batch_bytes)
        .sum()
}

async fn encode(name: &str, batches: &[RecordBatch]) -> Vec<FlightData> {
    FlightDataEncoderBuilder::new()
        .with_flight_descriptor(Some(FlightDescriptor::new_path(vec![name.to_owned()])))
        .with_max_flight_data_size(usize::MAX)
        .build(futures::stream::iter(
            batches.iter().cloned().map(Ok).collect::<Vec<_>>(),
        ))
        .try_collect()
        .await
        .expect("encode")
}

/// Seconds for one DoPut of the pre-encoded messages.
async fn time_put(client: &mut FlightClient, messages: &[FlightData]) -> f64 {
    let messages = messages.to_vec();
    let start = Instant::now();
    let _: Vec<_> = client
        .do_put(futures::stream::iter(messages.into_iter().map(Ok)))
        .await
        .expect("do_put")
        .try_collect()
        .await
        .expect("put results");
    start.elapsed().as_secs_f64()
}

/// Seconds for reading every endpoint of `name`, and the rows read.
async fn time_get(client: &mut FlightClient, name: &str) -> (f64, usize) {
    let start = Instant::now();
    let info = client
        .get_flight_info(FlightDescriptor::new_path(vec![name.to_owned()]))
        .await
        .expect("info");
    let mut rows = 0;
    for endpoint in info.endpoint {
        let mut stream = client
            .do_get(endpoint.ticket.expect("ticket"))
            .await
            .expect("do_get");
        while let Some(batch) = stream.try_next().await.expect("read") {
            rows += batch.num_rows();
        }
    }
    (start.elapsed().as_secs_f64(), rows)
}

async fn drop_dataset(client: &mut FlightClient, name: &str, ours: bool) {
    let body = if ours {
        serde_json::json!({ "name": name }).to_string().into_bytes()
    } else {
        name.as_bytes().to_vec()
    };
    let _: Vec<_> = client
        .do_action(Action::new("drop", body))
        .await
        .expect("drop")
        .try_collect()
        .await
        .expect("drop result");
}

struct Figures {
    put_gbps: f64,
    get_gbps: f64,
}

async fn measure(
    server: &Server,
    ours: bool,
    name: &str,
    batches: &[RecordBatch],
    args: &Args,
) -> Figures {
    let bytes = (table_bytes(batches) * args.streams as u64) as f64;
    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
    let mut clients = Vec::new();
    for stream in 0..args.streams {
        let copy = format!("{name}-{stream}");
        clients.push((
            server.client().await,
            Arc::new(encode(&copy, batches).await),
            copy,
        ));
    }
    let mut best_put = f64::MAX;
    let mut best_get = f64::MAX;
    for _ in 0..args.repeat.max(1) {
        let start = Instant::now();
        let puts = clients
            .iter_mut()
            .map(|(client, messages, _)| time_put(client, messages));
        futures::future::join_all(puts).await;
        best_put = best_put.min(start.elapsed().as_secs_f64());

        let start = Instant::now();
        let gets = clients
            .iter_mut()
            .map(|(client, _, copy)| time_get(client, copy));
        for (_, got) in futures::future::join_all(gets).await {
            assert_eq!(got, rows, "every row comes back");
        }
        best_get = best_get.min(start.elapsed().as_secs_f64());
        for (client, _, copy) in &mut clients {
            drop_dataset(client, copy, ours).await;
        }
    }
    Figures {
        put_gbps: bytes / best_put / 1e9,
        get_gbps: bytes / best_get / 1e9,
    }
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let ours = Server::spawn({
        let mut command = Command::new(&args.server);
        command.args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--backend",
            &args.backend,
        ]);
        command
    });
    let pyarrow = Server::spawn({
        let mut command = Command::new(&args.python);
        command.args(["examples/pyarrow_server.py", "--port", "0"]);
        command
    });
    tokio::time::sleep(Duration::from_millis(200)).await;

    let tables = [
        ("int64", int64_table(args.gib, args.batch_rows)),
        ("strings", string_table(args.gib, args.batch_rows)),
    ];
    println!(
        "{:<8} {:>9} {:>14} {:>14} {:>14} {:>14} {:>8} {:>8}",
        "table",
        "MB",
        "ours put GB/s",
        "pyarrow put",
        "ours get GB/s",
        "pyarrow get",
        "put x",
        "get x"
    );
    for (name, batches) in &tables {
        let mb = table_bytes(batches) as f64 / 1e6;
        let a = measure(&ours, true, name, batches, &args).await;
        let b = measure(&pyarrow, false, name, batches, &args).await;
        println!(
            "{:<8} {:>9.0} {:>14.2} {:>14.2} {:>14.2} {:>14.2} {:>7.2}x {:>7.2}x",
            name,
            mb,
            a.put_gbps,
            b.put_gbps,
            a.get_gbps,
            b.get_gbps,
            a.put_gbps / b.put_gbps,
            a.get_gbps / b.get_gbps
        );
    }
    println!(
        "backend: {}; {} concurrent stream(s), MB per stream; best of {} runs; \
         GB = 1e9 bytes of Arrow buffers",
        args.backend, args.streams, args.repeat
    );
}
