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
//! 3. `message`: each message is written into its gRPC frame with one copy by the codec
//!    ([`message::FlightDataCodec`]); the Arrow buffers are never concatenated first.

mod encode;
mod message;

use std::sync::Arc;

use arrow_flight::Ticket;
use futures::{FutureExt, StreamExt};
use tonic::body::Body;
use tonic::server::Grpc;

pub(crate) use message::IpcMessage;

use super::call::Call;
use super::descriptor::ReadOptions;
use super::router::{guard, request_too_large, stream_handler};
use super::ticket::{self, TicketRequest};
use super::{Service, Stream};
use crate::error::Error;

/// Serves one `DoGet` request: the ticket is bounded by `--max-request-bytes`, the reply
/// streamed as [`stream`] produces it.
pub(super) async fn respond(
    service: &Arc<Service>,
    request: http::Request<Body>,
) -> http::Response<Body> {
    let limit = service.options.max_request_bytes;
    let request = guard(request, limit, request_too_large, None, true);
    Grpc::new(message::FlightDataCodec)
        .apply_max_message_size_config(Some(limit), Some(usize::MAX))
        .server_streaming(
            stream_handler(service, |s, r| {
                async move {
                    let call = r.extensions().get::<Arc<Call>>().cloned();
                    Ok(tonic::Response::new(stream(&s, r.get_ref(), call)?))
                }
                .boxed()
            }),
            request,
        )
        .await
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
            if dataset.version() != version {
                return Err(crate::store::StoreError::StaleVersion {
                    name,
                    ticket: version,
                    current: dataset.version(),
                }
                .into());
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
