//! Host↔device transfer rates of a backend with no network in the way: how fast `DoPut` can
//! place data and `DoGet` can stage it into pinned host memory.
//!
//! ```text
//! cargo run --release --example staging_bench -- [--backend cuda] [--gib 1] [--chunk-mib 16] [--prefetch 2] \
//!     [--pinned-gib 3]
//! ```
//!
//! Uploads a table of 8 int64 columns and one of strings through the store, then reads each
//! back as `DoGet` does (chunks of `--chunk-mib`, `--prefetch` in flight) and prints GB/s.
//! On cuda, the last row is the baseline in the same run: the same bytes copied from pinned
//! host memory to the device and back with nothing else (`CudaBackend::plain_copies`).
//!
//! With `--pinned-gib`, the cuda backend pins that much host memory (`--pinned-host-memory`),
//! and each batch is encoded as an Arrow IPC message whose body is copied into it and decoded
//! in place, as `DoPut` does with a message body (that copy is the one `DoPut` makes out of
//! the network's frames, so it is not timed): the uploads then copy straight from it.
//! `--body-alignment 8` lays the bodies out as pyarrow writes them.

use std::sync::Arc;
use std::time::Instant;

use arrow::array::{ArrayRef, Int64Array, StringArray};
use arrow::ipc::MetadataVersion;
use arrow::ipc::reader::read_record_batch;
use arrow::ipc::writer::{DictionaryTracker, IpcDataGenerator, IpcWriteOptions};
use arrow::record_batch::RecordBatch;
use clap::Parser;
use futures::TryStreamExt;
use gpu_flight::arrays::batch_bytes;
use gpu_flight::backend::{Backend, BackendChoice, CudaBackend, GpuSelection, select};
use gpu_flight::store::{PutMode, Store, StoreOptions};

// The allocator the server uses, so that host copies into fresh memory cost what they do there.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
struct Args {
    #[arg(long, value_enum, default_value_t = BackendChoice::Cuda)]
    backend: BackendChoice,
    #[arg(long, default_value_t = 0)]
    device: u32,
    #[arg(long, default_value_t = 1.0)]
    gib: f64,
    #[arg(long, default_value_t = 16)]
    chunk_mib: u64,
    /// Chunks read ahead, as `DoGet` does (its default is 2).
    #[arg(long, default_value_t = 2)]
    prefetch: usize,
    #[arg(long, default_value_t = 131_072)]
    batch_rows: usize,
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Freed device memory the cuda backend keeps for reuse, MiB (default: its own choice).
    #[arg(long)]
    keep_device_mib: Option<u64>,
    /// Uploads the cuda backend runs at once (default: its own choice).
    #[arg(long)]
    uploads_at_once: Option<usize>,
    /// GiB of pinned host memory the tables are put from (cuda); 0 for none.
    #[arg(long, default_value_t = 0.0)]
    pinned_gib: f64,
    /// With `--pinned-gib`: the alignment of buffers in the message bodies (64 as arrow-rs
    /// writes them, 8 as pyarrow does).
    #[arg(long, default_value_t = 64)]
    body_alignment: usize,
}

/// `batch` as `DoPut` holds it with `--pinned-host-memory`: encoded as an Arrow IPC message
/// body whose buffers start `alignment` bytes apart (arrow-rs writes 64, pyarrow 8), the body
/// copied into the backend's pinned host memory, and the batch decoded in place there.
fn as_pinned_body(backend: &dyn Backend, batch: &RecordBatch, alignment: usize) -> RecordBatch {
    let options = IpcWriteOptions::try_new(alignment, false, MetadataVersion::V5)
        .expect("an IPC alignment of 8, 16, 32 or 64");
    let mut tracker = DictionaryTracker::new(false);
    let (_, encoded) = IpcDataGenerator::default()
        .encode(batch, &mut tracker, &options, &mut Default::default())
        .expect("encode");
    let body = backend
        .pinned_copy(&encoded.arrow_data)
        .expect("room in the pinned host memory (raise --pinned-gib)");
    let message = arrow::ipc::root_as_message(&encoded.ipc_message).expect("message");
    let header = message.header_as_record_batch().expect("a record batch");
    read_record_batch(
        &body,
        header,
        batch.schema(),
        &Default::default(),
        None,
        &message.version(),
    )
    .expect("decode in place")
}

