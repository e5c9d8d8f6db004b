//! The journal: torn and damaged records, replay after a checkpoint, and what commits cost.

use std::fs;

use super::super::journal::{self, JOURNAL_BYTES, Record};
use super::super::layout::{JOURNAL, MANIFEST};
use super::super::{Change, DataDir, DatasetEntry, FilesError};
use super::{TempDir, batch, expected_tree, old_state, schema, set, tree};
/// The journal's records: (start, end) of each, by walking the length prefixes.
fn records(journal: &[u8]) -> Vec<(usize, usize)> {
    let mut found = Vec::new();
    let mut at = 0;
    while at < journal.len() {
        let length = u32::from_le_bytes(journal[at..at + 4].try_into().expect("4")) as usize;
        found.push((at, at + 8 + length));
        at += 8 + length;
    }
    found
}

#[test]
fn a_torn_last_record_is_cut_off_at_open() {
    let tmp = TempDir::new();
    let (old, _) = old_state(tmp.path());
    let path = tmp.path().join(JOURNAL);
    // One more record, the one a crash tears.
    let (mut dir, _) = DataDir::open(tmp.path()).expect("open");
    let segment = dir
        .write_segment(&schema(), &[batch(50, 2)])
        .expect("write");
    dir.commit(set("late", 1, vec![segment])).expect("commit");
    drop(dir);
    let good = fs::read(&path).expect("journal");
    let &(start, end) = records(&good).last().expect("records");
    let mut tails: Vec<(String, Vec<u8>)> = (start..end)
        .map(|len| (format!("cut at {len}"), good[..len].to_vec()))
        .collect();
    // A file grown before its data reached the disk reads as zeros there.
    let mut zeros = good.clone();
    zeros[start..].fill(0);
    tails.push(("zero-filled".to_owned(), zeros));
    let mut flipped = good.clone();
    flipped[end - 2] ^= 0x10;
    tails.push(("its last bytes damaged".to_owned(), flipped));
    for (case, bytes) in tails {
        fs::write(&path, &bytes).expect("tear");
        let (mut dir, opened) = DataDir::open(tmp.path()).unwrap_or_else(|e| panic!("{case}: {e}"));
        assert_eq!(opened, old, "{case}");
        assert_eq!(
            fs::metadata(&path).expect("journal").len(),
            start as u64,
            "{case}"
        );
        assert_eq!(tree(tmp.path()), expected_tree(&old), "{case}: swept");
        // A record appended now follows the last whole one.
        let segment = dir
            .write_segment(&schema(), &[batch(60, 1)])
            .expect("write");
        dir.commit(set("after", 1, vec![segment])).expect("commit");
        let expected = dir.catalog().clone();
        drop(dir);
        assert_eq!(
            DataDir::open(tmp.path()).expect("reopen").1,
            expected,
            "{case}"
        );
    }
}

