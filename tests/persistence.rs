//! Persistence under `--data-dir`: committed datasets survive a restart, appends write only
//! what they add, drops and replaces reach the disk, and a disk that fails a write fails the
//! put (under `sync`) without touching what is stored. The crash tests (SIGKILL mid-write)
//! drive the real binary: `tests/python/test_persistence.py`.

mod common;

use std::path::Path;

use futures::TryStreamExt;
use std::sync::Arc;

use common::datadir::TempDataDir;
use common::devices::{batch, put, read_all, rows};
use gpu_flight::arrays::batch_bytes;
use gpu_flight::backend::HostBackend;
use gpu_flight::store::{Durability, PutMode, Store, StoreError, StoreOptions};

async fn open(dir: &Path, durability: Durability, devices: u32) -> Store {
    let options = StoreOptions {
        durability,
        ..StoreOptions::default()
    };
    open_with(dir, devices, options).await
}

/// Opens `dir` on `devices` pretend devices with `options` (its `data_dir` set to `dir`).
async fn open_with(dir: &Path, devices: u32, options: StoreOptions) -> Store {
    let options = StoreOptions {
        data_dir: Some(dir.to_owned()),
        ..options
    };
    Store::open(Arc::new(HostBackend::new().with_devices(devices)), options)
        .await
        .expect("open the data directory")
}

fn names(store: &Store) -> Vec<String> {
    store.list("").iter().map(|d| d.name().to_owned()).collect()
}

#[tokio::test]
async fn every_committed_change_survives_a_restart() {
    for durability in [Durability::Sync, Durability::Async] {
        let dir = TempDataDir::new(&format!("restart-{durability:?}"));
        let store = open(dir.path(), durability, 2).await;
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

        let store = open(dir.path(), durability, 2).await;
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
        let store = open(dir.path(), durability, 2).await;
        let appended: Vec<_> = (0..5).map(batch).collect();
        assert_eq!(read_all(&store, "appended").await, rows(&appended));
        store.close().await;
    }
}

/// Opens `dir` on `devices` pretend devices with a host tier of `host_limit` bytes.
async fn open_with_host_tier(dir: &Path, devices: u32, host_limit: u64) -> Store {
    let options = StoreOptions {
        host_memory_limit: Some(host_limit),
        ..StoreOptions::default()
    };
    open_with(dir, devices, options).await
}

#[tokio::test]
async fn a_restart_reads_no_rows_until_they_are_needed() {
    let dir = TempDataDir::new("lazy");
    let store = open(dir.path(), Durability::Sync, 2).await;
    for (index, name) in ["a", "b", "c"].into_iter().enumerate() {
        put(&store, name, PutMode::Create, None, &[batch(index as i64)])
            .await
            .expect("create");
    }
    store.close().await;
    drop(store);

    // Open: every dataset listed with its schema and rows, none of them in memory.
    let store = open_with_host_tier(dir.path(), 2, 1 << 30).await;
    assert_eq!(names(&store), ["a", "b", "c"]);
    let tiers = store.status().tiers;
    assert_eq!(
        (tiers.device_bytes, tiers.host_bytes, tiers.loads),
        (0, 0, 0)
    );
    assert!(tiers.disk_bytes > 3 * 1_600_000, "{tiers:?}");
    for name in ["a", "b", "c"] {
        let dataset = store.get(name).expect("listed");
        assert_eq!(dataset.num_rows(), batch(0).num_rows() as u64);
        assert_eq!(dataset.schema().fields(), batch(0).schema().fields());
        assert!(dataset.tier_bytes().disk > 0, "{name}");
    }
    // Datasets are spread over the devices as puts would be.
    let homes: std::collections::BTreeSet<u32> = ["a", "b", "c"]
        .iter()
        .flat_map(|name| store.get(name).expect("listed").device_runs())
        .map(|(_, device)| device)
        .collect();
    assert_eq!(homes.len(), 2, "{homes:?}");

    // A read loads its dataset, into the host tier, and only it.
    assert_eq!(read_all(&store, "b").await, batch(1));
    let b = store.get("b").expect("b").tier_bytes();
    assert!(b.host > 0 && b.device == 0 && b.disk == 0, "{b:?}");
    assert!(store.get("a").expect("a").tier_bytes().disk > 0);
    let tiers = store.status().tiers;
    assert_eq!(tiers.loads, 1, "{tiers:?}");
    // Read again: from memory, not loaded twice.
    assert_eq!(read_all(&store, "b").await, batch(1));
    assert_eq!(store.status().tiers.loads, 1);

    // A move loads onto the device directly.
    store.move_dataset("a", 1).await.expect("move");
    let a = store.get("a").expect("a");
    assert_eq!(
        a.device_runs().iter().map(|(_, d)| *d).collect::<Vec<_>>(),
        [1]
    );
    let a_tiers = a.tier_bytes();
    assert!(a_tiers.device > 0 && a_tiers.disk == 0, "{a_tiers:?}");
    assert_eq!(read_all(&store, "a").await, batch(0));

    // Without a host tier (the host backend's default), a read loads onto the device.
    store.close().await;
    drop(store);
    let store = open(dir.path(), Durability::Sync, 2).await;
    assert_eq!(read_all(&store, "c").await, batch(2));
    let c = store.get("c").expect("c").tier_bytes();
    assert!(c.device > 0 && c.host == 0 && c.disk == 0, "{c:?}");
    store.close().await;
}

