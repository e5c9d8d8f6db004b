//! A fault at every file-system step of every kind of commit, followed by a crash, a reopen, a
//! discard or a retry, leaves exactly the old catalog or the new one, and nothing else on disk.

use std::path::Path;

use arrow::array::RecordBatch;

use super::super::change::{apply, effect};
use super::super::fs::FaultPlan;
use super::super::{Change, DataDir, DatasetEntry, FilesError, Manifest, Segment};
use super::{
    Contents, TempDir, batch, expected_tree, old_state, read_dataset, rows, schema, set, tree,
};
fn new_parts() -> [Vec<RecordBatch>; 2] {
    [vec![batch(1000, 6)], vec![batch(2000, 2), batch(3000, 1)]]
}

/// The commits the fault matrix runs, each from [`old_state`].
#[derive(Debug, Clone, Copy, PartialEq)]
enum Op {
    /// "d" replaced by version 2, in two new segments: a journal record.
    Replace,
    /// The same, written as a new checkpoint that empties the journal.
    ReplaceByCheckpoint,
    /// Rows appended to "d", in a new segment.
    Append,
    /// "keep"'s two segments merged into one, as the background merges do.
    Merge,
    /// "d" dropped.
    Remove,
}

/// What one attempt at an operation got as far as: the segments it wrote, and the
/// catalog and rows it makes.
#[derive(Default)]
struct Attempt {
    written: Vec<Segment>,
    new: Option<(Manifest, Contents)>,
}

fn run_op(
    op: Op,
    dir: &mut DataDir,
    old: &(Manifest, Contents),
    attempt: &mut Attempt,
) -> Result<(), FilesError> {
    let (mut manifest, mut contents) = old.clone();
    let change = match op {
        Op::Replace | Op::ReplaceByCheckpoint => {
            if op == Op::ReplaceByCheckpoint {
                dir.checkpoint_next();
            }
            for part in new_parts() {
                let segment = dir.write_segment(&schema(), &part)?;
                attempt.written.push(segment);
            }
            contents.insert("d".to_owned(), new_parts().concat());
            set("d", 2, attempt.written.clone())
        }
        Op::Append => {
            let part = vec![batch(7000, 2)];
            attempt.written.push(dir.write_segment(&schema(), &part)?);
            contents.get_mut("d").expect("d").extend(part);
            let entry = DatasetEntry {
                version: 2,
                tag: None,
                segments: attempt.written.clone(),
            };
            let name = "d".to_owned();
            Change::Append { name, entry }
        }
        Op::Merge => {
            let run = old.0.datasets["keep"].segments.clone();
            let files = dir.segment_files();
            let pins: Vec<_> = run.iter().map(|s| files.pin(s)).collect();
            let merged = dir.segment_writer().merge(&pins)?;
            drop(pins);
            attempt.written.push(merged.clone());
            let name = "keep".to_owned();
            Change::Merge {
                name,
                at: 0,
                run,
                merged,
            }
        }
        Op::Remove => {
            contents.remove("d");
            Change::Remove {
                name: "d".to_owned(),
            }
        }
    };
    let mut datasets = manifest.datasets.clone();
    effect(&datasets, &change).expect("the change applies");
    apply(&mut datasets, change.clone());
    manifest.datasets = datasets;
    attempt.new = Some((manifest, contents));
    dir.commit(change)
}

/// Reopens `root` and checks it holds exactly the old catalog or exactly `new`, every
/// dataset reads back as committed, nothing else is left, and it takes commits again.
fn check_reopened(
    root: &Path,
    old: &(Manifest, Contents),
    new: Option<&(Manifest, Contents)>,
    must_be_new: bool,
    context: &str,
) {
    let (mut dir, manifest) = DataDir::open(root).unwrap_or_else(|e| panic!("{context}: {e}"));
    let is_new = new.is_some_and(|(new, _)| *new == manifest);
    assert!(
        is_new || manifest == old.0,
        "{context}: torn catalog {manifest:?}"
    );
    assert!(
        is_new || !must_be_new,
        "{context}: a commit that returned Ok was lost"
    );
    let contents = match new {
        Some((_, contents)) if is_new => contents,
        _ => &old.1,
    };
    assert_eq!(
        manifest.datasets.keys().collect::<Vec<_>>(),
        contents.keys().collect::<Vec<_>>()
    );
    for (name, entry) in &manifest.datasets {
        assert_eq!(
            rows(&read_dataset(&dir, entry)),
            rows(&contents[name]),
            "{context}: {name}"
        );
    }
    assert_eq!(tree(root), expected_tree(&manifest), "{context}: leftovers");
    // Whatever a crash left at the journal's end is gone: a new record follows.
    let segment = dir
        .write_segment(&schema(), &[batch(9000, 1)])
        .expect("write");
    dir.commit(set("after", 1, vec![segment]))
        .unwrap_or_else(|e| panic!("{context}: {e}"));
    let expected = dir.catalog().clone();
    drop(dir);
    let (_, reopened) = DataDir::open(root).unwrap_or_else(|e| panic!("{context}: {e}"));
    assert_eq!(reopened, expected, "{context}: after a later commit");
}

