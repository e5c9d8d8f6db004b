//! The `gpu-flight` binary: flags → tracing → [`launch::serve`] (credentials and TLS →
//! listeners → backend → store → server), or one of the subcommands that help set up
//! authentication.

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use gpu_flight::config::{Cli, LogFormat};
use gpu_flight::launch;
use tracing_subscriber::EnvFilter;

/// Flight streams allocate and free megabyte-sized message buffers continuously; mimalloc
/// reuses them instead of returning them to the OS and faulting fresh pages in every time,
/// which the system allocator does for allocations this large.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    // First: it may replace the process, which must happen before any thread starts.
    launch::allocator::keep_freed_memory();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("gpu-flight: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(run())
}

async fn run() -> ExitCode {
    let args = match Cli::parse().into_serve_args() {
        Ok(args) => args,
        Err(command) => return launch::tools::run(*command),
    };
    init_tracing(args.log_format);
    match launch::serve(args, launch::signals::shutdown).await {
        Ok(()) => {
            tracing::info!("stopped");
            ExitCode::SUCCESS
        }
        Err(failure) => {
            eprintln!("gpu-flight: {failure}");
            failure.exit_code()
        }
    }
}

fn init_tracing(format: LogFormat) {
    // h2 says at debug level, and nowhere else, why it resets a stream it finds malformed: a
    // gRPC 1.57+ client on the Unix socket sends the socket's %-encoded path as `:authority`,
    // which h2 refuses, and the client only sees INTERNAL. Its server events are rare.
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,h2::server=debug"));
    // Colour codes are for people at a terminal; in files and `kubectl logs` they are noise.
    let ansi = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}