#[tokio::test]
async fn reads_of_a_loaded_dataset_are_slices_of_its_files_batches() {
    // Three appends, three segments; loaded into the host tier as three pieces.
    let dir = TempDataDir::new("pieces");
    let store = open(dir.path(), Durability::Sync, 1).await;
    for i in 0..3 {
        put(&store, "d", PutMode::Append, None, &[batch(i)])
            .await
            .expect("append");
    }
    store.close().await;
    drop(store);
    let store = open_with_host_tier(dir.path(), 1, 1 << 30).await;
    let dataset = store.get("d").expect("d");
    let piece = batch(0).num_rows();
    // Chunks of three quarters of a piece: without regard for the pieces, every other one
    // would join two of them (a copy).
    let chunk_bytes = (batch_bytes(&batch(0)) * 3 / 4) as u64;
    let read: Vec<_> = dataset
        .read(0..dataset.num_rows(), chunk_bytes, 2)
        .expect("a stream")
        .try_collect()
        .await
        .expect("read");
    assert!(dataset.tier_bytes().host > 0);
    let mut row = 0;
    for batch in &read {
        let (first, last) = (row / piece, (row + batch.num_rows() - 1) / piece);
        assert_eq!(
            first,
            last,
            "rows {row}+{} span two pieces",
            batch.num_rows()
        );
        row += batch.num_rows();
    }
    assert_eq!(rows(&read), rows(&(0..3).map(batch).collect::<Vec<_>>()));
    store.close().await;
}

#[tokio::test]
async fn an_append_after_a_restart_loads_nothing_it_does_not_read() {
    let dir = TempDataDir::new("append-lazy");
    let store = open(dir.path(), Durability::Sync, 1).await;
    put(&store, "d", PutMode::Create, None, &[batch(0)])
        .await
        .expect("create");
    store.close().await;
    drop(store);

    // A budget with room for the appended rows, not for the base beside them: the append
    // (and writing what it added to disk) must not load the base.
    let options = StoreOptions {
        memory_limit: Some(2_500_000),
        host_memory_limit: Some(0),
        ..StoreOptions::default()
    };
    let store = open_with(dir.path(), 1, options).await;
    put(&store, "d", PutMode::Append, None, &[batch(1)])
        .await
        .expect("the appended rows fit");
    let d = store.get("d").expect("d");
    assert_eq!(store.status().tiers.loads, 0);
    assert!(d.tier_bytes().disk > 0, "{:?}", d.tier_bytes());
    // Reading the appended rows alone loads nothing either.
    let base = batch(0).num_rows() as u64;
    let read: Vec<_> = d
        .read(base + 10..d.num_rows(), 1 << 20, 2)
        .expect("a stream")
        .try_collect()
        .await
        .expect("read");
    assert_eq!(rows(&read), batch(1).slice(10, batch(1).num_rows() - 10));
    assert_eq!(store.status().tiers.loads, 0);
    store.close().await;
    drop(store);
    let store = open(dir.path(), Durability::Sync, 1).await;
    assert_eq!(read_all(&store, "d").await, rows(&[batch(0), batch(1)]));
    store.close().await;
}

