//! Small helpers for tasks the server spawns, and for the panics they may end in.

/// Aborts a spawned task when dropped, so a task never outlives the request or server that
/// started it, whichever way that ends.
#[derive(Debug)]
pub(crate) struct AbortOnDrop<T>(pub(crate) tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The text a panic carried, for logs and INTERNAL errors.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(text) = panic.downcast_ref::<&str>() {
        (*text).to_owned()
    } else if let Some(text) = panic.downcast_ref::<String>() {
        text.clone()
    } else {
        "a panic without a message".to_owned()
    }
}
