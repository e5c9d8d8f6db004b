//! The open directory: its lock, the checks of what commits name, quarantine, the sweep, and
//! segment ids.

use std::fs;

use super::super::layout::{LOCK, MANIFEST, MANIFEST_TMP, SEGMENTS, parse_file_name};
use super::super::manifest;
use super::super::{Change, DataDir, DatasetEntry, FilesError, Manifest, Segment};
use super::{
    TempDir, batch, checkpointed_state, expected_tree, old_state, read_dataset, schema, set, tree,
};
#[test]
fn a_manifest_naming_foreign_or_missing_segments_is_refused() {
    let tmp = TempDir::new();
    let (old, _) = checkpointed_state(tmp.path());
    let (mut dir, _) = DataDir::open(tmp.path()).expect("open");
    let real = old.datasets["d"].segments[0].clone();
    let kept = old.datasets["keep"].segments[0].clone();
    let named = |file: &str| Segment {
        file: file.to_owned(),
        ..real.clone()
    };
    for segment in [
        named("../../etc/passwd"),
        named("/etc/passwd"),
        named("seg-1.arrow"),
        named("seg-00000000000000000099.arrow"),
        Segment {
            bytes: real.bytes + 1,
            ..real.clone()
        },
        // Named by another dataset already: deleting one would break the other.
        kept.clone(),
    ] {
        let error = dir
            .commit(set("other", 1, vec![segment.clone()]))
            .expect_err(&segment.file);
        assert!(
            matches!(error, FilesError::UnknownSegment { .. }),
            "{error}"
        );
    }
    // Changes that do not apply to the catalog as it is.
    let entry = DatasetEntry {
        version: 3,
        tag: None,
        segments: vec![],
    };
    let name = "missing".to_owned();
    let error = dir
        .commit(Change::Append { name, entry })
        .expect_err("no such dataset");
    assert!(matches!(error, FilesError::Inapplicable { .. }), "{error}");
    let stale = Change::Merge {
        name: "keep".to_owned(),
        at: 1,
        run: vec![kept.clone()],
        merged: real.clone(),
    };
    let error = dir.commit(stale).expect_err("not where it was");
    assert!(matches!(error, FilesError::Inapplicable { .. }), "{error}");
    drop(dir);
    assert_eq!(DataDir::open(tmp.path()).expect("open").1, old);

    // Damaged files: the open quarantines the dataset, names the file and keeps it.
    let path = tmp.path().join(MANIFEST);
    let segment = tmp.path().join(SEGMENTS).join(&real.file);
    let data = fs::read(&segment).expect("read");
    fs::remove_file(&segment).expect("remove");
    let (dir, _) = DataDir::open(tmp.path()).expect("only d is damaged");
    let reason = &dir.damaged()["d"].reason;
    assert!(reason.contains("missing"), "{reason}");
    assert!(reason.contains(&real.file), "{reason}");
    drop(dir);
    fs::write(&segment, &data[..10]).expect("write");
    let (dir, _) = DataDir::open(tmp.path()).expect("only d is damaged");
    assert!(dir.damaged()["d"].reason.contains(&real.file));
    assert_eq!(dir.damaged().len(), 1);
    drop(dir);
    assert!(segment.exists(), "a damaged dataset's files are kept");

    // Written by hand, as a forger or a bug elsewhere would: commits go on with d as it
    // was found, and dropping d deletes only files of ours, never what a name points at.
    let mut bad = old.clone();
    bad.datasets.get_mut("d").expect("d").segments[0].file = "../LOCK".to_owned();
    fs::write(&path, manifest::encode(&bad, 0).expect("encode")).expect("write");
    let (mut dir, _) = DataDir::open(tmp.path()).expect("only d is damaged");
    let reason = &dir.damaged()["d"].reason;
    assert!(
        reason.contains("\"../LOCK\" is not a segment file name"),
        "{reason}"
    );
    assert_eq!(dir.damaged().len(), 1);
    dir.commit(Change::Remove {
        name: "d".to_owned(),
    })
    .expect("a drop of the damaged dataset");
    assert!(dir.damaged().is_empty());
    dir.checkpoint().expect("checkpoint");
    assert!(tmp.path().join(LOCK).exists());
    drop(dir);
    let (dir, catalog) = DataDir::open(tmp.path()).expect("open");
    assert!(dir.damaged().is_empty());
    assert!(!catalog.datasets.contains_key("d"));
}

