//! Command-line flags, each also readable from a `GPU_FLIGHT_*` environment variable, and what
//! they make: the options of the store, the Flight service and the server.
//!
//! The checks that turn a configuration that cannot be what the operator meant into a refusal
//! to start (naming the flag and why) or a warning, before anything listens, are in `checks`.

use std::path::PathBuf;
use std::time::Duration;

use bytesize::ByteSize;
use clap::builder::BoolishValueParser;
use clap::{Args, Parser, Subcommand};

use crate::auth::Role;
use crate::backend::{BackendChoice, GpuSelection};
use crate::flight::FlightOptions;
use crate::server::{ConnectionLimits, DoGetEncoder, DoPutDecoder, Http2Settings, ServeOptions};
use crate::store::{Durability, StoreOptions};

mod checks;

pub use checks::{ConfigError, MIN_MEMORY_LIMIT, check_token_file, exposed_listener_warning};

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
    Serve(Box<ServeArgs>),
    /// Print an argon2 hash of the password read from standard input, for a `[[users]]`
    /// entry of the `--auth-tokens` file.
    HashPassword,
    /// Print a `[[tokens]]` entry for the `--auth-tokens` file, with a new random bearer token
    /// (the token itself goes to standard error: give it to the client; the file keeps only
    /// its hash).
    NewToken {
        /// Who the token stands for, as logs and `status` show it.
        #[arg(long)]
        principal: String,
        /// What the token may do.
        #[arg(long, value_enum)]
        role: RoleArg,
    },
}

/// A role, as `new-token` takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RoleArg {
    Read,
    Write,
    Admin,
}

