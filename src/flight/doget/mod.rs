//! The framed `DoGet` reply, a fast path beside the generated server: [`respond`] answers a
//! whole `DoGet` request with an HTTP body that hands hyper the Arrow buffers without copying
//! them. The server routes `DoGet` here unless `--doget-encoder plain` chooses arrow-flight's
//! own encoder (the `FlightService` handler); both start from the same read (`read`).
//!
//! 1. `encode`: the batches are split into record batch messages that fit
//!    `--max-message-bytes` (measured by the bytes each slice really writes) and encoded as IPC
//!    messages, compressed when the ticket asks, a few ahead of the connection on a task of
//!    their own.
//! 2. `message`: each message stays IPC metadata plus the Arrow buffers it describes
//!    ([`IpcMessage`]), never concatenated.
//! 3. `body`: the reply's HTTP body frames each message for gRPC and hands hyper the large
//!    buffers where they lie, so the kernel's copy into the socket is the only one; trailers
//!    carry the final status.
//!
//! The server's layers apply here as to every method: limits on the request, authentication,
//! panic containment and accounting.

mod body;
mod encode;
mod message;

use std::sync::Arc;

use arrow_flight::Ticket;
use futures::StreamExt;
use tonic::Status;
use tonic::body::Body;
use tonic::codec::{Codec, Streaming};

pub(crate) use encode::one_row_overhead;

use super::Service;
use super::call::Call;
use super::read::Reading;
use crate::error::Error;

/// Answers one `DoGet` request: the ticket (bounded by `--max-request-bytes`) read, the reply
/// streamed as IPC messages framed for gRPC.
pub(crate) async fn respond(
    service: &Service,
    request: http::Request<Body>,
) -> http::Response<Body> {
    let (parts, body) = match super::uncompressed(request) {
        Ok(split) => split,
        Err(refused) => return *refused,
    };
    let limit = service.options.max_request_bytes;
    // The server's request-limits layer has already refused compressed, oversized, missing and
    // undecodable messages with clearer errors; the decoder's own checks are the backstop.
    let decoder = tonic_prost::ProstCodec::<Ticket, Ticket>::default().decoder();
    let mut requests = Streaming::new_request(decoder, body, None, Some(limit));
    let ticket = match requests.message().await {
        Ok(Some(ticket)) => ticket,
        Ok(None) => {
            return Status::from(Error::Undecodable(
                "the request carried no ticket".to_owned(),
            ))
            .into_http();
        }
        Err(status) => return status.into_http(),
    };
    let call = parts.extensions.get::<Arc<Call>>().cloned();
    let Reading {
        batches,
        schema,
        compression,
        running,
    } = match service.open_ticket(&ticket, call) {
        Ok(reading) => reading,
        Err(error) => return Status::from(error).into_http(),
    };
    let messages = encode::encode(
        batches,
        schema,
        service.options.max_message_bytes,
        compression,
        service.options.doget_encode_ahead,
        Arc::clone(&service.stages),
    )
    // The reply counts as running until its last message: shutdown waits for it.
    .inspect(move |_| {
        let _running = &running;
    })
    .boxed();
    let mut response = http::Response::new(Body::new(body::ReplyBody::new(messages)));
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    response
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use prost::Message;
    use tonic::Code;

    use super::*;
    use crate::auth::Auth;
    use crate::backend::HostBackend;
    use crate::flight::{FlightOptions, Lifecycle};
    use crate::store::{Store, StoreOptions};

    fn request(encoding: Option<&str>) -> http::Request<Body> {
        let ticket = Ticket::new("missing").encode_to_vec();
        let mut framed = vec![0];
        framed.extend((ticket.len() as u32).to_be_bytes());
        framed.extend(ticket);
        let mut builder = http::Request::builder()
            .uri("/arrow.flight.protocol.FlightService/DoGet")
            .header("content-type", "application/grpc");
        if let Some(encoding) = encoding {
            builder = builder.header("grpc-encoding", encoding);
        }
        builder
            .body(Body::new(http_body_util::Full::new(Bytes::from(framed))))
            .expect("request")
    }

    #[tokio::test]
    async fn compressed_requests_are_unimplemented_naming_identity() {
        let store = Store::new(Arc::new(HostBackend::new()), StoreOptions::default());
        let service = Service::new(
            store,
            FlightOptions::default(),
            Lifecycle::default(),
            Auth::default(),
        );
        let response = respond(&service, request(Some("gzip"))).await;
        let status = Status::from_header_map(response.headers()).expect("trailers-only");
        assert_eq!(status.code(), Code::Unimplemented, "{status:?}");
        assert_eq!(
            response
                .headers()
                .get("grpc-accept-encoding")
                .map(|v| v.as_bytes()),
            Some(&b"identity"[..])
        );
        for encoding in [None, Some("identity")] {
            let response = respond(&service, request(encoding)).await;
            let status = Status::from_header_map(response.headers()).expect("trailers-only");
            assert_eq!(
                status.code(),
                Code::NotFound,
                "{encoding:?}: the ticket was read"
            );
        }
    }
}
