//! One Flight call as the operator sees it: who made it, what it touched, what it moved, how it
//! ended. The server's accounting layer opens a [`Call`] for every request and puts it in the
//! request's extensions; handlers add the dataset and rows, the layers' bodies add bytes and
//! the final status. When the last reference goes (the reply is done or dropped) the call is logged as
//! one structured line and counted in the metrics. Long calls also log a progress line every
//! `--progress-seconds`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tonic::Code;

use crate::metrics::{CallFigures, Metrics};

/// A call in progress; see the module doc.
#[derive(Debug)]
pub(crate) struct Call {
    method: &'static str,
    /// Who is at the other end, as the connection names it.
    peer: Option<String>,
    principal: Mutex<Option<Arc<str>>>,
    started: Instant,
    /// The dataset (or action) the call is about, once the handler knows it.
    subject: Mutex<Option<String>>,
    rows_in: AtomicU64,
    rows_out: AtomicU64,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
    status: Mutex<Option<(Code, String)>>,
    /// Nanoseconds after `started` of the last progress line.
    last_progress: AtomicU64,
    progress_interval: Duration,
    metrics: Option<Arc<Metrics>>,
}

impl Call {
    pub(crate) fn new(
        method: &'static str,
        peer: Option<String>,
        progress_interval: Duration,
        metrics: Option<Arc<Metrics>>,
    ) -> Arc<Self> {
        Arc::new(Self {
            method,
            peer,
            principal: Mutex::new(None),
            started: Instant::now(),
            subject: Mutex::new(None),
            rows_in: AtomicU64::new(0),
            rows_out: AtomicU64::new(0),
            bytes_in: AtomicU64::new(0),
            bytes_out: AtomicU64::new(0),
            status: Mutex::new(None),
            last_progress: AtomicU64::new(0),
            progress_interval,
            metrics,
        })
    }

    pub(crate) fn set_principal(&self, name: Arc<str>) {
        *lock(&self.principal) = Some(name);
    }

    /// Names what the call is about: a dataset, or an action and its dataset.
    pub(crate) fn set_subject(&self, subject: impl Into<String>) {
        *lock(&self.subject) = Some(subject.into());
    }

    pub(crate) fn add_rows_in(&self, rows: u64) {
        self.rows_in.fetch_add(rows, Ordering::Relaxed);
    }

    pub(crate) fn add_rows_out(&self, rows: u64) {
        self.rows_out.fetch_add(rows, Ordering::Relaxed);
    }

    pub(crate) fn add_bytes_in(&self, bytes: u64) {
        self.bytes_in.fetch_add(bytes, Ordering::Relaxed);
        self.maybe_progress();
    }

    pub(crate) fn add_bytes_out(&self, bytes: u64) {
        self.bytes_out.fetch_add(bytes, Ordering::Relaxed);
        self.maybe_progress();
    }

    /// Records the status the reply carries (the first one seen wins).
    pub(crate) fn set_status(&self, code: Code, message: &str) {
        lock(&self.status).get_or_insert_with(|| (code, message.to_owned()));
    }

    fn maybe_progress(&self) {
        let elapsed = self.started.elapsed();
        let now = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        let last = self.last_progress.load(Ordering::Relaxed);
        let interval = u64::try_from(self.progress_interval.as_nanos()).unwrap_or(u64::MAX);
        if now.saturating_sub(last) < interval
            || self
                .last_progress
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        let (rows, bytes) = self.moved();
        tracing::info!(
            method = self.method,
            dataset = self.subject().as_deref().unwrap_or("-"),
            principal = self.principal().as_deref().unwrap_or("-"),
            rows,
            bytes,
            seconds = elapsed.as_secs(),
            mb_per_s = rate(bytes, elapsed),
            "in progress"
        );
    }

    fn subject(&self) -> Option<String> {
        lock(&self.subject).clone()
    }

    fn principal(&self) -> Option<Arc<str>> {
        lock(&self.principal).clone()
    }

    /// Rows and bytes in the call's main direction (in for a put, out for everything else).
    fn moved(&self) -> (u64, u64) {
        let rows = self.rows_in.load(Ordering::Relaxed) + self.rows_out.load(Ordering::Relaxed);
        let bytes_in = self.bytes_in.load(Ordering::Relaxed);
        let bytes_out = self.bytes_out.load(Ordering::Relaxed);
        (rows, bytes_in.max(bytes_out))
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        let duration = self.started.elapsed();
        // A reply that ended without a status was cut off: the client went away (or the
        // connection was closed under it).
        let (code, message) = lock(&self.status)
            .take()
            .unwrap_or((Code::Cancelled, "the reply was not finished".to_owned()));
        let (rows, bytes) = self.moved();
        let figures = CallFigures {
            method: self.method,
            code,
            duration,
            bytes_in: self.bytes_in.load(Ordering::Relaxed),
            bytes_out: self.bytes_out.load(Ordering::Relaxed),
            rows_in: self.rows_in.load(Ordering::Relaxed),
            rows_out: self.rows_out.load(Ordering::Relaxed),
        };
        if let Some(metrics) = &self.metrics {
            metrics.call_finished(&figures);
        }
        let subject = self.subject();
        let principal = self.principal();
        let peer = self.peer.as_deref();
        macro_rules! line {
            ($level:ident) => {
                tracing::$level!(
                    method = self.method,
                    dataset = subject.as_deref().unwrap_or("-"),
                    principal = principal.as_deref().unwrap_or("-"),
                    peer = peer.unwrap_or("-"),
                    rows,
                    bytes_in = figures.bytes_in,
                    bytes_out = figures.bytes_out,
                    // Microseconds are enough, and keep the line short.
                    duration_ms = (duration.as_secs_f64() * 1e6).round() / 1e3,
                    mb_per_s = rate(bytes, duration),
                    code = crate::metrics::code_name(code),
                    // Recorded with `Debug`, which escapes what a client put in the message.
                    error = (!message.is_empty()).then_some(message.as_str()),
                    "call finished"
                )
            };
        }
        match code {
            Code::Internal | Code::Unknown | Code::DataLoss => line!(warn),
            _ => line!(info),
        }
    }
}

/// Megabytes (10^6) per second, to two decimals.
fn rate(bytes: u64, elapsed: Duration) -> f64 {
    let seconds = elapsed.as_secs_f64();
    if seconds <= 0.0 {
        return 0.0;
    }
    (bytes as f64 / seconds / 1e4).round() / 100.0
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}
