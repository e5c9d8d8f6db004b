//! Concatenation of many partitions on the GPU (the shapes of seed 004): time for the whole
//! table with `kernels/concat.cu`, one launch, against one `cuMemcpyDtoDAsync` per fragment.
//!
//! ```text
//! cargo run --release --example concat_bench
//! python3 examples/concat_baselines.py   # torch.cat over the same shapes
//! ```
//!
//! First it measures the device's copy rate (one large `cuMemcpyDtoDAsync`), then for each
//! shape it uploads the partitions and concatenates them `--repeat` times, printing the best:
//! `total` includes planning on the host (`plan`), allocating the outputs (`alloc`) and
//! preparing the task table (`table`: its device memory, written into pinned staging); `kernel` is the task-table copy, the
//! launch and the synchronization; `memcpy loop` copies the same value buffers with one
//! `cuMemcpyDtoDAsync` per fragment (bitmaps left out, so it moves a little less). GB/s counts
//! bytes read plus written; `% of copy` compares the kernel with the device's copy rate.

use std::sync::Arc;
use std::time::Instant;

use arrow::array::{ArrayRef, DictionaryArray, Int32Array, Int64Array, StringArray};
use arrow::datatypes::Int32Type;
use arrow::record_batch::RecordBatch;
use clap::Parser;
use gpu_flight::arrays::batch_bytes;
use gpu_flight::backend::{Backend, CudaBackend, Partition};

