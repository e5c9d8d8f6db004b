//! `DoPut`: decode the client's Arrow IPC stream and feed it to a pending put.
//!
//! Uploads are pipelined: up to `depth` batches are being copied into backend memory while the
//! next messages are received and decoded. When `depth` uploads are outstanding the loop waits
//! for the oldest before reading more, which is the backpressure that bounds memory: gRPC flow
//! control then slows the client. Every message was paid for against the memory budget as its
//! bytes arrived (by the server's request-limits layer, which leaves the charges in the
//! request's [`Inbound`] ledger, in message order); that reservation follows the message until
//! its batch is uploaded (or, for a dictionary, until the put ends).
//!
//! **A put commits only on a clean end**: the receiving task must report [`Received::End`],
//! which it does only when the request stream ended with END_STREAM. A transport error, a reset,
//! a keepalive timeout, shutdown, the client's abort marker (`decode::PutAbort`), or the
//! receiving task dying for any reason ends the put with an error instead, and dropping the
//! pending put frees everything it had uploaded.
//!
//! Receiving runs on its own task a few messages ahead of decoding: the copy out of the HTTP/2
//! frames (`put_stream`) and decoding then proceed on different cores. If the put fails, the
//! receiving task is aborted and its request stream dropped.
//!
//! The server routes `DoPut` here ([`respond`]) past the generated server, whose codec would copy
//! each message once more, unless `--doput-decoder plain` keeps it there (the `do_put` handler).

use std::sync::Arc;
use std::time::Instant;

use arrow_flight::PutResult;
use bytes::{BufMut, BytesMut};
use futures::stream::FuturesOrdered;
use futures::{FutureExt, StreamExt};
use http_body::Frame;
use prost::Message;
use tonic::body::Body;
use tonic::metadata::MetadataMap;
use tonic::{Request, Status};

use super::call::Call;
use super::decode::{Decoded, PutDecoder, worth_a_block};
use super::descriptor::{self, DeviceRef};
use super::put_stream::{BodyBlocks, FrameReader, Inbound, PutMessage, PutMessages};
use super::sql::{self, IngestCheck, SqlPut};
use super::stages::Stages;
use super::{FlightOptions, Service};
use crate::auth::{self, Operation, Principal};
use crate::error::Error;
use crate::store::{PutSummary, Store};
use crate::task::AbortOnDrop;

/// Messages received ahead of the decoder.
const RECEIVE_AHEAD: usize = 4;

/// The store's number for a device a client named by number (checked by the store) or UUID.
pub(super) fn resolve_device(store: &Store, device: DeviceRef) -> Result<u32, Error> {
    /// `GPU-` and 32 hex digits in 8-4-4-4-12, and some room: longer is not a UUID, and is
    /// not echoed back.
    const MAX_UUID_BYTES: usize = 64;
    match device {
        DeviceRef::Number(number) => Ok(number),
        DeviceRef::Uuid(uuid) if uuid.len() > MAX_UUID_BYTES => Err(Error::InvalidCommand(
            "a device is a number or a GPU UUID (GPU- and 32 hex digits, as status lists them)"
                .to_owned(),
        )),
        DeviceRef::Uuid(uuid) => store
            .backend()
            .devices()
            .iter()
            .position(|d| {
                d.uuid
                    .as_deref()
                    .is_some_and(|u| u.eq_ignore_ascii_case(&uuid))
            })
            .map(|index| index as u32)
            .ok_or_else(|| {
                Error::InvalidCommand(format!(
                    "no device of this server has the UUID {uuid:?}; the status action lists them"
                ))
            }),
    }
}

