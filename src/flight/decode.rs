//! `DoPut` input: FlightData messages to Arrow schemas and record batches, trusting no number a
//! client wrote in them.
//!
//! Arrow's IPC reader assumes well-formed input in places: a buffer that points past the end of
//! the message body, a negative length or a row count of 2^62 makes it panic or allocate without
//! bound, and a buffer it views as typed values (offsets, views, dictionary keys) must hold a
//! whole number of them, aligned, or it panics. So every message's metadata is checked against
//! the bytes that really arrived ([`check_batch`]) and each buffer against the layout its
//! column gives it ([`check_layout`]) before Arrow reads it; Arrow then builds the arrays with
//! full validation (offsets, UTF-8, dictionary keys), and [`check_values`] adds what Arrow does
//! not check (decimal precision). A panic that still escapes Arrow is caught here and reported as a
//! server bug, never as the client's: the fuzzer in `tests/fuzz/` holds that line.
//!
//! Compressed bodies (LZ4 frame or ZSTD, as pyarrow writes with `IpcWriteOptions(compression=)`)
//! prefix each buffer with the length it decompresses to, and Arrow allocates that length before
//! it decompresses. So those lengths are read and bounded first ([`buffer_lengths`]): their sum
//! must fit in `--max-put-message-bytes`, and is paid for by the caller (the `reserve` argument of [`PutDecoder::decode`]) before Arrow
//! allocates anything. Arrow then refuses data that decompresses to more than it declared.
//!
//! Where the backend has memory it uploads from directly (the CUDA backend's
//! `--pinned-host-memory`), a large uncompressed record batch's body is decoded there: received
//! there straight from the network frames (`PutMessage::body_pinned`), or else first copied
//! there ([`PutDecoder::with_pinned_bodies`]), 64-byte aligned. Arrow then reads its arrays in
//! place, and their upload needs no staging copy. Without it, Arrow copies each buffer the
//! protobuf framing left misaligned (most of them) into an allocation of its own, and the
//! upload copies them again into staging.
//!
//! Decoded arrays never point into the message they came in ([`detach`]): Arrow realigns
//! misaligned buffers into allocations of its own, and the columns (and dictionaries) it decoded
//! in place are copied. A batch kept by a backend therefore never keeps a client's message alive,
//! with whatever padding it carried, and the host backend can keep Arrow's buffers as they are.
//! The exception is a record batch body that arrived in an aligned allocation of its own
//! (`put_stream`) and holds nothing but the batch's arrays
//! ([`crate::arrays::batch_owns_its_allocations`]): Arrow decodes them in place and they keep
//! the body, which is then no more than what they are charged for.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use arrow::array::{
    ArrayData, ArrayRef, Decimal32Array, Decimal64Array, Decimal128Array, Decimal256Array,
    make_array,
};
use arrow::buffer::Buffer;
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use arrow::ipc::{self, MessageHeader};
use arrow::record_batch::{RecordBatch, RecordBatchOptions};
use arrow_flight::FlightData;
use serde::Deserialize;

use super::put_stream::PutMessage;
use crate::arrays::{batch_owns_its_allocations, owned};
use crate::error::Error;

/// Most rows a record batch, or any array in it, may declare. cuDF columns have the same limit,
/// so a batch within it can always be handed to a GPU consumer as it is.
pub const MAX_BATCH_ROWS: i64 = i32::MAX as i64;

/// What one message contributed.
#[derive(Debug)]
pub(crate) enum Decoded {
    Schema(SchemaRef),
    Batch(RecordBatch),
    /// A dictionary, kept for the batches that follow.
    Dictionary,
    /// A message with no IPC content, such as a descriptor alone.
    Nothing,
    /// The client's [`PutAbort`] marker: the put is to be discarded, for this reason (bounded).
    Abandoned(String),
}

/// The `app_metadata` of a `DoPut` message without IPC content (no header, no body) by which a
/// client abandons its put: JSON `{"abort": "<reason>"}`. A client cannot cancel a gRPC stream
/// through pyarrow.flight, and ending it commits what was sent, so this is how a client whose
/// own data failed midway says not to commit. Any other `app_metadata` is ignored.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PutAbort {
    pub abort: String,
}

/// Most bytes of a [`PutAbort`] reason repeated in the error the client gets back (and logs).
const MAX_ABORT_REASON_BYTES: usize = 512;

impl PutAbort {
    /// The marker, if `app_metadata` is one; anything else is not. Only a JSON object counts
    /// (serde would fill the struct from `["..."]` too); its size is the message's, already
    /// bounded and paid for, so a long reason still aborts.
    fn parse(app_metadata: &[u8]) -> Option<Self> {
        if app_metadata.is_empty() {
            return None;
        }
        let object: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(app_metadata).ok()?;
        Self::deserialize(serde_json::Value::Object(object)).ok()
    }

    /// The reason, cut to [`MAX_ABORT_REASON_BYTES`] on a character boundary.
    fn into_reason(self) -> String {
        let mut reason = self.abort;
        if reason.len() > MAX_ABORT_REASON_BYTES {
            let mut end = MAX_ABORT_REASON_BYTES;
            while !reason.is_char_boundary(end) {
                end -= 1;
            }
            reason.truncate(end);
            reason.push_str("...");
        }
        reason
    }
}

/// Copies a message body into host memory the backend uploads from directly, where it has
/// room (`Store::pinned_copy`).
pub(crate) type PinnedCopy = Box<dyn Fn(&[u8]) -> Option<Buffer> + Send + Sync>;

/// Bodies smaller than this stay where they lie: their arrays go through staging anyway (an
/// upload copies straight from pinned memory only buffers large enough to pay for a copy each).
const PINNED_BODY_MIN_BYTES: usize = 256 << 10;
/// The average buffer an upload copies straight from pinned memory must reach (the CUDA
/// backend's `pieces::DIRECT_MIN_AVERAGE_BYTES`): a body of smaller buffers is staged anyway.
const PINNED_MIN_AVERAGE_BUFFER_BYTES: usize = 64 << 10;

/// Decodes one `DoPut` stream: remembers its schema and dictionaries between messages.
#[derive(Debug)]
pub(crate) struct PutDecoder {
    schema: Option<SchemaRef>,
    dictionaries: HashMap<i64, ArrayRef>,
    /// `--max-message-bytes`, which `DoGet` replies keep to: a schema message over it, or a
    /// schema no row of which fits in it, could not be read back, and is refused up front.
    max_message_bytes: usize,
    /// Most bytes a compressed message's buffers may decompress to.
    max_decompressed_bytes: u64,
    /// Whether decoded arrays must not point into their message ([`detach`]): for a backend
    /// that keeps the arrays it is given.
    detach: bool,
    /// Whether the schema has dense unions, whose offsets Arrow reads where they lie.
    dense_unions: bool,
    pinned: Option<PinnedBodies>,
}

/// [`PinnedCopy`], shown by name only.
struct PinnedBodies(PinnedCopy);

impl std::fmt::Debug for PinnedBodies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PinnedBodies")
    }
}

impl PutDecoder {
    pub(crate) fn new(max_message_bytes: usize, max_decompressed_bytes: u64, detach: bool) -> Self {
        Self {
            schema: None,
            dictionaries: HashMap::new(),
            max_message_bytes,
            max_decompressed_bytes,
            detach,
            dense_unions: false,
            pinned: None,
        }
    }

    /// Copies each record batch body worth it ([`worth_pinning`]) with `copy` first, and
    /// decodes the copy where `copy` returns one. For a backend that does not keep the arrays
    /// it is given (the copy is not detached).
    pub(crate) fn with_pinned_bodies(mut self, copy: PinnedCopy) -> Self {
        self.pinned = Some(PinnedBodies(copy));
        self
    }

    /// Decodes one message as [`Self::decode`] does; where its body came alone
    /// ([`PutMessage::body_alone`]) and holds nothing but a record batch's arrays, those arrays
    /// stay in it, even for a backend that keeps them.
    pub(crate) fn decode_message(
        &mut self,
        message: &PutMessage,
        reserve: impl FnOnce(u64) -> Result<(), Error>,
    ) -> Result<Decoded, Error> {
        self.decode_body(
            &message.data,
            message.body_alone,
            message.body_pinned,
            reserve,
        )
    }

