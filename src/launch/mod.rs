//! Starting the server from its configuration: what the `gpu-flight` binary does between
//! parsing its flags and serving, one step a file.
//!
//! [`serve`] finds everything that can be wrong with the configuration before anything
//! listens ([`crate::config`]'s checks, [`credentials`], [`exposure`]), then starts the
//! backend, binds ([`bind`]), opens the store, and serves until the shutdown future it was
//! given completes. Its [`Failure`] says which exit code and message the process ends with.
//! Process-wide concerns live beside it: [`allocator`] (an environment variable set by
//! re-executing, before anything else runs), [`signals`], [`reload`] (the token file on
//! SIGHUP), [`budgets`] (the open-file limit, and the budgets' log line), and [`tools`] (the
//! subcommands other than `serve`).

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;

use clap::ValueEnum;

use crate::auth::Auth;
use crate::config::{ConfigError, ServeArgs};
use crate::metrics::{self, Metrics};
use crate::server::{self, ServeOptions, TlsFiles};
use crate::store::Store;
use crate::task::AbortOnDrop;

pub mod allocator;
pub mod bind;
pub mod budgets;
pub mod credentials;
pub mod exposure;
pub mod reload;
pub mod signals;
pub mod tools;

/// Why [`serve`] ended without a clean stop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// The configuration cannot be served: nothing was served (exit code 2).
    Start(String),
    /// The server failed while serving (exit code 1).
    Serve(String),
}

impl Failure {
    /// The exit code the process ends with.
    pub fn exit_code(&self) -> ExitCode {
        match self {
            Self::Start(_) => ExitCode::from(2),
            Self::Serve(_) => ExitCode::FAILURE,
        }
    }
}

/// The line written to standard error, after `gpu-flight: `.
impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Start(message) => f.write_str(message),
            Self::Serve(message) => write!(f, "server failed: {message}"),
        }
    }
}

impl From<ConfigError> for Failure {
    fn from(error: ConfigError) -> Self {
        Self::Start(error.0)
    }
}

/// Serves `args` until the future `shutdown` returns completes. `shutdown` is called once
/// everything is bound and before the server says it serves, so that a signal handler it
/// installs is in place when a supervisor reads the `serving on` line.
pub async fn serve<F>(args: ServeArgs, shutdown: impl FnOnce() -> F) -> Result<(), Failure>
where
    F: Future<Output = ()> + Send,
{
    // Everything that can be wrong with the configuration is found before anything listens.
    args.validate()?;
    let auth = credentials::load_auth(&args).map_err(Failure::Start)?;
    let tls = credentials::load_tls(&args).map_err(Failure::Start)?;
    let mutual = tls.as_ref().is_some_and(TlsFiles::is_mutual);
    let addresses = bind::ListenAddresses::resolve(&args.listen)
        .await
        .map_err(Failure::Start)?;
    let authenticated = auth.is_on() || mutual;
    exposure::check(
        &addresses.tcp,
        authenticated,
        tls.is_some(),
        args.allow_unauthenticated,
    )
    .map_err(Failure::Start)?
    .warn();

    let backend =
        crate::backend::select(args.backend, &args.gpus(), args.host_devices).map_err(|error| {
            let choice = args
                .backend
                .to_possible_value()
                .map_or_else(String::new, |value| value.get_name().to_owned());
            Failure::Start(format!(
                "cannot start the backend (--backend {choice}): {error}"
            ))
        })?;
    let host_memory = crate::backend::host_memory_bytes();
    let capacity =
        args.check_capacity(&backend.devices(), host_memory, backend.holds_host_memory())?;
    for warning in capacity {
        tracing::warn!("{warning}");
    }
    let pinned = args.pinned_host_memory_bytes(host_memory);
    if !backend.holds_host_memory() {
        let available = crate::backend::host_memory_available();
        let pinnable = crate::config::pinnable(pinned, available);
        if pinnable < pinned {
            tracing::warn!(
                asked = pinned,
                available,
                pinning = pinnable,
                "less host memory is free than --pinned-host-memory asks to pin (pinned memory \
                 is never given back): pinning at most half of what is free"
            );
        }
        backend.pin_host_memory(pinnable);
    } else if args.pinned_host_memory.is_some() && pinned > 0 {
        // `--backend auto` on a machine without a GPU: validation let it through.
        tracing::warn!(
            "--pinned-host-memory is ignored: the host backend has no transfers to pin it for"
        );
    }
    let listeners = addresses.bind().await.map_err(Failure::Start)?;
    let metrics_listener = bind::bind_side(args.metrics_listen.as_deref(), "--metrics-listen")
        .await
        .map_err(Failure::Start)?;
    let health_listener = bind::bind_side(args.health_listen.as_deref(), "--health-listen")
        .await
        .map_err(Failure::Start)?;
    let shared_memory = bind::bind_shared_memory(args.shm_socket.as_deref())
        .await
        .map_err(Failure::Start)?;

    // Signal handlers go in before the server says it serves: a SIGTERM that a supervisor
    // sends as soon as it reads that line must shut down cleanly, not kill the process.
    let shutdown = shutdown();
    // Tasks this call starts end with it (`AbortOnDrop`), whichever way it returns: a caller
    // that serves again in the same process finds its ports and memory free.
    let _reloader = match &auth {
        Auth::Tokens(authenticator) => signals::hangups().map(|hangups| {
            AbortOnDrop(tokio::spawn(reload::reload_on(
                Arc::clone(authenticator),
                hangups,
            )))
        }),
        Auth::Off => None,
    };
    let backend_name = backend.name();
    // Loaded before the server says it serves: a client never sees a catalog still filling.
    let store = Store::open(backend, args.store_options())
        .await
        .map_err(|error| Failure::Start(error.to_string()))?;
    let metrics = Metrics::new(store.clone());
    let serve_options = budgets::connection_budget(args.serve_options());
    budgets::log_budgets(&args, &store, &serve_options);
    for listener in &listeners {
        let tls = tls.is_some() && !listener.is_unix();
        let location = listener
            .location(tls)
            .map_err(|e| Failure::Start(e.to_string()))?;
        // Scripts and tests read this line to learn the port when listening on port 0.
        println!("gpu-flight serving on {location} (backend: {backend_name})");
        tracing::info!(%location, backend = backend_name, tls, mutual_tls = mutual && tls, "serving");
    }
    if let Some(address) = health_listener.as_ref().and_then(|l| l.local_addr().ok()) {
        println!("gpu-flight health on grpc://{address}");
    }
    if let Some((_, path)) = shared_memory.as_ref().and_then(|l| l.unix()) {
        println!("gpu-flight shared memory on {}", path.display());
    }
    let _metrics_task = metrics_listener.map(|listener| {
        if let Ok(address) = listener.local_addr() {
            println!("gpu-flight metrics on http://{address}/metrics");
        }
        let metrics = Arc::clone(&metrics);
        AbortOnDrop(tokio::spawn(metrics::serve(
            listener,
            metrics,
            std::future::pending(),
        )))
    });
    let _ = std::io::stdout().flush();

    let options = ServeOptions {
        tls,
        auth,
        metrics: Some(metrics),
        ..serve_options
    };
    let listeners = server::Listeners {
        flight: listeners,
        health: health_listener,
        shared_memory,
    };
    let served = server::run(listeners, store.clone(), options, shutdown).await;
    // Changes acknowledged under --durability async reach the disk before the process ends.
    store.close().await;
    served.map_err(|error| Failure::Serve(error.to_string()))
}
