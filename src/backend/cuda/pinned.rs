//! The pinned host memory of `--pinned-host-memory` ([`PinnedHostMemory`]): pinned once, on
//! a thread of its own, on the first GPU's side of the machine; transfers use it once it is
//! there and go the staging way until then.
//!
//! Pinning is slow, and while the driver pins, the GPUs' other driver calls wait:
//! `cuMemHostAlloc` of 8 GiB kept a server from serving for 3.4-4.5 s on the H200 machine. So
//! the pages are faulted in by this thread first, without the driver, and then registered
//! (`ffi::PinnedBuffer`), which holds the driver about 50 ms a GiB; that is what lets the
//! server pin a default amount (1 GiB) at every start.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;

use super::ffi::{Context, PinnedArena};
use crate::backend::numa;

/// Pinned host memory for transfers, shared by every GPU of the backend.
#[derive(Debug, Default)]
pub(super) struct PinnedHostMemory {
    arena: OnceLock<Arc<PinnedArena>>,
    started: AtomicBool,
    /// Bytes being pinned now.
    pending: AtomicU64,
    /// Where to pin: the first GPU's context, and the CPUs of its NUMA node (the first touch
    /// of a page places it).
    place: OnceLock<(Arc<Context>, Option<Vec<usize>>)>,
    /// The pinning thread, joined before the backend goes ([`PinnedHostMemory::finish`]).
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl PinnedHostMemory {
    /// Pins on `context`'s GPU's side of the machine (`cpus`: its NUMA node's).
    pub(super) fn place(&self, context: Arc<Context>, cpus: Option<Vec<usize>>) {
        let _ = self.place.set((context, cpus));
    }

    /// The memory, if it has been pinned.
    pub(super) fn ready(&self) -> Option<&Arc<PinnedArena>> {
        self.arena.get()
    }

    /// Bytes being pinned now.
    pub(super) fn pending(&self) -> u64 {
        self.pending.load(Ordering::Acquire)
    }

    /// Starts pinning `size` bytes on a thread of its own, unless it has started before or
    /// there is nothing to pin.
    pub(super) fn start(self: &Arc<Self>, size: u64) {
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
        match pinning {
            Ok(thread) => *self.thread.lock().unwrap_or_else(|p| p.into_inner()) = Some(thread),
            Err(error) => {
                self.pending.store(0, Ordering::Release);
                tracing::warn!(%error, "no thread to pin host memory for transfers");
            }
        }
    }

    /// Waits for pinning to end, if it has not: a process must not exit (nor tear down the
    /// driver) while a thread is still pinning (inside `cuMemHostRegister`).
    pub(super) fn finish(&self) {
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(thread) = thread
            && thread.join().is_err()
        {
            tracing::warn!("the thread pinning host memory panicked");
        }
    }
}
