//! Prometheus metrics: what the server counts, and the HTTP endpoint that exposes them.
//!
//! Two kinds of figures. Events are counted as they happen ([`Metrics::call_finished`],
//! connections opened and closed). State (datasets, memory, leases, puts in flight, the
//! backend's own counters) is read from the store at each scrape by [`StoreCollector`], so it
//! can never drift from what `status` reports.
//!
//! The endpoint (`--metrics-listen`) is plain HTTP without authentication, like every
//! Prometheus exporter: bind it where only the monitoring system reaches it. It answers
//! `GET /metrics` and nothing else, a few scrapes at a time.

use std::fmt::Write as _;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::store::Store;

/// Scrapes served at once; more connections wait.
const MAX_SCRAPES: usize = 4;
/// Longest a scrape connection may stay open.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(30);

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

/// The store's state, read at each scrape.
#[derive(Debug)]
struct StoreCollector {
    store: Store,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeviceLabels {
    device: String,
    name: String,
}

impl Collector for StoreCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let status = self.store.status();
        gauge(
            &mut encoder,
            "datasets",
            "Datasets in the catalog",
            None,
            status.datasets as u64,
        )?;
        gauge(
            &mut encoder,
            "dataset_memory",
            "Backend memory held by committed datasets",
            Some(Unit::Bytes),
            status.bytes,
        )?;
        gauge(
            &mut encoder,
            "dataset_data",
            "Arrow bytes in committed datasets",
            Some(Unit::Bytes),
            status.data_bytes,
        )?;
        gauge(
            &mut encoder,
            "leases",
            "Live ipc-export leases",
            None,
            status.leases.len() as u64,
        )?;
        gauge(
            &mut encoder,
            "leased_only_memory",
            "Backend memory held only by leases (datasets dropped or replaced while exported)",
            Some(Unit::Bytes),
            status.leased_only_bytes,
        )?;
        gauge(
            &mut encoder,
            "puts_in_flight",
            "DoPut calls being received",
            None,
            status.puts.len() as u64,
        )?;
        gauge(
            &mut encoder,
            "puts_in_flight_received",
            "Arrow bytes received so far by the puts in flight",
            Some(Unit::Bytes),
            status.puts.iter().map(|p| p.bytes()).sum(),
        )?;
        let concatenations = ConstCounter::new(status.concatenations);
        concatenations.encode(encoder.encode_descriptor(
            "concatenations",
            "Compactions of a put's batches at commit, and background merges of appended partitions",
            None,
            concatenations.metric_type(),
        )?)?;
        let concatenated = ConstCounter::new(status.concatenated_bytes);
        concatenated.encode(encoder.encode_descriptor(
            "concatenated",
            "Arrow bytes copied by compactions",
            Some(&Unit::Bytes),
            concatenated.metric_type(),
        )?)?;
        let concat_time = ConstCounter::new(status.concatenation_seconds);
        concat_time.encode(encoder.encode_descriptor(
            "concatenation",
            "Time spent in compactions",
            Some(&Unit::Seconds),
            concat_time.metric_type(),
        )?)?;
        let merges = ConstCounter::new(status.merges);
        merges.encode(encoder.encode_descriptor(
            "merges",
            "Background merges of appended partitions with their neighbours",
            None,
            merges.metric_type(),
        )?)?;

        let tiers = &status.tiers;
        for (name, help, bytes) in [
            (
                "tier_device",
                "Bytes committed datasets hold on devices",
                tiers.device_bytes,
            ),
            (
                "tier_host",
                "Bytes committed datasets hold spilled to host memory",
                tiers.host_bytes,
            ),
            (
                "tier_disk",
                "Bytes of datasets only in the data directory's files, not loaded yet",
                tiers.disk_bytes,
            ),
            (
                "host_tier_used",
                "Bytes the host tier holds: spilled partitions and puts' messages paid for there",
                tiers.host_used_bytes,
            ),
            (
                "host_tier_limit",
                "The host tier's budget (--host-memory-limit; 0: nothing spills)",
                tiers.host_limit_bytes,
            ),
        ] {
            gauge(&mut encoder, name, help, Some(Unit::Bytes), bytes)?;
        }
        for (name, help, unit, value) in [
            (
                "spills",
                "Partitions spilled to host memory",
                None,
                tiers.spills as f64,
            ),
            (
                "spilled",
                "Bytes spilled to host memory",
                Some(&Unit::Bytes),
                tiers.spilled_bytes as f64,
            ),
            (
                "spill",
                "Time spent spilling",
                Some(&Unit::Seconds),
                tiers.spill_seconds,
            ),
            (
                "restores",
                "Spilled partitions brought back onto their devices",
                None,
                tiers.restores as f64,
            ),
            (
                "restored",
                "Bytes brought back onto devices",
                Some(&Unit::Bytes),
                tiers.restored_bytes as f64,
            ),
            (
                "restore",
                "Time spent restoring",
                Some(&Unit::Seconds),
                tiers.restore_seconds,
            ),
            (
                "loads",
                "Partitions loaded from the data directory",
                None,
                tiers.loads as f64,
            ),
            (
                "loaded",
                "Bytes of files loaded from the data directory",
                Some(&Unit::Bytes),
                tiers.loaded_bytes as f64,
            ),
            (
                "load",
                "Time spent loading from the data directory",
                Some(&Unit::Seconds),
                tiers.load_seconds,
            ),
            (
                "evictions",
                "Partitions dropped back to the data directory's files to free memory",
                None,
                tiers.evictions as f64,
            ),
        ] {
            let counter = ConstCounter::new(value);
            counter.encode(encoder.encode_descriptor(
                name,
                help,
                unit,
                counter.metric_type(),
            )?)?;
        }

