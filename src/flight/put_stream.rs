//! `DoPut`'s request stream read straight from its HTTP/2 frames: FlightData messages with one
//! copy of each byte, each record batch body in an allocation of its own, 64-byte aligned.
//!
//! tonic's codec copies every frame into a buffer per message, where the body lies wherever the
//! protobuf fields before it left it, so Arrow copies most of its buffers again (it realigns
//! what is misaligned) into fresh memory of its own. [`FrameReader`] gathers the fields before
//! the body (descriptor, IPC header, app_metadata: small) apart, and copies the body's bytes out
//! of the frames once, into an allocation that starts 64-byte aligned: Arrow reads its arrays
//! in place, and a backend that keeps them keeps that allocation ([`PutMessage::body_alone`]).
//! For a backend that uploads from pinned host memory, the put hands the reader blocks of it
//! once the caller is authorized ([`PutMessages::receive_bodies_in`]): large bodies are copied
//! out of the frames straight into them, and their upload needs no other copy.
//!
//! Protobuf leaves the order of fields to the writer. Flight implementations write the body
//! (field 1000) last; a message whose body comes first, twice or not at all is read as protobuf
//! says (the last occurrence wins), only without the aligned copy for a later occurrence.
//! Bytes that are not a FlightData message are INVALID_ARGUMENT, as on tonic's path, which the
//! generated server still serves under `--doput-decoder plain` ([`TonicMessages`]).
//!
//! The request body has passed the server's request-limits layer: each message's declared
//! length is within `--max-put-message-bytes` and paid for as its bytes arrive (the charges,
//! and why the layer failed a body, wait in the request's [`Inbound`] ledger), and the body
//! fails unless it really ended. A body's allocation is made when its field's length is read,
//! before its bytes arrive: address space, whose pages are written (and so used) only as the
//! paid-for bytes come.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::{Arc, Mutex};

use arrow::buffer::{Buffer, MutableBuffer};
use arrow_flight::FlightData;
use bytes::{Buf, Bytes};
use http_body_util::BodyExt;
use prost::Message;
use tonic::body::Body;
use tonic::{Code, Status, Streaming};

use crate::backend::BodyBlock;
use crate::error::Error;
use crate::store::memory::Reservation;

/// What the layer reading a `DoPut` body learned that its handler needs: the reservations paid
/// for each message, in arrival order, and why the body failed if it failed it. The layer
/// fills it as bytes arrive; the handler drains it as it receives each message.
#[derive(Debug, Clone, Default)]
pub(crate) struct Inbound(Arc<Mutex<InboundState>>);

#[derive(Debug, Default)]
struct InboundState {
    charges: VecDeque<Reservation>,
    failure: Option<Error>,
}

impl Inbound {
    fn lock(&self) -> std::sync::MutexGuard<'_, InboundState> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records the charge of the next whole message.
    pub(crate) fn push_charge(&self, charge: Reservation) {
        self.lock().charges.push_back(charge);
    }

    /// Records why the body failed (the stream then reports a status that says less).
    pub(crate) fn set_failure(&self, error: Error) {
        self.lock().failure = Some(error);
    }

    /// The reservation for the next message the handler receives.
    pub(crate) fn take_charge(&self) -> Option<Reservation> {
        self.lock().charges.pop_front()
    }

    /// Why the body failed, if the layer failed it (rather than the transport).
    pub(crate) fn take_failure(&self) -> Option<Error> {
        self.lock().failure.take()
    }
}

/// One `DoPut` message.
#[derive(Debug)]
pub(crate) struct PutMessage {
    pub data: FlightData,
    /// `data.data_body` is an allocation of its own, 64-byte aligned, holding nothing but the
    /// body: arrays decoded in place may keep it without keeping anything else of the message.
    pub body_alone: bool,
    /// What the request-limits layer charged for the message's bytes, taken from the
    /// [`Inbound`] ledger as the message is handed out (the layer records it first).
    pub charge: Option<Reservation>,
    /// `data.data_body` was received straight into a block of the backend's pinned host
    /// memory ([`PutMessages::receive_bodies_in`]): it needs no copy there.
    pub body_pinned: bool,
}