impl From<RoleArg> for Role {
    fn from(role: RoleArg) -> Self {
        match role {
            RoleArg::Read => Role::Read,
            RoleArg::Write => Role::Write,
            RoleArg::Admin => Role::Admin,
        }
    }
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines; coloured only on a terminal.
    #[default]
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

impl Cli {
    /// The serve flags, whichever way they were given; `Err` with the command otherwise.
    pub fn into_serve_args(self) -> Result<ServeArgs, Box<Command>> {
        match self.command {
            Some(Command::Serve(args)) => Ok(*args),
            Some(other) => Err(Box::new(other)),
            None => Ok(self.serve),
        }
    }
}

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Address to listen on, `HOST:PORT` (a host name listens on every address it resolves
    /// to; IPv6 in brackets), or a Unix socket, `unix:///path/to.sock`. Flight locations as
    /// the server prints them work too: `grpc://HOST:PORT` (or `grpc+tcp://`),
    /// `grpc+tls://HOST:PORT` (needs `--tls-cert`), `grpc+unix:///path/to.sock`. May be given more than once, or comma-separated in the
    /// environment. Port 0 picks a free port (the chosen address is printed).
    #[arg(long, env = "GPU_FLIGHT_LISTEN", default_value = "127.0.0.1:8815",
          value_delimiter = ',', action = clap::ArgAction::Append)]
    pub listen: Vec<String>,

    /// Where datasets live: `auto` picks cuda where a driver and a device exist, else host.
    #[arg(long, env = "GPU_FLIGHT_BACKEND", value_enum, default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,

    /// The GPUs to keep datasets on: `all` (every GPU `CUDA_VISIBLE_DEVICES` leaves visible)
    /// or CUDA ordinals such as `0,2,3`. Puts and endpoints number them 0, 1, … in this order.
    #[arg(long, env = "GPU_FLIGHT_DEVICES", default_value = "all")]
    pub devices: GpuSelection,

    /// One GPU (a CUDA ordinal): the same as `--devices N`.
    #[arg(long, env = "GPU_FLIGHT_DEVICE", conflicts_with = "devices")]
    pub device: Option<u32>,

    /// For tests of placement without GPUs: the host backend as this many devices, each with
    /// a budget of its own (`--memory-limit` applies to each).
    #[arg(long, env = "GPU_FLIGHT_HOST_DEVICES", default_value_t = 1, hide = true,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub host_devices: u32,

    /// Most bytes of datasets each device may hold, e.g. `8GiB` or `1000000`; default: the
    /// device's capacity. Beyond it, the least recently used datasets spill to host memory
    /// (`--host-memory-limit`); a put fails with RESOURCE_EXHAUSTED only when both are full.
    #[arg(long, env = "GPU_FLIGHT_MEMORY_LIMIT", value_parser = size)]
    pub memory_limit: Option<ByteSize>,

    /// Most bytes of datasets spilled to host memory, e.g. `64GiB`; `0` spills nothing.
    /// Default: half of the host's memory (or of the container's limit, where lower) with
    /// the CUDA backend; 0 with the host backend, whose datasets are in host memory already.
    #[arg(long, env = "GPU_FLIGHT_HOST_MEMORY_LIMIT", value_parser = size)]
    pub host_memory_limit: Option<ByteSize>,

    /// Host memory the CUDA backend pins for transfers, e.g. `4GiB`; default 1 GiB (at most a
    /// sixteenth of the host's memory), `0` for none. `DoPut` message bodies (large,
    /// uncompressed, without dictionary columns) are copied into it and uploaded straight from
    /// it, a spill copies a partition straight from the GPU into it (up to half of it) and a
    /// restore uploads straight from it: at the link's rate, without a staging copy. Pinned at
    /// start, in the background (the pages are faulted in first, then registered with the
    /// driver, during which the GPUs' other transfers wait: about 50 ms a GiB), and held for
    /// the life of the process, where nothing else on the machine can use it or swap it out;
    /// what does not fit in what is free of it goes through staging. At most half the host's
    /// memory, and never more than half of what is free at start (less is pinned, with a
    /// warning); the spills it holds count in `--host-memory-limit`.
    #[arg(long, env = "GPU_FLIGHT_PINNED_HOST_MEMORY", value_parser = size)]
    pub pinned_host_memory: Option<ByteSize>,

    /// Makes every committed dataset durable in this directory (Arrow IPC files and a
    /// manifest), and serves what it holds after a restart, each dataset loaded when first
    /// read. Without it nothing touches the disk.
    #[arg(long, env = "GPU_FLIGHT_DATA_DIR")]
    pub data_dir: Option<std::path::PathBuf>,

    /// With --data-dir: `sync` acknowledges a put, copy or drop once it is on disk; `async`
    /// at once, the disk following in commit order (a crash may lose the latest changes,
    /// never tear one).
    #[arg(long, env = "GPU_FLIGHT_DURABILITY", value_enum, default_value_t = Durability::Sync)]
    pub durability: Durability,

    /// A URI clients reach this server at (`grpc://HOST:PORT`, `grpc+tls://HOST:PORT`,
    /// `grpc+unix:///path`), listed as a location of every endpoint, so that readers given the
    /// endpoints of several servers know which server serves each. May be given more than once
    /// (comma-separated in the environment), at most 8. Without it endpoints carry only
    /// `arrow-flight-reuse-connection://?` (this server, on the caller's connection).
    #[arg(long = "advertise-uri", env = "GPU_FLIGHT_ADVERTISE_URI", value_delimiter = ',',
          action = clap::ArgAction::Append)]
    pub advertise_uri: Vec<String>,

    /// Rows per endpoint in GetFlightInfo; clients read endpoints in parallel.
    #[arg(long, env = "GPU_FLIGHT_ROWS_PER_ENDPOINT", default_value_t = 1 << 20,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub rows_per_endpoint: u64,

    /// Largest FlightData message DoGet sends (keep it under clients' 4 MiB gRPC default).
    #[arg(long, env = "GPU_FLIGHT_MAX_MESSAGE_BYTES", default_value = "4032KiB", value_parser = size)]
    pub max_message_bytes: ByteSize,

    /// Seconds running streams get to finish after SIGINT/SIGTERM before the server exits.
    #[arg(long, env = "GPU_FLIGHT_SHUTDOWN_GRACE", default_value_t = 30)]
    pub shutdown_grace_seconds: u64,

    /// Largest DoPut message (one record batch, as pyarrow sends it); larger ones are refused
    /// with RESOURCE_EXHAUSTED before they are received.
    #[arg(long, env = "GPU_FLIGHT_MAX_PUT_MESSAGE_BYTES", default_value = "1GiB", value_parser = size)]
    pub max_put_message_bytes: ByteSize,

    /// Largest message of any other request (tickets, descriptors, action bodies); larger
    /// ones are refused with INVALID_ARGUMENT.
    #[arg(long, env = "GPU_FLIGHT_MAX_REQUEST_BYTES", default_value = "64KiB", value_parser = size)]
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

    /// Serve TLS with this certificate chain (PEM); needs `--tls-key`.
    #[arg(long, env = "GPU_FLIGHT_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,

    /// The private key (PEM) of `--tls-cert`.
    #[arg(long, env = "GPU_FLIGHT_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,

    /// Mutual TLS: accept only clients with a certificate signed by a CA in this PEM file.
    #[arg(long, env = "GPU_FLIGHT_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,

    /// Require a bearer token on every call: a TOML file of tokens and users with their roles
    /// (read, write, admin), read again on SIGHUP. See docs/operations.md, Security.
    #[arg(long, env = "GPU_FLIGHT_AUTH_TOKENS")]
    pub auth_tokens: Option<PathBuf>,

    /// Hours a session token from Handshake (Basic credentials) stays valid.
    #[arg(long, env = "GPU_FLIGHT_SESSION_HOURS", default_value_t = 12,
          value_parser = clap::value_parser!(u64).range(1..=8760))]
    pub session_hours: u64,

    /// Listen on addresses other hosts can reach without `--auth-tokens` or
    /// `--tls-client-ca`: anyone who can connect may then read, replace and drop every
    /// dataset. Without this flag such a listen address is refused.
    /// The variable takes 1/0, yes/no, true/false, on/off.
    #[arg(long, env = "GPU_FLIGHT_ALLOW_UNAUTHENTICATED",
          value_parser = BoolishValueParser::new())]
    pub allow_unauthenticated: bool,

    /// Serve Prometheus metrics over plain HTTP at `http://ADDR/metrics` (no authentication:
    /// bind it where only the monitoring system can reach it).
    #[arg(long, env = "GPU_FLIGHT_METRICS_LISTEN")]
    pub metrics_listen: Option<String>,

    /// Also serve the gRPC health service, and nothing else, in plain text on `HOST:PORT`: for
    /// Kubernetes' gRPC probes, which can neither speak TLS nor send a token.
    #[arg(long, env = "GPU_FLIGHT_HEALTH_LISTEN")]
    pub health_listen: Option<String>,

    /// Log line format. Colours are used only when standard error is a terminal.
    #[arg(long, env = "GPU_FLIGHT_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// Offers shared-memory reads (`shm-read`) to processes on this node: the Unix socket
    /// they fetch their files from. `auto` puts it in a directory of this user's alone
    /// ($XDG_RUNTIME_DIR/gpu-flight, else /tmp/gpu-flight-UID, mode 0700), so only processes
    /// of the server's user reach it; a path of your own decides who may connect by the
    /// permissions of its directory (a token is needed all the same). Off without it.
    #[arg(long, env = "GPU_FLIGHT_SHM_SOCKET", value_name = "PATH|auto")]
    pub shm_socket: Option<std::path::PathBuf>,

    /// Shared-memory reads (`shm-read`) one principal may hold at once, each a set of up to
    /// 8 files.
    #[arg(long, env = "GPU_FLIGHT_SHM_MAX_FILES", default_value_t = 16,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub shm_max_files: u32,

    /// Bytes of shared-memory files one principal may hold at once; without it only the
    /// memory budget bounds them.
    #[arg(long, env = "GPU_FLIGHT_SHM_MAX_BYTES", value_parser = size)]
    pub shm_max_bytes: Option<ByteSize>,

    /// `ipc-export` leases one principal may hold at once; a new export past them is refused
    /// (RESOURCE_EXHAUSTED) until some are released or expire.
    #[arg(long, env = "GPU_FLIGHT_IPC_MAX_LEASES",
          default_value_t = crate::store::DEFAULT_MAX_EXPORT_LEASES,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub ipc_max_leases: u32,

    /// Files a shared-memory read is written as at most, each by its own thread (1 to 8).
    /// Hidden: the default (half the CPUs, at most 8) is for measuring against.
    #[arg(long, hide = true, env = "GPU_FLIGHT_SHM_WRITERS",
          value_parser = clap::value_parser!(u64).range(1..=8))]
    pub shm_writers: Option<u64>,

    /// Seconds between progress lines of a long DoPut or DoGet.
    #[arg(long, env = "GPU_FLIGHT_PROGRESS_SECONDS", default_value_t = 5,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub progress_seconds: u64,

    /// How DoGet replies are encoded: `framed` (the server's own framing, without copying the
    /// Arrow buffers) or `plain` (arrow-flight's encoder). Hidden: for measuring one against
    /// the other.
    #[arg(long, hide = true, value_enum, default_value = "framed")]
    pub doget_encoder: DoGetEncoder,

    /// How DoPut messages are read: `framed` (straight from the HTTP/2 frames, each body
    /// copied once into aligned memory) or `plain` (tonic's codec, then Arrow's realignment).
    /// Hidden: for measuring one against the other.
    #[arg(long, hide = true, value_enum, default_value = "framed")]
    pub doput_decoder: DoPutDecoder,

    /// Where statements' and reads' filters run: `device` (where the rows live, when the
    /// backend can) or `host` (after the rows were copied to host memory). Hidden: for
    /// measuring one against the other.
    #[arg(long, hide = true, value_enum, default_value = "device")]
    pub filter_on: FilterOn,

    /// Hidden, for measuring the network path: the HTTP/2 settings the server advertises and
    /// the read pipeline's depths. The worker threads are tokio's `TOKIO_WORKER_THREADS`.
    #[command(flatten)]
    pub tuning: TuningArgs,
}

