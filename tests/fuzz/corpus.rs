//! The corpus of valid DoPut streams every mutation starts from.

use std::sync::Arc;

use arrow::array::*;
use arrow::buffer::{NullBuffer, ScalarBuffer};
use arrow::datatypes::*;
use arrow::ipc::CompressionType;
use arrow::ipc::writer::IpcWriteOptions;
use arrow::record_batch::{RecordBatch, RecordBatchOptions};
use arrow_flight::encode::{DictionaryHandling, FlightDataEncoderBuilder};
use arrow_flight::{FlightData, FlightDescriptor};
use bytes::Bytes;
use futures::TryStreamExt;
use prost::Message;

use crate::common::{all_types_batch, int64_batch, string_batch};

/// The dataset every put case writes (the catalog is emptied between cases).
pub(crate) const NAME: &str = "fuzz";

/// A valid put: the batches, and FlightData messages arrow-flight encodes for them (no
/// descriptor yet: each case attaches its own).
#[derive(Debug, Clone)]
pub(crate) struct Stream {
    pub(crate) label: &'static str,
    pub(crate) schema: SchemaRef,
    pub(crate) batches: Vec<RecordBatch>,
    pub(crate) messages: Vec<FlightData>,
    /// Whether the server must accept it unmutated (the others use types it may refuse).
    pub(crate) supported: bool,
}

impl Stream {
    pub(crate) fn rows(&self) -> usize {
        self.batches.iter().map(RecordBatch::num_rows).sum()
    }

    /// The stream as sent under `descriptor`, unmutated: the descriptor rides on the first
    /// message, or alone when the stream has none.
    pub(crate) fn encoded_with(&self, descriptor: FlightDescriptor) -> Vec<Bytes> {
        let mut messages = self.messages.clone();
        match messages.first_mut() {
            Some(first) => first.flight_descriptor = Some(descriptor),
            None => messages.push(FlightData::new().with_descriptor(descriptor)),
        }
        messages
            .iter()
            .map(|m| Bytes::from(m.encode_to_vec()))
            .collect()
    }
}

async fn stream(
    label: &'static str,
    schema: SchemaRef,
    batches: Vec<RecordBatch>,
    supported: bool,
) -> Stream {
    compressed_stream(label, schema, batches, supported, None).await
}

/// A stream whose bodies are compressed with `codec` (each buffer prefixed with the length it
/// decompresses to: numbers the mutations get to rewrite).
async fn compressed_stream(
    label: &'static str,
    schema: SchemaRef,
    batches: Vec<RecordBatch>,
    supported: bool,
    codec: Option<CompressionType>,
) -> Stream {
    let options = IpcWriteOptions::default()
        .try_with_compression(codec)
        .unwrap_or_else(|e| panic!("compression for corpus stream {label}: {e}"));
    let messages = FlightDataEncoderBuilder::new()
        .with_options(options)
        .with_schema(Arc::clone(&schema))
        .with_dictionary_handling(DictionaryHandling::Resend)
        .build(futures::stream::iter(batches.clone().into_iter().map(Ok)))
        .try_collect()
        .await
        .unwrap_or_else(|e| panic!("encoding corpus stream {label}: {e}"));
    Stream {
        label,
        schema,
        batches,
        messages,
        supported,
    }
}

