//! Shutdown: the server's state, and the streams it lets finish before closing connections.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// The server's shutdown state and its running streams. Once shutdown begins, new requests
/// are refused with UNAVAILABLE; the server waits for [`Lifecycle::drained`] before closing
/// connections, so streams already running finish.
#[derive(Debug, Clone, Default)]
pub struct Lifecycle(Arc<LifecycleState>);

#[derive(Debug, Default)]
struct LifecycleState {
    shutting_down: AtomicBool,
    running: AtomicUsize,
    idle: tokio::sync::Notify,
}

impl Lifecycle {
    pub fn begin_shutdown(&self) {
        self.0.shutting_down.store(true, Ordering::Release);
    }

    pub fn is_shutting_down(&self) -> bool {
        self.0.shutting_down.load(Ordering::Acquire)
    }

    /// Counts a running `DoGet` or `DoPut` until the guard is dropped.
    pub fn track(&self) -> StreamGuard {
        self.0.running.fetch_add(1, Ordering::AcqRel);
        StreamGuard(Arc::clone(&self.0))
    }

    /// Completes when no tracked stream is running.
    pub async fn drained(&self) {
        loop {
            let idle = self.0.idle.notified();
            if self.0.running.load(Ordering::Acquire) == 0 {
                return;
            }
            idle.await;
        }
    }
}

/// A running stream, counted by its [`Lifecycle`] until dropped.
#[derive(Debug)]
pub struct StreamGuard(Arc<LifecycleState>);

impl Drop for StreamGuard {
    fn drop(&mut self) {
        if self.0.running.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}
