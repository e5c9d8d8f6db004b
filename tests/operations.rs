//! What operators see: the Prometheus endpoint, scraped over HTTP while the server works.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use common::{TestServer, code_of, int64_batch, path, put};
use futures::TryStreamExt;
use gpu_flight::backend::HostBackend;
use gpu_flight::metrics;
use gpu_flight::server::ServeOptions;
use gpu_flight::store::StoreOptions;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

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
