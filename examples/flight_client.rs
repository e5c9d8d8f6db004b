//! One benchmark client process: the Rust (arrow-flight) client of
//! `examples/python/throughput.py`, which starts N of these at once, each on its own
//! connection. Also the raw-socket ceiling: `send` and `sink` move the same bytes over a bare
//! TCP or Unix socket.
//!
//! ```text
//! flight_client get  --location grpc://127.0.0.1:8815 --name bench --row-bytes 64
//! flight_client put  --location grpc+unix:///tmp/gf.sock --name put-3 --table strings --mib 512
//! flight_client sink --address 127.0.0.1:0 --connections 8      # prints "listening ADDRESS"
//! flight_client send --address 127.0.0.1:40123 --mib 512
//! ```
//!
//! Each client prepares (connects, builds its table), prints `ready`, waits for a line on
//! standard input, does its one transfer, and prints one JSON line: `start` and `end` (Unix
//! seconds, so several processes' times compare), `bytes` (Arrow buffer bytes; raw bytes for
//! `send`) and `rows`.

use std::io::{BufRead, Read, Write};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use arrow::array::{ArrayData, ArrayRef, Int64Array, RecordBatch, StringArray};
use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::{FlightClient, FlightDescriptor, Ticket};
use clap::{Parser, Subcommand};
use futures::TryStreamExt;
use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

#[derive(Debug, Parser)]
struct Args {
    #[command(subcommand)]
    op: Op,
}

#[derive(Debug, Subcommand)]
enum Op {
    /// DoGet the dataset `name` (a bare-name ticket: the whole dataset, one stream).
    Get {
        #[arg(long)]
        location: String,
        #[arg(long)]
        name: String,
    },
    /// DoPut a generated table as the dataset `name`.
    Put {
        #[arg(long)]
        location: String,
        #[arg(long)]
        name: String,
        #[arg(long, default_value = "int64")]
        table: String,
        #[arg(long, default_value_t = 512)]
        mib: usize,
        #[arg(long, default_value_t = 131_072)]
        batch_rows: usize,
    },
    /// Accept `connections` connections on `address` and read each to its end.
    Sink {
        /// `HOST:PORT` or `unix:///path`.
        #[arg(long)]
        address: String,
        #[arg(long)]
        connections: usize,
    },
    /// Write `mib` MiB to a sink, then wait until it has read them.
    Send {
        #[arg(long)]
        address: String,
        #[arg(long, default_value_t = 512)]
        mib: usize,
    },
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Says `ready`, then blocks until the coordinator says go.
fn ready() {
    println!("ready");
    let _ = std::io::stdout().flush();
    let mut line = String::new();
    let _ = std::io::stdin().lock().read_line(&mut line);
}

fn report(start: f64, end: f64, bytes: u64, rows: u64) {
    println!(r#"{{"start": {start}, "end": {end}, "bytes": {bytes}, "rows": {rows}}}"#);
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    match Args::parse().op {
        Op::Get { location, name } => {
            let mut client = connect(&location).await?;
            ready();
            let start = now();
            let mut stream = client.do_get(Ticket::new(name)).await?;
            let (mut bytes, mut rows) = (0u64, 0u64);
            while let Some(batch) = stream.try_next().await? {
                rows += batch.num_rows() as u64;
                bytes += batch
                    .columns()
                    .iter()
                    .map(|c| data_bytes(&c.to_data()))
                    .sum::<u64>();
            }
            report(start, now(), bytes, rows);
        }
        Op::Put {
            location,
            name,
            table,
            mib,
            batch_rows,
        } => {
            let batches = match table.as_str() {
                "int64" => int64_table(mib, batch_rows),
                "strings" => string_table(mib, batch_rows),
                other => return Err(format!("unknown table {other}").into()),
            };
            let bytes: u64 = batches
                .iter()
                .flat_map(|b| b.columns())
                .map(|c| data_bytes(&c.to_data()))
                .sum();
            let rows: u64 = batches.iter().map(|b| b.num_rows() as u64).sum();
            let mut client = connect(&location).await?;
            ready();
            let start = now();
            let put = FlightDataEncoderBuilder::new()
                .with_flight_descriptor(Some(FlightDescriptor::new_path(vec![name])))
                .build(futures::stream::iter(batches.into_iter().map(Ok)));
            let _results: Vec<_> = client.do_put(put).await?.try_collect().await?;
            report(start, now(), bytes, rows);
        }
        Op::Sink {
            address,
            connections,
        } => sink(&address, connections)?,
        Op::Send { address, mib } => send(&address, mib)?,
    }
    Ok(())
}

/// The Arrow buffer bytes an array holds (its slices' lengths, not the allocations').
fn data_bytes(data: &ArrayData) -> u64 {
    let own: usize = data.buffers().iter().map(|b| b.len()).sum();
    let nulls = data.nulls().map_or(0, |n| n.buffer().len());
    (own + nulls) as u64 + data.child_data().iter().map(data_bytes).sum::<u64>()
}

/// A Flight client on its own connection: `grpc://HOST:PORT` or `grpc+unix:///path`.
async fn connect(location: &str) -> Result<FlightClient, Box<dyn std::error::Error>> {
    let channel: Channel = if let Some(path) = location.strip_prefix("grpc+unix://") {
        let path = path.to_owned();
        // The URI only fills the HTTP/2 authority; the connector decides where bytes go.
        Endpoint::try_from("http://localhost")?
            .initial_stream_window_size(16 << 20)
            .initial_connection_window_size(64 << 20)
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move {
                    let stream = tokio::net::UnixStream::connect(path).await?;
                    Ok::<_, std::io::Error>(TokioIo::new(stream))
                }
            }))
            .await?
    } else {
        let url = location.replacen("grpc://", "http://", 1);
        Endpoint::from_shared(url)?
            .initial_stream_window_size(16 << 20)
            .initial_connection_window_size(64 << 20)
            .tcp_nodelay(true)
            .connect()
            .await?
    };
    let inner = arrow_flight::flight_service_client::FlightServiceClient::new(channel)
        .max_decoding_message_size(usize::MAX)
        .max_encoding_message_size(usize::MAX);
    Ok(FlightClient::new_from_inner(inner))
}