    /// Decodes one message. For a compressed one, `reserve` is first asked to pay for the bytes
    /// its buffers decompress to; its error is returned as it is.
    #[cfg(test)]
    pub(crate) fn decode(
        &mut self,
        data: &FlightData,
        reserve: impl FnOnce(u64) -> Result<(), Error>,
    ) -> Result<Decoded, Error> {
        self.decode_body(data, false, false, reserve)
    }

    /// `body_pinned`: the body already lies in the backend's pinned memory, as a copy there
    /// would.
    fn decode_body(
        &mut self,
        data: &FlightData,
        body_alone: bool,
        body_pinned: bool,
        reserve: impl FnOnce(u64) -> Result<(), Error>,
    ) -> Result<Decoded, Error> {
        if data.data_header.is_empty() {
            if data.data_body.is_empty() {
                return Ok(match PutAbort::parse(&data.app_metadata) {
                    Some(marker) => Decoded::Abandoned(marker.into_reason()),
                    None => Decoded::Nothing,
                });
            }
            return Err(invalid("a FlightData message has a body but no IPC header"));
        }
        let message = ipc::root_as_message(&data.data_header)
            .map_err(|e| invalid(format!("unreadable IPC message header: {e}")))?;
        let version = message.version();
        let body_len = data.data_body.len();
        match message.header_type() {
            MessageHeader::Schema => {
                let limit = super::schema_limit(self.max_message_bytes);
                if data.data_header.len() > limit {
                    return Err(invalid(format!(
                        "the schema message has {} bytes, over the {limit} bytes a schema may \
                         take of the {}-byte message limit (--max-message-bytes) that replies \
                         carrying it keep to",
                        data.data_header.len(),
                        self.max_message_bytes
                    )));
                }
                let header = message
                    .header_as_schema()
                    .ok_or_else(|| invalid("an IPC schema message without its schema"))?;
                let schema = guarded("reading a schema", || {
                    ipc::convert::try_fb_to_schema(header)
                })?
                .map_err(|e| invalid(format!("invalid schema: {e}")))?;
                check_schema(&schema)?;
                let schema = Arc::new(schema);
                check_one_row_fits(&schema, self.max_message_bytes)?;
                if self.schema.is_none() {
                    self.dense_unions = has_dense_union(&schema);
                    self.schema = Some(Arc::clone(&schema));
                }
                Ok(Decoded::Schema(schema))
            }
            MessageHeader::DictionaryBatch => {
                let schema = self.schema()?;
                let header = message
                    .header_as_dictionary_batch()
                    .ok_or_else(|| invalid("an IPC dictionary message without its batch"))?;
                if header.isDelta() {
                    // Each delta re-concatenates the whole dictionary: quadratic work a client
                    // could ask for with a few bytes a message.
                    return Err(invalid(
                        "delta dictionary batches are not accepted; send each dictionary whole \
                         (pyarrow does unless emit_dictionary_deltas is set)",
                    ));
                }
                let batch = header
                    .data()
                    .ok_or_else(|| invalid("an IPC dictionary message without its data"))?;
                check_batch(&batch, body_len)?;
                let buffers = self.pay_for_decompression(&batch, &data.data_body, reserve)?;
                if let Some(values) = dictionary_values(&schema, header.id()) {
                    check_layout(&Schema::new(vec![values]), &batch, &buffers, version)?;
                }
                let body = self.body(&data.data_body);
                let dictionaries = &mut self.dictionaries;
                guarded("reading a dictionary", || {
                    ipc::reader::read_dictionary(&body, header, &schema, dictionaries, &version)
                })?
                .map_err(|e| invalid(format!("invalid dictionary batch: {e}")))?;
                if self.detach {
                    let message = body_range(body.as_slice());
                    for dictionary in self.dictionaries.values_mut() {
                        *dictionary = detach(dictionary, &message)?;
                    }
                }
                Ok(Decoded::Dictionary)
            }
            MessageHeader::RecordBatch => {
                let schema = self.schema()?;
                let header = message
                    .header_as_record_batch()
                    .ok_or_else(|| invalid("an IPC record batch message without its batch"))?;
                check_batch(&header, body_len)?;
                let buffers = self.pay_for_decompression(&header, &data.data_body, reserve)?;
                check_layout(&schema, &header, &buffers, version)?;
                let body = match &self.pinned {
                    Some(PinnedBodies(copy))
                        if !body_pinned && worth_pinning(&schema, &header, body_len) =>
                    {
                        copy(&data.data_body).unwrap_or_else(|| self.body(&data.data_body))
                    }
                    _ => self.body(&data.data_body),
                };
                let dictionaries = &self.dictionaries;
                let batch = guarded("reading a record batch", || {
                    ipc::reader::read_record_batch(
                        &body,
                        header,
                        schema,
                        dictionaries,
                        None,
                        &version,
                    )
                })?
                .map_err(|e| invalid(format!("invalid record batch: {e}")))?;
                for column in batch.columns() {
                    check_values(&column.to_data())?;
                }
                // A body that came alone is its allocation's whole length (a `Buffer` over
                // `bytes::Bytes` reports its length as its capacity, so only then is it
                // measured whole).
                if !self.detach || (body_alone && batch_owns_its_allocations(&batch)) {
                    return Ok(Decoded::Batch(batch));
                }
                let message = body_range(body.as_slice());
                let columns = batch
                    .columns()
                    .iter()
                    .map(|column| detach(column, &message))
                    .collect::<Result<Vec<_>, _>>()?;
                let options = RecordBatchOptions::new().with_row_count(Some(batch.num_rows()));
                let batch = RecordBatch::try_new_with_options(batch.schema(), columns, &options)
                    .map_err(|e| Error::Internal(format!("rebuilding a decoded batch: {e}")))?;
                Ok(Decoded::Batch(batch))
            }
            other => Err(invalid(format!(
                "unexpected IPC message type {other:?} in a DoPut stream; send a schema, then \
                 dictionaries and record batches"
            ))),
        }
    }

    /// Pays for what a compressed batch decompresses to; returns each buffer's offset in the
    /// body and the length Arrow will see for it.
    fn pay_for_decompression(
        &self,
        batch: &ipc::RecordBatch<'_>,
        body: &[u8],
        reserve: impl FnOnce(u64) -> Result<(), Error>,
    ) -> Result<Vec<(i64, i64)>, Error> {
        let (lengths, total) = buffer_lengths(batch, body, self.max_decompressed_bytes)?;
        if total > 0 {
            reserve(total)?;
        }
        Ok(lengths)
    }

    /// The body as Arrow reads it: in place, except that a dense union's offsets (`i32`s,
    /// which Arrow requires aligned and does not realign) need a body that starts aligned,
    /// and gRPC leaves a body wherever it lay in the frame.
    fn body(&self, body: &bytes::Bytes) -> Buffer {
        if self.dense_unions && !(body.as_ptr() as usize).is_multiple_of(8) {
            return Buffer::from_slice_ref(body);
        }
        Buffer::from(body.clone())
    }

    fn schema(&self) -> Result<SchemaRef, Error> {
        self.schema
            .clone()
            .ok_or_else(|| invalid("the put sent data before its schema"))
    }
}

/// Whether a record batch's body is worth copying into pinned memory: its arrays would then be
/// uploaded straight from there. Not where Arrow decompresses it into buffers of its own, nor
/// where the batch has dictionary columns (their values come from other messages, so the
/// upload stages them all), nor where its buffers are small on average or it is small.
fn worth_pinning(schema: &Schema, batch: &ipc::RecordBatch<'_>, body_len: usize) -> bool {
    let dictionaries = schema.fields().iter().any(|field| {
        crate::arrays::contains(field.data_type(), &|t| {
            matches!(t, DataType::Dictionary(..))
        })
    });
    !dictionaries && batch_worth_pinning(batch, body_len)
}

/// What [`worth_pinning`] asks of the batch itself: uncompressed, and large enough in all and
/// per buffer.
fn batch_worth_pinning(batch: &ipc::RecordBatch<'_>, body_len: usize) -> bool {
    let buffers = batch.buffers().map_or(0, |buffers| {
        buffers.iter().filter(|b| b.length() > 0).count()
    });
    batch.compression().is_none()
        && body_len >= PINNED_BODY_MIN_BYTES
        && body_len >= buffers.saturating_mul(PINNED_MIN_AVERAGE_BUFFER_BYTES)
}

