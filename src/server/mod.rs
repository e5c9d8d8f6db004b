//! The gRPC server: Flight plus the standard health service, with TLS, connection limits and
//! graceful shutdown.
//!
//! Connections come first (`listener`, `connection`, `tls`, `peer`); then each Flight request
//! passes the layers that every method shares (`endpoint` assembles them: `accounting`,
//! `authenticate`, `limits`, `panics`) before arrow-flight's generated server hands it to its
//! handler. `shared` serves the side channel of shared-memory reads, beside gRPC.
//!
//! The health service answers without authentication, so that Kubernetes' gRPC probes work on
//! a server that requires tokens; it tells nothing but whether the server is serving. Probes
//! cannot speak TLS either, so [`Listeners::health`] serves that one service, alone and in
//! plain text, on a listener of its own.
//!
//! [`run`] serves until its `shutdown` future completes. Then new requests are refused
//! (UNAVAILABLE, and health reports NOT_SERVING), streams already running get `grace` to
//! finish, and the function returns. Tests pass their own shutdown future; `launch::serve` passes
//! SIGINT/SIGTERM.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tonic::transport::Server;

mod accounting;
mod authenticate;
mod connection;
mod endpoint;
mod limits;
mod listener;
mod method;
mod panics;
mod peer;
mod shared;
mod tls;
mod unix_authority;

pub use connection::ConnectionLimits;
pub use endpoint::{DoGetEncoder, DoPutDecoder};
pub use listener::{ListenAddr, Listener};
pub use peer::{ConnectionInfo, ConnectionStreams, Peer};
pub use tls::TlsFiles;

use crate::auth::Auth;
use crate::flight::{FlightOptions, Lifecycle};
use crate::metrics::Metrics;
use crate::store::Store;
use crate::task::AbortOnDrop;

/// Where [`run`] accepts connections.
#[derive(Debug)]
pub struct Listeners {
    /// Flight and health: TCP with TLS when configured, Unix sockets always in plain text
    /// (they never leave the host; their file permissions decide who connects).
    pub flight: Vec<Listener>,
    /// Only the gRPC health service, always plain text: for probes that can neither
    /// authenticate nor speak TLS (the kubelet's).
    pub health: Option<TcpListener>,
    /// The Unix socket of shared-memory reads' side channel (`--shm-socket`); `None`: the
    /// server offers no shared memory.
    pub shared_memory: Option<Listener>,
}

impl From<Vec<TcpListener>> for Listeners {
    fn from(flight: Vec<TcpListener>) -> Self {
        Self {
            flight: flight.into_iter().map(Listener::from).collect(),
            health: None,
            shared_memory: None,
        }
    }
}

/// Everything [`run`] needs besides the listeners and the store.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub flight: FlightOptions,
    /// How long running streams may take to finish after shutdown begins.
    pub grace: Duration,
    pub connections: ConnectionLimits,
    /// Streams a client may have open on one connection (HTTP/2 SETTINGS).
    pub max_streams_per_connection: u32,
    /// How often a connection is pinged, and how long an answer may take before the connection
    /// is dropped: its puts abandoned, its reads stopped.
    pub keepalive_interval: Duration,
    pub keepalive_timeout: Duration,
    /// Serve TLS (and mutual TLS) with these files.
    pub tls: Option<TlsFiles>,
    /// How callers are authenticated.
    pub auth: Auth,
    /// Where calls and connections are counted.
    pub metrics: Option<Arc<Metrics>>,
    /// How `DoGet` replies are encoded (`--doget-encoder`, hidden: for measuring).
    pub doget_encoder: DoGetEncoder,
    /// How `DoPut` messages are read (`--doput-decoder`, hidden: for measuring).
    pub doput_decoder: DoPutDecoder,
    /// HTTP/2 windows and frame size.
    pub http2: Http2Settings,
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            flight: FlightOptions::default(),
            grace: Duration::from_secs(30),
            connections: ConnectionLimits::default(),
            max_streams_per_connection: 100,
            keepalive_interval: Duration::from_secs(20),
            keepalive_timeout: Duration::from_secs(10),
            tls: None,
            auth: Auth::Off,
            metrics: None,
            doget_encoder: DoGetEncoder::default(),
            doput_decoder: DoPutDecoder::default(),
            http2: Http2Settings::default(),
        }
    }
}

