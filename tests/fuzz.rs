//! A seeded mutation fuzzer for the Flight surface a client can reach.
//!
//! `do_put_mutations` starts from valid `DoPut` streams encoded by arrow-flight (int64 with
//! nulls, strings, every type of `all_types_batch`, nested lists, structs, dictionaries resent
//! across batches, decimals, a Null-type column, zero-column batches with rows, fixed-size lists,
//! views, unions, run-end encoding, multi-batch and schema-only streams; `create`, `replace` and
//! `append` over an existing dataset or none) and mutates them at two levels:
//! - Arrow IPC: the flatbuffer header and body of each FlightData (bit flips, random bytes,
//!   aligned words set to 0, 1, -1, 0x7fffffff, 0x80000000, 2^62, i64::MIN..., declared row
//!   counts rewritten consistently or not, truncation, extension) and the message sequence
//!   (swapped, duplicated, dropped, shuffled, spliced from another stream, schema-only, batches
//!   before the schema); and the descriptor (odd JSON commands, names, types).
//! - protobuf: the encoded FlightData bit-flipped, truncated, padded, or with invalid UTF-8 in
//!   a descriptor string.
//!
//! `unary_mutations` sends mutated GetFlightInfo, GetSchema, PollFlightInfo (descriptors), DoGet
//! (server-issued tickets, bare names, forged tickets), DoAction (every action type with odd
//! JSON bodies), ListFlights, ListActions, Handshake and DoExchange requests, as raw protobuf.
//!
//! After every case:
//! - the call's gRPC code is one a client can act on (DoPut: OK, INVALID_ARGUMENT,
//!   RESOURCE_EXHAUSTED, ALREADY_EXISTS over an existing dataset; unary: OK, INVALID_ARGUMENT,
//!   NOT_FOUND, UNIMPLEMENTED, FAILED_PRECONDITION, ALREADY_EXISTS), never INTERNAL, UNKNOWN,
//!   CANCELLED or OUT_OF_RANGE; what an OK call returns decodes;
//! - nothing panicked anywhere in the process (a panic hook counts panics);
//! - a failed put left the catalog as it was; a committed one reads back completely through
//!   ListFlights, GetFlightInfo, GetSchema and DoGet of every endpoint, its rows agree with the
//!   put summary, and every call answers within 30 s;
//! - once datasets are dropped, `used_bytes` returns to its baseline and `status` answers.
//!
//! Every run prints its seed and case count. Replay a run with
//! `GPU_FLIGHT_FUZZ_SEED=<seed> cargo test --test fuzz -- --nocapture`; each case draws from its
//! own generator, so `GPU_FLIGHT_FUZZ_CASE=<index>` replays one case alone (a unary case that
//! forges tickets from version numbers may need the whole run: versions depend on history).
//! Run many cases by hand with
//! `GPU_FLIGHT_FUZZ_CASES=20000 cargo test --release --test fuzz -- --nocapture`.
//! `GPU_FLIGHT_FUZZ_KEEP_GOING=1` records failures and goes on, then summarizes them by class;
//! `GPU_FLIGHT_FUZZ_VERBOSE=1` prints each case before sending it, which is how to find the
//! case behind a process abort (an allocation failure aborts; it is not a panic). A call that
//! hangs ends the whole test process (exit status 101) after the report: the stuck handler
//! would otherwise go on consuming memory. Progress lines go to stderr uncaptured, so they
//! survive an abort; running under `ulimit -v` keeps a runaway allocation from reaching the
//! OOM killer.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::net::SocketAddr;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use arrow::array::*;
use arrow::buffer::{NullBuffer, ScalarBuffer};
use arrow::datatypes::*;
use arrow::ipc::CompressionType;
use arrow::ipc::writer::IpcWriteOptions;
use arrow::record_batch::{RecordBatch, RecordBatchOptions};
use arrow_flight::decode::FlightRecordBatchStream;
use arrow_flight::encode::{DictionaryHandling, FlightDataEncoderBuilder};
use arrow_flight::flight_descriptor::DescriptorType;
use arrow_flight::{
    Action, ActionType, Criteria, FlightClient, FlightData, FlightDescriptor, FlightInfo,
    HandshakeRequest, HandshakeResponse, PollInfo, PutResult, SchemaResult, Ticket,
};
use bytes::Bytes;
use common::raw::{self, raw_call, raw_do_put, raw_unary};
use common::{all_types_batch, int64_batch, path, string_batch};
use futures::TryStreamExt;
use gpu_flight::backend::HostBackend;
use gpu_flight::flight::FlightOptions;
use gpu_flight::server::ServeOptions;
use gpu_flight::store::StoreOptions;
use prost::Message;
use rand::rngs::StdRng;
use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};
use tonic::Code;
use tonic::transport::Channel;

/// Cases per test when `GPU_FLIGHT_FUZZ_CASES` is unset: about 10 s of DoPut cases and 3 s of
/// unary ones in a debug build on two cores.
const DEFAULT_CASES: u64 = 300;
/// Longest any single call may take; beyond it the server is considered hung.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// How long memory may take to return after datasets are dropped.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(10);
const MEMORY_LIMIT: u64 = 256 << 20;
/// The dataset every put case writes (the catalog is emptied between cases).
const NAME: &str = "fuzz";

/// Values that sit on the edges of the signed and unsigned ranges IPC lengths and offsets use.
const INTERESTING: [u64; 12] = [
    0,
    1,
    u64::MAX, // -1
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    1 << 32,
    1 << 40,
    1 << 62,
    i64::MAX as u64,
    i64::MIN as u64,
    0x7fff_ffff_ffff_fff8,
];

// ---------------------------------------------------------------------------------------------
// Configuration, failures and the report

#[derive(Debug, Clone)]
struct Config {
    seed: u64,
    cases: u64,
    only: Option<u64>,
    keep_going: bool,
    verbose: bool,
}

impl Config {
    fn from_env(test: &str) -> Self {
        let seed = env_u64("GPU_FLIGHT_FUZZ_SEED").unwrap_or_else(|| {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .expect("clock after 1970");
            now.as_nanos() as u64
        });
        let config = Self {
            seed,
            cases: env_u64("GPU_FLIGHT_FUZZ_CASES").unwrap_or(DEFAULT_CASES),
            only: env_u64("GPU_FLIGHT_FUZZ_CASE"),
            keep_going: env_flag("GPU_FLIGHT_FUZZ_KEEP_GOING"),
            verbose: env_flag("GPU_FLIGHT_FUZZ_VERBOSE"),
        };
        announce(&format!(
            "fuzz {test}: seed {seed}, {} cases{}; replay with GPU_FLIGHT_FUZZ_SEED={seed} \
             GPU_FLIGHT_FUZZ_CASES={} cargo test --test fuzz {test} -- --nocapture",
            config.cases,
            config
                .only
                .map(|i| format!(" (only case {i})"))
                .unwrap_or_default(),
            config.cases,
        ));
        config
    }

    fn indices(&self) -> Range<u64> {
        match self.only {
            Some(index) => index..index + 1,
            None => 0..self.cases,
        }
    }

    /// Each case has its own generator so that one case replays without the others.
    fn rng(&self, index: u64) -> StdRng {
        StdRng::seed_from_u64(self.seed ^ index.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }
}

fn env_u64(name: &str) -> Option<u64> {
    let value = std::env::var(name).ok()?;
    Some(
        value
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("{name}={value:?} is not a u64: {e}")),
    )
}

fn env_flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| !v.is_empty() && v != "0")
}

/// Prints to the captured test output (shown with a failure) and to stderr uncaptured (see
/// [`progress`]); with `--nocapture` the line therefore appears twice.
fn announce(line: &str) {
    println!("{line}");
    progress(line);
}

