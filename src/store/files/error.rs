//! What can go wrong in the data directory ([`FilesError`], every message naming the file), the
//! constructors the other files build their errors with, and [`Failed`]: a commit's error
//! together with whether what it wrote may be in force on disk all the same.

use std::io;
use std::path::{Path, PathBuf};

use arrow::error::ArrowError;

use super::layout::MANIFEST_FORMAT;

/// What can go wrong in the data directory. Every message names the file.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FilesError {
    #[error("{action} {}: {source}", path.display())]
    Io {
        path: PathBuf,
        action: &'static str,
        source: io::Error,
    },
    #[error("{action} {}: {source}", path.display())]
    Arrow {
        path: PathBuf,
        action: &'static str,
        source: ArrowError,
    },
    #[error("{} is corrupt: {reason}", path.display())]
    Corrupt { path: PathBuf, reason: String },
    #[error(
        "{} has manifest format {found}, but this server reads format {MANIFEST_FORMAT}; \
         it was written by another gpu-flight version",
        path.display()
    )]
    Format { path: PathBuf, found: u32 },
    #[error(
        "data directory {} is in use by another process (it holds the lock on {}); \
         give each server its own --data-dir",
        root.display(), lock.display()
    )]
    Locked { root: PathBuf, lock: PathBuf },
    #[error(
        "cannot commit a manifest naming segment {file:?}: it is not a complete segment file \
         of this data directory ({reason})"
    )]
    UnknownSegment { file: String, reason: String },
    /// A change that does not apply to the catalog as it is, such as a merge of segments a
    /// later commit replaced.
    #[error("cannot commit a change of {name:?} to the catalog: {reason}")]
    Inapplicable { name: String, reason: String },
}

pub(super) fn io_error(path: &Path, action: &'static str) -> impl FnOnce(io::Error) -> FilesError {
    let path = path.to_path_buf();
    move |source| FilesError::Io {
        path,
        action,
        source,
    }
}

/// Arrow wraps the writer's I/O errors; unwrapping them keeps "No space left on device" plain.
pub(super) fn arrow_error(
    path: &Path,
    action: &'static str,
) -> impl FnOnce(ArrowError) -> FilesError {
    let path = path.to_path_buf();
    move |error| match error {
        ArrowError::IoError(_, source) => FilesError::Io {
            path,
            action,
            source,
        },
        source => FilesError::Arrow {
            path,
            action,
            source,
        },
    }
}

pub(super) fn corrupt(path: &Path, reason: impl Into<String>) -> FilesError {
    FilesError::Corrupt {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// `path` is corrupt: its `what` is `found`, but `by` records `recorded`.
pub(super) fn differs(
    path: &Path,
    what: &str,
    found: impl std::fmt::Display,
    recorded: impl std::fmt::Display,
    by: &str,
) -> FilesError {
    corrupt(
        path,
        format!("its {what} is {found} but {by} records {recorded}"),
    )
}

pub(super) fn crc(checksum: u32) -> String {
    format!("{checksum:#010x}")
}

/// A commit that failed, and whether what it wrote may be in force on disk all the same.
pub(super) struct Failed {
    pub(super) error: FilesError,
    pub(super) maybe_in_force: bool,
}

impl Failed {
    pub(super) fn not_in_force(error: FilesError) -> Self {
        Self {
            error,
            maybe_in_force: false,
        }
    }
}
