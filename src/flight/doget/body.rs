//! The `DoGet` reply as an HTTP body of gRPC frames, with no user-space copy of large buffers.
//!
//! tonic's server encodes each reply message into a buffer of its own and hands hyper that
//! buffer: one copy of every byte before the socket's. This body hands hyper the frames
//! themselves, each message as a few [`Bytes`] chunks ([`IpcMessage::into_frame`]): the
//! framing and small buffers copied together, every large Arrow buffer as it lies in memory
//! (a staging buffer of the device backend, a dataset's own buffer on the host). h2 writes
//! those with vectored writes straight from them, so the kernel's copy into the socket is the
//! only one. A chunk keeps its buffer alive until h2 has written it.
//!
//! The body ends with gRPC trailers: `grpc-status` 0 after the last message, or the error a
//! message stream ends with, as tonic's server would send them.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use futures::StreamExt;
use http::HeaderMap;
use http_body::{Frame, SizeHint};
use tonic::Status;

use super::message::IpcMessage;
use crate::flight::Stream;

/// A `DoGet` reply: the messages of `messages`, framed, then the trailers.
pub(super) struct ReplyBody {
    messages: Stream<IpcMessage>,
    /// Chunks of the message being sent, in order.
    pending: VecDeque<Bytes>,
    /// The trailers are sent: nothing follows.
    done: bool,
}

impl ReplyBody {
    pub(super) fn new(messages: Stream<IpcMessage>) -> Self {
        Self {
            messages,
            pending: VecDeque::new(),
            done: false,
        }
    }

    fn end(&mut self, status: &Status) -> Frame<Bytes> {
        self.done = true;
        // Nothing of an unfinished message may follow; today none is ever left here.
        self.pending.clear();
        let mut trailers = HeaderMap::new();
        if let Err(unencodable) = status.add_header(&mut trailers) {
            // Only metadata the server itself attached could be unencodable; say so plainly
            // rather than end the stream without a status.
            trailers.clear();
            let fallback = Status::internal(format!(
                "the reply's status could not be encoded: {}",
                unencodable.message()
            ));
            let _ = fallback.add_header(&mut trailers);
        }
        Frame::trailers(trailers)
    }
}

impl http_body::Body for ReplyBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        loop {
            if let Some(chunk) = self.pending.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(chunk))));
            }
            if self.done {
                return Poll::Ready(None);
            }
            let frame = match ready!(self.messages.poll_next_unpin(cx)) {
                Some(Ok(message)) => match message.into_frame(&mut self.pending) {
                    Ok(()) => continue,
                    Err(status) => self.end(&status),
                },
                Some(Err(status)) => self.end(&status),
                None => self.end(&Status::ok("")),
            };
            return Poll::Ready(Some(Ok(frame)));
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.pending.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{ArrayRef, Int64Array};
    use arrow::record_batch::RecordBatch;
    use arrow_flight::FlightData;
    use http_body_util::BodyExt;
    use prost::Message;
    use tonic::Code;

    use super::*;
    use crate::flight::doget::message::IpcMessageEncoder;

    fn messages() -> Vec<IpcMessage> {
        let ids: ArrayRef = Arc::new(Int64Array::from_iter_values(0..100_000));
        let batch = RecordBatch::try_from_iter([("id", ids)]).expect("batch");
        let mut encoder = IpcMessageEncoder::new(&batch.schema(), None).expect("encoder");
        encoder.encode(&batch).expect("encode")
    }

    /// Splits a gRPC body into its messages, checking each frame's prefix.
    fn unframe(mut body: &[u8]) -> Vec<FlightData> {
        let mut out = Vec::new();
        while !body.is_empty() {
            assert_eq!(body[0], 0, "uncompressed");
            let len = u32::from_be_bytes(body[1..5].try_into().expect("prefix")) as usize;
            out.push(FlightData::decode(&body[5..5 + len]).expect("FlightData"));
            body = &body[5 + len..];
        }
        out
    }

    #[tokio::test]
    async fn frames_every_message_then_sends_an_ok_status() {
        let sent = messages();
        let expected: Vec<FlightData> =
            sent.iter().cloned().map(|m| m.into_flight_data()).collect();
        let stream = futures::stream::iter(sent.into_iter().map(Ok)).boxed();
        let collected = ReplyBody::new(stream).collect().await.expect("body");
        let trailers = collected.trailers().cloned().expect("trailers");
        assert_eq!(
            Status::from_header_map(&trailers).map(|s| s.code()),
            Some(Code::Ok)
        );
        assert_eq!(unframe(&collected.to_bytes()), expected);
    }

    #[tokio::test]
    async fn an_error_ends_the_body_with_its_status() {
        let first = messages().remove(0);
        let stream = futures::stream::iter([
            Ok(first.clone()),
            Err(Status::resource_exhausted("no room")),
            Ok(first),
        ])
        .boxed();
        let collected = ReplyBody::new(stream).collect().await.expect("body");
        let status =
            Status::from_header_map(collected.trailers().expect("trailers")).expect("status");
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert_eq!(status.message(), "no room");
        assert_eq!(
            unframe(&collected.to_bytes()).len(),
            1,
            "nothing after the error"
        );
    }

    #[tokio::test]
    async fn large_buffers_are_sent_without_a_copy() {
        let message = messages().pop().expect("record batch");
        let mut chunks = VecDeque::new();
        message.clone().into_frame(&mut chunks).expect("frame");
        let values = message.body_buffers().iter().find(|b| b.len() >= 800_000);
        let values = values.expect("the id column's values");
        assert!(
            chunks.iter().any(|c| c.as_ptr() == values.as_ptr()),
            "the values are handed over where they lie"
        );
    }
}