        for (what, help, value) in [
            (
                "memory_used",
                "Bytes reserved on the device: datasets and puts in flight",
                0,
            ),
            (
                "memory_limit",
                "The device's budget (--memory-limit, else its capacity)",
                1,
            ),
        ] {
            let mut family = encoder.encode_descriptor(
                what,
                help,
                Some(&Unit::Bytes),
                prometheus_client::metrics::MetricType::Gauge,
            )?;
            for device in &status.devices {
                let bytes = if value == 0 {
                    Some(device.used_bytes)
                } else {
                    device.limit_bytes
                };
                let Some(bytes) = bytes else { continue };
                let labels = DeviceLabels {
                    device: device.info.ordinal.to_string(),
                    name: device.info.name.clone(),
                };
                ConstGauge::new(clamp(bytes)).encode(family.encode_family(&labels)?)?;
            }
        }

        // The backend's own counters (the CUDA backend's pinned staging pool, transfers,
        // kernel launches), each as a gauge under its own name.
        for (key, value) in &status.counters {
            let Some(number) = value.as_f64() else {
                continue;
            };
            let mut name = String::from("backend_");
            for c in key.chars() {
                let _ = name.write_char(if c.is_ascii_alphanumeric() { c } else { '_' });
            }
            ConstGauge::new(number).encode(encoder.encode_descriptor(
                &name,
                "A counter of the backend, as `status` reports it under \"counters\"",
                None,
                prometheus_client::metrics::MetricType::Gauge,
            )?)?;
        }
        Ok(())
    }
}

fn gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<Unit>,
    value: u64,
) -> Result<(), std::fmt::Error> {
    let gauge = ConstGauge::new(clamp(value));
    gauge.encode(encoder.encode_descriptor(name, help, unit.as_ref(), gauge.metric_type())?)
}

fn clamp(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// Serves `GET /metrics` on `listener` until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send,
) {
    let permits = Arc::new(Semaphore::new(MAX_SCRAPES));
    let accept = async {
        loop {
            let Ok(permit) = Arc::clone(&permits).acquire_owned().await else {
                return;
            };
            let (socket, _) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(error) => {
                    tracing::debug!(%error, "metrics accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let metrics = Arc::clone(&metrics);
            tokio::spawn(async move {
                let _permit = permit;
                let service = hyper::service::service_fn(move |request| {
                    let metrics = Arc::clone(&metrics);
                    async move { Ok::<_, std::convert::Infallible>(answer(&metrics, &request)) }
                });
                let connection = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(socket), service);
                let _ = tokio::time::timeout(SCRAPE_TIMEOUT, connection).await;
            });
        }
    };
    tokio::select! {
        () = accept => {}
        () = shutdown => {}
    }
}

fn answer(metrics: &Metrics, request: &Request<Incoming>) -> Response<Full<Bytes>> {
    let reply = |status: StatusCode, content_type: &'static str, body: String| {
        let mut response = Response::new(Full::new(Bytes::from(body)));
        *response.status_mut() = status;
        response.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static(content_type),
        );
        response
    };
    if request.uri().path() != "/metrics" {
        return reply(
            StatusCode::NOT_FOUND,
            "text/plain",
            "see /metrics\n".to_owned(),
        );
    }
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "GET only\n".to_owned(),
        );
    }
    match metrics.encode() {
        Ok(text) => reply(
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            text,
        ),
        Err(_) => reply(
            StatusCode::INTERNAL_SERVER_ERROR,
            "text/plain",
            "encoding failed\n".to_owned(),
        ),
    }
}
