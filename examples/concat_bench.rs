//! Concatenation of many partitions on the GPU (the shapes of seed 004): time for the whole
//! table with `kernels/concat.cu`, one launch.
//!
//! ```text
//! cargo run --release --example concat_bench
//! python3 examples/concat_baselines.py   # torch.cat and one cudaMemcpyAsync per fragment
//! ```
//!
//! For each shape it uploads the partitions, then concatenates them `--repeat` times and prints
//! the best: `total` includes allocating one device buffer per column; `kernel` is the
//! task-table copy, the launch and the synchronization. GB/s counts bytes read plus written.

use std::sync::Arc;
use std::time::Instant;

use arrow::array::{ArrayRef, Int64Array, StringArray};
use arrow::record_batch::RecordBatch;
use clap::Parser;
use gpu_flight::backend::{Backend, CudaBackend, Partition};
use gpu_flight::batch_size::batch_bytes;

#[derive(Debug, Parser)]
struct Args {
    #[arg(long, default_value_t = 0)]
    device: u32,
    #[arg(long, default_value_t = 200)]
    partitions: usize,
    #[arg(long, default_value_t = 10)]
    repeat: usize,
}

fn int64_partition(rows: usize, seed: usize) -> RecordBatch {
    let columns: Vec<(String, ArrayRef)> = (0..10)
        .map(|c| {
            let a: ArrayRef =
                Arc::new(Int64Array::from_iter((0..rows).map(|r| {
                    (!(r + c + seed).is_multiple_of(10)).then_some((r * c + seed) as i64)
                })));
            (format!("c{c}"), a)
        })
        .collect();
    RecordBatch::try_from_iter(columns).expect("batch")
}

fn string_partition(rows: usize, seed: usize) -> RecordBatch {
    let s: ArrayRef = Arc::new(StringArray::from_iter_values(
        (0..rows).map(|r| format!("{:0w$}", r + seed, w = 8 + r % 17)),
    ));
    RecordBatch::try_from_iter([("s", s)]).expect("batch")
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let backend = CudaBackend::open(args.device).expect("CUDA device");
    type Maker = fn(usize, usize) -> RecordBatch;
    let shapes: [(&str, usize, Maker); 3] = [
        ("10 x int64 + nulls, 1,000 rows", 1_000, int64_partition),
        ("10 x int64 + nulls, 100,000 rows", 100_000, int64_partition),
        ("1 x utf8, 100,000 rows", 100_000, string_partition),
    ];
    println!(
        "{} partitions per shape; best of {}",
        args.partitions, args.repeat
    );
    println!(
        "{:<36} {:>10} {:>11} {:>12} {:>12}",
        "shape (per partition)", "MB moved", "total ms", "kernel ms", "kernel GB/s"
    );
    for (name, rows, make) in shapes {
        let batches: Vec<RecordBatch> = (0..args.partitions).map(|p| make(rows, p)).collect();
        let data: u64 = batches.iter().map(batch_bytes).sum();
        let mut partitions: Vec<Arc<dyn Partition>> = Vec::new();
        for batch in batches {
            partitions.push(backend.upload(0, batch).await.expect("upload"));
        }
        let (mut best_total, mut best_kernel) = (f64::MAX, f64::MAX);
        for _ in 0..args.repeat.max(1) {
            let start = Instant::now();
            let compact = backend
                .concatenate(partitions.clone())
                .await
                .expect("concatenate");
            let wall = start.elapsed().as_secs_f64();
            let counters = backend.counters();
            let kernel = counters["concat_last_kernel_ns"].as_u64().unwrap_or(0) as f64 / 1e9;
            let total = counters["concat_last_total_ns"].as_u64().unwrap_or(0) as f64 / 1e9;
            assert_eq!(compact.num_rows(), rows * args.partitions);
            best_total = best_total.min(total.min(wall));
            best_kernel = best_kernel.min(kernel);
        }
        let moved = 2.0 * data as f64;
        println!(
            "{:<36} {:>10.1} {:>11.3} {:>12.3} {:>12.0}",
            name,
            moved / 1e6,
            best_total * 1e3,
            best_kernel * 1e3,
            moved / best_kernel / 1e9
        );
    }
}
