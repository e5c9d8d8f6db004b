//! A seeded mutation fuzzer for what a server reads back from `--data-dir`: a disk, a backup
//! tool or an operator may hand it damaged files, and it must never panic, hang, or serve rows
//! it did not store without saying so.
//!
//! A data directory is written through the store (every Arrow type, strings, dictionaries,
//! appends making several segments per dataset, an empty dataset). Each case copies it and
//! damages one file: a segment (bits flipped, words overwritten with edge values, truncated,
//! extended), the manifest (its JSON values replaced with edge values, segments dropped,
//! duplicated or swapped between datasets, or raw bytes damaged), or the journal of a copy
//! whose catalog is held as journal records after an empty checkpoint (raw bytes damaged, or
//! a record's values replaced). Half the cases then forge the checksums (the segment's size
//! and CRC-32 in the manifest, the manifest's own header, the record's) so that the damage
//! reaches the decoders instead of the checks. Then the directory is opened and every dataset
//! read in full.
//!
//! After every case:
//! - nothing panicked outside Arrow's IPC decoder (whose asserts on forged files the store
//!   catches and reports as corruption);
//! - an open that fails names a file of the directory, and one that succeeds lists datasets;
//! - without forged checksums, a damaged segment fails the start (its size changed) or the
//!   reads of its own dataset with `Corrupt`, and every other dataset reads back exactly as
//!   stored; a damaged manifest fails the start; a damaged journal fails the start, or (where
//!   only its end is damaged, as a crash mid-append leaves it) opens as the catalog some
//!   prefix of its records makes, every dataset reading back exactly so;
//! - with forged checksums, a read either fails or returns valid Arrow data of the rows the
//!   dataset lists.
//!
//! A fixed case first: a forged manifest that miscounts one segment's rows fails that
//! dataset's reads as corrupt.
//!
//! Every run prints its seed; replay with `GPU_FLIGHT_FUZZ_SEED=<seed>`, and run more cases
//! with `GPU_FLIGHT_DISK_FUZZ_CASES=<n>` (default 150).

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use arrow::record_batch::RecordBatch;
use common::all_types_batch;
use common::datadir::{TempDataDir, read_manifest, write_manifest, write_manifest_body};
use common::devices::put;
use futures::TryStreamExt;
use gpu_flight::backend::HostBackend;
use gpu_flight::store::{PutMode, Store, StoreError, StoreOptions};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;

/// Panics outside Arrow's IPC code, with where they happened.
static PANICS: Mutex<Vec<String>> = Mutex::new(Vec::new());
static DECODER_PANICS: AtomicUsize = AtomicUsize::new(0);

fn install_panic_hook() {
    static INSTALLED: OnceLock<()> = OnceLock::new();
    INSTALLED.get_or_init(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let location = info
                .location()
                .map(|l| format!("{}:{}", l.file(), l.line()))
                .unwrap_or_default();
            // Arrow's decoder asserts on some malformed layouts; the store catches those.
            if location.contains("/arrow-") {
                DECODER_PANICS.fetch_add(1, Ordering::Relaxed);
            } else {
                let message = info
                    .payload()
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| info.payload().downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                PANICS
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(format!("{location}: {message}"));
                previous(info);
            }
        }));
    });
}

fn options(dir: &Path) -> StoreOptions {
    StoreOptions {
        data_dir: Some(dir.to_owned()),
        ..StoreOptions::default()
    }
}

async fn open(dir: &Path) -> Result<Store, StoreError> {
    Store::open(Arc::new(HostBackend::new()), options(dir)).await
}

async fn read(store: &Store, name: &str) -> Result<Vec<RecordBatch>, StoreError> {
    let dataset = store.get(name)?;
    dataset
        .read(0..dataset.num_rows(), 64 << 10, 2)?
        .try_collect()
        .await
}

fn dictionary_batch(seed: usize) -> RecordBatch {
    let words: arrow::array::DictionaryArray<arrow::datatypes::Int32Type> = (0..500)
        .map(|i| (i % 7 != 3).then(|| ["a", "bb", "ccc", "dddd"][(i + seed) % 4]))
        .collect();
    let column: arrow::array::ArrayRef = Arc::new(words);
    RecordBatch::try_from_iter([("d", column)]).expect("batch")
}

