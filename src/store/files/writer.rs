//! Writing segment files ([`SegmentWriter`]): for the commits, and beside them for the
//! background merges, which join a run of small segments into one. A segment is written under
//! a temporary name through [`Fs`], fsync'd, renamed into place and its directory fsync'd, so a
//! name of ours only ever holds a complete file; its CRC-32 is taken as it is written. Batches
//! are prepared here too: an IPC file holds one dictionary per field.

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arrow::array::{Array, ArrayRef, RecordBatch, RecordBatchOptions};
use arrow::compute::concat;
use arrow::datatypes::{DataType, Schema, SchemaRef};
use arrow::error::ArrowError;
use arrow::ipc::writer::FileWriter;

use super::error::{FilesError, arrow_error, corrupt, differs, io_error};
use super::fs::{ChecksummedFile, Fs};
use super::layout::{TMP_SUFFIX, segment_name};
use super::manifest::Segment;
use super::segment::PinnedSegment;
use crate::arrays;
use crate::backend::dictionary;

/// Writes segment files: for the commits, and beside them for the background merges.
#[derive(Debug)]
pub(crate) struct SegmentWriter {
    segments: PathBuf,
    next_id: AtomicU64,
    fs: Fs,
}

impl SegmentWriter {
    /// A writer of files in `segments`, the first with id `next_id`: ids are never reused, so
    /// that a name always means one content.
    pub(super) fn new(segments: PathBuf, next_id: u64) -> Self {
        Self {
            segments,
            next_id: AtomicU64::new(next_id),
            fs: Fs::default(),
        }
    }

    /// The directory the segment files are in.
    pub(super) fn segments(&self) -> &Path {
        &self.segments
    }

    /// The file-system steps of the data directory, shared by the commits and the writes
    /// beside them, so that an injected fault counts them all.
    pub(super) fn fs(&self) -> &Fs {
        &self.fs
    }

    /// Writes `batches` (all of `schema`; none keeps just the schema) as a new segment file.
    pub(crate) fn write(
        &self,
        schema: &Schema,
        batches: &[RecordBatch],
    ) -> Result<Segment, FilesError> {
        let file = segment_name(self.next_id.fetch_add(1, Ordering::Relaxed));
        let path = self.segments.join(&file);
        let tmp = self.segments.join(format!("{file}{TMP_SUFFIX}"));
        // Arrow's writer does not check batches against the schema it was given.
        if let Some(batch) = batches
            .iter()
            .find(|b| b.schema_ref().fields() != schema.fields())
        {
            return Err(FilesError::Arrow {
                path,
                action: "writing",
                source: ArrowError::SchemaError(format!(
                    "a batch has schema {} but the segment's is {schema}",
                    batch.schema_ref()
                )),
            });
        }
        let batches =
            one_dictionary_per_field(schema, batches).map_err(|source| FilesError::Arrow {
                path: path.clone(),
                action: "merging the dictionaries of",
                source,
            })?;
        match self.write_new(&tmp, &path, schema, &batches) {
            Ok((bytes, checksum)) => Ok(Segment {
                file,
                rows: batches.iter().map(|b| b.num_rows() as u64).sum(),
                bytes,
                checksum,
                data_bytes: batches.iter().map(arrays::batch_bytes).sum(),
            }),
            Err(e) => {
                // Best effort: whatever remains is unnamed, and the next open sweeps it.
                let _ = self.fs.remove(&tmp);
                let _ = self.fs.remove(&path);
                Err(e)
            }
        }
    }

    fn write_new(
        &self,
        tmp: &Path,
        path: &Path,
        schema: &Schema,
        batches: &[RecordBatch],
    ) -> Result<(u64, u32), FilesError> {
        let file = self.fs.create(tmp).map_err(io_error(tmp, "creating"))?;
        let mut writer = FileWriter::try_new_buffered(ChecksummedFile::new(file, &self.fs), schema)
            .map_err(arrow_error(tmp, "writing"))?;
        for batch in batches {
            writer.write(batch).map_err(arrow_error(tmp, "writing"))?;
        }
        let tracked = writer
            .into_inner()
            .map_err(arrow_error(tmp, "writing"))?
            .into_inner()
            .map_err(|e| io_error(tmp, "writing")(e.into_error()))?;
        let checksum = tracked.hasher.finalize();
        self.fs
            .sync(&tracked.file)
            .map_err(io_error(tmp, "syncing"))?;
        drop(tracked.file);
        self.fs
            .rename(tmp, path)
            .map_err(io_error(tmp, "renaming into place"))?;
        self.fs.sync_dir(&self.segments)?;
        Ok((tracked.bytes, checksum))
    }