/// Knobs of the network path, hidden from `--help`: for same-run A/B measurements
/// (examples/python/throughput.py `--server-variants`), never needed otherwise.
#[derive(Debug, Clone, Args)]
pub struct TuningArgs {
    /// The largest HTTP/2 frame clients may send (SETTINGS_MAX_FRAME_SIZE): 16KiB to 16MiB-1.
    #[arg(long, hide = true, default_value = "1MiB", value_parser = frame_size)]
    pub h2_max_frame_bytes: ByteSize,
    /// Each stream's HTTP/2 receive window (at most 2GiB-1).
    #[arg(long, hide = true, default_value = "16MiB", value_parser = window_size)]
    pub h2_stream_window_bytes: ByteSize,
    /// The connection's HTTP/2 receive window (at most 2GiB-1).
    #[arg(long, hide = true, default_value = "64MiB", value_parser = window_size)]
    pub h2_connection_window_bytes: ByteSize,
    /// hyper's adaptive (BDP-estimating) receive windows instead of the fixed ones.
    #[arg(long, hide = true)]
    pub h2_adaptive_window: bool,
    /// Bytes a DoGet reads from the backend at a time (one device-to-host copy).
    #[arg(long, hide = true, default_value = "16MiB", value_parser = size)]
    pub read_chunk_bytes: ByteSize,
    /// Chunk reads a DoGet keeps in flight ahead of its encoder.
    #[arg(long, hide = true, default_value_t = 2,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub read_prefetch: u32,
    /// DoGet messages encoded ahead of the connection.
    #[arg(long, hide = true, default_value_t = 4,
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub doget_encode_ahead: u32,
    /// DoPut batches being uploaded while more are received.
    #[arg(long, hide = true, default_value_t = 4,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub put_pipeline_depth: u32,
}