/// Whether a body of `body_len` bytes is worth receiving straight into pinned memory, given
/// its message's protobuf fields before it (`fields`): a record batch's, by [`worth_pinning`]'s
/// rule as far as its IPC header alone tells (the frame reader does not know the schema; a
/// batch of dictionary keys so received is staged, as it would be anyway). Not a schema's nor
/// a dictionary's, which the decoder keeps for the whole put. The fields are read only for a
/// body large enough.
pub(crate) fn worth_a_block(body_len: usize, fields: &[u8]) -> bool {
    if body_len < PINNED_BODY_MIN_BYTES {
        return false;
    }
    let Ok(data) = <FlightData as prost::Message>::decode(fields) else {
        return false;
    };
    ipc::root_as_message(&data.data_header)
        .ok()
        .and_then(|message| message.header_as_record_batch())
        .is_some_and(|batch| batch_worth_pinning(&batch, body_len))
}

/// The addresses a message body occupies, its end included: an empty buffer Arrow places
/// there still holds the body's allocation.
fn body_range(body: &[u8]) -> std::ops::RangeInclusive<usize> {
    let start = body.as_ptr() as usize;
    start..=start + body.len()
}

/// `array`, or a copy of it in buffers of its own if any of its buffers lies in `message`.
fn detach(array: &ArrayRef, message: &std::ops::RangeInclusive<usize>) -> Result<ArrayRef, Error> {
    fn borrows(data: &ArrayData, message: &std::ops::RangeInclusive<usize>) -> bool {
        let nulls = data.nulls().map(|n| n.buffer());
        data.buffers()
            .iter()
            .chain(nulls)
            .any(|buffer| message.contains(&(buffer.as_ptr() as usize)))
            || data
                .child_data()
                .iter()
                .any(|child| borrows(child, message))
    }
    let data = array.to_data();
    if !borrows(&data, message) {
        return Ok(Arc::clone(array));
    }
    owned(&data)
        .map(make_array)
        .map_err(|e| Error::Internal(format!("copying a decoded array: {e}")))
}

fn invalid(message: impl Into<String>) -> Error {
    Error::InvalidIpc(message.into())
}

/// Runs Arrow code that should return errors for bad input but might panic instead; a panic is
/// a bug (ours, for not checking the input first), reported as INTERNAL and logged.
fn guarded<T>(what: &str, read: impl FnOnce() -> T) -> Result<T, Error> {
    std::panic::catch_unwind(AssertUnwindSafe(read)).map_err(|panic| {
        let reason = crate::task::panic_message(panic.as_ref());
        tracing::error!(%reason, what, "Arrow panicked on DoPut input");
        Error::Internal(format!("Arrow panicked {what}: {reason}"))
    })
}

/// Checks a record batch's metadata against the body that arrived: counts in range, every
/// buffer inside the body. Arrow slices buffers without checking and trusts the counts.
fn check_batch(batch: &ipc::RecordBatch<'_>, body_len: usize) -> Result<(), Error> {
    let rows = batch.length();
    if !(0..=MAX_BATCH_ROWS).contains(&rows) {
        return Err(invalid(format!(
            "a record batch declares {rows} rows; gpu-flight accepts 0 to {MAX_BATCH_ROWS} \
             rows a batch (split larger tables into several batches)"
        )));
    }
    for node in batch.nodes().iter().flatten() {
        let (length, nulls) = (node.length(), node.null_count());
        if !(0..=MAX_BATCH_ROWS).contains(&length) {
            return Err(invalid(format!(
                "an array declares {length} values; gpu-flight accepts 0 to {MAX_BATCH_ROWS}"
            )));
        }
        if !(0..=length).contains(&nulls) {
            return Err(invalid(format!(
                "an array of {length} values declares {nulls} nulls"
            )));
        }
    }
    let buffers = batch.buffers().map_or(0, |b| b.len());
    for buffer in batch.buffers().iter().flatten() {
        let (offset, length) = (buffer.offset(), buffer.length());
        let end = offset.checked_add(length);
        let inside = offset >= 0
            && length >= 0
            && end.is_some_and(|end| usize::try_from(end).is_ok_and(|end| end <= body_len));
        if !inside {
            return Err(invalid(format!(
                "a buffer at offset {offset} of {length} bytes lies outside the message body of \
                 {body_len} bytes"
            )));
        }
    }
    if let Some(counts) = batch.variadicBufferCounts() {
        for count in counts {
            if !usize::try_from(count).is_ok_and(|count| count <= buffers) {
                return Err(invalid(format!(
                    "a view array declares {count} data buffers; the batch has {buffers}"
                )));
            }
        }
    }
    Ok(())
}

/// The offset of each buffer of a batch (placed inside `body` by [`check_batch`]) and the
/// length it will have once Arrow has read it, and the bytes Arrow will allocate to decompress
/// them, at most `limit`: for an uncompressed batch the lengths in its metadata and nothing;
/// for a compressed one what each buffer's prefix declares (or, stored uncompressed, its
/// length less the prefix).
fn buffer_lengths(
    batch: &ipc::RecordBatch<'_>,
    body: &[u8],
    limit: u64,
) -> Result<(Vec<(i64, i64)>, u64), Error> {
    let Some(compression) = batch.compression() else {
        let wire = batch
            .buffers()
            .iter()
            .flatten()
            .map(|b| (b.offset(), b.length()))
            .collect();
        return Ok((wire, 0));
    };
    if compression.method() != ipc::BodyCompressionMethod::BUFFER {
        return Err(invalid(format!(
            "unknown IPC body compression method {:?}",
            compression.method()
        )));
    }
    let codec = compression.codec();
    if codec != ipc::CompressionType::LZ4_FRAME && codec != ipc::CompressionType::ZSTD {
        return Err(invalid(format!(
            "unknown IPC compression codec {codec:?}; gpu-flight reads LZ4_FRAME and ZSTD"
        )));
    }
    let mut total: u64 = 0;
    let mut lengths = Vec::new();
    for buffer in batch.buffers().iter().flatten() {
        // In range: check_batch placed every buffer inside the body.
        let start = usize::try_from(buffer.offset()).unwrap_or(usize::MAX);
        let length = usize::try_from(buffer.length()).unwrap_or(usize::MAX);
        let Some(bytes) = start
            .checked_add(length)
            .and_then(|end| body.get(start..end))
        else {
            return Err(invalid("a compressed buffer lies outside the message body"));
        };
        if bytes.is_empty() {
            lengths.push((buffer.offset(), 0));
            continue;
        }
        let Some(prefix) = bytes.first_chunk::<8>() else {
            return Err(invalid(format!(
                "a compressed buffer of {} bytes is shorter than its 8-byte length prefix",
                bytes.len()
            )));
        };
        let declared = i64::from_le_bytes(*prefix);
        // -1: stored uncompressed, used in place.
        if declared == -1 {
            lengths.push((
                buffer.offset(),
                i64::try_from(bytes.len() - 8).unwrap_or(i64::MAX),
            ));
            continue;
        }
        let declared = u64::try_from(declared).map_err(|_| {
            invalid(format!(
                "a compressed buffer declares {declared} bytes uncompressed"
            ))
        })?;
        total = total.saturating_add(declared);
        lengths.push((buffer.offset(), i64::try_from(declared).unwrap_or(i64::MAX)));
    }
    if total > limit {
        return Err(Error::MessageTooLarge {
            declared: usize::try_from(total).unwrap_or(usize::MAX),
            limit: usize::try_from(limit).unwrap_or(usize::MAX),
            flag: "--max-put-message-bytes",
            hint: "a compressed batch counts at its uncompressed size; send smaller batches \
                   (pyarrow: write_table(..., max_chunksize=...))",
        });
    }
    Ok((lengths, total))
}

