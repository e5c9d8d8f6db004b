//! Puts in flight, for `status`, the metrics and the logs: which datasets are being received,
//! by whom, and how far they have got.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::options::PutMode;

/// The puts a store is receiving.
#[derive(Debug, Default)]
pub(crate) struct InFlight {
    next_id: AtomicU64,
    running: Mutex<HashMap<u64, Arc<PutProgress>>>,
}

/// How far one put has got. Shared by the pending put (which counts) and `status` (which reads).
#[derive(Debug)]
pub struct PutProgress {
    pub name: String,
    pub mode: PutMode,
    /// Who sent it, as the protocol layer authenticated them.
    pub owner: String,
    pub started: Instant,
    rows: AtomicU64,
    bytes: AtomicU64,
}

impl PutProgress {
    /// Rows and Arrow bytes received so far.
    pub fn rows(&self) -> u64 {
        self.rows.load(Ordering::Relaxed)
    }

    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    pub(super) fn add(&self, rows: u64, bytes: u64) {
        self.rows.fetch_add(rows, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
    }
}

/// A put registered in [`InFlight`] until dropped.
#[derive(Debug)]
pub(crate) struct Registered {
    id: u64,
    pub(super) progress: Arc<PutProgress>,
    puts: Arc<InFlight>,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.puts.lock().remove(&self.id);
    }
}

impl InFlight {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<PutProgress>>> {
        self.running.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn register(self: &Arc<Self>, name: &str, mode: PutMode, owner: &str) -> Registered {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let progress = Arc::new(PutProgress {
            name: name.to_owned(),
            mode,
            owner: owner.to_owned(),
            started: Instant::now(),
            rows: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
        });
        self.lock().insert(id, Arc::clone(&progress));
        Registered {
            id,
            progress,
            puts: Arc::clone(self),
        }
    }

    /// The puts running now, oldest first.
    pub(crate) fn list(&self) -> Vec<Arc<PutProgress>> {
        let mut puts: Vec<_> = self.lock().values().cloned().collect();
        puts.sort_by_key(|p| p.started);
        puts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn puts_are_listed_until_dropped() {
        let puts = Arc::new(InFlight::default());
        let first = puts.register("a", PutMode::Create, "etl");
        let second = puts.register("b", PutMode::Append, "etl");
        first.progress.add(10, 80);
        let listed = puts.list();
        assert_eq!(listed.len(), 2);
        assert_eq!((listed[0].name.as_str(), listed[0].rows()), ("a", 10));
        assert_eq!(listed[0].bytes(), 80);
        drop(first);
        assert_eq!(puts.list().len(), 1);
        drop(second);
        assert!(puts.list().is_empty());
    }
}