#[tokio::test]
async fn a_load_pays_for_the_file_it_keeps_and_joins_small_segments() {
    let dir = TempDataDir::new("load-charge");
    let store = open(dir.path(), Durability::Sync, 1).await;
    put(&store, "large", PutMode::Create, None, &[batch(0)])
        .await
        .expect("create");
    // Two hundred ten-row appends: a segment file each, mostly framing.
    let small: Vec<_> = (0..200).map(|i| batch(i).slice(0, 10)).collect();
    for (i, rows) in small.iter().enumerate() {
        let mode = if i == 0 {
            PutMode::Create
        } else {
            PutMode::Append
        };
        put(&store, "small", mode, None, std::slice::from_ref(rows))
            .await
            .expect("put");
    }
    store.close().await;
    drop(store);

    let store = open_with_host_tier(dir.path(), 1, 1 << 30).await;
    let on_disk = store.get("large").expect("large").tier_bytes().disk;
    assert_eq!(read_all(&store, "large").await, batch(0));
    // Its batches are slices of the file read into memory, which is what they hold.
    let host = store.status().tiers.host_used_bytes;
    assert!(host >= on_disk, "{host} charged for a file of {on_disk}");

    // The small segments come back as one piece, of what their rows hold: one chunk.
    let dataset = store.get("small").expect("small");
    let read: Vec<_> = dataset
        .read(0..dataset.num_rows(), 1 << 20, 2)
        .expect("a stream")
        .try_collect()
        .await
        .expect("read");
    assert_eq!(read.len(), 1, "{} chunks", read.len());
    assert_eq!(rows(&read), rows(&small));
    let charged = store.status().tiers.host_used_bytes - host;
    let data: u64 = small.iter().map(batch_bytes).sum();
    assert!(
        charged >= data && charged < 4 * data,
        "{charged} for {data}"
    );
    store.close().await;
}

#[tokio::test]
async fn loaded_datasets_go_back_to_disk_when_memory_is_needed() {
    let dir = TempDataDir::new("evict");
    let store = open(dir.path(), Durability::Sync, 1).await;
    for (index, name) in ["a", "b"].into_iter().enumerate() {
        put(&store, name, PutMode::Create, None, &[batch(index as i64)])
            .await
            .expect("create");
    }
    store.close().await;
    drop(store);
    let reopen = |host_limit: u64| {
        let options = StoreOptions {
            memory_limit: Some(2_000_000),
            host_memory_limit: Some(host_limit),
            ..StoreOptions::default()
        };
        open_with(dir.path(), 1, options)
    };

    // A host tier with room for the two loaded datasets and little more: once the device is
    // full, a put spills there, and what was loaded from disk makes way (back to disk, not
    // copied) rather than refuse the put.
    let store = reopen(3_500_000).await;
    assert_eq!(read_all(&store, "a").await, batch(0));
    assert_eq!(read_all(&store, "b").await, batch(1));
    assert!(store.status().tiers.host_used_bytes > 3_000_000);
    put(&store, "new1", PutMode::Create, None, &[batch(2)])
        .await
        .expect("fits the device");
    put(&store, "new2", PutMode::Create, None, &[batch(3)])
        .await
        .expect("what is on disk makes way");
    // new1 is on disk too since its put: it goes back there rather than spill.
    let tiers = store.status().tiers;
    assert!(tiers.evictions >= 1, "{tiers:?}");
    let on_disk = ["a", "b", "new1"].map(|name| store.get(name).expect(name).tier_bytes().disk);
    assert!(on_disk.iter().any(|&bytes| bytes > 0), "{on_disk:?}");
    for (name, index) in [("a", 0), ("b", 1), ("new1", 2), ("new2", 3)] {
        assert_eq!(read_all(&store, name).await, batch(index), "{name}");
    }
    store.close().await;
    drop(store);

    // Without a host tier (the host backend's default), a dataset loaded onto the device
    // goes back to disk for a put that needs its room.
    let store = reopen(0).await;
    assert_eq!(read_all(&store, "a").await, batch(0));
    put(&store, "new3", PutMode::Create, None, &[batch(4)])
        .await
        .expect("a goes back to disk");
    assert!(store.get("a").expect("a").tier_bytes().disk > 0);
    assert_eq!(store.status().tiers.evictions, 1);
    assert_eq!(read_all(&store, "new3").await, batch(4));
    store.close().await;
}