/// Where [`PutMessages::receive_bodies_in`] puts bodies.
pub(crate) struct BodyBlocks {
    /// Whether a body is worth a block, from its length and its message's fields before it
    /// (protobuf, the IPC header among them): the reader waits for such a body whole before it
    /// asks for one.
    pub wants: fn(usize, &[u8]) -> bool,
    /// A block of the given length, where the backend has one free (`Store::body_block`).
    pub take: TakeBlock,
}

/// [`BodyBlocks::take`].
pub(crate) type TakeBlock = Box<dyn Fn(usize) -> Option<Box<dyn BodyBlock>> + Send + Sync>;

/// Where a put's messages come from.
pub(crate) trait PutMessages: Send + 'static {
    /// The next message; `None` once the stream ended cleanly.
    fn message(&mut self) -> impl Future<Output = Result<Option<PutMessage>, Error>> + Send;

    /// Receives later bodies into blocks `blocks` hands out, where it gives one, rather than
    /// into memory of the reader's own. A reader that cannot (tonic's codec has copied each
    /// message by the time it is handed out) ignores this.
    fn receive_bodies_in(&mut self, _blocks: BodyBlocks) {}
}

/// The generated server's stream: tonic's codec over the same guarded body.
pub(crate) struct TonicMessages {
    stream: Streaming<FlightData>,
    inbound: Inbound,
}

impl TonicMessages {
    pub(crate) fn new(stream: Streaming<FlightData>, inbound: Inbound) -> Self {
        Self { stream, inbound }
    }
}

impl PutMessages for TonicMessages {
    async fn message(&mut self) -> Result<Option<PutMessage>, Error> {
        match self.stream.message().await {
            Ok(message) => Ok(message.map(|data| PutMessage {
                data,
                body_alone: false,
                charge: self.inbound.take_charge(),
                body_pinned: false,
            })),
            Err(status) => Err(stream_failure(&self.inbound, status)),
        }
    }
}

/// Most bytes of a field's tag and length: two varints of at most 10 bytes.
const MAX_FIELD_HEAD_BYTES: usize = 20;
/// `data_body`'s field number in `FlightData`.
const BODY_FIELD: u64 = 1000;
/// Fields of a message stepped over one by one; FlightData has four, and a message of many tiny
/// unknown fields would otherwise cost a walk per few bytes. Past this, prost reads the rest.
const MAX_FIELDS_WALKED: usize = 16;

/// Reads FlightData messages from a `DoPut` request's body; see the module doc.
pub(crate) struct FrameReader {
    body: Body,
    inbound: Inbound,
    /// Frames received and not yet read, in order.
    chunks: VecDeque<Bytes>,
    /// Bytes in `chunks`.
    buffered: usize,
    /// The body has no more frames.
    ended: bool,
    blocks: Option<BodyBlocks>,
}

impl PutMessages for FrameReader {
    async fn message(&mut self) -> Result<Option<PutMessage>, Error> {
        self.next_message().await
    }

    fn receive_bodies_in(&mut self, blocks: BodyBlocks) {
        self.blocks = Some(blocks);
    }
}

impl FrameReader {
    pub(crate) fn new(body: Body, inbound: Inbound) -> Self {
        Self {
            body,
            inbound,
            chunks: VecDeque::new(),
            buffered: 0,
            ended: false,
            blocks: None,
        }
    }

