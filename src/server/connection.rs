//! Connections: how many, how long they may say nothing, and what happens when accept fails.
//!
//! tonic's own listener accepts without bound and retries accept errors at once, so a client
//! that opens a thousand idle sockets exhausts the process's file descriptors and the accept
//! loop then spins on EMFILE. [`incoming`] instead:
//!
//! - holds one permit of a semaphore per open connection, and closes connections beyond
//!   `max_connections` as soon as they are accepted (a warning, at most one a minute);
//! - logs accept errors once per burst and backs off (10 ms, doubling to 1 s) until accept
//!   works again.
//!
//! Each [`Connection`] closes itself when its client has not sent the HTTP/2 preface within the
//! handshake timeout, or has had no open stream for the idle timeout. Streams are counted by the
//! Flight router ([`ConnectionStreams`]), which finds them in each request's extensions through
//! tonic's `Connected` mechanism.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tonic::transport::server::Connected;

use crate::flight::ConnectionStreams;

/// Length of the HTTP/2 connection preface every client sends first.
const PREFACE_BYTES: usize = 24;
const FIRST_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_secs(1);
/// Connections refused at the limit are logged at most this often.
const REFUSAL_LOG_PERIOD: Duration = Duration::from_secs(60);

/// Bounds on connections.
#[derive(Debug, Clone)]
pub struct ConnectionLimits {
    /// Connections open at once; more are closed as soon as they are accepted.
    pub max_connections: usize,
    /// Time a new connection has to send the HTTP/2 preface.
    pub handshake_timeout: Duration,
    /// Time a connection may stay open with no stream.
    pub idle_timeout: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            max_connections: 1000,
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(300),
        }
    }
}

/// The connections `listener` accepts, within `limits`. Never ends and never fails: accept
/// errors are logged and retried after a pause.
pub(crate) fn incoming(
    listener: TcpListener,
    limits: ConnectionLimits,
) -> impl Stream<Item = Result<Connection, io::Error>> {
    let state = Acceptor {
        listener,
        permits: Arc::new(Semaphore::new(limits.max_connections)),
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
    listener: TcpListener,
    permits: Arc<Semaphore>,
    limits: ConnectionLimits,
    /// The pause after the last accept error, while accept keeps failing.
    backoff: Option<Duration>,
    last_refusal_log: Option<Instant>,
    /// Connections refused since the last log line about them.
    refused: u64,
}

impl Acceptor {
    async fn next(&mut self) -> Connection {
        loop {
            let (socket, peer) = match self.listener.accept().await {
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
            match Arc::clone(&self.permits).try_acquire_owned() {
                Ok(permit) => return Connection::new(socket, peer, permit, &self.limits),
                Err(_) => self.refuse(socket, peer),
            }
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

    fn refuse(&mut self, socket: TcpStream, peer: SocketAddr) {
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

/// An accepted connection that closes itself when its client stays silent too long.
#[derive(Debug)]
pub(crate) struct Connection {
    socket: TcpStream,
    streams: Arc<ConnectionStreams>,
    _permit: OwnedSemaphorePermit,
    peer: SocketAddr,
    bytes_read: usize,
    accepted: Instant,
    handshake_timeout: Duration,
    idle_timeout: Duration,
    /// Fires at the next moment a timeout could have been reached.
    check: Pin<Box<Sleep>>,
}

impl Connection {
    fn new(
        socket: TcpStream,
        peer: SocketAddr,
        permit: OwnedSemaphorePermit,
        limits: &ConnectionLimits,
    ) -> Self {
        // Flight messages are large and latency matters for the small ones.
        let _ = socket.set_nodelay(true);
        let accepted = Instant::now();
        Self {
            socket,
            streams: Arc::default(),
            _permit: permit,
            peer,
            bytes_read: 0,
            accepted,
            handshake_timeout: limits.handshake_timeout,
            idle_timeout: limits.idle_timeout,
            check: Box::pin(tokio::time::sleep_until(
                accepted + limits.handshake_timeout,
            )),
        }
    }

    /// An error once the connection has been silent past its timeout; otherwise arms the timer
    /// for the next moment that could happen.
    fn poll_timeouts(&mut self, cx: &mut Context<'_>) -> Result<(), io::Error> {
        loop {
            let now = Instant::now();
            let deadline = if self.bytes_read < PREFACE_BYTES {
                let deadline = self.accepted + self.handshake_timeout;
                if now >= deadline {
                    tracing::debug!(peer = %self.peer, "closing a connection that sent no HTTP/2 preface");
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "no HTTP/2 preface within the handshake timeout",
                    ));
                }
                deadline
            } else {
                match self.streams.idle_since() {
                    Some(since) => {
                        let deadline = Instant::from_std(since) + self.idle_timeout;
                        if now >= deadline {
                            tracing::debug!(peer = %self.peer, "closing an idle connection");
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
    type ConnectInfo = Arc<ConnectionStreams>;

    fn connect_info(&self) -> Self::ConnectInfo {
        Arc::clone(&self.streams)
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
        Pin::new(&mut self.socket).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.socket).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.socket.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.socket).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.socket).poll_shutdown(cx)
    }
}
