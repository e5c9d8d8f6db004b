//! Small helpers for tasks the server spawns.

/// Aborts a spawned task when dropped, so a task never outlives the request or server that
/// started it, whichever way that ends.
#[derive(Debug)]
pub(crate) struct AbortOnDrop<T>(pub(crate) tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}