    async fn next_message(&mut self) -> Result<Option<PutMessage>, Error> {
        if !self.fill(1).await? {
            return Ok(None);
        }
        if !self.fill(5).await? {
            return Err(truncated());
        }
        let mut prefix = [0u8; 5];
        self.peek(&mut prefix);
        self.skip(5);
        if prefix[0] != 0 {
            return Err(Error::Undecodable(
                "compressed gRPC messages are not accepted; send them uncompressed".to_owned(),
            ));
        }
        let mut remaining =
            u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
        // Every field but the first body, as it came: protobuf fields are self-delimiting, so
        // they still make a message without it.
        let mut rest: Vec<u8> = Vec::new();
        let mut body: Option<BodyBytes> = None;
        // A later body field replaces the first, an empty one too: the last occurrence wins.
        let mut replaced = false;
        let mut walked = 0;
        while remaining > 0 {
            let want = remaining.min(MAX_FIELD_HEAD_BYTES);
            if !self.fill(want).await? {
                return Err(truncated());
            }
            let mut head = [0u8; MAX_FIELD_HEAD_BYTES];
            self.peek(&mut head[..want]);
            walked += 1;
            let field = (walked <= MAX_FIELDS_WALKED)
                .then(|| field_head(&head[..want]))
                .flatten();
            match field {
                Some(field)
                    if field.number == BODY_FIELD
                        && field.delimited
                        && body.is_none()
                        && field.total() <= remaining =>
                {
                    self.skip(field.head);
                    body = Some(self.read_body(field.length, &rest).await?);
                    remaining -= field.total();
                }
                Some(field) if field.total() <= remaining => {
                    replaced |= field.number == BODY_FIELD && body.is_some();
                    reserve(&mut rest, field.total())?;
                    self.copy(field.total(), |bytes| rest.extend_from_slice(bytes))
                        .await?;
                    remaining -= field.total();
                }
                // Not a field this reader can step over, or one too many: the rest goes to
                // prost as it is, which says what is wrong with it (or reads it, where it is a
                // group or just many fields). The body
                // taken out goes back first, where it was among the body fields, for prost to
                // weigh against any later one.
                _ => {
                    if let Some(mut taken) = body.take().filter(|_| !replaced) {
                        let taken = taken.as_mut_slice();
                        reserve(&mut rest, taken.len().saturating_add(MAX_FIELD_HEAD_BYTES))?;
                        prost::encoding::encode_key(
                            BODY_FIELD as u32,
                            prost::encoding::WireType::LengthDelimited,
                            &mut rest,
                        );
                        prost::encoding::encode_varint(taken.len() as u64, &mut rest);
                        rest.extend_from_slice(taken);
                    }
                    reserve(&mut rest, remaining)?;
                    self.copy(remaining, |bytes| rest.extend_from_slice(bytes))
                        .await?;
                    remaining = 0;
                }
            }
        }
        let mut data = FlightData::decode(Bytes::from(rest)).map_err(|e| {
            Error::Undecodable(format!(
                "the request is not a valid FlightData protobuf message: {e}"
            ))
        })?;
        let (body_alone, body_pinned) = match body {
            Some(_) if replaced => (false, false),
            Some(body) => {
                let pinned = matches!(body, BodyBytes::Block(_));
                data.data_body = Bytes::from(body.into_buffer());
                (true, pinned)
            }
            None => (false, false),
        };
        Ok(Some(PutMessage {
            data,
            body_alone,
            charge: self.inbound.take_charge(),
            body_pinned,
        }))
    }