/// Answers one `DoPut` request, its messages read by [`FrameReader`].
pub(crate) async fn respond(
    service: &Service,
    request: http::Request<Body>,
) -> http::Response<Body> {
    let (parts, body) = match super::uncompressed(request) {
        Ok(split) => split,
        Err(refused) => return *refused,
    };
    // Left by the request-limits layer, which also bounds and charges every message and fails
    // a body that did not really end: without it, nothing is read.
    let Some(inbound) = parts.extensions.get::<Inbound>().cloned() else {
        return Status::from(Error::Internal(
            "a DoPut reached its handler without the request-limits layer".to_owned(),
        ))
        .into_http();
    };
    let messages = FrameReader::new(body, inbound);
    let request = Request::from_parts(
        MetadataMap::from_headers(parts.headers),
        parts.extensions,
        messages,
    );
    match service.put(request).await {
        Ok(result) => reply(&result),
        Err(error) => Status::from(error).into_http(),
    }
}

/// A reply of one message, `result`, and an OK status, as tonic's server frames it.
fn reply(result: &PutResult) -> http::Response<Body> {
    let message = result.encode_to_vec();
    let Ok(length) = u32::try_from(message.len()) else {
        return Status::internal("the put's result is over 4 GiB").into_http();
    };
    let mut framed = BytesMut::with_capacity(5 + message.len());
    framed.put_u8(0);
    framed.put_u32(length);
    framed.put_slice(&message);
    let mut trailers = http::HeaderMap::new();
    if let Err(status) = Status::ok("").add_header(&mut trailers) {
        return status.into_http();
    }
    let frames = [
        Ok::<_, Status>(Frame::data(framed.freeze())),
        Ok(Frame::trailers(trailers)),
    ];
    let mut response = http::Response::new(Body::new(http_body_util::StreamBody::new(
        futures::stream::iter(frames),
    )));
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    response
}

/// What the receiving task hands the decoder.
enum Received {
    Message(PutMessage),
    /// The client ended its stream cleanly: the only way a put commits.
    End,
    Failed(Error),
}

/// What a `DoPut` did, which its answer says.
pub(crate) enum Answer {
    /// A put named by our own descriptors.
    Put(PutSummary),
    /// A Flight SQL bulk ingestion.
    Ingested(PutSummary),
    /// A Flight SQL prepared statement's parameters, bound.
    Bound(bytes::Bytes),
}

