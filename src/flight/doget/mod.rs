//! `DoGet`, the whole transport in one place: a ticket in, FlightData frames out.
//!
//! [`respond`] is the entry point (the router calls it for every `DoGet`); the steps, in order:
//!
//! 1. [`stream`]: the ticket names a dataset version and a row range (a bare name: the whole
//!    current version); the dataset reads that range as chunks, several in flight, so a device
//!    backend's copies to host memory overlap with encoding and sending. The reply counts as a
//!    running stream ([`super::Lifecycle`]) until it ends, so shutdown waits for it.
//! 2. `encode`: the chunks are split into record batch messages that fit `--max-message-bytes`
//!    (measured by the bytes each slice really writes) and encoded as IPC messages, compressed
//!    when the ticket asks, a few ahead of the connection on a task of their own.
//! 3. `message`: each message stays IPC metadata plus the Arrow buffers it describes
//!    ([`IpcMessage`]), never concatenated.
//! 4. `body`: the reply's HTTP body frames each message for gRPC and hands hyper the large
//!    buffers where they lie, so the kernel's copy into the socket is the only one; trailers
//!    carry the final status.

mod body;
mod encode;
mod message;

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use arrow_flight::Ticket;
use futures::StreamExt;
use tonic::Status;
use tonic::body::Body;
use tonic::codec::Streaming;

pub(crate) use encode::one_row_overhead;
pub(crate) use message::IpcMessage;

use super::call::Call;
use super::descriptor::ReadOptions;
use super::router::{StrictDecoder, guard, panicked, request_too_large};
use super::ticket::{self, TicketRequest};
use super::{Service, Stream};
use crate::error::Error;

/// Serves one `DoGet` request: the ticket is bounded by `--max-request-bytes`, the reply
/// streamed as [`stream`] produces it.
pub(super) async fn respond(
    service: &Arc<Service>,
    request: http::Request<Body>,
) -> http::Response<Body> {
    if let Some(refused) = unsupported_encoding(request.headers()) {
        return refused.into_http();
    }
    let limit = service.options.max_request_bytes;
    let request = guard(request, limit, request_too_large, None, true);
    let (parts, body) = request.into_parts();
    // The guard has already refused compressed, oversized and missing messages with clearer
    // errors; the decoder's own checks are the backstop.
    let mut requests =
        Streaming::new_request(StrictDecoder::<Ticket>::default(), body, None, Some(limit));
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
    let messages = std::panic::catch_unwind(AssertUnwindSafe(|| stream(service, &ticket, call)));
    match messages {
        Ok(Ok(messages)) => {
            // Polling the messages cannot unwind into hyper either.
            let messages = AssertUnwindSafe(messages)
                .catch_unwind()
                .map(|item| item.unwrap_or_else(|panic| Err(panicked(panic.as_ref()))))
                .boxed();
            let mut response = http::Response::new(Body::new(body::ReplyBody::new(messages)));
            response.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/grpc"),
            );
            response
        }
        Ok(Err(error)) => Status::from(error).into_http(),
        Err(panic) => panicked(panic.as_ref()).into_http(),
    }
}

/// A request compressed with anything but `identity` is UNIMPLEMENTED, naming the encoding
/// this server accepts, as gRPC asks (and as tonic answers for the other methods).
fn unsupported_encoding(headers: &http::HeaderMap) -> Option<Status> {
    let encoding = headers.get("grpc-encoding")?;
    if encoding.as_bytes() == b"identity" {
        return None;
    }
    let mut metadata = tonic::metadata::MetadataMap::new();
    metadata.insert(
        "grpc-accept-encoding",
        tonic::metadata::MetadataValue::from_static("identity"),
    );
    Some(Status::with_metadata(
        tonic::Code::Unimplemented,
        format!(
            "the request is compressed with {:?}, which this server does not accept; send it \
             uncompressed",
            String::from_utf8_lossy(encoding.as_bytes())
        ),
        metadata,
    ))
}

/// The reply to `ticket`: its rows read from the store and encoded as IPC messages.
pub(super) fn stream(
    service: &Service,
    ticket: &Ticket,
    call: Option<Arc<Call>>,
) -> Result<Stream<IpcMessage>, Error> {
    service.ensure_serving()?;
    let request = ticket::decode(&ticket.ticket)?;
    if let Some(call) = &call {
        call.set_subject(request.name());
    }
    let (dataset, rows, read) = match request {
        TicketRequest::Whole { name } => {
            let dataset = service.store.get(&name)?;
            let rows = 0..dataset.num_rows();
            (dataset, rows, ReadOptions::default())
        }
        TicketRequest::Rows {
            name,
            version,
            rows,
            options,
        } => {
            let dataset = service.store.get(&name)?;
            let current = dataset.version_id();
            if current.number != version.number {
                return Err(crate::store::StoreError::StaleVersion {
                    name,
                    ticket: version.number,
                    current: current.number,
                }
                .into());
            }
            if current.tag != version.tag {
                return Err(crate::store::StoreError::ForeignTicket { name }.into());
            }
            (dataset, rows, options)
        }
    };
    tracing::debug!(dataset = dataset.name(), ?rows, "DoGet");
    let options = &service.options;
    let mut batches = dataset.read(rows, options.read_chunk_bytes, options.read_prefetch)?;
    if let Some(call) = call {
        batches = batches
            .inspect(move |batch| {
                if let Ok(batch) = batch {
                    call.add_rows_out(batch.num_rows() as u64);
                }
            })
            .boxed();
    }
    let guard = service.lifecycle.track();
    let messages = encode::encode(
        batches,
        dataset.schema(),
        options.max_message_bytes,
        read.compression.map(Into::into),
    );
    // The guard lives as long as the reply stream: shutdown waits for it.
    Ok(messages
        .inspect(move |_| {
            let _running = &guard;
        })
        .boxed())
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use prost::Message;
    use tonic::Code;
    use tower_service::Service as _;

    use super::*;
    use crate::auth::Auth;
    use crate::backend::HostBackend;
    use crate::flight::{FlightOptions, Lifecycle, make_server};
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
        let mut router = make_server(
            store,
            FlightOptions::default(),
            Lifecycle::default(),
            Auth::default(),
            None,
        );
        let response = router.call(request(Some("gzip"))).await.expect("response");
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
            let response = router.call(request(encoding)).await.expect("response");
            let status = Status::from_header_map(response.headers()).expect("trailers-only");
            assert_eq!(
                status.code(),
                Code::NotFound,
                "{encoding:?}: the ticket was read"
            );
        }
    }
}
