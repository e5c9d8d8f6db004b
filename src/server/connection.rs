//! Connections: how many, how long they may say nothing, and what happens when accept fails.
//!
//! tonic's own listener accepts without bound and retries accept errors at once, so a client
//! that opens a thousand idle sockets exhausts the process's file descriptors and the accept
//! loop then spins on EMFILE. [`incoming`] instead:
//!
//! - holds one permit of a semaphore per open connection. When all are taken, a new connection
//!   evicts the least useful one: one that has not finished its HTTP/2 preface (the oldest),
//!   else the one idle longest (no call open; gRPC clients reconnect by themselves). Only when
//!   every connection has a call in progress is the new one closed (a warning, at most one a
//!   minute). Silent or idle sockets therefore never lock real clients out;
//! - logs accept errors once per burst and backs off (10 ms, doubling to 1 s) until accept
//!   works again.
//!
//! Each [`Connection`] closes itself when its client has not sent the HTTP/2 preface within the
//! handshake timeout, or has had no open stream for the idle timeout. Streams are counted by the
//! accounting layer ([`ConnectionStreams`]), which finds them in each request's extensions through
//! tonic's `Connected` mechanism.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use std::sync::Weak;
use std::sync::atomic::{AtomicBool, Ordering};

use futures::task::AtomicWaker;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tonic::transport::server::Connected;

use super::listener::{Listener, Socket};
use super::peer::{ConnectionInfo, ConnectionStreams, Peer};
use crate::metrics::{ConnectionGauge, Metrics};

/// Length of the HTTP/2 connection preface every client sends first.
const PREFACE_BYTES: usize = 24;
const FIRST_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_secs(1);
/// Connections refused at the limit are logged at most this often.
const REFUSAL_LOG_PERIOD: Duration = Duration::from_secs(60);
/// How long a new connection waits for the slot of the connection it evicted.
const EVICTION_WAIT: Duration = Duration::from_secs(1);

/// Bounds on connections.
#[derive(Debug, Clone)]
pub struct ConnectionLimits {
    /// Connections open at once; more are closed as soon as they are accepted.
    pub max_connections: usize,
    /// Time a new connection has to send the HTTP/2 preface.
    pub handshake_timeout: Duration,
    /// Time a connection may stay open with no stream.
    pub idle_timeout: Duration,
    /// Time a write to the client may stay blocked (a peer that reads nothing: a stopped
    /// process, a dead node) before the connection is dropped. Keepalive alone cannot do it:
    /// closing a connection needs a write too.
    pub write_stall_timeout: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            max_connections: 1000,
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(300),
            write_stall_timeout: Duration::from_secs(30),
        }
    }
}

/// A budget of connections that several acceptors may share (TCP and Unix listeners are served
/// by two servers): one permit a connection, and the connections open, from which a full
/// budget evicts whichever acceptor's connection is least useful.
#[derive(Debug)]
pub(crate) struct ConnectionBudget {
    permits: Arc<Semaphore>,
    /// The connections handed out; dead entries are pruned as they are found.
    open: std::sync::Mutex<Vec<Weak<Shared>>>,
}

impl ConnectionBudget {
    pub(crate) fn new(max_connections: usize) -> Arc<Self> {
        Arc::new(Self {
            permits: Arc::new(Semaphore::new(max_connections)),
            open: std::sync::Mutex::default(),
        })
    }