/// Receives a whole `DoPut` stream from `caller`: commits a put, or binds a prepared
/// statement's parameters.
pub(crate) async fn receive(
    service: &Service,
    request: Request<impl PutMessages>,
    caller: &Principal,
) -> Result<Answer, Error> {
    let store = &service.store;
    let options = &service.options;
    let depth = options.put_pipeline_depth.max(1);
    let call = request.extensions().get::<Arc<Call>>().cloned();
    let mut input = request.into_inner();
    let Some(first) = input.message().await? else {
        return Err(Error::InvalidIpc(
            "the DoPut stream was empty; send a descriptor and a schema first".to_owned(),
        ));
    };
    // DoPut is admitted at the read role, which binding parameters needs; a put of data needs
    // the write role, checked before any batch is read.
    let put = Operation::Action(auth::Action::Put);
    let (target, ingested) = match sql::put_command(first.data.flight_descriptor.as_ref())? {
        None => {
            caller.authorize(put)?;
            (
                descriptor::put_target(first.data.flight_descriptor.as_ref())?,
                None,
            )
        }
        Some(SqlPut::Ingest(target, check)) => {
            caller.authorize(put)?;
            (target, Some(check))
        }
        Some(SqlPut::Parameters(handle)) => {
            let batches = receive_parameters(first, input, options).await?;
            service.prepared.bind(&handle, batches, caller)?;
            return Ok(Answer::Bound(handle));
        }
    };
    if let Some(call) = &call {
        call.set_subject(target.name.as_str());
    }
    let device = target
        .device
        .map(|d| resolve_device(store, d))
        .transpose()?;
    let mut pending = store.begin_put_on(target.name, target.mode, &caller.name, device)?;
    if ingested == Some(IngestCheck::MustExist) {
        pending.require_existing()?;
    }

    if !store.keeps_decoded_arrays() {
        // Bodies worth a block go straight into pinned memory: the decoder then makes no copy
        // of its own there (`PutDecoder::with_pinned_bodies`).
        let blocks = store.clone();
        input.receive_bodies_in(BodyBlocks {
            wants: worth_a_block,
            take: Box::new(move |len| blocks.body_block(len)),
        });
    }
    let (sender, mut receiver) = tokio::sync::mpsc::channel(RECEIVE_AHEAD);
    let _receiving = AbortOnDrop(tokio::spawn(async move {
        loop {
            let item = match input.message().await {
                Ok(Some(message)) => Received::Message(message),
                Ok(None) => Received::End,
                Err(error) => Received::Failed(error),
            };
            let last = !matches!(item, Received::Message(..));
            if sender.send(item).await.is_err() || last {
                break;
            }
        }
    }));

    let mut decoder = PutDecoder::new(
        options.max_message_bytes,
        options.max_put_message_bytes as u64,
        store.keeps_decoded_arrays(),
    );
    if !store.keeps_decoded_arrays() {
        let bodies = store.clone();
        decoder = decoder.with_pinned_bodies(Box::new(move |body| bodies.pinned_copy(body)));
    }
    let mut uploads = FuturesOrdered::new();
    // Dictionaries stay referenced by the decoder until the put ends; so do their charges.
    let mut dictionary_charges = Vec::new();
    let mut next = Some(first);
    let stages = &service.stages;
    let mut started = Instant::now();
    let received: Result<(), Error> = async {
        loop {
            let mut message = match next.take() {
                Some(message) => message,
                None => match receiver.recv().await {
                    Some(Received::Message(message)) => message,
                    Some(Received::End) => break,
                    Some(Received::Failed(error)) => return Err(error),
                    None => {
                        return Err(Error::Internal(
                            "the DoPut receiving task stopped before the stream ended".to_owned(),
                        ));
                    }
                },
            };
            started = Stages::lap(&stages.put_receive_wait_nanos, started);
            let mut charge = message.charge.take();
            Stages::add(&stages.put_messages, 1);
            Stages::add(
                &stages.put_bytes,
                (message.data.data_header.len() + message.data.data_body.len()) as u64,
            );
            // A compressed message also pays, before it is decompressed, for what it decompresses
            // to; that charge follows its batch until uploaded, like the message's own.
            let decoded = decoder.decode_message(&message, |bytes| {
                match &mut charge {
                    Some(charge) => store.grow_message(charge, bytes)?,
                    None => charge = Some(store.reserve_message(bytes)?),
                }
                Ok(())
            })?;
            started = Stages::lap(&stages.put_decode_nanos, started);
            match decoded {
                Decoded::Schema(schema) => pending.declare_schema(schema)?,
                Decoded::Batch(batch) => {
                    if let Some(call) = &call {
                        call.add_rows_in(batch.num_rows() as u64);
                    }
                    if let Some(upload) = pending.upload(batch, charge).await? {
                        uploads.push_back(upload);
                    }
                    // Finished uploads return their message's charge now, not when the pipeline
                    // next fills up.
                    while let Some(Some(uploaded)) = uploads.next().now_or_never() {
                        pending.add(uploaded?);
                    }
                    while uploads.len() >= depth {
                        if let Some(uploaded) = uploads.next().await {
                            pending.add(uploaded?);
                        }
                    }
                    started = Stages::lap(&stages.put_upload_nanos, started);
                }
                Decoded::Dictionary => dictionary_charges.extend(charge),
                Decoded::Nothing => {}
                // Returning drops the pending put and every charge: nothing commits.
                Decoded::Abandoned(reason) => return Err(Error::PutAbandoned(reason)),
            }
        }
        while let Some(uploaded) = uploads.next().await {
            pending.add(uploaded?);
        }
        Ok(())
    }
    .await;
    if let Err(error) = received {
        // The backend's uploads in flight go on either way (each still paid for): the failure
        // is answered once they are done, and their memory is free again.
        while uploads.next().await.is_some() {}
        return Err(error);
    }
    Stages::lap(&stages.put_upload_nanos, started);
    drop(decoder);
    drop(dictionary_charges);
    let summary = pending.commit().await?;
    tracing::info!(
        dataset = ?summary.name,
        mode = ?summary.mode,
        rows = summary.rows,
        bytes = summary.bytes,
        total_rows = summary.total_rows,
        principal = %caller.name,
        "DoPut committed"
    );
    Ok(if ingested.is_some() {
        Answer::Ingested(summary)
    } else {
        Answer::Put(summary)
    })
}

