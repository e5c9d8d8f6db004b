//! gpu-flight: an Arrow Flight server that keeps datasets in GPU memory (or host memory).
//!
//! Layers point one way: [`flight`] (the protocol) → [`store`] (catalog, puts, leases, memory
//! budget) → [`backend`] (host or CUDA memory). [`server`] wires them to gRPC with TLS and
//! connection limits; [`auth`] says who a caller is and what their role allows (the server's
//! layers ask it before any handler runs); [`metrics`] counts calls and reads the store's
//! state for Prometheus; [`consumer`] is the Rust side of `ipc-export` for processes on the
//! server's node.

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
