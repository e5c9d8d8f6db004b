//! The side channel of shared-memory reads: a Unix socket where a consumer trades the token
//! `shm-read` gave it for the descriptor of its memory file, passed with `SCM_RIGHTS`.
//!
//! The exchange is one line each way. The consumer sends its token and a newline; the server
//! answers `ok <bytes> <files>` with the files' descriptors attached, in order, in one message
//! (at most `flight::MAX_SHARED_FILES`, far below the kernel's 253), or `error <why>` without
//! one, and closes the connection. The store decides whether the token opens anything: once, in time,
//! and, where the `shm-read` call came over a Unix socket, only for the same user, which the
//! kernel reports for this connection (`SO_PEERCRED`).
//!
//! Idle connections must not delay anyone's claim (a token lives 30 s): every connection is
//! accepted at once and has two seconds to send its line; past [`MAX_EXCHANGES`] connections
//! at once, or [`MAX_EXCHANGES_PER_USER`] of one user, a new one is answered `error busy` and
//! closed, so one user's idle connections cannot take another's turns, and no claim waits
//! behind them.

use std::collections::HashMap;
use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
use tokio::io::Interest;
use tokio::net::UnixStream;
use tokio::sync::Semaphore;

use super::Listener;
use crate::store::Store;

/// Longest line a consumer may send: a token is 64 hex digits.
const MAX_LINE_BYTES: usize = 256;

/// How long a consumer has to send its token and read the answer: a token line is 65 bytes.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(2);

/// Connections served at once; one more is answered `error busy` and closed.
const MAX_EXCHANGES: usize = 1024;

/// Connections of one user (by `SO_PEERCRED`'s uid) served at once.
const MAX_EXCHANGES_PER_USER: usize = 64;

/// The exchanges running, by user.
#[derive(Debug, Default)]
struct Users(Mutex<HashMap<Option<u32>, usize>>);

/// One user's exchange, counted until dropped.
struct Turn {
    users: Arc<Users>,
    uid: Option<u32>,
}

impl Users {
    fn admit(self: &Arc<Self>, uid: Option<u32>) -> Option<Turn> {
        let mut running = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let count = running.entry(uid).or_default();
        if *count >= MAX_EXCHANGES_PER_USER {
            return None;
        }
        *count += 1;
        Some(Turn {
            users: Arc::clone(self),
            uid,
        })
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        let mut running = self.users.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(count) = running.get_mut(&self.uid) {
            *count -= 1;
            if *count == 0 {
                running.remove(&self.uid);
            }
        }
    }
}