    fn open(&self) -> std::sync::MutexGuard<'_, Vec<Weak<Shared>>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The connections `listeners` accept, each counted in `budget` (of `limits.max_connections`).
/// Never ends and never fails: accept errors are logged and retried after a pause.
pub(crate) fn incoming(
    listeners: Vec<Listener>,
    limits: ConnectionLimits,
    metrics: Option<Arc<Metrics>>,
    budget: Arc<ConnectionBudget>,
) -> impl Stream<Item = Result<Connection, io::Error>> {
    let state = Acceptor {
        listeners,
        next_listener: 0,
        metrics,
        permits: Arc::clone(&budget.permits),
        budget,
        limits,
        backoff: None,
        last_refusal_log: None,
        refused: 0,
    };
    futures::stream::unfold(state, |mut state| async move {
        let connection = state.next().await;
        Some((Ok(connection), state))
    })
}

struct Acceptor {
    listeners: Vec<Listener>,
    /// The listener asked first next time, so that a busy one cannot starve the others.
    next_listener: usize,
    metrics: Option<Arc<Metrics>>,
    permits: Arc<Semaphore>,
    limits: ConnectionLimits,
    /// The pause after the last accept error, while accept keeps failing.
    backoff: Option<Duration>,
    last_refusal_log: Option<Instant>,
    /// Connections refused since the last log line about them.
    refused: u64,
    /// Shared with the other acceptors: the connections open, for eviction.
    budget: Arc<ConnectionBudget>,
}

impl Acceptor {
    /// The next connection any listener accepts.
    async fn accept(&mut self) -> io::Result<(Socket, Peer)> {
        std::future::poll_fn(|cx| {
            let count = self.listeners.len();
            for offset in 0..count {
                let index = (self.next_listener + offset) % count;
                if let Poll::Ready(accepted) = self.listeners[index].poll_accept(cx) {
                    self.next_listener = (index + 1) % count;
                    return Poll::Ready(accepted);
                }
            }
            Poll::Pending
        })
        .await
    }

    async fn next(&mut self) -> Connection {
        loop {
            let (socket, peer) = match self.accept().await {
                Ok(accepted) => accepted,
                Err(error) => {
                    self.accept_failed(error).await;
                    continue;
                }
            };
            if let Some(pause) = self.backoff.take() {
                tracing::info!(
                    last_pause_ms = pause.as_millis() as u64,
                    "accepting connections again"
                );
            }
            let permit = match Arc::clone(&self.permits).try_acquire_owned() {
                Ok(permit) => Some(permit),
                Err(_) if self.evict_one() => {
                    tokio::time::timeout(EVICTION_WAIT, Arc::clone(&self.permits).acquire_owned())
                        .await
                        .ok()
                        .and_then(Result::ok)
                }
                Err(_) => None,
            };
            match permit {
                Some(permit) => {
                    let gauge = self.metrics.as_ref().map(Metrics::connection_opened);
                    let connection = Connection::new(socket, peer, permit, &self.limits, gauge);
                    let mut open = self.budget.open();
                    open.retain(|c| c.strong_count() > 0);
                    open.push(Arc::downgrade(&connection.shared));
                    drop(open);
                    return connection;
                }
                None => self.refuse(socket, peer),
            }
        }
    }

    /// Closes the open connection a new one is most worth more than: the oldest that has not
    /// finished its preface, else the one idle longest. False when every connection is busy.
    fn evict_one(&mut self) -> bool {
        let open: Vec<Arc<Shared>> = {
            let mut open = self.budget.open();
            open.retain(|c| c.strong_count() > 0);
            open.iter().filter_map(Weak::upgrade).collect()
        };
        let victim = open
            .iter()
            .filter(|c| !c.evicted.load(Ordering::Acquire))
            .filter_map(|c| {
                let silent = !c.handshaken.load(Ordering::Acquire);
                let since = if silent {
                    Some(c.accepted)
                } else {
                    c.streams.idle_since().map(Instant::from_std)
                };
                // Silent connections go before idle ones, older before newer.
                since.map(|since| ((!silent, since), c))
            })
            .min_by_key(|(key, _)| *key)
            .map(|(_, c)| c);
        match victim {
            Some(victim) => {
                tracing::debug!(peer = %victim.peer, "evicting a connection to admit a new one");
                victim.evicted.store(true, Ordering::Release);
                victim.waker.wake();
                true
            }
            None => false,
        }
    }

