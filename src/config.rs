//! Command-line flags, each also readable from a `GPU_FLIGHT_*` environment variable.

use std::net::SocketAddr;
use std::time::Duration;

use bytesize::ByteSize;
use clap::{Args, Parser, Subcommand};

use crate::backend::BackendChoice;
use crate::flight::FlightOptions;
use crate::server::{ConnectionLimits, ServeOptions};
use crate::store::StoreOptions;

/// gpu-flight: an Arrow Flight server that keeps datasets in GPU memory (or host memory where
/// there is no GPU).
#[derive(Debug, Parser)]
#[command(name = "gpu-flight", version, args_conflicts_with_subcommands = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    /// Flags for `serve`, which is also what a bare `gpu-flight` does.
    #[command(flatten)]
    pub serve: ServeArgs,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve Arrow Flight (the default).
    Serve(ServeArgs),
}

impl Cli {
    /// The serve flags, whichever way they were given.
    pub fn into_serve_args(self) -> ServeArgs {
        match self.command {
            Some(Command::Serve(args)) => args,
            None => self.serve,
        }
    }
}

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Address to listen on; port 0 picks a free port (the chosen address is printed).
    #[arg(long, env = "GPU_FLIGHT_LISTEN", default_value = "127.0.0.1:8815")]
    pub listen: SocketAddr,

    /// Where datasets live: `auto` picks cuda where a driver and a device exist, else host.
    #[arg(long, env = "GPU_FLIGHT_BACKEND", value_enum, default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,

    /// The GPU to keep datasets on (CUDA device ordinal).
    #[arg(long, env = "GPU_FLIGHT_DEVICE", default_value_t = 0)]
    pub device: u32,

    /// Most bytes of datasets each device may hold, e.g. `8GiB` or `1000000`; default: the
    /// device's capacity. A put beyond it fails with RESOURCE_EXHAUSTED.
    #[arg(long, env = "GPU_FLIGHT_MEMORY_LIMIT")]
    pub memory_limit: Option<ByteSize>,

    /// Rows per endpoint in GetFlightInfo; clients read endpoints in parallel.
    #[arg(long, env = "GPU_FLIGHT_ROWS_PER_ENDPOINT", default_value_t = 1 << 20,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub rows_per_endpoint: u64,

    /// Largest FlightData message DoGet sends (keep it under clients' 4 MiB gRPC default).
    #[arg(long, env = "GPU_FLIGHT_MAX_MESSAGE_BYTES", default_value = "2MiB")]
    pub max_message_bytes: ByteSize,

    /// Seconds running streams get to finish after SIGINT/SIGTERM before the server exits.
    #[arg(long, env = "GPU_FLIGHT_SHUTDOWN_GRACE", default_value_t = 30)]
    pub shutdown_grace_seconds: u64,

    /// Largest DoPut message (one record batch, as pyarrow sends it); larger ones are refused
    /// with RESOURCE_EXHAUSTED before they are received.
    #[arg(long, env = "GPU_FLIGHT_MAX_PUT_MESSAGE_BYTES", default_value = "1GiB")]
    pub max_put_message_bytes: ByteSize,

    /// Largest message of any other request (tickets, descriptors, action bodies); larger
    /// ones are refused with INVALID_ARGUMENT.
    #[arg(long, env = "GPU_FLIGHT_MAX_REQUEST_BYTES", default_value = "64KiB")]
    pub max_request_bytes: ByteSize,

    /// Connections open at once; more are closed as soon as they are accepted.
    #[arg(long, env = "GPU_FLIGHT_MAX_CONNECTIONS", default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub max_connections: u64,

    /// Streams (calls) a client may have open at once on one connection.
    #[arg(long, env = "GPU_FLIGHT_MAX_STREAMS_PER_CONNECTION", default_value_t = 100,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_streams_per_connection: u32,

    /// Seconds a new connection has to start HTTP/2 before it is closed.
    #[arg(long, env = "GPU_FLIGHT_HANDSHAKE_TIMEOUT_SECONDS", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub handshake_timeout_seconds: u64,

    /// Seconds a connection may stay open with no call in progress before it is closed
    /// (clients reconnect by themselves).
    #[arg(long, env = "GPU_FLIGHT_IDLE_TIMEOUT_SECONDS", default_value_t = 300,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub idle_timeout_seconds: u64,

    /// Seconds between HTTP/2 pings on a connection.
    #[arg(long, env = "GPU_FLIGHT_KEEPALIVE_INTERVAL_SECONDS", default_value_t = 20,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub keepalive_interval_seconds: u64,

    /// Seconds a ping may go unanswered before the connection is dropped: its puts are
    /// abandoned (nothing is committed) and its reads stopped.
    #[arg(long, env = "GPU_FLIGHT_KEEPALIVE_TIMEOUT_SECONDS", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub keepalive_timeout_seconds: u64,
}