#[test]
fn a_locked_directory_cannot_be_opened_twice() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<DataDir>(); // the store moves it into spawn_blocking
    let tmp = TempDir::new();
    let (first, _) = DataDir::open(tmp.path()).expect("open");
    let error = DataDir::open(tmp.path()).expect_err("second open");
    assert!(matches!(error, FilesError::Locked { .. }), "{error}");
    assert!(
        error.to_string().contains("in use by another process"),
        "{error}"
    );
    assert!(
        error.to_string().contains(&*tmp.path().to_string_lossy()),
        "{error}"
    );
    drop(first);
    DataDir::open(tmp.path()).expect("open once the first is closed");
}

#[test]
fn dataset_names_never_become_paths() {
    let tmp = TempDir::new();
    let (mut dir, _) = DataDir::open(tmp.path()).expect("open");
    let names = [
        "../../etc/passwd".to_owned(),
        "a/b".to_owned(),
        "/abs".to_owned(),
        "nul\0inside".to_owned(),
        "..".to_owned(),
        String::new(),
        "segments/seg-00000000000000000000.arrow".to_owned(),
        "\u{202e}ünïcödé\n\"quoted\"".to_owned(),
        "x".repeat(1 << 20),
    ];
    let mut manifest = Manifest::default();
    for (version, name) in names.iter().enumerate() {
        let segment = dir.write_segment(&schema(), &[]).expect("write");
        let entry = DatasetEntry {
            version: version as u64,
            tag: None,
            segments: vec![segment],
        };
        manifest.datasets.insert(name.clone(), entry.clone());
        let name = name.clone();
        dir.commit(Change::Set { name, entry }).expect("commit");
    }
    drop(dir);
    let (dir, reopened) = DataDir::open(tmp.path()).expect("reopen");
    assert_eq!(reopened, manifest);
    assert_eq!(tree(tmp.path()), expected_tree(&manifest));
    for entry in reopened.datasets.values() {
        assert!(read_dataset(&dir, entry).is_empty());
    }
}

#[test]
fn segment_ids_survive_restarts_and_sweeps() {
    let tmp = TempDir::new();
    let (mut dir, _) = DataDir::open(tmp.path()).expect("open");
    let committed = dir.write_segment(&schema(), &[batch(0, 1)]).expect("write");
    let mut manifest = Manifest::default();
    manifest.datasets.insert(
        "d".to_owned(),
        DatasetEntry {
            version: 1,
            tag: None,
            segments: vec![committed.clone()],
        },
    );
    dir.commit(set("d", 1, vec![committed.clone()]))
        .expect("commit");
    // A put that never committed, as a crash would leave it, and its temporary file.
    let orphan = dir.write_segment(&schema(), &[batch(0, 2)]).expect("write");
    let segments = tmp.path().join(SEGMENTS);
    fs::write(segments.join("seg-00000000000000000077.arrow.tmp"), b"half").expect("tmp");
    fs::write(tmp.path().join(MANIFEST_TMP), b"half a manifest").expect("tmp");
    fs::write(segments.join("notes.txt"), b"not ours").expect("foreign");
    drop(dir);

    let (mut dir, reopened) = DataDir::open(tmp.path()).expect("reopen");
    assert_eq!(reopened, manifest);
    let mut expected = expected_tree(&manifest);
    expected.insert(format!("{SEGMENTS}/notes.txt"));
    assert_eq!(
        tree(tmp.path()),
        expected,
        "leftovers swept, foreign files kept"
    );
    let next = dir.write_segment(&schema(), &[]).expect("write");
    let id = |s: &Segment| parse_file_name(&s.file).expect("ours").0;
    assert!(
        id(&next) > id(&orphan) && id(&next) > 77,
        "{next:?} reuses an id"
    );
    assert!(id(&orphan) > id(&committed));
}

#[test]
fn discard_removes_only_what_no_manifest_names() {
    let tmp = TempDir::new();
    let (old, _) = old_state(tmp.path());
    let (mut dir, _) = DataDir::open(tmp.path()).expect("open");
    let committed = old.datasets["d"].segments[0].clone();
    let pending = dir.write_segment(&schema(), &[batch(0, 1)]).expect("write");
    dir.discard(&pending).expect("discard");
    dir.discard(&pending).expect("discarding twice is harmless");
    dir.discard(&committed).expect("kept");
    assert_eq!(tree(tmp.path()), expected_tree(&old));
}
