//! What a request knows of its connection: who is at the other end ([`Peer`]), the client
//! certificate mutual TLS verified, and the connection's open streams ([`ConnectionStreams`]).
//!
//! Each accepted connection hands tonic a [`ConnectionInfo`] (tonic's `Connected`), which tonic
//! puts in the extensions of every request on it; the layers read it from there. Streams are
//! counted here, by the accounting layer, because the connection closes itself after an idle
//! timeout that only they can tell.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::auth::{ClientCertificate, Origin};

/// Open streams on one connection and when the last one ended, shared between the accounting
/// layer (which counts requests) and the connection (which closes itself when idle too long).
#[derive(Debug)]
pub struct ConnectionStreams {
    open: AtomicUsize,
    last_active: Mutex<Instant>,
}

impl Default for ConnectionStreams {
    fn default() -> Self {
        Self {
            open: AtomicUsize::new(0),
            last_active: Mutex::new(Instant::now()),
        }
    }
}

impl ConnectionStreams {
    /// When the connection's last stream ended (or it was opened), if no stream is open now.
    pub fn idle_since(&self) -> Option<Instant> {
        if self.open.load(Ordering::Acquire) > 0 {
            return None;
        }
        Some(*self.last_active.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Counts one stream as open until the returned guard is dropped.
    pub(super) fn begin(self: &Arc<Self>) -> OpenStream {
        self.open.fetch_add(1, Ordering::AcqRel);
        OpenStream(Arc::clone(self))
    }
}

/// One request counted as open on its connection until dropped.
#[derive(Debug)]
pub(super) struct OpenStream(Arc<ConnectionStreams>);

impl Drop for OpenStream {
    fn drop(&mut self) {
        *self.0.last_active.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        self.0.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What the layers learn of a request's connection (tonic's connect info).
#[derive(Debug, Clone)]
pub struct ConnectionInfo {
    pub streams: Arc<ConnectionStreams>,
    pub peer: Peer,
    /// The client's certificate, verified by mutual TLS.
    pub certificate: Option<Arc<ClientCertificate>>,
}

impl ConnectionInfo {
    /// Where failed authentication from this connection is counted.
    pub fn origin(&self) -> Origin {
        match self.peer {
            Peer::Tcp(address) => Origin::Ip(address.ip()),
            Peer::Unix { uid, .. } => Origin::UnixUser(uid),
        }
    }
}

/// Who is at the other end of a connection, as logs name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    Tcp(SocketAddr),
    /// A Unix socket's peer: its process and user, as the kernel reports them.
    Unix {
        pid: Option<i32>,
        uid: Option<u32>,
    },
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Tcp(address) => address.fmt(f),
            Self::Unix { pid, uid } => {
                f.write_str("unix")?;
                if let Some(pid) = pid {
                    write!(f, " pid={pid}")?;
                }
                if let Some(uid) = uid {
                    write!(f, " uid={uid}")?;
                }
                Ok(())
            }
        }
    }
}