// The allocator the server uses, so that planning's allocations cost what they do there.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
struct Args {
    #[arg(long, default_value_t = 0)]
    device: u32,
    #[arg(long, default_value_t = 200)]
    partitions: usize,
    #[arg(long, default_value_t = 10)]
    repeat: usize,
    /// Only this shape (0-3, in the printed order): for profiling one.
    #[arg(long)]
    shape: Option<usize>,
    /// Size of the single copy that measures the device's copy rate.
    #[arg(long, default_value_t = 1024)]
    copy_mib: usize,
    /// Also time the kernel compiled to this PTX (`kernels/concat.cu` changed, compiled by
    /// `kernels/build_ptx.py`), after the committed one, in the same process; repeatable.
    #[arg(long)]
    ptx: Vec<std::path::PathBuf>,
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

/// Category codes whose dictionary differs in every partition (a rotating window of 64 of
/// 256 names), so every fragment's keys are mapped.
fn dictionary_partition(rows: usize, seed: usize) -> RecordBatch {
    let names: Vec<String> = (0..64)
        .map(|k| format!("name-{}", (k + seed) % 256))
        .collect();
    let keys = Int32Array::from_iter(
        (0..rows).map(|r| (!(r + seed).is_multiple_of(10)).then_some(((r * 7 + seed) % 64) as i32)),
    );
    let dictionary =
        DictionaryArray::<Int32Type>::try_new(keys, Arc::new(StringArray::from(names)))
            .expect("dictionary");
    RecordBatch::try_from_iter([("d", Arc::new(dictionary) as ArrayRef)]).expect("batch")
}

fn string_partition(rows: usize, seed: usize) -> RecordBatch {
    let s: ArrayRef = Arc::new(StringArray::from_iter_values(
        (0..rows).map(|r| format!("{:0w$}", r + seed, w = 8 + r % 17)),
    ));
    RecordBatch::try_from_iter([("s", s)]).expect("batch")
}

async fn upload_all(backend: &CudaBackend, batches: Vec<RecordBatch>) -> Vec<Arc<dyn Partition>> {
    let mut partitions = Vec::with_capacity(batches.len());
    for batch in batches {
        partitions.push(backend.upload(0, batch).await.expect("upload"));
    }
    partitions
}

/// The device's copy rate, bytes read + written per second, best of `repeat`.
async fn copy_rate(backend: &CudaBackend, mib: usize, repeat: usize) -> f64 {
    let rows = mib * (1 << 20) / 8;
    let column: ArrayRef = Arc::new(Int64Array::from_iter_values(0..rows as i64));
    let batch = RecordBatch::try_from_iter([("x", column)]).expect("batch");
    let partition = upload_all(backend, vec![batch]).await;
    let mut best = f64::MAX;
    for _ in 0..repeat.max(1) {
        let copy = backend.copy_per_fragment(&partition).expect("copy");
        best = best.min(copy.elapsed.as_secs_f64());
        assert_eq!(copy.bytes as usize, rows * 8);
    }
    2.0 * (rows * 8) as f64 / best
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    // The backend's own log (e.g. `RUST_LOG=gpu_flight=debug`: each task table's stages).
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let backend = CudaBackend::open(args.device).expect("CUDA device");
    let rate = copy_rate(&backend, args.copy_mib, args.repeat).await;
    println!(
        "device copy rate (one {} MiB cuMemcpyDtoDAsync, read + write): {:.0} GB/s",
        args.copy_mib,
        rate / 1e9
    );
    run_shapes(&backend, &args, rate).await;
    drop(backend);
    for path in &args.ptx {
        let ptx = std::fs::read_to_string(path).expect("the PTX file");
        let backend = CudaBackend::open(args.device)
            .expect("CUDA device")
            .with_concat_kernel(&ptx)
            .expect("the kernel loads");
        println!("kernel from {}:", path.display());
        run_shapes(&backend, &args, rate).await;
    }
}

/// Every shape concatenated with `backend`'s kernel; `rate` is the device's copy rate.
async fn run_shapes(backend: &CudaBackend, args: &Args, rate: f64) {
    type Maker = fn(usize, usize) -> RecordBatch;
    let shapes: [(&str, usize, Maker); 4] = [
        ("10 x int64 + nulls, 1,000 rows", 1_000, int64_partition),
        ("10 x int64 + nulls, 100,000 rows", 100_000, int64_partition),
        ("1 x utf8, 100,000 rows", 100_000, string_partition),
        (
            "1 x dictionary, 100,000 rows",
            100_000,
            dictionary_partition,
        ),
    ];
    println!(
        "{} partitions per shape; best of {}",
        args.partitions, args.repeat
    );
    println!(
        "{:<34} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>11} {:>10} {:>12} {:>9}",
        "shape (per partition)",
        "MB moved",
        "total ms",
        "plan ms",
        "alloc ms",
        "table ms",
        "kernel ms",
        "kernel GB/s",
        "% of copy",
        "memcpy loop",
        "(copies)"
    );
    for (index, (name, rows, make)) in shapes.into_iter().enumerate() {
        if args.shape.is_some_and(|only| only != index) {
            continue;
        }
        let batches: Vec<RecordBatch> = (0..args.partitions).map(|p| make(rows, p)).collect();
        let data: u64 = batches.iter().map(batch_bytes).sum();
        let partitions = upload_all(backend, batches).await;
        let (mut best_total, mut best_kernel, mut best_loop) = (f64::MAX, f64::MAX, f64::MAX);
        let (mut allocate_at_best, mut plan_at_best, mut table_at_best) = (0.0, 0.0, 0.0);
        let mut loop_copies = 0;
        for _ in 0..args.repeat.max(1) {
            let start = Instant::now();
            let compact = backend
                .compact(partitions.clone())
                .await
                .expect("concatenate");
            let wall = start.elapsed().as_secs_f64();
            let counters = backend.counters();
            let kernel = counters["concat_last_kernel_ns"].as_u64().unwrap_or(0) as f64 / 1e9;
            let total = counters["concat_last_total_ns"].as_u64().unwrap_or(0) as f64 / 1e9;
            let allocate = counters["concat_last_allocate_ns"].as_u64().unwrap_or(0) as f64 / 1e9;
            let plan = counters["concat_last_plan_ns"].as_u64().unwrap_or(0) as f64 / 1e9;
            let table = counters["concat_last_table_ns"].as_u64().unwrap_or(0) as f64 / 1e9;
            assert_eq!(compact.num_rows(), rows * args.partitions);
            if total.min(wall) < best_total {
                allocate_at_best = allocate;
                plan_at_best = plan;
                table_at_best = table;
            }
            best_total = best_total.min(total.min(wall));
            best_kernel = best_kernel.min(kernel);
            let copy = backend.copy_per_fragment(&partitions).expect("memcpy loop");
            if copy.copies > 0 {
                best_loop = best_loop.min(copy.elapsed.as_secs_f64());
                loop_copies = copy.copies;
            }
        }
        let moved = 2.0 * data as f64;
        let kernel_rate = moved / best_kernel;
        let memcpy = if best_loop < f64::MAX {
            format!("{:.3} ms", best_loop * 1e3)
        } else {
            "-".to_owned()
        };
        println!(
            "{:<34} {:>9.1} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>10.3} {:>11.0} {:>9.0}% {:>12} {:>9}",
            name,
            moved / 1e6,
            best_total * 1e3,
            plan_at_best * 1e3,
            allocate_at_best * 1e3,
            table_at_best * 1e3,
            best_kernel * 1e3,
            kernel_rate / 1e9,
            100.0 * kernel_rate / rate,
            memcpy,
            loop_copies
        );
    }
}
