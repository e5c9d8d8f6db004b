//! The pinned host memory of `--pinned-host-memory` ([`PinnedHostMemory`]): how much to pin,
//! where, and when.
//!
//! Pinning is slow (`cuMemHostAlloc` pins about 2 GB a second, on one core) and so is giving
//! the memory back at exit, so a server does not pin at start: the first transfer that could
//! use the memory (a `DoPut` message body large enough, or a spill) starts pinning it on a
//! thread of its own, and goes the staging way itself; later ones use it once it is there. A
//! server that never moves much data never pins any.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use super::ffi::{Context, PinnedArena};
use crate::backend::numa;

/// Pinned host memory for transfers, shared by every GPU of the backend.
#[derive(Debug, Default)]
pub(super) struct PinnedHostMemory {
    arena: OnceLock<Arc<PinnedArena>>,
    /// Bytes to pin when first wanted; 0 for none.
    size: AtomicU64,
    started: AtomicBool,
    /// Bytes being pinned now.
    pending: AtomicU64,
    /// Where to pin: the first GPU's context, and the CPUs of its NUMA node (the first touch
    /// of a page places it).
    place: OnceLock<(Arc<Context>, Option<Vec<usize>>)>,
}

impl PinnedHostMemory {
    /// Pins on `context`'s GPU's side of the machine (`cpus`: its NUMA node's).
    pub(super) fn place(&self, context: Arc<Context>, cpus: Option<Vec<usize>>) {
        let _ = self.place.set((context, cpus));
    }

    /// How much to pin once wanted; ignored once pinning has started.
    pub(super) fn set_size(&self, bytes: u64) {
        if !self.started.load(Ordering::Acquire) {
            self.size.store(bytes, Ordering::Release);
        }
    }

    /// The memory, if it has been pinned; pins nothing.
    pub(super) fn ready(&self) -> Option<&Arc<PinnedArena>> {
        self.arena.get()
    }

    /// The memory, if it has been pinned; otherwise starts pinning it (once), for later
    /// transfers.
    pub(super) fn wanted(self: &Arc<Self>) -> Option<&Arc<PinnedArena>> {
        if let Some(arena) = self.arena.get() {
            return Some(arena);
        }
        self.start();
        None
    }

    /// Bytes being pinned now.
    pub(super) fn pending(&self) -> u64 {
        self.pending.load(Ordering::Acquire)
    }

    /// Starts pinning on a thread of its own, unless it has started before or there is
    /// nothing to pin.
    pub(super) fn start(self: &Arc<Self>) {
        let size = self.size.load(Ordering::Acquire);
        let Ok(bytes) = usize::try_from(size) else {
            tracing::warn!(
                size,
                "pinned host memory larger than the address space: none pinned"
            );
            return;
        };
        if bytes == 0 || self.started.swap(true, Ordering::AcqRel) {
            return;
        }
        let Some((context, cpus)) = self.place.get().cloned() else {
            return;
        };
        self.pending.store(size, Ordering::Release);
        let this = Arc::clone(self);
        let pinning = std::thread::Builder::new()
            .name("gpu-flight-pin-memory".to_owned())
            .spawn(move || {
                let started = std::time::Instant::now();
                let pinned = match &cpus {
                    Some(cpus) => numa::on_cpus(cpus, || PinnedArena::new(&context, bytes)),
                    None => PinnedArena::new(&context, bytes),
                };
                match pinned {
                    Ok(arena) => {
                        let _ = this.arena.set(arena);
                        tracing::info!(
                            bytes,
                            seconds = started.elapsed().as_secs_f64(),
                            "pinned host memory for transfers is ready"
                        );
                    }
                    Err(error) => tracing::warn!(
                        %error,
                        bytes,
                        "pinning host memory for transfers failed; they go through staging"
                    ),
                }
                this.pending.store(0, Ordering::Release);
            });
        if let Err(error) = pinning {
            self.pending.store(0, Ordering::Release);
            tracing::warn!(%error, "no thread to pin host memory for transfers");
        }
    }
}
