//! `DoGet` encoding: record batches to FlightData messages within the message-size limit.
//!
//! Batches are split by the bytes a slice really writes ([`crate::arrays`]), halving pieces
//! until each fits; arrow-flight's own splitting measures whole shared buffers instead, which
//! over-splits every slice and cannot see skew in variable-length columns. Dictionaries are sent
//! as dictionaries, never hydrated. Messages stay zero-copy [`IpcMessage`]s until the reply body
//! frames them for gRPC.
//!
//! The size estimate is checked against each encoded message: a record batch message over the
//! limit is split again, and where one row's metadata alone exceeds the limit (a schema of
//! tens of thousands of columns) the read fails with an error that says so, rather than send a
//! message the client's gRPC limit would refuse anyway. `DoPut` refuses such schemas up front
//! ([`one_row_overhead`]), so only data stored under a larger limit can get here.
//!
//! Reading (device-to-host copies, for a device backend), splitting and encoding run on their
//! own task a few messages ahead of the connection task that writes frames to the socket. When
//! the client goes away the receiver is dropped and that task stops at its next send. If that
//! task fails or panics, the client gets the error: a reply stream never just stops short.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Instant;

use arrow::datatypes::{DataType, Schema, SchemaRef};
use arrow::ipc::CompressionType;
use arrow::record_batch::RecordBatch;
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt};
use tokio::sync::mpsc::Sender;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use super::message::{IpcMessage, IpcMessageEncoder};
use crate::flight::message_size::body_budget;

use crate::arrays;
use crate::arrays::batch_bytes;
use crate::error::Error;
use crate::flight::stages::Stages;
use crate::task::panic_message;

/// Encodes a stream of batches as IPC messages, each at most `max_message_bytes` unless a
/// single row (or a dictionary) is larger than that on its own, up to `ahead` messages ahead
/// of the connection; the time each stage takes is added to `stages`.
pub(crate) fn encode(
    batches: BoxStream<'static, Result<RecordBatch, Error>>,
    schema: SchemaRef,
    max_message_bytes: usize,
    compression: Option<CompressionType>,
    ahead: usize,
    stages: Arc<Stages>,
) -> BoxStream<'static, Result<IpcMessage, Status>> {
    let budget = body_budget(&schema, max_message_bytes);
    let (sender, receiver) = tokio::sync::mpsc::channel(ahead.max(1));
    tokio::spawn(async move {
        let limits = Limits {
            budget,
            max_message_bytes,
            compression,
        };
        let produced = AssertUnwindSafe(produce(batches, &schema, limits, &sender, &stages))
            .catch_unwind()
            .await;
        let status = match produced {
            Ok(Ok(())) => return,
            Ok(Err(status)) => status,
            Err(panic) => {
                let reason = panic_message(panic.as_ref());
                tracing::error!(reason = %reason.escape_debug(), "encoding a DoGet reply panicked");
                Status::from(Error::Internal(format!(
                    "encoding the reply panicked: {reason}"
                )))
            }
        };
        let _ = sender.send(Err(status)).await;
    });
    ReceiverStream::new(receiver).boxed()
}

#[derive(Debug, Clone, Copy)]
struct Limits {
    /// Body bytes a record batch is first split to.
    budget: usize,
    /// What each message must fit, metadata included.
    max_message_bytes: usize,
    /// Buffer compression of record batch and dictionary bodies.
    compression: Option<CompressionType>,
}

/// Reads, splits and encodes until the batches end or the receiver is gone.
async fn produce(
    mut batches: BoxStream<'static, Result<RecordBatch, Error>>,
    schema: &SchemaRef,
    limits: Limits,
    sender: &Sender<Result<IpcMessage, Status>>,
    stages: &Stages,
) -> Result<(), Status> {
    let mut encoder = IpcMessageEncoder::new(schema, limits.compression).map_err(encoding_error)?;
    let mut messages = Vec::new();
    let mut first = true;
    let mut started = Instant::now();
    while let Some(batch) = batches.next().await {
        started = Stages::lap(&stages.doget_staging_nanos, started);
        let batch = batch.map_err(Status::from)?;
        for piece in split_to_size(batch, limits.budget) {
            let piece = compact_views(piece)?;
            encode_within(&mut encoder, piece, limits, &mut first, &mut messages)?;
            started = Stages::lap(&stages.doget_encode_nanos, started);
            for message in messages.drain(..) {
                let message = message.padded(limits.max_message_bytes);
                Stages::add(&stages.doget_messages, 1);
                Stages::add(&stages.doget_bytes, message.encoded_len() as u64);
                if sender.send(Ok(message)).await.is_err() {
                    return Ok(()); // the client went away
                }
            }
            started = Stages::lap(&stages.doget_send_wait_nanos, started);
        }
    }
    for message in encoder.finish().map_err(encoding_error)? {
        check_schema_message(&message, limits)?;
        if sender.send(Ok(message)).await.is_err() {
            break;
        }
    }
    Ok(())
}