#[tokio::test]
async fn a_version_still_read_keeps_its_files_until_it_is_done() {
    let dir = TempDataDir::new("pinned");
    let store = open(dir.path(), Durability::Sync, 1).await;
    put(&store, "d", PutMode::Create, None, &[batch(0)])
        .await
        .expect("create");
    store.close().await;
    drop(store);
    let segment_files = || {
        std::fs::read_dir(dir.path().join("segments"))
            .expect("segments")
            .flatten()
            .count()
    };

    let store = open(dir.path(), Durability::Sync, 1).await;
    let old = store.get("d").expect("d");
    assert!(old.tier_bytes().disk > 0);
    // Replaced on disk: the manifest no longer names the old segment, but a reader of the
    // old version (a DoGet that got its dataset before the replace) still loads from it.
    put(&store, "d", PutMode::Replace, None, &[batch(1)])
        .await
        .expect("replace");
    assert_eq!(
        segment_files(),
        2,
        "the old segment is kept while it is needed"
    );
    let read: Vec<_> = old
        .read(0..old.num_rows(), 1 << 20, 2)
        .expect("a stream")
        .try_collect()
        .await
        .expect("the old version reads");
    assert_eq!(rows(&read), batch(0));
    drop(old);
    // Once nothing needs it, the next change to the directory deletes it.
    put(&store, "e", PutMode::Create, None, &[batch(2)])
        .await
        .expect("create");
    assert_eq!(segment_files(), 2, "d's new segment and e's");
    store.close().await;
}

#[tokio::test]
async fn appends_write_what_they_add_not_the_dataset() {
    let dir = TempDataDir::new("appends");
    let store = open(dir.path(), Durability::Sync, 1).await;
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
}

#[tokio::test]
async fn background_merges_keep_the_version_and_write_nothing() {
    let dir = TempDataDir::new("merges");
    let store = open(dir.path(), Durability::Sync, 1).await;
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
    store.compactions_settled().await;
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
    store.compactions_settled().await;
    store.close().await;
    drop(store);

    let store = open(dir.path(), Durability::Sync, 1).await;
    assert_eq!(read_all(&store, "log").await, rows(&sent));
    store.close().await;
}

/// Segment files under `dir`, and the bytes of its catalog: `manifest.json` and the journal.
fn on_disk(dir: &Path) -> (usize, u64) {
    let files = std::fs::read_dir(dir.join("segments"))
        .expect("segments")
        .count();
    let catalog = ["manifest.json", "journal"]
        .iter()
        .map(|name| std::fs::metadata(dir.join(name)).map_or(0, |m| m.len()))
        .sum();
    (files, catalog)
}

#[tokio::test]
async fn many_small_appends_keep_the_directory_small() {
    let dir = TempDataDir::new("many-appends");
    let store = open(dir.path(), Durability::Sync, 1).await;
    let n = 2000;
    let one = |i: i64| batch(i).slice(0, 1);
    for i in 0..n {
        let mode = if i == 0 {
            PutMode::Create
        } else {
            PutMode::Append
        };
        put(&store, "log", mode, None, &[one(i)])
            .await
            .expect("put");
    }
    // Each commit appends a record, and the journal is folded into the checkpoint once it
    // outgrows it: the catalog never holds more than tens of KiB, where rewriting it whole
    // at every append grew it to 150 KB.
    let (_, catalog) = on_disk(dir.path());
    assert!(catalog < 100 << 10, "{catalog} bytes of catalog");
    store.close().await;
    drop(store);
    // Merged on disk as they came: O(log n) files, each rewritten O(log n) times, where
    // every append used to leave its own file.
    let (files, catalog) = on_disk(dir.path());
    assert!(files <= 24, "{files} segment files for {n} appends");
    assert!(catalog < 8 << 10, "{catalog} bytes of catalog");

    let sent: Vec<_> = (0..n).map(one).collect();
    let store = open(dir.path(), Durability::Sync, 1).await;
    assert_eq!(
        read_all(&store, "log").await,
        rows(&sent),
        "every row, in order"
    );
    put(&store, "log", PutMode::Append, None, &[one(n)])
        .await
        .expect("append after a restart");
    store.close().await;
    drop(store);
    let sent: Vec<_> = (0..=n).map(one).collect();
    let store = open(dir.path(), Durability::Sync, 1).await;
    assert_eq!(read_all(&store, "log").await, rows(&sent));
    store.close().await;
    let (files, _) = on_disk(dir.path());
    assert!(files <= 24, "{files} segment files");
}