/// Checks each buffer against what Arrow will do with it, before Arrow does: Arrow's reader
/// slices a union's type-id and offset buffers (and views its offsets as `i32`s) before it
/// validates anything, and its validation views offsets, sizes, views, dictionary keys and run
/// ends as typed slices, asserting (a panic) that each buffer holds a whole number of values.
/// Walks the schema in the order the reader consumes field nodes and buffers (depth first, one
/// node a field, a fixed number of buffers a layout). `buffers` holds each buffer's offset in
/// the body and the length Arrow will see ([`buffer_lengths`]).
fn check_layout(
    schema: &Schema,
    batch: &ipc::RecordBatch<'_>,
    buffers: &[(i64, i64)],
    version: ipc::MetadataVersion,
) -> Result<(), Error> {
    /// Lengths of the field nodes, and offsets and lengths of the buffers, consumed in order.
    struct Walk<'a> {
        nodes: std::vec::IntoIter<i64>,
        buffers: std::iter::Copied<std::slice::Iter<'a, (i64, i64)>>,
        variadic: std::collections::VecDeque<i64>,
        legacy_union_validity: bool,
    }
    impl Walk<'_> {
        fn node(&mut self) -> Result<i64, Error> {
            self.nodes.next().ok_or_else(|| {
                invalid("the record batch has fewer field nodes than its schema needs")
            })
        }
        fn buffer(&mut self) -> Result<(i64, i64), Error> {
            self.buffers
                .next()
                .ok_or_else(|| invalid("the record batch has fewer buffers than its schema needs"))
        }
        fn skip(&mut self, buffers: usize) -> Result<(), Error> {
            (0..buffers).try_for_each(|_| self.buffer().map(drop))
        }
        /// The next buffer, which Arrow views as values of `width` bytes.
        fn values(&mut self, field: &Field, width: usize, what: &str) -> Result<i64, Error> {
            let (_, length) = self.buffer()?;
            let whole = usize::try_from(length).is_ok_and(|length| length.is_multiple_of(width));
            if !whole {
                return Err(invalid(format!(
                    "column '{}' has a buffer of {length} bytes for its {what}, not a whole \
                     number of {width}-byte values",
                    field.name()
                )));
            }
            Ok(length)
        }
        fn field(&mut self, field: &Field) -> Result<(), Error> {
            let length = self.node()?;
            match field.data_type() {
                DataType::Null => Ok(()),
                DataType::Utf8 | DataType::Binary => {
                    self.skip(1)?;
                    self.values(field, 4, "offsets")?;
                    self.skip(1)
                }
                DataType::LargeUtf8 | DataType::LargeBinary => {
                    self.skip(1)?;
                    self.values(field, 8, "offsets")?;
                    self.skip(1)
                }
                DataType::Utf8View | DataType::BinaryView => {
                    let count = self.variadic.pop_front().unwrap_or(0);
                    self.skip(1)?;
                    self.values(field, 16, "views")?;
                    self.skip(usize::try_from(count).unwrap_or(0))
                }
                DataType::List(child) | DataType::Map(child, _) => {
                    self.skip(1)?;
                    self.values(field, 4, "offsets")?;
                    self.field(child)
                }
                DataType::LargeList(child) => {
                    self.skip(1)?;
                    self.values(field, 8, "offsets")?;
                    self.field(child)
                }
                DataType::ListView(child) | DataType::LargeListView(child) => {
                    let width = if matches!(field.data_type(), DataType::ListView(_)) {
                        4
                    } else {
                        8
                    };
                    self.skip(1)?;
                    self.values(field, width, "offsets")?;
                    self.values(field, width, "sizes")?;
                    self.field(child)
                }
                DataType::FixedSizeList(child, _) => {
                    self.skip(1)?;
                    self.field(child)
                }
                DataType::Struct(fields) => {
                    self.skip(1)?;
                    fields.iter().try_for_each(|f| self.field(f))
                }
                DataType::RunEndEncoded(ends, values) => {
                    self.field(ends)?;
                    self.field(values)
                }
                DataType::Union(fields, mode) => {
                    if self.legacy_union_validity {
                        self.skip(1)?;
                    }
                    let (_, ids) = self.buffer()?;
                    let offsets = match mode {
                        arrow::datatypes::UnionMode::Dense => Some(self.buffer()?),
                        arrow::datatypes::UnionMode::Sparse => None,
                    };
                    let short = ids < length
                        || offsets.is_some_and(|(_, len)| len < length.saturating_mul(4));
                    if short {
                        return Err(invalid(format!(
                            "union column '{}' of {length} values has too short a type-id or \
                             offset buffer",
                            field.name()
                        )));
                    }
                    // Arrow uses the offsets where they lie in the body (realigned to 8 bytes
                    // by the decoder if need be), as `i32`s it requires aligned.
                    if let Some((offset, _)) = offsets
                        && offset % 4 != 0
                    {
                        return Err(invalid(format!(
                            "union column '{}' has its offsets at byte {offset} of the body, \
                             not aligned to 4 bytes (IPC aligns buffers to 8)",
                            field.name()
                        )));
                    }
                    fields.iter().try_for_each(|(_, f)| self.field(f))
                }
                DataType::Dictionary(keys, _) => {
                    self.skip(1)?;
                    match keys.primitive_width() {
                        Some(width) => self.values(field, width, "dictionary keys").map(drop),
                        None => self.skip(1),
                    }
                }
                // Primitives, booleans, fixed-size binary: validity and values.
                other => {
                    self.skip(1)?;
                    match other.primitive_width() {
                        Some(width) => self.values(field, width, "values").map(drop),
                        None => self.skip(1),
                    }
                }
            }
        }
    }
    let mut walk = Walk {
        nodes: batch
            .nodes()
            .iter()
            .flatten()
            .map(|n| n.length())
            .collect::<Vec<_>>()
            .into_iter(),
        buffers: buffers.iter().copied(),
        variadic: batch
            .variadicBufferCounts()
            .map(|counts| counts.iter().collect())
            .unwrap_or_default(),
        legacy_union_validity: version < ipc::MetadataVersion::V5,
    };
    schema.fields().iter().try_for_each(|f| walk.field(f))
}

fn has_dense_union(schema: &Schema) -> bool {
    let dense = |t: &DataType| matches!(t, DataType::Union(_, arrow::datatypes::UnionMode::Dense));
    schema
        .fields()
        .iter()
        .any(|f| crate::arrays::contains(f.data_type(), &dense))
}

/// The values field of the dictionary `id`, as Arrow's reader finds it (the first field with
/// that id), if the schema has one.
fn dictionary_values(schema: &Schema, id: i64) -> Option<Field> {
    #[expect(deprecated, reason = "Arrow's reader looks dictionaries up by this id")]
    let fields = schema.fields_with_dict_id(id);
    match fields.first()?.data_type() {
        DataType::Dictionary(_, values) => Some(Field::new("", values.as_ref().clone(), true)),
        _ => None,
    }
}

/// Checks what Arrow's schema conversion accepts but later code would trust: sizes that must
/// not be negative.
fn check_schema(schema: &Schema) -> Result<(), Error> {
    // Arrow slices a union's buffers before it validates them. `check_layout` checks them in
    // dictionary messages too, but no client has needed the type: it stays refused.
    let union_dictionary = |t: &DataType| {
        matches!(t, DataType::Dictionary(_, values)
            if crate::arrays::contains(values, &|v| matches!(v, DataType::Union(_, _))))
    };
    if let Some(field) = schema
        .fields()
        .iter()
        .find(|f| crate::arrays::contains(f.data_type(), &union_dictionary))
    {
        return Err(invalid(format!(
            "field '{}' holds dictionary-encoded unions, which gpu-flight does not accept; send \
             the union column without dictionary encoding",
            field.name()
        )));
    }
    fn check(field: &Field) -> Result<(), Error> {
        match field.data_type() {
            DataType::FixedSizeList(child, size) => {
                if *size < 0 {
                    return Err(invalid(format!(
                        "field '{}' is a fixed-size list of {size} values",
                        field.name()
                    )));
                }
                check(child)
            }
            DataType::FixedSizeBinary(size) if *size < 0 => Err(invalid(format!(
                "field '{}' is fixed-size binary of {size} bytes",
                field.name()
            ))),
            DataType::List(child)
            | DataType::LargeList(child)
            | DataType::ListView(child)
            | DataType::LargeListView(child)
            | DataType::Map(child, _) => check(child),
            DataType::Struct(fields) => fields.iter().try_for_each(|f| check(f)),
            DataType::Union(fields, _) => fields.iter().try_for_each(|(_, f)| check(f)),
            DataType::RunEndEncoded(ends, values) => {
                check(ends)?;
                check(values)
            }
            DataType::Dictionary(_, values) => {
                check(&Field::new(field.name(), values.as_ref().clone(), true))
            }
            _ => Ok(()),
        }
    }
    schema.fields().iter().try_for_each(|f| check(f))
}

