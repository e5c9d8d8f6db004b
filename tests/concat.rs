//! Concatenation of many uploaded batches into compact columns, over random fragment counts
//! and sizes (empty fragments and single rows included), random null patterns, sliced inputs,
//! strings, lists, structs and dictionaries (shared, overlapping and disjoint).
//!
//! The host backend's concatenation is the reference: it is checked against Arrow's own
//! `concat_batches` (equal arrays; for dictionary columns equal values, with every dictionary
//! value once), and the backend under test is checked against it byte for byte, values under
//! nulls included. The CUDA instantiation poisons every output first, so a byte the kernel
//! fails to write shows.

use std::sync::Arc;

use arrow::array::*;
use arrow::buffer::{BooleanBuffer, OffsetBuffer};
use arrow::datatypes::*;
use arrow::record_batch::RecordBatch;
use gpu_flight::backend::{Backend, CudaBackend, HostBackend, Partition};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn host() -> Arc<dyn Backend> {
    Arc::new(HostBackend::new())
}

fn cuda() -> Arc<dyn Backend> {
    Arc::new(
        CudaBackend::open(0)
            .expect("CUDA device 0")
            .with_poisoned_outputs(),
    )
}

#[tokio::test]
async fn host_concatenation_matches_arrow() {
    random_rounds(host(), 7, 20).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA device"]
async fn cuda_concatenation_matches_the_host_reference() {
    random_rounds(cuda(), 11, 60).await;
}

async fn random_rounds(backend: Arc<dyn Backend>, seed: u64, rounds: usize) {
    let host = host();
    let mut rng = StdRng::seed_from_u64(seed);
    for round in 0..rounds {
        let fragments = rng.random_range(1..=60);
        let shared = random_dictionary(&mut rng);
        let inputs: Vec<RecordBatch> = (0..fragments)
            .map(|_| random_fragment(&mut rng, &shared))
            .collect();
        let got = concatenate(&backend, &inputs).await;
        let reference = concatenate(&host, &inputs).await;
        let arrow =
            arrow::compute::concat_batches(&inputs[0].schema(), &inputs).expect("arrow reference");
        assert_eq!(reference.num_rows(), arrow.num_rows(), "round {round}");
        assert_eq!(got.num_rows(), arrow.num_rows(), "round {round}");
        for (index, field) in arrow.schema().fields().iter().enumerate() {
            let context = format!("round {round}, column {}", field.name());
            let (g, r, a) = (
                got.column(index),
                reference.column(index),
                arrow.column(index),
            );
            if let DataType::Dictionary(_, value_type) = field.data_type() {
                let values = |array: &ArrayRef| {
                    arrow::compute::cast(array, value_type).expect("dictionary values")
                };
                assert_eq!(&values(r), &values(a), "{context}: values");
                assert_unique_dictionary(r, &context);
            } else {
                assert_eq!(r, a, "{context}");
            }
            assert_same_bytes(&compacted(g), &compacted(r), &context);
        }
        assert_eq!(got, reference, "round {round}");
    }
}

async fn concatenate(backend: &Arc<dyn Backend>, inputs: &[RecordBatch]) -> RecordBatch {
    let mut partitions: Vec<Arc<dyn Partition>> = Vec::new();
    for input in inputs {
        partitions.push(backend.upload(0, input.clone()).await.expect("upload"));
    }
    let compact = backend.compact(partitions).await.expect("concatenate");
    let rows = compact.num_rows();
    compact.read(0, rows, None).await.expect("read back")
}

fn assert_unique_dictionary(array: &ArrayRef, context: &str) {
    let dictionary = array.as_any_dictionary().values();
    let rendered: Vec<String> = (0..dictionary.len())
        .map(|i| {
            arrow::util::display::ArrayFormatter::try_new(dictionary.as_ref(), &Default::default())
                .expect("formatter")
                .value(i)
                .to_string()
        })
        .collect();
    let mut unique = rendered.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(
        unique.len(),
        rendered.len(),
        "{context}: dictionary {rendered:?}"
    );
}

/// A dictionary of up to 12 strings drawn from 30, in random order.
fn random_dictionary(rng: &mut StdRng) -> ArrayRef {
    let size = rng.random_range(1..=12);
    let mut pool: Vec<usize> = (0..30).collect();
    let picked: Vec<String> = (0..size)
        .map(|_| format!("v{}", pool.swap_remove(rng.random_range(0..pool.len()))))
        .collect();
    Arc::new(StringArray::from(picked))
}

/// A batch of every supported kind of column, of 0, 1, up to 3000, 20,000 or 70,000 rows, possibly a slice
/// starting at an odd row (so bitmaps start mid-byte).
fn random_fragment(rng: &mut StdRng, shared_dictionary: &ArrayRef) -> RecordBatch {
    let rows = match rng.random_range(0..20) {
        0 | 1 => 0,
        2 | 3 => 1,
        // Large enough that whole kernel tiles (32 KiB) fall inside one fragment's values.
        4 => rng.random_range(5_000..20_000),
        // And larger, so that whole tiles (2,048 units) of offsets, 2-byte keys and more lie
        // inside one fragment.
        5 => rng.random_range(35_000..70_000),
        _ => rng.random_range(2..3000),
    };
    let slice_start = if rng.random_bool(0.3) {
        rng.random_range(1..8)
    } else {
        0
    };
    let total = rows + slice_start;
    let density = [0.0, 0.1, 0.5, 1.0][rng.random_range(0..4)];
    let valid = |rng: &mut StdRng| !rng.random_bool(density);
    let mut seeds: Vec<u64> = (0..total).map(|_| rng.random()).collect();
    seeds.iter_mut().for_each(|s| *s %= 1_000_000);
    let v: Vec<bool> = (0..total).map(|_| valid(rng)).collect();
    let opt = |i: usize| v[i];
    let int64: ArrayRef = Arc::new(Int64Array::from_iter(
        (0..total).map(|i| opt(i).then_some(seeds[i] as i64 - 500_000)),
    ));
    let int8: ArrayRef = Arc::new(Int8Array::from_iter(
        (0..total).map(|i| opt(i).then_some(seeds[i] as i8)),
    ));
    let float: ArrayRef = Arc::new(Float64Array::from_iter_values(
        (0..total).map(|i| seeds[i] as f64 / 7.0),
    ));
    let boolean: ArrayRef = Arc::new(BooleanArray::from_iter(
        (0..total).map(|i| opt(i).then_some(seeds[i].is_multiple_of(3))),
    ));
    let utf8: ArrayRef = Arc::new(StringArray::from_iter(
        (0..total).map(|i| opt(i).then(|| "ab".repeat((seeds[i] % 9) as usize))),
    ));
    let large_binary: ArrayRef = Arc::new(LargeBinaryArray::from_iter_values(
        (0..total).map(|i| vec![seeds[i] as u8; (seeds[i] % 5) as usize]),
    ));
    let list: ArrayRef = Arc::new(ListArray::from_iter_primitive::<Int32Type, _, _>(
        (0..total).map(|i| {
            opt(i).then(|| {
                (0..seeds[i] % 4)
                    .map(|k| (k % 3 != 1).then_some(k as i32))
                    .collect::<Vec<_>>()
            })
        }),
    ));
    let nested_strings = StringArray::from_iter_values((0..total * 2).map(|k| format!("n{k}")));
    let large_list: ArrayRef = Arc::new(LargeListArray::new(
        Arc::new(Field::new("item", DataType::Utf8, true)),
        OffsetBuffer::<i64>::from_lengths(std::iter::repeat_n(2, total)),
        Arc::new(nested_strings),
        None,
    ));
    let structs: ArrayRef = Arc::new(StructArray::new(
        Fields::from(vec![
            Field::new("a", DataType::Int16, true),
            Field::new("b", DataType::Utf8, true),
        ]),
        vec![
            Arc::new(Int16Array::from_iter(
                (0..total).map(|i| seeds[i].is_multiple_of(2).then_some(seeds[i] as i16)),
            )) as ArrayRef,
            Arc::new(StringArray::from_iter_values(
                (0..total).map(|i| i.to_string()),
            )),
        ],
        Some(v.iter().copied().collect()),
    ));
    let fixed_list: ArrayRef = Arc::new(
        FixedSizeListArray::from_iter_primitive::<Float32Type, _, _>(
            (0..total).map(|i| opt(i).then(|| vec![Some(i as f32), None, Some(seeds[i] as f32)])),
            3,
        ),
    );
    let decimal: ArrayRef = Arc::new(
        Decimal128Array::from_iter(
            (0..total).map(|i| opt(i).then_some(seeds[i] as i128 * 1_000_000_007)),
        )
        .with_precision_and_scale(30, 2)
        .expect("decimal"),
    );
    let fixed_binary: ArrayRef = Arc::new(
        FixedSizeBinaryArray::try_from_sparse_iter_with_size(
            (0..total).map(|i| opt(i).then_some([seeds[i] as u8; 5])),
            5,
        )
        .expect("fixed binary"),
    );
    // Half the fragments share the round's dictionary, as one writer's batches do; the others
    // bring their own, overlapping it or not.
    let dictionary = if rng.random_bool(0.5) {
        Arc::clone(shared_dictionary)
    } else {
        random_dictionary(rng)
    };
    let entries = dictionary.len() as u64;
    let categories: ArrayRef = Arc::new(
        DictionaryArray::<Int16Type>::try_new(
            Int16Array::from_iter(
                (0..total).map(|i| opt(i).then_some((seeds[i] % entries) as i16)),
            ),
            Arc::clone(&dictionary),
        )
        .expect("dictionary"),
    );
    // 4-byte keys, which the kernel remaps a whole tile at a time.
    let codes: ArrayRef = Arc::new(
        DictionaryArray::<Int32Type>::try_new(
            Int32Array::from_iter(
                (0..total).map(|i| opt(i).then_some(((seeds[i] / 7) % entries) as i32)),
            ),
            dictionary,
        )
        .expect("dictionary"),
    );
    let small_codes: ArrayRef = Arc::new(
        DictionaryArray::<UInt8Type>::try_new(
            UInt8Array::from_iter_values((0..total).map(|i| (seeds[i] % 3) as u8)),
            Arc::new(Int32Array::from(vec![7, (seeds.len() % 5) as i32, -1])),
        )
        .expect("dictionary"),
    );
    let batch = RecordBatch::try_from_iter_with_nullable([
        ("int64", int64, true),
        ("int8", int8, true),
        ("float", float, true),
        ("boolean", boolean, true),
        ("utf8", utf8, true),
        ("large_binary", large_binary, true),
        ("list", list, true),
        ("large_list", large_list, true),
        ("struct", structs, true),
        ("fixed_list", fixed_list, true),
        ("decimal", decimal, true),
        ("fixed_binary", fixed_binary, true),
        ("categories", categories, true),
        ("codes", codes, true),
        ("small_codes", small_codes, false),
    ])
    .expect("batch");
    batch.slice(slice_start, rows)
}

/// A compact copy (offset 0, offsets from 0, children exactly as referenced) that keeps the
/// values under nulls, so two arrays can be compared buffer by buffer.
fn compacted(array: &ArrayRef) -> ArrayData {
    let data = array.to_data();
    let mut copy = MutableArrayData::new(vec![&data], false, data.len());
    copy.try_extend(0, 0, data.len()).expect("copy");
    copy.freeze()
}

/// Compares the meaningful bytes of two compact arrays: validity bits, values (under nulls
/// too), offsets, string bytes, children.
fn assert_same_bytes(got: &ArrayData, expected: &ArrayData, context: &str) {
    assert_eq!(got.data_type(), expected.data_type(), "{context}");
    let len = expected.len();
    assert_eq!(got.len(), len, "{context}: length");
    let bits = |data: &ArrayData| data.nulls().map(|n| n.iter().collect::<Vec<bool>>());
    assert_eq!(bits(got), bits(expected), "{context}: validity");
    let prefix = |data: &ArrayData, buffer: usize, bytes: usize| {
        data.buffers()[buffer].as_slice()[..bytes].to_vec()
    };
    match expected.data_type() {
        DataType::Boolean => {
            let values = |d: &ArrayData| {
                BooleanBuffer::new(d.buffers()[0].clone(), 0, len)
                    .iter()
                    .collect::<Vec<_>>()
            };
            assert_eq!(values(got), values(expected), "{context}: booleans");
        }
        DataType::Utf8
        | DataType::LargeUtf8
        | DataType::Binary
        | DataType::LargeBinary
        | DataType::List(_)
        | DataType::LargeList(_) => {
            let width = match expected.data_type() {
                DataType::Utf8 | DataType::Binary | DataType::List(_) => 4,
                _ => 8,
            };
            assert_eq!(
                prefix(got, 0, (len + 1) * width),
                prefix(expected, 0, (len + 1) * width),
                "{context}: offsets"
            );
            if let DataType::List(_) | DataType::LargeList(_) = expected.data_type() {
                assert_same_bytes(
                    &got.child_data()[0],
                    &expected.child_data()[0],
                    &format!("{context}.item"),
                );
            } else {
                let end = expected.buffers()[1].len().min(got.buffers()[1].len());
                let used = if width == 4 {
                    expected.buffer::<i32>(0)[len] as usize
                } else {
                    expected.buffer::<i64>(0)[len] as usize
                };
                assert!(end >= used, "{context}: value bytes present");
                assert_eq!(
                    prefix(got, 1, used),
                    prefix(expected, 1, used),
                    "{context}: value bytes"
                );
            }
        }
        DataType::Dictionary(key, _) => {
            let width = key.primitive_width().expect("key width");
            assert_eq!(
                prefix(got, 0, len * width),
                prefix(expected, 0, len * width),
                "{context}: keys"
            );
            assert_same_bytes(
                &got.child_data()[0],
                &expected.child_data()[0],
                &format!("{context}.dictionary"),
            );
        }
        DataType::Struct(_) | DataType::FixedSizeList(_, _) => {
            for (index, (g, e)) in got
                .child_data()
                .iter()
                .zip(expected.child_data())
                .enumerate()
            {
                assert_same_bytes(g, e, &format!("{context}.{index}"));
            }
        }
        other => {
            let width = other.primitive_width().unwrap_or_else(|| match other {
                DataType::FixedSizeBinary(n) => *n as usize,
                _ => panic!("{context}: no byte width for {other}"),
            });
            assert_eq!(
                prefix(got, 0, len * width),
                prefix(expected, 0, len * width),
                "{context}: values"
            );
        }
    }
}
