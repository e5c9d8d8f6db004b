//! Flight calls with arbitrary request bytes: a tonic codec that passes messages through as
//! bytes, so a test can send protobuf that no generated client would produce (truncated,
//! bit-flipped, invalid UTF-8 in string fields) and see exactly what the server answers.

use bytes::{Buf, BufMut, Bytes};
use futures::StreamExt;
use http::uri::PathAndQuery;
use tonic::Status;
use tonic::client::Grpc;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::transport::Channel;

pub const HANDSHAKE: &str = "/arrow.flight.protocol.FlightService/Handshake";
pub const LIST_FLIGHTS: &str = "/arrow.flight.protocol.FlightService/ListFlights";
pub const GET_FLIGHT_INFO: &str = "/arrow.flight.protocol.FlightService/GetFlightInfo";
pub const POLL_FLIGHT_INFO: &str = "/arrow.flight.protocol.FlightService/PollFlightInfo";
pub const GET_SCHEMA: &str = "/arrow.flight.protocol.FlightService/GetSchema";
pub const DO_GET: &str = "/arrow.flight.protocol.FlightService/DoGet";
pub const DO_PUT: &str = "/arrow.flight.protocol.FlightService/DoPut";
pub const DO_EXCHANGE: &str = "/arrow.flight.protocol.FlightService/DoExchange";
pub const DO_ACTION: &str = "/arrow.flight.protocol.FlightService/DoAction";
pub const LIST_ACTIONS: &str = "/arrow.flight.protocol.FlightService/ListActions";

/// Replies larger than gRPC's usual 4 MiB are the server's business (it bounds its own
/// messages); the fuzzer must not turn them into client-side errors.
const MAX_REPLY_BYTES: usize = 256 << 20;

/// Messages are bytes in both directions, unparsed.
#[derive(Debug, Clone, Copy, Default)]
pub struct RawCodec;

#[derive(Debug, Clone, Copy, Default)]
pub struct RawEncoder;

#[derive(Debug, Clone, Copy, Default)]
pub struct RawDecoder;

impl Codec for RawCodec {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = RawEncoder;
    type Decoder = RawDecoder;

    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }

    fn decoder(&mut self) -> RawDecoder {
        RawDecoder
    }
}

impl Encoder for RawEncoder {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put(item);
        Ok(())
    }
}

impl Decoder for RawDecoder {
    type Item = Bytes;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

/// Calls `method` (a full path such as [`GET_FLIGHT_INFO`]) with the messages `requests` and
/// collects every reply message. Works for all four gRPC call shapes: a unary reply is a
/// stream of one.
pub async fn raw_call(
    channel: Channel,
    method: &str,
    requests: Vec<Bytes>,
) -> Result<Vec<Bytes>, Status> {
    let path: PathAndQuery = method
        .parse()
        .map_err(|e| Status::invalid_argument(format!("bad method path {method}: {e}")))?;
    let mut grpc = Grpc::new(channel).max_decoding_message_size(MAX_REPLY_BYTES);
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(format!("channel not ready: {e}")))?;
    let request = tonic::Request::new(futures::stream::iter(requests));
    let mut replies = grpc.streaming(request, path, RawCodec).await?.into_inner();
    let mut messages = Vec::new();
    while let Some(message) = replies.next().await {
        messages.push(message?);
    }
    Ok(messages)
}

/// A unary or server-streaming call with one request message of arbitrary bytes.
pub async fn raw_unary(
    channel: Channel,
    method: &str,
    request: Bytes,
) -> Result<Vec<Bytes>, Status> {
    raw_call(channel, method, vec![request]).await
}

/// `DoPut` with FlightData messages given as raw protobuf bytes; returns the PutResults.
pub async fn raw_do_put(channel: Channel, messages: Vec<Bytes>) -> Result<Vec<Bytes>, Status> {
    raw_call(channel, DO_PUT, messages).await
}