#[test]
fn a_bad_record_before_good_ones_is_corruption_and_deletes_nothing() {
    let tmp = TempDir::new();
    let (old, _) = old_state(tmp.path());
    let path = tmp.path().join(JOURNAL);
    let good = fs::read(&path).expect("journal");
    let spans = records(&good);
    assert!(spans.len() >= 4, "{spans:?}");
    let (start, end) = spans[1];
    let mut flipped = good.clone();
    flipped[(start + end) / 2] ^= 0x01;
    let mut short = good.clone();
    short[start..start + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    let mut swapped = good[..spans[1].0].to_vec();
    swapped.extend_from_slice(&good[spans[2].0..spans[2].1]);
    swapped.extend_from_slice(&good[spans[1].0..spans[1].1]);
    swapped.extend_from_slice(&good[spans[2].1..]);
    let mut gap = good[..spans[1].0].to_vec();
    gap.extend_from_slice(&good[spans[2].0..]);
    let forged = |seq: u64, change: Change| {
        let mut bytes = good.clone();
        bytes.extend(journal::encode(&Record { seq, change }).expect("encode"));
        bytes
    };
    let next = spans.len() as u64 + 1;
    let entry = DatasetEntry {
        version: 9,
        tag: None,
        segments: vec![],
    };
    let name = "nobody".to_owned();
    let inapplicable = forged(next, Change::Append { name, entry });
    let invalid = {
        let payload = b"{\"seq\": 5, \"change\": {\"rename\": {}}}";
        let mut bytes = good.clone();
        bytes.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
        bytes.extend_from_slice(payload);
        bytes
    };
    let cases: [(&str, &[u8], &str); 6] = [
        ("a flipped byte", &flipped, "yet a whole record follows"),
        ("a damaged length", &short, "yet a whole record follows"),
        ("records out of order", &swapped, "follows record"),
        ("a record missing", &gap, "follows record"),
        ("a change that does not apply", &inapplicable, "no dataset"),
        ("a record of no known change", &invalid, "does not parse"),
    ];
    for (case, bytes, says) in cases {
        fs::write(&path, bytes).expect("damage");
        let error = DataDir::open(tmp.path()).expect_err(case);
        assert!(
            matches!(error, FilesError::Corrupt { .. }),
            "{case}: {error}"
        );
        let message = error.to_string();
        assert!(
            message.contains(&*path.to_string_lossy()),
            "{case}: {message}"
        );
        assert!(message.contains(says), "{case}: {message}");
        assert_eq!(
            fs::read(&path).expect("journal"),
            bytes,
            "{case}: kept as found"
        );
        assert_eq!(
            tree(tmp.path()),
            expected_tree(&old),
            "{case}: the segments stay"
        );
    }
    // Records with no checkpoint before them: the manifest was lost.
    fs::write(&path, &good).expect("restore");
    let manifest = fs::read(tmp.path().join(MANIFEST)).expect("manifest");
    fs::remove_file(tmp.path().join(MANIFEST)).expect("remove");
    let error = DataDir::open(tmp.path()).expect_err("no manifest");
    assert!(error.to_string().contains("no manifest.json"), "{error}");
    fs::write(tmp.path().join(MANIFEST), manifest).expect("restore");
    assert_eq!(DataDir::open(tmp.path()).expect("open").1, old);
}

#[test]
fn records_a_checkpoint_holds_are_not_applied_twice() {
    let tmp = TempDir::new();
    let (old, _) = old_state(tmp.path());
    let path = tmp.path().join(JOURNAL);
    let journal = fs::read(&path).expect("journal");
    assert!(!journal.is_empty());
    let (mut dir, _) = DataDir::open(tmp.path()).expect("open");
    dir.checkpoint().expect("checkpoint");
    drop(dir);
    assert_eq!(fs::metadata(&path).expect("journal").len(), 0);
    // A crash after the checkpoint was renamed into place, before the journal was emptied.
    fs::write(&path, &journal).expect("put back");
    let (mut dir, opened) = DataDir::open(tmp.path()).expect("open");
    assert_eq!(opened, old);
    assert_eq!(
        fs::metadata(&path).expect("journal").len(),
        0,
        "spent records go"
    );
    dir.commit(Change::Remove {
        name: "d".to_owned(),
    })
    .expect("commit");
    let expected = dir.catalog().clone();
    drop(dir);
    assert_eq!(DataDir::open(tmp.path()).expect("reopen").1, expected);
}

#[test]
fn commits_cost_what_they_change() {
    let tmp = TempDir::new();
    let (mut dir, _) = DataDir::open(tmp.path()).expect("open");
    let size = |name: &str| fs::metadata(tmp.path().join(name)).map_or(0, |m| m.len());
    let mut checkpoints = 0;
    let mut checkpoint = size(MANIFEST);
    for i in 0..2000 {
        let segment = dir.write_segment(&schema(), &[]).expect("write");
        let name = format!("d{}", i % 10);
        let change = if i < 10 {
            set(&name, 1, vec![segment])
        } else {
            let entry = DatasetEntry {
                version: i,
                tag: None,
                segments: vec![segment],
            };
            Change::Append { name, entry }
        };
        let journal = size(JOURNAL);
        dir.commit(change).expect("commit");
        if size(MANIFEST) != checkpoint {
            checkpoints += 1;
            checkpoint = size(MANIFEST);
            assert_eq!(size(JOURNAL), 0);
        } else {
            // One record of what changed, not the catalog: a few hundred bytes.
            assert!(
                size(JOURNAL) - journal < 512,
                "{} bytes",
                size(JOURNAL) - journal
            );
        }
        // The journal is folded once it outgrows the checkpoint (and a floor).
        assert!(size(JOURNAL) <= checkpoint.max(JOURNAL_BYTES) + 512);
    }
    assert!(
        checkpoints > 0 && checkpoints < 40,
        "{checkpoints} checkpoints"
    );
}
