//! Tests of the data directory, one file per file of `files` they test, and the fixtures they
//! share. They test through [`DataDir`], the only way to open a directory, so they sit above
//! every file of `files` rather than inside the lower ones.

mod crash;
mod dir;
mod journal;
mod manifest;
mod segment;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::{
    ArrayRef, DictionaryArray, Int32Array, Int64Array, ListArray, RecordBatch, StringArray,
    StructArray,
};
use arrow::buffer::OffsetBuffer;
use arrow::datatypes::{DataType, Field, Int8Type, Int32Type, Schema, SchemaRef};

use super::layout::{JOURNAL, LOCK, MANIFEST, SEGMENTS};
use super::{Change, DataDir, DatasetEntry, Manifest, Segment};

/// A directory under the system's temporary one, removed when dropped.
pub(super) struct TempDir(PathBuf);

impl TempDir {
    pub(super) fn new() -> Self {
        let mut name = [0u8; 8];
        getrandom::fill(&mut name).expect("random");
        let path = std::env::temp_dir().join(format!("gpu-flight-files-{}", hex::encode(name)));
        Self(path)
    }

    pub(super) fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// A schema with the types that make IPC files interesting: a dictionary and nesting.
pub(super) fn schema() -> SchemaRef {
    let item = DataType::Struct(
        vec![
            Field::new("a", DataType::Int32, false),
            Field::new("b", DataType::Utf8, true),
            Field::new(
                "c",
                DataType::Dictionary(Box::new(DataType::Int8), Box::new(DataType::Utf8)),
                true,
            ),
        ]
        .into(),
    );
    let tag = DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8));
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("name", DataType::Utf8, true),
        Field::new("tag", tag, false),
        Field::new_list("items", Field::new_list_field(item, true), true),
    ]))
}

pub(super) fn batch(seed: i64, rows: usize) -> RecordBatch {
    let schema = schema();
    let ids = Int64Array::from_iter_values((0..rows as i64).map(|i| seed + i));
    let names: StringArray = (0..rows)
        .map(|i| (i % 3 != 0).then(|| format!("name {}", seed + i as i64)))
        .collect();
    let tags: DictionaryArray<Int32Type> = (0..rows)
        .map(|i| ["x", "y", "z"][(seed as usize + i) % 3])
        .collect();
    let DataType::List(item) = schema.field(3).data_type() else {
        panic!("items is a list");
    };
    let DataType::Struct(fields) = item.data_type() else {
        panic!("items are structs");
    };
    let values = StructArray::new(
        fields.clone(),
        vec![
            Arc::new(Int32Array::from_iter_values(
                (0..2 * rows as i32).map(|v| v * 7),
            )) as ArrayRef,
            Arc::new(StringArray::from_iter(
                (0..2 * rows).map(|v| (v % 2 == 0).then(|| format!("b{v}"))),
            )),
            Arc::new(
                (0..2 * rows)
                    .map(|v| (v % 5 != 0).then_some(["p", "q", "r", "s"][(seed as usize + v) % 4]))
                    .collect::<DictionaryArray<Int8Type>>(),
            ),
        ],
        None,
    );
    let items = ListArray::new(
        Arc::clone(item),
        OffsetBuffer::from_lengths(std::iter::repeat_n(2, rows)),
        Arc::new(values),
        None,
    );
    RecordBatch::try_new(
        schema,
        vec![
            Arc::new(ids),
            Arc::new(names),
            Arc::new(tags),
            Arc::new(items),
        ],
    )
    .expect("batch")
}

pub(super) fn read_dataset(dir: &DataDir, entry: &DatasetEntry) -> Vec<RecordBatch> {
    let mut batches = Vec::new();
    for segment in &entry.segments {
        let (got, read) = dir.read_segment(segment).expect("segment reads back");
        assert_eq!(got, schema());
        assert_eq!(
            read.iter().map(|b| b.num_rows() as u64).sum::<u64>(),
            segment.rows
        );
        batches.extend(read);
    }
    batches
}

/// The rows of `batches`, in one batch: a merge keeps rows, not batch boundaries.
pub(super) fn rows(batches: &[RecordBatch]) -> RecordBatch {
    arrow::compute::concat_batches(&schema(), batches).expect("concat")
}

/// Every file and directory under `root`, relative to it.
pub(super) fn tree(root: &Path) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut pending = vec![root.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in fs::read_dir(&dir).expect("list") {
            let path = entry.expect("entry").path();
            let relative = path.strip_prefix(root).expect("inside");
            found.insert(relative.to_string_lossy().into_owned());
            if path.is_dir() {
                pending.push(path);
            }
        }
    }
    found
}

/// What a reopened directory must hold: the lock, the checkpoint, the journal, and
/// exactly the catalog's segments.
pub(super) fn expected_tree(manifest: &Manifest) -> BTreeSet<String> {
    let mut expected: BTreeSet<String> =
        [LOCK, MANIFEST, JOURNAL, SEGMENTS].map(String::from).into();
    for segment in manifest.datasets.values().flat_map(|d| &d.segments) {
        expected.insert(format!("{SEGMENTS}/{}", segment.file));
    }
    expected
}

pub(super) type Contents = BTreeMap<String, Vec<RecordBatch>>;

pub(super) fn set(name: &str, version: u64, segments: Vec<Segment>) -> Change {
    Change::Set {
        name: name.to_owned(),
        entry: DatasetEntry {
            version,
            tag: None,
            segments,
        },
    }
}

/// The state each crash run starts from, committed through the journal: "d" at version
/// 1, "keep" of two segments (an append), and "empty" with a schema and no rows.
pub(super) fn old_state(root: &Path) -> (Manifest, Contents) {
    let (mut dir, opened) = DataDir::open(root).expect("open");
    assert_eq!(opened, Manifest::default());
    let mut contents = Contents::new();
    for (name, batches) in [
        ("d", vec![batch(0, 5)]),
        ("keep", vec![batch(100, 3)]),
        ("empty", vec![]),
    ] {
        let segment = dir.write_segment(&schema(), &batches).expect("write");
        dir.commit(set(name, 1, vec![segment])).expect("commit");
        contents.insert(name.to_owned(), batches);
    }
    let appended = vec![batch(200, 4), batch(300, 1)];
    let segment = dir.write_segment(&schema(), &appended).expect("write");
    let entry = DatasetEntry {
        version: 2,
        tag: None,
        segments: vec![segment],
    };
    let name = "keep".to_owned();
    dir.commit(Change::Append { name, entry }).expect("append");
    contents.get_mut("keep").expect("keep").extend(appended);
    (dir.catalog().clone(), contents)
}

/// [`old_state`], folded into the checkpoint: the journal is empty.
pub(super) fn checkpointed_state(root: &Path) -> (Manifest, Contents) {
    let state = old_state(root);
    let (mut dir, _) = DataDir::open(root).expect("open");
    dir.checkpoint().expect("checkpoint");
    assert_eq!(fs::metadata(root.join(JOURNAL)).expect("journal").len(), 0);
    state
}
