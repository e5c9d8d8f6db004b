//! Filtered reads (a read CMD's `"where"`, the predicate Flight SQL statements use) against an
//! oracle written here row by row, on every backend. On the CUDA backend every one of these
//! filters runs on the device (numbers, booleans, strings, large strings, dictionaries) and
//! the rows are gathered there; the answers must be the oracle's, for every type of column
//! returned.

mod common;

use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, BooleanArray, Decimal128Array, DictionaryArray, FixedSizeBinaryArray,
    Float64Array, Int32Array, Int64Array, LargeStringArray, StringArray, TimestampMillisecondArray,
    UInt64Array,
};
use arrow::datatypes::Int32Type;
use arrow::record_batch::RecordBatch;
use arrow_flight::FlightDescriptor;
use common::*;
use futures::TryStreamExt;
use gpu_flight::backend::Backend;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

type MakeBackend = fn() -> Arc<dyn Backend>;

/// Row `i` of the test table: the values the oracle reads.
fn x(i: usize) -> Option<i32> {
    (!i.is_multiple_of(13)).then_some((i * 7919 % 1000) as i32)
}

fn f(i: usize) -> Option<f64> {
    match i {
        _ if i.is_multiple_of(19) => None,
        _ if i.is_multiple_of(17) => Some(f64::NAN),
        _ if i.is_multiple_of(31) => Some(-0.0),
        _ => Some((i % 100) as f64 / 10.0 - 5.0),
    }
}

fn b(i: usize) -> Option<bool> {
    (!i.is_multiple_of(23)).then_some(i.is_multiple_of(3))
}

fn cents(i: usize) -> i128 {
    (i % 1000) as i128 - 500
}

fn batch(rows: std::ops::Range<usize>) -> RecordBatch {
    let strings = |i: usize| (!i.is_multiple_of(29)).then(|| format!("s{}", i % 50));
    let columns: Vec<(&str, ArrayRef)> = vec![
        (
            "i",
            Arc::new(Int64Array::from_iter_values(rows.clone().map(|i| i as i64))),
        ),
        ("x", Arc::new(Int32Array::from_iter(rows.clone().map(x)))),
        ("f", Arc::new(Float64Array::from_iter(rows.clone().map(f)))),
        ("b", Arc::new(BooleanArray::from_iter(rows.clone().map(b)))),
        (
            "u",
            Arc::new(UInt64Array::from_iter(
                rows.clone()
                    .map(|i| (!i.is_multiple_of(43)).then(|| u64::MAX - i as u64)),
            )),
        ),
        (
            "m",
            Arc::new(
                Decimal128Array::from_iter(
                    rows.clone()
                        .map(|i| (!i.is_multiple_of(37)).then(|| cents(i))),
                )
                .with_precision_and_scale(12, 2)
                .expect("decimal"),
            ),
        ),
        (
            "t",
            Arc::new(TimestampMillisecondArray::from_iter(
                rows.clone()
                    .map(|i| (!i.is_multiple_of(41)).then_some(i as i64 * 1000)),
            )),
        ),
        (
            "s",
            Arc::new(StringArray::from_iter(rows.clone().map(strings))),
        ),
        (
            "ls",
            Arc::new(LargeStringArray::from_iter(
                rows.clone()
                    .map(|i| (!i.is_multiple_of(11)).then(|| "x".repeat(i % 7))),
            )),
        ),
        (
            "d",
            Arc::new(
                rows.clone()
                    .map(|i| ["red", "green", "blue"][i % 3])
                    .collect::<DictionaryArray<Int32Type>>(),
            ),
        ),
        (
            "fb",
            Arc::new(
                FixedSizeBinaryArray::try_from_sparse_iter_with_size(
                    rows.clone().map(|i| {
                        (!i.is_multiple_of(47)).then(|| (i as u32).to_le_bytes()[..3].to_vec())
                    }),
                    3,
                )
                .expect("fixed size binary"),
            ),
        ),
    ];
    RecordBatch::try_from_iter(columns).expect("batch")
}

