//! Damage found at start quarantines only the datasets it touches: they are listed as damaged
//! by `status`, read as DATA_LOSS naming the file, and can be dropped or replaced; every other
//! dataset is served and the directory takes changes. A directory unusable as a whole (its
//! manifest unreadable) still refuses the start, naming the file.

mod common;

use std::path::Path;
use std::sync::Arc;

use arrow::record_batch::RecordBatch;
use tonic::Code;

use common::datadir::{TempDataDir, read_manifest, segment_path, write_manifest};
use common::{TestServer, assert_same_data, cmd, code_of, get_all, int64_batch, put, status};
use gpu_flight::backend::HostBackend;
use gpu_flight::server::ServeOptions;
use gpu_flight::store::{Store, StoreError, StoreOptions};

async fn open(dir: &Path) -> Result<Store, StoreError> {
    let options = StoreOptions {
        data_dir: Some(dir.to_owned()),
        ..StoreOptions::default()
    };
    Store::open(Arc::new(HostBackend::new()), options).await
}

async fn serve(dir: &Path) -> TestServer {
    let store = open(dir).await.expect("the server starts");
    TestServer::serve(store, ServeOptions::default()).await
}

async fn stop(server: TestServer) {
    let store = server.store.clone();
    server.shutdown_and_wait().await;
    store.close().await;
}

/// `bad` and `good` of two segments each (an append), and `other` of one. Each segment is
/// over 1 MiB, so that no merge on disk joins them.
async fn write_datasets(dir: &Path) -> Vec<(&'static str, Vec<RecordBatch>)> {
    let server = serve(dir).await;
    let mut client = server.client().await;
    let mut stored = Vec::new();
    for (name, seed) in [("bad", 1), ("good", 2), ("other", 3)] {
        let first = int64_batch(70_000, 2, seed);
        put(&mut client, cmd(name, "create"), vec![first.clone()])
            .await
            .expect("create");
        let mut batches = vec![first];
        if name != "other" {
            let second = int64_batch(70_000, 2, seed * 10);
            put(&mut client, cmd(name, "append"), vec![second.clone()])
                .await
                .expect("append");
            batches.push(second);
        }
        stored.push((name, batches));
    }
    stop(server).await;
    stored
}

fn edit(path: &Path, change: impl FnOnce(&mut Vec<u8>)) {
    let mut bytes = std::fs::read(path).expect("read");
    change(&mut bytes);
    std::fs::write(path, bytes).expect("write");
}

/// Where an Arrow IPC file's footer lies: it ends 10 bytes before the end (a 4-byte length and
/// the 6-byte magic), and is as long as that length says.
fn footer(bytes: &[u8]) -> std::ops::Range<usize> {
    let end = bytes.len() - 10;
    let length = i32::from_le_bytes(bytes[end..end + 4].try_into().expect("4 bytes")) as usize;
    end - length..end
}

/// Each way a dataset's files can be damaged, with what names the damage.
fn damage(dir: &Path, case: &str) -> String {
    let first = segment_path(dir, "bad", 0);
    let named = first
        .file_name()
        .expect("a file")
        .to_string_lossy()
        .into_owned();
    match case {
        "truncated" => edit(&first, |b| b.truncate(b.len() - 100)),
        "footer zeroed" => edit(&first, |b| {
            let at = footer(b);
            b[at].fill(0);
        }),
        "last byte flipped" => edit(&first, |b| {
            let last = b.len() - 1;
            b[last] ^= 0xff;
        }),
        "footer length flipped" => edit(&first, |b| {
            let at = b.len() - 10;
            b[at + 1] ^= 0x40;
        }),
        "later segment truncated" => {
            let second = segment_path(dir, "bad", 1);
            edit(&second, |b| b.truncate(b.len() / 2));
            return second
                .file_name()
                .expect("a file")
                .to_string_lossy()
                .into_owned();
        }
        "missing" => std::fs::remove_file(&first).expect("remove"),
        "two datasets name one segment" => {
            let mut manifest = read_manifest(dir);
            let shared = manifest["datasets"]["good"]["segments"][0].clone();
            manifest["datasets"]["bad"]["segments"][0] = shared;
            write_manifest(dir, &manifest);
            return "manifest.json".to_owned();
        }
        other => panic!("no case {other}"),
    }
    named
}

const CASES: [&str; 7] = [
    "truncated",
    "footer zeroed",
    "last byte flipped",
    "footer length flipped",
    "later segment truncated",
    "missing",
    "two datasets name one segment",
];

async fn damaged_names(server: &TestServer) -> Vec<String> {
    let status = status(&mut server.client().await).await;
    status["persistence"]["damaged"]
        .as_array()
        .expect("persistence.damaged")
        .iter()
        .map(|d| d["name"].as_str().expect("name").to_owned())
        .collect()
}