/// What follows a fault: the process dies there, or the store carries on with the error.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Then {
    /// Every later step fails too, so no cleanup runs; then the directory is reopened.
    Crash,
    /// The directory is closed and reopened.
    Reopen,
    /// The store discards what the put wrote, then the server stops.
    Discard,
    /// The store discards what the put wrote, and a later put succeeds.
    Retry,
}

/// Injects a fault at every step of `op` in turn, followed by each of [`Then`].
fn every_fault_of(op: Op) -> u64 {
    let then = [Then::Crash, Then::Reopen, Then::Discard, Then::Retry];
    let mut steps = u64::MAX;
    // A torn write puts half its bytes down before it fails.
    for (then, torn) in then.into_iter().flat_map(|t| [(t, false), (t, true)]) {
        let mut step = 0;
        loop {
            let context = format!("{op:?}, {then:?}, torn {torn}, step {step}");
            let tmp = TempDir::new();
            let old = old_state(tmp.path());
            let (mut dir, opened) = DataDir::open(tmp.path()).expect("open");
            assert_eq!(opened, old.0);
            let crash = then == Then::Crash;
            dir.inject(FaultPlan { step, torn, crash });
            let mut attempt = Attempt::default();
            let result = run_op(op, &mut dir, &old, &mut attempt);
            if !dir.fault_fired() {
                result.expect("no fault, no error");
                drop(dir);
                check_reopened(tmp.path(), &old, attempt.new.as_ref(), true, &context);
                break;
            }
            // Only a failed deletion after the commit can leave the operation Ok.
            let mut must_be_new = result.is_ok();
            if let Err(e) = &result {
                let message = e.to_string();
                assert!(message.contains("injected fault"), "{context}: {message}");
                let path = tmp.path().to_string_lossy();
                assert!(message.contains(&*path), "{context}: {message}");
                assert_eq!(dir.catalog(), &old.0, "{context}: the catalog changed");
            }
            if result.is_err() && matches!(then, Then::Discard | Then::Retry) {
                // The store keeps serving the old version, which must still read back.
                for segment in &attempt.written {
                    dir.discard(segment).expect("discard");
                }
                for (name, entry) in &old.0.datasets {
                    let read = rows(&read_dataset(&dir, entry));
                    assert_eq!(read, rows(&old.1[name]), "{context}");
                }
            }
            if result.is_err() && then == Then::Retry {
                // Steps after a fault that is no crash go through.
                attempt = Attempt::default();
                run_op(op, &mut dir, &old, &mut attempt).expect("retry");
                must_be_new = true;
            }
            drop(dir);
            let new = attempt.new.as_ref();
            check_reopened(tmp.path(), &old, new, must_be_new, &context);
            step += 1;
        }
        steps = steps.min(step);
    }
    steps
}

#[test]
fn every_fault_of_a_journal_record_leaves_the_old_or_the_new_catalog() {
    // Two segments (create, write, fsync, rename, directory fsync each), the record
    // (a write, an fsync) and the old segment's deletion.
    let steps = every_fault_of(Op::Replace);
    assert!(steps >= 13, "only {steps} steps");
    // A segment, the record.
    let steps = every_fault_of(Op::Append);
    assert!(steps >= 7, "only {steps} steps");
    // The record, the deletion of its segment.
    let steps = every_fault_of(Op::Remove);
    assert!(steps >= 3, "only {steps} steps");
}

#[test]
fn every_fault_of_a_checkpoint_leaves_the_old_or_the_new_catalog() {
    // Two segments, the checkpoint (create, write, fsync, rename, directory fsync), the
    // journal emptied (a truncation, an fsync) and the old segment's deletion.
    let steps = every_fault_of(Op::ReplaceByCheckpoint);
    assert!(steps >= 18, "only {steps} steps");
}

#[test]
fn every_fault_of_a_merge_leaves_the_old_or_the_new_catalog() {
    // The merged segment, the record, the two merged segments' deletions.
    let steps = every_fault_of(Op::Merge);
    assert!(steps >= 9, "only {steps} steps");
}
