//! Prometheus metrics: what the server counts, and the HTTP endpoint that exposes them.
//!
//! Two kinds of figures. Events are counted here as they happen ([`Metrics::call_finished`],
//! connections opened and closed). State (datasets, memory, leases, puts in flight, the
//! backend's own counters) is read from the store at each scrape by `collector`, so it can
//! never drift from what `status` reports. [`serve`] (in `endpoint`) answers scrapes.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use crate::store::Store;

mod collector;
mod endpoint;

pub use endpoint::serve;

use collector::StoreCollector;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    method: &'static str,
    code: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MethodLabels {
    method: &'static str,
}

/// The server's metrics. Cheap to share: one per server, behind an `Arc`.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    calls: Family<CallLabels, Counter>,
    durations: Family<MethodLabels, Histogram>,
    received_bytes: Family<MethodLabels, Counter>,
    sent_bytes: Family<MethodLabels, Counter>,
    received_rows: Counter,
    sent_rows: Counter,
    connections_open: Gauge<i64, AtomicI64>,
    connections_accepted: Counter<u64, AtomicU64>,
}

/// What one finished call did, as [`Metrics::call_finished`] counts it.
#[derive(Debug, Clone, Copy)]
pub struct CallFigures {
    pub method: &'static str,
    pub code: tonic::Code,
    pub duration: Duration,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub rows_in: u64,
    pub rows_out: u64,
}

impl Metrics {
    /// Metrics over `store`, whose state is read at each scrape.
    pub fn new(store: Store) -> Arc<Self> {
        let mut registry = Registry::with_prefix("gpu_flight");
        let calls = Family::<CallLabels, Counter>::default();
        registry.register(
            "requests",
            "Flight calls finished, by method and gRPC status code",
            calls.clone(),
        );
        // From a millisecond (a status call) to twenty minutes (a put of hundreds of GiB).
        let durations = Family::<MethodLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
                0.001, 4.0, 11,
            ))
        });
        registry.register_with_unit(
            "request_duration",
            "Time from a call's arrival to the end of its reply",
            Unit::Seconds,
            durations.clone(),
        );
        let received_bytes = Family::<MethodLabels, Counter>::default();
        registry.register_with_unit(
            "received",
            "Request bytes received (gRPC messages), by method",
            Unit::Bytes,
            received_bytes.clone(),
        );
        let sent_bytes = Family::<MethodLabels, Counter>::default();
        registry.register_with_unit(
            "sent",
            "Reply bytes sent (gRPC messages), by method",
            Unit::Bytes,
            sent_bytes.clone(),
        );
        let received_rows = Counter::default();
        registry.register(
            "received_rows",
            "Rows received by DoPut",
            received_rows.clone(),
        );
        let sent_rows = Counter::default();
        registry.register("sent_rows", "Rows sent by DoGet", sent_rows.clone());
        let connections_open = Gauge::default();
        registry.register(
            "connections",
            "Client connections open now",
            connections_open.clone(),
        );
        let connections_accepted = Counter::default();
        registry.register(
            "connections_accepted",
            "Client connections accepted",
            connections_accepted.clone(),
        );
        registry.register_collector(Box::new(StoreCollector { store }));
        Arc::new(Self {
            registry,
            calls,
            durations,
            received_bytes,
            sent_bytes,
            received_rows,
            sent_rows,
            connections_open,
            connections_accepted,
        })
    }

    /// Counts a finished Flight call.
    pub fn call_finished(&self, call: &CallFigures) {
        let method = MethodLabels {
            method: call.method,
        };
        self.calls
            .get_or_create(&CallLabels {
                method: call.method,
                code: code_name(call.code),
            })
            .inc();
        self.durations
            .get_or_create(&method)
            .observe(call.duration.as_secs_f64());
        if call.bytes_in > 0 {
            self.received_bytes
                .get_or_create(&method)
                .inc_by(call.bytes_in);
        }
        if call.bytes_out > 0 {
            self.sent_bytes
                .get_or_create(&method)
                .inc_by(call.bytes_out);
        }
        self.received_rows.inc_by(call.rows_in);
        self.sent_rows.inc_by(call.rows_out);
    }

    /// Counts a connection as open until the guard is dropped.
    pub fn connection_opened(self: &Arc<Self>) -> ConnectionGauge {
        self.connections_accepted.inc();
        self.connections_open.inc();
        ConnectionGauge(Arc::clone(self))
    }

    /// The exposition text, as a scrape gets it.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)?;
        Ok(text)
    }
}

/// An open connection, counted by [`Metrics`] until dropped.
#[derive(Debug)]
pub struct ConnectionGauge(Arc<Metrics>);

impl Drop for ConnectionGauge {
    fn drop(&mut self) {
        self.0.connections_open.dec();
    }
}

/// The gRPC name of a code, as clients and grpc tooling spell it.
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code;
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}
