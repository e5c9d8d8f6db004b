//! Persistence under `--data-dir`: committed datasets survive a restart, appends write only
//! what they add, drops and replaces reach the disk, and a disk that fails a write fails the
//! put (under `sync`) without touching what is stored. The crash tests (SIGKILL mid-write)
//! drive the real binary: `tests/python/test_persistence.py`.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::devices::{batch, put, read_all, rows};
use gpu_flight::backend::HostBackend;
use gpu_flight::store::{Durability, PutMode, Store, StoreError, StoreOptions};

fn data_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("gpu-flight-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

async fn open(dir: &Path, durability: Durability, devices: u32) -> Store {
    Store::open(
        Arc::new(HostBackend::new().with_devices(devices)),
        StoreOptions {
            data_dir: Some(dir.to_owned()),
            durability,
            ..StoreOptions::default()
        },
    )
    .await
    .expect("open the data directory")
}

fn names(store: &Store) -> Vec<String> {
    store.list("").iter().map(|d| d.name().to_owned()).collect()
}

#[tokio::test]
async fn every_committed_change_survives_a_restart() {
    let dir = data_dir("restart");
    for durability in [Durability::Sync, Durability::Async] {
        let _ = std::fs::remove_dir_all(&dir);
        let store = open(&dir, durability, 2).await;
        put(&store, "appended", PutMode::Create, None, &[batch(0)])
            .await
            .expect("create");
        for i in 1..4 {
            put(&store, "appended", PutMode::Append, None, &[batch(i)])
                .await
                .expect("append");
        }
        put(&store, "replaced", PutMode::Create, None, &[batch(10)])
            .await
            .expect("create");
        put(&store, "replaced", PutMode::Replace, None, &[batch(11)])
            .await
            .expect("replace");
        put(&store, "dropped", PutMode::Create, None, &[batch(20)])
            .await
            .expect("create");
        store.drop_dataset("dropped").await.expect("drop");
        put(
            &store,
            "../../etc/passwd",
            PutMode::Create,
            Some(0),
            &[batch(30)],
        )
        .await
        .expect("any name");
        store
            .move_dataset("../../etc/passwd", 1)
            .await
            .expect("move");
        store
            .copy_dataset("replaced", "copied", 0)
            .await
            .expect("copy");
        store.close().await;
        drop(store);

        let store = open(&dir, durability, 2).await;
        assert_eq!(
            names(&store),
            ["../../etc/passwd", "appended", "copied", "replaced"],
            "{durability:?}"
        );
        let appended: Vec<_> = (0..4).map(batch).collect();
        assert_eq!(read_all(&store, "appended").await, rows(&appended));
        assert_eq!(read_all(&store, "replaced").await, batch(11));
        assert_eq!(read_all(&store, "copied").await, batch(11));
        assert_eq!(read_all(&store, "../../etc/passwd").await, batch(30));
        // And the restarted store persists on: an append to a loaded dataset.
        put(&store, "appended", PutMode::Append, None, &[batch(4)])
            .await
            .expect("append after restart");
        store.close().await;
        drop(store);
        let store = open(&dir, durability, 2).await;
        let appended: Vec<_> = (0..5).map(batch).collect();
        assert_eq!(read_all(&store, "appended").await, rows(&appended));
        store.close().await;
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn appends_write_what_they_add_not_the_dataset() {
    let dir = data_dir("appends");
    let store = open(&dir, Durability::Sync, 1).await;
    put(&store, "log", PutMode::Create, None, &[batch(0)])
        .await
        .expect("create");
    let written = |store: &Store| {
        store
            .status()
            .persistence
            .expect("persistence status")
            .written_bytes
    };
    let first = written(&store);
    for i in 1..20 {
        put(&store, "log", PutMode::Append, None, &[batch(i)])
            .await
            .expect("append");
    }
    let appended = written(&store) - first;
    // Each append writes its own batch (a file of about `first` bytes); rewriting the
    // dataset each time would write about 200 of them.
    assert!(
        appended <= 19 * first + first / 2,
        "{appended} bytes written for 19 appends of {first}"
    );
    store.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn background_merges_keep_the_version_and_write_nothing() {
    let dir = data_dir("merges");
    let store = open(&dir, Durability::Sync, 1).await;
    // Small batches, which the host backend merges.
    let small = |i: i64| batch(i).slice(0, 1000);
    let sent: Vec<_> = (0..17).map(small).collect();
    put(&store, "log", PutMode::Create, None, &sent[..1])
        .await
        .expect("create");
    for batch in &sent[1..16] {
        put(
            &store,
            "log",
            PutMode::Append,
            None,
            std::slice::from_ref(batch),
        )
        .await
        .expect("append");
    }
    let disk = |store: &Store| {
        let persistence = store.status().persistence.expect("persistence status");
        (
            persistence.segments,
            persistence.written_bytes,
            persistence.pending,
        )
    };
    let version = store.get("log").expect("log").version();
    let (segments, written, _) = disk(&store);
    store.merges_settled().await;
    assert!(store.status().merges > 0, "the appends were merged");
    assert_eq!(store.get("log").expect("log").version(), version);
    assert_eq!(
        disk(&store),
        (segments, written, 0),
        "nothing more to write"
    );
    // An append to the merged dataset still writes only what it adds: the writer knows its
    // version.
    put(&store, "log", PutMode::Append, None, &sent[16..])
        .await
        .expect("append");
    assert_eq!(disk(&store).0, segments + 1);
    store.merges_settled().await;
    store.close().await;
    drop(store);

    let store = open(&dir, Durability::Sync, 1).await;
    assert_eq!(read_all(&store, "log").await, rows(&sent));
    store.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_failed_disk_write_fails_the_put_and_keeps_what_was_stored() {
    let dir = data_dir("failing");
    let store = open(&dir, Durability::Sync, 1).await;
    put(&store, "kept", PutMode::Create, None, &[batch(0)])
        .await
        .expect("create");
    // The segments directory becomes a file: every segment write now fails.
    let segments = dir.join("segments");
    let aside = dir.join("segments.aside");
    std::fs::rename(&segments, &aside).expect("move aside");
    std::fs::write(&segments, b"not a directory").expect("block");

    let error = put(&store, "lost", PutMode::Create, None, &[batch(1)])
        .await
        .expect_err("the disk refused it");
    assert!(matches!(error, StoreError::Persist(_)), "{error}");
    assert!(
        error.to_string().contains("segments"),
        "names the file: {error}"
    );
    assert!(store.get("lost").is_err(), "not committed in memory either");
    let error = put(&store, "kept", PutMode::Replace, None, &[batch(2)])
        .await
        .expect_err("the disk refused it");
    assert!(matches!(error, StoreError::Persist(_)), "{error}");
    assert_eq!(
        read_all(&store, "kept").await,
        batch(0),
        "the old version stays"
    );
    // The undos are on their way to the disk: the old version is there already, so they
    // write nothing (and cannot fail).
    let persistence = || store.status().persistence.expect("status");
    for _ in 0..200 {
        if persistence().pending == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(persistence().pending, 0);
    assert_eq!(
        persistence().failures,
        2,
        "the two refused puts, nothing else"
    );

    std::fs::remove_file(&segments).expect("unblock");
    std::fs::rename(&aside, &segments).expect("put back");
    put(&store, "later", PutMode::Create, None, &[batch(3)])
        .await
        .expect("the disk works again");
    store.close().await;
    drop(store);

    let store = open(&dir, Durability::Sync, 1).await;
    assert_eq!(names(&store), ["kept", "later"]);
    assert_eq!(read_all(&store, "kept").await, batch(0));
    assert_eq!(read_all(&store, "later").await, batch(3));
    store.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_data_directory_serves_one_server_and_a_corrupt_one_none() {
    let dir = data_dir("exclusive");
    let store = open(&dir, Durability::Sync, 1).await;
    put(&store, "d", PutMode::Create, None, &[batch(0)])
        .await
        .expect("create");
    let second = Store::open(
        Arc::new(HostBackend::new()),
        StoreOptions {
            data_dir: Some(dir.clone()),
            ..StoreOptions::default()
        },
    )
    .await;
    let error = second.expect_err("the directory is in use");
    assert!(error.to_string().contains("in use"), "{error}");
    store.close().await;
    drop(store);

    // A damaged segment: the server refuses to start rather than start without the data.
    let segment = std::fs::read_dir(dir.join("segments"))
        .expect("segments")
        .flatten()
        .find(|e| e.file_name().to_string_lossy().ends_with(".arrow"))
        .expect("a segment")
        .path();
    let mut bytes = std::fs::read(&segment).expect("read");
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    std::fs::write(&segment, bytes).expect("damage");
    let error = Store::open(
        Arc::new(HostBackend::new()),
        StoreOptions {
            data_dir: Some(dir.clone()),
            ..StoreOptions::default()
        },
    )
    .await
    .expect_err("a corrupt segment");
    let message = error.to_string();
    assert!(
        message.contains("\"d\"") && message.contains("corrupt"),
        "{message}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn without_a_data_directory_nothing_is_written() {
    let store = Store::open(Arc::new(HostBackend::new()), StoreOptions::default())
        .await
        .expect("open");
    put(&store, "d", PutMode::Create, None, &[batch(0)])
        .await
        .expect("create");
    assert!(store.status().persistence.is_none());
}
