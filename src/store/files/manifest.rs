//! The checkpoint, `manifest.json`: the catalog's documents ([`Manifest`], [`DatasetEntry`],
//! [`Segment`]) and the file that holds them whole. Its first line is a header with the format,
//! the body's size and CRC-32, and the last journal record the checkpoint includes; the JSON
//! catalog follows. A checkpoint is written under a temporary name, fsync'd, renamed into
//! place and its directory fsync'd, so a crash leaves the old one or the new one.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::error::{Failed, FilesError, corrupt, crc, differs, io_error};
use super::fs::{Fs, write_file};
use super::layout::{MANIFEST, MANIFEST_FORMAT, MANIFEST_TMP};

/// The durable catalog: what `DataDir::open` returns and `DataDir::commit` changes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Manifest {
    pub(crate) datasets: BTreeMap<String, DatasetEntry>,
}

/// One dataset as committed: its version and, in order, the segments holding its rows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct DatasetEntry {
    pub(crate) version: u64,
    /// The version's random tag (see `store::Version`); absent in manifests written before
    /// versions had tags.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) tag: Option<u64>,
    pub(crate) segments: Vec<Segment>,
}

/// One immutable Arrow IPC file under `segments/`, as `SegmentWriter::write` made it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Segment {
    /// The file name inside `segments/`, `seg-<20-digit id>.arrow`.
    pub(crate) file: String,
    pub(crate) rows: u64,
    /// The file's size.
    pub(crate) bytes: u64,
    /// CRC-32 of the whole file.
    pub(crate) checksum: u32,
    /// Arrow bytes of its rows as they were written (0 in manifests written before this was
    /// recorded: the file's size stands in).
    #[serde(default)]
    pub(crate) data_bytes: u64,
}

/// The first line of `manifest.json`; the JSON manifest follows it. The checksum covers the
/// body's bytes exactly, so a torn or altered manifest cannot parse as a smaller catalog. No
/// field it does not know: a bit flipped in a key (`sequence`, which older manifests lack)
/// must not read as that field missing.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Header {
    format: u32,
    bytes: u64,
    crc32: u32,
    /// The last journal record the checkpoint includes (0 in manifests written before there
    /// was a journal, and before the first record).
    #[serde(default)]
    sequence: u64,
}

pub(super) fn encode(manifest: &Manifest, sequence: u64) -> Result<Vec<u8>, serde_json::Error> {
    let body = serde_json::to_vec(manifest)?;
    let header = Header {
        format: MANIFEST_FORMAT,
        bytes: body.len() as u64,
        crc32: crc32fast::hash(&body),
        sequence,
    };
    let mut text = serde_json::to_vec(&header)?;
    text.push(b'\n');
    text.extend_from_slice(&body);
    Ok(text)
}

/// Reads the checkpoint at `path`: the catalog, the last journal record it includes, and the
/// file's size. `None` where there is none yet.
pub(super) fn read(path: &Path) -> Result<Option<(Manifest, u64, u64)>, FilesError> {
    let text = match fs::read(path) {
        Ok(text) => text,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_error(path, "reading")(e)),
    };
    let newline = text
        .iter()
        .position(|&b| b == b'\n')
        .ok_or_else(|| corrupt(path, "it has no header line"))?;
    let (header, body) = (&text[..newline], &text[newline + 1..]);
    let header: Header = serde_json::from_slice(header)
        .map_err(|e| corrupt(path, format!("its header does not parse: {e}")))?;
    if header.format != MANIFEST_FORMAT {
        return Err(FilesError::Format {
            path: path.to_path_buf(),
            found: header.format,
        });
    }
    if header.bytes != body.len() as u64 {
        return Err(differs(
            path,
            "body size",
            body.len(),
            header.bytes,
            "its header",
        ));
    }
    let checksum = crc32fast::hash(body);
    if checksum != header.crc32 {
        let (found, recorded) = (crc(checksum), crc(header.crc32));
        return Err(differs(path, "CRC-32", found, recorded, "its header"));
    }
    let manifest = serde_json::from_slice(body)
        .map_err(|e| corrupt(path, format!("it does not parse: {e}")))?;
    // An empty catalog's checkpoint is some bytes long too: zero stands for none.
    Ok(Some((
        manifest,
        header.sequence,
        (text.len() as u64).max(1),
    )))
}

/// Writes `catalog` as the checkpoint in `root`, including the journal's records up to
/// `sequence`, and returns its size. An error says whether the new checkpoint may be in force
/// all the same: once the rename was tried, the next open may find either.
pub(super) fn write(
    fs: &Fs,
    root: &Path,
    catalog: &Manifest,
    sequence: u64,
) -> Result<u64, Failed> {
    let tmp = root.join(MANIFEST_TMP);
    let path = root.join(MANIFEST);
    let text = encode(catalog, sequence)
        .map_err(|e| Failed::not_in_force(io_error(&tmp, "encoding")(e.into())))?;
    if let Err(error) = write_file(fs, &tmp, &text) {
        let _ = fs.remove(&tmp);
        return Err(Failed::not_in_force(error));
    }
    fs.rename(&tmp, &path)
        .map_err(io_error(&tmp, "renaming into place"))
        .and_then(|()| fs.sync_dir(root))
        .map_err(|error| Failed {
            error,
            maybe_in_force: true,
        })?;
    Ok(text.len() as u64)
}
