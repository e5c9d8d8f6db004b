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
//! - protobuf: the encoded FlightData bit-flipped, truncated, padded, with invalid UTF-8 in a
//!   descriptor string, or valid with its fields rearranged (reversed, a short body before the
//!   real one, unknown fields), which the server's own reader of FlightData must read as prost
//!   does.
//!
//! `do_put_mutations_into_body_blocks` runs the same cases against a host backend that hands out
//! blocks for large message bodies, as the CUDA backend does from its pinned host memory, so that
//! the server receives those bodies straight into a block and decodes them there (`blocks`).
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
//! - once datasets are dropped, `used_bytes` returns to its baseline and `status` answers, and
//!   every body block and pinned copy has been freed.
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
//!
//! Layout: `campaign` (configuration, failures, the report, panics), `server` (the server under
//! test), `blocks` (the backend with body blocks), `checks` (what is checked after each case),
//! `corpus` (the valid streams), `mutate` and `descriptors` (what is done to them), then the
//! cases: `put` and `unary` (with `unary::requests`, what a unary case sends).

#[path = "../common/mod.rs"]
mod common;

mod blocks;
mod campaign;
mod checks;
mod corpus;
mod descriptors;
mod mutate;
mod put;
mod server;
mod unary;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use gpu_flight::backend::{Backend, HostBackend};

use campaign::{Campaign, Config, SERIAL, install_panic_hook, lock};
use server::{Served, client_runtime, serve_options};

#[test]
fn do_put_mutations() {
    run(
        "do_put_mutations",
        Arc::new(HostBackend::new()),
        put::campaign,
    );
}

/// The same cases against a backend that receives large bodies into blocks of its own and
/// decodes them there (`blocks`), as the CUDA backend does into pinned memory. Putting the
/// corpus unmutated (skipped when one case is replayed) takes blocks, and runs out of them.
#[test]
fn do_put_mutations_into_body_blocks() {
    let before = (blocks::blocks_handed_out(), blocks::refused());
    run(
        "do_put_mutations_into_body_blocks",
        Arc::new(blocks::BlockHost::new()),
        put::campaign,
    );
    if !campaign::one_case_only() {
        assert!(
            blocks::blocks_handed_out() > before.0,
            "no body was received into a block"
        );
        assert!(
            blocks::refused() > before.1,
            "blocks never ran out, so their fallback was not taken"
        );
    }
}

#[test]
fn unary_mutations() {
    run(
        "unary_mutations",
        Arc::new(HostBackend::new()),
        unary::campaign,
    );
}

/// One test: its cases, on a client runtime, against a server of their own, then the report.
fn run<F: Future<Output = Campaign>>(
    test: &str,
    backend: Arc<dyn Backend>,
    campaign: fn(Config, SocketAddr) -> F,
) {
    let _serial = lock(&SERIAL);
    install_panic_hook();
    let config = Config::from_env(test);
    let served = Served::start(backend, serve_options());
    let campaign = client_runtime().block_on(campaign(config, served.addr));
    campaign.finish(test);
    served.stop();
}
