//! `DoGet` messages as IPC metadata plus the Arrow buffers they describe, never concatenated.
//!
//! The usual path (arrow-flight's encoder, then prost, then tonic's codec) copies every body
//! byte twice in user space: once when the IPC writer concatenates the buffers into
//! `FlightData.data_body`, once when prost copies that into the gRPC frame. Here arrow-ipc's
//! [`StreamEncoder`] produces each message as zero-copy [`Buffer`]s that point into the arrays,
//! and [`IpcMessage::into_frame`] writes the gRPC and protobuf framing of `FlightData` by hand
//! around them: small buffers are copied beside the framing, large ones are handed on as they
//! are (see `body`).
//!
//! The bytes on the wire are exactly what prost would produce for the same `FlightData`
//! (a test checks it); clients see an ordinary Flight stream. A message of 1 MiB or more ends
//! in one more field, of zeros, with a number `FlightData` does not use, which protobuf readers
//! skip ([`IpcMessage::padded`]): it rounds the message up to whole 64 KiB, so that a client's
//! allocator is asked for a few sizes over and over. Messages of a large partition otherwise
//! differ by up to a few hundred bytes each, and pyarrow readers spent 20-28% more CPU per GB
//! on them (docs/performance-notes.md, run (ak)).

use std::collections::VecDeque;

use arrow::buffer::Buffer;
use arrow::datatypes::Schema;
use arrow::error::ArrowError;
use arrow::ipc::CompressionType;
use arrow::ipc::writer::{IpcWriteOptions, StreamEncoder};
use arrow::record_batch::RecordBatch;
use bytes::{BufMut, Bytes, BytesMut};
use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint, key_len};
use tonic::Status;

use crate::error::Error;

/// `FlightData.data_header` and `FlightData.data_body` field numbers.
const DATA_HEADER_TAG: u32 = 2;
const DATA_BODY_TAG: u32 = 1000;
/// The IPC continuation marker that precedes each message's metadata length.
const CONTINUATION: u32 = 0xFFFF_FFFF;
/// The gRPC message prefix: a compression flag and a big-endian length.
const GRPC_PREFIX_BYTES: usize = 5;
/// Body buffers at least this large go to the socket where they lie, each as a chunk of its own;
/// smaller ones are copied beside the framing. A chunk becomes at least one HTTP/2 DATA frame,
/// and a large one a write of its own, so tiny ones are cheaper copied.
const ZERO_COPY_BYTES: usize = 64 * 1024;
/// Largest chunk handed on: h2 refuses a single chunk of 2 GiB or more (its largest window) by
/// resetting the stream, so a larger buffer (one huge value) goes as several slices of itself.
const MAX_CHUNK_BYTES: usize = 16 << 20;
/// Messages of at least this many bytes are padded to whole [`PAD_QUANTUM`]s (at most a 16th
/// more, or an 8th where the next whole quantum leaves no room for the field).
const PAD_FROM: usize = 1 << 20;
const PAD_QUANTUM: usize = 64 << 10;
/// The padding's field number, which `FlightData` does not use (its fields are 1, 2, 3, 1000).
const PADDING_TAG: u32 = 15;
/// Field numbers of `FlightData` (descriptor, header, app metadata, body). A padding length
/// never reads as a key of one of them, so that a reader that reads keys without skipping
/// unknown fields, taking the padding's length and then each zero for a key, finds none of
/// its fields there: Arrow Java's reader compares whole keys, Arrow C++'s before version 14
/// took the field number (`key >> 3`) whatever the wire type.
const READER_FIELDS: [usize; 4] = [1, 2, 3, 1000];
/// Zeros the padding is sent from.
static ZEROS: [u8; 2 * PAD_QUANTUM] = [0; 2 * PAD_QUANTUM];

/// One IPC message: flatbuffer metadata and body buffers not yet copied anywhere.
#[derive(Debug, Clone)]
pub(crate) struct IpcMessage {
    header: Bytes,
    body: Vec<Buffer>,
    body_len: usize,
    /// Zero bytes in the padding field after the body (0: no such field).
    padding: usize,
}

