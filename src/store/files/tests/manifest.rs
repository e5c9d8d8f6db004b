//! The checkpoint: damage is an error at open that deletes nothing; old formats still open.

use std::fs;

use super::super::layout::{JOURNAL, MANIFEST};
use super::super::manifest;
use super::super::{DataDir, FilesError};
use super::{
    TempDir, batch, checkpointed_state, expected_tree, read_dataset, rows, schema, set, tree,
};
#[test]
fn a_damaged_manifest_is_an_error_at_open_and_deletes_nothing() {
    let tmp = TempDir::new();
    let (old, _) = checkpointed_state(tmp.path());
    let path = tmp.path().join(MANIFEST);
    let good = fs::read(&path).expect("read");
    let newline = good.iter().position(|&b| b == b'\n').expect("header");
    let mut flipped = good.clone();
    flipped[newline + 5] ^= 0x01;
    let mut future = manifest::encode(&old, 0).expect("encode");
    let future_newline = future.iter().position(|&b| b == b'\n').expect("header");
    future.splice(
        ..future_newline,
        br#"{"format":2,"bytes":0,"crc32":0}"#.iter().copied(),
    );
    let cases: [(&str, &[u8]); 7] = [
        ("garbage", b"this is not a manifest\n{}"),
        ("empty", b""),
        ("header only", &good[..newline]),
        ("truncated", &good[..good.len() - 4]),
        ("flipped", &flipped),
        ("extended", &[&good[..], b" "].concat()),
        ("future", &future),
    ];
    for (case, bytes) in cases {
        fs::write(&path, bytes).expect("damage");
        let error = DataDir::open(tmp.path()).expect_err(case);
        let message = error.to_string();
        assert!(
            message.contains(&*path.to_string_lossy()),
            "{case}: {message}"
        );
        if case == "future" {
            assert!(
                matches!(error, FilesError::Format { found: 2, .. }),
                "{message}"
            );
        } else {
            assert!(
                matches!(error, FilesError::Corrupt { .. }),
                "{case}: {message}"
            );
        }
        assert_eq!(
            tree(tmp.path()),
            expected_tree(&old),
            "{case}: the segments stay"
        );
    }
    fs::write(&path, &good).expect("restore");
    assert_eq!(DataDir::open(tmp.path()).expect("open").1, old);
}

#[test]
fn a_directory_written_before_the_journal_opens() {
    // What the code before the journal wrote: a manifest of format 1 whose header has no
    // sequence number, and no journal.
    let tmp = TempDir::new();
    let (old, contents) = checkpointed_state(tmp.path());
    fs::remove_file(tmp.path().join(JOURNAL)).expect("remove");
    let body = serde_json::to_vec(&old).expect("json");
    let header = format!(
        r#"{{"format":1,"bytes":{},"crc32":{}}}"#,
        body.len(),
        crc32fast::hash(&body)
    );
    fs::write(
        tmp.path().join(MANIFEST),
        [header.as_bytes(), b"\n", &body].concat(),
    )
    .expect("write");
    let (mut dir, opened) = DataDir::open(tmp.path()).expect("open");
    assert_eq!(opened, old);
    for (name, entry) in &opened.datasets {
        assert_eq!(rows(&read_dataset(&dir, entry)), rows(&contents[name]));
    }
    assert_eq!(tree(tmp.path()), expected_tree(&old));
    let segment = dir.write_segment(&schema(), &[batch(5, 5)]).expect("write");
    dir.commit(set("new", 1, vec![segment])).expect("commit");
    let expected = dir.catalog().clone();
    drop(dir);
    assert_eq!(DataDir::open(tmp.path()).expect("reopen").1, expected);
}
