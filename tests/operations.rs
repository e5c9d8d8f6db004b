//! What operators see: the Prometheus endpoint, scraped over HTTP while the server works, and
//! the health service that probes ask.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use std::time::Duration;

use common::{TestServer, code_of, connect, int64_batch, path, put};
use futures::TryStreamExt;
use gpu_flight::auth::{Auth, Authenticator, DEFAULT_SESSION_TTL, new_token};
use gpu_flight::backend::HostBackend;
use gpu_flight::metrics;
use gpu_flight::server::ServeOptions;
use gpu_flight::store::StoreOptions;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tonic::transport::Channel;
use tonic_health::ServingStatus;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

/// One HTTP/1.1 request; the status line and body.
async fn http_get(addr: SocketAddr, target: &str) -> (String, String) {
    let mut socket = TcpStream::connect(addr).await.expect("connect");
    socket
        .write_all(
            format!("GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .expect("request");
    let mut reply = String::new();
    socket.read_to_string(&mut reply).await.expect("reply");
    let (head, body) = reply.split_once("\r\n\r\n").expect("HTTP reply");
    let status = head.lines().next().unwrap_or_default().to_owned();
    (status, body.to_owned())
}

/// Samples by their full name with labels, e.g. `gpu_flight_requests_total{method="DoPut",code="OK"}`.
fn samples(text: &str) -> HashMap<String, f64> {
    text.lines()
        .filter(|line| !line.starts_with('#') && !line.is_empty())
        .filter_map(|line| {
            let (name, value) = line.rsplit_once(' ')?;
            Some((name.to_owned(), value.parse().ok()?))
        })
        .collect()
}

fn sample(samples: &HashMap<String, f64>, name: &str) -> f64 {
    samples.get(name).copied().unwrap_or(0.0)
}

#[tokio::test]
async fn metrics_move_with_the_work() {
    let server = TestServer::start_with(
        Arc::new(HostBackend::new()),
        StoreOptions {
            memory_limit: Some(64 << 20),
            // The device's limit alone: no host tier to spill to.
            host_memory_limit: Some(0),
            ..StoreOptions::default()
        },
        ServeOptions::default(),
    )
    .await;
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let metrics_addr = listener.local_addr().expect("addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let endpoint = tokio::spawn(metrics::serve(
        listener,
        Arc::clone(&server.metrics),
        async {
            let _ = stopped.await;
        },
    ));

    let (status, body) = http_get(metrics_addr, "/metrics").await;
    assert!(status.contains("200"), "{status}");
    let before = samples(&body);
    assert_eq!(sample(&before, "gpu_flight_datasets"), 0.0);
    assert_eq!(
        sample(
            &before,
            "gpu_flight_memory_limit_bytes{device=\"0\",name=\"host memory\"}"
        ),
        64.0 * 1048576.0,
        "{body}"
    );

    let mut client = server.client().await;
    let batch = int64_batch(10_000, 4, 1);
    put(&mut client, path("metered"), vec![batch.clone()])
        .await
        .expect("put");
    let back = common::get_all(&mut client, "metered").await.expect("get");
    common::assert_same_data(&[batch], &back);
    let missing = client
        .get_flight_info(path("absent"))
        .await
        .expect_err("not found");
    assert_eq!(code_of(&missing), tonic::Code::NotFound);
    // The last call's record is written when its reply ends; a status call after it orders
    // the scrape after that.
    let _ = client
        .list_actions()
        .await
        .expect("list")
        .try_collect::<Vec<_>>()
        .await;

    let (_, body) = http_get(metrics_addr, "/metrics").await;
    let after = samples(&body);
    let moved = |name: &str| sample(&after, name) - sample(&before, name);
    assert_eq!(
        moved("gpu_flight_requests_total{method=\"DoPut\",code=\"OK\"}"),
        1.0,
        "{body}"
    );
    assert_eq!(
        moved("gpu_flight_requests_total{method=\"DoGet\",code=\"OK\"}"),
        1.0
    );
    assert_eq!(
        moved("gpu_flight_requests_total{method=\"GetFlightInfo\",code=\"NOT_FOUND\"}"),
        1.0
    );
    assert_eq!(moved("gpu_flight_received_rows_total"), 10_000.0);
    assert_eq!(moved("gpu_flight_sent_rows_total"), 10_000.0);
    assert!(moved("gpu_flight_received_bytes_total{method=\"DoPut\"}") >= 320_000.0);
    assert!(moved("gpu_flight_sent_bytes_total{method=\"DoGet\"}") >= 320_000.0);
    assert_eq!(
        moved("gpu_flight_request_duration_seconds_count{method=\"DoPut\"}"),
        1.0
    );
    assert_eq!(sample(&after, "gpu_flight_datasets"), 1.0);
    assert!(sample(&after, "gpu_flight_dataset_data_bytes") >= 320_000.0);
    assert!(
        sample(
            &after,
            "gpu_flight_memory_used_bytes{device=\"0\",name=\"host memory\"}"
        ) >= 320_000.0
    );
    assert!(sample(&after, "gpu_flight_connections") >= 1.0);
    assert!(moved("gpu_flight_connections_accepted_total") >= 1.0);
    assert_eq!(sample(&after, "gpu_flight_puts_in_flight"), 0.0);

    let (status, _) = http_get(metrics_addr, "/elsewhere").await;
    assert!(status.contains("404"), "{status}");
    let _ = stop.send(());
    endpoint.await.expect("endpoint stopped");
    server.shutdown_and_wait().await;
}

/// What the health service says about the whole server (the empty service name, which is what
/// Kubernetes asks), asked without credentials over plain text.
async fn health(addr: SocketAddr) -> Result<ServingStatus, tonic::Status> {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .expect("uri")
        .connect()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let reply = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await?;
    Ok(match reply.into_inner().status {
        1 => ServingStatus::Serving,
        2 => ServingStatus::NotServing,
        _ => ServingStatus::Unknown,
    })
}

/// Kubernetes' gRPC probes send no token and speak no TLS. Health answers them on the Flight
/// port without credentials and on the health listener in plain text; that listener serves
/// nothing else; and while the server drains, both say NOT_SERVING.
#[tokio::test]
async fn health_answers_probes_without_credentials_and_reports_draining() {
    let (token, digest) = new_token().expect("token");
    let file = std::env::temp_dir().join(format!("gpu-flight-health-{}.toml", std::process::id()));
    std::fs::write(
        &file,
        format!("[[tokens]]\nprincipal = \"etl\"\nrole = \"write\"\nsha256 = \"{digest}\"\n"),
    )
    .expect("token file");
    let authenticator = Authenticator::load(&file, DEFAULT_SESSION_TTL).expect("load");
    std::fs::remove_file(&file).expect("remove token file");
    let server = TestServer::start_with_health_listener(
        Arc::new(HostBackend::new()),
        StoreOptions::default(),
        ServeOptions {
            auth: Auth::Tokens(Arc::new(authenticator)),
            grace: Duration::from_secs(20),
            ..ServeOptions::default()
        },
    )
    .await;
    let health_addr = server.health_addr.expect("health listener");
    assert_eq!(
        health(server.addr).await.expect("health"),
        ServingStatus::Serving
    );
    assert_eq!(
        health(health_addr).await.expect("health"),
        ServingStatus::Serving
    );

    // Flight needs the token on its own port, and is not served on the health port at all.
    let mut anonymous = server.client().await;
    let Err(refused) = anonymous.list_flights("").await else {
        panic!("ListFlights without a token");
    };
    assert_eq!(code_of(&refused), tonic::Code::Unauthenticated);
    let mut elsewhere = connect(health_addr).await;
    elsewhere
        .add_header("authorization", &format!("Bearer {token}"))
        .expect("header");
    let Err(absent) = elsewhere.list_flights("").await else {
        panic!("Flight on the health port");
    };
    assert_eq!(code_of(&absent), tonic::Code::Unimplemented);

    // A put still arriving keeps the server draining after shutdown begins.
    let mut writer = server.client().await;
    writer
        .add_header("authorization", &format!("Bearer {token}"))
        .expect("header");
    let (batches, receiver) = tokio::sync::mpsc::channel(1);
    let data = arrow_flight::encode::FlightDataEncoderBuilder::new()
        .with_flight_descriptor(Some(path("slow")))
        .build(tokio_stream::wrappers::ReceiverStream::new(receiver));
    let put = tokio::spawn(async move { writer.do_put(data).await.map(|_| ()) });
    batches
        .send(Ok(int64_batch(1000, 2, 1)))
        .await
        .expect("send");
    let store = server.store.clone();
    wait_for(|| !store.status().puts.is_empty()).await;
    let mut server = server;
    server.begin_shutdown();
    let mut status = ServingStatus::Serving;
    for _ in 0..100 {
        status = health(health_addr).await.expect("health while draining");
        if status == ServingStatus::NotServing {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(status, ServingStatus::NotServing);
    drop(batches);
    let _ = put.await.expect("put task");
    server.shutdown_and_wait().await;
}

async fn wait_for(condition: impl Fn() -> bool) {
    for _ in 0..200 {
        if condition() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("condition not met in 5 s");
}

/// The exposition's shape, without the values: every `# HELP`, `# TYPE` and `# UNIT` line as
/// it is, and each sample's name, labels and whether its value is written as an integer or a
/// float, sorted within its family (a family's label sets come in no fixed order).
fn exposition_shape(text: &str) -> String {
    let mut shape = String::new();
    let mut samples: Vec<String> = Vec::new();
    let flush = |shape: &mut String, samples: &mut Vec<String>| {
        samples.sort_unstable();
        for sample in samples.drain(..) {
            shape.push_str(&sample);
            shape.push('\n');
        }
    };
    for line in text.lines() {
        if line.starts_with("# HELP") || line.starts_with("# EOF") {
            flush(&mut shape, &mut samples);
        }
        if line.starts_with('#') {
            shape.push_str(line);
            shape.push('\n');
        } else if let Some((name, value)) = line.rsplit_once(' ') {
            let kind = if value.parse::<i64>().is_ok() {
                "integer"
            } else {
                "float"
            };
            samples.push(format!("{name} {kind}"));
        }
    }
    flush(&mut shape, &mut samples);
    shape
}

/// Names, help texts, types, units and label sets of every metric a scrape of a server holding
/// a dataset shows, as dashboards and alerts rely on them: tests/golden/metrics.txt.
#[tokio::test]
async fn the_metrics_exposition_keeps_its_names_help_units_and_labels() {
    let server = TestServer::start_with(
        Arc::new(HostBackend::new()),
        StoreOptions {
            memory_limit: Some(64 << 20),
            host_memory_limit: Some(0),
            ..StoreOptions::default()
        },
        ServeOptions::default(),
    )
    .await;
    let mut client = server.client().await;
    let batch = int64_batch(1_000, 2, 1);
    put(&mut client, path("shaped"), vec![batch])
        .await
        .expect("put");
    common::get_all(&mut client, "shaped").await.expect("get");
    let _ = client
        .list_actions()
        .await
        .expect("list")
        .try_collect::<Vec<_>>()
        .await;
    let shape = exposition_shape(&server.metrics.encode().expect("encode"));
    let golden = include_str!("golden/metrics.txt");
    if shape != golden && std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(
            concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/metrics.txt"),
            &shape,
        )
        .expect("write the golden file");
    }
    assert_eq!(shape, golden, "the exposition changed:\n{shape}");
    server.shutdown_and_wait().await;
}