/// The rows a predicate keeps, as the oracle reads them (SQL's NULL is never kept; floats
/// order as Arrow orders them: NaN above everything, -0.0 below 0.0).
type Keeps = Box<dyn Fn(usize) -> bool>;

fn cases() -> Vec<(&'static str, Keeps)> {
    let gt = |v: Option<f64>, than: f64| v.is_some_and(|v| v.total_cmp(&than).is_gt());
    vec![
        ("x < 100", Box::new(|i| x(i).is_some_and(|x| x < 100))),
        (
            "x BETWEEN 10 AND 20 AND b = TRUE",
            Box::new(|i| x(i).is_some_and(|x| (10..=20).contains(&x)) && b(i) == Some(true)),
        ),
        (
            "f > 0 OR x IS NULL",
            Box::new(move |i| gt(f(i), 0.0) || x(i).is_none()),
        ),
        (
            "NOT (f >= -1.0)",
            Box::new(|i| f(i).is_some_and(|f| f.total_cmp(&-1.0).is_lt())),
        ),
        (
            "f = 0",
            Box::new(|i| f(i).is_some_and(|f| f.total_cmp(&0.0).is_eq())),
        ),
        (
            "i IN (5, 77, 1000, 299999, 12, 13, 14, 15, 16)",
            Box::new(|i| [5, 77, 1000, 299_999, 12, 13, 14, 15, 16].contains(&i)),
        ),
        (
            "m >= 4.99",
            Box::new(|i| cents(i) >= 499 && !i.is_multiple_of(37)),
        ),
        (
            "t < TIMESTAMP '1970-01-01 00:01:40'",
            Box::new(|i| i < 100 && !i.is_multiple_of(41)),
        ),
        (
            "x = 3 AND f IS NOT NULL",
            Box::new(|i| x(i) == Some(3) && f(i).is_some()),
        ),
        ("x IS NULL", Box::new(|i| x(i).is_none())),
        ("i < 0", Box::new(|_| false)),
        ("i >= 0", Box::new(|_| true)),
        (
            "u > 18446744073709500000",
            Box::new(|i| {
                !i.is_multiple_of(43) && u64::MAX - (i as u64) > 18_446_744_073_709_500_000
            }),
        ),
        (
            "b = FALSE OR x IN (1, 2, 3) OR NOT x IN (4, 5)",
            Box::new(|i| b(i) == Some(false) || x(i).is_some_and(|x| x != 4 && x != 5)),
        ),
        (
            "s = 's7' AND i < 1000",
            Box::new(|i| !i.is_multiple_of(29) && i % 50 == 7 && i < 1000),
        ),
        (
            "s < 's2'",
            Box::new(|i| !i.is_multiple_of(29) && format!("s{}", i % 50).as_str() < "s2"),
        ),
        (
            "s IN ('s1', 's2', 's3', 's4', 's5', 's6', 's7', 's8', 's9', NULL)",
            Box::new(|i| !i.is_multiple_of(29) && (1..=9).contains(&(i % 50))),
        ),
        (
            "ls > 'xxxx'",
            Box::new(|i| !i.is_multiple_of(11) && i % 7 > 4),
        ),
        (
            "ls = ''",
            Box::new(|i| !i.is_multiple_of(11) && i.is_multiple_of(7)),
        ),
        (
            "ls IS NULL OR t IS NULL",
            Box::new(|i| i.is_multiple_of(11) || i.is_multiple_of(41)),
        ),
        (
            "d = 'green' OR d IN ('blue', 'purple')",
            Box::new(|i| i % 3 != 0),
        ),
        (
            "d >= 'red' AND x < 500",
            Box::new(|i| i % 3 == 0 && x(i).is_some_and(|x| x < 500)),
        ),
    ]
}

const ROWS: usize = 300_000;