    /// The next `len` bytes, a message body, in an allocation of their own: a block of pinned
    /// memory where one is given for it, else the process's memory (fallible: that memory,
    /// unlike the budget, is not ours to count). `fields` are the message's fields before the
    /// body, whose IPC header says whether the body is worth a block.
    async fn read_body(&mut self, len: usize, fields: &[u8]) -> Result<BodyBytes, Error> {
        if let Some(blocks) = &self.blocks {
            // A block only for a body wholly received: one taken for bytes still to come would
            // be held for as long as the client cared to leave them coming. Other bodies are
            // copied as they come, as without blocks.
            let block = if (blocks.wants)(len, fields) {
                if !self.fill(len).await? {
                    return Err(truncated());
                }
                self.blocks.as_ref().and_then(|blocks| (blocks.take)(len))
            } else {
                None
            };
            if let Some(mut block) = block.filter(|block| block.size() == len) {
                let target = block.as_mut_slice();
                let mut at = 0;
                self.copy(len, |bytes| {
                    target[at..at + bytes.len()].copy_from_slice(bytes);
                    at += bytes.len();
                })
                .await?;
                return Ok(BodyBytes::Block(block));
            }
        }
        let mut buffer =
            MutableBuffer::try_with_capacity(len).map_err(|_| Error::HostMemory(len))?;
        self.copy(len, |bytes| buffer.extend_from_slice(bytes))
            .await?;
        Ok(BodyBytes::Heap(buffer))
    }

    /// Receives one more frame; false once the body has none.
    async fn receive(&mut self) -> Result<bool, Error> {
        while !self.ended {
            match self.body.frame().await {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) if data.is_empty() => {}
                    Ok(data) => {
                        self.buffered += data.len();
                        self.chunks.push_back(data);
                        return Ok(true);
                    }
                    // Trailers end a request as END_STREAM does.
                    Err(_trailers) => self.ended = true,
                },
                Some(Err(status)) => return Err(stream_failure(&self.inbound, status)),
                // The request-limits layer fails a body that ends without END_STREAM (hyper
                // ends one that was reset as if it were over); checked again here so that a
                // reset can never read as a clean end.
                None if !http_body::Body::is_end_stream(&self.body) => {
                    return Err(Error::ClientGone(
                        "the request stream was reset or its connection closed before the \
                         client ended it"
                            .to_owned(),
                    ));
                }
                None => self.ended = true,
            }
        }
        Ok(false)
    }

    /// Receives until `n` bytes are buffered; false if the body ended first.
    async fn fill(&mut self, n: usize) -> Result<bool, Error> {
        while self.buffered < n {
            if !self.receive().await? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Copies the first buffered bytes into `out`, as many as it holds, leaving them buffered.
    fn peek(&self, out: &mut [u8]) {
        let mut filled = 0;
        for chunk in &self.chunks {
            if filled == out.len() {
                break;
            }
            let n = chunk.len().min(out.len() - filled);
            out[filled..filled + n].copy_from_slice(&chunk[..n]);
            filled += n;
        }
    }

    /// Drops `n` buffered bytes.
    fn skip(&mut self, mut n: usize) {
        while n > 0 {
            let Some(chunk) = self.chunks.front_mut() else {
                break;
            };
            let step = n.min(chunk.len());
            chunk.advance(step);
            self.buffered -= step;
            n -= step;
            if chunk.is_empty() {
                self.chunks.pop_front();
            }
        }
    }

    /// Hands the next `n` bytes of the body to `to`, frame by frame, receiving as needed.
    async fn copy(&mut self, mut n: usize, mut to: impl FnMut(&[u8])) -> Result<(), Error> {
        while n > 0 {
            if self.chunks.is_empty() && !self.receive().await? {
                return Err(truncated());
            }
            let Some(chunk) = self.chunks.front_mut() else {
                continue;
            };
            let step = n.min(chunk.len());
            to(&chunk[..step]);
            chunk.advance(step);
            self.buffered -= step;
            n -= step;
            if chunk.is_empty() {
                self.chunks.pop_front();
            }
        }
        Ok(())
    }
}

/// A message body read out of the frames, in an allocation of its own.
enum BodyBytes {
    Heap(MutableBuffer),
    Block(Box<dyn BodyBlock>),
}

impl BodyBytes {
    fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            Self::Heap(buffer) => buffer.as_slice_mut(),
            Self::Block(block) => block.as_mut_slice(),
        }
    }

    fn into_buffer(self) -> Buffer {
        match self {
            Self::Heap(buffer) => Buffer::from(buffer),
            Self::Block(block) => block.into_buffer(),
        }
    }
}

