//! `ipc-import`: a co-located producer's GPU columns copied into a dataset.
//!
//! On the host backend (everywhere): malformed and forged documents are refused with
//! INVALID_ARGUMENT, a well-formed one with FAILED_PRECONDITION (it needs the cuda backend),
//! and nothing is ever committed (the role, write, is in the role table's tests). On a GPU (ignored elsewhere): a
//! second process, this test binary re-run as [`producer_process`], hands the server the
//! columns of datasets of every type held by a CUDA server of its own (their `ipc-export`
//! handles, so every buffer lies where an export says) and columns it allocated itself (through
//! `gpu_flight::consumer::import_document`), which must then read back exactly; forged
//! documents over real handles, the server's own handles, and a producer that exits mid-call
//! commit nothing and leak nothing.

mod common;

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use arrow::array::{ArrayRef, Int64Array, ListArray, StringArray};
use arrow::datatypes::{DataType, Field, Int32Type, Schema};
use arrow::record_batch::RecordBatch;
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use common::*;
use gpu_flight::backend::cuda::ImportDevice;
use gpu_flight::backend::{Backend, BufferKind, CudaBackend, HostBackend};
use gpu_flight::consumer::{self, DeviceBuffer, DeviceColumn, ExportOptions};
use gpu_flight::flight::ipc_export::{
    ArrayDocument, BufferDocument, ColumnDocument, DeviceDocument, ImportDocument,
};
use gpu_flight::store::PutMode;
use serde_json::{Value, json};
use tonic::Code;

/// Set in the environment of the second process: what it should do, as JSON.
const CHILD_ENV: &str = "GPU_FLIGHT_IMPORT_CHILD";

fn cuda() -> Arc<dyn Backend> {
    Arc::new(CudaBackend::open(0).expect("CUDA device 0"))
}

fn schema_base64(schema: &Schema) -> String {
    let options = arrow::ipc::writer::IpcWriteOptions::default();
    let message =
        arrow_flight::IpcMessage::try_from(arrow_flight::SchemaAsIpc::new(schema, &options))
            .expect("schema");
    BASE64.encode(&message.0)
}

fn buffer(kind: BufferKind, offset: u64, length: u64) -> BufferDocument {
    BufferDocument {
        kind,
        offset,
        length,
        handle: None,
        allocation_bytes: None,
    }
}

/// A well-formed document for `rows` rows of one int64 column in a made-up allocation.
fn int64_document(name: &str, rows: u64) -> ImportDocument {
    let schema = Schema::new(vec![Field::new("x", DataType::Int64, true)]);
    ImportDocument {
        version: Some(1),
        name: name.to_owned(),
        mode: None,
        device: DeviceDocument {
            device: None,
            ordinal: 0,
            uuid: "GPU-00000000-0000-0000-0000-000000000000".to_owned(),
            pci_bus_id: "0000:00:00.0".to_owned(),
        },
        num_rows: rows,
        schema: schema_base64(&schema),
        columns: vec![ColumnDocument {
            handle: BASE64.encode([7u8; 64]),
            allocation_bytes: 2 << 20,
            array: ArrayDocument {
                name: String::new(),
                data_type: String::new(),
                length: rows,
                null_count: 0,
                buffers: vec![buffer(BufferKind::Values, 0, rows * 8)],
                children: vec![],
                dictionary: None,
            },
        }],
    }
}

fn body(document: &ImportDocument) -> Value {
    serde_json::to_value(document).expect("document")
}