/// Writes straight to stderr, which libtest does not capture (`eprintln!` it does): when the
/// process aborts (an allocation failure is not a panic) captured output is lost, and these
/// lines are what tell which seed and case to replay.
fn progress(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// One broken invariant. `fatal` stops the run even with KEEP_GOING: after a hang the server
/// cannot be trusted to answer the next case.
#[derive(Debug)]
struct Failure {
    class: String,
    detail: String,
    fatal: bool,
}

impl Failure {
    fn new(class: impl Into<String>, detail: impl Into<String>) -> Self {
        Self {
            class: class.into(),
            detail: detail.into(),
            fatal: false,
        }
    }
}

type Checked<T> = Result<T, Failure>;

/// A failed case as the final report shows it.
#[derive(Debug)]
struct Recorded {
    case: String,
    mutations: String,
    failure: Failure,
    panics: Vec<PanicRecord>,
}

/// Runs the cases of one test, stopping at the first failure unless KEEP_GOING.
#[derive(Debug)]
struct Campaign {
    config: Config,
    failures: Vec<Recorded>,
    ran: u64,
    /// How often each call ended how, to see what the mutations reach.
    outcomes: BTreeMap<String, u64>,
    started: Instant,
}

impl Campaign {
    fn new(config: Config) -> Self {
        Self {
            config,
            failures: Vec::new(),
            ran: 0,
            outcomes: BTreeMap::new(),
            started: Instant::now(),
        }
    }

    fn begin(&self, case: &str, mutations: &str) {
        *lock(&CURRENT_CASE) = format!("{case} [{mutations}]");
        if self.config.verbose {
            progress(&format!("{case}: {mutations}"));
        }
    }

    /// Records the outcome of a case; returns whether to go on.
    fn end(
        &mut self,
        case: String,
        mutations: String,
        outcome: Checked<()>,
        panics: usize,
    ) -> bool {
        self.ran += 1;
        let new_panics = panics_since(panics);
        // A panic is the most specific account of a failure: it names the class, and what the
        // client saw (often CANCELLED, the stream reset) goes in the detail.
        let failure = match (outcome, new_panics.first()) {
            (Ok(()), None) => None,
            (Err(failure), None) => Some(failure),
            (outcome, Some(first)) => Some(Failure {
                class: format!("panic at {}", short_location(&first.location)),
                detail: match &outcome {
                    Ok(()) => "the call itself passed".to_owned(),
                    Err(f) => format!("{}: {}", f.class, f.detail),
                },
                fatal: outcome.is_err_and(|f| f.fatal),
            }),
        };
        let Some(failure) = failure else {
            return true;
        };
        let fatal = failure.fatal;
        let recorded = Recorded {
            case,
            mutations,
            failure,
            panics: new_panics,
        };
        progress(&format!(
            "FAILED {} (seed {}): {}\n  mutations: {}\n  {}{}",
            recorded.case,
            self.config.seed,
            recorded.failure.class,
            recorded.mutations,
            recorded.failure.detail,
            describe_panics(&recorded.panics),
        ));
        self.failures.push(recorded);
        self.config.keep_going && !fatal
    }

    /// Panics with a summary of the failures, grouped by class, if there were any.
    fn finish(self, test: &str) {
        let elapsed = self.started.elapsed();
        let outcomes: Vec<String> = self
            .outcomes
            .iter()
            .map(|(outcome, count)| format!("{outcome} {count}"))
            .collect();
        announce(&format!("fuzz {test}: outcomes: {}", outcomes.join(", ")));
        if self.failures.is_empty() {
            announce(&format!(
                "fuzz {test}: seed {}: {} cases passed in {:.1} s",
                self.config.seed,
                self.ran,
                elapsed.as_secs_f64()
            ));
            return;
        }
        let mut classes: BTreeMap<&str, Vec<&Recorded>> = BTreeMap::new();
        for failure in &self.failures {
            classes
                .entry(failure.failure.class.as_str())
                .or_default()
                .push(failure);
        }
        let mut summary = format!(
            "fuzz {test}: seed {}: {} of {} cases failed ({:.1} s), {} classes:\n",
            self.config.seed,
            self.failures.len(),
            self.ran,
            elapsed.as_secs_f64(),
            classes.len()
        );
        for (class, examples) in &classes {
            let first = examples[0];
            summary.push_str(&format!(
                "- {class}: {} case(s), first {} [{}]\n    {}{}\n",
                examples.len(),
                first.case,
                first.mutations,
                first.failure.detail,
                describe_panics(&first.panics)
            ));
        }
        summary.push_str(&format!(
            "replay with GPU_FLIGHT_FUZZ_SEED={} GPU_FLIGHT_FUZZ_CASE=<index>",
            self.config.seed
        ));
        if self.failures.iter().any(|f| f.failure.fatal) {
            // A hung handler keeps running on its thread, usually allocating as it goes; only
            // ending the process stops it before it takes the machine's memory.
            announce(&summary);
            std::process::exit(101);
        }
        panic!("{summary}");
    }
}

/// A panic location without the cargo registry prefix.
fn short_location(location: &str) -> &str {
    location
        .find("index.crates.io-")
        .and_then(|at| {
            location[at..]
                .find('/')
                .map(|slash| &location[at + slash + 1..])
        })
        .unwrap_or(location)
}

fn describe_panics(panics: &[PanicRecord]) -> String {
    panics
        .iter()
        .map(|p| {
            format!(
                "\n    panic in thread '{}' at {}: {}",
                p.thread, p.location, p.message
            )
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Process-wide state: panics, the case running, one test at a time

#[derive(Debug, Clone)]
struct PanicRecord {
    thread: String,
    location: String,
    message: String,
}

static PANICS: Mutex<Vec<PanicRecord>> = Mutex::new(Vec::new());
static CURRENT_CASE: Mutex<String> = Mutex::new(String::new());
/// The two tests share the panic hook and its count, so they take turns.
static SERIAL: Mutex<()> = Mutex::new(());

/// A poisoned lock only means another test failed; the data is still usable.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Records every panic (server tasks included: tokio catches them, so nothing else would
/// notice), then lets the previous hook print it as usual.
fn install_panic_hook() {
    static INSTALLED: OnceLock<()> = OnceLock::new();
    INSTALLED.get_or_init(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let record = PanicRecord {
                thread: std::thread::current()
                    .name()
                    .unwrap_or("unnamed")
                    .to_owned(),
                location: info
                    .location()
                    .map(|l| format!("{}:{}:{}", l.file(), l.line(), l.column()))
                    .unwrap_or_else(|| "unknown location".to_owned()),
                message: panic_message(info.payload()).chars().take(500).collect(),
            };
            lock(&PANICS).push(record);
            let case = lock(&CURRENT_CASE).clone();
            eprintln!("panic while running {case}");
            previous(info);
        }));
    });
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> &str {
    if let Some(text) = payload.downcast_ref::<&str>() {
        text
    } else if let Some(text) = payload.downcast_ref::<String>() {
        text
    } else {
        "(non-string payload)"
    }
}

fn panic_count() -> usize {
    lock(&PANICS).len()
}

fn panics_since(count: usize) -> Vec<PanicRecord> {
    lock(&PANICS).get(count..).unwrap_or_default().to_vec()
}

/// The server on its own runtime: a handler stuck in a loop then cannot starve the client's
/// timers (so the 30 s limit is enforced), and a failed test does not wait for it on exit.
struct Served {
    runtime: Option<tokio::runtime::Runtime>,
    server: Option<common::TestServer>,
    addr: SocketAddr,
}

impl Served {
    fn start(options: ServeOptions) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("fuzz-server")
            .enable_all()
            .build()
            .expect("server runtime");
        let server = runtime.block_on(common::TestServer::start_with(
            Arc::new(HostBackend::new()),
            StoreOptions {
                memory_limit: Some(MEMORY_LIMIT),
                // The device's limit alone: no host tier to spill to.
                host_memory_limit: Some(0),
                ..StoreOptions::default()
            },
            options,
        ));
        let addr = server.addr;
        Self {
            runtime: Some(runtime),
            server: Some(server),
            addr,
        }
    }

    fn stop(mut self) {
        if let (Some(runtime), Some(server)) = (self.runtime.as_ref(), self.server.take()) {
            runtime.block_on(server.shutdown_and_wait());
        }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.server.take();
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

/// Small endpoints and messages, so that small datasets still span several of each.
fn serve_options() -> ServeOptions {
    ServeOptions {
        flight: FlightOptions {
            rows_per_endpoint: 64,
            max_message_bytes: 64 << 10,
            ..FlightOptions::default()
        },
        ..ServeOptions::default()
    }
}

fn client_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("client runtime")
}

async fn open_channel(addr: SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .expect("uri")
        .connect()
        .await
        .expect("connect")
}

/// Awaits `future`, failing (fatally) if it takes longer than [`CALL_TIMEOUT`].
async fn timed<T>(what: &str, future: impl std::future::Future<Output = T>) -> Checked<T> {
    tokio::time::timeout(CALL_TIMEOUT, future)
        .await
        .map_err(|_| Failure {
            class: format!("hang: {what}"),
            detail: format!("{what} did not answer in {} s", CALL_TIMEOUT.as_secs()),
            fatal: true,
        })
}

/// The class of a refused call: its code and the start of its message, so that one frequent
/// cause (say, protobuf the server cannot decode) does not hide the others.
fn status_class(what: &str, status: &tonic::Status) -> String {
    const PROTOBUF: &str = "failed to decode Protobuf message";
    let message: String = status
        .message()
        .chars()
        .map(|c| if c.is_ascii_digit() { '#' } else { c })
        .collect();
    let message = match message.find(PROTOBUF) {
        Some(at) => &message[..at + PROTOBUF.len()],
        None => &message,
    };
    let cause: String = message.splitn(3, ':').take(2).collect::<Vec<_>>().join(":");
    let cause: String = cause.chars().take(80).collect();
    format!("{what} answered {:?} ({})", status.code(), cause.trim())
}

fn status_summary(status: &tonic::Status) -> String {
    let message: String = status.message().chars().take(300).collect();
    format!("{:?}: {message}", status.code())
}

// ---------------------------------------------------------------------------------------------
// Checks shared by both tests

/// The `status` action, through raw gRPC so its failure is a finding rather than a panic.
async fn server_status(channel: &Channel) -> Checked<serde_json::Value> {
    let request = Action::new("status", "").encode_to_vec();
    let replies = timed(
        "status",
        raw_unary(channel.clone(), raw::DO_ACTION, request.into()),
    )
    .await?
    .map_err(|s| Failure::new("status fails", status_summary(&s)))?;
    let [reply] = replies.as_slice() else {
        return Err(Failure::new(
            "status fails",
            format!("{} replies", replies.len()),
        ));
    };
    let result = arrow_flight::Result::decode(reply.clone())
        .map_err(|e| Failure::new("status fails", format!("undecodable Result: {e}")))?;
    serde_json::from_slice(&result.body)
        .map_err(|e| Failure::new("status fails", format!("status is not JSON: {e}")))
}

async fn used_bytes(channel: &Channel) -> Checked<u64> {
    let status = server_status(channel).await?;
    status["devices"][0]["used_bytes"]
        .as_u64()
        .ok_or_else(|| Failure::new("status fails", format!("no used_bytes in {status}")))
}

/// Polls until `used_bytes` is back to `baseline` and `status` counts `datasets` datasets.
/// (Like `common::wait_until`, but a miss is a recorded failure, not a panic, so that
/// KEEP_GOING can go on.)
async fn settle(channel: &Channel, baseline: u64, datasets: u64) -> Checked<()> {
    let deadline = Instant::now() + SETTLE_TIMEOUT;
    loop {
        let status = server_status(channel).await?;
        let used = status["devices"][0]["used_bytes"].as_u64();
        let count = status["datasets"].as_u64();
        if used == Some(baseline) && count == Some(datasets) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(Failure::new(
                "memory not returned",
                format!(
                    "after {} s used_bytes is {used:?} (baseline {baseline}) and datasets \
                     {count:?} (expected {datasets})",
                    SETTLE_TIMEOUT.as_secs()
                ),
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Every dataset ListFlights reports, by name.
async fn list_datasets(client: &mut FlightClient) -> Checked<BTreeMap<String, FlightInfo>> {
    let infos: Vec<FlightInfo> = timed("ListFlights", async {
        client.list_flights(Bytes::new()).await?.try_collect().await
    })
    .await?
    .map_err(|e| Failure::new("ListFlights fails", e.to_string()))?;
    let mut datasets = BTreeMap::new();
    for info in infos {
        let name = info
            .flight_descriptor
            .as_ref()
            .and_then(|d| d.path.first().cloned())
            .ok_or_else(|| Failure::new("ListFlights fails", "a FlightInfo without a name"))?;
        datasets.insert(name, info);
    }
    Ok(datasets)
}

/// What reading a dataset back produced.
#[derive(Debug)]
struct ReadBack {
    schema: SchemaRef,
    batches: Vec<RecordBatch>,
}

impl ReadBack {
    fn rows(&self) -> usize {
        self.batches.iter().map(RecordBatch::num_rows).sum()
    }
}

/// Reads a dataset completely: GetFlightInfo, GetSchema, and DoGet of every endpoint, each
/// decoded (and so validated) by arrow-flight's client.
async fn read_back(client: &mut FlightClient, name: &str) -> Checked<ReadBack> {
    let fail = |what: &str, e: String| Failure::new(format!("read back: {what} fails"), e);
    let info = timed("GetFlightInfo", client.get_flight_info(path(name)))
        .await?
        .map_err(|e| fail("GetFlightInfo", e.to_string()))?;
    let total_records = info.total_records;
    let schema: SchemaRef = Arc::new(
        info.clone()
            .try_decode_schema()
            .map_err(|e| fail("GetFlightInfo schema", e.to_string()))?,
    );
    let schema_again = timed("GetSchema", client.get_schema(path(name)))
        .await?
        .map_err(|e| fail("GetSchema", e.to_string()))?;
    if &schema_again != schema.as_ref() {
        return Err(Failure::new(
            "read back: schemas disagree",
            format!("GetFlightInfo says {schema}, GetSchema says {schema_again}"),
        ));
    }
    let mut batches = Vec::new();
    for (index, endpoint) in info.endpoint.into_iter().enumerate() {
        let ticket = endpoint
            .ticket
            .ok_or_else(|| fail("GetFlightInfo", format!("endpoint {index} has no ticket")))?;
        let mut part: Vec<RecordBatch> = timed("DoGet", async {
            client.do_get(ticket).await?.try_collect().await
        })
        .await?
        .map_err(|e| fail("DoGet", format!("endpoint {index}: {e}")))?;
        batches.append(&mut part);
    }
    for batch in &batches {
        if batch.schema().fields() != schema.fields() {
            return Err(Failure::new(
                "read back: schemas disagree",
                format!("DoGet sent {} for a dataset of {schema}", batch.schema()),
            ));
        }
    }
    let read = ReadBack { schema, batches };
    if read.rows() as i64 != total_records {
        return Err(Failure::new(
            "read back: row counts disagree",
            format!(
                "GetFlightInfo says {total_records} rows, DoGet sent {}",
                read.rows()
            ),
        ));
    }
    Ok(read)
}

/// Whether `read` holds exactly `sent` (schema and values).
fn same_data(sent: &Stream, read: &ReadBack) -> Result<(), String> {
    if read.schema != sent.schema {
        return Err(format!(
            "schema changed from {} to {}",
            sent.schema, read.schema
        ));
    }
    let concat = |batches: &[RecordBatch]| arrow::compute::concat_batches(&sent.schema, batches);
    let expected = concat(&sent.batches).map_err(|e| format!("concat: {e}"))?;
    let got = concat(&read.batches).map_err(|e| format!("concat: {e}"))?;
    if expected != got {
        return Err(format!(
            "data changed: {} rows expected, {} read, contents differ",
            expected.num_rows(),
            got.num_rows()
        ));
    }
    Ok(())
}

async fn drop_dataset(channel: &Channel, name: &str) -> Checked<()> {
    let request = Action::new("drop", serde_json::json!({ "name": name }).to_string());
    timed(
        "drop",
        raw_unary(
            channel.clone(),
            raw::DO_ACTION,
            request.encode_to_vec().into(),
        ),
    )
    .await?
    .map(|_| ())
    .map_err(|s| Failure::new("drop fails", format!("{name:?}: {}", status_summary(&s))))
}

// ---------------------------------------------------------------------------------------------
// The corpus of valid DoPut streams

/// A valid put: the batches, and FlightData messages arrow-flight encodes for them (no
/// descriptor yet: each case attaches its own).
#[derive(Debug, Clone)]
struct Stream {
    label: &'static str,
    schema: SchemaRef,
    batches: Vec<RecordBatch>,
    messages: Vec<FlightData>,
    /// Whether the server must accept it unmutated (the others use types it may refuse).
    supported: bool,
}

impl Stream {
    fn rows(&self) -> usize {
        self.batches.iter().map(RecordBatch::num_rows).sum()
    }
}

async fn stream(
    label: &'static str,
    schema: SchemaRef,
    batches: Vec<RecordBatch>,
    supported: bool,
) -> Stream {
    compressed_stream(label, schema, batches, supported, None).await
}

/// A stream whose bodies are compressed with `codec` (each buffer prefixed with the length it
/// decompresses to: numbers the mutations get to rewrite).
async fn compressed_stream(
    label: &'static str,
    schema: SchemaRef,
    batches: Vec<RecordBatch>,
    supported: bool,
    codec: Option<CompressionType>,
) -> Stream {
    let options = IpcWriteOptions::default()
        .try_with_compression(codec)
        .unwrap_or_else(|e| panic!("compression for corpus stream {label}: {e}"));
    let messages = FlightDataEncoderBuilder::new()
        .with_options(options)
        .with_schema(Arc::clone(&schema))
        .with_dictionary_handling(DictionaryHandling::Resend)
        .build(futures::stream::iter(batches.clone().into_iter().map(Ok)))
        .try_collect()
        .await
        .unwrap_or_else(|e| panic!("encoding corpus stream {label}: {e}"));
    Stream {
        label,
        schema,
        batches,
        messages,
        supported,
    }
}

async fn put_corpus() -> Vec<Stream> {
    let first = |batches: &[RecordBatch]| batches[0].schema();
    let mut corpus = Vec::new();
    let sets: Vec<(&'static str, Vec<RecordBatch>, bool)> = vec![
        (
            "int64-nulls",
            vec![int64_batch(50, 3, 0), int64_batch(13, 3, 500)],
            true,
        ),
        (
            "strings",
            vec![string_batch(40, 0), string_batch(25, 40)],
            true,
        ),
        ("all-types", vec![all_types_batch(12)], true),
        ("lists", vec![lists_batch(30, 0), lists_batch(9, 1)], true),
        ("structs", vec![struct_batch(33)], true),
        (
            "dictionaries",
            vec![
                dictionary_batch(20, 0),
                dictionary_batch(15, 1),
                dictionary_batch(7, 2),
            ],
            true,
        ),
        ("decimals", vec![decimal_batch(25)], true),
        (
            "null-column",
            vec![null_column_batch(30), null_column_batch(4)],
            true,
        ),
        (
            "only-null",
            vec![only_null_batch(17), only_null_batch(3)],
            true,
        ),
        ("fixed-size", vec![fixed_size_batch(21)], true),
        ("multi-batch", multi_batches(), true),
        ("views", vec![views_batch(19)], false),
        ("union", vec![union_batch(16)], false),
        ("run-end", vec![run_end_batch()], false),
    ];
    for (label, batches, supported) in sets {
        let schema = first(&batches);
        corpus.push(stream(label, schema, batches, supported).await);
    }
    corpus.push(
        stream(
            "zero-columns",
            Arc::new(Schema::empty()),
            vec![zero_column_batch(5), zero_column_batch(3)],
            true,
        )
        .await,
    );
    corpus.push(stream("schema-only", int64_batch(1, 2, 0).schema(), vec![], true).await);
    let compressed: [(&'static str, Vec<RecordBatch>, CompressionType); 3] = [
        (
            "int64-lz4",
            vec![int64_batch(60, 3, 0), int64_batch(20, 3, 60)],
            CompressionType::LZ4_FRAME,
        ),
        (
            "strings-zstd",
            vec![string_batch(40, 0), string_batch(25, 40)],
            CompressionType::ZSTD,
        ),
        (
            "dictionaries-lz4",
            vec![dictionary_batch(20, 0), dictionary_batch(15, 1)],
            CompressionType::LZ4_FRAME,
        ),
    ];
    for (label, batches, codec) in compressed {
        let schema = first(&batches);
        corpus.push(compressed_stream(label, schema, batches, true, Some(codec)).await);
    }
    corpus
}

fn lists_batch(rows: usize, seed: usize) -> RecordBatch {
    let mut nested = ListBuilder::new(ListBuilder::new(StringBuilder::new()));
    for r in 0..rows {
        if (r + seed) % 6 == 5 {
            nested.append_null();
            continue;
        }
        for i in 0..(r % 3) {
            let inner = nested.values();
            for j in 0..((r + i) % 4) {
                if (r + j) % 5 == 0 {
                    inner.values().append_null();
                } else {
                    inner.values().append_value(format!("v{r}.{i}.{j}"));
                }
            }
            inner.append(true);
        }
        nested.append(true);
    }
    let large = LargeListArray::from_iter_primitive::<Int64Type, _, _>(
        (0..rows)
            .map(|r| (r % 4 != 1).then(|| (0..r % 5).map(|v| Some(v as i64)).collect::<Vec<_>>())),
    );
    RecordBatch::try_from_iter([
        ("nested", Arc::new(nested.finish()) as ArrayRef),
        ("large", Arc::new(large)),
    ])
    .expect("lists batch")
}

fn struct_batch(rows: usize) -> RecordBatch {
    let inner = StructArray::new(
        Fields::from(vec![
            Field::new("c", DataType::Utf8, true),
            Field::new("d", DataType::Float64, true),
        ]),
        vec![
            Arc::new(StringArray::from_iter(
                (0..rows).map(|r| (r % 3 != 0).then(|| format!("c{r}"))),
            )) as ArrayRef,
            Arc::new(Float64Array::from_iter_values(
                (0..rows).map(|r| r as f64 / 3.0),
            )),
        ],
        Some(NullBuffer::from_iter((0..rows).map(|r| r % 4 != 2))),
    );
    let outer = StructArray::new(
        Fields::from(vec![
            Field::new("a", DataType::Int32, false),
            Field::new("b", inner.data_type().clone(), true),
        ]),
        vec![
            Arc::new(Int32Array::from_iter_values(0..rows as i32)) as ArrayRef,
            Arc::new(inner),
        ],
        Some(NullBuffer::from_iter((0..rows).map(|r| r % 7 != 6))),
    );
    RecordBatch::try_from_iter([("s", Arc::new(outer) as ArrayRef)]).expect("struct batch")
}

/// Each call has its own dictionary, so a multi-batch stream resends and the server merges.
fn dictionary_batch(rows: usize, seed: usize) -> RecordBatch {
    let words: Vec<Option<String>> = (0..rows)
        .map(|r| (r % 5 != 4).then(|| format!("w{}", (r * 7 + seed) % (3 + seed))))
        .collect();
    let words: DictionaryArray<Int32Type> = words.iter().map(Option::as_deref).collect();
    let keys = Int8Array::from_iter((0..rows).map(|r| (r % 6 != 1).then_some((r % 3) as i8)));
    let values = Int64Array::from_iter_values([seed as i64, -1, i64::MAX]);
    let numbers =
        DictionaryArray::<Int8Type>::try_new(keys, Arc::new(values)).expect("int8 dictionary");
    RecordBatch::try_from_iter([
        ("words", Arc::new(words) as ArrayRef),
        ("numbers", Arc::new(numbers)),
    ])
    .expect("dictionary batch")
}

fn decimal_batch(rows: usize) -> RecordBatch {
    let wide = Decimal128Array::from_iter(
        (0..rows).map(|r| (r % 4 != 0).then_some((r as i128 - 10) * 123_456_789_012_345)),
    )
    .with_precision_and_scale(38, 10)
    .expect("decimal128(38, 10)");
    let narrow = Decimal128Array::from_iter_values(
        (0..rows).map(|r| (r as i128 * 4_999) % 100_000 - 50_000),
    )
    .with_precision_and_scale(5, 2)
    .expect("decimal128(5, 2)");
    let huge = Decimal256Array::from_iter(
        (0..rows).map(|r| (r % 3 != 1).then(|| i256::from_i128(r as i128 * 10_i128.pow(30)))),
    )
    .with_precision_and_scale(76, 0)
    .expect("decimal256(76, 0)");
    RecordBatch::try_from_iter([
        ("wide", Arc::new(wide) as ArrayRef),
        ("narrow", Arc::new(narrow)),
        ("huge", Arc::new(huge)),
    ])
    .expect("decimal batch")
}

fn null_column_batch(rows: usize) -> RecordBatch {
    RecordBatch::try_from_iter([
        ("nothing", Arc::new(NullArray::new(rows)) as ArrayRef),
        ("x", Arc::new(Int32Array::from_iter_values(0..rows as i32))),
    ])
    .expect("null column batch")
}

fn only_null_batch(rows: usize) -> RecordBatch {
    RecordBatch::try_from_iter([("nothing", Arc::new(NullArray::new(rows)) as ArrayRef)])
        .expect("only-null batch")
}

fn zero_column_batch(rows: usize) -> RecordBatch {
    RecordBatch::try_new_with_options(
        Arc::new(Schema::empty()),
        vec![],
        &RecordBatchOptions::new().with_row_count(Some(rows)),
    )
    .expect("zero-column batch")
}

fn fixed_size_batch(rows: usize) -> RecordBatch {
    let lists = FixedSizeListArray::from_iter_primitive::<Float32Type, _, _>(
        (0..rows)
            .map(|r| (r % 5 != 2).then(|| vec![Some(r as f32), (r % 2 == 0).then_some(0.5), None])),
        3,
    );
    let binary = FixedSizeBinaryArray::try_from_sparse_iter_with_size(
        (0..rows).map(|r| (r % 4 != 3).then_some([r as u8; 5])),
        5,
    )
    .expect("fixed-size binary");
    RecordBatch::try_from_iter([
        ("lists", Arc::new(lists) as ArrayRef),
        ("binary", Arc::new(binary)),
    ])
    .expect("fixed-size batch")
}

/// Slices, a zero-row batch between them, and a different chunking each time.
fn multi_batches() -> Vec<RecordBatch> {
    let whole = int64_batch(100, 2, 0);
    vec![
        whole.slice(0, 10),
        whole.slice(10, 0),
        whole.slice(10, 50),
        whole.slice(60, 40),
        int64_batch(1, 2, 7),
    ]
}

fn views_batch(rows: usize) -> RecordBatch {
    let strings = StringViewArray::from_iter(
        (0..rows).map(|r| (r % 4 != 0).then(|| "long enough to leave the view ".repeat(r % 3))),
    );
    let binary = BinaryViewArray::from_iter((0..rows).map(|r| Some(vec![r as u8; r])));
    RecordBatch::try_from_iter([
        ("strings", Arc::new(strings) as ArrayRef),
        ("binary", Arc::new(binary)),
    ])
    .expect("views batch")
}

fn union_batch(rows: usize) -> RecordBatch {
    let fields = UnionFields::try_new(
        [0_i8, 1],
        [
            Field::new("i", DataType::Int32, true),
            Field::new("s", DataType::Utf8, true),
        ],
    )
    .expect("union fields");
    let type_ids: ScalarBuffer<i8> = (0..rows).map(|r| (r % 2) as i8).collect();
    let union = UnionArray::try_new(
        fields,
        type_ids,
        None,
        vec![
            Arc::new(Int32Array::from_iter_values(0..rows as i32)) as ArrayRef,
            Arc::new(StringArray::from_iter_values(
                (0..rows).map(|r| format!("u{r}")),
            )),
        ],
    )
    .expect("sparse union");
    RecordBatch::try_from_iter([("u", Arc::new(union) as ArrayRef)]).expect("union batch")
}

fn run_end_batch() -> RecordBatch {
    let run_ends = Int32Array::from(vec![4, 9, 15, 20]);
    let values = Int64Array::from(vec![Some(1), None, Some(3), Some(i64::MIN)]);
    let runs = RunArray::<Int32Type>::try_new(&run_ends, &values).expect("run array");
    RecordBatch::try_from_iter([("runs", Arc::new(runs) as ArrayRef)]).expect("run-end batch")
}

// ---------------------------------------------------------------------------------------------
// Mutations

/// The mutations applied to a case, for the failure report.
#[derive(Debug, Default)]
struct Log(Vec<String>);

impl Log {
    fn push(&mut self, entry: impl Into<String>) {
        self.0.push(entry.into());
    }
}

impl std::fmt::Display for Log {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.is_empty() {
            f.write_str("none")
        } else {
            f.write_str(&self.0.join("; "))
        }
    }
}

/// One byte-level change to `bytes` (used on IPC headers and bodies, protobuf encodings,
/// tickets and action bodies).
fn mutate_bytes(rng: &mut StdRng, bytes: &mut Vec<u8>, log: &mut Log, what: &str) {
    let len = bytes.len();
    match rng.random_range(0..9) {
        0 if len > 0 => {
            let flips = rng.random_range(1..=4);
            let mut at = Vec::new();
            for _ in 0..flips {
                let offset = rng.random_range(0..len);
                let bit = rng.random_range(0..8);
                bytes[offset] ^= 1 << bit;
                at.push(format!("{offset}.{bit}"));
            }
            log.push(format!("{what}: flip bits {}", at.join(",")));
        }
        1 if len > 0 => {
            let offset = rng.random_range(0..len);
            let count = rng.random_range(1..=8).min(len - offset);
            rng.fill(&mut bytes[offset..offset + count]);
            log.push(format!("{what}: {count} random bytes at {offset}"));
        }
        2 if len >= 4 => {
            let width = if len >= 8 && rng.random_bool(0.5) {
                8
            } else {
                4
            };
            let offset = rng.random_range(0..=(len - width) / width) * width;
            let value = *INTERESTING.choose(rng).expect("values");
            let word = &value.to_le_bytes()[..width];
            bytes[offset..offset + width].copy_from_slice(word);
            log.push(format!(
                "{what}: {width}-byte word at {offset} = {word:02x?}"
            ));
        }
        3 if len > 0 => {
            let keep = match rng.random_range(0..3) {
                0 => len.saturating_sub(8),
                1 => len - 1,
                _ => rng.random_range(0..len),
            };
            bytes.truncate(keep);
            log.push(format!("{what}: truncated {len} -> {keep}"));
        }
        4 => {
            let extra = *[1_usize, 7, 8, 64, 4096].choose(rng).expect("sizes");
            let zeros = rng.random_bool(0.5);
            for _ in 0..extra {
                bytes.push(if zeros { 0 } else { rng.random() });
            }
            log.push(format!(
                "{what}: extended by {extra} {} bytes",
                if zeros { "zero" } else { "random" }
            ));
        }
        5 => {
            let offset = rng.random_range(0..=len);
            let count = rng.random_range(1..=8);
            let inserted: Vec<u8> = (0..count).map(|_| rng.random()).collect();
            bytes.splice(offset..offset, inserted);
            log.push(format!("{what}: inserted {count} random bytes at {offset}"));
        }
        6 if len > 0 => {
            let start = rng.random_range(0..len);
            let end = rng.random_range(start..=len.min(start + 16));
            bytes.drain(start..end);
            log.push(format!("{what}: deleted bytes {start}..{end}"));
        }
        7 if len > 0 => {
            let start = rng.random_range(0..len);
            let end = rng.random_range(start..=len.min(start + 16));
            let copy = bytes[start..end].to_vec();
            bytes.splice(end..end, copy);
            log.push(format!("{what}: duplicated bytes {start}..{end}"));
        }
        8 if len > 0 => {
            let offset = rng.random_range(0..len);
            bytes[offset] = *[0xff_u8, 0x80, 0xc3, 0x00].choose(rng).expect("bytes");
            log.push(format!("{what}: byte {offset} = {:#04x}", bytes[offset]));
        }
        _ => {
            bytes.clear();
            log.push(format!("{what}: emptied ({len} bytes)"));
        }
    }
}

/// Replaces the first occurrence of `needle` with bytes that are not UTF-8, as a client that
/// ignores protobuf's string rules would send.
fn corrupt_utf8(bytes: &mut [u8], needle: &[u8], rng: &mut StdRng, log: &mut Log) {
    let Some(at) = bytes.windows(needle.len()).position(|w| w == needle) else {
        log.push(format!(
            "protobuf: invalid UTF-8 (no {:?} to corrupt)",
            String::from_utf8_lossy(needle)
        ));
        return;
    };
    // A lone continuation byte, an invalid byte, or a truncated two-byte sequence.
    let bad = *[0x80_u8, 0xff, 0xc3].choose(rng).expect("bytes");
    let offset = at + needle.len() - 1;
    bytes[offset] = bad;
    log.push(format!(
        "protobuf: invalid UTF-8 {bad:#04x} in {:?}",
        String::from_utf8_lossy(needle)
    ));
}

/// The rows an IPC header declares (record batch or dictionary batch), if it parses.
fn declared_rows(header: &[u8]) -> Option<i64> {
    let message = arrow::ipc::root_as_message(header).ok()?;
    if let Some(batch) = message.header_as_record_batch() {
        return Some(batch.length());
    }
    message
        .header_as_dictionary_batch()?
        .data()
        .map(|b| b.length())
}

/// Rewrites aligned 8-byte words equal to `from` (the batch length and the field node lengths
/// and null counts hold the row count), all of them or one; returns how many.
fn rewrite_words(bytes: &mut [u8], from: u64, to: u64, all: bool, rng: &mut StdRng) -> usize {
    let hits: Vec<usize> = (0..bytes.len() / 8)
        .map(|i| i * 8)
        .filter(|&o| bytes[o..o + 8] == from.to_le_bytes())
        .collect();
    let chosen: Vec<usize> = if all {
        hits
    } else {
        hits.choose(rng).copied().into_iter().collect()
    };
    for &offset in &chosen {
        bytes[offset..offset + 8].copy_from_slice(&to.to_le_bytes());
    }
    chosen.len()
}

/// Indexes of messages with a non-empty header (or body).
fn with_header(messages: &[FlightData]) -> Vec<usize> {
    (0..messages.len())
        .filter(|&i| !messages[i].data_header.is_empty())
        .collect()
}

fn with_body(messages: &[FlightData]) -> Vec<usize> {
    (0..messages.len())
        .filter(|&i| !messages[i].data_body.is_empty())
        .collect()
}

fn edit(bytes: &Bytes, change: impl FnOnce(&mut Vec<u8>)) -> Bytes {
    let mut owned = bytes.to_vec();
    change(&mut owned);
    owned.into()
}

/// One Arrow IPC-level mutation of a message sequence.
fn mutate_ipc(rng: &mut StdRng, messages: &mut Vec<FlightData>, corpus: &[Stream], log: &mut Log) {
    let n = messages.len();
    match rng.random_range(0..14) {
        0..=2 => {
            let Some(&i) = with_header(messages).choose(rng) else {
                return log.push("header: none to mutate");
            };
            let header = &mut messages[i].data_header;
            *header = edit(header, |b| {
                mutate_bytes(rng, b, log, &format!("header {i}"))
            });
        }
        3..=5 => {
            let Some(&i) = with_body(messages).choose(rng) else {
                return log.push("body: none to mutate");
            };
            let body = &mut messages[i].data_body;
            *body = edit(body, |b| mutate_bytes(rng, b, log, &format!("body {i}")));
        }
        6 => {
            // Row counts the buffers may not back: consistent (every word that held the count)
            // or not (one of them), in one batch or in every batch (sums of counts can overflow
            // where one count alone cannot).
            let batches: Vec<(usize, i64)> = (0..n)
                .filter_map(|i| declared_rows(&messages[i].data_header).map(|r| (i, r)))
                .collect();
            let Some(&(chosen, rows)) = batches.choose(rng) else {
                return log.push("rows: no batch to rewrite");
            };
            let to = match rng.random_range(0..3) {
                0 => *INTERESTING.choose(rng).expect("values"),
                1 => (rows as u64).wrapping_add(rng.random_range(1..=64)),
                _ => (rows as u64).saturating_mul(1 << rng.random_range(1..40)),
            };
            let all = rng.random_bool(0.6);
            let every_batch = rng.random_bool(0.3);
            let mut count = 0;
            for (i, declared) in batches {
                if i != chosen && !every_batch {
                    continue;
                }
                let header = &mut messages[i].data_header;
                *header = edit(header, |b| {
                    count += rewrite_words(b, declared as u64, to, all, rng)
                });
            }
            log.push(format!(
                "message {chosen}: declared rows {rows} -> {to:#x} ({count} word(s), {}{})",
                if all { "all" } else { "one" },
                if every_batch { ", every batch" } else { "" }
            ));
        }
        7 if n >= 2 => {
            let (a, b) = (rng.random_range(0..n), rng.random_range(0..n));
            messages.swap(a, b);
            log.push(format!("swapped messages {a} and {b}"));
        }
        8 if n >= 1 => {
            let from = rng.random_range(0..n);
            let to = rng.random_range(0..=n);
            let copy = messages[from].clone();
            messages.insert(to, copy);
            log.push(format!("duplicated message {from} at {to}"));
        }
        9 if n >= 1 => {
            let i = rng.random_range(0..n);
            messages.remove(i);
            log.push(format!("dropped message {i} of {n}"));
        }
        10 if n >= 2 => {
            messages.shuffle(rng);
            log.push("shuffled all messages");
        }
        11 if n >= 1 => {
            if rng.random_bool(0.5) {
                messages.truncate(1);
                log.push("schema only");
            } else {
                let schema = messages.remove(0);
                messages.push(schema);
                log.push("batches before the schema");
            }
        }
        12 => {
            let other = corpus.choose(rng).expect("corpus");
            if let Some(message) = other.messages.choose(rng) {
                let at = rng.random_range(0..=n);
                messages.insert(at, message.clone());
                log.push(format!("spliced a message of {} at {at}", other.label));
            }
        }
        13 if n >= 1 => {
            // The header of one message over the body of another: a plausible header that
            // describes buffers the body does not have.
            let (a, b) = (rng.random_range(0..n), rng.random_range(0..n));
            messages[a].data_body = messages[b].data_body.clone();
            log.push(format!("body of message {b} under the header of {a}"));
        }
        _ => {
            let i = rng.random_range(0..n.max(1));
            if let Some(message) = messages.get_mut(i) {
                message.data_body = Bytes::new();
                message.data_header = Bytes::new();
            }
            log.push(format!("emptied message {i}"));
        }
    }
}

/// The descriptor a put case sends, and the mode it asks for (`None` when it asks for nothing
/// the server should accept, or when a mutation may have changed the name).
fn put_descriptor(
    rng: &mut StdRng,
    log: &mut Log,
) -> (Option<FlightDescriptor>, Option<&'static str>) {
    let mode = *["create", "replace", "append"].choose(rng).expect("modes");
    match rng.random_range(0..10) {
        0 | 1 => {
            log.push("descriptor: PATH");
            (Some(path(NAME)), Some("create"))
        }
        2..=6 => {
            log.push(format!("descriptor: CMD {mode}"));
            (Some(common::cmd(NAME, mode)), Some(mode))
        }
        _ => {
            let (label, descriptor) = odd_descriptor(rng, mode);
            log.push(format!("descriptor: {label}"));
            (descriptor, None)
        }
    }
}

fn deep(depth: usize, open: &str, close: &str) -> String {
    format!("{}{}", open.repeat(depth), close.repeat(depth))
}

/// Descriptors a careless or hostile client could send.
fn odd_descriptor(rng: &mut StdRng, mode: &str) -> (String, Option<FlightDescriptor>) {
    let cmd = |body: Vec<u8>| Some(FlightDescriptor::new_cmd(body));
    let json = |v: serde_json::Value| v.to_string().into_bytes();
    let long = "x".repeat(*[256_usize, 257, 4096].choose(rng).expect("lengths"));
    let choices: Vec<(String, Option<FlightDescriptor>)> = vec![
        ("none".into(), None),
        (
            "JSON array command".into(),
            cmd(json(serde_json::json!([NAME, mode]))),
        ),
        (
            "unknown mode".into(),
            cmd(json(serde_json::json!({"name": NAME, "mode": "upsert"}))),
        ),
        (
            "no mode".into(),
            cmd(json(serde_json::json!({ "name": NAME }))),
        ),
        (
            "extra field".into(),
            cmd(json(
                serde_json::json!({"name": NAME, "mode": mode, "x": 1}),
            )),
        ),
        (
            "name with newline".into(),
            cmd(json(serde_json::json!({"name": "fu\nzz", "mode": mode}))),
        ),
        (
            "name NUL".into(),
            cmd(json(serde_json::json!({"name": "\u{0}", "mode": mode}))),
        ),
        (
            "empty name".into(),
            cmd(json(serde_json::json!({"name": "", "mode": mode}))),
        ),
        (
            format!("name of {} bytes", long.len()),
            cmd(json(serde_json::json!({"name": long, "mode": mode}))),
        ),
        (
            "name not a string".into(),
            cmd(json(serde_json::json!({"name": 7, "mode": mode}))),
        ),
        (
            "device 0".into(),
            cmd(json(
                serde_json::json!({"name": NAME, "mode": mode, "device": 0}),
            )),
        ),
        (
            "no such device".into(),
            cmd(json(
                serde_json::json!({"name": NAME, "mode": mode, "device": 7}),
            )),
        ),
        (
            "device beyond u32".into(),
            cmd(json(
                serde_json::json!({"name": NAME, "mode": mode, "device": 1_u64 << 40}),
            )),
        ),
        (
            "negative device".into(),
            cmd(json(
                serde_json::json!({"name": NAME, "mode": mode, "device": -1}),
            )),
        ),
        (
            "unknown device UUID".into(),
            cmd(json(
                serde_json::json!({"name": NAME, "mode": mode, "device": "GPU-00000000-0000-0000-0000-000000000000"}),
            )),
        ),
        (
            format!("device UUID of {} bytes", long.len()),
            cmd(json(
                serde_json::json!({"name": NAME, "mode": mode, "device": long}),
            )),
        ),
        (
            "device list".into(),
            cmd(json(
                serde_json::json!({"name": NAME, "mode": mode, "device": [0]}),
            )),
        ),
        (
            "deeply nested name".into(),
            cmd(format!(r#"{{"name": {}, "mode": "{mode}"}}"#, deep(5000, "[", "]")).into_bytes()),
        ),
        (
            "nested just under the limit".into(),
            cmd(format!(r#"{{"name": {}}}"#, deep(126, "[", "]")).into_bytes()),
        ),
        (
            "non-UTF-8 name".into(),
            cmd(b"{\"name\": \"fu\xffzz\", \"mode\": \"create\"}".to_vec()),
        ),
        (
            "lone surrogate escape".into(),
            cmd(br#"{"name": "\ud800", "mode": "create"}"#.to_vec()),
        ),
        (
            "trailing data".into(),
            cmd(format!("{{\"name\": \"{NAME}\", \"mode\": \"{mode}\"}}\n{{}}").into_bytes()),
        ),
        (
            "newlines around JSON".into(),
            cmd(format!("\n\n{{\n\"name\"\n:\n\"{NAME}\"\n}}\n\n").into_bytes()),
        ),
        ("empty command".into(), cmd(Vec::new())),
        ("null".into(), cmd(b"null".to_vec())),
        (
            "PATH of two".into(),
            Some(FlightDescriptor::new_path(vec![NAME.into(), "x".into()])),
        ),
        (
            "PATH of none".into(),
            Some(FlightDescriptor::new_path(vec![])),
        ),
        (
            "PATH with control char".into(),
            Some(FlightDescriptor::new_path(vec!["fu\u{7f}zz".into()])),
        ),
        (
            "UNKNOWN type".into(),
            Some(FlightDescriptor {
                r#type: DescriptorType::Unknown as i32,
                cmd: Bytes::new(),
                path: vec![NAME.into()],
            }),
        ),
        (
            "type 99".into(),
            Some(FlightDescriptor {
                r#type: 99,
                cmd: json(serde_json::json!({ "name": NAME })).into(),
                path: vec![NAME.into()],
            }),
        ),
    ];
    let chosen = rng.random_range(0..choices.len());
    choices
        .into_iter()
        .nth(chosen)
        .expect("a descriptor choice")
}

/// One protobuf-level mutation of an encoded message.
fn mutate_protobuf(rng: &mut StdRng, encoded: &mut [Vec<u8>], log: &mut Log) {
    if encoded.is_empty() {
        return log.push("protobuf: no message");
    }
    // The first message carries the descriptor: aim at it more often than chance would.
    let i = if rng.random_bool(0.4) {
        0
    } else {
        rng.random_range(0..encoded.len())
    };
    if i == 0 && rng.random_bool(0.3) {
        corrupt_utf8(&mut encoded[0], NAME.as_bytes(), rng, log);
    } else {
        mutate_bytes(rng, &mut encoded[i], log, &format!("protobuf {i}"));
    }
}

// ---------------------------------------------------------------------------------------------
// DoPut cases

#[derive(Debug)]
struct PutCase {
    id: String,
    /// The corpus stream (index) put unmutated under [`NAME`] first, if any.
    existing: Option<usize>,
    /// The mode the descriptor asks for, when it is a plain one.
    mode: Option<&'static str>,
    messages: Vec<Bytes>,
    log: Log,
}

impl PutCase {
    fn generate(id: String, rng: &mut StdRng, corpus: &[Stream]) -> Self {
        let mut log = Log::default();
        let chosen = rng.random_range(0..corpus.len());
        log.push(format!("stream {}", corpus[chosen].label));
        let existing = rng.random_bool(0.35).then(|| {
            let existing = if rng.random_bool(0.5) {
                chosen
            } else {
                rng.random_range(0..corpus.len())
            };
            log.push(format!("over existing {}", corpus[existing].label));
            existing
        });
        let mut messages = corpus[chosen].messages.clone();
        let ipc_mutations = *[0, 1, 1, 1, 2, 2, 3].choose(rng).expect("counts");
        for _ in 0..ipc_mutations {
            mutate_ipc(rng, &mut messages, corpus, &mut log);
        }
        let (descriptor, mode) = put_descriptor(rng, &mut log);
        if let Some(first) = messages.first_mut() {
            first.flight_descriptor = descriptor;
        } else if let Some(descriptor) = descriptor {
            messages.push(FlightData::new().with_descriptor(descriptor));
            log.push("descriptor alone");
        }
        let mut encoded: Vec<Vec<u8>> = messages.iter().map(Message::encode_to_vec).collect();
        if rng.random_bool(0.2) {
            mutate_protobuf(rng, &mut encoded, &mut log);
        }
        Self {
            id,
            existing,
            mode,
            messages: encoded.into_iter().map(Bytes::from).collect(),
            log,
        }
    }

    /// A corpus stream with one header byte changed, as `known` says.
    fn known(id: String, known: &KnownEdit, corpus: &[Stream]) -> Self {
        let stream = corpus
            .iter()
            .find(|s| s.label == known.stream)
            .unwrap_or_else(|| panic!("no corpus stream {}", known.stream));
        let mut case = Self::unmutated(id, stream);
        let mut message =
            FlightData::decode(case.messages[known.message].clone()).expect("corpus message");
        message.data_header = edit(&message.data_header, |b| {
            b[known.byte] = (known.change)(b[known.byte]);
        });
        case.messages[known.message] = message.encode_to_vec().into();
        case.log = Log(vec![format!("stream {}; {}", stream.label, known.what)]);
        case
    }

    /// A stream sent as is: the corpus entries must themselves pass.
    fn unmutated(id: String, stream: &Stream) -> Self {
        let mut messages = stream.messages.clone();
        let descriptor = common::cmd(NAME, "create");
        match messages.first_mut() {
            Some(first) => first.flight_descriptor = Some(descriptor),
            None => messages.push(FlightData::new().with_descriptor(descriptor)),
        }
        Self {
            id,
            existing: None,
            mode: Some("create"),
            messages: messages
                .iter()
                .map(|m| Bytes::from(m.encode_to_vec()))
                .collect(),
            log: Log(vec![format!("stream {} unmutated", stream.label)]),
        }
    }
}

/// A header edit that once broke the server, replayed by every run whatever its seed: the
/// random search may not come back to it for a long time.
struct KnownEdit {
    stream: &'static str,
    message: usize,
    byte: usize,
    change: fn(u8) -> u8,
    /// How the search logged it.
    what: &'static str,
}

const KNOWN_HEADER_EDITS: [KnownEdit; 2] = [
    // A list's offsets buffer declared 195 bytes long instead of 80: not a whole number of
    // offsets, which Arrow asserted (a panic) validating the list (seed 424242, case 189076).
    KnownEdit {
        stream: "lists",
        message: 2,
        byte: 304,
        change: |_| 0xc3,
        what: "header 2: byte 304 = 0xc3",
    },
    // A views buffer declared 306 bytes long, 19 views and 2 bytes: the same assertion (seed
    // 424242, case 249492).
    KnownEdit {
        stream: "views",
        message: 1,
        byte: 176,
        change: |b| b ^ 1 << 1,
        what: "header 1: flip bits 176.1",
    },
];

/// Everything the DoPut test shares across cases.
struct PutRig {
    channel: Channel,
    client: FlightClient,
    corpus: Vec<Stream>,
    baseline: u64,
}

impl PutRig {
    /// Puts `stream` unmutated under [`NAME`]; returns whether the dataset now exists (a type
    /// the server does not support may be refused, nothing else).
    async fn put_stream(&self, stream: &Stream) -> Checked<bool> {
        let mut messages = stream.messages.clone();
        let descriptor = path(NAME);
        match messages.first_mut() {
            Some(first) => first.flight_descriptor = Some(descriptor),
            None => messages.push(FlightData::new().with_descriptor(descriptor)),
        }
        let encoded = messages
            .iter()
            .map(|m| Bytes::from(m.encode_to_vec()))
            .collect();
        match timed("DoPut", raw_do_put(self.channel.clone(), encoded)).await? {
            Ok(_) => Ok(true),
            Err(status) if !stream.supported && status.code() == Code::InvalidArgument => Ok(false),
            Err(status) => Err(Failure::new(
                "valid put refused",
                format!("{} put first: {}", stream.label, status_summary(&status)),
            )),
        }
    }

    async fn run(
        &mut self,
        case: &PutCase,
        expect_ok: bool,
        outcomes: &mut BTreeMap<String, u64>,
    ) -> Checked<()> {
        let existing = match case.existing {
            Some(existing) if self.put_stream(&self.corpus[existing]).await? => Some(existing),
            _ => None,
        };
        let outcome = timed(
            "DoPut",
            raw_do_put(self.channel.clone(), case.messages.clone()),
        )
        .await?;
        let code = outcome.as_ref().err().map_or(Code::Ok, tonic::Status::code);
        *outcomes.entry(format!("{code:?}")).or_default() += 1;
        let summary = match &outcome {
            Ok(replies) => Some(put_summary(replies)?),
            Err(status) => {
                let allowed = matches!(
                    status.code(),
                    Code::InvalidArgument | Code::ResourceExhausted
                ) || (status.code() == Code::AlreadyExists && existing.is_some());
                if !allowed || expect_ok {
                    return Err(Failure::new(
                        status_class("DoPut", status),
                        status_summary(status),
                    ));
                }
                None
            }
        };
        let datasets = list_datasets(&mut self.client).await?;
        let names: BTreeSet<&str> = datasets.keys().map(String::as_str).collect();
        let mut reads = BTreeMap::new();
        for name in &names {
            reads.insert(*name, read_back(&mut self.client, name).await?);
        }
        match &summary {
            None => self.check_untouched(existing, &names, &reads)?,
            Some(summary) => self.check_committed(case, existing, summary, &names, &reads)?,
        }
        server_status(&self.channel).await?;
        for name in &names {
            drop_dataset(&self.channel, name).await?;
        }
        settle(&self.channel, self.baseline, 0).await
    }

    /// A failed put leaves the catalog as it was.
    fn check_untouched(
        &self,
        existing: Option<usize>,
        names: &BTreeSet<&str>,
        reads: &BTreeMap<&str, ReadBack>,
    ) -> Checked<()> {
        let expected: BTreeSet<&str> = existing.iter().map(|_| NAME).collect();
        if *names != expected {
            return Err(Failure::new(
                "failed put left a trace",
                format!("datasets {names:?}, expected {expected:?}"),
            ));
        }
        if let (Some(existing), Some(read)) = (existing, reads.get(NAME)) {
            same_data(&self.corpus[existing], read)
                .map_err(|e| Failure::new("failed put changed the dataset", e))?;
        }
        Ok(())
    }

    /// A committed put is visible, whole, and what its summary says.
    fn check_committed(
        &self,
        case: &PutCase,
        existing: Option<usize>,
        summary: &serde_json::Value,
        names: &BTreeSet<&str>,
        reads: &BTreeMap<&str, ReadBack>,
    ) -> Checked<()> {
        let fail =
            |what: &str| Failure::new(what, format!("summary {summary}, datasets {names:?}"));
        let name = summary["name"]
            .as_str()
            .ok_or_else(|| fail("put summary lacks a name"))?;
        let read = reads
            .get(name)
            .ok_or_else(|| fail("committed dataset not listed"))?;
        let total_rows = summary["total_rows"].as_u64();
        if total_rows != Some(read.rows() as u64) {
            return Err(Failure::new(
                "put summary disagrees with the data",
                format!("summary {summary}, {} rows read back", read.rows()),
            ));
        }
        let extra: Vec<&&str> = names
            .iter()
            .filter(|n| **n != name && !(existing.is_some() && **n == NAME))
            .collect();
        if !extra.is_empty() {
            return Err(fail("put created more than one dataset"));
        }
        let mode = summary["mode"].as_str();
        if name == NAME
            && let Some(existing) = existing
        {
            let before = self.corpus[existing].rows() as u64;
            let rows = summary["rows"].as_u64().unwrap_or(u64::MAX);
            match mode {
                Some("create") => return Err(fail("create replaced an existing dataset")),
                Some("append") if total_rows != before.checked_add(rows) => {
                    return Err(Failure::new(
                        "append lost or invented rows",
                        format!("{before} rows before, summary {summary}"),
                    ));
                }
                _ => {}
            }
        }
        if let (Some(asked), Some(got)) = (case.mode, mode)
            && asked != got
        {
            return Err(fail("put summary reports another mode"));
        }
        Ok(())
    }
}

/// The one PutResult a committed put returns, parsed.
fn put_summary(replies: &[Bytes]) -> Checked<serde_json::Value> {
    let [reply] = replies else {
        return Err(Failure::new(
            "DoPut reply malformed",
            format!("{} PutResults", replies.len()),
        ));
    };
    let result = PutResult::decode(reply.clone())
        .map_err(|e| Failure::new("DoPut reply malformed", e.to_string()))?;
    serde_json::from_slice(&result.app_metadata)
        .map_err(|e| Failure::new("DoPut reply malformed", format!("summary not JSON: {e}")))
}

/// Empties the catalog after a failed case so the next one starts clean, and takes what memory
/// stays held as the new baseline (the leak has been reported).
async fn recover(channel: &Channel, client: &mut FlightClient) -> Option<u64> {
    // By name first: listing is what may have failed.
    let _ = drop_dataset(channel, NAME).await;
    if let Ok(datasets) = list_datasets(client).await {
        for name in datasets.keys() {
            let _ = drop_dataset(channel, name).await;
        }
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    used_bytes(channel).await.ok()
}

#[test]
fn do_put_mutations() {
    let _serial = lock(&SERIAL);
    install_panic_hook();
    let config = Config::from_env("do_put_mutations");
    let served = Served::start(serve_options());
    let campaign = client_runtime().block_on(put_campaign(config, served.addr));
    campaign.finish("do_put_mutations");
    served.stop();
}

async fn put_campaign(config: Config, addr: SocketAddr) -> Campaign {
    let channel = open_channel(addr).await;
    let client = FlightClient::new(channel.clone());
    let corpus = put_corpus().await;
    let baseline = used_bytes(&channel).await.expect("status before any case");
    let mut rig = PutRig {
        channel,
        client,
        corpus,
        baseline,
    };
    let mut campaign = Campaign::new(config);
    let mut cases = Vec::new();
    if campaign.config.only.is_none() {
        for (i, stream) in rig.corpus.iter().enumerate() {
            cases.push((
                PutCase::unmutated(format!("corpus {i}"), stream),
                stream.supported,
            ));
        }
        for (i, known) in KNOWN_HEADER_EDITS.iter().enumerate() {
            cases.push((
                PutCase::known(format!("known {i}"), known, &rig.corpus),
                false,
            ));
        }
    }
    for index in campaign.config.indices() {
        let mut rng = campaign.config.rng(index);
        cases.push((
            PutCase::generate(format!("put case {index}"), &mut rng, &rig.corpus),
            false,
        ));
    }
    for (case, expect_ok) in cases {
        let mutations = case.log.to_string();
        campaign.begin(&case.id, &mutations);
        let panics = panic_count();
        let outcome = rig.run(&case, expect_ok, &mut campaign.outcomes).await;
        let failed = outcome.is_err() || panic_count() > panics;
        if !campaign.end(case.id.clone(), mutations, outcome, panics) {
            break;
        }
        if failed && let Some(baseline) = recover(&rig.channel, &mut rig.client).await {
            rig.baseline = baseline;
        }
    }
    campaign
}

// ---------------------------------------------------------------------------------------------
// Unary cases

/// Datasets the unary test reads, drops and recreates.
fn fixtures() -> Vec<(&'static str, Vec<RecordBatch>)> {
    vec![
        ("t", vec![int64_batch(250, 3, 0)]),
        ("s", vec![string_batch(120, 3)]),
        ("types", vec![all_types_batch(40)]),
        ("d", vec![dictionary_batch(70, 1)]),
        ("é/ü 2024", vec![int64_batch(10, 1, 5)]),
        // Nested, Null-type and zero-column data over several endpoints (64 rows each).
        ("l", vec![lists_batch(100, 2)]),
        ("n", vec![null_column_batch(150)]),
        ("z", vec![zero_column_batch(130)]),
    ]
}

/// Methods and their weights: the ones with request contents of their own get most cases.
const METHODS: [(&str, u32); 9] = [
    (raw::GET_FLIGHT_INFO, 3),
    (raw::GET_SCHEMA, 2),
    (raw::POLL_FLIGHT_INFO, 1),
    (raw::DO_GET, 5),
    (raw::DO_ACTION, 5),
    (raw::LIST_FLIGHTS, 2),
    (raw::LIST_ACTIONS, 1),
    (raw::HANDSHAKE, 1),
    (raw::DO_EXCHANGE, 1),
];

#[derive(Debug)]
struct UnaryCase {
    id: String,
    method: &'static str,
    requests: Vec<Bytes>,
    /// The rows an unmutated DoGet must return: a short stream is data lost without an error.
    expected_rows: Option<usize>,
    log: Log,
}

struct UnaryRig {
    channel: Channel,
    client: FlightClient,
    fixtures: Vec<(&'static str, Vec<RecordBatch>)>,
    corpus: Vec<Stream>,
    baseline: u64,
}

impl UnaryRig {
    fn fixture_name(&self, rng: &mut StdRng) -> &'static str {
        self.fixtures.choose(rng).expect("fixtures").0
    }

    /// A name a request could carry: a fixture, or one that is not there or not valid.
    fn some_name(&self, rng: &mut StdRng) -> String {
        if rng.random_bool(0.7) {
            return self.fixture_name(rng).to_owned();
        }
        let names = [
            "missing",
            "",
            "a\nb",
            "\u{0}",
            "t ",
            "T",
            "é/ü",
            "\u{202e}t",
        ];
        match rng.random_range(0..=names.len()) {
            i if i < names.len() => names[i].to_owned(),
            _ => "n".repeat(*[256_usize, 257, 70_000].choose(rng).expect("lengths")),
        }
    }

    async fn generate(&mut self, id: String, rng: &mut StdRng) -> Checked<UnaryCase> {
        let mut log = Log::default();
        let method = METHODS
            .choose_weighted(rng, |(_, weight)| *weight)
            .expect("methods")
            .0;
        log.push(method.rsplit('/').next().unwrap_or(method));
        let mut expected_rows = None;
        let mut request = match method {
            raw::GET_FLIGHT_INFO | raw::GET_SCHEMA | raw::POLL_FLIGHT_INFO => {
                self.descriptor(rng, &mut log).encode_to_vec()
            }
            raw::DO_GET => {
                let (ticket, rows) = self.ticket(rng, &mut log).await?;
                expected_rows = rows;
                Ticket::new(ticket).encode_to_vec()
            }
            raw::DO_ACTION => self.action(rng, &mut log).encode_to_vec(),
            raw::LIST_FLIGHTS => {
                let expression: Vec<u8> = match rng.random_range(0..5) {
                    0 => Vec::new(),
                    1 => self.fixture_name(rng).as_bytes().to_vec(),
                    2 => b"\xff\xfe".to_vec(),
                    3 => "é".as_bytes()[..1].to_vec(),
                    _ => (0..rng.random_range(1..32)).map(|_| rng.random()).collect(),
                };
                log.push(format!(
                    "criteria {:?}",
                    String::from_utf8_lossy(&expression)
                ));
                Criteria {
                    expression: expression.into(),
                }
                .encode_to_vec()
            }
            raw::HANDSHAKE => HandshakeRequest {
                protocol_version: rng.random(),
                payload: Bytes::from_static(b"user:password"),
            }
            .encode_to_vec(),
            raw::DO_EXCHANGE => {
                let stream = self.corpus.choose(rng).expect("corpus");
                let mut message = stream.messages.first().cloned().unwrap_or_default();
                message.flight_descriptor = Some(path(self.fixture_name(rng)));
                message.encode_to_vec()
            }
            _ => Vec::new(), // ListActions takes Empty
        };
        // Mostly none: undecodable requests stop in tonic, before the server's own parsing.
        let protobuf_mutations = *[0, 0, 0, 0, 1, 2].choose(rng).expect("counts");
        if protobuf_mutations > 0 {
            expected_rows = None;
        }
        for _ in 0..protobuf_mutations {
            if rng.random_bool(0.25) {
                let needle = ["t", "s", "types", "drop", "status", "é"]
                    .choose(rng)
                    .expect("needles");
                corrupt_utf8(&mut request, needle.as_bytes(), rng, &mut log);
            } else {
                mutate_bytes(rng, &mut request, &mut log, "protobuf");
            }
        }
        let mut requests = vec![Bytes::from(request)];
        if rng.random_bool(0.03) {
            // A unary method given two messages, or none.
            if rng.random_bool(0.5) {
                requests.push(requests[0].clone());
                log.push("request sent twice");
            } else {
                requests.clear();
                log.push("no request message");
            }
        }
        Ok(UnaryCase {
            id,
            method,
            requests,
            expected_rows,
            log,
        })
    }

    fn descriptor(&self, rng: &mut StdRng, log: &mut Log) -> FlightDescriptor {
        match rng.random_range(0..7) {
            0..=2 => {
                let name = self.some_name(rng);
                log.push(format!("PATH {:?}", abbreviate(&name)));
                path(&name)
            }
            3 => {
                let name = self.fixture_name(rng);
                log.push(format!("CMD naming {name}"));
                common::cmd(name, "create")
            }
            4 => {
                let (name, codec) = (self.some_name(rng), read_codec(rng));
                log.push(format!(
                    "read CMD {:?} compression {codec}",
                    abbreviate(&name)
                ));
                FlightDescriptor::new_cmd(format!(
                    r#"{{"name": {}, "compression": {codec}}}"#,
                    serde_json::Value::from(name)
                ))
            }
            _ => {
                let (label, descriptor) = odd_descriptor(rng, "create");
                log.push(format!("descriptor: {label}"));
                descriptor.unwrap_or_default()
            }
        }
    }

    /// A server-issued ticket, a bare name or a forged ticket, perhaps mutated.
    /// The ticket, and the rows it must return if it was left intact.
    async fn ticket(
        &mut self,
        rng: &mut StdRng,
        log: &mut Log,
    ) -> Checked<(Vec<u8>, Option<usize>)> {
        let mut expected_rows = None;
        let mut ticket = match rng.random_range(0..10) {
            0..=4 => {
                let name = self.fixture_name(rng);
                // Tickets for plain replies, and for LZ4 or ZSTD compressed ones.
                let (descriptor, how) = match rng.random_range(0..3) {
                    0 => (path(name), "plain"),
                    1 => (compressed_read(name, "lz4"), "lz4"),
                    _ => (compressed_read(name, "zstd"), "zstd"),
                };
                let info = timed("GetFlightInfo", self.client.get_flight_info(descriptor))
                    .await?
                    .map_err(|e| Failure::new("fixture unreadable", e.to_string()))?;
                let endpoint = info.endpoint.choose(rng).expect("an endpoint");
                log.push(format!("issued {how} ticket of {name}"));
                let ticket = endpoint.ticket.clone().expect("a ticket").ticket.to_vec();
                expected_rows = issued_rows(&ticket);
                ticket
            }
            5 | 6 => {
                let name = self.some_name(rng);
                log.push(format!("bare name {:?}", abbreviate(&name)));
                expected_rows = self
                    .fixtures
                    .iter()
                    .find(|(fixture, _)| *fixture == name)
                    .map(|(_, batches)| batches.iter().map(RecordBatch::num_rows).sum());
                name.into_bytes()
            }
            _ => {
                let name = self.fixture_name(rng);
                let forged = forged_ticket(rng, name);
                log.push(format!(
                    "forged ticket {:?}",
                    abbreviate(&String::from_utf8_lossy(&forged))
                ));
                forged
            }
        };
        if rng.random_bool(0.5) {
            expected_rows = None;
            if rng.random_bool(0.5) {
                rewrite_number(rng, &mut ticket, log);
            } else {
                mutate_bytes(rng, &mut ticket, log, "ticket");
            }
        }
        Ok((ticket, expected_rows))
    }

    fn action(&self, rng: &mut StdRng, log: &mut Log) -> Action {
        let kind = *[
            "drop",
            "drop",
            "status",
            "ipc-export",
            "ipc-export",
            "ipc-release",
            "move",
            "move",
            "copy",
            "",
            "DROP",
            "drop ",
            "list",
        ]
        .choose(rng)
        .expect("actions");
        let name = self.some_name(rng);
        let column = ["c0", "c1", "s", "nope", ""].choose(rng).expect("columns");
        let lease_seconds = [0_u64, 1, 86_400, 86_401, u64::MAX].choose(rng);
        let move_device = *[1_i64, -1, 1 << 40].choose(rng).expect("devices");
        let long_uuid = "GPU-".repeat(2000);
        let move_uuid = *["GPU-x", "", long_uuid.as_str()]
            .choose(rng)
            .expect("uuids");
        let lease = *["", "x", "0123456789abcdef", name.as_str()]
            .choose(rng)
            .expect("leases");
        let bodies: Vec<(String, Vec<u8>)> = vec![
            (
                "name".into(),
                json_body(serde_json::json!({ "name": name })),
            ),
            (
                "name with extra".into(),
                json_body(serde_json::json!({"name": name, "extra": true})),
            ),
            ("empty object".into(), b"{}".to_vec()),
            ("empty".into(), Vec::new()),
            (
                "JSON array".into(),
                json_body(serde_json::json!([name, "create"])),
            ),
            (
                "name array".into(),
                json_body(serde_json::json!({ "name": [name] })),
            ),
            ("bare name".into(), name.clone().into_bytes()),
            ("null".into(), b"null".to_vec()),
            (
                "deep nesting".into(),
                format!(
                    r#"{{"name": {}}}"#,
                    deep(
                        *[127_usize, 129, 100_000].choose(rng).expect("depths"),
                        "[",
                        "]"
                    )
                )
                .into_bytes(),
            ),
            (
                "deep objects".into(),
                deep(200, r#"{"a":"#, "}")
                    .replace(r#":}"#, ":1}")
                    .into_bytes(),
            ),
            (
                "newlines".into(),
                format!("\n{{\n\"name\"\n:\n{}\n}}\n\n", serde_json::json!(name)).into_bytes(),
            ),
            (
                "non-UTF-8".into(),
                b"{\"name\": \"t\xff\xfe\", \"lease\": \"\xc3\"}".to_vec(),
            ),
            (
                "move to device 0".into(),
                json_body(serde_json::json!({"name": name, "device": 0})),
            ),
            (
                "move to a device out of range".into(),
                json_body(serde_json::json!({"name": name, "device": move_device})),
            ),
            (
                "move to a UUID".into(),
                json_body(serde_json::json!({"name": name, "device": move_uuid})),
            ),
            (
                "export columns".into(),
                json_body(serde_json::json!({"name": name, "columns": [column, column]})),
            ),
            (
                "export lease".into(),
                json_body(serde_json::json!({
                    "name": name,
                    "lease_seconds": lease_seconds,
                    "lease": "0123456789abcdef",
                })),
            ),
            (
                "negative lease".into(),
                br#"{"name": "t", "lease_seconds": -1}"#.to_vec(),
            ),
            (
                "float lease".into(),
                br#"{"name": "t", "lease_seconds": 1e300}"#.to_vec(),
            ),
            (
                "release".into(),
                json_body(serde_json::json!({
                    "lease": lease
                })),
            ),
            ("release number".into(), br#"{"lease": 5}"#.to_vec()),
            (
                "export to a device".into(),
                json_body(serde_json::json!({
                    "name": name,
                    "version": *[1_i64, 2, 3, -1].choose(rng).expect("versions"),
                    "device": move_device,
                    "copy": rng.random_bool(0.5),
                })),
            ),
            (
                "export to a UUID".into(),
                json_body(serde_json::json!({
                    "name": name,
                    "version": 2,
                    "device": move_uuid,
                    "copy": true,
                    "columns": [column],
                })),
            ),
            (
                "copy as".into(),
                json_body(
                    serde_json::json!({"name": name, "as": self.some_name(rng), "device": move_device}),
                ),
            ),
            (
                "export copy without a device".into(),
                json_body(serde_json::json!({"name": name, "version": 2, "copy": true})),
            ),
        ];
        let chosen = rng.random_range(0..bodies.len());
        let (label, mut body) = bodies.into_iter().nth(chosen).expect("a body");
        log.push(format!("action {kind:?} body {label}"));
        if rng.random_bool(0.3) {
            mutate_bytes(rng, &mut body, log, "body");
        }
        Action::new(kind, body)
    }

    async fn run(&mut self, case: &UnaryCase, outcomes: &mut BTreeMap<String, u64>) -> Checked<()> {
        let outcome = timed(
            case.method,
            raw_call(self.channel.clone(), case.method, case.requests.clone()),
        )
        .await?;
        let method = case.method.rsplit('/').next().unwrap_or(case.method);
        let code = outcome.as_ref().err().map_or(Code::Ok, tonic::Status::code);
        *outcomes.entry(format!("{method} {code:?}")).or_default() += 1;
        match outcome {
            Ok(replies) => {
                let rows = check_replies(case.method, &replies).await?;
                if let Some(expected) = case.expected_rows
                    && rows != expected
                {
                    return Err(Failure::new(
                        "DoGet returned the wrong number of rows",
                        format!("{rows} rows, the ticket asks for {expected}"),
                    ));
                }
            }
            Err(status) => {
                let allowed = matches!(
                    status.code(),
                    Code::InvalidArgument
                        | Code::NotFound
                        | Code::Unimplemented
                        | Code::FailedPrecondition
                        | Code::AlreadyExists
                );
                if !allowed {
                    return Err(Failure::new(
                        status_class(method, &status),
                        status_summary(&status),
                    ));
                }
            }
        }
        self.restore_fixtures().await?;
        settle(&self.channel, self.baseline, self.fixtures.len() as u64).await
    }

    /// Puts back fixtures a `drop` removed; fails if anything else changed in the catalog.
    async fn restore_fixtures(&mut self) -> Checked<()> {
        let datasets = list_datasets(&mut self.client).await?;
        let expected: BTreeSet<&str> = self.fixtures.iter().map(|(n, _)| *n).collect();
        let unexpected: Vec<&String> = datasets
            .keys()
            .filter(|n| !expected.contains(n.as_str()))
            .collect();
        if !unexpected.is_empty() {
            return Err(Failure::new(
                "a read-only call created a dataset",
                format!("{unexpected:?}"),
            ));
        }
        for (name, batches) in &self.fixtures {
            if !datasets.contains_key(*name) {
                timed(
                    "DoPut",
                    common::put(
                        &mut self.client,
                        common::cmd(name, "replace"),
                        batches.clone(),
                    ),
                )
                .await?
                .map_err(|e| Failure::new("fixture cannot be restored", e.to_string()))?;
            }
        }
        Ok(())
    }

    /// Reads every fixture back and compares it with what was put.
    async fn check_fixtures(&mut self) -> Checked<()> {
        for (name, batches) in self.fixtures.clone() {
            let read = read_back(&mut self.client, name).await?;
            let sent = Stream {
                label: name,
                schema: batches[0].schema(),
                batches,
                messages: Vec::new(),
                supported: true,
            };
            same_data(&sent, &read).map_err(|e| {
                Failure::new("fixture changed by read-only calls", format!("{name}: {e}"))
            })?;
        }
        Ok(())
    }
}

fn json_body(value: serde_json::Value) -> Vec<u8> {
    value.to_string().into_bytes()
}

fn abbreviate(text: &str) -> String {
    if text.len() <= 40 {
        text.to_owned()
    } else {
        format!(
            "{}... ({} bytes)",
            text.chars().take(20).collect::<String>(),
            text.len()
        )
    }
}

/// A ticket in the server's format with fields a server never issues.
fn forged_ticket(rng: &mut StdRng, name: &str) -> Vec<u8> {
    let numbers = [
        "0",
        "1",
        "63",
        "64",
        "250",
        "251",
        "18446744073709551615",
        "18446744073709551616",
        "-1",
        "1e3",
        "9223372036854775807",
    ];
    let mut number = || *numbers.choose(rng).expect("numbers");
    let (version, tag, start, end) = (number(), number(), number(), number());
    let body = match rng.random_range(0..7) {
        0 => format!(r#"{{"name":"{name}","version":{version},"start":{start},"end":{end}}}"#),
        6 => format!(
            r#"{{"name":"{name}","version":{version},"tag":{tag},"start":{start},"end":{end}}}"#
        ),
        1 => format!(r#"{{"name":"{name}","version":{version},"start":{start}}}"#),
        2 => {
            format!(r#"{{"name":"{name}","version":{version},"start":{start},"end":{end},"x":0}}"#)
        }
        3 => format!(r#"{{"name":"","version":1,"start":{start},"end":{end}}}"#),
        4 => format!(r#"["{name}",{version},{start},{end}]"#),
        _ => String::new(),
    };
    let format_line = *["1", "0", "2", "", "1\r", "01"]
        .choose(rng)
        .expect("versions");
    format!("\0gpu-flight-ticket/{format_line}\n{body}").into_bytes()
}

/// The row range of a server-issued ticket (the JSON after the format line), as a count.
/// A GetFlightInfo descriptor whose tickets read `name` compressed with `codec`.
fn compressed_read(name: &str, codec: &str) -> FlightDescriptor {
    FlightDescriptor::new_cmd(serde_json::json!({"name": name, "compression": codec}).to_string())
}

/// A `compression` value for a read command, as JSON: a codec, or one the server must refuse.
fn read_codec(rng: &mut StdRng) -> &'static str {
    [
        "\"lz4\"", "\"zstd\"", "null", "\"gzip\"", "\"LZ4\"", "1", "[]", "\"\"",
    ]
    .choose(rng)
    .copied()
    .unwrap_or("null")
}

fn issued_rows(ticket: &[u8]) -> Option<usize> {
    let newline = ticket.iter().position(|&b| b == b'\n')?;
    let body: serde_json::Value = serde_json::from_slice(&ticket[newline + 1..]).ok()?;
    let (start, end) = (body["start"].as_u64()?, body["end"].as_u64()?);
    usize::try_from(end.checked_sub(start)?).ok()
}

/// Replaces one run of digits with an edge value (row ranges and versions live in those).
fn rewrite_number(rng: &mut StdRng, bytes: &mut Vec<u8>, log: &mut Log) {
    let mut runs = Vec::new();
    let mut start = None;
    for (i, b) in bytes.iter().enumerate() {
        match (b.is_ascii_digit(), start) {
            (true, None) => start = Some(i),
            (false, Some(s)) => {
                runs.push(s..i);
                start = None;
            }
            _ => {}
        }
    }
    if let Some(s) = start {
        runs.push(s..bytes.len());
    }
    let Some(run) = runs.choose(rng).cloned() else {
        return log.push("ticket: no number to rewrite");
    };
    let value = *[
        "0",
        "1",
        "18446744073709551615",
        "18446744073709551616",
        "9223372036854775808",
        "4294967296",
        "100000000000",
        "65",
    ]
    .choose(rng)
    .expect("values");
    let old = String::from_utf8_lossy(&bytes[run.clone()]).into_owned();
    bytes.splice(run, value.bytes());
    log.push(format!("ticket: number {old} -> {value}"));
}

/// What an OK reply holds must decode as the method's reply type; returns the rows of a DoGet.
async fn check_replies(method: &str, replies: &[Bytes]) -> Checked<usize> {
    let mut rows = 0;
    let fail = |e: String| Failure::new(format!("undecodable {method} reply"), e);
    match method {
        raw::GET_FLIGHT_INFO | raw::LIST_FLIGHTS => {
            for reply in replies {
                let info = FlightInfo::decode(reply.clone()).map_err(|e| fail(e.to_string()))?;
                info.try_decode_schema().map_err(|e| fail(e.to_string()))?;
            }
        }
        raw::POLL_FLIGHT_INFO => {
            for reply in replies {
                PollInfo::decode(reply.clone()).map_err(|e| fail(e.to_string()))?;
            }
        }
        raw::GET_SCHEMA => {
            for reply in replies {
                let result =
                    SchemaResult::decode(reply.clone()).map_err(|e| fail(e.to_string()))?;
                Schema::try_from(&result).map_err(|e| fail(e.to_string()))?;
            }
        }
        raw::DO_GET => {
            let data = replies
                .iter()
                .map(|r| FlightData::decode(r.clone()))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| fail(e.to_string()))?;
            let stream = FlightRecordBatchStream::new_from_flight_data(futures::stream::iter(
                data.into_iter().map(Ok),
            ));
            let batches: Vec<RecordBatch> = stream
                .try_collect()
                .await
                .map_err(|e| fail(e.to_string()))?;
            rows = batches.iter().map(RecordBatch::num_rows).sum();
        }
        raw::DO_ACTION => {
            for reply in replies {
                let result =
                    arrow_flight::Result::decode(reply.clone()).map_err(|e| fail(e.to_string()))?;
                serde_json::from_slice::<serde_json::Value>(&result.body)
                    .map_err(|e| fail(format!("result is not JSON: {e}")))?;
            }
        }
        raw::LIST_ACTIONS => {
            for reply in replies {
                ActionType::decode(reply.clone()).map_err(|e| fail(e.to_string()))?;
            }
        }
        raw::HANDSHAKE => {
            for reply in replies {
                let response =
                    HandshakeResponse::decode(reply.clone()).map_err(|e| fail(e.to_string()))?;
                if response.payload.is_empty() {
                    return Err(fail("a Handshake reply without a token".into()));
                }
            }
        }
        _ => {
            if !replies.is_empty() {
                return Err(fail(format!(
                    "{} replies to an unsupported method",
                    replies.len()
                )));
            }
        }
    }
    Ok(rows)
}

#[test]
fn unary_mutations() {
    let _serial = lock(&SERIAL);
    install_panic_hook();
    let config = Config::from_env("unary_mutations");
    let served = Served::start(serve_options());
    let campaign = client_runtime().block_on(unary_campaign(config, served.addr));
    campaign.finish("unary_mutations");
    served.stop();
}

async fn unary_campaign(config: Config, addr: SocketAddr) -> Campaign {
    let channel = open_channel(addr).await;
    let mut client = FlightClient::new(channel.clone());
    let fixtures = fixtures();
    for (name, batches) in &fixtures {
        common::put(&mut client, path(name), batches.clone())
            .await
            .unwrap_or_else(|e| panic!("fixture {name}: {e}"));
    }
    let baseline = used_bytes(&channel)
        .await
        .expect("status after the fixtures");
    let mut rig = UnaryRig {
        channel,
        client,
        fixtures,
        corpus: put_corpus().await,
        baseline,
    };
    let mut campaign = Campaign::new(config);
    for index in campaign.config.indices() {
        let id = format!("unary case {index}");
        let mut rng = campaign.config.rng(index);
        let panics = panic_count();
        let case = match rig.generate(id.clone(), &mut rng).await {
            Ok(case) => case,
            Err(failure) => {
                if !campaign.end(id, "(generating)".into(), Err(failure), panics) {
                    break;
                }
                continue;
            }
        };
        let mutations = case.log.to_string();
        campaign.begin(&case.id, &mutations);
        let outcome = rig.run(&case, &mut campaign.outcomes).await;
        let failed = outcome.is_err() || panic_count() > panics;
        if !campaign.end(case.id.clone(), mutations, outcome, panics) {
            break;
        }
        if failed {
            let _ = rig.restore_fixtures().await;
            if let Ok(used) = used_bytes(&rig.channel).await {
                rig.baseline = used;
            }
        }
    }
    // After a failure without KEEP_GOING the fixtures were not restored; after a hang the
    // server cannot be trusted.
    let fatal = campaign.failures.iter().any(|f| f.failure.fatal);
    if campaign.failures.is_empty() || (campaign.config.keep_going && !fatal) {
        campaign.begin("final fixture check", "none");
        let panics = panic_count();
        let outcome = rig.check_fixtures().await;
        campaign.end("final fixture check".into(), "none".into(), outcome, panics);
    }
    campaign
}