/// Where filters run (`--filter-on`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum FilterOn {
    Device,
    Host,
}

/// What the CUDA backend pins for transfers without `--pinned-host-memory`: enough for the
/// message bodies of many concurrent puts (each a few MiB), so that their uploads skip the
/// staging copy (1 GiB did as well as 4 with 16 clients on the H200 machine).
pub const DEFAULT_PINNED_HOST_MEMORY: u64 = 1 << 30;
/// The default is at most the host's memory divided by this, so that a small host keeps
/// nearly all of its memory swappable.
pub const DEFAULT_PINNED_HOST_FRACTION: u64 = 16;

/// How much of `asked` bytes of host memory to pin when `available` bytes are free now (where
/// known): at most half of them, since pinned memory is never given back or swapped out and
/// the server and everything else on the machine need the rest.
pub fn pinnable(asked: u64, available: Option<u64>) -> u64 {
    available.map_or(asked, |available| asked.min(available / 2))
}

impl ServeArgs {
    /// Host memory to pin for the CUDA backend's transfers, on a host with `host_memory`
    /// bytes (where known): `--pinned-host-memory`, else the default.
    pub fn pinned_host_memory_bytes(&self, host_memory: Option<u64>) -> u64 {
        match self.pinned_host_memory {
            Some(bytes) => bytes.as_u64(),
            None => host_memory.map_or(DEFAULT_PINNED_HOST_MEMORY, |memory| {
                DEFAULT_PINNED_HOST_MEMORY.min(memory / DEFAULT_PINNED_HOST_FRACTION)
            }),
        }
    }

    /// The GPUs asked for: `--device N` alone, else `--devices`.
    pub fn gpus(&self) -> GpuSelection {
        match self.device {
            Some(ordinal) => GpuSelection::Ordinals(vec![ordinal]),
            None => self.devices.clone(),
        }
    }

