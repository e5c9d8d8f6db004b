//! The `gpu-flight` binary: flags → tracing → credentials and TLS → listeners → backend →
//! store → server.

use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use gpu_flight::auth::{self, Auth, Authenticator};
use gpu_flight::config::{self, Cli, Command, ConfigError, LogFormat, ServeArgs};
use gpu_flight::metrics::{self, Metrics};
use gpu_flight::server::{self, ListenAddr, Listener, ServeOptions, TlsFiles};
use gpu_flight::store::Store;
use tokio::net::TcpListener;
use tracing_subscriber::EnvFilter;

/// Flight streams allocate and free megabyte-sized message buffers continuously; mimalloc
/// reuses them instead of returning them to the OS and faulting fresh pages in every time,
/// which the system allocator does for allocations this large.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    keep_freed_memory();
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

/// How long mimalloc keeps freed memory before returning it to the operating system, unless
/// `MIMALLOC_PURGE_DELAY` says otherwise.
const PURGE_DELAY_MS: &str = "10000";

/// A data server frees and allocates gigabytes a second (receive buffers, decoded batches).
/// When the allocator hands freed memory back to the kernel at once, the next allocation faults
/// its pages in again and the kernel zeroes them: measured on a 16-core machine, eight clients'
/// puts ran 20-40% slower than with freed memory kept for reuse. Idle memory still goes back
/// after `PURGE_DELAY_MS`. mimalloc reads its options from the environment before `main` runs,
/// and its setter is foreign code, so when the variable is unset the process sets it and
/// replaces itself with a fresh image of the same binary (as the JDK launcher does for
/// `LD_LIBRARY_PATH`). If that fails, it carries on with mimalloc's default.
fn keep_freed_memory() {
    const VARIABLE: &str = "MIMALLOC_PURGE_DELAY";
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        if std::env::var_os(VARIABLE).is_some() {
            return;
        }
        let Ok(binary) = std::env::current_exe() else {
            return;
        };
        let mut args = std::env::args_os();
        let name = args
            .next()
            .unwrap_or_else(|| binary.clone().into_os_string());
        // Under an ELF interpreter (ld.so, valgrind, qemu-user) the executable is the
        // interpreter, which would be run instead: keep mimalloc's default there.
        if std::path::Path::new(&name).file_name() != binary.file_name() {
            return;
        }
        // Returns only if the exec failed.
        let _error = std::process::Command::new(&binary)
            .arg0(name)
            .args(args)
            .env(VARIABLE, PURGE_DELAY_MS)
            .exec();
    }
}

async fn run() -> ExitCode {
    let args = match Cli::parse().into_serve_args() {
        Ok(args) => args,
        Err(command) => return tool(*command),
    };
    init_tracing(args.log_format);
    match serve(args).await {
        Ok(()) => {
            tracing::info!("stopped");
            ExitCode::SUCCESS
        }
        Err(Failure::Start(message)) => {
            eprintln!("gpu-flight: {message}");
            ExitCode::from(2)
        }
        Err(Failure::Serve(message)) => {
            eprintln!("gpu-flight: server failed: {message}");
            ExitCode::FAILURE
        }
    }
}

enum Failure {
    /// The configuration cannot be served (exit code 2).
    Start(String),
    Serve(String),
}

