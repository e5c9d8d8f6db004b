//! What pyarrow cannot send: hand-built Arrow IPC messages and raw HTTP/2 gRPC calls.
//!
//! IPC record batch headers are built field by field with Arrow's own flatbuffer builders, so a
//! test can declare any length, null count or buffer range. Raw calls go through the h2 crate,
//! so a test can frame messages as it likes, announce lengths it never sends, or end a stream
//! with RST_STREAM instead of END_STREAM.

use std::net::SocketAddr;

use arrow::datatypes::Schema;
use arrow::ipc::writer::IpcWriteOptions;
use arrow::ipc::{
    Buffer as IpcBuffer, FieldNode, MessageBuilder, MessageHeader, MetadataVersion,
    RecordBatchBuilder,
};
use arrow_flight::{FlightData, FlightDescriptor, SchemaAsIpc};
use bytes::Bytes;
use prost::Message;

/// The schema message of a put, carrying its descriptor as pyarrow sends it.
pub fn schema_message(schema: &Schema, descriptor: FlightDescriptor) -> FlightData {
    let mut data: FlightData = SchemaAsIpc::new(schema, &IpcWriteOptions::default()).into();
    data.flight_descriptor = Some(descriptor);
    data
}

/// A record batch message with exactly the metadata given: `length` rows, `nodes` as
/// (length, null count) per array, `buffers` as (offset, length) into `body`.
pub fn batch_message(
    length: i64,
    nodes: &[(i64, i64)],
    buffers: &[(i64, i64)],
    body: Vec<u8>,
) -> FlightData {
    let mut fbb = flatbuffers::FlatBufferBuilder::new();
    let nodes: Vec<FieldNode> = nodes.iter().map(|&(l, n)| FieldNode::new(l, n)).collect();
    let buffers: Vec<IpcBuffer> = buffers.iter().map(|&(o, l)| IpcBuffer::new(o, l)).collect();
    let nodes = fbb.create_vector(&nodes);
    let buffers = fbb.create_vector(&buffers);
    let mut batch = RecordBatchBuilder::new(&mut fbb);
    batch.add_length(length);
    batch.add_nodes(nodes);
    batch.add_buffers(buffers);
    let batch = batch.finish();
    let mut message = MessageBuilder::new(&mut fbb);
    message.add_version(MetadataVersion::V5);
    message.add_header_type(MessageHeader::RecordBatch);
    message.add_header(batch.as_union_value());
    message.add_bodyLength(body.len() as i64);
    let message = message.finish();
    fbb.finish(message, None);
    FlightData {
        data_header: Bytes::copy_from_slice(fbb.finished_data()),
        data_body: body.into(),
        ..FlightData::default()
    }
}

/// One gRPC message: the 5-byte prefix (uncompressed, big-endian length) and `message`.
pub fn frame(message: &[u8]) -> Bytes {
    let mut framed = Vec::with_capacity(message.len() + 5);
    framed.push(0);
    framed.extend_from_slice(&(message.len() as u32).to_be_bytes());
    framed.extend_from_slice(message);
    framed.into()
}

/// `messages` encoded and framed one after another.
pub fn frames<M: Message>(messages: &[M]) -> Bytes {
    let mut body = Vec::new();
    for message in messages {
        body.extend_from_slice(&frame(&message.encode_to_vec()));
    }
    body.into()
}

/// How a raw call ends its request stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// END_STREAM: the client finished cleanly.
    Clean,
    /// RST_STREAM with NO_ERROR, which hyper passes on as an ordinary end of the body.
    ResetNoError,
    /// Nothing: the stream stays open (the caller drops it later).
    Open,
    /// A trailers frame, which also ends the stream.
    Trailers,
    /// END_STREAM on the request headers: no body at all (`body` is ignored).
    OnHeaders,
}

/// A raw HTTP/2 connection to the server.
pub async fn h2_connect(addr: SocketAddr) -> h2::client::SendRequest<Bytes> {
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (client, connection) = h2::client::handshake(tcp).await.expect("h2 handshake");
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client.ready().await.expect("h2 ready")
}

/// The gRPC status and message a call ended with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub code: i32,
    pub message: String,
}

/// Calls Flight method `method` with the bytes `body` (already framed), ending the request as
/// `end` says, and waits for the status (at most `wait`).
pub async fn call(
    client: &mut h2::client::SendRequest<Bytes>,
    method: &str,
    body: Bytes,
    end: End,
    wait: std::time::Duration,
) -> Option<Outcome> {
    call_with(client, method, &[], body, end, wait).await
}

/// [`call`] with more request headers.
pub async fn call_with(
    client: &mut h2::client::SendRequest<Bytes>,
    method: &str,
    headers: &[(&str, &str)],
    body: Bytes,
    end: End,
    wait: std::time::Duration,
) -> Option<Outcome> {
    let mut request = http::Request::builder()
        .method("POST")
        .uri(format!(
            "http://localhost/arrow.flight.protocol.FlightService/{method}"
        ))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request.body(()).expect("request");
    let (response, mut stream) = client
        .send_request(request, end == End::OnHeaders)
        .expect("send");
    if end != End::OnHeaders {
        stream.reserve_capacity(body.len());
        stream
            .send_data(body, end == End::Clean)
            .expect("send body");
    }
    if end == End::Trailers {
        stream
            .send_trailers(http::HeaderMap::new())
            .expect("send trailers");
    }
    if end == End::ResetNoError {
        // Let the data go out first, as a client that reset after sending would.
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        stream.send_reset(h2::Reason::NO_ERROR);
    }
    let outcome = tokio::time::timeout(wait, async move {
        let response = response.await.ok()?;
        let status = |headers: &http::HeaderMap| {
            let code = headers.get("grpc-status")?.to_str().ok()?.parse().ok()?;
            let message = headers
                .get("grpc-message")
                .and_then(|m| m.to_str().ok())
                .map(percent_decode)
                .unwrap_or_default();
            Some(Outcome { code, message })
        };
        if let Some(outcome) = status(response.headers()) {
            return Some(outcome);
        }
        let mut body = response.into_body();
        while let Some(data) = body.data().await {
            let _ = data.ok()?;
        }
        let trailers = body.trailers().await.ok()??;
        status(&trailers)
    })
    .await
    .ok()
    .flatten();
    drop(stream);
    outcome
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let Ok(byte) = u8::from_str_radix(&text[i + 1..i + 3], 16)
        {
            out.push(byte);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}
