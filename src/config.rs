//! Command-line flags, each also readable from a `GPU_FLIGHT_*` environment variable, and the
//! checks that turn a configuration that cannot be what the operator meant into a refusal to
//! start (naming the flag and why) or a warning, before anything listens.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use bytesize::ByteSize;
use clap::builder::BoolishValueParser;
use clap::{Args, Parser, Subcommand};

use crate::auth::{Loaded, Role};
use crate::backend::{BackendChoice, DeviceInfo, GpuSelection};
use crate::flight::FlightOptions;
use crate::server::{ConnectionLimits, DoGetEncoder, ListenAddr, ServeOptions};
use crate::store::{Durability, StoreOptions};

/// The smallest `--memory-limit` (and non-zero `--host-memory-limit`) the server starts with.
/// Below it no useful dataset fits (a put is refused once one schema message and a batch's
/// buffers are charged), so such a value is a unit left out (`--memory-limit 8` for 8GiB), not
/// a budget.
pub const MIN_MEMORY_LIMIT: u64 = 1 << 20;

/// A configuration the server refuses to start with: the message names the flag and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

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

    /// Rows per endpoint in GetFlightInfo; clients read endpoints in parallel.
    #[arg(long, env = "GPU_FLIGHT_ROWS_PER_ENDPOINT", default_value_t = 1 << 20,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub rows_per_endpoint: u64,

    /// Largest FlightData message DoGet sends (keep it under clients' 4 MiB gRPC default).
    #[arg(long, env = "GPU_FLIGHT_MAX_MESSAGE_BYTES", default_value = "2MiB", value_parser = size)]
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
    /// (read, write, admin), read again on SIGHUP. See the README's Security section.
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

    /// Seconds between progress lines of a long DoPut or DoGet.
    #[arg(long, env = "GPU_FLIGHT_PROGRESS_SECONDS", default_value_t = 5,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub progress_seconds: u64,

    /// How DoGet replies are encoded: `framed` (the server's own framing, without copying the
    /// Arrow buffers) or `plain` (arrow-flight's encoder). Hidden: for measuring one against
    /// the other.
    #[arg(long, hide = true, value_enum, default_value = "framed")]
    pub doget_encoder: DoGetEncoder,
}

impl ServeArgs {
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
            rows_per_endpoint: self.rows_per_endpoint,
            max_message_bytes: bytes(self.max_message_bytes),
            max_put_message_bytes: bytes(self.max_put_message_bytes),
            max_request_bytes: bytes(self.max_request_bytes),
            progress_interval: Duration::from_secs(self.progress_seconds),
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
            doget_encoder: self.doget_encoder,
            // Files and the token file are read by `main`, which reports their errors.
            ..ServeOptions::default()
        }
    }
}

