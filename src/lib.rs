//! gpu-flight: an Arrow Flight server that keeps datasets in GPU memory (or host memory).
//!
//! # Layout
//!
//! Layers point one way, top to bottom; `tests/module_graph.rs` fails on a file that names a
//! layer above its own, and on any import cycle.
//!
//! - `main.rs` parses the flags, sets up tracing and calls [`launch::serve`], which checks the
//!   configuration ([`config`]), binds, opens the store and runs the [`server`] until its
//!   shutdown future completes.
//! - [`server`]: connections (TCP, Unix sockets, TLS, limits, idle timeouts), then the tower
//!   layers every call passes (accounting, authentication and roles, request limits, panic
//!   containment) in front of arrow-flight's generated `FlightServiceServer`.
//! - [`flight`]: the protocol. Thin handlers parse a descriptor, ticket or action document,
//!   call the store and encode the answer; `flight::doget` frames `DoGet` replies itself
//!   (docs/performance-notes.md has the A/B that keeps it). [`consumer`] is the Rust side of
//!   `ipc-export`.
//! - [`metrics`] counts calls and reads the store at each scrape; [`error`] is the one place a
//!   gRPC code is chosen; [`auth`] says who a caller is and which role each method and action
//!   needs.
//! - [`store`]: a facade over components built in one order (tiers and budgets, the compactor,
//!   loads, persistence, the catalog, puts, moves, leases and export).
//! - [`backend`]: where column bytes live, host memory or CUDA devices; all `unsafe` is in
//!   `backend/cuda/ffi.rs`.
//! - [`arrays`] (what Arrow arrays cost, and copies of them) and `task` serve every layer.
//!
//! A put: `server` bounds and charges each message → `flight::put` decodes batches →
//! `store` uploads them as partitions into a pending put and commits it atomically. A get:
//! `GetFlightInfo` issues tickets for a version → `DoGet` reads its partitions (device to host
//! where needed) and frames them as Arrow IPC. An export: `ipc-export` leases a version and
//! answers each column's CUDA IPC handle with offsets.
//!
//! # Words
//!
//! One word per idea, in code, logs and documents:
//!
//! - **device**: a memory space the backend places data in (a GPU, or a pretend device of host
//!   memory); naming one the server lacks is `UnknownDevice`.
//! - **dataset**: a name's committed, immutable version: a schema and its partitions.
//! - **version**: a number that grows with every commit, and a random tag; a ticket names both.
//! - **partition**: rows a backend holds as one unit; the store's handle on one, shared by the
//!   versions that include it, is a *stored partition*, whose slot says which tier it is in.
//! - **tier**: where a partition's rows are now: a device, host memory, or only on disk.
//! - **spill**, **restore**, **load**, **evict**: device to host tier; host tier back to a
//!   device; disk back into memory; letting a partition the data directory holds go back to
//!   disk, without a copy.
//! - **compact**: join a dataset's partitions on one device into one contiguous partition (at
//!   commit, on moves and loads, and in the background for appended partitions). **merge** is
//!   only for segment files on disk and for dictionaries.
//! - **budget**, **reservation**, **charge**: the bytes a device or the host tier may hold; a
//!   claim on them that is returned on drop; what a batch costs.
//! - **put**, **commit**, **mode**: a `DoPut` in progress; making it visible at once; create,
//!   replace or append.
//! - **move**, **copy**: a dataset onto another device; onto a new name.
//! - **export**, **lease**, **replica**: `ipc-export` of a version's columns; the consumer's
//!   hold that keeps them mapped; a copy made on the consumer's GPU for one lease.
//! - **segment**, **manifest**, **damaged**: one Arrow IPC file of rows under `--data-dir`; the
//!   catalog on disk; a dataset whose files failed the checks at start.
//! - **principal**, **role**: who a call comes from; what it may do (read, write, admin).

pub mod arrays;
pub mod auth;
pub mod backend;
pub mod config;
pub mod consumer;
pub mod error;
pub mod flight;
pub mod launch;
pub mod metrics;
pub mod server;
pub mod store;
mod task;