    /// Errors that concern one connection (it was reset before we took it) are skipped; the
    /// rest (out of file descriptors or memory) are logged once and backed off, so the loop
    /// never spins while the condition lasts.
    async fn accept_failed(&mut self, error: io::Error) {
        if matches!(
            error.kind(),
            io::ErrorKind::ConnectionAborted
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::Interrupted
        ) {
            return;
        }
        let pause = match self.backoff {
            None => {
                tracing::warn!(
                    %error,
                    open_connections = self.limits.max_connections - self.permits.available_permits(),
                    "accepting connections failed; retrying with backoff (raise the open-file \
                     limit, `ulimit -n`, or lower --max-connections)"
                );
                FIRST_BACKOFF
            }
            Some(last) => (last * 2).min(MAX_BACKOFF),
        };
        self.backoff = Some(pause);
        tokio::time::sleep(pause).await;
    }

    fn refuse(&mut self, socket: Socket, peer: Peer) {
        drop(socket);
        self.refused += 1;
        let now = Instant::now();
        if self
            .last_refusal_log
            .is_none_or(|last| now.duration_since(last) >= REFUSAL_LOG_PERIOD)
        {
            tracing::warn!(
                %peer,
                refused = self.refused,
                max_connections = self.limits.max_connections,
                "connection limit reached: closing new connections (--max-connections)"
            );
            self.last_refusal_log = Some(now);
            self.refused = 0;
        }
    }
}

/// What the acceptor knows of a connection it handed out, and how it asks one to close.
#[derive(Debug)]
struct Shared {
    streams: Arc<ConnectionStreams>,
    peer: Peer,
    accepted: Instant,
    /// The client has sent the HTTP/2 preface.
    handshaken: AtomicBool,
    evicted: AtomicBool,
    /// Wakes the connection's reads, so that an eviction takes effect at once.
    waker: AtomicWaker,
    /// Counts the connection as open in the metrics.
    _gauge: Option<ConnectionGauge>,
}

/// An accepted connection that closes itself when its client stays silent too long, or when
/// the acceptor evicts it.
#[derive(Debug)]
pub(crate) struct Connection {
    socket: Socket,
    shared: Arc<Shared>,
    _permit: OwnedSemaphorePermit,
    bytes_read: usize,
    handshake_timeout: Duration,
    idle_timeout: Duration,
    /// Fires at the next moment a timeout could have been reached.
    check: Pin<Box<Sleep>>,
    write_stall_timeout: Duration,
    /// Since when writes have been blocked, if they are.
    write_blocked_since: Option<Instant>,
    write_check: Pin<Box<Sleep>>,
}

impl Connection {
    fn new(
        socket: Socket,
        peer: Peer,
        permit: OwnedSemaphorePermit,
        limits: &ConnectionLimits,
        gauge: Option<ConnectionGauge>,
    ) -> Self {
        let accepted = Instant::now();
        Self {
            socket,
            shared: Arc::new(Shared {
                streams: Arc::default(),
                peer,
                accepted,
                handshaken: AtomicBool::new(false),
                evicted: AtomicBool::new(false),
                waker: AtomicWaker::new(),
                _gauge: gauge,
            }),
            _permit: permit,
            bytes_read: 0,
            handshake_timeout: limits.handshake_timeout,
            idle_timeout: limits.idle_timeout,
            check: Box::pin(tokio::time::sleep_until(
                accepted + limits.handshake_timeout,
            )),
            write_stall_timeout: limits.write_stall_timeout,
            write_blocked_since: None,
            write_check: Box::pin(tokio::time::sleep_until(
                accepted + limits.write_stall_timeout,
            )),
        }
    }

    pub(crate) fn peer(&self) -> Peer {
        self.shared.peer
    }