/// Encodes `piece`, halving it until its record batch message fits the limit. Dictionaries are
/// sent as they are (they cannot be split); the schema and a single row's metadata must fit.
fn encode_within(
    encoder: &mut IpcMessageEncoder,
    piece: RecordBatch,
    limits: Limits,
    first: &mut bool,
    out: &mut Vec<IpcMessage>,
) -> Result<(), Status> {
    let mut messages = encoder.encode(&piece).map_err(encoding_error)?;
    if std::mem::take(first)
        && let Some(schema) = messages.first()
    {
        check_schema_message(schema, limits)?;
    }
    let Some(batch) = messages.pop() else {
        return Ok(());
    };
    out.append(&mut messages);
    if batch.encoded_len() <= limits.max_message_bytes {
        out.push(batch);
        return Ok(());
    }
    let rows = piece.num_rows();
    if rows <= 1 {
        // What the message carries besides the row's values: metadata and buffer padding,
        // which grow with the number of columns and no split can reduce.
        let overhead = (batch.encoded_len() as u64).saturating_sub(batch_bytes(&piece));
        if overhead > limits.max_message_bytes as u64 {
            return Err(Status::from(Error::ReplyTooLarge {
                what: "the metadata and padding of a one-row record batch",
                needed: usize::try_from(overhead).unwrap_or(usize::MAX),
                limit: limits.max_message_bytes,
            }));
        }
        // One row whose values alone exceed the limit: sent as it is, as documented.
        out.push(batch);
        return Ok(());
    }
    let half = rows / 2;
    encode_within(encoder, piece.slice(0, half), limits, first, out)?;
    encode_within(encoder, piece.slice(half, rows - half), limits, first, out)
}

/// A slice of a view column still points at all of its data buffers, and Arrow's IPC writer
/// sends every one of them with each slice: keep only what the slice's views use.
fn compact_views(piece: RecordBatch) -> Result<RecordBatch, Status> {
    let has_views = piece
        .schema()
        .fields()
        .iter()
        .any(|f| matches!(f.data_type(), DataType::Utf8View | DataType::BinaryView));
    if !has_views {
        return Ok(piece);
    }
    let columns = piece
        .columns()
        .iter()
        .map(|column| arrow::array::make_array(arrays::compact_views(column.to_data())))
        .collect();
    RecordBatch::try_new(piece.schema(), columns).map_err(encoding_error)
}

/// Most bytes a one-row record batch message of `schema` can take besides the row's values, as
/// [`encode_within`] measures them (the encoded length less [`batch_bytes`]), whatever the row
/// holds and whichever compression the ticket asks for. When this is within
/// `--max-message-bytes`, every row of the dataset can be sent; `DoPut` refuses a schema for
/// which it is not, since nothing of such a dataset could be read back.
///
/// Counted from the schema alone (a client's schema need not be one Arrow can build arrays
/// of): the metadata holds 16 bytes for each array's field node and each buffer, 8 for each
/// view column's count of data buffers, and a fixed part; each buffer then costs at most 71
/// bytes beyond the bytes `batch_bytes` counts for it (padding to the writer's 64-byte
/// alignment, and an 8-byte prefix when compressed), and an offsets buffer one offset more
/// than Arrow's slice measure counts. Views nested in other types are not compacted before
/// they are sent (see [`compact_views`]) and are not bounded here.
pub(crate) fn one_row_overhead(schema: &Schema) -> u64 {
    /// The `Message` and `RecordBatch` tables, their vtables, the compression table, vector
    /// lengths and alignment, padding to 8 bytes, and the two fields' keys and length
    /// prefixes (varints of at most 5 bytes) in the protobuf `FlightData`.
    const FIXED: u64 = 256;
    const PER_NODE: u64 = 16;
    const PER_BUFFER: u64 = 16 + 63 + 8;
    const PER_VARIADIC_COUNT: u64 = 8;
    /// The offset Arrow's slice measure leaves out (`len` offsets counted, `len + 1` sent).
    const PER_OFFSETS: u64 = 8;
    let mut layout = Layout::default();
    for field in schema.fields() {
        layout.add(field.data_type());
    }
    FIXED
        + layout.nodes * PER_NODE
        + layout.buffers * PER_BUFFER
        + layout.views * PER_VARIADIC_COUNT
        + layout.offsets * PER_OFFSETS
}

