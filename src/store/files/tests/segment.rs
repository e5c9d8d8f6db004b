//! Segment files: plain Arrow IPC files, checked as they are read and written.

use std::fs::{self, File};

use arrow::array::RecordBatch;
use arrow::datatypes::{DataType, Field, Schema};
use arrow::ipc::reader::FileReader;

use super::super::layout::{JOURNAL, LOCK, MANIFEST, SEGMENTS};
use super::super::{DataDir, FilesError, Segment};
use super::{TempDir, batch, schema, tree};
#[test]
fn segments_are_plain_arrow_ipc_files() {
    let tmp = TempDir::new();
    let (mut dir, _) = DataDir::open(tmp.path()).expect("open");
    let batches = vec![batch(0, 4), batch(10, 0), batch(20, 3)];
    let full = dir.write_segment(&schema(), &batches).expect("write");
    let empty = dir.write_segment(&schema(), &[]).expect("write");
    assert_eq!((full.rows, empty.rows), (7, 0));

    // Arrow's own reader, which reads what pyarrow.ipc.open_file does.
    for (segment, expected) in [(&full, &batches), (&empty, &vec![])] {
        let path = tmp.path().join(SEGMENTS).join(&segment.file);
        assert_eq!(fs::metadata(&path).expect("stat").len(), segment.bytes);
        let data = fs::read(&path).expect("read");
        assert_eq!(crc32fast::hash(&data), segment.checksum);
        let reader = FileReader::try_new(File::open(&path).expect("open"), None).expect("ipc");
        assert_eq!(reader.schema(), schema());
        let read: Vec<RecordBatch> = reader.collect::<Result<_, _>>().expect("batches");
        assert_eq!(&read, expected);

        let (got, read) = dir.read_segment(segment).expect("read_segment");
        assert_eq!(got, schema(), "the schema survives with no batches too");
        assert_eq!(&read, expected);
    }
}

#[test]
fn a_damaged_segment_is_corrupt_naming_the_file() {
    let tmp = TempDir::new();
    let (mut dir, _) = DataDir::open(tmp.path()).expect("open");
    let segment = dir.write_segment(&schema(), &[batch(0, 8)]).expect("write");
    let path = tmp.path().join(SEGMENTS).join(&segment.file);
    let good = fs::read(&path).expect("read");

    for at in [0, good.len() / 2, good.len() - 1] {
        let mut bad = good.clone();
        bad[at] ^= 0x20;
        fs::write(&path, &bad).expect("damage");
        let error = dir.read_segment(&segment).expect_err("flipped byte");
        assert!(matches!(error, FilesError::Corrupt { .. }), "{error}");
        assert!(error.to_string().contains(&segment.file), "{error}");
    }
    fs::write(&path, &good[..good.len() - 3]).expect("truncate");
    let error = dir.read_segment(&segment).expect_err("truncated");
    assert!(error.to_string().contains("its size is"), "{error}");
    fs::remove_file(&path).expect("remove");
    let error = dir.read_segment(&segment).expect_err("missing");
    assert!(error.to_string().contains(&segment.file), "{error}");
    fs::write(&path, &good).expect("restore");
    assert_eq!(
        dir.read_segment(&segment).expect("read").1,
        vec![batch(0, 8)]
    );
}

#[test]
fn forged_segments_are_errors_not_panics() {
    // A file whose checksum matches yet is not valid Arrow: only a forger makes one, and
    // it still must not take the server down.
    let tmp = TempDir::new();
    let (mut dir, _) = DataDir::open(tmp.path()).expect("open");
    let segment = dir.write_segment(&schema(), &[batch(0, 3)]).expect("write");
    let path = tmp.path().join(SEGMENTS).join(&segment.file);
    let good = fs::read(&path).expect("read");
    let forge = |data: &[u8]| {
        fs::write(&path, data).expect("forge");
        let forged = Segment {
            bytes: data.len() as u64,
            checksum: crc32fast::hash(data),
            ..segment.clone()
        };
        // Either outcome is fine; a panic or an abort is not.
        let _ = dir.read_segment(&forged);
    };
    for at in 0..good.len() {
        for flip in [0x01, 0x80, 0xff] {
            let mut bad = good.clone();
            bad[at] ^= flip;
            forge(&bad);
        }
    }
    for len in (0..good.len()).step_by(5) {
        forge(&good[..len]);
    }
    forge(b"ARROW1\0\0not really\xff\xff\xff\x7fARROW1");
}

#[test]
fn a_batch_of_another_schema_is_refused_and_leaves_nothing() {
    let tmp = TempDir::new();
    let (mut dir, _) = DataDir::open(tmp.path()).expect("open");
    let other = Schema::new(vec![Field::new("id", DataType::Int64, false)]);
    let error = dir
        .write_segment(&other, &[batch(0, 1)])
        .expect_err("mismatch");
    assert!(matches!(error, FilesError::Arrow { .. }), "{error}");
    assert_eq!(
        tree(tmp.path()),
        [LOCK, MANIFEST, JOURNAL, SEGMENTS].map(String::from).into()
    );
}
