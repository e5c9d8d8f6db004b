//! The `gpu-flight` binary: flags → tracing → backend → store → server.

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;
use gpu_flight::config::Cli;
use gpu_flight::server::{self, ServeOptions};
use gpu_flight::store::Store;
use tracing_subscriber::EnvFilter;

/// Flight streams allocate and free megabyte-sized message buffers continuously; mimalloc
/// reuses them instead of returning them to the OS and faulting fresh pages in every time,
/// which the system allocator does for allocations this large.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> ExitCode {
    let args = Cli::parse().into_serve_args();
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();

    let backend = match gpu_flight::backend::select(args.backend, args.device) {
        Ok(backend) => backend,
        Err(error) => {
            eprintln!(
                "gpu-flight: cannot start the {:?} backend: {error}",
                args.backend
            );
            return ExitCode::from(2);
        }
    };
    let listener = match tokio::net::TcpListener::bind(args.listen).await {
        Ok(listener) => listener,
        Err(error) => {
            eprintln!("gpu-flight: cannot listen on {}: {error}", args.listen);
            return ExitCode::from(2);
        }
    };
    let address = listener
        .local_addr()
        .map_or_else(|_| args.listen.to_string(), |a| a.to_string());
    let backend_name = backend.name();
    let store = Store::new(backend, args.store_options());
    // Scripts and tests read this line to learn the port when listening on port 0.
    println!("gpu-flight serving on grpc://{address} (backend: {backend_name})");
    let _ = std::io::stdout().flush();
    tracing::info!(%address, backend = backend_name, "serving");

    let options = connection_budget(args.serve_options());
    match server::run(listener, store, options, shutdown_signal()).await {
        Ok(()) => {
            tracing::info!("stopped");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("gpu-flight: server failed: {error}");
            ExitCode::FAILURE
        }
    }
}

/// File descriptors kept for everything but client connections: the listener, logs, the
/// driver's, the runtime's.
const RESERVED_FILES: u64 = 64;

/// Raises the open-file limit as far as the hard limit allows, and keeps `--max-connections`
/// under it: a connection limit above the file limit does not limit anything.
fn connection_budget(mut options: ServeOptions) -> ServeOptions {
    let files = match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(files) => files,
        Err(error) => {
            tracing::warn!(%error, "cannot read or raise the open-file limit");
            return options;
        }
    };
    let wanted = options.connections.max_connections as u64;
    let possible = files.saturating_sub(RESERVED_FILES).max(1);
    if wanted > possible {
        tracing::warn!(
            max_connections = wanted,
            open_file_limit = files,
            "--max-connections is above what the open-file limit allows; using {possible}"
        );
        options.connections.max_connections = usize::try_from(possible).unwrap_or(usize::MAX);
    }
    options
}

/// Completes on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut terminate) => {
                tokio::select! {
                    _ = interrupt => {}
                    _ = terminate.recv() => {}
                }
            }
            Err(_) => {
                let _ = interrupt.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = interrupt.await;
    }
}