impl ServeArgs {
    /// Checks the flags against each other, before anything is read or started. What cannot
    /// be what the operator meant is an error; the server then does not start.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.check_floors()?;
        if self.durability == Durability::Async && self.data_dir.is_none() {
            return Err(ConfigError(
                "--durability async applies to --data-dir, which is not given: without a data \
                 directory nothing is written to disk, so there is nothing to acknowledge before \
                 it is. Give --data-dir DIR, or leave --durability out"
                    .to_owned(),
            ));
        }
        if self.backend == BackendChoice::Host
            && let GpuSelection::Ordinals(ordinals) = self.gpus()
        {
            let flag = if self.device.is_some() {
                "--device"
            } else {
                "--devices"
            };
            let ordinals: Vec<String> = ordinals.iter().map(ToString::to_string).collect();
            return Err(ConfigError(format!(
                "{flag} {} selects GPUs, but --backend host keeps datasets in host memory, which \
                 has no GPUs to select: this server's devices would be 0..{} (host memory). Use \
                 --backend cuda (or auto) to serve from GPUs, or leave {flag} out",
                ordinals.join(","),
                self.host_devices - 1
            )));
        }
        let tls = self.tls_cert.is_some();
        for spec in &self.listen {
            match ListenAddr::tls_scheme(spec) {
                Some(true) if !tls => {
                    return Err(ConfigError(format!(
                        "--listen {spec}: grpc+tls:// serves TLS, which needs --tls-cert and \
                         --tls-key; give them, or listen with grpc:// (plain text)"
                    )));
                }
                Some(false) if tls => {
                    return Err(ConfigError(format!(
                        "--listen {spec} says plain text, but with --tls-cert every TCP listener \
                         serves TLS; write grpc+tls://{} (or HOST:PORT)",
                        spec.split_once("://")
                            .map_or(spec.as_str(), |(_, rest)| rest)
                    )));
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// `--memory-limit` and a non-zero `--host-memory-limit` must be at least
    /// [`MIN_MEMORY_LIMIT`].
    fn check_floors(&self) -> Result<(), ConfigError> {
        let limits = [
            ("--memory-limit", self.memory_limit, false),
            ("--host-memory-limit", self.host_memory_limit, true),
        ];
        for (flag, limit, zero_allowed) in limits {
            let Some(limit) = limit.map(|limit| limit.as_u64()) else {
                continue;
            };
            if limit < MIN_MEMORY_LIMIT && !(zero_allowed && limit == 0) {
                let zero = if zero_allowed { " (or 0 for none)" } else { "" };
                return Err(ConfigError(format!(
                    "{flag} {limit} B is below the least this server runs with, 1 MiB \
                     ({MIN_MEMORY_LIMIT} bytes): no dataset would fit. A size without a unit \
                     is bytes; write it with one, such as 8GiB or 512MiB{zero}"
                )));
            }
        }
        Ok(())
    }

    /// Checks the memory budgets against what there is: each device's capacity (`devices`, as
    /// the backend reports them) and the memory this process may use (`host_memory`: the
    /// machine's, or its cgroup's limit where lower). A budget above the memory it divides
    /// is refused: the store would cap it at the capacity without a word, so the operator's
    /// number would mean nothing, and on the host backend the kernel's OOM killer, not the
    /// budget, would stop the puts that exceed the memory (and every dataset with them).
    /// Returns warnings for the log.
    pub fn check_capacity(
        &self,
        devices: &[DeviceInfo],
        host_memory: Option<u64>,
        holds_host_memory: bool,
    ) -> Result<Vec<String>, ConfigError> {
        let mut warnings = Vec::new();
        let limit = self.memory_limit.map(|limit| limit.as_u64());
        if let Some(limit) = limit {
            for (index, device) in devices.iter().enumerate() {
                if let Some(total) = device.total_bytes
                    && limit > total
                {
                    let shared = if devices.len() > 1 && holds_host_memory {
                        format!(" (the host's memory shared by {} devices)", devices.len())
                    } else {
                        String::new()
                    };
                    return Err(ConfigError(format!(
                        "--memory-limit {limit} bytes ({}) is more than device {index} ({}) \
                         has: {total} bytes ({}){shared}. The budget cannot be more than the \
                         memory; give at most {total}, or leave --memory-limit out for the \
                         default ({})",
                        ByteSize::b(limit).display().iec(),
                        device.name,
                        ByteSize::b(total).display().iec(),
                        device
                            .default_limit_bytes
                            .map_or("the device's capacity".to_owned(), |bytes| {
                                format!("{bytes} bytes")
                            }),
                    )));
                }
            }
        }
        let host_limit = self.host_memory_limit.map(|limit| limit.as_u64());
        if let (Some(host_limit), Some(memory)) = (host_limit, host_memory) {
            if host_limit > memory {
                return Err(ConfigError(format!(
                    "--host-memory-limit {host_limit} bytes ({}) is more than the memory this \
                     process may use: {memory} bytes ({}; the machine's memory, or the \
                     container's memory limit where lower). Give at most {memory}, or leave it \
                     out for the default",
                    ByteSize::b(host_limit).display().iec(),
                    ByteSize::b(memory).display().iec(),
                )));
            }
            // On the host backend both tiers are the same memory.
            if holds_host_memory && host_limit > 0 {
                let device_budgets: u64 = devices
                    .iter()
                    .map(|device| limit.or(device.default_limit_bytes).unwrap_or(0))
                    .sum();
                let together = device_budgets.saturating_add(host_limit);
                if together > memory {
                    warnings.push(format!(
                        "--memory-limit (all devices: {device_budgets} bytes) and \
                         --host-memory-limit ({host_limit} bytes) are both host memory on the \
                         host backend, and together ({together} bytes) more than this process \
                         may use ({memory} bytes): the operating system may refuse memory \
                         before the budgets do"
                    ));
                }
            }
        }
        Ok(warnings)
    }
}

/// A token file with nobody in it lets no call through: a server started with one serves no
/// one (and on a network address looks protected while useless). Refused unless
/// `--allow-unauthenticated` says the operator means it (to fill the file in and reload it);
/// then a warning.
pub fn check_token_file(
    loaded: Loaded,
    path: &std::path::Path,
    allow_unauthenticated: bool,
) -> Result<Option<String>, ConfigError> {
    if loaded.tokens > 0 || loaded.users > 0 {
        return Ok(None);
    }
    let problem = format!(
        "the token file {} has no tokens and no users: no principal could ever call",
        path.display()
    );
    if allow_unauthenticated {
        return Ok(Some(format!(
            "{problem} until entries are added and the file is reloaded (SIGHUP)"
        )));
    }
    Err(ConfigError(format!(
        "{problem}. Add one (`gpu-flight new-token --principal NAME --role write >> {}`), or \
         leave --auth-tokens out on a loopback address",
        path.display()
    )))
}

/// The warning for a plain-HTTP or plain-gRPC side listener (`--metrics-listen`,
/// `--health-listen`) bound where other hosts can reach it: it has no authentication and no
/// TLS. `None` on loopback.
pub fn exposed_listener_warning(flag: &str, address: SocketAddr) -> Option<String> {
    if address.ip().is_loopback() {
        return None;
    }
    let what = if flag == "--metrics-listen" {
        "metrics (counts and sizes)"
    } else {
        "the health service (whether the server is serving)"
    };
    Some(format!(
        "{flag} {address} serves {what} without authentication or TLS on an address other hosts \
         may reach: make sure a firewall or network policy limits who can connect"
    ))
}

/// Parses a size flag, with an error that says what a size looks like.
fn size(text: &str) -> Result<ByteSize, String> {
    text.trim().parse::<ByteSize>().map_err(|_| {
        "expected a size such as 8GiB, 512MiB, 512MB or 1048576 (bytes); units: B, KB, MB, \
         GB, TB (powers of 1000), KiB, MiB, GiB, TiB (powers of 1024)"
            .to_owned()
    })
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

    fn serve(flags: &[&str]) -> ServeArgs {
        Cli::try_parse_from(["gpu-flight", "serve"].iter().chain(flags))
            .expect("flags parse")
            .into_serve_args()
            .expect("serve")
    }

    fn refusal(flags: &[&str]) -> String {
        serve(flags).validate().expect_err("refused").0
    }

    #[test]
    fn limits_below_the_floor_are_refused_and_zero_host_memory_is_not() {
        assert!(refusal(&["--memory-limit", "1048575"]).contains("--memory-limit"));
        assert!(refusal(&["--host-memory-limit", "1KiB"]).contains("--host-memory-limit"));
        for fine in [
            &["--memory-limit", "1MiB"][..],
            &["--host-memory-limit", "0"],
            &["--memory-limit", "3MB", "--host-memory-limit", "0"],
        ] {
            assert_eq!(serve(fine).validate(), Ok(()), "{fine:?}");
        }
        let error = refusal(&["--memory-limit", "0"]);
        assert!(!error.contains("0 for none"), "{error}");
    }

    #[test]
    fn async_durability_needs_a_data_dir() {
        assert!(refusal(&["--durability", "async"]).contains("--data-dir"));
        let with_dir = serve(&["--durability", "async", "--data-dir", "/tmp/d"]);
        assert_eq!(with_dir.validate(), Ok(()));
        assert_eq!(serve(&["--durability", "sync"]).validate(), Ok(()));
    }

    #[test]
    fn the_host_backend_selects_no_gpus() {
        let error = refusal(&["--backend", "host", "--devices", "0,1"]);
        assert!(error.contains("--devices 0,1"), "{error}");
        let error = refusal(&["--backend", "host", "--host-devices", "3", "--device", "2"]);
        assert!(
            error.contains("--device 2") && error.contains("0..2"),
            "{error}"
        );
        assert_eq!(
            serve(&["--backend", "host", "--devices", "all"]).validate(),
            Ok(())
        );
        assert_eq!(
            serve(&["--backend", "cuda", "--device", "1"]).validate(),
            Ok(())
        );
    }

    #[test]
    fn listen_schemes_agree_with_the_tls_flags() {
        let tls = ["--tls-cert", "c.pem", "--tls-key", "k.pem"];
        let with_tls = |listen: &str| {
            let mut flags = vec!["--listen", listen];
            flags.extend(tls);
            serve(&flags).validate()
        };
        assert_eq!(with_tls("grpc+tls://0.0.0.0:8815"), Ok(()));
        assert_eq!(with_tls("0.0.0.0:8815"), Ok(()));
        let error = with_tls("grpc://0.0.0.0:8815")
            .expect_err("plain text with TLS")
            .0;
        assert!(error.contains("grpc+tls://0.0.0.0:8815"), "{error}");
        assert!(with_tls("grpc+tcp://0.0.0.0:8815").is_err());
        assert!(refusal(&["--listen", "grpc+tls://127.0.0.1:0"]).contains("--tls-cert"));
        assert_eq!(
            serve(&["--listen", "grpc://127.0.0.1:0"]).validate(),
            Ok(())
        );
    }

    fn device(total: u64) -> DeviceInfo {
        DeviceInfo {
            ordinal: 0,
            name: "test memory".to_owned(),
            total_bytes: Some(total),
            default_limit_bytes: Some(total / 4 * 3),
            uuid: None,
            pci_bus_id: None,
            numa_node: None,
        }
    }

    #[test]
    fn budgets_above_the_memory_are_refused_naming_both_numbers() {
        const GIB: u64 = 1 << 30;
        let devices = [device(24 * GIB)];
        let error = serve(&["--memory-limit", "1TiB"])
            .check_capacity(&devices, Some(24 * GIB), true)
            .expect_err("more than there is")
            .0;
        assert!(
            error.contains("--memory-limit")
                && error.contains(&(1u64 << 40).to_string())
                && error.contains(&(24 * GIB).to_string()),
            "{error}"
        );
        // A device's own capacity decides, whatever the host has.
        let error = serve(&["--memory-limit", "80GiB"])
            .check_capacity(&[device(79 * GIB)], Some(512 * GIB), false)
            .expect_err("more than the GPU has")
            .0;
        assert!(error.contains("device 0 (test memory)"), "{error}");
        let error = serve(&["--host-memory-limit", "32GiB"])
            .check_capacity(&devices, Some(24 * GIB), false)
            .expect_err("more than the host has")
            .0;
        assert!(
            error.contains("--host-memory-limit") && error.contains(&(24 * GIB).to_string()),
            "{error}"
        );
        let fine = serve(&["--memory-limit", "24GiB", "--host-memory-limit", "0"]);
        assert_eq!(
            fine.check_capacity(&devices, Some(24 * GIB), true),
            Ok(vec![])
        );
        // Unknown capacities are not checked.
        let unknown = DeviceInfo {
            total_bytes: None,
            ..device(0)
        };
        let any = serve(&["--memory-limit", "1TiB", "--host-memory-limit", "1TiB"]);
        assert_eq!(any.check_capacity(&[unknown], None, true), Ok(vec![]));
    }

    #[test]
    fn host_backend_tiers_that_together_exceed_the_memory_are_warned_about() {
        const GIB: u64 = 1 << 30;
        let args = serve(&["--memory-limit", "16GiB", "--host-memory-limit", "16GiB"]);
        let warnings = args
            .check_capacity(&[device(24 * GIB)], Some(24 * GIB), true)
            .expect("each fits");
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        // On a GPU the two are different memories.
        let gpu = args
            .check_capacity(&[device(24 * GIB)], Some(24 * GIB), false)
            .expect("each fits");
        assert!(gpu.is_empty(), "{gpu:?}");
    }

    #[test]
    fn an_empty_token_file_is_refused_unless_unauthenticated_access_is_allowed() {
        let path = std::path::Path::new("/etc/gpu-flight/tokens.toml");
        let empty = Loaded {
            tokens: 0,
            users: 0,
        };
        let error = check_token_file(empty, path, false)
            .expect_err("nobody can call")
            .0;
        assert!(error.contains("/etc/gpu-flight/tokens.toml"), "{error}");
        assert!(matches!(check_token_file(empty, path, true), Ok(Some(_))));
        for loaded in [
            Loaded {
                tokens: 1,
                users: 0,
            },
            Loaded {
                tokens: 0,
                users: 1,
            },
        ] {
            assert_eq!(check_token_file(loaded, path, false), Ok(None));
        }
    }

    #[test]
    fn side_listeners_off_loopback_are_warned_about() {
        for address in ["0.0.0.0:9090", "[::]:9090", "10.0.0.5:9090"] {
            let address = address.parse().expect("address");
            let warning = exposed_listener_warning("--metrics-listen", address).expect("warned");
            assert!(warning.contains("--metrics-listen"), "{warning}");
        }
        for address in ["127.0.0.1:9090", "[::1]:9090"] {
            let address = address.parse().expect("address");
            assert_eq!(exposed_listener_warning("--health-listen", address), None);
        }
    }

    #[test]
    fn zero_rows_per_endpoint_is_refused() {
        assert!(Cli::try_parse_from(["gpu-flight", "--rows-per-endpoint", "0"]).is_err());
    }
}