/// The length of the padding field holding `zeros` zero bytes.
fn padding_field_len(zeros: usize) -> usize {
    if zeros == 0 {
        return 0;
    }
    key_len(PADDING_TAG) + encoded_len_varint(zeros as u64) + zeros
}

/// The zeros a padding field of exactly `room` bytes holds, if one can be that long.
fn zeros_filling(room: usize) -> Option<usize> {
    (1..=10)
        .filter_map(|varint| room.checked_sub(key_len(PADDING_TAG) + varint))
        .find(|&zeros| zeros > 0 && padding_field_len(zeros) == room)
}

/// Whether `value`, read as a protobuf key, names one of `FlightData`'s fields.
fn reads_as_a_field(value: usize) -> bool {
    READER_FIELDS.contains(&(value >> 3))
}

/// The padding that takes a message of `len` bytes to a whole number of [`PAD_QUANTUM`]s
/// within `limit`: 0 for a message under [`PAD_FROM`] or already whole, or where no such
/// padding fits.
fn padding_for(len: usize, limit: usize) -> usize {
    if len < PAD_FROM || len.is_multiple_of(PAD_QUANTUM) {
        return 0;
    }
    let mut target = len.next_multiple_of(PAD_QUANTUM);
    // The next whole quantum where this one leaves no room for the field, or would need a
    // length that reads as a key.
    for _ in 0..2 {
        if target > limit {
            return 0;
        }
        if let Some(zeros) = zeros_filling(target - len)
            && !reads_as_a_field(zeros)
            && zeros <= ZEROS.len()
        {
            return zeros;
        }
        target += PAD_QUANTUM;
    }
    0
}

impl IpcMessage {
    /// Length of the protobuf encoding of the equivalent `FlightData`.
    pub(crate) fn encoded_len(&self) -> usize {
        let header = if self.header.is_empty() {
            0
        } else {
            key_len(DATA_HEADER_TAG)
                + encoded_len_varint(self.header.len() as u64)
                + self.header.len()
        };
        let body = if self.body_len == 0 {
            0
        } else {
            key_len(DATA_BODY_TAG) + encoded_len_varint(self.body_len as u64) + self.body_len
        };
        header + body + padding_field_len(self.padding)
    }

    /// This message, a record batch's or a dictionary's of at least [`PAD_FROM`] bytes padded
    /// to whole [`PAD_QUANTUM`]s where that stays within `limit` (see the module docs).
    pub(crate) fn padded(mut self, limit: usize) -> Self {
        if self.body_len > 0 && self.padding == 0 {
            self.padding = padding_for(self.encoded_len(), limit);
        }
        self
    }

    /// Appends this message to `out` as one gRPC frame: the prefix, the protobuf framing of the
    /// equivalent `FlightData` and its metadata in one chunk, then the body, small buffers copied
    /// into chunks, large ones as they are.
    pub(crate) fn into_frame(self, out: &mut VecDeque<Bytes>) -> Result<(), Status> {
        // Only a single row can pass --max-message-bytes, and gRPC frames end at 4 GiB.
        let len = u32::try_from(self.encoded_len()).map_err(|_| {
            Status::from(Error::Unsupported(
                "a row that takes more than 4 GiB, the most one gRPC message can carry,",
            ))
        })?;
        let copied: usize = self
            .body
            .iter()
            .map(Buffer::len)
            .filter(|&n| n < ZERO_COPY_BYTES)
            .sum();
        let mut chunk =
            BytesMut::with_capacity(GRPC_PREFIX_BYTES + 32 + self.header.len() + copied);
        chunk.put_u8(0);
        chunk.put_u32(len);
        if !self.header.is_empty() {
            encode_key(DATA_HEADER_TAG, WireType::LengthDelimited, &mut chunk);
            encode_varint(self.header.len() as u64, &mut chunk);
            chunk.put_slice(&self.header);
        }
        if self.body_len > 0 {
            encode_key(DATA_BODY_TAG, WireType::LengthDelimited, &mut chunk);
            encode_varint(self.body_len as u64, &mut chunk);
        }
        for buffer in self.body {
            if buffer.len() < ZERO_COPY_BYTES {
                chunk.put_slice(buffer.as_slice());
                continue;
            }
            if !chunk.is_empty() {
                out.push_back(chunk.split().freeze());
            }
            let whole = Bytes::from_owner(buffer);
            let mut start = 0;
            while start < whole.len() {
                let end = whole.len().min(start + MAX_CHUNK_BYTES);
                out.push_back(whole.slice(start..end));
                start = end;
            }
        }
        if self.padding > 0 {
            encode_key(PADDING_TAG, WireType::LengthDelimited, &mut chunk);
            encode_varint(self.padding as u64, &mut chunk);
        }
        if !chunk.is_empty() {
            out.push_back(chunk.freeze());
        }
        if self.padding > 0 {
            out.push_back(Bytes::from_static(&ZEROS[..self.padding]));
        }
        Ok(())
    }

