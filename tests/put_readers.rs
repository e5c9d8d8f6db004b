//! The two readers of `DoPut` messages (the server's own, straight from the HTTP/2 frames, and
//! tonic's codec under the hidden `--doput-decoder plain`) take the same streams to the same
//! datasets and refuse the same ones with the same codes: every type, many batches, fields in
//! an order no Flight writer uses, bytes that are not protobuf.

mod common;

use arrow_flight::FlightData;
use arrow_flight::encode::{DictionaryHandling, FlightDataEncoderBuilder};
use bytes::Bytes;
use common::raw::raw_do_put;
use common::*;
use futures::TryStreamExt;
use gpu_flight::server::{DoPutDecoder, ServeOptions};
use prost::Message;
use tonic::Code;

async fn server(decoder: DoPutDecoder) -> TestServer {
    TestServer::on_host(ServeOptions {
        doput_decoder: decoder,
        ..ServeOptions::default()
    })
    .await
}

/// A put of `batches` under `name`, as protobuf messages a test may rearrange.
async fn encoded(name: &str, batches: Vec<arrow::record_batch::RecordBatch>) -> Vec<Vec<u8>> {
    let schema = batches[0].schema();
    let messages: Vec<FlightData> = FlightDataEncoderBuilder::new()
        .with_schema(schema)
        .with_flight_descriptor(Some(cmd(name, "create")))
        .with_dictionary_handling(DictionaryHandling::Resend)
        .build(futures::stream::iter(batches.into_iter().map(Ok)))
        .try_collect()
        .await
        .expect("encode");
    messages.iter().map(Message::encode_to_vec).collect()
}

/// Field 1000 (data_body) with `body`.
fn body_field(body: &[u8]) -> Vec<u8> {
    let mut field = vec![0xc2, 0x3e];
    prost::encoding::encode_varint(body.len() as u64, &mut field);
    field.extend(body);
    field
}

/// The message with its body (encoded last by every Flight writer) moved to the front.
fn body_first(encoded: &[u8]) -> Vec<u8> {
    let message = FlightData::decode(encoded).expect("FlightData");
    if message.data_body.is_empty() {
        return encoded.to_vec();
    }
    let mut moved = body_field(&message.data_body);
    FlightData {
        data_body: Bytes::new(),
        ..message
    }
    .encode(&mut moved)
    .expect("encode");
    moved
}

/// The message with a short body before its real one, which replaces it.
fn two_bodies(encoded: &[u8]) -> Vec<u8> {
    if FlightData::decode(encoded)
        .expect("FlightData")
        .data_body
        .is_empty()
    {
        return encoded.to_vec();
    }
    let mut doubled = body_field(&[1, 2, 3]);
    doubled.extend(encoded);
    doubled
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_readers_store_every_type_alike() {
    let batches: Vec<_> = (0..3).map(|_| all_types_batch(700)).collect();
    for decoder in [DoPutDecoder::Framed, DoPutDecoder::Plain] {
        let server = server(decoder).await;
        let mut client = server.client().await;
        for (name, rearrange) in [
            ("as_sent", None),
            ("body_first", Some(body_first as fn(&[u8]) -> Vec<u8>)),
            ("two_bodies", Some(two_bodies)),
        ] {
            let messages = encoded(name, batches.clone()).await;
            let messages = messages
                .iter()
                .map(|m| Bytes::from(rearrange.map_or_else(|| m.clone(), |r| r(m))))
                .collect();
            raw_do_put(server.channel().await, messages)
                .await
                .unwrap_or_else(|e| panic!("{decoder:?} {name}: {e:?}"));
            let received = get_all(&mut client, name).await.expect("read back");
            assert_same_data(&batches, &received);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_readers_refuse_alike() {
    let valid = encoded("refused", vec![int64_batch(1000, 3, 1)]).await;
    let cases: Vec<(&str, Vec<Bytes>, Code)> = vec![
        (
            "not protobuf",
            vec![Bytes::from(valid[0].clone()), Bytes::from_static(&[0xff])],
            Code::InvalidArgument,
        ),
        (
            "a body longer than its message",
            vec![
                Bytes::from(valid[0].clone()),
                Bytes::from_static(&[0xc2, 0x3e, 100, 1, 2]),
            ],
            Code::InvalidArgument,
        ),
        (
            "a body without a header",
            vec![
                Bytes::from(valid[0].clone()),
                Bytes::from(body_field(&[0; 64])),
            ],
            Code::InvalidArgument,
        ),
    ];
    for decoder in [DoPutDecoder::Framed, DoPutDecoder::Plain] {
        let server = server(decoder).await;
        let mut client = server.client().await;
        for (name, messages, code) in &cases {
            let status = raw_do_put(server.channel().await, messages.clone())
                .await
                .expect_err(name);
            assert_eq!(status.code(), *code, "{decoder:?} {name}: {status:?}");
        }
        assert!(
            list_all(&mut client).await.is_empty(),
            "{decoder:?}: nothing committed"
        );
        assert_eq!(used_bytes(&mut client).await, 0, "{decoder:?}");
    }
}