#[tokio::test]
async fn a_merge_on_disk_keeps_the_files_a_loaded_version_reads() {
    let dir = TempDataDir::new("merge-pinned");
    let store = open(dir.path(), Durability::Sync, 1).await;
    // A large segment, then a small one: too far apart in size to be merged.
    let parts = [
        batch(0).slice(0, 1000),
        batch(1).slice(0, 100),
        batch(2).slice(0, 100),
    ];
    for (i, part) in parts[..2].iter().enumerate() {
        let mode = if i == 0 {
            PutMode::Create
        } else {
            PutMode::Append
        };
        put(&store, "d", mode, None, std::slice::from_ref(part))
            .await
            .expect("put");
    }
    store.close().await;
    drop(store);
    assert_eq!(on_disk(dir.path()).0, 2);

    // Loaded from disk, this version reads the two files as they are.
    let store = open(dir.path(), Durability::Sync, 1).await;
    let old = store.get("d").expect("d");
    // An append of the small one's size: the two small files are merged into one.
    put(&store, "d", PutMode::Append, None, &parts[2..])
        .await
        .expect("append");
    store.close().await;
    assert_eq!(
        on_disk(dir.path()).0,
        3,
        "the large file, the merged one, and the small one the old version still reads"
    );
    let read: Vec<_> = old
        .read(0..old.num_rows(), 1 << 20, 2)
        .expect("a stream")
        .try_collect()
        .await
        .expect("the old version reads");
    assert_eq!(rows(&read), rows(&parts[..2]));
    drop((old, store));

    let store = open(dir.path(), Durability::Sync, 1).await;
    assert_eq!(
        on_disk(dir.path()).0,
        2,
        "the merged-away file is gone once unread"
    );
    assert_eq!(read_all(&store, "d").await, rows(&parts));
    store.close().await;
}

#[tokio::test]
async fn a_failed_disk_write_fails_the_put_and_keeps_what_was_stored() {
    let dir = TempDataDir::new("failing");
    let store = open(dir.path(), Durability::Sync, 1).await;
    put(&store, "kept", PutMode::Create, None, &[batch(0)])
        .await
        .expect("create");
    // The segments directory becomes a file: every segment write now fails.
    let segments = dir.path().join("segments");
    let aside = dir.path().join("segments.aside");
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

    let store = open(dir.path(), Durability::Sync, 1).await;
    assert_eq!(names(&store), ["kept", "later"]);
    assert_eq!(read_all(&store, "kept").await, batch(0));
    assert_eq!(read_all(&store, "later").await, batch(3));
    store.close().await;
}

