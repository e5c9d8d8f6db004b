//! Copies between GPUs of one node: the `move` action's rate for every ordered pair of
//! devices, and the rate of staging reads (DoGet's device-to-host path) from one GPU and from
//! all at once.
//!
//! ```text
//! cargo run --release --example peer_bench -- [--ordinals 0,1] [--gib 1] [--repeat 3]
//! ```
//!
//! `--ordinals` lists CUDA ordinals (default: every visible GPU); one may be listed twice to
//! run every path on a single GPU (then "peer" copies are copies within it). Prints the
//! `cuDeviceCanAccessPeer` matrix, GB/s per pair (best of `--repeat`), and staging GB/s.

use std::sync::Arc;
use std::time::Instant;

use arrow::array::{ArrayRef, Int64Array};
use arrow::record_batch::RecordBatch;
use clap::Parser;
use futures::TryStreamExt;
use gpu_flight::arrays::batch_bytes;
use gpu_flight::backend::{Backend, CudaBackend};
use gpu_flight::store::{PutMode, Store, StoreOptions};

#[derive(Debug, Parser)]
struct Args {
    /// CUDA ordinals of the devices (default: all visible).
    #[arg(long, value_delimiter = ',')]
    ordinals: Vec<u32>,
    /// Dataset size per device.
    #[arg(long, default_value_t = 1.0)]
    gib: f64,
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Staging read chunks, and how many are in flight per device (as DoGet reads).
    #[arg(long, default_value_t = 16)]
    chunk_mib: u64,
    #[arg(long, default_value_t = 4)]
    prefetch: usize,
}

fn batches(gib: f64, seed: i64) -> Vec<RecordBatch> {
    let rows = (gib * (1u64 << 30) as f64 / 32.0) as usize;
    let batch_rows = 1 << 20;
    (0..rows)
        .step_by(batch_rows)
        .map(|start| {
            let len = batch_rows.min(rows - start);
            let columns: Vec<(String, ArrayRef)> = (0..4)
                .map(|c| {
                    let a: ArrayRef = Arc::new(Int64Array::from_iter_values(
                        (start..start + len).map(|r| seed + (r * 4 + c) as i64),
                    ));
                    (format!("c{c}"), a)
                })
                .collect();
            RecordBatch::try_from_iter(columns).expect("batch")
        })
        .collect()
}

async fn put_on(store: &Store, name: &str, device: u32, batches: &[RecordBatch]) {
    let mut put = store
        .begin_put_on(name.to_owned(), PutMode::Replace, "bench", Some(device))
        .expect("begin");
    put.declare_schema(batches[0].schema()).expect("schema");
    for batch in batches {
        if let Some(upload) = put.upload(batch.clone(), None).await.expect("reserve") {
            put.add(upload.await.expect("upload"));
        }
    }
    put.commit().await.expect("commit");
}

/// Reads all of `names` at once, as DoGet does; returns the seconds it took.
async fn stage(store: &Store, names: &[String], args: &Args) -> f64 {
    let start = Instant::now();
    let reads = names.iter().map(|name| {
        let dataset = store.get(name).expect("dataset");
        let stream = dataset
            .read(0..dataset.num_rows(), args.chunk_mib << 20, args.prefetch)
            .expect("read");
        tokio::spawn(stream.try_fold(0usize, |n, b| async move { Ok(n + b.num_rows()) }))
    });
    for read in futures::future::join_all(reads).await {
        read.expect("join").expect("read");
    }
    start.elapsed().as_secs_f64()
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let ordinals = if args.ordinals.is_empty() {
        CudaBackend::visible_devices().expect("CUDA")
    } else {
        args.ordinals.clone()
    };
    let backend = Arc::new(CudaBackend::open_all(&ordinals).expect("CUDA devices"));
    let devices = backend.devices();
    println!("devices (CUDA ordinal, name, PCI bus, NUMA node):");
    for (index, device) in devices.iter().enumerate() {
        println!(
            "  {index}: {} {} {} {:?}",
            device.ordinal,
            device.name,
            device.pci_bus_id.as_deref().unwrap_or("?"),
            device.numa_node
        );
    }
    println!(
        "peer access (row reads column): {:?}",
        backend.peer_access()
    );
    let store = Store::new(backend, StoreOptions::default());
    let count = devices.len() as u32;
    let mut names = Vec::new();
    let mut bytes = 0;
    for device in 0..count {
        let data = batches(args.gib, i64::from(device) << 40);
        bytes = data.iter().map(batch_bytes).sum::<u64>();
        let name = format!("d{device}");
        put_on(&store, &name, device, &data).await;
        names.push(name);
    }
    println!(
        "{:.2} GB on each device; best of {}",
        bytes as f64 / 1e9,
        args.repeat
    );

    println!("move (peer copy + commit), GB/s:");
    for from in 0..count {
        for to in (0..count).filter(|&to| to != from) {
            let mut best = f64::MAX;
            for _ in 0..args.repeat.max(1) {
                let start = Instant::now();
                let moved = store
                    .move_dataset(&names[from as usize], to)
                    .await
                    .expect("move");
                best = best.min(start.elapsed().as_secs_f64());
                assert_eq!(moved.moved_bytes, bytes);
                store
                    .move_dataset(&names[from as usize], from)
                    .await
                    .expect("move back");
            }
            println!("  {from} -> {to}: {:>8.1}", bytes as f64 / best / 1e9);
        }
    }

    println!("staging reads (device to pinned host memory), GB/s:");
    for device in 0..count as usize {
        let mut best = f64::MAX;
        for _ in 0..args.repeat.max(1) {
            best = best.min(stage(&store, &names[device..=device], &args).await);
        }
        println!(
            "  device {device} alone: {:>8.1}",
            bytes as f64 / best / 1e9
        );
    }
    if count > 1 {
        let mut best = f64::MAX;
        for _ in 0..args.repeat.max(1) {
            best = best.min(stage(&store, &names, &args).await);
        }
        println!(
            "  all {count} at once:  {:>8.1}",
            (bytes * u64::from(count)) as f64 / best / 1e9
        );
    }
}