/// Refuses a schema whose one-row record batch message `DoGet` could not send within
/// `--max-message-bytes` (its metadata and padding alone, tens of thousands of columns): such
/// a put would succeed and every read of it fail.
fn check_one_row_fits(schema: &Schema, limit: usize) -> Result<(), Error> {
    let overhead = super::doget::one_row_overhead(schema);
    if overhead > limit as u64 {
        return Err(invalid(format!(
            "a record batch of this schema takes up to {overhead} bytes of metadata and padding \
             for a single row, over the {limit}-byte message limit (--max-message-bytes) that \
             DoGet replies keep to, so no row of it could be read back; put fewer columns per \
             dataset, or raise --max-message-bytes (and the clients' maximum receive size)"
        )));
    }
    Ok(())
}

/// What Arrow's validation leaves out: decimal values within their declared precision.
fn check_values(data: &ArrayData) -> Result<(), Error> {
    let precision = |result: Result<(), arrow::error::ArrowError>| {
        result.map_err(|e| invalid(format!("invalid decimal value: {e}")))
    };
    match data.data_type() {
        DataType::Decimal32(p, _) => {
            precision(Decimal32Array::from(data.clone()).validate_decimal_precision(*p))
        }
        DataType::Decimal64(p, _) => {
            precision(Decimal64Array::from(data.clone()).validate_decimal_precision(*p))
        }
        DataType::Decimal128(p, _) => {
            precision(Decimal128Array::from(data.clone()).validate_decimal_precision(*p))
        }
        DataType::Decimal256(p, _) => {
            precision(Decimal256Array::from(data.clone()).validate_decimal_precision(*p))
        }
        _ => data.child_data().iter().try_for_each(check_values),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{DictionaryArray, Int32Array, Int64Array, StringArray};
    use arrow::buffer::MutableBuffer;
    use arrow::datatypes::Int32Type;
    use arrow_flight::encode::{DictionaryHandling, FlightDataEncoderBuilder};
    use futures::TryStreamExt;

    /// `bytes` in a 64-byte aligned allocation: Arrow then decodes arrays in place, pointing
    /// into it, instead of realigning them into buffers of its own.
    fn aligned(bytes: &[u8]) -> bytes::Bytes {
        let mut buffer = MutableBuffer::with_capacity(bytes.len());
        buffer.extend_from_slice(bytes);
        bytes::Bytes::from_owner(Buffer::from(buffer))
    }

    fn addresses(data: &ArrayData, out: &mut Vec<usize>) {
        let nulls = data.nulls().map(|n| n.buffer());
        out.extend(
            data.buffers()
                .iter()
                .chain(nulls)
                .map(|b| b.as_ptr() as usize),
        );
        data.child_data().iter().for_each(|c| addresses(c, out));
    }

    #[test]
    fn decoded_arrays_never_point_into_their_message() {
        let keys = arrow::array::Int32Array::from(vec![0, 1, 0, 1]);
        let values = StringArray::from(vec!["red", "blue"]);
        let colours = DictionaryArray::<Int32Type>::try_new(keys, Arc::new(values)).expect("dict");
        let batch = RecordBatch::try_from_iter([
            (
                "n",
                Arc::new(Int64Array::from(vec![1, 2, 3, 4])) as ArrayRef,
            ),
            (
                "s",
                Arc::new(StringArray::from(vec!["a", "bb", "ccc", "dddd"])) as ArrayRef,
            ),
            ("c", Arc::new(colours) as ArrayRef),
        ])
        .expect("batch");
        let encoded = FlightDataEncoderBuilder::new()
            .with_dictionary_handling(DictionaryHandling::Resend)
            .build(futures::stream::iter([Ok(batch.clone())]))
            .try_collect::<Vec<_>>();
        let messages = futures::executor::block_on(encoded).expect("encode");
        let mut decoder = PutDecoder::new(1 << 20, 1 << 20, true);
        let mut bodies = Vec::new();
        let mut decoded = None;
        for mut message in messages {
            message.data_body = aligned(&message.data_body);
            let start = message.data_body.as_ptr() as usize;
            bodies.push(start..start + message.data_body.len());
            if let Decoded::Batch(batch) = decoder.decode(&message, |_| Ok(())).expect("decode") {
                decoded = Some(batch);
            }
        }
        let decoded = decoded.expect("a batch");
        assert_eq!(decoded, batch);
        let mut pointers = Vec::new();
        for column in decoded.columns() {
            addresses(&column.to_data(), &mut pointers);
        }
        for pointer in pointers {
            assert!(
                !bodies.iter().any(|body| body.contains(&pointer)),
                "an array points into a message body"
            );
        }
    }

    /// Decodes `batch` from bodies that came alone, each with `room` bytes no buffer covers at
    /// its end, by a decoder for a backend that keeps arrays; how many of the decoded batch's
    /// buffers still point into its body.
    fn kept_in_body(batch: &RecordBatch, room: usize) -> usize {
        let mut decoder = PutDecoder::new(64 << 20, 64 << 20, true);
        let mut decoded = None;
        for message in encode(batch.clone(), None) {
            let mut body = message.data_body.to_vec();
            body.resize(body.len() + room, 0);
            let message = PutMessage {
                data: FlightData {
                    data_body: aligned(&body),
                    ..message
                },
                body_alone: true,
                charge: None,
                body_pinned: false,
            };
            let start = message.data.data_body.as_ptr() as usize;
            let body = start..start + message.data.data_body.len();
            if let Decoded::Batch(batch) = decoder
                .decode_message(&message, |_| Ok(()))
                .expect("decode")
            {
                decoded = Some((batch, body));
            }
        }
        let (decoded, body) = decoded.expect("a batch");
        assert_eq!(&decoded, batch);
        let mut pointers = Vec::new();
        for column in decoded.columns() {
            addresses(&column.to_data(), &mut pointers);
        }
        pointers.iter().filter(|p| body.contains(p)).count()
    }

    #[test]
    fn a_body_alone_is_kept_only_where_it_holds_nothing_but_its_arrays() {
        let batch = RecordBatch::try_from_iter([
            (
                "n",
                Arc::new(Int64Array::from_iter_values(0..10_000)) as ArrayRef,
            ),
            (
                "s",
                Arc::new(StringArray::from_iter_values(
                    (0..10_000).map(|i| format!("value {i}")),
                )) as ArrayRef,
            ),
        ])
        .expect("batch");
        // Values, offsets and string bytes: all read in place.
        assert_eq!(kept_in_body(&batch, 0), 3, "a tight body is kept");
        assert_eq!(kept_in_body(&batch, 64), 3, "padding is not room");
        assert_eq!(
            kept_in_body(&batch, 1 << 20),
            0,
            "a body with room to spare is not kept"
        );
    }

    #[test]
    fn a_dictionarys_values_do_not_pay_for_room_in_the_keys_body() {
        // 100 KB of values, kept apart; 4 KB of keys, in a body with 64 KB of room.
        let values = StringArray::from_iter_values((0..1000).map(|i| format!("{i:0100}")));
        let keys = Int32Array::from_iter_values((0..1000).map(|i| i % 1000));
        let colours = DictionaryArray::<Int32Type>::try_new(keys, Arc::new(values)).expect("dict");
        let batch =
            RecordBatch::try_from_iter([("c", Arc::new(colours) as ArrayRef)]).expect("batch");
        assert_eq!(
            kept_in_body(&batch, 64 << 10),
            0,
            "the keys' roomy body is kept"
        );
    }

    #[test]
    fn large_uncompressed_bodies_are_decoded_in_the_pinned_copy() {
        use std::sync::Mutex;
        // A stand-in for the backend's pinned memory: a 64-byte aligned copy, remembered.
        let copies: Arc<Mutex<Vec<std::ops::Range<usize>>>> = Arc::default();
        let decoder = |copies: &Arc<Mutex<Vec<_>>>| {
            let copies = Arc::clone(copies);
            PutDecoder::new(64 << 20, 64 << 20, false).with_pinned_bodies(Box::new(move |body| {
                let copy = Buffer::from(aligned(body));
                let start = copy.as_ptr() as usize;
                copies
                    .lock()
                    .expect("copies")
                    .push(start..start + copy.len());
                Some(copy)
            }))
        };
        let large = RecordBatch::try_from_iter([(
            "n",
            Arc::new(Int64Array::from_iter_values(0..100_000)) as ArrayRef,
        )])
        .expect("batch");
        let mut pinned = decoder(&copies);
        let mut decoded = None;
        for message in encode(large.clone(), None) {
            if let Decoded::Batch(batch) = pinned.decode(&message, |_| Ok(())).expect("decode") {
                decoded = Some(batch);
            }
        }
        let decoded = decoded.expect("a batch");
        assert_eq!(decoded, large);
        let mut pointers = Vec::new();
        addresses(&decoded.column(0).to_data(), &mut pointers);
        let made = copies.lock().expect("copies").clone();
        assert_eq!(made.len(), 1, "the record batch's body alone");
        assert!(
            pointers.iter().all(|p| made[0].contains(p)),
            "decoded in place"
        );
        // Compressed bodies (Arrow decompresses them into buffers of its own), small ones, and
        // those of batches with dictionary columns (staged whole anyway) are not copied.
        let small = large.slice(0, 1000);
        let lz4 = Some(arrow::ipc::CompressionType::LZ4_FRAME);
        let keys = arrow::array::Int32Array::from_iter_values((0..200_000).map(|i| i % 2));
        let values = StringArray::from(vec!["red", "blue"]);
        let colours = DictionaryArray::<Int32Type>::try_new(keys, Arc::new(values)).expect("dict");
        let coloured =
            RecordBatch::try_from_iter([("c", Arc::new(colours) as ArrayRef)]).expect("batch");
        for (batch, codec) in [(large, lz4), (small, None), (coloured, None)] {
            let skipped = Arc::default();
            let mut pinned = decoder(&skipped);
            for message in encode(batch, codec) {
                pinned.decode(&message, |_| Ok(())).expect("decode");
            }
            assert!(skipped.lock().expect("copies").is_empty());
        }
    }

    #[test]
    fn only_large_uncompressed_record_batch_bodies_are_worth_a_block() {
        let large = RecordBatch::try_from_iter([(
            "n",
            Arc::new(Int64Array::from_iter_values(0..100_000)) as ArrayRef,
        )])
        .expect("batch");
        // What the frame reader passes: the body's length and the fields before it.
        let worth = |message: &FlightData| {
            let fields = prost::Message::encode_to_vec(&FlightData {
                data_body: bytes::Bytes::new(),
                ..message.clone()
            });
            worth_a_block(message.data_body.len(), &fields)
        };
        let verdicts =
            |batch: RecordBatch, codec| encode(batch, codec).iter().map(worth).collect::<Vec<_>>();
        // The schema's message, then the batch's.
        assert_eq!(verdicts(large.clone(), None), vec![false, true]);
        assert_eq!(verdicts(large.slice(0, 1000), None), vec![false, false]);
        let lz4 = Some(arrow::ipc::CompressionType::LZ4_FRAME);
        assert_eq!(verdicts(large, lz4), vec![false, false]);
        // A large dictionary's message is kept by the decoder for the whole put: not worth one.
        let keys = arrow::array::Int32Array::from_iter_values(0..100_000);
        let values = StringArray::from_iter_values((0..100_000).map(|i| format!("value {i}")));
        let dictionary =
            DictionaryArray::<Int32Type>::try_new(keys, Arc::new(values)).expect("dictionary");
        let batch =
            RecordBatch::try_from_iter([("d", Arc::new(dictionary) as ArrayRef)]).expect("batch");
        let messages = encode(batch, None);
        let dictionary = messages
            .iter()
            .find(|m| {
                ipc::root_as_message(&m.data_header)
                    .is_ok_and(|h| h.header_type() == MessageHeader::DictionaryBatch)
            })
            .expect("a dictionary message");
        assert!(dictionary.data_body.len() > PINNED_BODY_MIN_BYTES);
        assert!(!worth(dictionary));
        let garbage = FlightData {
            data_header: bytes::Bytes::from_static(b"not a flatbuffer"),
            ..FlightData::default()
        };
        assert!(!worth_a_block(
            1 << 20,
            &prost::Message::encode_to_vec(&garbage)
        ));
        assert!(!worth_a_block(1 << 20, b"\xff not protobuf"));
    }

    #[test]
    fn a_body_received_into_pinned_memory_is_not_copied_there_again() {
        let copies = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = Arc::clone(&copies);
        let mut decoder =
            PutDecoder::new(64 << 20, 64 << 20, false).with_pinned_bodies(Box::new(move |body| {
                counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Some(Buffer::from(aligned(body)))
            }));
        let batch = RecordBatch::try_from_iter([(
            "n",
            Arc::new(Int64Array::from_iter_values(0..100_000)) as ArrayRef,
        )])
        .expect("batch");
        let mut decoded = Vec::new();
        for (pinned, message) in [false, true].into_iter().zip(encode(batch.clone(), None)) {
            // The schema, then the batch (whose body came in a block).
            let message = PutMessage {
                data: FlightData {
                    data_body: aligned(&message.data_body),
                    ..message
                },
                body_alone: true,
                charge: None,
                body_pinned: pinned,
            };
            let body = message.data.data_body.as_ptr() as usize;
            if let Decoded::Batch(got) = decoder
                .decode_message(&message, |_| Ok(()))
                .expect("decode")
            {
                let mut pointers = Vec::new();
                addresses(&got.column(0).to_data(), &mut pointers);
                assert!(pointers.contains(&body), "decoded where it lies");
                decoded.push(got);
            }
        }
        assert_eq!(decoded, vec![batch]);
        assert_eq!(copies.load(std::sync::atomic::Ordering::Relaxed), 0);
    }

    #[test]
    fn damaged_messages_decode_alike_with_and_without_pinned_bodies() {
        use rand::{Rng, SeedableRng};
        // Client bytes reach Arrow through the pinned copy too: whatever a damaged message
        // does to the plain decoder (a batch, or an error), it must do the same there, and
        // never panic (a caught panic is an Internal error).
        let ints: ArrayRef = Arc::new(Int64Array::from_iter(
            (0..40_000).map(|i| (i % 7 != 0).then_some(i)),
        ));
        let words: ArrayRef = Arc::new(StringArray::from_iter_values(
            (0..40_000).map(|i| format!("w{}", i % 1000)),
        ));
        let batch = RecordBatch::try_from_iter([("n", ints), ("s", words)]).expect("batch");
        let messages = encode(batch, None);
        let copies = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let pinned = || {
            let copies = Arc::clone(&copies);
            PutDecoder::new(64 << 20, 64 << 20, false).with_pinned_bodies(Box::new(move |body| {
                copies.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Some(Buffer::from(aligned(body)))
            }))
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(20261125);
        let mut outcomes = [0usize; 2];
        for _ in 0..400 {
            let mut damaged = messages.clone();
            let last = damaged.last_mut().expect("a batch message");
            let mut header = last.data_header.to_vec();
            let mut body = last.data_body.to_vec();
            for _ in 0..rng.random_range(1..4) {
                match rng.random_range(0..3) {
                    0 => {
                        let at = rng.random_range(0..header.len());
                        header[at] = rng.random();
                    }
                    1 => {
                        let at = rng.random_range(0..body.len());
                        body[at] = rng.random();
                    }
                    _ => body.truncate(rng.random_range(0..body.len())),
                }
            }
            last.data_header = header.into();
            last.data_body = body.into();
            let decode = |mut decoder: PutDecoder| {
                let mut last = Ok(Decoded::Nothing);
                for message in &damaged {
                    last = decoder.decode(message, |_| Ok(()));
                    if last.is_err() {
                        break;
                    }
                }
                last
            };
            match (
                decode(PutDecoder::new(64 << 20, 64 << 20, false)),
                decode(pinned()),
            ) {
                (Ok(Decoded::Batch(plain)), Ok(Decoded::Batch(copied))) => {
                    assert_eq!(plain, copied);
                    outcomes[0] += 1;
                }
                (Err(plain), Err(copied)) => {
                    assert!(!matches!(plain, Error::Internal(_)), "{plain}");
                    assert!(!matches!(copied, Error::Internal(_)), "{copied}");
                    outcomes[1] += 1;
                }
                (plain, copied) => panic!("plain {plain:?}, pinned {copied:?}"),
            }
        }
        assert!(outcomes[1] > 0, "some damage is refused: {outcomes:?}");
        let copies = copies.load(std::sync::atomic::Ordering::Relaxed);
        assert!(copies > 50, "bodies went through the pinned copy: {copies}");
    }

    fn encode(batch: RecordBatch, codec: Option<arrow::ipc::CompressionType>) -> Vec<FlightData> {
        let options = arrow::ipc::writer::IpcWriteOptions::default()
            .try_with_compression(codec)
            .expect("codec");
        let encoded = FlightDataEncoderBuilder::new()
            .with_options(options)
            .with_dictionary_handling(DictionaryHandling::Resend)
            .build(futures::stream::iter([Ok(batch)]))
            .try_collect::<Vec<_>>();
        futures::executor::block_on(encoded).expect("encode")
    }

    fn sparse_union(type_ids: Vec<i8>) -> ArrayRef {
        let rows = type_ids.len();
        let fields =
            arrow::datatypes::UnionFields::try_new([0], [Field::new("a", DataType::Int8, true)])
                .expect("fields");
        let child: ArrayRef = Arc::new(arrow::array::Int8Array::from(vec![1i8; rows]));
        let ids = arrow::buffer::ScalarBuffer::from(type_ids);
        Arc::new(arrow::array::UnionArray::try_new(fields, ids, None, vec![child]).expect("union"))
    }

    fn decode_all(messages: &[FlightData]) -> Result<Decoded, Error> {
        let mut decoder = PutDecoder::new(1 << 20, 1 << 30, true);
        let mut last = Ok(Decoded::Nothing);
        for message in messages {
            last = decoder.decode(message, |_| Ok(()));
            if last.is_err() {
                break;
            }
        }
        last
    }

    /// The offset of the first field node's length in a record batch header.
    fn first_node_length_at(header: &[u8]) -> usize {
        let message = ipc::root_as_message(header).expect("message");
        let batch = message.header_as_record_batch().expect("batch");
        let nodes = batch.nodes().expect("nodes");
        nodes.bytes().as_ptr() as usize - header.as_ptr() as usize
    }

    #[test]
    fn compressed_unions_are_checked_at_their_uncompressed_lengths() {
        let batch = |ids| RecordBatch::try_from_iter([("u", sparse_union(ids))]).expect("batch");
        // Type ids that compress well: valid, so accepted.
        let lz4 = Some(arrow::ipc::CompressionType::LZ4_FRAME);
        let messages = encode(batch(vec![0; 100_000]), lz4);
        assert!(matches!(decode_all(&messages), Ok(Decoded::Batch(_))));
        // A union longer than its type ids, which Arrow would slice out of range.
        let mut messages = encode(batch(vec![0; 16]), lz4);
        let last = messages.last_mut().expect("batch message");
        let mut header = last.data_header.to_vec();
        let at = first_node_length_at(&header);
        header[at..at + 8].copy_from_slice(&20i64.to_le_bytes());
        last.data_header = header.into();
        assert!(
            matches!(decode_all(&messages), Err(Error::InvalidIpc(_))),
            "refused as the client's error, not a panic"
        );
    }

    #[test]
    fn dictionary_encoded_unions_are_refused() {
        let keys = arrow::array::Int8Array::from(vec![0i8, 1]);
        let values = sparse_union(vec![0; 16]);
        let dictionary = DictionaryArray::<arrow::datatypes::Int8Type>::try_new(keys, values)
            .expect("dictionary");
        let batch =
            RecordBatch::try_from_iter([("d", Arc::new(dictionary) as ArrayRef)]).expect("batch");
        match decode_all(&encode(batch, None)) {
            Err(Error::InvalidIpc(message)) => assert!(message.contains("dictionary-encoded")),
            other => panic!("{other:?}"),
        }
    }

    /// A batch of every layout whose buffers Arrow views as typed values: offsets of each
    /// width, list views, views, dictionary keys, run ends, union offsets, fixed-width values.
    fn typed_buffers_batch() -> RecordBatch {
        use arrow::array::*;
        use arrow::datatypes::{Int16Type, Int64Type, IntervalMonthDayNano};
        let rows: usize = 6;
        let mut lists = ListBuilder::new(ListBuilder::new(StringBuilder::new()));
        for r in 0..rows {
            for i in 0..r % 3 {
                lists.values().values().append_value(format!("v{r}.{i}"));
                lists.values().append(true);
            }
            lists.append(r != 4);
        }
        let large = LargeListArray::from_iter_primitive::<Int64Type, _, _>(
            (0..rows).map(|r| Some((0..r as i64).map(Some).collect::<Vec<_>>())),
        );
        let list_view = ListViewArray::new(
            Arc::new(Field::new_list_field(DataType::Int32, true)),
            arrow::buffer::ScalarBuffer::from(vec![0i32, 1, 2, 3, 4, 5]),
            arrow::buffer::ScalarBuffer::from(vec![1i32; 6]),
            Arc::new(Int32Array::from_iter_values(0..6)),
            None,
        );
        let keys = Int16Array::from_iter_values((0..rows).map(|r| (r % 2) as i16));
        let dictionary = DictionaryArray::<Int16Type>::try_new(
            keys,
            Arc::new(StringArray::from(vec!["red", "blue"])),
        )
        .expect("dictionary");
        let run_ends = RunArray::<Int16Type>::try_new(
            &Int16Array::from(vec![2i16, 6]),
            &Int64Array::from(vec![7i64, 8]),
        )
        .expect("run ends");
        let dense = {
            let fields = arrow::datatypes::UnionFields::try_new(
                [0, 1],
                [
                    Field::new("a", DataType::Int64, true),
                    Field::new("b", DataType::Utf8, true),
                ],
            )
            .expect("fields");
            let ids = arrow::buffer::ScalarBuffer::from(vec![0i8, 1, 0, 1, 0, 1]);
            let offsets = arrow::buffer::ScalarBuffer::from(vec![0i32, 0, 1, 1, 2, 2]);
            let children: Vec<ArrayRef> = vec![
                Arc::new(Int64Array::from(vec![1i64, 2, 3])),
                Arc::new(StringArray::from(vec!["x", "yy", "zzz"])),
            ];
            UnionArray::try_new(fields, ids, Some(offsets), children).expect("dense union")
        };
        let columns: Vec<(&str, ArrayRef)> = vec![
            (
                "strings",
                Arc::new(StringArray::from_iter_values(
                    (0..rows).map(|r| format!("s{r}")),
                )),
            ),
            (
                "large strings",
                Arc::new(LargeStringArray::from_iter_values(
                    (0..rows).map(|r| format!("l{r}")),
                )),
            ),
            (
                "views",
                Arc::new(StringViewArray::from_iter_values(
                    (0..rows).map(|r| format!("a value too long to be inline {r}")),
                )),
            ),
            ("lists", Arc::new(lists.finish())),
            ("large lists", Arc::new(large)),
            ("list views", Arc::new(list_view)),
            ("dictionary", Arc::new(dictionary)),
            ("run ends", Arc::new(run_ends)),
            ("dense union", Arc::new(dense)),
            (
                "i16",
                Arc::new(Int16Array::from_iter_values(0..rows as i16)),
            ),
            (
                "f64",
                Arc::new(Float64Array::from_iter_values((0..rows).map(|r| r as f64))),
            ),
            (
                "decimals",
                Arc::new(
                    Decimal256Array::from_iter_values(
                        (0..rows).map(|r| arrow::datatypes::i256::from_i128(r as i128)),
                    )
                    .with_precision_and_scale(20, 2)
                    .expect("precision"),
                ),
            ),
            (
                "intervals",
                Arc::new(IntervalMonthDayNanoArray::from_iter_values(
                    (0..rows).map(|r| IntervalMonthDayNano::new(r as i32, 1, 2)),
                )),
            ),
        ];
        RecordBatch::try_from_iter(columns).expect("batch")
    }

    /// Where each buffer's `(offset, length)` lies in an IPC record batch or dictionary
    /// header, and how many there are.
    fn buffers_at(header: &[u8]) -> (usize, usize) {
        let message = ipc::root_as_message(header).expect("message");
        let batch = match message.header_as_record_batch() {
            Some(batch) => batch,
            None => message
                .header_as_dictionary_batch()
                .and_then(|d| d.data())
                .expect("a batch"),
        };
        let buffers = batch.buffers().expect("buffers");
        (
            buffers.bytes().as_ptr() as usize - header.as_ptr() as usize,
            buffers.len(),
        )
    }

    fn set_buffer_length(message: &mut FlightData, index: usize, length: i64) {
        let (at, _) = buffers_at(&message.data_header);
        let mut header = message.data_header.to_vec();
        let field = at + 16 * index + 8;
        header[field..field + 8].copy_from_slice(&length.to_le_bytes());
        message.data_header = header.into();
    }

    fn buffer_length(message: &FlightData, index: usize) -> i64 {
        let (at, _) = buffers_at(&message.data_header);
        let field = at + 16 * index + 8;
        i64::from_le_bytes(
            message.data_header[field..field + 8]
                .try_into()
                .expect("8 bytes"),
        )
    }

    /// `message`'s body again, starting one byte past an aligned address: where a body sliced
    /// out of a gRPC receive buffer may well start.
    fn misaligned(message: &mut FlightData) {
        let mut bytes = vec![0u8; message.data_body.len() + 1];
        let start = if (bytes.as_ptr() as usize).is_multiple_of(2) {
            1
        } else {
            0
        };
        bytes[start..start + message.data_body.len()].copy_from_slice(&message.data_body);
        let len = message.data_body.len();
        message.data_body = bytes::Bytes::from(bytes).slice(start..start + len);
    }

    #[test]
    fn valid_batches_decode_wherever_their_body_lies() {
        let batch = typed_buffers_batch();
        for shift in [false, true] {
            let mut messages = encode(batch.clone(), None);
            if shift {
                messages.iter_mut().for_each(misaligned);
            }
            match decode_all(&messages) {
                Ok(Decoded::Batch(decoded)) => assert_eq!(decoded, batch),
                other => panic!("misaligned {shift}: {other:?}"),
            }
        }
    }

    #[test]
    fn buffers_that_do_not_hold_whole_values_are_refused() {
        // Arrow views offsets, views, keys and run ends as typed slices, and asserts (panics)
        // that a buffer holds a whole number of values: shorten or lengthen each buffer of
        // each message by a byte, which the body has room for (buffers are padded).
        let messages = encode(typed_buffers_batch(), None);
        let mut refused = 0;
        for (m, message) in messages.iter().enumerate().skip(1) {
            let (_, count) = buffers_at(&message.data_header);
            for index in 0..count {
                let length = buffer_length(message, index);
                for changed in [length - 1, length + 1] {
                    if changed < 0 {
                        continue;
                    }
                    let mut mutated = messages.clone();
                    set_buffer_length(&mut mutated[m], index, changed);
                    match decode_all(&mutated) {
                        Ok(_) => {}
                        Err(Error::InvalidIpc(_)) => refused += 1,
                        Err(other) => {
                            panic!("message {m}, buffer {index} of {changed} bytes: {other:?}")
                        }
                    }
                }
            }
        }
        assert!(refused > 0, "some were refused");
    }

    #[test]
    fn a_dense_union_offsets_buffer_off_its_alignment_is_refused() {
        let batch = typed_buffers_batch();
        let schema = batch.schema();
        let union = schema.index_of("dense union").expect("column");
        let column = RecordBatch::try_new(
            Arc::new(Schema::new(vec![schema.field(union).clone()])),
            vec![Arc::clone(batch.column(union))],
        )
        .expect("batch");
        let mut messages = encode(column, None);
        let last = messages.last_mut().expect("batch message");
        // Buffers: type ids, offsets, then the children's. Move the offsets by 2 bytes, to
        // where the body still holds them whole.
        let (at, _) = buffers_at(&last.data_header);
        let mut header = last.data_header.to_vec();
        let field = at + 16;
        let offset = i64::from_le_bytes(header[field..field + 8].try_into().expect("8 bytes"));
        header[field..field + 8].copy_from_slice(&(offset + 2).to_le_bytes());
        last.data_header = header.into();
        match decode_all(&messages) {
            Err(Error::InvalidIpc(message)) => assert!(message.contains("align"), "{message}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_schema_arrow_cannot_build_arrays_of_is_measured_without_a_panic() {
        // Run ends of an unsigned type: Arrow reads the schema, but panics making an array of
        // it (the fuzzer found the put check doing so, seed 424242, put case 100404).
        let ends = Arc::new(Field::new("run_ends", DataType::UInt32, false));
        let values = Arc::new(Field::new("values", DataType::Utf8, true));
        let schema = Schema::new(vec![Field::new(
            "r",
            DataType::RunEndEncoded(ends, values),
            true,
        )]);
        let options = arrow::ipc::writer::IpcWriteOptions::default();
        let message: FlightData = arrow_flight::SchemaAsIpc::new(&schema, &options).into();
        let mut decoder = PutDecoder::new(1 << 20, 1 << 20, true);
        match decoder.decode(&message, |_| Ok(())) {
            Ok(Decoded::Schema(_)) | Err(Error::InvalidIpc(_)) => {}
            other => panic!("{other:?}"),
        }
    }

    /// Owns a message's memory and says when it is freed.
    struct Owner(Vec<u8>, Arc<std::sync::atomic::AtomicBool>);

    impl AsRef<[u8]> for Owner {
        fn as_ref(&self) -> &[u8] {
            &self.0
        }
    }

    impl Drop for Owner {
        fn drop(&mut self) {
            self.1.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[test]
    fn empty_buffers_at_the_end_of_a_body_do_not_keep_it() {
        // An all-null dictionary column whose dictionary is empty: its buffers are empty, and
        // placed at the very end of a body that is a slice of a larger receive buffer.
        let keys = Int32Array::from(vec![None::<i32>, None]);
        let values: ArrayRef = Arc::new(arrow::array::Int8Array::from(Vec::<i8>::new()));
        let dictionary = DictionaryArray::<Int32Type>::try_new(keys, values).expect("dictionary");
        let batch =
            RecordBatch::try_from_iter([("d", Arc::new(dictionary) as ArrayRef)]).expect("batch");
        let freed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut decoder = PutDecoder::new(1 << 20, 1 << 30, true);
        for mut message in encode(batch, None) {
            let is_dictionary = ipc::root_as_message(&message.data_header)
                .is_ok_and(|m| m.header_type() == MessageHeader::DictionaryBatch);
            if is_dictionary {
                let mut header = message.data_header.to_vec();
                let (at, count) = {
                    let parsed = ipc::root_as_message(&header).expect("message");
                    let data = parsed.header_as_dictionary_batch().and_then(|d| d.data());
                    let buffers = data.and_then(|d| d.buffers()).expect("buffers");
                    (
                        buffers.bytes().as_ptr() as usize - header.as_ptr() as usize,
                        buffers.len(),
                    )
                };
                for i in 0..count {
                    let field = at + 16 * i;
                    header[field..field + 8].copy_from_slice(&8i64.to_le_bytes());
                    header[field + 8..field + 16].copy_from_slice(&0i64.to_le_bytes());
                }
                message.data_header = header.into();
                let received = Owner(vec![0u8; 1 << 20], Arc::clone(&freed));
                message.data_body = bytes::Bytes::from_owner(received).slice(0..8);
            }
            decoder.decode(&message, |_| Ok(())).expect("decode");
        }
        assert!(
            freed.load(std::sync::atomic::Ordering::SeqCst),
            "the receive buffer is freed while the put still runs"
        );
    }
}