/// Puts the test table as `t`, in three puts: several partitions, and chunks that start
/// mid-partition.
async fn put_table(client: &mut arrow_flight::FlightClient) {
    let parts = [0..100_000, 100_000..250_000, 250_000..ROWS];
    for (k, part) in parts.iter().enumerate() {
        let mode = if k == 0 { "create" } else { "append" };
        put(client, cmd("t", mode), vec![batch(part.clone())])
            .await
            .expect("put");
    }
}

/// Every row of `t` that `predicate` keeps, read through its endpoints.
async fn read_where(client: &mut arrow_flight::FlightClient, predicate: &str) -> RecordBatch {
    let command = serde_json::json!({"name": "t", "where": predicate});
    let info = client
        .get_flight_info(FlightDescriptor::new_cmd(command.to_string()))
        .await
        .unwrap_or_else(|e| panic!("{predicate}: {e}"));
    let mut read = Vec::new();
    for endpoint in &info.endpoint {
        let ticket = endpoint.ticket.clone().expect("a ticket");
        let mut part: Vec<RecordBatch> = client
            .do_get(ticket)
            .await
            .expect("do_get")
            .try_collect()
            .await
            .unwrap_or_else(|e| panic!("{predicate}: {e}"));
        read.append(&mut part);
    }
    concat(&batch(0..100).schema(), &read)
}

/// The device's filter counters (rows filtered there, chunks that fell back to the host);
/// `None` on a backend without them.
async fn device_counters(client: &mut arrow_flight::FlightClient) -> Option<(u64, u64)> {
    let status = status(client).await;
    let counters = &status["counters"];
    Some((
        counters["filtered_rows"].as_u64()?,
        counters["filter_fallbacks"].as_u64()?,
    ))
}