/// Writes the directory every case starts from, and returns what each dataset holds.
async fn original(dir: &Path) -> BTreeMap<String, Vec<RecordBatch>> {
    let store = open(dir).await.expect("a fresh directory");
    let mut stored: BTreeMap<String, Vec<RecordBatch>> = BTreeMap::new();
    let mut add = |name: &str, batch: RecordBatch| {
        stored.entry(name.to_owned()).or_default().push(batch);
    };
    for (name, batch, mode) in [
        ("types", all_types_batch(300), PutMode::Create),
        ("types", all_types_batch(77), PutMode::Append),
        ("strings", common::string_batch(2000, 1), PutMode::Create),
        ("strings", common::string_batch(500, 9), PutMode::Append),
        ("strings", common::string_batch(200, 4), PutMode::Append),
        ("dictionary", dictionary_batch(0), PutMode::Create),
        ("dictionary", dictionary_batch(1), PutMode::Append),
        ("ints", common::int64_batch(5000, 3, 7), PutMode::Create),
    ] {
        put(&store, name, mode, None, std::slice::from_ref(&batch))
            .await
            .expect("put");
        add(name, batch);
    }
    let schema = Arc::new(arrow::datatypes::Schema::new(vec![
        arrow::datatypes::Field::new("x", arrow::datatypes::DataType::Int64, true),
    ]));
    let mut pending = store
        .begin_put("empty".to_owned(), PutMode::Create, "fuzz")
        .expect("begin");
    pending.declare_schema(Arc::clone(&schema)).expect("schema");
    pending.commit().await.expect("commit");
    stored.insert("empty".to_owned(), Vec::new());
    store.close().await;
    stored
}

fn copy_dir(from: &Path, to: &Path) {
    let _ = std::fs::remove_dir_all(to);
    std::fs::create_dir_all(to.join("segments")).expect("mkdir");
    std::fs::copy(from.join("manifest.json"), to.join("manifest.json")).expect("manifest");
    if from.join("journal").exists() {
        std::fs::copy(from.join("journal"), to.join("journal")).expect("journal");
    }
    for entry in std::fs::read_dir(from.join("segments"))
        .expect("segments")
        .flatten()
    {
        std::fs::copy(entry.path(), to.join("segments").join(entry.file_name())).expect("copy");
    }
}

/// The rows of `batches`, if any.
fn rows_of(batches: &[RecordBatch]) -> Option<RecordBatch> {
    let schema = batches.first()?.schema();
    arrow::compute::concat_batches(&schema, batches).ok()
}

/// What each dataset holds: its rows, in one batch (none for no rows).
type Contents = BTreeMap<String, Option<RecordBatch>>;

/// A journal record as the server writes it: length, CRC-32, then the JSON.
fn record(payload: &Value) -> Vec<u8> {
    let payload = serde_json::to_vec(payload).expect("json");
    let mut bytes = (payload.len() as u32).to_le_bytes().to_vec();
    bytes.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    bytes.extend_from_slice(&payload);
    bytes
}