    pub fn store_options(&self) -> StoreOptions {
        StoreOptions {
            memory_limit: self.memory_limit.map(|b| b.as_u64()),
            host_memory_limit: self.host_memory_limit.map(|b| b.as_u64()),
            data_dir: self.data_dir.clone(),
            durability: self.durability,
        }
    }

    pub fn flight_options(&self) -> FlightOptions {
        FlightOptions {
            advertise: self.advertise_uri.clone(),
            rows_per_endpoint: self.rows_per_endpoint,
            max_message_bytes: bytes(self.max_message_bytes),
            max_put_message_bytes: bytes(self.max_put_message_bytes),
            max_request_bytes: bytes(self.max_request_bytes),
            progress_interval: Duration::from_secs(self.progress_seconds),
            filter_on_device: self.filter_on == FilterOn::Device,
            read_chunk_bytes: self.tuning.read_chunk_bytes.as_u64().max(1),
            read_prefetch: self.tuning.read_prefetch as usize,
            doget_encode_ahead: self.tuning.doget_encode_ahead as usize,
            put_pipeline_depth: self.tuning.put_pipeline_depth as usize,
            // The socket is filled in once the server listens on it (`server::run`).
            shared_memory: crate::flight::SharedMemoryOptions {
                socket: None,
                limits: crate::store::SharedLimits {
                    max_files: self.shm_max_files,
                    max_bytes: self.shm_max_bytes.map(|b| b.as_u64()),
                    ..crate::store::SharedLimits::default()
                },
                writers: self.shm_writers.map(|n| n as usize),
            },
            max_export_leases: self.ipc_max_leases,
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
            doget_encoder: self.doget_encoder,
            doput_decoder: self.doput_decoder,
            http2: Http2Settings {
                stream_window_bytes: window(self.tuning.h2_stream_window_bytes),
                connection_window_bytes: window(self.tuning.h2_connection_window_bytes),
                max_frame_bytes: window(self.tuning.h2_max_frame_bytes),
                adaptive_window: self.tuning.h2_adaptive_window,
            },
            // Files and the token file are read by `launch::credentials`, which reports their errors.
            ..ServeOptions::default()
        }
    }
}

/// Parses a size flag, with an error that says what a size looks like.
fn size(text: &str) -> Result<ByteSize, String> {
    text.trim().parse::<ByteSize>().map_err(|_| {
        "expected a size such as 8GiB, 512MiB, 512MB or 1048576 (bytes); units: B, KB, MB, \
         GB, TB (powers of 1000), KiB, MiB, GiB, TiB (powers of 1024)"
            .to_owned()
    })
}

/// An HTTP/2 frame size: what SETTINGS_MAX_FRAME_SIZE may say (RFC 9113, 6.5.2).
fn frame_size(text: &str) -> Result<ByteSize, String> {
    let parsed = size(text)?;
    if !(1 << 14..1 << 24).contains(&parsed.as_u64()) {
        return Err("an HTTP/2 frame size is 16KiB to 16MiB less one byte".to_owned());
    }
    Ok(parsed)
}

/// An HTTP/2 flow-control window: at most 2^31-1 bytes.
fn window_size(text: &str) -> Result<ByteSize, String> {
    let parsed = size(text)?;
    if parsed.as_u64() > (1 << 31) - 1 {
        return Err("an HTTP/2 window is at most 2GiB less one byte".to_owned());
    }
    Ok(parsed)
}