/// The record batches of a prepared statement's parameters: at most
/// `sql::MAX_PARAMETER_BYTES` of them, held until bound.
async fn receive_parameters(
    first: PutMessage,
    mut input: impl PutMessages,
    options: &FlightOptions,
) -> Result<Vec<arrow::record_batch::RecordBatch>, Error> {
    let mut decoder = PutDecoder::new(
        options.max_message_bytes,
        options.max_put_message_bytes as u64,
        true,
    );
    let mut batches = Vec::new();
    let mut held = 0usize;
    let mut next = Some(first);
    loop {
        let message = match next.take() {
            Some(message) => message,
            None => match input.message().await? {
                Some(message) => message,
                None => break,
            },
        };
        // Each message was paid for as it arrived (its charge goes with it); it is small or
        // refused below.
        match decoder.decode_message(&message, |_| Ok(()))? {
            Decoded::Batch(batch) => {
                // What the batch holds: its arrays' bytes (Arrow's own measure would count
                // the whole body once per buffer decoded in place from it).
                held = held.saturating_add(crate::arrays::batch_bytes(&batch) as usize);
                if held > sql::MAX_PARAMETER_BYTES {
                    return Err(Error::InvalidCommand(format!(
                        "a prepared statement's parameters are at most {} bytes",
                        sql::MAX_PARAMETER_BYTES
                    )));
                }
                batches.push(batch);
            }
            Decoded::Abandoned(reason) => return Err(Error::PutAbandoned(reason)),
            Decoded::Schema(_) | Decoded::Dictionary | Decoded::Nothing => {}
        }
    }
    Ok(batches)
}

#[cfg(test)]
mod tests {
    use arrow::array::{ArrayRef, Int64Array};
    use arrow::record_batch::RecordBatch;
    use arrow_flight::encode::FlightDataEncoderBuilder;
    use futures::TryStreamExt;
    use http_body_util::BodyExt;

    use super::*;

    /// `batch` as a `DoPut` request body read by [`FrameReader`], and its first message.
    async fn messages(batch: RecordBatch) -> (PutMessage, FrameReader) {
        let messages: Vec<arrow_flight::FlightData> = FlightDataEncoderBuilder::new()
            .build(futures::stream::iter([Ok(batch)]))
            .try_collect()
            .await
            .expect("encode");
        let mut framed = Vec::new();
        for message in messages {
            let encoded = message.encode_to_vec();
            framed.push(0);
            framed.extend((encoded.len() as u32).to_be_bytes());
            framed.extend(encoded);
        }
        let body =
            http_body_util::Full::new(bytes::Bytes::from(framed)).map_err(|never| match never {});
        let mut reader = FrameReader::new(Body::new(body), Inbound::default());
        let first = reader.message().await.expect("read").expect("a message");
        (first, reader)
    }

    #[tokio::test]
    async fn parameters_are_measured_by_what_they_hold() {
        // 480 KB of parameters, under the 1 MiB cap; decoded in place from one body, which
        // Arrow's measure counts once per column.
        let column = || Arc::new(Int64Array::from_iter_values(0..20_000)) as ArrayRef;
        let batch = RecordBatch::try_from_iter([("a", column()), ("b", column()), ("c", column())])
            .expect("batch");
        let (first, reader) = messages(batch.clone()).await;
        let options = FlightOptions::default();
        let batches = receive_parameters(first, reader, &options)
            .await
            .expect("within the cap");
        assert_eq!(batches, vec![batch]);
    }
}