/// What a record batch message holds for some columns, at most: field nodes, buffers, view
/// columns and offsets buffers (a dictionary's values travel in a message of their own).
#[derive(Debug, Default)]
struct Layout {
    nodes: u64,
    buffers: u64,
    views: u64,
    offsets: u64,
}

impl Layout {
    fn add(&mut self, data_type: &DataType) {
        self.nodes += 1;
        match data_type {
            DataType::Null => {}
            DataType::Utf8 | DataType::Binary | DataType::LargeUtf8 | DataType::LargeBinary => {
                self.buffers += 3;
                self.offsets += 1;
            }
            // Validity, views, and the one data buffer a compacted row can need.
            DataType::Utf8View | DataType::BinaryView => {
                self.buffers += 3;
                self.views += 1;
            }
            DataType::List(child) | DataType::LargeList(child) | DataType::Map(child, _) => {
                self.buffers += 2;
                self.offsets += 1;
                self.add(child.data_type());
            }
            DataType::ListView(child) | DataType::LargeListView(child) => {
                self.buffers += 3;
                self.add(child.data_type());
            }
            DataType::FixedSizeList(child, _) => {
                self.buffers += 1;
                self.add(child.data_type());
            }
            DataType::Struct(fields) => {
                self.buffers += 1;
                fields.iter().for_each(|f| self.add(f.data_type()));
            }
            // A validity buffer only in the legacy format, type ids, offsets when dense.
            DataType::Union(fields, _) => {
                self.buffers += 3;
                fields.iter().for_each(|(_, f)| self.add(f.data_type()));
            }
            DataType::RunEndEncoded(ends, values) => {
                self.add(ends.data_type());
                self.add(values.data_type());
            }
            // Primitives, booleans, fixed-size binary, dictionary keys: validity and values.
            _ => self.buffers += 2,
        }
    }
}

fn check_schema_message(message: &IpcMessage, limits: Limits) -> Result<(), Status> {
    if message.encoded_len() > limits.max_message_bytes {
        return Err(Status::from(Error::ReplyTooLarge {
            what: "the schema",
            needed: message.encoded_len(),
            limit: limits.max_message_bytes,
        }));
    }
    Ok(())
}

fn encoding_error(error: arrow::error::ArrowError) -> Status {
    Status::from(Error::Internal(format!("encoding DoGet reply: {error}")))
}

/// Splits `batch` into row slices of at most `budget` bytes each (a single row may exceed it).
pub(crate) fn split_to_size(batch: RecordBatch, budget: usize) -> Vec<RecordBatch> {
    let mut pieces = Vec::new();
    split_into(batch, budget as u64, &mut pieces);
    pieces
}