/// Rewrites the catalog of `dir` (a copy of the pristine directory, whose journal is empty) as
/// journal records after an empty checkpoint: each dataset set with its first segment, then
/// its further segments appended one a record. Returns the records' payloads, and the
/// catalog as each prefix of them makes it (`stored` being what the datasets hold).
fn journalize(
    dir: &Path,
    stored: &BTreeMap<String, Vec<RecordBatch>>,
) -> (Vec<Value>, Vec<Contents>) {
    let manifest = read_manifest(dir);
    let mut payloads = Vec::new();
    let mut states = vec![Contents::new()];
    let mut held: BTreeMap<String, u64> = BTreeMap::new();
    for (name, entry) in manifest["datasets"].as_object().expect("datasets") {
        let all = rows_of(&stored[name]);
        for (index, segment) in entry["segments"]
            .as_array()
            .expect("segments")
            .iter()
            .enumerate()
        {
            let mut one = entry.clone();
            one["segments"] = Value::Array(vec![segment.clone()]);
            let op = if index == 0 { "set" } else { "append" };
            let seq = payloads.len() + 1;
            payloads.push(
                serde_json::json!({"seq": seq, "change": {op: {"name": name, "entry": one}}}),
            );
            let rows = held.entry(name.clone()).or_default();
            *rows += segment["rows"].as_u64().expect("rows");
            let mut state = states.last().expect("a state").clone();
            state.insert(
                name.clone(),
                all.as_ref().map(|all| all.slice(0, *rows as usize)),
            );
            states.push(state);
        }
    }
    write_manifest_body(dir, br#"{"datasets":{}}"#);
    let journal: Vec<u8> = payloads.iter().flat_map(record).collect();
    std::fs::write(dir.join("journal"), journal).expect("journal");
    (payloads, states)
}

fn damage_journal(
    rng: &mut StdRng,
    dir: &Path,
    forge: bool,
    payloads: &[Value],
    states: &[Contents],
) -> Case {
    if !forge {
        let path = dir.join("journal");
        let mut bytes = std::fs::read(&path).expect("journal");
        let what = damage_bytes(rng, &mut bytes);
        std::fs::write(&path, &bytes).expect("write");
        return Case {
            what: format!("journal bytes: {what}"),
            damaged: None,
            manifest: true,
            forged: false,
            states: Some(states.to_vec()),
        };
    }
    let mut payloads = payloads.to_vec();
    let index = rng.random_range(0..payloads.len());
    let change = payloads[index]["change"]
        .as_object_mut()
        .and_then(|change| change.values_mut().next())
        .expect("a change");
    let value = EDGE_NUMBERS[rng.random_range(0..EDGE_NUMBERS.len())];
    let what = match rng.random_range(0..4) {
        0 => {
            let field = ["rows", "bytes", "checksum", "data_bytes"][rng.random_range(0..4)];
            change["entry"]["segments"][0][field] = value.into();
            format!("record {index}: segment {field} = {value}")
        }
        1 => {
            change["entry"]["version"] = value.into();
            format!("record {index}: version = {value}")
        }
        2 => {
            payloads[index]["seq"] = value.into();
            format!("record {index}: seq = {value}")
        }
        _ => {
            let file =
                ["../manifest.json", "seg-1.arrow", "/etc/passwd", ""][rng.random_range(0..4)];
            change["entry"]["segments"][0]["file"] = file.into();
            format!("record {index}: file = {file:?}")
        }
    };
    let journal: Vec<u8> = payloads.iter().flat_map(record).collect();
    std::fs::write(dir.join("journal"), journal).expect("journal");
    Case {
        what: format!("journal (forged): {what}"),
        damaged: None,
        manifest: true,
        forged: true,
        states: None,
    }
}

/// The manifest's segment entries, as (dataset, index, file).
fn segments(manifest: &Value) -> Vec<(String, usize, String)> {
    let mut found = Vec::new();
    for (name, entry) in manifest["datasets"].as_object().expect("datasets") {
        for (index, segment) in entry["segments"]
            .as_array()
            .expect("segments")
            .iter()
            .enumerate()
        {
            let file = segment["file"].as_str().expect("file").to_owned();
            found.push((name.clone(), index, file));
        }
    }
    found
}

const EDGE_NUMBERS: [u64; 9] = [
    0,
    1,
    7,
    u32::MAX as u64,
    1 << 31,
    1 << 53,
    i64::MAX as u64,
    u64::MAX - 1,
    u64::MAX,
];

fn damage_bytes(rng: &mut StdRng, bytes: &mut Vec<u8>) -> String {
    match rng.random_range(0..5) {
        0 => {
            let flips = rng.random_range(1..=8);
            for _ in 0..flips {
                let at = rng.random_range(0..bytes.len());
                bytes[at] ^= 1 << rng.random_range(0..8);
            }
            format!("{flips} bits flipped")
        }
        1 => {
            let at = rng.random_range(0..bytes.len().saturating_sub(8).max(1)) & !7;
            let word = EDGE_NUMBERS[rng.random_range(0..EDGE_NUMBERS.len())].to_le_bytes();
            let end = (at + 8).min(bytes.len());
            if bytes[at..end] == word[..end - at] {
                // Already that value: damage it all the same.
                bytes[at] ^= 0x80;
            } else {
                bytes[at..end].copy_from_slice(&word[..end - at]);
            }
            format!("word at {at} set")
        }
        2 => {
            let keep = rng.random_range(0..bytes.len());
            bytes.truncate(keep);
            format!("truncated to {keep}")
        }
        3 => {
            let more = rng.random_range(1..4096);
            bytes.extend((0..more).map(|_| rng.random::<u8>()));
            format!("{more} bytes appended")
        }
        _ => {
            // The footer and the trailer: where a reader starts.
            let from = bytes.len().saturating_sub(rng.random_range(1..256));
            let at = rng.random_range(from..bytes.len());
            bytes[at] ^= rng.random_range(1..=255u8);
            format!("byte {at} near the end changed")
        }
    }
}

/// What a case did: which dataset's files it damaged, and whether it forged the checksums.
struct Case {
    what: String,
    damaged: Option<String>,
    manifest: bool,
    forged: bool,
    /// For a damaged journal: the catalogs an open may accept, one per prefix of its records.
    states: Option<Vec<Contents>>,
}

fn damage_segment(rng: &mut StdRng, dir: &Path, forge: bool) -> Case {
    let mut manifest = read_manifest(dir);
    let all = segments(&manifest);
    let (name, index, file) = all[rng.random_range(0..all.len())].clone();
    let path = dir.join("segments").join(&file);
    let mut bytes = std::fs::read(&path).expect("segment");
    let what = damage_bytes(rng, &mut bytes);
    std::fs::write(&path, &bytes).expect("write");
    if forge {
        let segment = &mut manifest["datasets"][&name]["segments"][index];
        segment["bytes"] = bytes.len().into();
        segment["checksum"] = crc32fast::hash(&bytes).into();
        write_manifest(dir, &manifest);
    }
    Case {
        what: format!("segment {file} of {name:?}: {what}"),
        damaged: Some(name),
        manifest: false,
        forged: forge,
        states: None,
    }
}

fn damage_manifest(rng: &mut StdRng, dir: &Path, forge: bool) -> Case {
    if !forge {
        let path = dir.join("manifest.json");
        let mut bytes = std::fs::read(&path).expect("manifest");
        let what = damage_bytes(rng, &mut bytes);
        std::fs::write(&path, &bytes).expect("write");
        return Case {
            what: format!("manifest bytes: {what}"),
            damaged: None,
            manifest: true,
            forged: false,
            states: None,
        };
    }
    let mut manifest = read_manifest(dir);
    let all = segments(&manifest);
    let (name, index, _) = all[rng.random_range(0..all.len())].clone();
    let what = match rng.random_range(0..6) {
        0 | 1 => {
            let field = ["rows", "bytes", "checksum", "data_bytes"][rng.random_range(0..4)];
            let value = EDGE_NUMBERS[rng.random_range(0..EDGE_NUMBERS.len())];
            manifest["datasets"][&name]["segments"][index][field] = value.into();
            format!("{name:?} segment {index} {field} = {value}")
        }
        2 => {
            let file = [
                "../manifest.json",
                "seg-1.arrow",
                "/etc/passwd",
                "seg-00000000000000000000.arrow\0",
                "",
            ][rng.random_range(0..5)];
            manifest["datasets"][&name]["segments"][index]["file"] = file.into();
            format!("{name:?} segment {index} file = {file:?}")
        }
        3 => {
            let segments = manifest["datasets"][&name]["segments"]
                .as_array_mut()
                .expect("segments");
            segments.remove(index);
            format!("{name:?} segment {index} dropped")
        }
        4 => {
            let (other, other_index, _) = all[rng.random_range(0..all.len())].clone();
            let moved = manifest["datasets"][&other]["segments"][other_index].clone();
            manifest["datasets"][&name]["segments"][index] = moved;
            format!("{name:?} segment {index} replaced by {other:?}'s {other_index}")
        }
        _ => {
            let value = EDGE_NUMBERS[rng.random_range(0..EDGE_NUMBERS.len())];
            manifest["datasets"][&name]["version"] = value.into();
            format!("{name:?} version = {value}")
        }
    };
    write_manifest(dir, &manifest);
    Case {
        what: format!("manifest (forged): {what}"),
        damaged: Some(name),
        manifest: true,
        forged: true,
        states: None,
    }
}

async fn run_case(
    case: &Case,
    dir: &Path,
    stored: &BTreeMap<String, Vec<RecordBatch>>,
) -> Result<(), String> {
    let store = match open(dir).await {
        Ok(store) => store,
        Err(error) => {
            let message = error.to_string();
            if !message.contains(&dir.display().to_string()) {
                return Err(format!("an open failed without naming the file: {message}"));
            }
            // Damage to one dataset's files must not keep the others from being served.
            if !case.manifest {
                return Err(format!("a damaged segment failed the start: {message}"));
            }
            return Ok(());
        }
    };
    if let Some(states) = &case.states {
        // Only a torn end is accepted: the catalog is then what the records before it make.
        let mut found = Contents::new();
        for dataset in store.list("") {
            let name = dataset.name().to_owned();
            let batches = read(&store, &name)
                .await
                .map_err(|e| format!("{name:?} of an accepted journal failed: {e}"))?;
            found.insert(name, rows_of(&batches).filter(|rows| rows.num_rows() > 0));
        }
        store.close().await;
        let normal = |state: &Contents| -> Contents {
            state
                .iter()
                .map(|(name, rows)| (name.clone(), rows.clone().filter(|r| r.num_rows() > 0)))
                .collect()
        };
        if !states.iter().any(|state| normal(state) == found) {
            return Err("a damaged journal opened as no prefix of its records".to_owned());
        }
        return Ok(());
    }
    if !case.forged && case.manifest {
        store.close().await;
        return Err("a damaged manifest was accepted".to_owned());
    }
    for (name, damage) in store.damaged() {
        if !case.manifest && case.damaged.as_deref() != Some(name.as_str()) {
            return Err(format!(
                "{name:?} was not damaged but is quarantined: {damage:?}"
            ));
        }
        match store.get(&name) {
            Err(StoreError::Damaged { reason, .. })
                if reason.contains(&dir.display().to_string()) => {}
            other => {
                return Err(format!(
                    "{name:?} is damaged but reads as {:?}",
                    other.map(|d| d.num_rows())
                ));
            }
        }
    }
    for dataset in store.list("") {
        let name = dataset.name().to_owned();
        let result = read(&store, &name).await;
        let untouched = case.damaged.as_deref() != Some(name.as_str()) && !case.manifest;
        match result {
            Ok(batches) => {
                let rows: usize = batches.iter().map(RecordBatch::num_rows).sum();
                if rows as u64 != dataset.num_rows() {
                    return Err(format!(
                        "{name:?} listed {} rows and read {rows}",
                        dataset.num_rows()
                    ));
                }
                for batch in &batches {
                    for column in batch.columns() {
                        column
                            .to_data()
                            .validate_full()
                            .map_err(|e| format!("{name:?} read invalid Arrow data: {e}"))?;
                    }
                }
                let expected = &stored[&name];
                let same = || {
                    let schema = expected.first().map(RecordBatch::schema);
                    match schema {
                        None => batches.is_empty(),
                        Some(schema) => {
                            arrow::compute::concat_batches(&schema, &batches).ok()
                                == arrow::compute::concat_batches(&schema, expected).ok()
                        }
                    }
                };
                if (untouched || !case.forged) && !same() {
                    return Err(format!("{name:?} read other rows than were stored"));
                }
            }
            Err(error) if untouched => {
                return Err(format!("{name:?} was not damaged but failed: {error}"));
            }
            Err(StoreError::Corrupt(_)) => {}
            Err(error) if case.forged => {
                // Forged files may also fail as other errors a client can act on.
                if matches!(error, StoreError::Backend(_) | StoreError::Persist(_)) {
                    let message = error.to_string();
                    if message.contains("panicked") && !message.contains("decoder") {
                        return Err(format!("{name:?}: {message}"));
                    }
                }
            }
            Err(error) => return Err(format!("{name:?} failed as other than corrupt: {error}")),
        }
    }
    // Whatever was found damaged, the directory still takes changes: a new dataset, and the
    // drop of every damaged one.
    let fresh = all_types_batch(3);
    put(&store, "fuzz-fresh", PutMode::Create, None, &[fresh])
        .await
        .map_err(|e| format!("a put after the start failed: {e}"))?;
    for (name, _) in store.damaged() {
        store
            .drop_dataset(&name)
            .await
            .map_err(|e| format!("dropping damaged {name:?} failed: {e}"))?;
    }
    if !store.damaged().is_empty() {
        return Err("damaged datasets remain after their drops".to_owned());
    }
    store.close().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damaged_data_directories_fail_cleanly() {
    install_panic_hook();
    let seed = std::env::var("GPU_FLIGHT_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::rng().random::<u64>());
    let cases: usize = std::env::var("GPU_FLIGHT_DISK_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(150);
    eprintln!("disk fuzz: seed {seed}, {cases} cases (GPU_FLIGHT_FUZZ_SEED={seed} replays)");
    let root = TempDataDir::new("disk-fuzz");
    let pristine = root.path().join("pristine");
    let stored = original(&pristine).await;
    let work = root.path().join("case");
    let journaled = root.path().join("journaled");
    copy_dir(&pristine, &journaled);
    let (payloads, states) = journalize(&journaled, &stored);
    let mut failures = Vec::new();
    // The journaled copy opens as the pristine one.
    copy_dir(&journaled, &work);
    if let Err(failure) = run_case(
        &Case {
            what: "the journaled copy".to_owned(),
            damaged: None,
            manifest: true,
            forged: false,
            states: Some(states[states.len() - 1..].to_vec()),
        },
        &work,
        &stored,
    )
    .await
    {
        failures.push(format!("undamaged journal: {failure}"));
    }
    if let Err(failure) = miscounted_rows_are_corrupt(&pristine, &work, &stored).await {
        failures.push(format!("miscounted rows: {failure}"));
    }
    for index in 0..cases {
        let mut rng = StdRng::seed_from_u64(seed ^ (index as u64).wrapping_mul(0x9e37_79b9));
        let forge = rng.random_bool(0.5);
        let case = match rng.random_range(0..10) {
            0..6 => {
                copy_dir(&pristine, &work);
                damage_segment(&mut rng, &work, forge)
            }
            6..8 => {
                copy_dir(&pristine, &work);
                damage_manifest(&mut rng, &work, forge)
            }
            _ => {
                copy_dir(&journaled, &work);
                damage_journal(&mut rng, &work, forge, &payloads, &states)
            }
        };
        let panics_before = PANICS.lock().unwrap_or_else(|p| p.into_inner()).len();
        let outcome = tokio::time::timeout(
            std::time::Duration::from_secs(30),
            run_case(&case, &work, &stored),
        )
        .await
        .unwrap_or_else(|_| Err("the case did not finish in 30 s".to_owned()));
        let panics: Vec<String> =
            PANICS.lock().unwrap_or_else(|p| p.into_inner())[panics_before..].to_vec();
        if let Err(failure) = outcome {
            failures.push(format!("case {index} ({}): {failure}", case.what));
        }
        for panic in panics {
            failures.push(format!("case {index} ({}): panicked at {panic}", case.what));
        }
    }
    eprintln!(
        "disk fuzz: {cases} cases, {} failures, {} decoder panics caught",
        failures.len(),
        DECODER_PANICS.load(Ordering::Relaxed)
    );
    assert!(failures.is_empty(), "seed {seed}:\n{}", failures.join("\n"));
}

/// A fixed case: a manifest whose forged row count for a segment is off by one. Rows are
/// numbered by the manifest before any file is read, so a segment holding other rows than it
/// records would misplace every row after it: its dataset is corrupt, the others are served.
async fn miscounted_rows_are_corrupt(
    pristine: &Path,
    work: &Path,
    stored: &BTreeMap<String, Vec<RecordBatch>>,
) -> Result<(), String> {
    copy_dir(pristine, work);
    let mut manifest = read_manifest(work);
    let segment = &mut manifest["datasets"]["strings"]["segments"][1];
    let recorded = segment["rows"].as_u64().ok_or("no rows")?;
    segment["rows"] = (recorded - 1).into();
    write_manifest(work, &manifest);
    let store = open(work).await.map_err(|e| e.to_string())?;
    match read(&store, "strings").await {
        Err(StoreError::Corrupt(message))
            if message.contains(&format!("manifest records {}", recorded - 1)) => {}
        other => return Err(format!("a miscounted segment read as {other:?}")),
    }
    let ints = read(&store, "ints").await.map_err(|e| e.to_string())?;
    let schema = stored["ints"][0].schema();
    if arrow::compute::concat_batches(&schema, &ints).ok()
        != arrow::compute::concat_batches(&schema, &stored["ints"]).ok()
    {
        return Err("another dataset read other rows".to_owned());
    }
    store.close().await;
    Ok(())
}
