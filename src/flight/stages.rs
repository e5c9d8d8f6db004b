//! Where the server's streaming time goes, stage by stage, summed over every call since the
//! server started: what `status` shows under `"stages"`, so that a benchmark can read it before
//! and after a run and divide by the bytes moved (examples/python/throughput.py does).
//!
//! Each figure is a wall-clock wait or busy time of the task that does the stage, taken once
//! per message (never per HTTP/2 frame), so that counting costs nothing measurable:
//! - `DoGet` (the framed reply, `doget`): waiting for the backend's next chunk (`staging`: a
//!   device backend's copies to host memory), splitting and encoding it (`encode`), and waiting
//!   for the connection to take the encoded messages (`send_wait`: the client or the socket
//!   pushing back, through HTTP/2 flow control and hyper's send buffer).
//! - `DoPut`: waiting for the next message from the connection (`receive_wait`), decoding it
//!   (`decode`), and handing batches to the backend and waiting for uploads when the pipeline
//!   is full (`upload`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// The stage counters of one server.
#[derive(Debug, Default)]
pub(crate) struct Stages {
    pub(crate) doget_messages: AtomicU64,
    pub(crate) doget_bytes: AtomicU64,
    pub(crate) doget_staging_nanos: AtomicU64,
    pub(crate) doget_encode_nanos: AtomicU64,
    pub(crate) doget_send_wait_nanos: AtomicU64,
    pub(crate) put_messages: AtomicU64,
    pub(crate) put_bytes: AtomicU64,
    pub(crate) put_receive_wait_nanos: AtomicU64,
    pub(crate) put_decode_nanos: AtomicU64,
    pub(crate) put_upload_nanos: AtomicU64,
}

/// The stage counters as `status` shows them: bytes, messages and seconds.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct StagesDocument {
    pub doget: DoGetStages,
    pub put: PutStages,
}

#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct DoGetStages {
    /// Messages the framed reply encoded, and their encoded bytes.
    pub messages: u64,
    pub bytes: u64,
    pub staging_seconds: f64,
    pub encode_seconds: f64,
    pub send_wait_seconds: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct PutStages {
    /// Messages decoded, and their encoded bytes (metadata and body).
    pub messages: u64,
    pub bytes: u64,
    pub receive_wait_seconds: f64,
    pub decode_seconds: f64,
    pub upload_seconds: f64,
}

impl Stages {
    /// Adds `n` to `counter`.
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Adds the time since `started` to `counter`, and returns now (the next stage's start).
    pub(crate) fn lap(counter: &AtomicU64, started: Instant) -> Instant {
        let now = Instant::now();
        let nanos = u64::try_from(now.duration_since(started).as_nanos()).unwrap_or(u64::MAX);
        counter.fetch_add(nanos, Ordering::Relaxed);
        now
    }

    pub(crate) fn document(&self) -> StagesDocument {
        let get = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        let seconds = |counter: &AtomicU64| get(counter) as f64 / 1e9;
        StagesDocument {
            doget: DoGetStages {
                messages: get(&self.doget_messages),
                bytes: get(&self.doget_bytes),
                staging_seconds: seconds(&self.doget_staging_nanos),
                encode_seconds: seconds(&self.doget_encode_nanos),
                send_wait_seconds: seconds(&self.doget_send_wait_nanos),
            },
            put: PutStages {
                messages: get(&self.put_messages),
                bytes: get(&self.put_bytes),
                receive_wait_seconds: seconds(&self.put_receive_wait_nanos),
                decode_seconds: seconds(&self.put_decode_nanos),
                upload_seconds: seconds(&self.put_upload_nanos),
            },
        }
    }
}