fn split_into(batch: RecordBatch, budget: u64, out: &mut Vec<RecordBatch>) {
    let bytes = batch_bytes(&batch);
    let rows = batch.num_rows();
    if bytes <= budget || rows <= 1 {
        out.push(batch);
        return;
    }
    let parts = bytes.div_ceil(budget.max(1)).clamp(2, rows as u64) as usize;
    let rows_per_part = rows.div_ceil(parts);
    let mut offset = 0;
    while offset < rows {
        let len = rows_per_part.min(rows - offset);
        split_into(batch.slice(offset, len), budget, out);
        offset += len;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{ArrayRef, Int64Array, StringArray};
    use arrow::datatypes::Field;

    use super::*;

    #[test]
    fn skewed_strings_are_split_until_every_piece_fits() {
        // Ten thousand tiny strings followed by ten large ones: even splitting by rows would
        // put all the large ones in one piece.
        let values: Vec<String> = (0..10_000)
            .map(|_| "x".to_owned())
            .chain((0..10).map(|_| "y".repeat(100_000)))
            .collect();
        let column: ArrayRef = Arc::new(StringArray::from(values));
        let ids: ArrayRef = Arc::new(Int64Array::from_iter_values(0..10_010));
        let batch = RecordBatch::try_from_iter([("s", column), ("id", ids)]).expect("batch");
        let budget = 250_000;
        let pieces = split_to_size(batch.clone(), budget);
        assert!(pieces.iter().all(|p| batch_bytes(p) <= budget as u64));
        assert_eq!(pieces.iter().map(|p| p.num_rows()).sum::<usize>(), 10_010);
        let rejoined = arrow::compute::concat_batches(&batch.schema(), &pieces).expect("concat");
        assert_eq!(rejoined, batch);
    }

    /// Rows of every layout, with nulls, empty and long values, and values of every length
    /// modulo the 64-byte padding.
    fn varied_batch(rows: usize) -> RecordBatch {
        use arrow::array::*;
        use arrow::datatypes::{Int8Type, Int32Type};
        let text = |r: usize| (r % 7 != 3).then(|| "é".repeat(r * 5 % 97));
        let strings = StringArray::from_iter((0..rows).map(text));
        let large = LargeBinaryArray::from_iter((0..rows).map(|r| text(r).map(String::into_bytes)));
        let views = StringViewArray::from_iter((0..rows).map(text));
        let lists = ListArray::from_iter_primitive::<Int32Type, _, _>((0..rows).map(|r| {
            (r % 5 != 2).then(|| (0..r * 3 % 41).map(|v| (v % 4 != 1).then_some(v as i32)))
        }));
        let fixed = FixedSizeListArray::from_iter_primitive::<Int32Type, _, _>(
            (0..rows).map(|r| (r % 6 != 0).then(|| vec![Some(r as i32); 5])),
            5,
        );
        let nested = StructArray::from(vec![
            (
                Arc::new(Field::new("i", DataType::Int64, true)),
                Arc::new(Int64Array::from_iter(
                    (0..rows).map(|r| (r % 3 != 0).then_some(r as i64)),
                )) as ArrayRef,
            ),
            (
                Arc::new(Field::new("s", DataType::Utf8, true)),
                Arc::new(StringArray::from_iter((0..rows).map(text))) as ArrayRef,
            ),
        ]);
        let dictionary: DictionaryArray<Int8Type> =
            (0..rows).map(|r| ["a", "bb", "ccc"][r % 3]).collect();
        let decimals = Decimal256Array::from_iter_values(
            (0..rows).map(|r| arrow::datatypes::i256::from_i128(r as i128)),
        );
        let binary = FixedSizeBinaryArray::try_from_sparse_iter_with_size(
            (0..rows).map(|r| (r % 4 != 0).then_some([r as u8; 3])),
            3,
        )
        .expect("fixed-size binary");
        let flags = BooleanArray::from_iter((0..rows).map(|r| (r % 9 != 0).then_some(r % 2 == 0)));
        let union = {
            let fields = arrow::datatypes::UnionFields::try_new(
                [0, 1],
                [
                    Field::new("n", DataType::Int64, true),
                    Field::new("s", DataType::Utf8, true),
                ],
            )
            .expect("fields");
            let ids: Vec<i8> = (0..rows).map(|r| (r % 2) as i8).collect();
            let offsets: Vec<i32> = (0..rows).map(|r| (r / 2) as i32).collect();
            let half = rows.div_ceil(2);
            let children: Vec<ArrayRef> = vec![
                Arc::new(Int64Array::from_iter_values(0..half as i64)),
                Arc::new(StringArray::from_iter((0..half).map(text))),
            ];
            UnionArray::try_new(fields, ids.into(), Some(offsets.into()), children)
                .expect("dense union")
        };
        let ends: Vec<i32> = (3..rows as i32).step_by(3).chain([rows as i32]).collect();
        let runs = RunArray::<Int32Type>::try_new(
            &Int32Array::from(ends.clone()),
            &StringArray::from_iter((0..ends.len()).map(text)),
        )
        .expect("run ends");
        let map = {
            let mut builder = MapBuilder::new(None, StringBuilder::new(), Int32Builder::new());
            for r in 0..rows {
                for k in 0..r % 4 {
                    builder.keys().append_value(format!("k{k}"));
                    builder.values().append_option((k != 1).then_some(k as i32));
                }
                builder.append(r % 5 != 1).expect("map entry");
            }
            builder.finish()
        };
        let columns: Vec<(&str, ArrayRef)> = vec![
            ("strings", Arc::new(strings)),
            ("large binary", Arc::new(large)),
            ("views", Arc::new(views)),
            ("lists", Arc::new(lists)),
            ("fixed lists", Arc::new(fixed)),
            ("struct", Arc::new(nested)),
            ("dictionary", Arc::new(dictionary)),
            ("decimals", Arc::new(decimals)),
            ("fixed binary", Arc::new(binary)),
            ("flags", Arc::new(flags)),
            ("nulls", Arc::new(NullArray::new(rows))),
            (
                "i64",
                Arc::new(Int64Array::from_iter_values(0..rows as i64)),
            ),
            ("union", Arc::new(union)),
            ("runs", Arc::new(runs)),
            ("map", Arc::new(map)),
        ];
        RecordBatch::try_from_iter(columns).expect("batch")
    }

    #[test]
    fn one_row_messages_keep_within_the_bound_put_checks() {
        let narrow = varied_batch(64);
        // The same columns 40 times over: the metadata then weighs as much as the padding.
        let some = varied_batch(12);
        let wide = RecordBatch::try_from_iter((0..40).flat_map(|copy| {
            let some = some.clone();
            (0..some.num_columns()).map(move |c| {
                let name = format!("{}{copy}", some.schema().field(c).name());
                (name, Arc::clone(some.column(c)))
            })
        }))
        .expect("wide batch");
        for batch in [narrow, wide] {
            within_bound(&batch);
        }
    }

    #[test]
    fn the_bound_is_close_for_fixed_width_columns() {
        // A null row of 100 int64 columns: a validity and a values buffer each, both padded.
        let column: ArrayRef = Arc::new(Int64Array::from(vec![Some(1), None]));
        let batch =
            RecordBatch::try_from_iter((0..100).map(|c| (format!("c{c}"), Arc::clone(&column))))
                .expect("batch");
        let bound = one_row_overhead(&batch.schema()) as i64;
        let largest = within_bound(&batch);
        assert!(
            largest > bound * 85 / 100,
            "a bound of {bound} for at most {largest}"
        );
    }

    /// The largest overhead of a one-row message of `batch`, checked against the bound.
    fn within_bound(batch: &RecordBatch) -> i64 {
        let schema = batch.schema();
        let bound = one_row_overhead(&schema);
        let mut largest = 0;
        for compression in [
            None,
            Some(CompressionType::LZ4_FRAME),
            Some(CompressionType::ZSTD),
        ] {
            for row in 0..batch.num_rows() {
                // As `produce` sends a one-row piece: views compacted, then encoded.
                let piece = compact_views(batch.slice(row, 1)).expect("compact");
                let mut encoder = IpcMessageEncoder::new(&schema, compression).expect("encoder");
                let message = encoder
                    .encode(&piece)
                    .expect("encode")
                    .pop()
                    .expect("batch");
                let overhead = message.encoded_len() as i64 - batch_bytes(&piece) as i64;
                assert!(
                    overhead <= bound as i64,
                    "row {row}, {compression:?}: {overhead} bytes over a bound of {bound}"
                );
                largest = largest.max(overhead);
            }
        }
        largest
    }

    #[test]
    fn a_row_larger_than_the_budget_is_sent_alone() {
        let column: ArrayRef = Arc::new(StringArray::from(vec!["z".repeat(1000); 3]));
        let batch = RecordBatch::try_from_iter([("s", column)]).expect("batch");
        let pieces = split_to_size(batch, 100);
        assert_eq!(pieces.len(), 3);
    }
}