    /// After a write could not proceed: an error once the connection was evicted or writes have
    /// been blocked past the stall timeout; otherwise arms the timer for that moment.
    fn poll_write_blocked(&mut self, cx: &mut Context<'_>) -> Result<(), io::Error> {
        self.shared.waker.register(cx.waker());
        if self.shared.evicted.load(Ordering::Acquire) {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "closed to admit a new connection (--max-connections)",
            ));
        }
        let deadline =
            *self.write_blocked_since.get_or_insert_with(Instant::now) + self.write_stall_timeout;
        if self.write_check.deadline() != deadline {
            self.write_check.as_mut().reset(deadline);
        }
        if Instant::now() >= deadline || self.write_check.as_mut().poll(cx).is_ready() {
            tracing::debug!(peer = %self.shared.peer, "closing a connection whose client reads nothing");
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client has read nothing within the write stall timeout",
            ));
        }
        Ok(())
    }

    /// Passes a write's result on, tracking whether writes are blocked.
    fn write_result<T>(
        &mut self,
        cx: &mut Context<'_>,
        result: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        match result {
            Poll::Ready(result) => {
                self.write_blocked_since = None;
                Poll::Ready(result)
            }
            Poll::Pending => match self.poll_write_blocked(cx) {
                Ok(()) => Poll::Pending,
                Err(error) => Poll::Ready(Err(error)),
            },
        }
    }

    /// An error once the connection has been silent past its timeout; otherwise arms the timer
    /// for the next moment that could happen.
    fn poll_timeouts(&mut self, cx: &mut Context<'_>) -> Result<(), io::Error> {
        self.shared.waker.register(cx.waker());
        if self.shared.evicted.load(Ordering::Acquire) {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "closed to admit a new connection (--max-connections)",
            ));
        }
        loop {
            let now = Instant::now();
            let deadline = if self.bytes_read < PREFACE_BYTES {
                let deadline = self.shared.accepted + self.handshake_timeout;
                if now >= deadline {
                    tracing::debug!(peer = %self.shared.peer, "closing a connection that sent no HTTP/2 preface");
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "no HTTP/2 preface within the handshake timeout",
                    ));
                }
                deadline
            } else {
                match self.shared.streams.idle_since() {
                    Some(since) => {
                        let deadline = Instant::from_std(since) + self.idle_timeout;
                        if now >= deadline {
                            tracing::debug!(peer = %self.shared.peer, "closing an idle connection");
                            return Err(io::Error::new(
                                io::ErrorKind::TimedOut,
                                "no stream within the idle timeout",
                            ));
                        }
                        deadline
                    }
                    // Busy: look again once an idle timeout could have passed.
                    None if self.check.deadline() > now => self.check.deadline(),
                    None => now + self.idle_timeout,
                }
            };
            if self.check.deadline() != deadline {
                self.check.as_mut().reset(deadline);
            }
            if self.check.as_mut().poll(cx).is_pending() {
                return Ok(());
            }
        }
    }
}

impl Connected for Connection {
    type ConnectInfo = ConnectionInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        ConnectionInfo {
            streams: Arc::clone(&self.shared.streams),
            peer: self.shared.peer,
            certificate: None,
        }
    }
}

impl AsyncRead for Connection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let result = Pin::new(&mut self.socket).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = result {
            self.bytes_read = self.bytes_read.saturating_add(buf.filled().len() - before);
            if self.bytes_read >= PREFACE_BYTES {
                self.shared.handshaken.store(true, Ordering::Release);
            }
            return Poll::Ready(Ok(()));
        }
        if result.is_pending()
            && let Err(error) = self.poll_timeouts(cx)
        {
            return Poll::Ready(Err(error));
        }
        result
    }
}

impl AsyncWrite for Connection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.socket).poll_write(cx, buf);
        self.write_result(cx, result)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.socket).poll_write_vectored(cx, bufs);
        self.write_result(cx, result)
    }

    fn is_write_vectored(&self) -> bool {
        self.socket.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let result = Pin::new(&mut self.socket).poll_flush(cx);
        self.write_result(cx, result)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let result = Pin::new(&mut self.socket).poll_shutdown(cx);
        self.write_result(cx, result)
    }
}