async fn serve(args: ServeArgs) -> Result<(), Failure> {
    // Everything that can be wrong with the configuration is found before anything listens.
    args.validate().map_err(start)?;
    let auth = match &args.auth_tokens {
        Some(path) => {
            let ttl = Duration::from_secs(args.session_hours * 3600);
            let authenticator =
                Authenticator::load(path, ttl).map_err(|e| Failure::Start(e.to_string()))?;
            let loaded = authenticator.loaded();
            tracing::info!(
                path = %path.display(),
                tokens = loaded.tokens,
                users = loaded.users,
                "authentication on"
            );
            if let Some(warning) =
                config::check_token_file(loaded, path, args.allow_unauthenticated).map_err(start)?
            {
                tracing::warn!("{warning}");
            }
            Auth::Tokens(Arc::new(authenticator))
        }
        None => Auth::Off,
    };
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => {
            Some(TlsFiles::load(cert, key, args.tls_client_ca.as_deref()).map_err(Failure::Start)?)
        }
        _ => None,
    };
    let mutual = tls.as_ref().is_some_and(TlsFiles::is_mutual);
    let (addresses, sockets) = listen_addresses(&args.listen)
        .await
        .map_err(Failure::Start)?;
    check_exposure(&args, &addresses, auth.is_on() || mutual, tls.is_some())?;

    let backend = gpu_flight::backend::select(args.backend, &args.gpus(), args.host_devices)
        .map_err(|error| {
            let choice = args
                .backend
                .to_possible_value()
                .map_or_else(String::new, |value| value.get_name().to_owned());
            Failure::Start(format!(
                "cannot start the backend (--backend {choice}): {error}"
            ))
        })?;
    let capacity = args
        .check_capacity(
            &backend.devices(),
            gpu_flight::backend::host_memory_bytes(),
            backend.holds_host_memory(),
        )
        .map_err(start)?;
    for warning in capacity {
        tracing::warn!("{warning}");
    }
    let mut listeners: Vec<Listener> = Vec::new();
    for address in &addresses {
        let listener = Listener::bind_tcp(*address, "--listen")
            .await
            .map_err(Failure::Start)?;
        listeners.push(listener.into());
    }
    for path in &sockets {
        let listener = Listener::bind_unix(path).await.map_err(|error| {
            Failure::Start(format!(
                "cannot listen on unix://{}: {error}",
                path.display()
            ))
        })?;
        listeners.push(listener);
    }
    let metrics_listener = bind_one(args.metrics_listen.as_deref(), "--metrics-listen").await?;
    let health_listener = bind_one(args.health_listen.as_deref(), "--health-listen").await?;

    // Signal handlers go in before the server says it serves: a SIGTERM that a supervisor
    // sends as soon as it reads that line must shut down cleanly, not kill the process.
    let shutdown = shutdown_signal();
    let _reloader = match &auth {
        Auth::Tokens(authenticator) => reload_on_hangup(Arc::clone(authenticator)),
        Auth::Off => None,
    };
    let backend_name = backend.name();
    // Loaded before the server says it serves: a client never sees a catalog still filling.
    let store = Store::open(backend, args.store_options())
        .await
        .map_err(|error| Failure::Start(error.to_string()))?;
    let metrics = Metrics::new(store.clone());
    let serve_options = connection_budget(args.serve_options());
    log_budgets(&args, &store, &serve_options);
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
    let _metrics_task = metrics_listener.map(|listener| {
        if let Ok(address) = listener.local_addr() {
            println!("gpu-flight metrics on http://{address}/metrics");
        }
        let metrics = Arc::clone(&metrics);
        tokio::spawn(metrics::serve(listener, metrics, std::future::pending()))
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
    };
    let served = server::run(listeners, store.clone(), options, shutdown).await;
    // Changes acknowledged under --durability async reach the disk before the process ends.
    store.close().await;
    served.map_err(|error| Failure::Serve(error.to_string()))
}