/// A field's tag and, for a length-delimited field, its length.
#[derive(Debug, PartialEq, Eq)]
struct FieldHead {
    number: u64,
    delimited: bool,
    /// Bytes of the tag and length.
    head: usize,
    /// Bytes of the value after them.
    length: usize,
}

impl FieldHead {
    fn total(&self) -> usize {
        self.head.saturating_add(self.length)
    }
}

/// The field that `bytes` (at most [`MAX_FIELD_HEAD_BYTES`] of a message) begins with, where
/// its extent is known from them: not groups, nor anything cut short or malformed.
fn field_head(bytes: &[u8]) -> Option<FieldHead> {
    let (tag, tag_len) = varint(bytes)?;
    let number = tag >> 3;
    let after = &bytes[tag_len..];
    let (delimited, head, length) = match tag & 7 {
        0 => (false, tag_len, varint(after)?.1),
        1 => (false, tag_len, 8),
        2 => {
            let (length, length_len) = varint(after)?;
            (true, tag_len + length_len, usize::try_from(length).ok()?)
        }
        5 => (false, tag_len, 4),
        _ => return None,
    };
    Some(FieldHead {
        number,
        delimited,
        head,
        length,
    })
}

/// A protobuf varint at the start of `bytes`, and its length in bytes.
fn varint(bytes: &[u8]) -> Option<(u64, usize)> {
    let mut value = 0u64;
    for (i, &byte) in bytes.iter().enumerate().take(10) {
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            // The tenth byte may carry one bit only.
            return (i < 9 || byte <= 1).then_some((value, i + 1));
        }
    }
    None
}

/// Room for `more` bytes in `rest`, or the error that the host has none.
fn reserve(rest: &mut Vec<u8>, more: usize) -> Result<(), Error> {
    rest.try_reserve(more).map_err(|_| Error::HostMemory(more))
}

fn truncated() -> Error {
    Error::Undecodable("the request ended in the middle of a gRPC message".to_owned())
}

/// Why the request stream failed: what the layer reading the body found (a limit, the budget,
/// a stream that ended without END_STREAM), else undecodable bytes, else the transport.
fn stream_failure(inbound: &Inbound, status: Status) -> Error {
    if let Some(error) = inbound.take_failure() {
        return error;
    }
    match status.code() {
        // What tonic's prost decoder says of a message that is not protobuf: the client's
        // mistake. Known by prost's own words, so that any other INTERNAL stays the server's.
        Code::Internal if status.message().starts_with(PROST_DECODE_ERROR) => {
            Error::Undecodable(format!(
                "the request is not a valid FlightData protobuf message: {}",
                status.message()
            ))
        }
        Code::Internal => {
            Error::Internal(format!("the request stream failed: {}", status.message()))
        }
        _ => Error::ClientGone(status.message().to_owned()),
    }
}

/// How a `prost::DecodeError` begins when displayed, which tonic's codec sends as the message
/// of an INTERNAL status.
const PROST_DECODE_ERROR: &str = "failed to decode Protobuf message";

/// A request body for tests: it yields its frames, then ends; `end_stream` is what h2 would say
/// about whether END_STREAM arrived.
#[cfg(test)]
pub(crate) struct Scripted {
    frames: VecDeque<Result<Bytes, Status>>,
    end_stream: bool,
}

#[cfg(test)]
impl Scripted {
    pub(crate) fn new(frames: Vec<Result<Bytes, Status>>, end_stream: bool) -> Self {
        Self {
            frames: frames.into(),
            end_stream,
        }
    }
}

#[cfg(test)]
impl http_body::Body for Scripted {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Status>>> {
        std::task::Poll::Ready(
            self.frames
                .pop_front()
                .map(|f| f.map(http_body::Frame::data)),
        )
    }

    fn is_end_stream(&self) -> bool {
        self.frames.is_empty() && self.end_stream
    }
}