/// HTTP/2 flow-control windows. The defaults (64 KiB) stall bulk transfers on round trips;
/// these let a stream keep several messages in flight.
const STREAM_WINDOW_BYTES: u32 = 16 << 20;
const CONNECTION_WINDOW_BYTES: u32 = 64 << 20;
/// Largest HTTP/2 frame clients may send us. The default, 16 KiB, splits an 8 MiB record
/// batch into 512 frames, each parsed, queued and copied on its own. (What we send is bounded
/// by the client's own setting: pyarrow's gRPC advertises 4 MiB.)
const MAX_FRAME_BYTES: u32 = 1 << 20;

/// The HTTP/2 settings the server advertises (hidden `--h2-*` flags, for measuring).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Http2Settings {
    pub stream_window_bytes: u32,
    pub connection_window_bytes: u32,
    pub max_frame_bytes: u32,
    /// hyper's BDP-estimating window instead of the fixed ones.
    pub adaptive_window: bool,
}

impl Default for Http2Settings {
    fn default() -> Self {
        Self {
            stream_window_bytes: STREAM_WINDOW_BYTES,
            connection_window_bytes: CONNECTION_WINDOW_BYTES,
            max_frame_bytes: MAX_FRAME_BYTES,
            adaptive_window: false,
        }
    }
}
/// Time clients get to read the end of their replies before connections close at shutdown.
const CLOSE_LINGER: Duration = Duration::from_millis(500);
/// How often expired `ipc-export` leases are looked for: a lease ends at most this late.
const LEASE_REAPER_PERIOD: Duration = Duration::from_millis(250);
/// Connections open at once on the health listener: probes open one at a time, and a flood
/// there must not cost the Flight clients their file descriptors.
const HEALTH_MAX_CONNECTIONS: usize = 16;

