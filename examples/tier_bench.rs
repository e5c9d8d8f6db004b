//! Memory tiers and persistence, measured through the store (no network in the way):
//!
//! ```text
//! cargo run --release --example tier_bench -- [--backend cuda] [--spill-gib 3] \
//!     [--appends 1000] [--append-mib 1] [--persist-gib 10 --data-dir DIR] \
//!     [--durable-appends 10000 --data-dir DIR] [--spill-in-pieces] [--pinned-gib 4]
//! ```
//!
//! - **Spill:** `--spill-gib` of int64 datasets (256 MiB each) put with the device's budget at
//!   a third of that, so two thirds spill to host memory; every row is read back and compared,
//!   then every spilled dataset is exported (which restores it onto the device, spilling
//!   others). Prints spill and restore GB/s from the store's own counters, and on cuda the
//!   baseline in the same run: plain copies between the device and pinned host memory. With
//!   `--pinned-gib`, that much host memory is pinned for spills first, and the bench
//!   says how many spills and restores went straight through it.
//! - **Appends:** `--appends` appends of `--append-mib` to one dataset: the commits' time, then
//!   the background merges' (waited for), and the bytes they copied against what recopying
//!   the dataset at every append copies.
//! - **Persistence:** with `--data-dir`, `--persist-gib` put durably (`sync`) in 1 GiB
//!   datasets, then the directory reopened (the page cache dropped first where the bench runs
//!   as root): the time until a server would answer, then every dataset read twice, the
//!   first read loading it from the files. The baseline, in the same run and dropped cache: a
//!   plain sequential read of the same files.
//! - **Durable appends:** with `--data-dir`, `--durable-appends` one-row appends to one
//!   dataset, each acknowledged once on disk (`sync`): the latency of the first and of the
//!   last thousand, and what the directory holds afterwards (segment files, and the bytes of
//!   `manifest.json` and the journal); then the directory is reopened and every row compared.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow::array::{ArrayRef, Int64Array};
use arrow::record_batch::RecordBatch;
use clap::Parser;
use futures::TryStreamExt;
use gpu_flight::arrays::batch_bytes;
use gpu_flight::backend::{Backend, BackendChoice, CudaBackend, GpuSelection, select};
use gpu_flight::store::{Durability, ExportRequest, PutMode, Store, StoreOptions};

// The allocator the server uses, so that spills into fresh memory cost what they do there.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
struct Args {
    #[arg(long, value_enum, default_value_t = BackendChoice::Cuda)]
    backend: BackendChoice,
    #[arg(long, default_value_t = 3.0)]
    spill_gib: f64,
    #[arg(long, default_value_t = 1000)]
    appends: u64,
    #[arg(long, default_value_t = 1)]
    append_mib: u64,
    #[arg(long, default_value_t = 10.0)]
    persist_gib: f64,
    #[arg(long)]
    data_dir: Option<PathBuf>,
    #[arg(long, default_value_t = 0)]
    durable_appends: u64,
    /// On cuda: spill by reading rows in pieces (the other backends' way) instead of copying
    /// each partition's allocation whole, to compare the two.
    #[arg(long)]
    spill_in_pieces: bool,
    /// On cuda: GiB of host memory pinned for spills (`--pinned-host-memory`), waited for
    /// before the puts; 0 for none.
    #[arg(long, default_value_t = 0.0)]
    pinned_gib: f64,
}

const MIB: u64 = 1 << 20;
const BATCH_ROWS: u64 = MIB; // 8 MiB of int64

/// Rows `rows` of dataset `seed`: values no other dataset or row has.
fn batch(seed: u64, rows: std::ops::Range<u64>) -> RecordBatch {
    let x: ArrayRef = Arc::new(Int64Array::from_iter_values(
        rows.map(|r| (seed << 40 | r) as i64),
    ));
    RecordBatch::try_from_iter([("x", x)]).expect("batch")
}

fn batches(seed: u64, rows: u64) -> Vec<RecordBatch> {
    (0..rows)
        .step_by(BATCH_ROWS as usize)
        .map(|start| batch(seed, start..rows.min(start + BATCH_ROWS)))
        .collect()
}

async fn put(store: &Store, name: &str, mode: PutMode, batches: &[RecordBatch]) {
    let mut pending = store
        .begin_put(name.to_owned(), mode, "bench")
        .expect("begin");
    pending.declare_schema(batches[0].schema()).expect("schema");
    for batch in batches {
        if let Some(upload) = pending.upload(batch.clone(), None).await.expect("reserve") {
            pending.add(upload.await.expect("upload"));
        }
    }
    pending.commit().await.expect("commit");
}