#[tokio::test]
async fn a_data_directory_serves_one_server_and_a_corrupt_one_none() {
    let dir = TempDataDir::new("exclusive");
    let store = open(dir.path(), Durability::Sync, 1).await;
    put(&store, "d", PutMode::Create, None, &[batch(0)])
        .await
        .expect("create");
    let second = Store::open(
        Arc::new(HostBackend::new()),
        StoreOptions {
            data_dir: Some(dir.path().to_owned()),
            ..StoreOptions::default()
        },
    )
    .await;
    let error = second.expect_err("the directory is in use");
    assert!(error.to_string().contains("in use"), "{error}");
    store.close().await;
    drop(store);

    // A damaged segment fails the reads of its own dataset, naming the file, and nothing
    // else: the server starts and serves the rest.
    let store = open(dir.path(), Durability::Sync, 1).await;
    put(&store, "other", PutMode::Create, None, &[batch(1)])
        .await
        .expect("create");
    store.close().await;
    drop(store);
    let segment = std::fs::read_dir(dir.path().join("segments"))
        .expect("segments")
        .flatten()
        .map(|e| e.path())
        .filter(|path| path.extension().is_some_and(|e| e == "arrow"))
        .min()
        .expect("the first segment, d's");
    let mut bytes = std::fs::read(&segment).expect("read");
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    std::fs::write(&segment, &bytes).expect("damage");
    let store = open(dir.path(), Durability::Sync, 1).await;
    let damaged = store.get("d").expect("listed");
    let error = damaged
        .read(0..damaged.num_rows(), 1 << 20, 2)
        .expect("a stream")
        .try_collect::<Vec<_>>()
        .await
        .expect_err("a corrupt segment");
    assert!(matches!(error, StoreError::Corrupt(_)), "{error}");
    let name = segment
        .file_name()
        .expect("name")
        .to_string_lossy()
        .into_owned();
    assert!(error.to_string().contains(&name), "{error}");
    assert_eq!(read_all(&store, "other").await, batch(1));
    store.close().await;
    drop(store);

    // A segment of another size than the manifest records (truncated, or replaced) is
    // found at start: its dataset is not served (DATA_LOSS naming the file), the others are.
    std::fs::write(&segment, &bytes[..middle]).expect("truncate");
    let store = open(dir.path(), Durability::Sync, 1).await;
    let error = store.get("d").expect_err("a truncated segment");
    assert!(matches!(error, StoreError::Damaged { .. }), "{error}");
    assert!(error.to_string().contains(&name), "{error}");
    assert_eq!(read_all(&store, "other").await, batch(1));
    store.close().await;
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

/// The files hold every dataset's name and rows: only the server's user may read them.
#[tokio::test]
async fn the_data_directory_is_private_to_the_servers_user() {
    use std::os::unix::fs::PermissionsExt;
    let dir = TempDataDir::new("private");
    let store = open(dir.path(), Durability::Sync, 1).await;
    put(&store, "secret", PutMode::Create, None, &[batch(0)])
        .await
        .expect("create");
    put(&store, "secret", PutMode::Append, None, &[batch(1)])
        .await
        .expect("append");
    store.close().await;
    let mut checked = 0;
    let mut pending = vec![dir.path().to_owned()];
    while let Some(path) = pending.pop() {
        let meta = std::fs::metadata(&path).expect("metadata");
        let mode = meta.permissions().mode() & 0o777;
        if meta.is_dir() {
            assert_eq!(mode, 0o700, "{}", path.display());
            for entry in std::fs::read_dir(&path).expect("list") {
                pending.push(entry.expect("entry").path());
            }
        } else {
            assert_eq!(mode & 0o077, 0, "{} is {mode:o}", path.display());
        }
        checked += 1;
    }
    assert!(
        checked >= 5,
        "the directory, segments/, a segment, the manifest, the lock"
    );
}

/// A put made durable can leave memory as a dataset loaded from disk can: with no host tier,
/// the next put that needs its room drops it back to its files instead of being refused
/// (three puts of 40 MB under 64 MiB failed at the second before).
#[tokio::test]
async fn durable_puts_make_way_for_later_ones() {
    let dir = TempDataDir::new("durable-evict");
    let options = StoreOptions {
        memory_limit: Some(4_000_000),
        host_memory_limit: Some(0),
        ..StoreOptions::default()
    };
    let store = open_with(dir.path(), 1, options).await;
    for (index, name) in ["a", "b", "c", "d"].into_iter().enumerate() {
        put(&store, name, PutMode::Create, None, &[batch(index as i64)])
            .await
            .expect("room is made by what is on disk");
    }
    let tiers = store.status().tiers;
    assert!(tiers.evictions >= 2, "{tiers:?}");
    assert!(store.get("a").expect("a").tier_bytes().disk > 0);
    for (index, name) in ["a", "b", "c", "d"].into_iter().enumerate() {
        assert_eq!(read_all(&store, name).await, batch(index as i64), "{name}");
    }
    // An append's new partition is held on disk too.
    put(&store, "d", PutMode::Append, None, &[batch(9)])
        .await
        .expect("append");
    for (index, name) in ["a", "b", "c"].into_iter().enumerate() {
        assert_eq!(read_all(&store, name).await, batch(index as i64), "{name}");
    }
    store.close().await;
}