/// Serves Flight on `listeners` until `shutdown` completes, then drains.
pub async fn run(
    listeners: Listeners,
    store: Store,
    mut options: ServeOptions,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let lifecycle = Lifecycle::default();
    let _reaper = AbortOnDrop(store.spawn_lease_reaper(LEASE_REAPER_PERIOD));
    // Replies name the side channel's socket where one is served, and only then.
    options.flight.shared_memory.socket = listeners
        .shared_memory
        .as_ref()
        .and_then(|listener| listener.unix().map(|(_, path)| path.to_owned()));
    let _side_channel = listeners
        .shared_memory
        .map(|listener| AbortOnDrop(tokio::spawn(shared::serve(listener, store.clone()))));
    let (health, health_service) = tonic_health::server::health_reporter();
    let flight = endpoint::flight(
        store,
        options.flight,
        options.doget_encoder,
        options.doput_decoder,
        lifecycle.clone(),
        options.auth,
        options.metrics.clone(),
    );
    health
        .set_serving::<arrow_flight::flight_service_server::FlightServiceServer<()>>()
        .await;

    // Ends with this function, after Flight: it reports NOT_SERVING while streams drain.
    let _health_only = listeners.health.map(|listener| {
        let limits = ConnectionLimits {
            max_connections: HEALTH_MAX_CONNECTIONS,
            ..options.connections.clone()
        };
        let budget = connection::ConnectionBudget::new(HEALTH_MAX_CONNECTIONS);
        let incoming = connection::incoming(vec![listener.into()], limits, None, budget);
        AbortOnDrop(tokio::spawn(
            Server::builder()
                .add_service(health_service.clone())
                .serve_with_incoming(incoming),
        ))
    });

    // TCP listeners serve TLS when it is configured; Unix sockets are served by a second
    // server in plain text. Both share the Flight service, the connection budget and the
    // shutdown.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let budget = connection::ConnectionBudget::new(options.connections.max_connections);
    let (unix, tcp): (Vec<Listener>, Vec<Listener>) =
        listeners.flight.into_iter().partition(Listener::is_unix);
    let mut servers = Vec::new();
    for (group, tls) in [(tcp, options.tls.as_ref()), (unix, None)] {
        if group.is_empty() {
            continue;
        }
        let incoming = connection::incoming(
            group,
            options.connections.clone(),
            options.metrics.clone(),
            Arc::clone(&budget),
        );
        let mut stop = stop_rx.clone();
        let stopped = async move {
            let _ = stop.wait_for(|stop| *stop).await;
        };
        let router = Server::builder()
            .initial_stream_window_size(options.http2.stream_window_bytes)
            .initial_connection_window_size(options.http2.connection_window_bytes)
            .max_frame_size(options.http2.max_frame_bytes)
            .http2_adaptive_window(Some(options.http2.adaptive_window))
            .max_concurrent_streams(options.max_streams_per_connection)
            // Pings find clients that vanished or froze without closing their connection (a
            // dead node, a stopped process), so their puts are abandoned and what their
            // reads held is returned.
            .http2_keepalive_interval(Some(options.keepalive_interval))
            .http2_keepalive_timeout(Some(options.keepalive_timeout))
            .add_service(health_service.clone())
            .add_service(flight.clone());
        servers.push(AbortOnDrop(match tls {
            Some(tls) => {
                let incoming = tls::accept(
                    incoming,
                    tls.config(),
                    options.connections.handshake_timeout,
                );
                tokio::spawn(router.serve_with_incoming_shutdown(incoming, stopped))
            }
            None => tokio::spawn(router.serve_with_incoming_shutdown(incoming, stopped)),
        }));
    }
    // Dropping this future (after the grace period) aborts the servers.
    let mut server = Box::pin(async move {
        let ends = servers
            .iter_mut()
            .map(|server| async { flatten((&mut server.0).await) });
        futures::future::try_join_all(ends).await.map(drop)
    });

    tokio::select! {
        result = &mut server => return result,
        () = shutdown => {}
    }
    tracing::info!(
        grace_seconds = options.grace.as_secs(),
        "shutting down: refusing new requests, draining streams"
    );
    lifecycle.begin_shutdown();
    health
        .set_not_serving::<arrow_flight::flight_service_server::FlightServiceServer<()>>()
        .await;
    // The empty name is the whole server, which is what Kubernetes' gRPC probes ask about.
    health
        .set_service_status("", tonic_health::ServingStatus::NotServing)
        .await;
    // Close connections only once our streams are done, and a moment later: hyper closes a
    // connection as soon as its last reply is queued, and a socket closed with unread input
    // (the client's window updates) is reset, which can destroy reply bytes the client has not
    // read yet.
    let deadline = tokio::time::Instant::now() + options.grace;
    if tokio::time::timeout_at(deadline, lifecycle.drained())
        .await
        .is_ok()
    {
        tokio::time::sleep(CLOSE_LINGER).await;
    }
    let _ = stop_tx.send(true);
    match tokio::time::timeout_at(
        deadline.max(tokio::time::Instant::now() + CLOSE_LINGER),
        &mut server,
    )
    .await
    {
        Ok(result) => result,
        Err(_) => {
            tracing::warn!("streams still running after the grace period; closing them");
            Ok(())
        }
    }
}

fn flatten(
    joined: Result<Result<(), tonic::transport::Error>, tokio::task::JoinError>,
) -> Result<(), tonic::transport::Error> {
    match joined {
        Ok(result) => result,
        Err(join_error) => {
            tracing::warn!(%join_error, "server task ended abnormally");
            Ok(())
        }
    }
}