#[tokio::test]
async fn the_host_backend_refuses_imports_and_commits_nothing() {
    let server = TestServer::start(Arc::new(HostBackend::new())).await;
    let mut client = server.client().await;
    let refused = action(&mut client, "ipc-import", body(&int64_document("t", 100)))
        .await
        .expect_err("host memory cannot import");
    assert_eq!(code_of(&refused), Code::FailedPrecondition, "{refused}");
    assert!(refused.to_string().contains("cuda backend"), "{refused}");
    let zero = action(&mut client, "ipc-import", body(&int64_document("t", 0)))
        .await
        .expect_err("no rows either");
    assert_eq!(code_of(&zero), Code::FailedPrecondition, "{zero}");

    let well_formed = body(&int64_document("t", 100));
    let with = |path: &[&str], value: Value| {
        let mut document = well_formed.clone();
        let mut at = &mut document;
        for key in &path[..path.len() - 1] {
            at = match key.parse::<usize>() {
                Ok(index) => &mut at[index],
                Err(_) => &mut at[*key],
            };
        }
        at[path[path.len() - 1]] = value;
        document
    };
    let buffer_field =
        |field: &str, value: Value| with(&["columns", "0", "buffers", "0", field], value);
    let cases: Vec<(&str, Value, &str)> = vec![
        ("not an object", json!([1, 2]), "JSON object"),
        ("no name", json!({"num_rows": 1}), "name"),
        ("unknown field", with(&["colour"], json!("red")), "colour"),
        ("a bad name", with(&["name"], json!("")), "empty"),
        ("a newer version", with(&["version"], json!(2)), "version"),
        ("a bad mode", with(&["mode"], json!("upsert")), "upsert"),
        ("a bad schema", with(&["schema"], json!("!!")), "base64"),
        (
            "schema not IPC",
            with(&["schema"], json!(BASE64.encode(b"nonsense"))),
            "schema",
        ),
        ("no columns", with(&["columns"], json!([])), "1 fields"),
        (
            "a short handle",
            with(&["columns", "0", "handle"], json!(BASE64.encode([1u8; 10]))),
            "64 bytes",
        ),
        (
            "rows mismatch",
            with(&["num_rows"], json!(101)),
            "101 are expected",
        ),
        (
            "short values",
            buffer_field("length", json!(799)),
            "need 800",
        ),
        (
            "outside the allocation",
            buffer_field("offset", json!((2 << 20) - 8)),
            "outside the allocation",
        ),
        (
            "offset overflow",
            buffer_field("offset", json!(u64::MAX)),
            "outside the allocation",
        ),
        (
            "offsets for int64",
            buffer_field("kind", json!("offsets")),
            "buffers",
        ),
        ("a bad kind", buffer_field("kind", json!("bits")), "bits"),
        (
            "a buffer handle without its size",
            buffer_field("handle", json!(BASE64.encode([3u8; 64]))),
            "go together",
        ),
        (
            "nulls without a bitmap",
            with(&["columns", "0", "null_count"], json!(3)),
            "validity",
        ),
        (
            "children of an int64",
            with(
                &["columns", "0", "children"],
                json!([{"length": 1, "null_count": 0, "buffers": [], "children": []}]),
            ),
            "children",
        ),
        ("too many rows", with(&["num_rows"], json!(u64::MAX)), ""),
    ];
    for (label, document, expected) in cases {
        let error = action(&mut client, "ipc-import", document)
            .await
            .expect_err(label);
        assert_eq!(code_of(&error), Code::InvalidArgument, "{label}: {error}");
        assert!(error.to_string().contains(expected), "{label}: {error}");
    }
    let status = status(&mut client).await;
    assert_eq!(status["datasets"], 0, "nothing committed: {status}");
    assert_eq!(status["puts"], json!([]), "no put left behind");
    server.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA device"]
async fn the_servers_own_handles_are_refused_cleanly() {
    // Opening a handle in the process that exported it fails: the driver's rule.
    let server = TestServer::start(cuda()).await;
    let mut client = server.client().await;
    put(&mut client, path("t"), vec![int64_batch(100_000, 2, 0)])
        .await
        .expect("put");
    let start = device_bytes(&status(&mut client).await);
    let options = ExportOptions::default();
    let export = consumer::export(&mut client, "t", &options)
        .await
        .expect("export");
    let document = from_export(&export, 0, "again", PutMode::Create);
    let error = consumer::import(&mut client, &document)
        .await
        .expect_err("the server's own memory");
    assert!(error.to_string().contains("could not be opened"), "{error}");
    consumer::release(&mut client, &export.lease)
        .await
        .expect("release");
    let after = status(&mut client).await;
    assert_eq!(after["datasets"], 1, "nothing committed");
    assert_eq!(device_bytes(&after), start, "nothing kept");
    server.shutdown_and_wait().await;
}

fn device_bytes(status: &Value) -> u64 {
    status["counters"]["device_allocated_bytes"]
        .as_u64()
        .expect("device_allocated_bytes")
}

/// The import document of partition `index` of an export: the same columns, named for
/// another dataset.
fn from_export(
    export: &gpu_flight::flight::ipc_export::ExportDocument,
    index: usize,
    name: &str,
    mode: PutMode,
) -> ImportDocument {
    let partition = &export.partitions[index];
    ImportDocument {
        version: Some(1),
        name: name.to_owned(),
        mode: Some(mode),
        device: partition.device.clone(),
        num_rows: partition.num_rows,
        schema: export.schema.clone(),
        columns: partition.columns.clone(),
    }
}

/// The datasets the producer process puts into its own server and hands over, by name.
fn produced() -> Vec<(&'static str, Vec<RecordBatch>)> {
    vec![
        ("single", vec![all_types_batch(333).slice(5, 300)]),
        (
            "many",
            vec![
                all_types_batch(100),
                all_types_batch(37),
                all_types_batch(500).slice(3, 201),
            ],
        ),
        (
            "wide",
            (0..4).map(|i| int64_batch(300_000, 8, i * 7)).collect(),
        ),
    ]
}

/// Columns the producer allocates itself: int64 with nulls, strings and a list, each buffer
/// in an allocation of its own.
fn pointer_batch() -> RecordBatch {
    let ints: ArrayRef = Arc::new(Int64Array::from(
        (0..1000)
            .map(|i| (i % 7 != 0).then_some(i * 3))
            .collect::<Vec<_>>(),
    ));
    let words: ArrayRef = Arc::new(StringArray::from(
        (0..1000).map(|i| format!("w{i}é")).collect::<Vec<_>>(),
    ));
    let lists: ArrayRef = Arc::new(ListArray::from_iter_primitive::<Int32Type, _, _>(
        (0..1000).map(|i| Some((0..i % 4).map(Some).collect::<Vec<_>>())),
    ));
    RecordBatch::try_from_iter([("ints", ints), ("words", words), ("lists", lists)]).expect("batch")
}

async fn run_producer(task: Value) -> String {
    let described = task.to_string();
    let output = tokio::task::spawn_blocking(move || producer_command(task).output())
        .await
        .expect("join")
        .expect("run the producer");
    let log = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success() && log.contains("produced"),
        "producer {described} failed:\n{log}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    log
}

fn producer_command(task: Value) -> Command {
    let mut command = Command::new(std::env::current_exe().expect("test binary"));
    command
        .args([
            "producer_process",
            "--exact",
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, task.to_string());
    command
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA device"]
async fn a_producer_process_hands_over_every_type_and_it_reads_back_exactly() {
    let server = TestServer::start(cuda()).await;
    let mut client = server.client().await;
    let start = device_bytes(&status(&mut client).await);
    // The producer compares what this server reads back with what its own does (merged
    // dictionaries included).
    run_producer(json!({"mode": "exports", "addr": server.addr.to_string()})).await;
    for (name, batches) in produced() {
        let rows: usize = batches.iter().map(RecordBatch::num_rows).sum();
        let got = get_all(&mut client, name).await.expect("DoGet");
        assert_eq!(
            got.iter().map(RecordBatch::num_rows).sum::<usize>(),
            rows,
            "{name}"
        );
    }
    // The producer and its server are gone: the copies are the server's own.
    run_producer(json!({"mode": "pointers", "addr": server.addr.to_string()})).await;
    let got = get_all(&mut client, "pointers").await.expect("DoGet");
    assert_eq!(concat(&got[0].schema(), &got), pointer_batch());
    // Exported again, the imported data maps like any dataset's.
    let export = consumer::export(&mut client, "pointers", &ExportOptions::default())
        .await
        .expect("export an imported dataset");
    assert_eq!(export.num_rows, 1000);
    consumer::release(&mut client, &export.lease)
        .await
        .expect("release");
    let counters = &status(&mut client).await["counters"];
    assert!(counters["imports"].as_u64() >= Some(4), "{counters}");
    for (name, _) in produced() {
        action(&mut client, "drop", json!({"name": name}))
            .await
            .expect("drop");
    }
    action(&mut client, "drop", json!({"name": "pointers"}))
        .await
        .expect("drop");
    wait_until(|| async { device_bytes(&status(&mut server.client().await).await) == start }).await;
    server.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA device"]
async fn forged_documents_over_real_handles_commit_nothing_and_leak_nothing() {
    let server = TestServer::start(cuda()).await;
    let mut client = server.client().await;
    let start = device_bytes(&status(&mut client).await);
    let log = run_producer(json!({"mode": "hostile", "addr": server.addr.to_string()})).await;
    assert!(!log.contains("UNEXPECTED"), "{log}");
    let after = status(&mut client).await;
    assert_eq!(after["datasets"], 0, "{after}");
    assert_eq!(device_bytes(&after), start, "{after}");
    assert_eq!(after["counters"]["pinned_leased_bytes"], 0, "{after}");
    server.shutdown_and_wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA device"]
async fn a_producer_that_exits_mid_call_leaves_all_or_nothing() {
    let server = TestServer::start(cuda()).await;
    let mut client = server.client().await;
    let start = device_bytes(&status(&mut client).await);
    for delay_ms in [0, 1, 5, 20] {
        run_producer(
            json!({"mode": "exit", "addr": server.addr.to_string(), "delay_ms": delay_ms}),
        )
        .await;
        // Whatever the call got to: no put left, and the dataset whole or absent.
        wait_until(|| async { status(&mut server.client().await).await["puts"] == json!([]) })
            .await;
        if let Ok(batches) = get_all(&mut client, "gone").await {
            let rows: usize = batches.iter().map(RecordBatch::num_rows).sum();
            assert_eq!(rows, 4 << 20, "all of it");
            action(&mut client, "drop", json!({"name": "gone"}))
                .await
                .expect("drop");
        }
    }
    wait_until(|| async { device_bytes(&status(&mut server.client().await).await) == start }).await;
    server.shutdown_and_wait().await;
}

/// The second process of the GPU tests; does nothing unless started by one of them.
#[test]
#[ignore = "needs a CUDA device"]
fn producer_process() {
    let Ok(task) = std::env::var(CHILD_ENV) else {
        return;
    };
    let task: Value = serde_json::from_str(&task).expect("task");
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async move {
        let addr = task["addr"].as_str().expect("addr");
        let mut target = connect(addr.parse().expect("address")).await;
        match task["mode"].as_str() {
            Some("exports") => hand_over_exports(&mut target).await,
            Some("pointers") => hand_over_pointers(&mut target).await,
            Some("hostile") => forge(&mut target).await,
            Some("exit") => exit_mid_call(target, task["delay_ms"].as_u64().unwrap_or(0)).await,
            other => panic!("unknown mode {other:?}"),
        }
        println!("produced");
    });
}

/// Puts [`produced`] into a CUDA server of this process, and hands each partition of each to
/// the target server, the first as `create`, the rest as `append`.
async fn hand_over_exports(target: &mut arrow_flight::FlightClient) {
    let own = TestServer::start(cuda()).await;
    let mut client = own.client().await;
    for (name, batches) in produced() {
        put(&mut client, path(name), batches).await.expect("put");
        let export = consumer::export(&mut client, name, &ExportOptions::default())
            .await
            .expect("export");
        for index in 0..export.partitions.len() {
            let mode = if index == 0 {
                PutMode::Create
            } else {
                PutMode::Append
            };
            let document = from_export(&export, index, name, mode);
            let summary = consumer::import(target, &document).await.expect("import");
            assert_eq!(summary.rows, export.partitions[index].num_rows);
        }
        consumer::release(&mut client, &export.lease)
            .await
            .expect("release");
        let theirs = get_all(target, name).await.expect("DoGet there");
        let ours = get_all(&mut client, name).await.expect("DoGet here");
        assert_eq!(
            concat(&theirs[0].schema(), &theirs),
            concat(&ours[0].schema(), &ours),
            "{name} reads back as it was put"
        );
        println!("{name}: handed over and read back");
    }
    own.shutdown_and_wait().await;
}

/// Device memory of this process holding each buffer of `array` (a column of
/// [`pointer_batch`]), in allocations of their own, and its description.
fn upload_column(
    device: &ImportDevice,
    array: &arrow::array::ArrayData,
    kept: &mut Vec<gpu_flight::backend::cuda::DeviceMemory>,
) -> DeviceColumn {
    let mut buffers = Vec::new();
    let mut add = |kind, bytes: &[u8]| {
        let memory = device.upload(bytes).expect("upload");
        buffers.push(DeviceBuffer {
            kind,
            address: memory.address(),
            length: bytes.len() as u64,
        });
        kept.push(memory);
    };
    if let Some(nulls) = array.nulls() {
        add(BufferKind::Validity, nulls.buffer().as_slice());
    }
    match array.data_type() {
        DataType::Int64 => add(BufferKind::Values, array.buffers()[0].as_slice()),
        DataType::Int32 => add(BufferKind::Values, array.buffers()[0].as_slice()),
        DataType::Utf8 => {
            add(BufferKind::Offsets, array.buffers()[0].as_slice());
            add(BufferKind::Values, array.buffers()[1].as_slice());
        }
        DataType::List(_) => add(BufferKind::Offsets, array.buffers()[0].as_slice()),
        other => panic!("{other}"),
    }
    let children = array
        .child_data()
        .iter()
        .map(|child| upload_column(device, child, kept))
        .collect();
    DeviceColumn {
        length: array.len() as u64,
        null_count: array.null_count() as u64,
        buffers,
        children,
        dictionary: None,
    }
}

/// `pointer_batch()` uploaded into this process's GPU memory, and the document that hands it
/// over as `name`; the memory lives as long as the returned holder.
fn pointer_document(name: &str) -> (ImportDocument, Vec<gpu_flight::backend::cuda::DeviceMemory>) {
    let device = ImportDevice::by_ordinal(0).expect("GPU 0");
    let batch = pointer_batch();
    let mut kept = Vec::new();
    let columns: Vec<DeviceColumn> = batch
        .columns()
        .iter()
        .map(|c| upload_column(&device, &c.to_data(), &mut kept))
        .collect();
    let document = consumer::import_document(
        &device,
        name,
        PutMode::Create,
        &batch.schema(),
        batch.num_rows() as u64,
        &columns,
    )
    .expect("document");
    (document, kept)
}

async fn hand_over_pointers(target: &mut arrow_flight::FlightClient) {
    let (document, kept) = pointer_document("pointers");
    consumer::import(target, &document).await.expect("import");
    drop(kept); // freed as soon as the call returned
}

/// Forged documents over real memory of this process; prints UNEXPECTED for any answer but a
/// refusal with INVALID_ARGUMENT.
async fn forge(target: &mut arrow_flight::FlightClient) {
    let (document, kept) = pointer_document("forged");
    let device = ImportDevice::by_ordinal(0).expect("GPU 0");
    let mut cases: Vec<(&str, ImportDocument)> = Vec::new();
    let mut forged = |label, change: &dyn Fn(&mut ImportDocument)| {
        let mut copy = document.clone();
        change(&mut copy);
        cases.push((label, copy));
    };
    forged("a larger allocation than the handle maps", &|d| {
        d.columns[0].allocation_bytes = 1 << 40;
        d.columns[0].array.buffers[0].allocation_bytes = None;
        d.columns[0].array.buffers[0].handle = None;
    });
    forged("a handle of nothing", &|d| {
        d.columns[0].handle = BASE64.encode([0x5a; 64]);
    });
    forged("a buffer past its allocation's end", &|d| {
        let values = &mut d.columns[0].array.buffers[1];
        values.offset = values.allocation_bytes.unwrap_or(1 << 21) - 8;
    });
    forged("string bytes shorter than the offsets say", &|d| {
        d.columns[1].array.buffers[1].length -= 1;
    });
    forged("string offsets shifted past their allocation's end", &|d| {
        d.columns[1].array.buffers[0].offset += 4;
    });
    forged("a list child of fewer rows than referenced", &|d| {
        d.columns[2].array.children[0].length -= 1;
    });
    forged("a wrong GPU", &|d| {
        d.device.uuid = "GPU-ffffffff-ffff-ffff-ffff-ffffffffffff".to_owned();
        d.device.pci_bus_id = "ffff:ff:ff.f".to_owned();
    });
    for (label, document) in cases {
        match consumer::import(target, &document).await {
            Err(consumer::ConsumerError::Flight(error))
                if code_of(&error) == Code::InvalidArgument =>
            {
                println!("{label}: refused ({error})");
            }
            other => println!("UNEXPECTED {label}: {other:?}"),
        }
    }
    // Memory freed before the call: its handle is stale.
    let freed = device.upload(&[1u8; 4096]).expect("upload");
    let stale = consumer::import_document(
        &device,
        "stale",
        PutMode::Create,
        &Schema::new(vec![Field::new("x", DataType::Int64, false)]),
        512,
        &[DeviceColumn {
            length: 512,
            null_count: 0,
            buffers: vec![DeviceBuffer {
                kind: BufferKind::Values,
                address: freed.address(),
                length: 4096,
            }],
            children: vec![],
            dictionary: None,
        }],
    )
    .expect("document");
    drop(freed);
    match consumer::import(target, &stale).await {
        Err(consumer::ConsumerError::Flight(error)) if code_of(&error) == Code::InvalidArgument => {
            println!("stale: refused ({error})");
        }
        // The driver may hand the same block out again, mapped under the same handle.
        Ok(_) => {
            action(target, "drop", json!({"name": "stale"}))
                .await
                .expect("drop");
        }
        other => println!("UNEXPECTED stale: {other:?}"),
    }
    drop(kept);
}

/// Starts importing 32 MiB of int64s and exits `delay_ms` later, without waiting.
async fn exit_mid_call(mut target: arrow_flight::FlightClient, delay_ms: u64) {
    let device = ImportDevice::by_ordinal(0).expect("GPU 0");
    let rows = 4usize << 20;
    let values: Vec<u8> = (0..rows as i64).flat_map(|v| v.to_le_bytes()).collect();
    let memory = device.upload(&values).expect("upload");
    let document = consumer::import_document(
        &device,
        "gone",
        PutMode::Create,
        &Schema::new(vec![Field::new("x", DataType::Int64, false)]),
        rows as u64,
        &[DeviceColumn {
            length: rows as u64,
            null_count: 0,
            buffers: vec![DeviceBuffer {
                kind: BufferKind::Values,
                address: memory.address(),
                length: values.len() as u64,
            }],
            children: vec![],
            dictionary: None,
        }],
    )
    .expect("document");
    tokio::spawn(async move { consumer::import(&mut target, &document).await });
    tokio::time::sleep(Duration::from_millis(delay_ms)).await;
    println!("produced");
    std::process::exit(0);
}