fn tables(gib: f64, batch_rows: usize) -> Vec<(&'static str, Vec<RecordBatch>)> {
    let int_rows = (gib * (1u64 << 30) as f64 / 64.0) as usize;
    let str_rows = (gib * (1u64 << 30) as f64 / 44.0) as usize;
    let ints = (0..int_rows)
        .step_by(batch_rows)
        .map(|start| {
            let len = batch_rows.min(int_rows - start);
            let columns: Vec<(String, ArrayRef)> = (0..8)
                .map(|c| {
                    let a: ArrayRef = Arc::new(Int64Array::from_iter_values(
                        (start..start + len).map(|r| (r * 8 + c) as i64),
                    ));
                    (format!("c{c}"), a)
                })
                .collect();
            RecordBatch::try_from_iter(columns).expect("batch")
        })
        .collect();
    let strings = (0..str_rows)
        .step_by(batch_rows)
        .map(|start| {
            let len = batch_rows.min(str_rows - start);
            let s: ArrayRef = Arc::new(StringArray::from_iter_values(
                (start..start + len).map(|r| format!("{:0width$}", r, width = 16 + r % 33)),
            ));
            let id: ArrayRef = Arc::new(Int64Array::from_iter_values(
                (start..start + len).map(|r| r as i64),
            ));
            RecordBatch::try_from_iter([("s", s), ("id", id)]).expect("batch")
        })
        .collect();
    vec![("int64", ints), ("strings", strings)]
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let pinned = (args.pinned_gib * (1u64 << 30) as f64) as u64;
    let tuned = args.keep_device_mib.is_some() || args.uploads_at_once.is_some() || pinned > 0;
    let backend: Arc<dyn Backend> = if args.backend == BackendChoice::Cuda && tuned {
        let mut cuda = CudaBackend::open(args.device).expect("CUDA device");
        if let Some(mib) = args.keep_device_mib {
            cuda = cuda.with_kept_device_memory(mib << 20);
        }
        if let Some(uploads) = args.uploads_at_once {
            cuda = cuda.with_uploads_at_once(uploads);
        }
        if pinned > 0 {
            cuda = cuda.with_pinned_host_memory(pinned);
            let started = Instant::now();
            while cuda.pinned_host_memory().is_none() {
                assert!(
                    started.elapsed().as_secs() < 300,
                    "pinning failed (see the log)"
                );
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        }
        Arc::new(cuda)
    } else {
        select(args.backend, &GpuSelection::Ordinals(vec![args.device]), 1).expect("backend")
    };
    let store = Store::new(backend, StoreOptions::default());
    println!(
        "{:<8} {:>8} {:>16} {:>16}",
        "table", "MB", "upload GB/s", "stage GB/s"
    );
    for (name, batches) in tables(args.gib, args.batch_rows) {
        let batches: Vec<RecordBatch> = if pinned > 0 {
            let backend = store.backend();
            batches
                .iter()
                .map(|batch| as_pinned_body(backend.as_ref(), batch, args.body_alignment))
                .collect()
        } else {
            batches
        };
        let bytes: u64 = batches.iter().map(batch_bytes).sum();
        let (mut best_put, mut best_read) = (f64::MAX, f64::MAX);
        let mut stages = String::new();
        for _ in 0..args.repeat.max(1) {
            let before = store.backend().counters();
            let start = Instant::now();
            let mut put = store
                .begin_put(name.to_owned(), PutMode::Replace, "bench")
                .expect("begin");
            put.declare_schema(batches[0].schema()).expect("schema");
            let mut uploads = Vec::with_capacity(batches.len());
            for batch in &batches {
                uploads.extend(put.upload(batch.clone(), None).await.expect("reserve"));
            }
            for uploaded in futures::future::try_join_all(uploads)
                .await
                .expect("upload")
            {
                put.add(uploaded);
            }
            let uploaded = start.elapsed().as_secs_f64();
            put.commit().await.expect("commit");
            let seconds = start.elapsed().as_secs_f64();
            if seconds < best_put {
                best_put = seconds;
                let summed = upload_stages(&before, &store.backend().counters());
                stages = format!(
                    "best put: uploads {uploaded:.3} s, commit (concatenation) {:.3} s{}{summed}",
                    seconds - uploaded,
                    if summed.is_empty() { "" } else { "; " },
                );
            }

            let dataset = store.get(name).expect("dataset");
            let start = Instant::now();
            let rows: usize = dataset
                .read(0..dataset.num_rows(), args.chunk_mib << 20, args.prefetch)
                .expect("read")
                .try_fold(0, |n, b| async move { Ok(n + b.num_rows()) })
                .await
                .expect("read");
            best_read = best_read.min(start.elapsed().as_secs_f64());
            assert_eq!(rows as u64, dataset.num_rows());
        }
        println!(
            "{:<8} {:>8.0} {:>16.2} {:>16.2}",
            name,
            bytes as f64 / 1e6,
            bytes as f64 / best_put / 1e9,
            bytes as f64 / best_read / 1e9
        );
        if !stages.is_empty() {
            println!("         {stages}");
        }
    }
    if args.backend == BackendChoice::Cuda {
        plain_copies(&args);
    }
    println!(
        "backend: {:?}; reads of {} MiB chunks, {} in flight; best of {}; GB = 1e9 bytes of Arrow buffers{}",
        args.backend,
        args.chunk_mib,
        args.prefetch,
        args.repeat,
        if pinned > 0 {
            "; tables put from pinned host memory"
        } else {
            ""
        }
    );
}

/// Where the last put's uploads spent their time, summed over uploads running at once (the
/// cuda backend's counters; empty on others).
fn upload_stages(
    before: &serde_json::Map<String, serde_json::Value>,
    after: &serde_json::Map<String, serde_json::Value>,
) -> String {
    let seconds = |key: &str| {
        let at = |m: &serde_json::Map<String, serde_json::Value>| {
            m.get(key).and_then(serde_json::Value::as_u64)
        };
        Some((at(after)? - at(before)?) as f64 / 1e9)
    };
    match (
        seconds("upload_allocate_ns"),
        seconds("upload_fill_ns"),
        seconds("upload_copy_ns"),
    ) {
        (Some(allocate), Some(fill), Some(copy)) => format!(
            "last put, summed over its uploads: allocate {allocate:.3} s, fill staging {fill:.3} s, copy to the device {copy:.3} s"
        ),
        _ => String::new(),
    }
}

/// The baseline in the same run: as many bytes as the int64 table copied between pinned host
/// memory and the device in `--chunk-mib` pieces, nothing else.
fn plain_copies(args: &Args) {
    let backend = CudaBackend::open(args.device).expect("CUDA device");
    let bytes = (args.gib * (1u64 << 30) as f64) as usize;
    let (mut to_device, mut to_host) = (f64::MAX, f64::MAX);
    for _ in 0..args.repeat.max(1) {
        let copies = backend
            .plain_copies(args.device, bytes, (args.chunk_mib << 20) as usize)
            .expect("plain copies");
        to_device = to_device.min(copies.to_device.as_secs_f64());
        to_host = to_host.min(copies.to_host.as_secs_f64());
    }
    println!(
        "{:<8} {:>8.0} {:>16.2} {:>16.2}   (pinned memory to the device and back, no layout)",
        "plain",
        bytes as f64 / 1e6,
        bytes as f64 / to_device / 1e9,
        bytes as f64 / to_host / 1e9
    );
}
