//! Segment files checked against the catalog: at open, every segment a dataset names must be a
//! name of ours (never a path elsewhere), present, of the recorded size, and named by that
//! dataset alone. A dataset that fails is damaged ([`Damage`]): quarantined with its files kept,
//! while every other dataset is served. The checks are stats, not reads, so open costs no more
//! than listing the files; checksums are checked when a segment is read.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;
use std::io;
use std::path::Path;

use super::error::{FilesError, corrupt, differs, io_error};
use super::layout::{MANIFEST, segment_path};
use super::manifest::{Manifest, Segment};

/// Why a dataset's files cannot be served, naming the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Damage {
    pub(crate) reason: String,
}

/// What [`check_segments`] found.
pub(super) struct Checked {
    /// Every segment file the catalog names that is ours (damaged datasets' included, so
    /// that they are kept), by file name.
    pub(super) named: HashMap<String, Segment>,
    pub(super) damaged: BTreeMap<String, Damage>,
    /// Files more than one dataset names.
    pub(super) shared: HashSet<String>,
}

/// Checks every segment `catalog` names: a name of ours (never a path elsewhere), present,
/// of the recorded size, and named by one dataset only. A dataset that fails is damaged; its
/// files are kept, and every other dataset is served.
pub(super) fn check_segments(root: &Path, segments: &Path, catalog: &Manifest) -> Checked {
    let mut named = HashMap::new();
    let mut damaged: BTreeMap<String, Damage> = BTreeMap::new();
    let mut shared = HashSet::new();
    let mut owners: HashMap<&str, &str> = HashMap::new();
    for (name, entry) in &catalog.datasets {
        let mut reason = None;
        for segment in &entry.segments {
            let path = match segment_path(segments, &segment.file) {
                Ok(path) => path,
                Err(why) => {
                    reason.get_or_insert_with(|| corrupt(&root.join(MANIFEST), why).to_string());
                    continue;
                }
            };
            if let Err(error) = check_size(&path, segment) {
                reason.get_or_insert_with(|| error.to_string());
            }
            if let Some(other) = owners.insert(&segment.file, name)
                && other != name
            {
                let why = format!(
                    "segment {:?} is named by datasets {other:?} and {name:?}",
                    segment.file
                );
                let why = corrupt(&root.join(MANIFEST), why).to_string();
                damaged.insert(
                    other.to_owned(),
                    Damage {
                        reason: why.clone(),
                    },
                );
                reason = Some(why);
                shared.insert(segment.file.clone());
            }
            named
                .entry(segment.file.clone())
                .or_insert_with(|| segment.clone());
        }
        if let Some(reason) = reason {
            damaged.insert(name.clone(), Damage { reason });
        }
    }
    Checked {
        named,
        damaged,
        shared,
    }
}

/// Checks by its size that the file at `path` is the segment the manifest records.
pub(super) fn check_size(path: &Path, segment: &Segment) -> Result<(), FilesError> {
    match fs::metadata(path) {
        Ok(meta) if meta.len() == segment.bytes => Ok(()),
        Ok(meta) => Err(differs(
            path,
            "size",
            meta.len(),
            segment.bytes,
            "the manifest",
        )),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            Err(corrupt(path, "the manifest names it but it is missing"))
        }
        Err(e) => Err(io_error(path, "checking")(e)),
    }
}
