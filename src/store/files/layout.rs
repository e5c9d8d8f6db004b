//! Where things are in a data directory: the names of its files, the names segment files are
//! given (and which names are ours, so that a manifest never points outside `segments/`), and
//! the manifest format number. The bottom of `files`: it uses nothing else here.
//!
//! ```text
//! DIR/LOCK                       held with an exclusive lock while a server uses DIR
//! DIR/manifest.json              the catalog's checkpoint: dataset names to versions and segments
//! DIR/journal                    the catalog's changes since the checkpoint, one record each
//! DIR/segments/seg-<id>.arrow    Arrow IPC *file* format, readable without the server
//! ```

use std::path::{Path, PathBuf};

/// The manifest format this code writes and reads. Bump it when the manifest's meaning changes.
pub(super) const MANIFEST_FORMAT: u32 = 1;

pub(super) const LOCK: &str = "LOCK";
pub(super) const MANIFEST: &str = "manifest.json";
pub(super) const MANIFEST_TMP: &str = "manifest.json.tmp";
/// The journal's file name in the data directory.
pub(super) const JOURNAL: &str = "journal";
pub(super) const SEGMENTS: &str = "segments";
pub(super) const TMP_SUFFIX: &str = ".tmp";

pub(super) fn segment_name(id: u64) -> String {
    format!("seg-{id:020}.arrow")
}

/// The id of a segment file name, and whether it is the temporary one.
pub(super) fn parse_file_name(name: &str) -> Option<(u64, bool)> {
    let (name, tmp) = match name.strip_suffix(TMP_SUFFIX) {
        Some(name) => (name, true),
        None => (name, false),
    };
    let digits = name.strip_prefix("seg-")?.strip_suffix(".arrow")?;
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((digits.parse().ok()?, tmp))
}

/// The path of a segment named in a manifest, which is only trusted if it is a name we write.
pub(super) fn segment_path(segments: &Path, file: &str) -> Result<PathBuf, String> {
    match parse_file_name(file) {
        Some((_, false)) => Ok(segments.join(file)),
        _ => Err(format!("{file:?} is not a segment file name")),
    }
}