#[cfg(test)]
mod tests {
    use arrow_flight::FlightDescriptor;

    use super::*;

    #[test]
    fn only_prost_decode_errors_are_the_clients() {
        let inbound = Inbound::default();
        let undecodable = <arrow_flight::FlightData as prost::Message>::decode(&[0xff_u8][..])
            .expect_err("not protobuf")
            .to_string();
        assert!(matches!(
            stream_failure(&inbound, Status::internal(undecodable)),
            Error::Undecodable(_)
        ));
        assert!(matches!(
            stream_failure(&inbound, Status::internal("h2 protocol error")),
            Error::Internal(_)
        ));
        assert!(matches!(
            stream_failure(&inbound, Status::cancelled("gone")),
            Error::ClientGone(_)
        ));
    }

    /// `messages` framed for gRPC, cut into frames of `size` bytes.
    fn framed(messages: &[Vec<u8>], size: usize) -> Vec<Result<Bytes, Status>> {
        let mut stream = Vec::new();
        for message in messages {
            stream.push(0);
            stream.extend((message.len() as u32).to_be_bytes());
            stream.extend(message);
        }
        stream
            .chunks(size)
            .map(|chunk| Ok(Bytes::copy_from_slice(chunk)))
            .collect()
    }

    fn reader(frames: Vec<Result<Bytes, Status>>) -> FrameReader {
        FrameReader::new(Body::new(Scripted::new(frames, true)), Inbound::default())
    }

    async fn read_all(mut reader: FrameReader) -> Result<Vec<PutMessage>, Error> {
        let mut messages = Vec::new();
        while let Some(message) = reader.message().await? {
            messages.push(message);
        }
        Ok(messages)
    }

    fn flight_data(body_len: usize) -> FlightData {
        FlightData {
            flight_descriptor: Some(FlightDescriptor::new_path(vec!["a".into(), "b".into()])),
            data_header: Bytes::from(vec![7u8; 300]),
            app_metadata: Bytes::from_static(b"metadata"),
            data_body: (0..body_len).map(|i| i as u8).collect::<Vec<u8>>().into(),
        }
    }

    #[tokio::test]
    async fn messages_read_alike_however_the_frames_cut_them() {
        let messages = [flight_data(5000), flight_data(0), flight_data(1)];
        let encoded: Vec<Vec<u8>> = messages.iter().map(|m| m.encode_to_vec()).collect();
        for size in [1, 2, 3, 5, 7, 64, 301, 4096, 1 << 20] {
            let read = read_all(reader(framed(&encoded, size)))
                .await
                .expect("valid messages");
            assert_eq!(read.len(), messages.len(), "frames of {size}");
            for (got, sent) in read.iter().zip(&messages) {
                assert_eq!(&got.data, sent, "frames of {size}");
                // Every body was its own allocation (protobuf leaves an empty one out).
                let sent_body = !sent.data_body.is_empty();
                assert_eq!(got.body_alone, sent_body, "frames of {size}");
                if sent_body {
                    assert_eq!(got.data.data_body.as_ptr() as usize % 64, 0, "aligned");
                }
            }
        }
    }