async fn read(store: &Store, name: &str) -> Vec<RecordBatch> {
    let dataset = store.get(name).expect("dataset");
    dataset
        .read(0..dataset.num_rows(), 16 * MIB, 2)
        .expect("read")
        .try_collect()
        .await
        .expect("read")
}

fn same_rows(got: &[RecordBatch], want: &[RecordBatch]) -> bool {
    let got = arrow::compute::concat_batches(&want[0].schema(), got).expect("concat");
    let want = arrow::compute::concat_batches(&want[0].schema(), want).expect("concat");
    got == want
}

fn gbps(bytes: u64, seconds: f64) -> f64 {
    bytes as f64 / seconds.max(1e-9) / 1e9
}

async fn backend(args: &Args) -> Arc<dyn Backend> {
    let pinned = (args.pinned_gib * (1u64 << 30) as f64) as u64;
    if (args.spill_in_pieces || pinned > 0) && args.backend == BackendChoice::Cuda {
        let mut cuda = CudaBackend::open(0).expect("CUDA device");
        if args.spill_in_pieces {
            cuda = cuda.with_spills_in_pieces();
        }
        if pinned > 0 {
            let started = Instant::now();
            cuda = cuda.with_pinned_host_memory(pinned);
            while cuda.pinned_host_memory().is_none() {
                assert!(
                    started.elapsed() < Duration::from_secs(300),
                    "pinned host memory not ready (see the log)"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            println!(
                "pinned host memory: {:.2} GiB pinned in {:.2} s",
                pinned as f64 / (1u64 << 30) as f64,
                started.elapsed().as_secs_f64()
            );
        }
        return Arc::new(cuda);
    }
    select(args.backend, &GpuSelection::Ordinals(vec![0]), 1).expect("backend")
}

/// Where spills through staging spent their time (cuda): the backend's counters, summed over
/// the two lanes each spill runs.
fn staged_spills(store: &Store) -> String {
    let counters = store.backend().counters();
    let count = |name: &str| counters.get(name).and_then(|v| v.as_u64()).unwrap_or(0);
    let seconds = |name: &str| count(name) as f64 / 1e9;
    format!(
        "{} spill copies ({:.2} GiB) through staging; their lanes spent {:.3} s leasing staging, \
         {:.3} s waiting for device-to-host copies, {:.3} s writing into host memory",
        count("staged_spill_copies"),
        count("staged_spill_bytes") as f64 / (1u64 << 30) as f64,
        seconds("staged_spill_lease_ns"),
        seconds("staged_spill_copy_ns"),
        seconds("staged_spill_write_ns"),
    )
}

/// How many spills and uploads (restores) went straight through pinned host memory (cuda).
fn pinned_copies(store: &Store) -> String {
    let counters = store.backend().counters();
    let count = |name: &str| counters.get(name).and_then(|v| v.as_u64()).unwrap_or(0);
    format!(
        "{} spill copies ({:.2} GiB) and {} uploads ({:.2} GiB) straight through pinned host memory",
        count("pinned_spill_copies"),
        count("pinned_spill_bytes") as f64 / (1u64 << 30) as f64,
        count("pinned_upload_copies"),
        count("pinned_upload_bytes") as f64 / (1u64 << 30) as f64,
    )
}

async fn spill(args: &Args) {
    let total = (args.spill_gib * (1u64 << 30) as f64) as u64;
    let per_dataset = 256 * MIB;
    let datasets = total.div_ceil(per_dataset);
    let store = Store::new(
        backend(args).await,
        StoreOptions {
            memory_limit: Some(total / 3),
            host_memory_limit: Some(4 * total),
            ..StoreOptions::default()
        },
    );
    let started = Instant::now();
    for seed in 0..datasets {
        put(
            &store,
            &format!("d{seed}"),
            PutMode::Create,
            &batches(seed, per_dataset / 8),
        )
        .await;
    }
    let put_seconds = started.elapsed().as_secs_f64();
    let status = store.status();
    let tiers = &status.tiers;
    println!(
        "spill: put {:.2} GiB with a {:.2} GiB device budget in {put_seconds:.2} s; {} spills, \
         {:.2} GiB in {:.3} s: {:.2} GB/s",
        (datasets * per_dataset) as f64 / (1u64 << 30) as f64,
        (total / 3) as f64 / (1u64 << 30) as f64,
        tiers.spills,
        tiers.spilled_bytes as f64 / (1u64 << 30) as f64,
        tiers.spill_seconds,
        gbps(tiers.spilled_bytes, tiers.spill_seconds),
    );
    assert!(status.devices[0].used_bytes <= total / 3, "the budget held");
    if !store.backend().holds_host_memory() {
        println!("spill: {}", pinned_copies(&store));
        println!("spill: {}", staged_spills(&store));
    }
    if !store.backend().holds_host_memory() {
        plain_copies(per_dataset as usize);
    }
    let started = Instant::now();
    let mut read_bytes = 0;
    for seed in 0..datasets {
        let got = read(&store, &format!("d{seed}")).await;
        read_bytes += got.iter().map(batch_bytes).sum::<u64>();
        assert!(
            same_rows(&got, &batches(seed, per_dataset / 8)),
            "d{seed} reads back as put"
        );
    }
    println!(
        "spill: every row read back and equal ({:.2} GiB, from both tiers, {:.2} s with the check)",
        read_bytes as f64 / (1u64 << 30) as f64,
        started.elapsed().as_secs_f64()
    );
    if store.backend().holds_host_memory() {
        println!("restore: not measured (the host backend exports nothing)");
        return;
    }
    let before = store.status().tiers;
    for seed in 0..datasets {
        let name = format!("d{seed}");
        if store.get(&name).expect("d").tier_bytes().host == 0 {
            continue;
        }
        let export = store
            .export(ExportRequest::new(&name, Duration::from_secs(60), "bench"))
            .await
            .expect("export restores");
        store.release(&export.lease.id, None).expect("release");
    }
    let after = store.status().tiers;
    let restored = after.restored_bytes - before.restored_bytes;
    let seconds = after.restore_seconds - before.restore_seconds;
    println!(
        "restore: {} partitions, {:.2} GiB in {seconds:.3} s: {:.2} GB/s (exports of spilled datasets)",
        after.restores - before.restores,
        restored as f64 / (1u64 << 30) as f64,
        gbps(restored, seconds),
    );
    // Each restore first makes room on the full device by spilling others: apart from them,
    // the restores' own uploads. Nothing else runs meanwhile, so every spill of this phase
    // is one a restore made (and timed within its own time).
    let spilling = after.spill_seconds - before.spill_seconds;
    let own = seconds - spilling;
    println!(
        "restore: of which {:.3} s spilling {} partitions ({:.2} GiB) to make room; without them {}",
        spilling,
        after.spills - before.spills,
        (after.spilled_bytes - before.spilled_bytes) as f64 / (1u64 << 30) as f64,
        if own > 0.0 {
            format!("{:.2} GB/s", gbps(restored, own))
        } else {
            "not measurable".to_owned()
        },
    );
    // The host memory these spills write into was freed by the restore just before each, and
    // the allocator (mimalloc, which gives freed memory back to the kernel after 10 ms) hands
    // it out again, written before: the first spills wrote into fresh pages.
    println!(
        "restore: the spills making room: {:.2} GB/s",
        gbps(after.spilled_bytes - before.spilled_bytes, spilling)
    );
    println!("restore: {}", pinned_copies(&store));
}

async fn appends(args: &Args) {
    let store = Store::new(backend(args).await, StoreOptions::default());
    let rows = args.append_mib * MIB / 8;
    let started = Instant::now();
    for i in 0..args.appends {
        let mode = if i == 0 {
            PutMode::Create
        } else {
            PutMode::Append
        };
        put(&store, "log", mode, &[batch(1, i * rows..(i + 1) * rows)]).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    // Merges run in the background; their copies are counted once they are all done.
    store.compactions_settled().await;
    let settled = started.elapsed().as_secs_f64() - seconds;
    let dataset = store.get("log").expect("log");
    let appended = dataset.data_bytes();
    let status = store.status();
    let copied = status.concatenated_bytes;
    // Recopying the whole dataset at every append copies 1 + 2 + ... + (n - 1) appends' bytes.
    let n = args.appends;
    let recopy = (n * (n - 1) / 2) * (appended / n);
    println!(
        "appends: {n} of {} MiB committed in {seconds:.2} s, merges done {settled:.2} s later; \
         {} merges copied {:.2} GiB ({:.1}x the {:.2} GiB appended), {} partitions; recopying \
         at every append copies {:.1} GiB ({:.0}x)",
        args.append_mib,
        status.merges,
        copied as f64 / (1u64 << 30) as f64,
        copied as f64 / appended as f64,
        appended as f64 / (1u64 << 30) as f64,
        dataset.num_partitions(),
        recopy as f64 / (1u64 << 30) as f64,
        recopy as f64 / appended as f64,
    );
    let got = read(&store, "log").await;
    assert!(
        same_rows(&got, &[batch(1, 0..n * rows)]),
        "the appended rows read back in order"
    );
}

async fn persistence(args: &Args, dir: &PathBuf) {
    let _ = std::fs::remove_dir_all(dir);
    let options = StoreOptions {
        data_dir: Some(dir.clone()),
        durability: Durability::Sync,
        ..StoreOptions::default()
    };
    let store = Store::open(backend(args).await, options.clone())
        .await
        .expect("open");
    let datasets = args.persist_gib.ceil() as u64;
    let per_dataset = ((args.persist_gib * (1u64 << 30) as f64) as u64 / datasets) / 8;
    let started = Instant::now();
    for seed in 0..datasets {
        put(
            &store,
            &format!("p{seed}"),
            PutMode::Create,
            &batches(seed, per_dataset),
        )
        .await;
    }
    let seconds = started.elapsed().as_secs_f64();
    let written = store
        .status()
        .persistence
        .expect("persistence")
        .written_bytes;
    println!(
        "persist: {datasets} datasets, {:.2} GiB on disk, put durably (sync) in {seconds:.2} s: {:.2} GB/s",
        written as f64 / (1u64 << 30) as f64,
        gbps(written, seconds),
    );
    store.close().await;
    drop(store);
    // Best effort: with the page cache dropped (root only), first reads come from the disk,
    // for the baseline (a plain sequential read of the files) as for the loads.
    let cold = std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok();
    let (plain_bytes, plain_gbps) = plain_read(dir);
    println!(
        "baseline: the data directory's {:.2} GiB read sequentially (8 MiB reads, {} page cache) at {plain_gbps:.2} GB/s",
        plain_bytes as f64 / (1u64 << 30) as f64,
        if cold { "dropped" } else { "warm" },
    );
    let cold = cold && std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok();
    let started = Instant::now();
    let store = Store::open(backend(args).await, options)
        .await
        .expect("reopen");
    let answering = started.elapsed().as_secs_f64();
    println!(
        "restart: {} datasets ({:.2} GiB on disk) listed and the store ready (a server answers) after {:.3} s",
        store.list("").len(),
        written as f64 / (1u64 << 30) as f64,
        answering,
    );
    let names: Vec<String> = store.list("").iter().map(|d| d.name().to_owned()).collect();
    let mut first_reads = 0.0;
    for pass in ["first read (loads)", "second read"] {
        let started = Instant::now();
        let mut bytes = 0;
        for name in &names {
            bytes += read(&store, name)
                .await
                .iter()
                .map(batch_bytes)
                .sum::<u64>();
        }
        let seconds = started.elapsed().as_secs_f64();
        if first_reads == 0.0 {
            first_reads = seconds;
        }
        println!(
            "restart: {pass} of every dataset, {:.2} GiB in {seconds:.2} s: {:.2} GB/s",
            bytes as f64 / (1u64 << 30) as f64,
            gbps(bytes, seconds),
        );
    }
    let tiers = store.status().tiers;
    println!(
        "restart: every dataset read in full {:.2} s after the start ({} page cache); {} loads of {:.2} GiB of files in {:.2} s; now {:.2} GiB on devices, {:.2} GiB in the host tier",
        answering + first_reads,
        if cold { "dropped" } else { "warm" },
        tiers.loads,
        tiers.loaded_bytes as f64 / (1u64 << 30) as f64,
        tiers.load_seconds,
        tiers.device_bytes as f64 / (1u64 << 30) as f64,
        tiers.host_bytes as f64 / (1u64 << 30) as f64,
    );
    let got = read(&store, "p0").await;
    assert!(same_rows(&got, &batches(0, per_dataset)), "p0 as put");
    store.close().await;
    let _ = std::fs::remove_dir_all(dir);
}

/// The baseline of spills and restores in the same run: one dataset's bytes copied from the
/// device to pinned host memory and back in 64 MiB pieces, with nothing else.
fn plain_copies(bytes: usize) {
    let backend = CudaBackend::open(0).expect("CUDA device");
    let copies = (0..3)
        .map(|_| {
            backend
                .plain_copies(0, bytes, 64 << 20)
                .expect("plain copies")
        })
        .min_by_key(|c| c.to_host + c.to_device)
        .expect("three runs");
    println!(
        "baseline: {:.2} GiB copied device to pinned host memory at {:.2} GB/s, back at {:.2} GB/s (plain copies, best of 3)",
        bytes as f64 / (1u64 << 30) as f64,
        gbps(copies.bytes, copies.to_host.as_secs_f64()),
        gbps(copies.bytes, copies.to_device.as_secs_f64()),
    );
}

/// Every file under `dir` read sequentially in 8 MiB reads, as the baseline of loads: GB/s.
fn plain_read(dir: &std::path::Path) -> (u64, f64) {
    use std::io::Read;
    let mut files = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(path) = pending.pop() {
        for entry in std::fs::read_dir(&path).expect("read_dir").flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else {
                files.push(path);
            }
        }
    }
    let mut buffer = vec![0u8; 8 << 20];
    let started = Instant::now();
    let mut bytes = 0u64;
    for path in files {
        let mut file = std::fs::File::open(path).expect("open");
        loop {
            let n = file.read(&mut buffer).expect("read");
            if n == 0 {
                break;
            }
            bytes += n as u64;
        }
    }
    (bytes, gbps(bytes, started.elapsed().as_secs_f64()))
}

/// Mean, median and 99th percentile of `latencies`, in milliseconds.
fn latency(latencies: &[Duration]) -> String {
    let mut sorted = latencies.to_vec();
    sorted.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mean = sorted.iter().map(|&d| ms(d)).sum::<f64>() / sorted.len().max(1) as f64;
    let at = |q: f64| ms(sorted[((sorted.len() - 1) as f64 * q) as usize]);
    format!(
        "mean {mean:.3} ms, p50 {:.3} ms, p99 {:.3} ms",
        at(0.5),
        at(0.99)
    )
}

/// Files under `dir/segments`, and the bytes of everything else in `dir` (the catalog).
fn directory(dir: &std::path::Path) -> (usize, u64) {
    let segments = std::fs::read_dir(dir.join("segments"))
        .map(|entries| entries.count())
        .unwrap_or(0);
    let catalog = ["manifest.json", "journal"]
        .iter()
        .filter_map(|name| std::fs::metadata(dir.join(name)).ok())
        .map(|meta| meta.len())
        .sum();
    (segments, catalog)
}

async fn durable_appends(args: &Args, dir: &PathBuf) {
    let _ = std::fs::remove_dir_all(dir);
    let options = StoreOptions {
        data_dir: Some(dir.clone()),
        durability: Durability::Sync,
        ..StoreOptions::default()
    };
    let store = Store::open(backend(args).await, options.clone())
        .await
        .expect("open");
    let n = args.durable_appends;
    let mut latencies = Vec::with_capacity(n as usize);
    for i in 0..n {
        let mode = if i == 0 {
            PutMode::Create
        } else {
            PutMode::Append
        };
        let started = Instant::now();
        put(&store, "log", mode, &[batch(2, i..i + 1)]).await;
        latencies.push(started.elapsed());
    }
    let window = latencies.len().min(1000);
    let (segments, catalog) = directory(dir);
    println!(
        "durable appends: {n} one-row appends (sync); first {window}: {}; last {window}: {}; \
         then {segments} segment files and {catalog} bytes of manifest.json and journal",
        latency(&latencies[..window]),
        latency(&latencies[latencies.len() - window..]),
    );
    let started = Instant::now();
    store.close().await;
    drop(store);
    let (segments, catalog) = directory(dir);
    println!(
        "durable appends: closed in {:.3} s: {segments} segment files, {catalog} bytes of \
         manifest.json and journal",
        started.elapsed().as_secs_f64()
    );
    let started = Instant::now();
    let store = Store::open(backend(args).await, options)
        .await
        .expect("reopen");
    let opened = started.elapsed().as_secs_f64();
    let got = read(&store, "log").await;
    assert!(same_rows(&got, &[batch(2, 0..n)]), "every row, in order");
    println!("durable appends: reopened in {opened:.3} s, every row read back in order");
    store.close().await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    // The store's own log (e.g. `RUST_LOG=gpu_flight=info`: each spill's stages).
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    if args.spill_gib > 0.0 {
        spill(&args).await;
    }
    if args.appends > 0 {
        appends(&args).await;
    }
    if let Some(dir) = &args.data_dir {
        if args.durable_appends > 0 {
            durable_appends(&args, dir).await;
        }
        if args.persist_gib > 0.0 {
            persistence(&args, dir).await;
        }
    }
}