/// The subcommands that help set up authentication.
fn tool(command: Command) -> ExitCode {
    match command {
        Command::Serve(_) => ExitCode::SUCCESS,
        Command::HashPassword => {
            let mut password = String::new();
            if std::io::stdin().is_terminal() {
                eprintln!("password (echoed; pipe it in to avoid that):");
            }
            if let Err(error) = std::io::stdin().read_line(&mut password) {
                eprintln!("gpu-flight: cannot read the password: {error}");
                return ExitCode::from(2);
            }
            let password = password.trim_end_matches(['\r', '\n']);
            if password.is_empty() {
                eprintln!("gpu-flight: the password is empty");
                return ExitCode::from(2);
            }
            match auth::hash_password(password) {
                Ok(hash) => {
                    println!("{hash}");
                    ExitCode::SUCCESS
                }
                Err(error) => {
                    eprintln!("gpu-flight: cannot hash the password: {error}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::NewToken { principal, role } => match auth::new_token() {
            Ok((token, digest)) => {
                let role = auth::Role::from(role);
                println!(
                    "[[tokens]]\nprincipal = {principal:?}\nrole = \"{role}\"\nsha256 = \"{digest}\""
                );
                eprintln!(
                    "bearer token for {principal:?} (shown once; the file keeps only its hash):"
                );
                eprintln!("{token}");
                ExitCode::SUCCESS
            }
            Err(error) => {
                eprintln!("gpu-flight: cannot make a token: {error}");
                ExitCode::FAILURE
            }
        },
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

/// The listener of a flag that takes one address (the first it resolves to), if given.
async fn bind_one(spec: Option<&str>, flag: &str) -> Result<Option<TcpListener>, Failure> {
    let Some(spec) = spec else {
        return Ok(None);
    };
    let address = *resolve(&[spec.to_owned()])
        .await
        .map_err(|error| Failure::Start(format!("{flag}: {error}")))?
        .first()
        .ok_or_else(|| Failure::Start(format!("{flag} {spec} resolves to no address")))?;
    let listener = Listener::bind_tcp(address, flag)
        .await
        .map_err(Failure::Start)?;
    if let Some(warning) = config::exposed_listener_warning(flag, address) {
        tracing::warn!("{warning}");
    }
    Ok(Some(listener))
}

/// A configuration error, as the start fails with it.
fn start(error: ConfigError) -> Failure {
    Failure::Start(error.to_string())
}

/// One line with every budget the server runs with, as chosen from the flags and the machine:
/// what an operator checks first when memory or connections run out.
fn log_budgets(args: &ServeArgs, store: &Store, options: &ServeOptions) {
    let status = store.status();
    let memory_limits: Vec<String> = status
        .devices
        .iter()
        .map(|device| {
            device
                .limit_bytes
                .map_or("unlimited".to_owned(), |b| b.to_string())
        })
        .collect();
    tracing::info!(
        // Device by device, in the order puts and endpoints number them.
        memory_limit_bytes = %memory_limits.join(","),
        host_memory_limit_bytes = status.tiers.host_limit_bytes,
        max_message_bytes = options.flight.max_message_bytes,
        max_put_message_bytes = options.flight.max_put_message_bytes,
        max_request_bytes = options.flight.max_request_bytes,
        max_connections = options.connections.max_connections,
        max_streams_per_connection = options.max_streams_per_connection,
        data_dir = %args.data_dir.as_ref().map_or("none".into(), |dir| dir.display().to_string()),
        durability = if args.data_dir.is_some() {
            format!("{:?}", args.durability).to_lowercase()
        } else {
            "none (nothing is written to disk)".to_owned()
        },
        "budgets"
    );
}

/// The TCP addresses and Unix socket paths the `--listen` values name, in order, without
/// repeats.
async fn listen_addresses(specs: &[String]) -> Result<(Vec<SocketAddr>, Vec<PathBuf>), String> {
    let mut tcp = Vec::new();
    let mut unix = Vec::new();
    for spec in specs {
        match ListenAddr::parse(spec)? {
            ListenAddr::Tcp(spec) => tcp.push(spec),
            ListenAddr::Unix(path) if !unix.contains(&path) => unix.push(path),
            ListenAddr::Unix(_) => {}
        }
    }
    let addresses = if tcp.is_empty() {
        Vec::new()
    } else {
        resolve(&tcp).await?
    };
    Ok((addresses, unix))
}

/// Every address the `HOST:PORT` values name, in order, without repeats.
async fn resolve(specs: &[String]) -> Result<Vec<SocketAddr>, String> {
    let mut addresses = Vec::new();
    for spec in specs {
        let resolved = tokio::net::lookup_host(spec.as_str()).await.map_err(|error| {
            format!(
                "cannot resolve the listen address {spec:?} ({error}); it is HOST:PORT, such as \
                 127.0.0.1:8815, localhost:8815 or [::1]:8815 (or unix:///path/to.sock)"
            )
        })?;
        for address in resolved {
            if !addresses.contains(&address) {
                addresses.push(address);
            }
        }
    }
    if addresses.is_empty() {
        return Err("no address to listen on".to_owned());
    }
    Ok(addresses)
}

/// Redis' protected mode, for Flight: without authentication, only loopback addresses,
/// unless the operator says otherwise (and then a warning).
fn check_exposure(
    args: &ServeArgs,
    addresses: &[SocketAddr],
    authenticated: bool,
    tls: bool,
) -> Result<(), Failure> {
    let exposed: Vec<String> = addresses
        .iter()
        .filter(|address| !address.ip().is_loopback())
        .map(ToString::to_string)
        .collect();
    if exposed.is_empty() {
        return Ok(());
    }
    let exposed = exposed.join(", ");
    if !authenticated {
        if !args.allow_unauthenticated {
            return Err(Failure::Start(format!(
                "refusing to listen on {exposed} without authentication: anyone who can connect \
                 could read, replace and drop every dataset. Give --auth-tokens FILE (or \
                 --tls-client-ca for mutual TLS), listen on a loopback address (127.0.0.1, \
                 [::1], localhost), or add --allow-unauthenticated if a firewall or network \
                 policy already limits who can connect."
            )));
        }
        tracing::warn!(
            addresses = %exposed,
            "serving WITHOUT authentication on addresses other hosts may reach \
             (--allow-unauthenticated): anyone who can connect may read, replace and drop every \
             dataset"
        );
    } else if !tls {
        tracing::warn!(
            addresses = %exposed,
            "authentication without TLS: tokens and passwords cross the network in clear text; \
             give --tls-cert and --tls-key"
        );
    }
    Ok(())
}

/// Reads the token file again on each SIGHUP. A file that fails to load is logged and the
/// previous one stays in force.
fn reload_on_hangup(authenticator: Arc<Authenticator>) -> Option<tokio::task::JoinHandle<()>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut hangups = match signal(SignalKind::hangup()) {
            Ok(hangups) => hangups,
            Err(error) => {
                tracing::warn!(%error, "cannot listen for SIGHUP; the token file will not be reloaded");
                return None;
            }
        };
        Some(tokio::spawn(async move {
            while hangups.recv().await.is_some() {
                match authenticator.reload() {
                    Ok(loaded) => tracing::info!(
                        path = %authenticator.path().display(),
                        tokens = loaded.tokens,
                        users = loaded.users,
                        "token file reloaded"
                    ),
                    Err(error) => tracing::error!(
                        %error,
                        "token file NOT reloaded; the previous one stays in force"
                    ),
                }
            }
        }))
    }
    #[cfg(not(unix))]
    {
        let _ = authenticator;
        None
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

/// Listens for SIGINT and SIGTERM from this call on, and returns a future that completes on
/// the first of them. (`tokio::signal::ctrl_c` would install its handler only when polled.)
fn shutdown_signal() -> impl Future<Output = ()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let interrupt = signal(SignalKind::interrupt());
        let terminate = signal(SignalKind::terminate());
        async move {
            match (interrupt, terminate) {
                (Ok(mut interrupt), Ok(mut terminate)) => {
                    tokio::select! {
                        _ = interrupt.recv() => {}
                        _ = terminate.recv() => {}
                    }
                }
                (Ok(mut only), Err(error)) | (Err(error), Ok(mut only)) => {
                    tracing::warn!(%error, "cannot listen for one of SIGINT and SIGTERM");
                    only.recv().await;
                }
                (Err(error), Err(_)) => {
                    tracing::warn!(%error, "cannot listen for SIGINT or SIGTERM; stop the server by killing it");
                    std::future::pending::<()>().await;
                }
            }
        }
    }
    #[cfg(not(unix))]
    {
        async {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