/// 8 int64 columns, `mib` MiB.
fn int64_table(mib: usize, batch_rows: usize) -> Vec<RecordBatch> {
    let rows = (mib << 20) / 64;
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

/// An int64 id and a utf8 column of 16-48 characters, about `mib` MiB.
fn string_table(mib: usize, batch_rows: usize) -> Vec<RecordBatch> {
    // About 32 characters + 4 offset bytes + 8 id bytes a row.
    let rows = (mib << 20) / 44;
    batches(rows, batch_rows, |start, len| {
        let ids: ArrayRef = Arc::new(Int64Array::from_iter_values(
            (start..start + len).map(|r| r as i64),
        ));
        let strings: ArrayRef = Arc::new(StringArray::from_iter_values(
            (start..start + len).map(|r| format!("{:0width$}", r, width = 16 + r % 33)),
        ));
        vec![("id".to_owned(), ids), ("s".to_owned(), strings)]
    })
}

fn batches(
    rows: usize,
    batch_rows: usize,
    make: impl Fn(usize, usize) -> Vec<(String, ArrayRef)>,
) -> Vec<RecordBatch> {
    (0..rows)
        .step_by(batch_rows.max(1))
        .map(|start| {
            let len = batch_rows.min(rows - start);
            RecordBatch::try_from_iter(make(start, len)).expect("batch")
        })
        .collect()
}

const CHUNK: usize = 4 << 20;

trait Socket: Read + Write + Send {
    fn close_write(&self) -> std::io::Result<()>;
}

impl Socket for std::net::TcpStream {
    fn close_write(&self) -> std::io::Result<()> {
        self.shutdown(std::net::Shutdown::Write)
    }
}

impl Socket for std::os::unix::net::UnixStream {
    fn close_write(&self) -> std::io::Result<()> {
        self.shutdown(std::net::Shutdown::Write)
    }
}

fn sink(address: &str, connections: usize) -> Result<(), Box<dyn std::error::Error>> {
    let drain = |mut socket: Box<dyn Socket>| {
        std::thread::spawn(move || {
            let mut buffer = vec![0u8; CHUNK];
            while matches!(socket.read(&mut buffer), Ok(n) if n > 0) {}
            // Closing tells the sender that everything arrived.
            let _ = socket.close_write();
        })
    };
    let mut threads = Vec::new();
    if let Some(path) = address.strip_prefix("unix://") {
        let _ = std::fs::remove_file(path);
        let listener = std::os::unix::net::UnixListener::bind(path)?;
        println!("listening unix://{path}");
        std::io::stdout().flush()?;
        for _ in 0..connections {
            threads.push(drain(Box::new(listener.accept()?.0)));
        }
    } else {
        let listener = std::net::TcpListener::bind(address)?;
        println!("listening {}", listener.local_addr()?);
        std::io::stdout().flush()?;
        for _ in 0..connections {
            let (socket, _) = listener.accept()?;
            socket.set_nodelay(true)?;
            threads.push(drain(Box::new(socket)));
        }
    }
    for thread in threads {
        let _ = thread.join();
    }
    Ok(())
}

fn send(address: &str, mib: usize) -> Result<(), Box<dyn std::error::Error>> {
    let mut socket: Box<dyn Socket> = match address.strip_prefix("unix://") {
        Some(path) => Box::new(std::os::unix::net::UnixStream::connect(path)?),
        None => {
            let socket = std::net::TcpStream::connect(address)?;
            socket.set_nodelay(true)?;
            Box::new(socket)
        }
    };
    let buffer = vec![7u8; CHUNK];
    let total = (mib << 20) as u64;
    ready();
    let start = now();
    let mut sent = 0u64;
    while sent < total {
        let n = (total - sent).min(CHUNK as u64) as usize;
        socket.write_all(&buffer[..n])?;
        sent += n as u64;
    }
    socket.close_write()?;
    let mut rest = [0u8; 1];
    let _ = socket.read(&mut rest);
    report(start, now(), sent, 0);
    Ok(())
}
