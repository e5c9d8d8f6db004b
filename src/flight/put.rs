//! `DoPut`: decode the client's Arrow IPC stream and feed it to a pending put.
//!
//! Uploads are pipelined: up to `depth` batches are being copied into backend memory while the
//! next messages are received and decoded. When `depth` uploads are outstanding the loop waits
//! for the oldest before reading more, which is the backpressure that bounds memory: gRPC flow
//! control then slows the client. The put commits only after every upload has completed; any
//! error returns early and drops the pending put, which frees everything it had uploaded.
//!
//! Receiving runs on its own task a few messages ahead of decoding: gRPC's copy out of the
//! HTTP/2 frames and Arrow's copy of each body into aligned memory then proceed on different
//! cores. If the put fails the receiver is dropped, the receiving task stops, and its request
//! stream is dropped with it.

use arrow_flight::FlightData;
use arrow_flight::decode::{DecodedPayload, FlightDataDecoder};
use arrow_flight::error::FlightError;
use futures::stream::FuturesOrdered;
use futures::{StreamExt, TryStreamExt};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;

use super::descriptor;
use crate::error::Error;
use crate::store::{PutSummary, Store};

/// Messages received ahead of the decoder.
const RECEIVE_AHEAD: usize = 4;

/// Receives a whole `DoPut` stream and commits it.
pub(crate) async fn receive(
    store: &Store,
    mut input: Streaming<FlightData>,
    depth: usize,
) -> Result<PutSummary, Error> {
    let first = match input.message().await {
        Ok(Some(first)) => first,
        Ok(None) => {
            return Err(Error::InvalidIpc(
                "the DoPut stream was empty; send a descriptor and a schema first".to_owned(),
            ));
        }
        Err(status) => return Err(Error::ClientGone(status.message().to_owned())),
    };
    let (name, mode) = descriptor::put_target(first.flight_descriptor.as_ref())?;
    let mut pending = store.begin_put(name, mode)?;

    let (sender, receiver) = tokio::sync::mpsc::channel(RECEIVE_AHEAD);
    tokio::spawn(async move {
        while let Some(message) = input.next().await {
            let failed = message.is_err();
            if sender.send(message).await.is_err() || failed {
                break;
            }
        }
    });
    let received = ReceiverStream::new(receiver);
    let messages = futures::stream::once(futures::future::ready(Ok(first)))
        .chain(received.map_err(|status| FlightError::Tonic(Box::new(status))));
    let mut decoder = FlightDataDecoder::new(messages);
    let mut uploads = FuturesOrdered::new();
    while let Some(decoded) = decoder.next().await {
        let decoded = decoded.map_err(decode_error)?;
        match decoded.payload {
            DecodedPayload::Schema(schema) => pending.declare_schema(schema)?,
            DecodedPayload::RecordBatch(batch) => {
                if let Some(upload) = pending.upload(batch)? {
                    uploads.push_back(upload);
                }
                while uploads.len() >= depth.max(1) {
                    if let Some(uploaded) = uploads.next().await {
                        pending.add(uploaded?);
                    }
                }
            }
            DecodedPayload::None => {}
        }
    }
    while let Some(uploaded) = uploads.next().await {
        pending.add(uploaded?);
    }
    let summary = pending.commit().await?;
    tracing::info!(
        dataset = %summary.name,
        mode = ?summary.mode,
        rows = summary.rows,
        bytes = summary.bytes,
        total_rows = summary.total_rows,
        "DoPut committed"
    );
    Ok(summary)
}

/// A failure of the incoming stream: the client's transport, or the bytes it sent.
fn decode_error(error: FlightError) -> Error {
    match error {
        FlightError::Tonic(status) => Error::ClientGone(status.message().to_owned()),
        other => Error::InvalidIpc(other.to_string()),
    }
}
