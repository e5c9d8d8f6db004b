//! Reading segment files back: pins that keep a version's files on disk while it may be
//! read, and the checked decoding of Arrow IPC files. A read of rows checks the file's size
//! and CRC-32 against the catalog first (a read of the schema alone, its size), and a file
//! that passes yet is malformed (only a forger makes one) is corruption, never a panic.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use arrow::array::RecordBatch;
use arrow::buffer::{Buffer, MutableBuffer};
use arrow::datatypes::SchemaRef;
use arrow::ipc::reader::{FileDecoder, read_footer_length};
use arrow::ipc::{Block, Footer, convert::try_fb_to_schema, root_as_footer};

use super::check::check_size;
use super::error::{FilesError, corrupt, crc, differs, io_error};
use super::layout::{MANIFEST, segment_path};
use super::manifest::Segment;

/// The segment files of an open data directory, for loading datasets when they are needed
/// rather than all at start. A file a [`PinnedSegment`] names is never deleted while it is
/// pinned, even once no manifest names it: a version a newer one replaced may still be read.
#[derive(Debug)]
pub(crate) struct SegmentFiles {
    root: PathBuf,
    segments: PathBuf,
    /// File name to the number of pins on it.
    pins: Mutex<HashMap<String, usize>>,
    /// How many files lost their last pin: deletions put off for a pin are retried when it
    /// changes.
    released: AtomicU64,
}

impl SegmentFiles {
    pub(super) fn new(root: PathBuf, segments: PathBuf) -> Self {
        Self {
            root,
            segments,
            pins: Mutex::default(),
            released: AtomicU64::new(0),
        }
    }

    /// Keeps `segment`'s file until the returned pin is dropped.
    pub(crate) fn pin(self: &Arc<Self>, segment: &Segment) -> PinnedSegment {
        let mut pins = self.pins.lock().unwrap_or_else(|p| p.into_inner());
        *pins.entry(segment.file.clone()).or_default() += 1;
        PinnedSegment {
            files: Arc::clone(self),
            segment: segment.clone(),
        }
    }

    pub(super) fn released(&self) -> u64 {
        self.released.load(Ordering::Relaxed)
    }

    pub(super) fn is_pinned(&self, file: &str) -> bool {
        let pins = self.pins.lock().unwrap_or_else(|p| p.into_inner());
        pins.contains_key(file)
    }

    fn path(&self, segment: &Segment) -> Result<PathBuf, FilesError> {
        segment_path(&self.segments, &segment.file)
            .map_err(|reason| corrupt(&self.root.join(MANIFEST), reason))
    }

    /// Reads a segment after checking its size and checksum against `segment`. The arrays
    /// borrow the file's bytes, read once into memory of exactly the file's size.
    pub(super) fn read(
        &self,
        segment: &Segment,
    ) -> Result<(SchemaRef, Vec<RecordBatch>), FilesError> {
        let path = self.path(segment)?;
        check_size(&path, segment)?;
        let mut file = File::open(&path).map_err(io_error(&path, "opening"))?;
        let len = usize::try_from(segment.bytes).map_err(|_| corrupt(&path, "too large"))?;
        // Arrow's allocation is 64-byte aligned, so decoded arrays use it without copying.
        let mut data = MutableBuffer::try_from_len_zeroed(len)
            .map_err(|e| io_error(&path, "reading")(io::Error::other(e.to_string())))?;
        file.read_exact(data.as_slice_mut())
            .map_err(io_error(&path, "reading"))?;
        let checksum = crc32fast::hash(&data);
        if checksum != segment.checksum {
            let (found, recorded) = (crc(checksum), crc(segment.checksum));
            return Err(differs(&path, "CRC-32", found, recorded, "the manifest"));
        }
        let data = Buffer::from(data);
        // The checksum matched, so only a forged file gets here malformed; Arrow's decoder
        // asserts instead of erring on some malformed layouts, and that too is corruption.
        guarded(|| decode(&data)).map_err(|reason| corrupt(&path, reason))
    }