/// A size its parser has bounded to 32 bits.
fn window(size: ByteSize) -> u32 {
    u32::try_from(size.as_u64()).unwrap_or(u32::MAX)
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
        let args = Cli::parse_from(["gpu-flight"])
            .into_serve_args()
            .expect("serve");
        assert_eq!(args.listen, ["127.0.0.1:8815"]);
        assert!(args.auth_tokens.is_none() && !args.allow_unauthenticated);
        assert_eq!(args.backend, BackendChoice::Auto);
        assert_eq!(
            args.flight_options().max_message_bytes,
            crate::flight::DEFAULT_MAX_MESSAGE_BYTES
        );
        let serve = args.serve_options();
        assert_eq!(serve.flight.max_put_message_bytes, 1 << 30);
        assert_eq!(serve.flight.max_request_bytes, 64 << 10);
        assert_eq!(serve.connections.max_connections, 1000);
        assert_eq!(serve.keepalive_interval, Duration::from_secs(20));
    }

    #[test]
    fn hidden_tuning_flags_reach_the_options_and_default_to_the_constants() {
        let defaults = Cli::parse_from(["gpu-flight"])
            .into_serve_args()
            .expect("serve");
        assert_eq!(defaults.serve_options().http2, Http2Settings::default());
        let flight = FlightOptions::default();
        let parsed = defaults.flight_options();
        assert_eq!(
            (parsed.read_chunk_bytes, parsed.read_prefetch),
            (flight.read_chunk_bytes, flight.read_prefetch)
        );
        assert_eq!(
            (parsed.doget_encode_ahead, parsed.put_pipeline_depth),
            (flight.doget_encode_ahead, flight.put_pipeline_depth)
        );

        let args = Cli::parse_from([
            "gpu-flight",
            "--h2-max-frame-bytes",
            "4MiB",
            "--h2-stream-window-bytes",
            "32MiB",
            "--h2-connection-window-bytes",
            "1GiB",
            "--h2-adaptive-window",
            "--read-chunk-bytes",
            "4MiB",
            "--read-prefetch",
            "6",
            "--doget-encode-ahead",
            "16",
        ])
        .into_serve_args()
        .expect("serve");
        let http2 = args.serve_options().http2;
        assert_eq!(http2.max_frame_bytes, 4 << 20);
        assert_eq!(http2.stream_window_bytes, 32 << 20);
        assert_eq!(http2.connection_window_bytes, 1 << 30);
        assert!(http2.adaptive_window);
        let flight = args.flight_options();
        assert_eq!(
            (flight.read_chunk_bytes, flight.read_prefetch),
            (4 << 20, 6)
        );
        assert_eq!(flight.doget_encode_ahead, 16);

        for refused in [
            ["--h2-max-frame-bytes", "16MiB"],
            ["--h2-max-frame-bytes", "1KiB"],
            ["--h2-stream-window-bytes", "2GiB"],
            ["--read-prefetch", "0"],
        ] {
            let parsed = Cli::try_parse_from(["gpu-flight", refused[0], refused[1]]);
            assert!(parsed.is_err(), "{refused:?}");
        }
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
        .into_serve_args()
        .expect("serve");
        assert_eq!(args.store_options().memory_limit, Some(1 << 30));
        assert_eq!(args.backend, BackendChoice::Host);
        assert_eq!(args.flight_options().max_message_bytes, 1 << 20);
    }

    #[test]
    fn gpus_default_to_all_and_take_a_list_or_one() {
        let gpus = |flags: &[&str]| {
            Cli::try_parse_from(["gpu-flight", "serve"].iter().chain(flags))
                .map_err(|e| e.to_string())
                .and_then(|cli| cli.into_serve_args().map_err(|_| "no serve".to_owned()))
                .map(|args| args.gpus())
        };
        assert_eq!(gpus(&[]), Ok(GpuSelection::All));
        assert_eq!(
            gpus(&["--devices", "0, 2,3"]),
            Ok(GpuSelection::Ordinals(vec![0, 2, 3]))
        );
        assert_eq!(
            gpus(&["--device", "1"]),
            Ok(GpuSelection::Ordinals(vec![1]))
        );
        for bad in [
            &["--devices", "0,0"][..],
            &["--devices", "gpu0"],
            &["--devices", ""],
            &["--devices", "1", "--device", "2"],
        ] {
            assert!(gpus(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn listen_takes_names_and_repeats() {
        let args = Cli::parse_from([
            "gpu-flight",
            "--listen",
            "localhost:8815",
            "--listen",
            "[::1]:9000",
        ])
        .into_serve_args()
        .expect("serve");
        assert_eq!(args.listen, ["localhost:8815", "[::1]:9000"]);
    }

    #[test]
    fn size_errors_say_what_a_size_is() {
        let error = Cli::try_parse_from(["gpu-flight", "--memory-limit", "8 gigs"])
            .expect_err("refused")
            .to_string();
        assert!(error.contains("8GiB") && error.contains("512MB"), "{error}");
    }

    #[test]
    fn tls_key_needs_a_certificate() {
        assert!(Cli::try_parse_from(["gpu-flight", "--tls-key", "k.pem"]).is_err());
        assert!(Cli::try_parse_from(["gpu-flight", "--tls-client-ca", "ca.pem"]).is_err());
    }

    #[test]
    fn zero_rows_per_endpoint_is_refused() {
        assert!(Cli::try_parse_from(["gpu-flight", "--rows-per-endpoint", "0"]).is_err());
    }
}
