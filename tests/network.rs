//! The network path's instruments and knobs (issue 27): the per-stage counters `status` shows
//! move with the bytes that streams move, and a server with non-default HTTP/2 settings and
//! read depths still serves every byte.

mod common;

use std::sync::Arc;

use common::*;
use gpu_flight::backend::HostBackend;
use gpu_flight::flight::FlightOptions;
use gpu_flight::server::{Http2Settings, ServeOptions};
use serde_json::Value;

fn stage(status: &Value, op: &str, field: &str) -> f64 {
    status["stages"][op][field]
        .as_f64()
        .unwrap_or_else(|| panic!("stages.{op}.{field} in {}", status["stages"]))
}

#[tokio::test]
async fn stage_counters_move_with_puts_and_gets() {
    let server = TestServer::start(Arc::new(HostBackend::new())).await;
    let mut client = server.client().await;
    let before = status(&mut client).await;
    for field in ["messages", "bytes"] {
        assert_eq!(stage(&before, "doget", field), 0.0, "{field}");
        assert_eq!(stage(&before, "put", field), 0.0, "{field}");
    }

    let batches: Vec<_> = (0..4).map(|seed| int64_batch(50_000, 4, seed)).collect();
    let data_bytes: usize = batches.iter().map(|b| b.get_array_memory_size()).sum();
    put(&mut client, path("t"), batches.clone())
        .await
        .expect("put");
    let after_put = status(&mut client).await;
    // The schema message and the four batches, each with its Arrow body.
    assert!(stage(&after_put, "put", "messages") >= 5.0, "{after_put}");
    assert!(
        stage(&after_put, "put", "bytes") >= data_bytes as f64 * 0.9,
        "{}",
        after_put["stages"]
    );
    for field in ["decode_seconds", "upload_seconds"] {
        assert!(stage(&after_put, "put", field) > 0.0, "put {field}");
    }
    assert_eq!(stage(&after_put, "doget", "messages"), 0.0, "no read yet");

    let read = get_by_name(&mut client, "t").await.expect("get");
    assert_same_data(&batches, &read);
    let after_get = status(&mut client).await;
    assert!(stage(&after_get, "doget", "messages") >= 5.0);
    assert!(stage(&after_get, "doget", "bytes") >= stage(&after_put, "put", "bytes") * 0.9);
    for field in ["staging_seconds", "encode_seconds"] {
        assert!(stage(&after_get, "doget", field) > 0.0, "get {field}");
    }
    for field in ["send_wait_seconds", "staging_seconds", "encode_seconds"] {
        assert!(stage(&after_get, "doget", field).is_finite());
    }
    // Reads count nothing as put, and the put's counters stay where they were.
    assert_eq!(after_get["stages"]["put"], after_put["stages"]["put"]);
    server.shutdown_and_wait().await;
}

#[tokio::test]
async fn tuned_http2_settings_and_read_depths_serve_every_byte() {
    for (http2, read_chunk_bytes, read_prefetch, doget_encode_ahead) in [
        (
            Http2Settings {
                stream_window_bytes: 65_535,
                connection_window_bytes: 65_535,
                max_frame_bytes: 16 << 10,
                adaptive_window: false,
            },
            64 << 10,
            1,
            1,
        ),
        (
            Http2Settings {
                stream_window_bytes: 64 << 20,
                connection_window_bytes: 256 << 20,
                max_frame_bytes: (16 << 20) - 1,
                adaptive_window: true,
            },
            1 << 20,
            8,
            32,
        ),
    ] {
        let options = ServeOptions {
            http2,
            flight: FlightOptions {
                read_chunk_bytes,
                read_prefetch,
                doget_encode_ahead,
                ..FlightOptions::default()
            },
            ..ServeOptions::default()
        };
        let server = TestServer::on_host(options).await;
        let mut client = server.client().await;
        let batches = vec![int64_batch(100_000, 3, 1), string_batch(20_000, 2)];
        for (i, batch) in batches.into_iter().enumerate() {
            let name = format!("t{i}");
            put(&mut client, path(&name), vec![batch.clone()])
                .await
                .expect("put");
            let read = get_all(&mut client, &name).await.expect("get");
            assert_same_data(&[batch], &read);
        }
        server.shutdown_and_wait().await;
    }
}