    /// The body's buffers, in order.
    #[cfg(test)]
    pub(super) fn body_buffers(&self) -> &[Buffer] {
        &self.body
    }

    /// The same message as a `FlightData` (concatenating the body), as tests compare them.
    #[cfg(test)]
    pub(crate) fn into_flight_data(self) -> arrow_flight::FlightData {
        let mut body = Vec::with_capacity(self.body_len);
        for buffer in &self.body {
            body.extend_from_slice(buffer.as_slice());
        }
        arrow_flight::FlightData {
            data_header: self.header,
            data_body: body.into(),
            ..arrow_flight::FlightData::default()
        }
    }
}

/// Turns record batches into [`IpcMessage`]s: the schema first, dictionaries as they change.
pub(crate) struct IpcMessageEncoder {
    encoder: StreamEncoder,
}

impl std::fmt::Debug for IpcMessageEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcMessageEncoder").finish_non_exhaustive()
    }
}

impl IpcMessageEncoder {
    /// An encoder whose record batch and dictionary bodies are compressed with `compression`.
    pub(crate) fn new(
        schema: &Schema,
        compression: Option<CompressionType>,
    ) -> Result<Self, ArrowError> {
        let options = IpcWriteOptions::default().try_with_compression(compression)?;
        Ok(Self {
            encoder: StreamEncoder::try_new_with_options(schema, options)?,
        })
    }

    /// The messages for one batch (the first call also yields the schema).
    pub(crate) fn encode(&mut self, batch: &RecordBatch) -> Result<Vec<IpcMessage>, ArrowError> {
        split_messages(self.encoder.encode(batch)?)
    }

    /// The schema message if no batch was encoded, so an empty stream still has its schema.
    pub(crate) fn finish(self) -> Result<Vec<IpcMessage>, ArrowError> {
        split_messages(self.encoder.finish()?)
    }
}

/// Splits an IPC stream, given as consecutive buffers, into messages; stops at end-of-stream.
fn split_messages(buffers: Vec<Buffer>) -> Result<Vec<IpcMessage>, ArrowError> {
    let mut stream = BufferCursor::new(buffers);
    let mut messages = Vec::new();
    while stream.remaining() > 0 {
        let marker = u32::from_le_bytes(stream.take_array()?);
        let metadata_len = if marker == CONTINUATION {
            u32::from_le_bytes(stream.take_array()?)
        } else {
            marker // the pre-1.0 format has no continuation marker
        } as usize;
        if metadata_len == 0 {
            break;
        }
        let header = Bytes::from(stream.take_vec(metadata_len)?);
        let message = arrow::ipc::root_as_message(&header)
            .map_err(|e| ArrowError::IpcError(format!("unreadable IPC metadata: {e}")))?;
        let body_len = usize::try_from(message.bodyLength())
            .map_err(|_| ArrowError::IpcError("negative IPC body length".to_owned()))?;
        let body = stream.take_buffers(body_len)?;
        messages.push(IpcMessage {
            header,
            body,
            body_len,
            padding: 0,
        });
    }
    Ok(messages)
}

/// Reads bytes across a list of buffers, slicing rather than copying where it can.
struct BufferCursor {
    buffers: VecDeque<Buffer>,
}

impl BufferCursor {
    fn new(buffers: Vec<Buffer>) -> Self {
        Self {
            buffers: buffers.into_iter().filter(|b| !b.is_empty()).collect(),
        }
    }

    fn remaining(&self) -> usize {
        self.buffers.iter().map(Buffer::len).sum()
    }

