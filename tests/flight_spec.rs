//! What the Flight specification asks of a server beyond reads and writes: endpoints that say
//! where they are served (`--advertise-uri`, `arrow-flight-reuse-connection://?`),
//! `PollFlightInfo`, `CancelFlightInfo` and `RenewFlightEndpoint`.

mod common;

use std::sync::Arc;

use arrow_flight::{
    CancelFlightInfoRequest, CancelStatus, FlightDescriptor, RenewFlightEndpointRequest,
};
use common::*;
use futures::TryStreamExt;
use gpu_flight::backend::HostBackend;
use gpu_flight::flight::FlightOptions;
use gpu_flight::server::ServeOptions;

const REUSE: &str = "arrow-flight-reuse-connection://?";

fn locations(endpoint: &arrow_flight::FlightEndpoint) -> Vec<&str> {
    endpoint.location.iter().map(|l| l.uri.as_str()).collect()
}

#[tokio::test]
async fn endpoints_carry_this_servers_locations() {
    let plain = TestServer::start(Arc::new(HostBackend::new())).await;
    let mut client = plain.client().await;
    put(&mut client, path("t"), vec![int64_batch(1000, 2, 0)])
        .await
        .expect("put");
    let info = client.get_flight_info(path("t")).await.expect("info");
    assert!(!info.endpoint.is_empty());
    for endpoint in &info.endpoint {
        assert_eq!(locations(endpoint), [REUSE], "the caller's own connection");
    }
    plain.shutdown_and_wait().await;

    let options = ServeOptions {
        flight: FlightOptions {
            advertise: vec![
                "grpc://gpu-node-7:8815".to_owned(),
                "grpc+unix:///run/gpu-flight.sock".to_owned(),
            ],
            rows_per_endpoint: 100,
            ..FlightOptions::default()
        },
        ..ServeOptions::default()
    };
    let server = TestServer::on_host(options).await;
    let mut client = server.client().await;
    put(&mut client, path("t"), vec![int64_batch(1000, 2, 0)])
        .await
        .expect("put");
    let info = client.get_flight_info(path("t")).await.expect("info");
    assert_eq!(info.endpoint.len(), 10);
    for endpoint in &info.endpoint {
        assert_eq!(
            locations(endpoint),
            [
                "grpc://gpu-node-7:8815",
                "grpc+unix:///run/gpu-flight.sock",
                REUSE
            ]
        );
    }
    server.shutdown_and_wait().await;
}

#[tokio::test]
async fn poll_answers_the_complete_info_and_cancel_and_renew_change_nothing() {
    let server = TestServer::start(Arc::new(HostBackend::new())).await;
    let mut client = server.client().await;
    let batch = int64_batch(5000, 3, 7);
    put(&mut client, path("t"), vec![batch.clone()])
        .await
        .expect("put");
    let info = client.get_flight_info(path("t")).await.expect("info");

    let polled = client.poll_flight_info(path("t")).await.expect("poll");
    assert_eq!(polled.info.as_ref(), Some(&info), "complete at once");
    assert_eq!(polled.progress, Some(1.0));
    assert!(polled.flight_descriptor.is_none(), "nothing left to poll");
    let missing = client
        .poll_flight_info(FlightDescriptor::new_path(vec!["absent".into()]))
        .await
        .expect_err("not found");
    assert_eq!(code_of(&missing), tonic::Code::NotFound);

    let cancelled = client
        .cancel_flight_info(CancelFlightInfoRequest::new(info.clone()))
        .await
        .expect("cancel");
    assert_eq!(cancelled.status(), CancelStatus::NotCancellable);

    let endpoint = info.endpoint[0].clone();
    let renewed = client
        .renew_flight_endpoint(RenewFlightEndpointRequest::new(endpoint.clone()))
        .await
        .expect("renew");
    assert_eq!(renewed, endpoint, "tickets do not expire by time");
    let ticket = renewed.ticket.expect("a ticket");
    let read: Vec<_> = client
        .do_get(ticket)
        .await
        .expect("the renewed ticket reads")
        .try_collect()
        .await
        .expect("read");
    assert_eq!(read.iter().map(|b| b.num_rows()).sum::<usize>(), 5000);
    server.shutdown_and_wait().await;
}