async fn where_keeps_the_oracles_rows(make: MakeBackend) {
    let server = TestServer::start(make()).await;
    let mut client = server.client().await;
    put_table(&mut client).await;
    let rows = ROWS;
    let whole = batch(0..rows);
    let on_device = status(&mut client).await["backend"] == "cuda";
    for (predicate, keeps) in cases() {
        let before = device_counters(&mut client).await;
        let got = read_where(&mut client, predicate).await;
        if on_device {
            // Every row was tested on the device, none fell back.
            let (Some(before), Some(after)) = (before, device_counters(&mut client).await) else {
                panic!("the cuda backend counts filtered rows");
            };
            assert_eq!(
                after.0 - before.0,
                rows as u64,
                "{predicate}: rows filtered on the device"
            );
            assert_eq!(after.1, before.1, "{predicate}: chunks that fell back");
        }
        let kept: Vec<u64> = (0..rows).filter(|&i| keeps(i)).map(|i| i as u64).collect();
        let expected = arrow::compute::take_record_batch(
            &whole,
            &arrow::array::UInt64Array::from(kept.clone()),
        )
        .expect("take");
        assert_eq!(got.num_rows(), kept.len(), "{predicate}: rows kept");
        for (index, field) in whole.schema().fields().iter().enumerate() {
            assert_eq!(
                got.column(index).to_data(),
                expected.column(index).to_data(),
                "{predicate}: column {}",
                field.name()
            );
        }
    }
    server.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_where_keeps_the_oracles_rows() {
    where_keeps_the_oracles_rows(|| Arc::new(gpu_flight::backend::HostBackend::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a CUDA device"]
async fn cuda_where_keeps_the_oracles_rows() {
    where_keeps_the_oracles_rows(|| {
        Arc::new(gpu_flight::backend::CudaBackend::open(0).expect("CUDA device 0"))
    })
    .await;
}

/// A random predicate over the test table's columns, of the grammar statements take.
fn random_predicate(rng: &mut StdRng, depth: u32) -> String {
    let column = ["x", "f", "b", "u", "m", "t", "s", "ls", "d", "i"][rng.random_range(0..10)];
    let literal = |rng: &mut StdRng| -> String {
        match column {
            "x" | "i" => rng.random_range(-5..1100).to_string(),
            "f" => ["0", "-0.0", "1.5", "-4.9", "4.5", "2"][rng.random_range(0..6)].to_owned(),
            "b" => ["TRUE", "FALSE"][rng.random_range(0..2)].to_owned(),
            "u" => ["18446744073709500000", "0", "18446744073709551615"][rng.random_range(0..3)]
                .to_owned(),
            "m" => ["4.99", "-5", "0.01", "2.5"][rng.random_range(0..4)].to_owned(),
            "t" => format!("TIMESTAMP '1970-01-01 00:0{}:00'", rng.random_range(0..10)),
            "s" => format!("'s{}'", rng.random_range(0..60)),
            "ls" => format!("'{}'", "x".repeat(rng.random_range(0..8))),
            _ => ["'red'", "'green'", "'blue'", "'pink'", "''"][rng.random_range(0..5)].to_owned(),
        }
    };
    match rng.random_range(0..if depth > 2 { 4 } else { 7 }) {
        0 | 1 => {
            let op = ["=", "<>", "<", "<=", ">", ">="][rng.random_range(0..6)];
            format!("{column} {op} {}", literal(rng))
        }
        2 => format!("{column} IS {}NULL", ["", "NOT "][rng.random_range(0..2)]),
        3 => {
            let items: Vec<String> = (0..[1, 3, 9][rng.random_range(0..3)])
                .map(|_| literal(rng))
                .collect();
            let not = ["", "NOT "][rng.random_range(0..2)];
            format!("{column} {not}IN ({})", items.join(", "))
        }
        4 => format!("NOT ({})", random_predicate(rng, depth + 1)),
        _ => {
            let joiner = [" AND ", " OR "][rng.random_range(0..2)];
            let parts: Vec<String> = (0..rng.random_range(2..5))
                .map(|_| format!("({})", random_predicate(rng, depth + 1)))
                .collect();
            parts.join(joiner)
        }
    }
}

/// Random predicates read from two servers over the same GPU, one filtering on the device and
/// one on the host: the same rows, every column.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a CUDA device"]
async fn cuda_device_and_host_filters_agree_on_random_predicates() {
    use gpu_flight::server::ServeOptions;
    use gpu_flight::store::StoreOptions;

    let start = |on_device: bool| async move {
        let mut options = ServeOptions::default();
        options.flight.filter_on_device = on_device;
        let backend = Arc::new(gpu_flight::backend::CudaBackend::open(0).expect("CUDA device 0"));
        TestServer::start_with(backend, StoreOptions::default(), options).await
    };
    let (device, host) = (start(true).await, start(false).await);
    let (mut on_device, mut on_host) = (device.client().await, host.client().await);
    put_table(&mut on_device).await;
    put_table(&mut on_host).await;
    let mut rng = StdRng::seed_from_u64(26);
    let (mut compared, mut kept) = (0, 0);
    while compared < 200 {
        let predicate = random_predicate(&mut rng, 0);
        let command = serde_json::json!({"name": "t", "where": predicate});
        // Literals a column cannot take are refused alike; skip those.
        if on_host
            .get_flight_info(FlightDescriptor::new_cmd(command.to_string()))
            .await
            .is_err()
        {
            continue;
        }
        let before = device_counters(&mut on_device).await.expect("counters");
        let expected = read_where(&mut on_host, &predicate).await;
        let got = read_where(&mut on_device, &predicate).await;
        let after = device_counters(&mut on_device).await.expect("counters");
        assert_eq!(
            after.0 - before.0,
            ROWS as u64,
            "{predicate}: on the device"
        );
        assert_eq!(got, expected, "{predicate}");
        compared += 1;
        kept += got.num_rows();
    }
    assert!(kept > 0, "some predicates keep rows");
    device.shutdown_and_wait().await;
    host.shutdown_and_wait().await;
}