    fn take_array<const N: usize>(&mut self) -> Result<[u8; N], ArrowError> {
        let bytes = self.take_vec(N)?;
        let mut array = [0; N];
        array.copy_from_slice(&bytes);
        Ok(array)
    }

    /// Copies out `len` bytes (metadata: small).
    fn take_vec(&mut self, len: usize) -> Result<Vec<u8>, ArrowError> {
        let mut out = Vec::with_capacity(len);
        for buffer in self.take_buffers(len)? {
            out.extend_from_slice(buffer.as_slice());
        }
        Ok(out)
    }

    /// The next `len` bytes as zero-copy slices.
    fn take_buffers(&mut self, mut len: usize) -> Result<Vec<Buffer>, ArrowError> {
        let mut out = Vec::new();
        while len > 0 {
            let Some(front) = self.buffers.pop_front() else {
                return Err(ArrowError::IpcError(
                    "IPC stream ended mid-message".to_owned(),
                ));
            };
            if front.len() <= len {
                len -= front.len();
                out.push(front);
            } else {
                out.push(front.slice_with_length(0, len));
                self.buffers.push_front(front.slice(len));
                len = 0;
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{ArrayRef, DictionaryArray, Int64Array, StringArray};
    use arrow::datatypes::Int32Type;
    use arrow_flight::decode::FlightRecordBatchStream;
    use futures::TryStreamExt;
    use prost::Message;

    use super::*;

    fn batch(offset: i64) -> RecordBatch {
        let ids: ArrayRef = Arc::new(Int64Array::from_iter(
            (0..1000).map(|i| (i % 3 != 0).then_some(i + offset)),
        ));
        let words: ArrayRef = Arc::new(StringArray::from_iter_values(
            (0..1000).map(|i| format!("w{i}")),
        ));
        let dict: DictionaryArray<Int32Type> = (0..1000).map(|i| ["a", "b"][i % 2]).collect();
        RecordBatch::try_from_iter([
            ("id", ids),
            ("word", words),
            ("d", Arc::new(dict) as ArrayRef),
        ])
        .expect("batch")
    }

    #[test]
    fn hand_framing_equals_prost() {
        let sliced = batch(0).slice(7, 333);
        let mut encoder = IpcMessageEncoder::new(&sliced.schema(), None).expect("encoder");
        let messages = encoder.encode(&sliced).expect("encode");
        assert_eq!(messages.len(), 3, "schema, dictionary, batch");
        for message in messages {
            let mut chunks = VecDeque::new();
            message.clone().into_frame(&mut chunks).expect("frame");
            let ours: Vec<u8> = chunks.iter().flatten().copied().collect();
            let prost = message.into_flight_data().encode_to_vec();
            assert_eq!(ours[0], 0, "not compressed");
            assert_eq!(ours[1..5], (prost.len() as u32).to_be_bytes());
            assert_eq!(ours[5..], prost);
        }
    }

    #[tokio::test]
    async fn messages_decode_back_to_the_batches() {
        let batches = vec![batch(0).slice(3, 500), batch(1000), batch(5).slice(999, 1)];
        let mut encoder = IpcMessageEncoder::new(&batches[0].schema(), None).expect("encoder");
        let mut data = Vec::new();
        for batch in &batches {
            data.extend(encoder.encode(batch).expect("encode"));
        }
        data.extend(encoder.finish().expect("finish"));
        let flight_data = data.into_iter().map(|m| Ok(m.into_flight_data()));
        let decoded: Vec<RecordBatch> =
            FlightRecordBatchStream::new_from_flight_data(futures::stream::iter(flight_data))
                .try_collect()
                .await
                .expect("decode");
        assert_eq!(decoded, batches);
    }

    #[test]
    fn huge_buffers_are_handed_on_in_slices() {
        let values: ArrayRef = Arc::new(Int64Array::from_iter_values(0..5 << 20)); // 40 MiB
        let batch = RecordBatch::try_from_iter([("v", values)]).expect("batch");
        let mut encoder = IpcMessageEncoder::new(&batch.schema(), None).expect("encoder");
        let message = encoder
            .encode(&batch)
            .expect("encode")
            .pop()
            .expect("batch");
        let mut chunks = VecDeque::new();
        message.clone().into_frame(&mut chunks).expect("frame");
        assert!(chunks.iter().all(|c| c.len() <= MAX_CHUNK_BYTES));
        assert_eq!(
            chunks.iter().filter(|c| c.len() == MAX_CHUNK_BYTES).count(),
            2
        );
        let ours: Vec<u8> = chunks.iter().flatten().copied().collect();
        assert_eq!(ours[5..], message.into_flight_data().encode_to_vec());
    }

    #[test]
    fn padding_fills_whole_quanta_within_the_limit_and_never_reads_as_a_key() {
        let limit = 4032 << 10;
        for room in 0..3 * PAD_QUANTUM {
            if let Some(zeros) = zeros_filling(room) {
                assert_eq!(padding_field_len(zeros), room);
            }
        }
        let mut padded = 0;
        for len in (PAD_FROM..limit + PAD_QUANTUM)
            .step_by(997)
            .chain([PAD_FROM, 2 << 20])
        {
            let zeros = padding_for(len, limit);
            if zeros == 0 {
                assert!(
                    len.is_multiple_of(PAD_QUANTUM) || len + 2 * PAD_QUANTUM > limit,
                    "{len} left unpadded"
                );
                continue;
            }
            padded += 1;
            let total = len + padding_field_len(zeros);
            assert_eq!(total % PAD_QUANTUM, 0, "{len}");
            assert!(total <= limit, "{len}");
            assert!(!reads_as_a_field(zeros), "{len}");
        }
        assert!(padded > 2500);
        assert_eq!(
            padding_for(PAD_FROM - 1, limit),
            0,
            "small messages stay as they are"
        );
        // Where the room left would take a length that reads as a key of one of FlightData's
        // fields, whatever its wire type, the next quantum is taken.
        for key in [8, 10, 20, 26, 31, 8000, 8002, 8007] {
            let room = key_len(PADDING_TAG) + encoded_len_varint(key as u64) + key;
            let len = 2 * PAD_FROM - room;
            let zeros = padding_for(len, limit);
            assert!(zeros > 0 && !reads_as_a_field(zeros), "{key}: {zeros}");
            assert_eq!((len + padding_field_len(zeros)) % PAD_QUANTUM, 0, "{key}");
        }
        // A message of whole quanta already is left as it is.
        assert_eq!(padding_for(2 * PAD_FROM, limit), 0);
    }

    #[tokio::test]
    async fn a_padded_message_reads_back_as_the_batch_it_was() {
        let values: ArrayRef = Arc::new(Int64Array::from_iter_values(0..150_000)); // 1.2 MB
        let batch = RecordBatch::try_from_iter([("v", values)]).expect("batch");
        let mut encoder = IpcMessageEncoder::new(&batch.schema(), None).expect("encoder");
        let mut messages = encoder.encode(&batch).expect("encode");
        let message = messages.pop().expect("batch").padded(4 << 20);
        assert!(message.padding > 0);
        let mut chunks = VecDeque::new();
        message.clone().into_frame(&mut chunks).expect("frame");
        let ours: Vec<u8> = chunks.iter().flatten().copied().collect();
        assert_eq!(ours[1..5], ((ours.len() - 5) as u32).to_be_bytes());
        assert_eq!((ours.len() - 5) % PAD_QUANTUM, 0);
        // prost skips the unknown field: the same FlightData as without it.
        let read = arrow_flight::FlightData::decode(&ours[5..]).expect("protobuf");
        assert_eq!(read, message.into_flight_data());
        let schema = messages.pop().expect("schema").into_flight_data();
        let decoded: Vec<RecordBatch> =
            FlightRecordBatchStream::new_from_flight_data(futures::stream::iter([
                Ok(schema),
                Ok(read),
            ]))
            .try_collect()
            .await
            .expect("decode");
        assert_eq!(decoded, vec![batch]);
    }

    #[test]
    fn an_empty_stream_still_has_its_schema() {
        let schema = batch(0).schema();
        let messages = IpcMessageEncoder::new(&schema, None)
            .expect("encoder")
            .finish()
            .expect("finish");
        assert_eq!(messages.len(), 1);
        assert_eq!(messages[0].body_len, 0);
    }
}