#[tokio::test]
async fn damage_quarantines_only_the_datasets_it_touches() {
    for case in CASES {
        let dir = TempDataDir::new(&format!("damage-{}", case.replace(' ', "-")));
        let stored = write_datasets(dir.path()).await;
        let named = damage(dir.path(), case);
        let shared = case == "two datasets name one segment";

        let server = serve(dir.path()).await;
        let mut client = server.client().await;
        let expected = if shared {
            vec!["bad".to_owned(), "good".to_owned()]
        } else {
            vec!["bad".to_owned()]
        };
        assert_eq!(damaged_names(&server).await, expected, "{case}");
        for (name, batches) in &stored {
            let read = get_all(&mut client, name).await;
            if expected.iter().any(|d| d == name) {
                let error = read.expect_err(case);
                assert_eq!(code_of(&error), Code::DataLoss, "{case}: {name}: {error}");
                assert!(error.to_string().contains(&named), "{case}: {error}");
            } else {
                assert_same_data(batches, &read.expect(case));
            }
        }
        // A create would hide the damaged dataset, an append build on it: refused, saying so.
        for mode in ["create", "append"] {
            let error = put(&mut client, cmd("bad", mode), vec![int64_batch(5, 2, 0)])
                .await
                .expect_err(case);
            assert_eq!(code_of(&error), Code::DataLoss, "{case}: {mode}: {error}");
        }
        // The directory takes changes: a new dataset, a replace of one damaged dataset and
        // the drop of the other (or of the only one).
        put(
            &mut client,
            cmd("new", "create"),
            vec![int64_batch(10, 2, 5)],
        )
        .await
        .expect("a new dataset");
        let replacement = int64_batch(20, 2, 6);
        put(
            &mut client,
            cmd("bad", "replace"),
            vec![replacement.clone()],
        )
        .await
        .expect("a replace of a damaged dataset");
        if shared {
            common::action(&mut client, "drop", serde_json::json!({"name": "good"}))
                .await
                .expect("a drop of a damaged dataset");
        }
        assert!(damaged_names(&server).await.is_empty(), "{case}");
        stop(server).await;

        // Nothing damaged is left on disk, and what was changed stays changed.
        let server = serve(dir.path()).await;
        let mut client = server.client().await;
        assert!(damaged_names(&server).await.is_empty(), "{case}");
        assert_same_data(
            &[replacement],
            &get_all(&mut client, "bad").await.expect(case),
        );
        assert_same_data(
            &stored[2].1,
            &get_all(&mut client, "other").await.expect(case),
        );
        if shared {
            assert_eq!(
                code_of(&get_all(&mut client, "good").await.expect_err(case)),
                Code::NotFound
            );
        }
        stop(server).await;
    }
}

#[tokio::test]
async fn a_damaged_dataset_can_be_dropped_then_created_again() {
    let dir = TempDataDir::new("damage-drop");
    let stored = write_datasets(dir.path()).await;
    damage(dir.path(), "truncated");
    let server = serve(dir.path()).await;
    let mut client = server.client().await;
    let dropped = common::action(&mut client, "drop", serde_json::json!({"name": "bad"}))
        .await
        .expect("drop");
    assert_eq!(
        dropped["rows"], 140_000,
        "the rows its manifest entry recorded"
    );
    let error = get_all(&mut client, "bad").await.expect_err("dropped");
    assert_eq!(code_of(&error), Code::NotFound);
    put(
        &mut client,
        cmd("bad", "create"),
        vec![int64_batch(7, 2, 9)],
    )
    .await
    .expect("create after the drop");
    assert_same_data(
        &stored[1].1,
        &get_all(&mut client, "good").await.expect("good"),
    );
    stop(server).await;
}

#[tokio::test]
async fn a_directory_unusable_as_a_whole_still_refuses_the_start() {
    let dir = TempDataDir::new("damage-manifest");
    write_datasets(dir.path()).await;
    edit(&dir.path().join("manifest.json"), |b| {
        let middle = b.len() / 2;
        b[middle] ^= 0x01;
    });
    let error = open(dir.path()).await.expect_err("an unreadable manifest");
    assert!(error.to_string().contains("manifest.json"), "{error}");
}

/// The newest file is the likeliest to be lost. Its number stays taken: a new file under its
/// name would be refused by the catalog that still names it (every put failed) and would pass
/// for the lost file at the next start.
#[tokio::test]
async fn a_lost_newest_file_keeps_its_number() {
    let dir = TempDataDir::new("damage-newest");
    let stored = write_datasets(dir.path()).await;
    let newest = segment_path(dir.path(), "other", 0);
    std::fs::remove_file(&newest).expect("lose the newest file");
    let server = serve(dir.path()).await;
    let mut client = server.client().await;
    assert_eq!(damaged_names(&server).await, vec!["other".to_owned()]);
    let fresh = int64_batch(70_000, 2, 42);
    put(&mut client, cmd("new", "create"), vec![fresh.clone()])
        .await
        .expect("a put beside the damaged dataset");
    assert!(!newest.exists(), "no new file took the lost one's name");
    stop(server).await;
    let server = serve(dir.path()).await;
    let mut client = server.client().await;
    assert_same_data(&[fresh], &get_all(&mut client, "new").await.expect("new"));
    assert_same_data(
        &stored[0].1,
        &get_all(&mut client, "bad").await.expect("bad"),
    );
    assert_eq!(damaged_names(&server).await, vec!["other".to_owned()]);
    stop(server).await;
}