    /// A segment's schema, from its footer alone: what a dataset is listed with before its
    /// rows are loaded. The checksum is checked when the rows are.
    fn read_schema(&self, segment: &Segment) -> Result<SchemaRef, FilesError> {
        let path = self.path(segment)?;
        check_size(&path, segment)?;
        let mut file = File::open(&path).map_err(io_error(&path, "opening"))?;
        let mut trailer = [0u8; 10];
        let footer_start = segment
            .bytes
            .checked_sub(trailer.len() as u64)
            .and_then(|trailer_start| {
                file.seek(SeekFrom::Start(trailer_start)).ok()?;
                file.read_exact(&mut trailer).ok()?;
                let footer_len = read_footer_length(trailer).ok()?;
                trailer_start.checked_sub(footer_len as u64)
            })
            .ok_or_else(|| corrupt(&path, "it has no Arrow file footer"))?;
        // At most the file's size, which `check_size` just read.
        let mut footer = vec![0u8; (segment.bytes - footer_start - 10) as usize];
        file.seek(SeekFrom::Start(footer_start))
            .and_then(|_| file.read_exact(&mut footer))
            .map_err(io_error(&path, "reading"))?;
        guarded(|| {
            let footer =
                root_as_footer(&footer).map_err(|e| format!("its footer does not parse: {e}"))?;
            footer_schema(&footer)
        })
        .map_err(|reason| corrupt(&path, reason))
    }
}

/// `decode`, with a panic of Arrow's decoder (on a forged layout) as an error.
fn guarded<T>(decode: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    std::panic::catch_unwind(AssertUnwindSafe(decode)).unwrap_or_else(|panic| {
        Err(format!(
            "the Arrow decoder panicked: {}",
            crate::task::panic_message(panic.as_ref())
        ))
    })
}

/// One segment a dataset still needs, kept on disk while this lives.
#[derive(Debug)]
pub(crate) struct PinnedSegment {
    files: Arc<SegmentFiles>,
    segment: Segment,
}

impl PinnedSegment {
    pub(crate) fn segment(&self) -> &Segment {
        &self.segment
    }

    /// Its schema and batches, checked against the manifest's checksum.
    pub(crate) fn read(&self) -> Result<(SchemaRef, Vec<RecordBatch>), FilesError> {
        self.files.read(&self.segment)
    }

    /// Its schema, from the file's footer.
    pub(crate) fn read_schema(&self) -> Result<SchemaRef, FilesError> {
        self.files.read_schema(&self.segment)
    }
}

impl Drop for PinnedSegment {
    fn drop(&mut self) {
        let mut pins = self.files.pins.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(count) = pins.get_mut(&self.segment.file) {
            *count -= 1;
            if *count == 0 {
                pins.remove(&self.segment.file);
                self.files.released.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// Decodes an Arrow IPC file held in memory; the arrays borrow `data`. Every block is checked
/// to lie inside the file before it is sliced, as Arrow's own slicing would panic instead.
fn decode(data: &Buffer) -> Result<(SchemaRef, Vec<RecordBatch>), String> {
    let trailer_start = data
        .len()
        .checked_sub(10)
        .ok_or("it is too short for an Arrow file")?;
    let trailer = <[u8; 10]>::try_from(&data[trailer_start..]).map_err(|e| e.to_string())?;
    let footer_len = read_footer_length(trailer).map_err(|e| e.to_string())?;
    let footer_start = trailer_start
        .checked_sub(footer_len)
        .ok_or("its footer length exceeds the file")?;
    let footer = root_as_footer(&data[footer_start..trailer_start])
        .map_err(|e| format!("its footer does not parse: {e}"))?;
    let schema = footer_schema(&footer)?;
    let block_data = |block: &Block| {
        let start = usize::try_from(block.offset()).ok();
        let meta = usize::try_from(block.metaDataLength()).ok();
        let body = usize::try_from(block.bodyLength()).ok();
        let len = meta.zip(body).and_then(|(m, b)| m.checked_add(b));
        match start.zip(len) {
            Some((start, len)) if start.checked_add(len).is_some_and(|e| e <= footer_start) => {
                Ok(data.slice_with_length(start, len))
            }
            _ => Err(format!("a block ({block:?}) lies outside the file")),
        }
    };
    let mut decoder = FileDecoder::new(Arc::clone(&schema), footer.version());
    for block in footer.dictionaries().iter().flatten() {
        decoder
            .read_dictionary(block, &block_data(block)?)
            .map_err(|e| e.to_string())?;
    }
    let mut batches = Vec::new();
    for block in footer.recordBatches().iter().flatten() {
        let batch = decoder
            .read_record_batch(block, &block_data(block)?)
            .map_err(|e| e.to_string())?;
        batches.extend(batch);
    }
    Ok((schema, batches))
}

fn footer_schema(footer: &Footer<'_>) -> Result<SchemaRef, String> {
    let ipc_schema = footer.schema().ok_or("its footer has no schema")?;
    if !ipc_schema.endianness().equals_to_target_endianness() {
        return Err("it was written with the other byte order".to_owned());
    }
    Ok(Arc::new(
        try_fb_to_schema(ipc_schema).map_err(|e| e.to_string())?,
    ))
}