impl ServeArgs {
    pub fn store_options(&self) -> StoreOptions {
        StoreOptions {
            memory_limit: self.memory_limit.map(|b| b.as_u64()),
        }
    }

    pub fn flight_options(&self) -> FlightOptions {
        FlightOptions {
            rows_per_endpoint: self.rows_per_endpoint,
            max_message_bytes: bytes(self.max_message_bytes),
            max_put_message_bytes: bytes(self.max_put_message_bytes),
            max_request_bytes: bytes(self.max_request_bytes),
            ..FlightOptions::default()
        }
    }

    /// Everything the server needs besides the listener and the store.
    pub fn serve_options(&self) -> ServeOptions {
        ServeOptions {
            flight: self.flight_options(),
            grace: Duration::from_secs(self.shutdown_grace_seconds),
            connections: ConnectionLimits {
                max_connections: usize::try_from(self.max_connections).unwrap_or(usize::MAX),
                handshake_timeout: Duration::from_secs(self.handshake_timeout_seconds),
                idle_timeout: Duration::from_secs(self.idle_timeout_seconds),
                // A client that answers no ping for this long is gone; one that reads nothing
                // for as long is too.
                write_stall_timeout: Duration::from_secs(
                    self.keepalive_interval_seconds + self.keepalive_timeout_seconds,
                ),
            },
            max_streams_per_connection: self.max_streams_per_connection,
            keepalive_interval: Duration::from_secs(self.keepalive_interval_seconds),
            keepalive_timeout: Duration::from_secs(self.keepalive_timeout_seconds),
        }
    }
}

/// gRPC messages are at most 4 GiB (a 32-bit length prefix).
fn bytes(size: ByteSize) -> usize {
    usize::try_from(size.as_u64().min(u64::from(u32::MAX))).unwrap_or(usize::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_invocation_serves_with_defaults() {
        let args = Cli::parse_from(["gpu-flight"]).into_serve_args();
        assert_eq!(args.listen.port(), 8815);
        assert_eq!(args.backend, BackendChoice::Auto);
        assert_eq!(args.flight_options().max_message_bytes, 2 << 20);
        let serve = args.serve_options();
        assert_eq!(serve.flight.max_put_message_bytes, 1 << 30);
        assert_eq!(serve.flight.max_request_bytes, 64 << 10);
        assert_eq!(serve.connections.max_connections, 1000);
        assert_eq!(serve.keepalive_interval, Duration::from_secs(20));
    }

    #[test]
    fn serve_subcommand_and_sizes_parse() {
        let args = Cli::parse_from([
            "gpu-flight",
            "serve",
            "--memory-limit",
            "1GiB",
            "--backend",
            "host",
            "--max-message-bytes",
            "1048576",
        ])
        .into_serve_args();
        assert_eq!(args.store_options().memory_limit, Some(1 << 30));
        assert_eq!(args.backend, BackendChoice::Host);
        assert_eq!(args.flight_options().max_message_bytes, 1 << 20);
    }

    #[test]
    fn zero_rows_per_endpoint_is_refused() {
        assert!(Cli::try_parse_from(["gpu-flight", "--rows-per-endpoint", "0"]).is_err());
    }
}