    #[tokio::test]
    async fn fields_in_any_order_read_as_protobuf_says() {
        let sent = flight_data(100);
        let body_field = |body: &[u8]| {
            let mut field = vec![0xc2, 0x3e, body.len() as u8];
            field.extend(body);
            field
        };
        let header_only = FlightData {
            data_body: Bytes::new(),
            ..sent.clone()
        }
        .encode_to_vec();
        let joined = |parts: &[&[u8]]| parts.concat();
        // An unknown group (field 5: start and end), which this reader does not step over.
        let group: &[u8] = &[0x2b, 0x2c];
        let cases = [
            (
                "body first",
                joined(&[&body_field(&sent.data_body), &header_only]),
                true,
            ),
            (
                "body twice",
                joined(&[
                    &body_field(&[1, 2, 3]),
                    &header_only,
                    &body_field(&sent.data_body),
                ]),
                false,
            ),
            (
                "a later empty body",
                joined(&[&body_field(&sent.data_body), &header_only, &body_field(&[])]),
                false,
            ),
            (
                "unknown fields",
                joined(&[&[0x28, 0x96, 0x01, 0x3a, 2, 9, 9], &sent.encode_to_vec()]),
                true,
            ),
            (
                "a group after the body",
                joined(&[&body_field(&sent.data_body), group, &header_only]),
                false,
            ),
            (
                "a group first",
                joined(&[group, &sent.encode_to_vec()]),
                false,
            ),
            (
                "many fields before the body",
                joined(&[&[0x28, 0x01].repeat(1000), &sent.encode_to_vec()]),
                false,
            ),
            (
                "many fields after the body",
                joined(&[
                    &body_field(&sent.data_body),
                    &[0x28, 0x01].repeat(1000),
                    &header_only,
                ]),
                false,
            ),
            (
                "a group between two bodies",
                joined(&[
                    &body_field(&[1, 2, 3]),
                    &header_only,
                    group,
                    &body_field(&[4]),
                ]),
                false,
            ),
        ];
        for (name, message, alone) in cases {
            // What prost makes of the same bytes is the answer.
            let expected = FlightData::decode(&message[..]).expect(name);
            let read = read_all(reader(framed(&[message], 3))).await.expect(name);
            assert_eq!(read.len(), 1, "{name}");
            assert_eq!(read[0].data, expected, "{name}");
            assert_eq!(read[0].body_alone, alone, "{name}");
        }
    }

    /// A block of test memory standing in for the backend's pinned memory.
    struct TestBlock(Vec<u8>);

    impl BodyBlock for TestBlock {
        fn size(&self) -> usize {
            self.0.len()
        }

        fn as_mut_slice(&mut self) -> &mut [u8] {
            &mut self.0
        }

        fn into_buffer(self: Box<Self>) -> Buffer {
            Buffer::from_vec(self.0)
        }
    }

    /// A reader whose bodies of 1,000 bytes or more go into blocks, where the message's IPC
    /// header (among the fields before the body) is `flight_data`'s; and how many blocks it
    /// took.
    fn reader_with_blocks(
        frames: Vec<Result<Bytes, Status>>,
    ) -> (FrameReader, Arc<std::sync::atomic::AtomicUsize>) {
        let taken = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = Arc::clone(&taken);
        let mut reader = reader(frames);
        reader.receive_bodies_in(BodyBlocks {
            wants: |len, fields| {
                len >= 1000
                    && FlightData::decode(fields)
                        .is_ok_and(|data| data.data_header == [7u8; 300][..])
            },
            take: Box::new(move |len| {
                count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                // Stale bytes, as reused pinned memory holds: all of them must be overwritten.
                Some(Box::new(TestBlock(vec![0xee; len])) as Box<dyn BodyBlock>)
            }),
        });
        (reader, taken)
    }

