//! A co-located Rust consumer: maps a dataset's columns from a gpu-flight server on this node
//! through `ipc-export`, prints where they are, reads them (a host copy, to show the bytes),
//! and releases the lease.
//!
//! ```text
//! cargo run --release --example ipc_consumer -- --server http://127.0.0.1:8815 --name trips
//! ```
//!
//! `--verify` also reads the dataset with DoGet and checks that both agree; `--device N`
//! names the GPU this process computes on, and `--copy` replicates onto it what lies
//! elsewhere. The first partition's buffers are printed.

use std::time::Instant;

use arrow::array::Array;
use arrow_flight::FlightClient;
use clap::Parser;
use futures::TryStreamExt;
use gpu_flight::consumer::{self, ExportOptions, MappedDataset};

#[derive(Debug, Parser)]
struct Args {
    #[arg(long, default_value = "http://127.0.0.1:8815")]
    server: String,
    #[arg(long)]
    name: String,
    /// Columns to map (all when absent).
    #[arg(long, value_delimiter = ',')]
    columns: Vec<String>,
    #[arg(long, default_value_t = 300)]
    lease_seconds: u64,
    #[arg(long)]
    verify: bool,
    /// The GPU this process computes on (its ordinal here): partitions on other GPUs are
    /// mapped for peer access from it.
    #[arg(long)]
    device: Option<u32>,
    /// With --device: replicate partitions on other GPUs onto it for the lease.
    #[arg(long, requires = "device")]
    copy: bool,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let channel = tonic::transport::Channel::from_shared(args.server.clone())?
        .connect()
        .await?;
    let mut client = FlightClient::new(channel);
    let mut options = ExportOptions {
        columns: (!args.columns.is_empty()).then(|| args.columns.clone()),
        lease_seconds: args.lease_seconds,
        ..ExportOptions::default()
    };
    if let Some(ordinal) = args.device {
        options = options.on_device(ordinal)?;
        options.copy = args.copy;
    }
    let started = Instant::now();
    let document = consumer::export(&mut client, &args.name, &options).await?;
    let exported = started.elapsed();
    let mapped = MappedDataset::open(&document)?;
    let opened = started.elapsed();
    println!(
        "'{}': {} rows in {} partitions, {} allocations mapped; export {:.3} ms, \
         export + open {:.3} ms; lease {} until {}",
        args.name,
        mapped.num_rows(),
        mapped.partitions().len(),
        mapped.mapped_allocations(),
        exported.as_secs_f64() * 1e3,
        opened.as_secs_f64() * 1e3,
        document.lease,
        document.expires_at
    );
    for (index, partition) in mapped.partitions().iter().enumerate() {
        println!(
            "  partition {index}: {} rows on GPU {} ({:?}), mapped on device {} here",
            partition.num_rows(),
            partition.holder().uuid,
            partition.access(),
            partition.device_ordinal()
        );
    }
    let expected = if args.verify {
        let batches: Vec<_> = client
            .do_get(arrow_flight::Ticket::new(args.name.clone()))
            .await?
            .try_collect()
            .await?;
        Some(arrow::compute::concat_batches(
            &batches[0].schema(),
            &batches,
        )?)
    } else {
        None
    };
    for (index, field) in mapped.schema().fields().iter().enumerate() {
        let buffers: Vec<String> = mapped.partitions()[0]
            .column_buffers(index)?
            .iter()
            .map(|b| format!("{:?} {:#x} ({} B)", b.kind, b.address, b.length))
            .collect();
        let column = mapped.read_column(index)?;
        println!(
            "  {} {}: {} nulls; {}",
            field.name(),
            field.data_type(),
            column.null_count(),
            buffers.join(", ")
        );
        if let Some(full) = &expected {
            let same = full
                .column_by_name(field.name())
                .is_some_and(|e| e.as_ref() == column.as_ref());
            if !same {
                return Err(format!("column {} differs from DoGet", field.name()).into());
            }
        }
    }
    if expected.is_some() {
        println!("every column equals what DoGet returns");
    }
    drop(mapped);
    consumer::release(&mut client, &document.lease).await?;
    println!("released lease {}", document.lease);
    Ok(())
}