pub(crate) async fn put_corpus() -> Vec<Stream> {
    let first = |batches: &[RecordBatch]| batches[0].schema();
    let mut corpus = Vec::new();
    let sets: Vec<(&'static str, Vec<RecordBatch>, bool)> = vec![
        (
            "int64-nulls",
            vec![int64_batch(50, 3, 0), int64_batch(13, 3, 500)],
            true,
        ),
        (
            "strings",
            vec![string_batch(40, 0), string_batch(25, 40)],
            true,
        ),
        ("all-types", vec![all_types_batch(12)], true),
        ("lists", vec![lists_batch(30, 0), lists_batch(9, 1)], true),
        ("structs", vec![struct_batch(33)], true),
        (
            "dictionaries",
            vec![
                dictionary_batch(20, 0),
                dictionary_batch(15, 1),
                dictionary_batch(7, 2),
            ],
            true,
        ),
        ("decimals", vec![decimal_batch(25)], true),
        (
            "null-column",
            vec![null_column_batch(30), null_column_batch(4)],
            true,
        ),
        (
            "only-null",
            vec![only_null_batch(17), only_null_batch(3)],
            true,
        ),
        ("fixed-size", vec![fixed_size_batch(21)], true),
        ("multi-batch", multi_batches(), true),
        // Bodies large enough for a block of pinned memory (at least 256 KiB, buffers of 64 KiB
        // on average): received into one where the backend has them (`blocks`).
        (
            "int64-large",
            vec![int64_batch(12_000, 3, 0), int64_batch(16_000, 3, 12_000)],
            true,
        ),
        ("strings-large", vec![string_batch(9_000, 0)], true),
        ("views", vec![views_batch(19)], false),
        ("union", vec![union_batch(16)], false),
        ("run-end", vec![run_end_batch()], false),
    ];
    for (label, batches, supported) in sets {
        let schema = first(&batches);
        corpus.push(stream(label, schema, batches, supported).await);
    }
    corpus.push(
        stream(
            "zero-columns",
            Arc::new(Schema::empty()),
            vec![zero_column_batch(5), zero_column_batch(3)],
            true,
        )
        .await,
    );
    corpus.push(stream("schema-only", int64_batch(1, 2, 0).schema(), vec![], true).await);
    let compressed: [(&'static str, Vec<RecordBatch>, CompressionType); 3] = [
        (
            "int64-lz4",
            vec![int64_batch(60, 3, 0), int64_batch(20, 3, 60)],
            CompressionType::LZ4_FRAME,
        ),
        (
            "strings-zstd",
            vec![string_batch(40, 0), string_batch(25, 40)],
            CompressionType::ZSTD,
        ),
        (
            "dictionaries-lz4",
            vec![dictionary_batch(20, 0), dictionary_batch(15, 1)],
            CompressionType::LZ4_FRAME,
        ),
    ];
    for (label, batches, codec) in compressed {
        let schema = first(&batches);
        corpus.push(compressed_stream(label, schema, batches, true, Some(codec)).await);
    }
    corpus
}

pub(crate) fn lists_batch(rows: usize, seed: usize) -> RecordBatch {
    let mut nested = ListBuilder::new(ListBuilder::new(StringBuilder::new()));
    for r in 0..rows {
        if (r + seed) % 6 == 5 {
            nested.append_null();
            continue;
        }
        for i in 0..(r % 3) {
            let inner = nested.values();
            for j in 0..((r + i) % 4) {
                if (r + j) % 5 == 0 {
                    inner.values().append_null();
                } else {
                    inner.values().append_value(format!("v{r}.{i}.{j}"));
                }
            }
            inner.append(true);
        }
        nested.append(true);
    }
    let large = LargeListArray::from_iter_primitive::<Int64Type, _, _>(
        (0..rows)
            .map(|r| (r % 4 != 1).then(|| (0..r % 5).map(|v| Some(v as i64)).collect::<Vec<_>>())),
    );
    RecordBatch::try_from_iter([
        ("nested", Arc::new(nested.finish()) as ArrayRef),
        ("large", Arc::new(large)),
    ])
    .expect("lists batch")
}

fn struct_batch(rows: usize) -> RecordBatch {
    let inner = StructArray::new(
        Fields::from(vec![
            Field::new("c", DataType::Utf8, true),
            Field::new("d", DataType::Float64, true),
        ]),
        vec![
            Arc::new(StringArray::from_iter(
                (0..rows).map(|r| (r % 3 != 0).then(|| format!("c{r}"))),
            )) as ArrayRef,
            Arc::new(Float64Array::from_iter_values(
                (0..rows).map(|r| r as f64 / 3.0),
            )),
        ],
        Some(NullBuffer::from_iter((0..rows).map(|r| r % 4 != 2))),
    );
    let outer = StructArray::new(
        Fields::from(vec![
            Field::new("a", DataType::Int32, false),
            Field::new("b", inner.data_type().clone(), true),
        ]),
        vec![
            Arc::new(Int32Array::from_iter_values(0..rows as i32)) as ArrayRef,
            Arc::new(inner),
        ],
        Some(NullBuffer::from_iter((0..rows).map(|r| r % 7 != 6))),
    );
    RecordBatch::try_from_iter([("s", Arc::new(outer) as ArrayRef)]).expect("struct batch")
}

/// Each call has its own dictionary, so a multi-batch stream resends and the server merges.
pub(crate) fn dictionary_batch(rows: usize, seed: usize) -> RecordBatch {
    let words: Vec<Option<String>> = (0..rows)
        .map(|r| (r % 5 != 4).then(|| format!("w{}", (r * 7 + seed) % (3 + seed))))
        .collect();
    let words: DictionaryArray<Int32Type> = words.iter().map(Option::as_deref).collect();
    let keys = Int8Array::from_iter((0..rows).map(|r| (r % 6 != 1).then_some((r % 3) as i8)));
    let values = Int64Array::from_iter_values([seed as i64, -1, i64::MAX]);
    let numbers =
        DictionaryArray::<Int8Type>::try_new(keys, Arc::new(values)).expect("int8 dictionary");
    RecordBatch::try_from_iter([
        ("words", Arc::new(words) as ArrayRef),
        ("numbers", Arc::new(numbers)),
    ])
    .expect("dictionary batch")
}

fn decimal_batch(rows: usize) -> RecordBatch {
    let wide = Decimal128Array::from_iter(
        (0..rows).map(|r| (r % 4 != 0).then_some((r as i128 - 10) * 123_456_789_012_345)),
    )
    .with_precision_and_scale(38, 10)
    .expect("decimal128(38, 10)");
    let narrow = Decimal128Array::from_iter_values(
        (0..rows).map(|r| (r as i128 * 4_999) % 100_000 - 50_000),
    )
    .with_precision_and_scale(5, 2)
    .expect("decimal128(5, 2)");
    let huge = Decimal256Array::from_iter(
        (0..rows).map(|r| (r % 3 != 1).then(|| i256::from_i128(r as i128 * 10_i128.pow(30)))),
    )
    .with_precision_and_scale(76, 0)
    .expect("decimal256(76, 0)");
    RecordBatch::try_from_iter([
        ("wide", Arc::new(wide) as ArrayRef),
        ("narrow", Arc::new(narrow)),
        ("huge", Arc::new(huge)),
    ])
    .expect("decimal batch")
}

pub(crate) fn null_column_batch(rows: usize) -> RecordBatch {
    RecordBatch::try_from_iter([
        ("nothing", Arc::new(NullArray::new(rows)) as ArrayRef),
        ("x", Arc::new(Int32Array::from_iter_values(0..rows as i32))),
    ])
    .expect("null column batch")
}

fn only_null_batch(rows: usize) -> RecordBatch {
    RecordBatch::try_from_iter([("nothing", Arc::new(NullArray::new(rows)) as ArrayRef)])
        .expect("only-null batch")
}

pub(crate) fn zero_column_batch(rows: usize) -> RecordBatch {
    RecordBatch::try_new_with_options(
        Arc::new(Schema::empty()),
        vec![],
        &RecordBatchOptions::new().with_row_count(Some(rows)),
    )
    .expect("zero-column batch")
}

fn fixed_size_batch(rows: usize) -> RecordBatch {
    let lists = FixedSizeListArray::from_iter_primitive::<Float32Type, _, _>(
        (0..rows)
            .map(|r| (r % 5 != 2).then(|| vec![Some(r as f32), (r % 2 == 0).then_some(0.5), None])),
        3,
    );
    let binary = FixedSizeBinaryArray::try_from_sparse_iter_with_size(
        (0..rows).map(|r| (r % 4 != 3).then_some([r as u8; 5])),
        5,
    )
    .expect("fixed-size binary");
    RecordBatch::try_from_iter([
        ("lists", Arc::new(lists) as ArrayRef),
        ("binary", Arc::new(binary)),
    ])
    .expect("fixed-size batch")
}

/// Slices, a zero-row batch between them, and a different chunking each time.
fn multi_batches() -> Vec<RecordBatch> {
    let whole = int64_batch(100, 2, 0);
    vec![
        whole.slice(0, 10),
        whole.slice(10, 0),
        whole.slice(10, 50),
        whole.slice(60, 40),
        int64_batch(1, 2, 7),
    ]
}

fn views_batch(rows: usize) -> RecordBatch {
    let strings = StringViewArray::from_iter(
        (0..rows).map(|r| (r % 4 != 0).then(|| "long enough to leave the view ".repeat(r % 3))),
    );
    let binary = BinaryViewArray::from_iter((0..rows).map(|r| Some(vec![r as u8; r])));
    RecordBatch::try_from_iter([
        ("strings", Arc::new(strings) as ArrayRef),
        ("binary", Arc::new(binary)),
    ])
    .expect("views batch")
}

fn union_batch(rows: usize) -> RecordBatch {
    let fields = UnionFields::try_new(
        [0_i8, 1],
        [
            Field::new("i", DataType::Int32, true),
            Field::new("s", DataType::Utf8, true),
        ],
    )
    .expect("union fields");
    let type_ids: ScalarBuffer<i8> = (0..rows).map(|r| (r % 2) as i8).collect();
    let union = UnionArray::try_new(
        fields,
        type_ids,
        None,
        vec![
            Arc::new(Int32Array::from_iter_values(0..rows as i32)) as ArrayRef,
            Arc::new(StringArray::from_iter_values(
                (0..rows).map(|r| format!("u{r}")),
            )),
        ],
    )
    .expect("sparse union");
    RecordBatch::try_from_iter([("u", Arc::new(union) as ArrayRef)]).expect("union batch")
}

fn run_end_batch() -> RecordBatch {
    let run_ends = Int32Array::from(vec![4, 9, 15, 20]);
    let values = Int64Array::from(vec![Some(1), None, Some(3), Some(i64::MIN)]);
    let runs = RunArray::<Int32Type>::try_new(&run_ends, &values).expect("run array");
    RecordBatch::try_from_iter([("runs", Arc::new(runs) as ArrayRef)]).expect("run-end batch")
}