    #[tokio::test]
    async fn bodies_given_a_block_are_received_into_it_whole() {
        let messages = [flight_data(5000), flight_data(0), flight_data(10)];
        let encoded: Vec<Vec<u8>> = messages.iter().map(|m| m.encode_to_vec()).collect();
        for size in [1, 7, 301, 4096] {
            let (reader, taken) = reader_with_blocks(framed(&encoded, size));
            let read = read_all(reader).await.expect("valid messages");
            assert_eq!(taken.load(std::sync::atomic::Ordering::Relaxed), 1);
            for (got, sent) in read.iter().zip(&messages) {
                assert_eq!(&got.data, sent, "frames of {size}");
                assert_eq!(
                    got.body_pinned,
                    sent.data_body.len() >= 1000,
                    "frames of {size}"
                );
                assert_eq!(
                    got.body_alone,
                    !sent.data_body.is_empty(),
                    "frames of {size}"
                );
            }
        }
        // A body in a block that prost must read after all (a group after it): it goes back
        // among the fields, read as protobuf says, in memory of its own.
        let sent = flight_data(2000);
        let mut message = FlightData {
            data_body: Bytes::new(),
            ..sent.clone()
        }
        .encode_to_vec();
        message.extend([0xc2, 0x3e, 0xd0, 0x0f]);
        message.extend(&sent.data_body[..]);
        message.extend([0x2b, 0x2c]);
        let expected = FlightData::decode(&message[..]).expect("protobuf");
        assert_eq!(expected, sent);
        let (reader, taken) = reader_with_blocks(framed(&[message.clone()], 3));
        let read = read_all(reader).await.expect("valid message");
        assert_eq!(taken.load(std::sync::atomic::Ordering::Relaxed), 1);
        assert_eq!(read[0].data, expected);
        assert!(!read[0].body_pinned && !read[0].body_alone);
        // The body before the header: no header yet, so no block.
        let mut first = vec![0xc2, 0x3e, 0xd0, 0x0f];
        first.extend(&sent.data_body[..]);
        first.extend(&message[..message.len() - 2 - 2004]);
        let (reader, taken) = reader_with_blocks(framed(&[first], 3));
        let read = read_all(reader).await.expect("valid message");
        assert_eq!(taken.load(std::sync::atomic::Ordering::Relaxed), 0);
        assert_eq!(read[0].data, sent);
        assert!(!read[0].body_pinned && read[0].body_alone);
    }

    #[tokio::test]
    async fn no_block_is_taken_for_a_body_that_has_not_all_arrived() {
        // The stream ends 100 bytes into a 5,000-byte body: nothing was ever held for it.
        let mut frames = framed(&[flight_data(5000).encode_to_vec()], 100);
        frames.truncate(6);
        let (reader, taken) = reader_with_blocks(frames);
        let error = read_all(reader).await.expect_err("truncated");
        assert!(matches!(error, Error::Undecodable(_)), "{error:?}");
        assert_eq!(taken.load(std::sync::atomic::Ordering::Relaxed), 0);
    }

    #[tokio::test]
    async fn what_is_not_protobuf_is_undecodable() {
        for message in [
            // Field 1, length-delimited, declaring 100 bytes where there are 2.
            vec![0x0a, 100, 1, 2],
            // A body declaring more than the message holds.
            vec![0xc2, 0x3e, 50, 1],
            // A varint that never ends.
            vec![
                0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
            ],
            // Field number 0.
            vec![0x02, 0],
        ] {
            let error = read_all(reader(framed(std::slice::from_ref(&message), 2)))
                .await
                .expect_err("not protobuf");
            assert!(
                matches!(&error, Error::Undecodable(m) if m.starts_with("the request is not a valid FlightData")),
                "{message:?}: {error:?}"
            );
        }
    }

    #[tokio::test]
    async fn a_stream_cut_in_a_message_or_failing_is_an_error() {
        let mut frames = framed(&[flight_data(1000).encode_to_vec()], 100);
        frames.truncate(5);
        let error = read_all(reader(frames)).await.expect_err("truncated");
        assert!(matches!(error, Error::Undecodable(_)), "{error:?}");

        let mut frames = framed(&[flight_data(10).encode_to_vec()], 100);
        frames.push(Err(Status::cancelled("reset")));
        let error = read_all(reader(frames)).await.expect_err("failed");
        assert!(matches!(error, Error::ClientGone(_)), "{error:?}");

        // Whole messages, then an end without END_STREAM (a reset, as hyper reports one).
        let frames = framed(&[flight_data(10).encode_to_vec()], 100);
        let reader = FrameReader::new(Body::new(Scripted::new(frames, false)), Inbound::default());
        let error = read_all(reader).await.expect_err("no clean end");
        assert!(matches!(error, Error::ClientGone(_)), "{error:?}");
    }
}