    /// Writes the rows of `run`, in order, as one new segment (its batches joined into one):
    /// what replaces a run of small segments. Each is checked against its checksum and the
    /// rows it records as it is read.
    pub(crate) fn merge(&self, run: &[PinnedSegment]) -> Result<Segment, FilesError> {
        let mut schema = None;
        let mut batches = Vec::new();
        for pinned in run {
            let segment = pinned.segment();
            let path = self.segments.join(&segment.file);
            let (found, read) = pinned.read()?;
            let rows = read.iter().fold(0u64, |sum, b| sum + b.num_rows() as u64);
            if rows != segment.rows {
                return Err(differs(
                    &path,
                    "row count",
                    rows,
                    segment.rows,
                    "the catalog",
                ));
            }
            match &schema {
                None => schema = Some(found),
                Some(first) if first.fields() != found.fields() => {
                    return Err(corrupt(
                        &path,
                        format!("its schema is {found}, but the segment before it has {first}"),
                    ));
                }
                Some(_) => {}
            }
            batches.extend(read);
        }
        let schema = schema.ok_or_else(|| FilesError::Inapplicable {
            name: String::new(),
            reason: "a merge of no segments".to_owned(),
        })?;
        let joined = join(&schema, &batches).map_err(|source| FilesError::Arrow {
            path: self.segments.clone(),
            action: "joining the batches of a merge in",
            source,
        })?;
        self.write(&schema, &joined)
    }
}

/// Column `column` of `batches`, in one array; top-level dictionaries are merged to distinct
/// values, as the backends concatenate them.
fn concat_column(
    schema: &Schema,
    column: usize,
    batches: &[RecordBatch],
) -> Result<ArrayRef, ArrowError> {
    let parts: Vec<&dyn Array> = batches.iter().map(|b| b.column(column).as_ref()).collect();
    match schema.field(column).data_type() {
        DataType::Dictionary(_, _) => {
            dictionary::concat_on_host(&parts).map_err(|e| ArrowError::ComputeError(e.to_string()))
        }
        _ => concat(&parts),
    }
}

/// `batches` (all of `schema`) joined into one batch: the rows of a merge, in order.
fn join(schema: &SchemaRef, batches: &[RecordBatch]) -> Result<Vec<RecordBatch>, ArrowError> {
    if batches.len() < 2 {
        return Ok(batches.to_vec());
    }
    let columns = (0..schema.fields().len())
        .map(|column| concat_column(schema, column, batches))
        .collect::<Result<Vec<_>, _>>()?;
    let rows = batches.iter().map(RecordBatch::num_rows).sum();
    let options = RecordBatchOptions::new().with_row_count(Some(rows));
    Ok(vec![RecordBatch::try_new_with_options(
        Arc::clone(schema),
        columns,
        &options,
    )?])
}

/// An IPC file holds one dictionary per field for all its batches, while each batch a put
/// receives may carry its own. A column containing dictionaries is concatenated (top-level
/// dictionaries merged to distinct values, as the backends concatenate them, so pandas can
/// read the file) and sliced back, so the batches keep their boundaries and share one.
fn one_dictionary_per_field<'a>(
    schema: &Schema,
    batches: &'a [RecordBatch],
) -> Result<Cow<'a, [RecordBatch]>, ArrowError> {
    let is_dictionary = |t: &DataType| matches!(t, DataType::Dictionary(_, _));
    let columns: Vec<usize> = (0..schema.fields().len())
        .filter(|&i| arrays::contains(schema.field(i).data_type(), &is_dictionary))
        .collect();
    if columns.is_empty() || batches.len() < 2 {
        return Ok(Cow::Borrowed(batches));
    }
    let mut arrays: Vec<Vec<ArrayRef>> = batches.iter().map(|b| b.columns().to_vec()).collect();
    for &column in &columns {
        let whole = concat_column(schema, column, batches)?;
        let mut offset = 0;
        for (batch, arrays) in batches.iter().zip(&mut arrays) {
            arrays[column] = whole.slice(offset, batch.num_rows());
            offset += batch.num_rows();
        }
    }
    let shared = batches.iter().zip(arrays).map(|(batch, arrays)| {
        let options = RecordBatchOptions::new().with_row_count(Some(batch.num_rows()));
        RecordBatch::try_new_with_options(batch.schema(), arrays, &options)
    });
    Ok(Cow::Owned(shared.collect::<Result<_, _>>()?))
}