/// Serves the side channel on `listener` until the task is aborted.
pub(super) async fn serve(listener: Listener, store: Store) {
    let Some((socket, path)) = listener.unix() else {
        tracing::warn!("the shared-memory side channel needs a Unix socket");
        return;
    };
    tracing::info!(socket = %path.display(), "shared-memory side channel listening");
    let exchanges = Arc::new(Semaphore::new(MAX_EXCHANGES));
    let users = Arc::new(Users::default());
    loop {
        let stream = match socket.accept().await {
            Ok((stream, _)) => stream,
            Err(error) => {
                // Out of descriptors, usually: wait rather than spin.
                tracing::warn!(%error, "shared-memory side channel: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let uid = stream.peer_cred().ok().map(|c| c.uid());
        let turn = Arc::clone(&exchanges)
            .try_acquire_owned()
            .ok()
            .zip(users.admit(uid));
        let store = store.clone();
        tokio::spawn(async move {
            let Some(_turn) = turn else {
                tracing::info!(
                    ?uid,
                    "shared-memory side channel: busy, a connection refused"
                );
                let busy = b"error busy: too many connections at once; try again\n";
                let _ = tokio::time::timeout(EXCHANGE_TIMEOUT, write_all(&stream, busy)).await;
                return;
            };
            match tokio::time::timeout(EXCHANGE_TIMEOUT, exchange(&stream, &store)).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => {
                    tracing::info!(%error, "shared-memory side channel: exchange failed");
                }
                Err(_) => tracing::info!("shared-memory side channel: the consumer was too slow"),
            }
        });
    }
}

/// One consumer's exchange: its token in, the descriptor (or why not) out.
async fn exchange(stream: &UnixStream, store: &Store) -> io::Result<()> {
    let credentials = stream.peer_cred().ok();
    let uid = credentials.map(|c| c.uid());
    let line = read_line(stream).await?;
    let token = std::str::from_utf8(&line).unwrap_or("").trim();
    match store.claim_shared(token, uid) {
        Ok(file) => {
            tracing::debug!(
                lease = file.lease.get(..8).unwrap_or(""),
                bytes = file.bytes,
                files = file.fds.len(),
                pid = ?credentials.and_then(|c| c.pid()),
                ?uid,
                "shared-memory files handed over"
            );
            let answer = format!("ok {} {}\n", file.bytes, file.fds.len());
            send_with_fds(stream, answer.as_bytes(), &file.fds).await
        }
        Err(error) => {
            tracing::info!(
                pid = ?credentials.and_then(|c| c.pid()),
                ?uid,
                %error,
                "shared-memory token refused"
            );
            let answer = format!("error {}\n", error.to_string().replace('\n', " "));
            write_all(stream, answer.as_bytes()).await
        }
    }
}

/// The first line the consumer sends (without its newline), of at most `MAX_LINE_BYTES`.
async fn read_line(stream: &UnixStream) -> io::Result<Vec<u8>> {
    let mut line = Vec::with_capacity(MAX_LINE_BYTES);
    let mut buffer = [0u8; MAX_LINE_BYTES];
    loop {
        stream.readable().await?;
        let read = match stream.try_read(&mut buffer[..MAX_LINE_BYTES - line.len()]) {
            Ok(0) => return Ok(line),
            Ok(read) => read,
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => continue,
            Err(error) => return Err(error),
        };
        line.extend_from_slice(&buffer[..read]);
        if let Some(end) = line.iter().position(|&b| b == b'\n') {
            line.truncate(end);
            return Ok(line);
        }
        if line.len() >= MAX_LINE_BYTES {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "a token line longer than a token",
            ));
        }
    }
}

/// Sends `message` with `fds` attached (`SCM_RIGHTS`), then whatever of `message` the first
/// send left.
async fn send_with_fds(stream: &UnixStream, message: &[u8], fds: &[OwnedFd]) -> io::Result<()> {
    let fds: Vec<_> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let sent = loop {
        stream.writable().await?;
        let sent = stream.try_io(Interest::WRITABLE, || {
            sendmsg::<()>(
                stream.as_raw_fd(),
                &[IoSlice::new(message)],
                &[ControlMessage::ScmRights(&fds)],
                MsgFlags::MSG_NOSIGNAL,
                None,
            )
            .map_err(io::Error::from)
        });
        match sent {
            Ok(sent) => break sent,
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => continue,
            Err(error) => return Err(error),
        }
    };
    write_all(stream, message.get(sent..).unwrap_or_default()).await
}

async fn write_all(stream: &UnixStream, mut bytes: &[u8]) -> io::Result<()> {
    while !bytes.is_empty() {
        stream.writable().await?;
        match stream.try_write(bytes) {
            Ok(written) => bytes = bytes.get(written..).unwrap_or_default(),
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => continue,
            Err(error) => return Err(error),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_user_has_its_own_turns() {
        let users = Arc::new(Users::default());
        let mine: Vec<Turn> = (0..MAX_EXCHANGES_PER_USER)
            .map(|_| users.admit(Some(1000)).expect("a turn"))
            .collect();
        assert!(
            users.admit(Some(1000)).is_none(),
            "one user's turns are used up"
        );
        assert!(
            users.admit(Some(1001)).is_some(),
            "another user still has turns"
        );
        assert!(
            users.admit(None).is_some(),
            "and a peer the kernel did not name"
        );
        drop(mine);
        assert!(
            users.admit(Some(1000)).is_some(),
            "turns come back when exchanges end"
        );
        assert!(
            users.0.lock().expect("lock").is_empty(),
            "no user is counted once its exchanges end"
        );
    }
}
