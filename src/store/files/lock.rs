//! Claiming a data directory for this process: created (with `segments/`) readable by the
//! server's user alone, a warning where an existing one lets others in, and an exclusive lock
//! on `LOCK` that two servers sharing one `--data-dir` cannot both hold.

use std::fs::{self, File, TryLockError};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::Path;

use super::error::{FilesError, io_error};
use super::fs::{private_file, sync_dir};
use super::layout::{LOCK, SEGMENTS};

/// Creates the data directory at `root` if it is absent, makes its entry durable, and locks
/// it. The lock is held until the returned file is closed.
pub(super) fn lock(root: &Path) -> Result<File, FilesError> {
    let segments = root.join(SEGMENTS);
    let existed = root.is_dir();
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&segments)
        .map_err(io_error(&segments, "creating"))?;
    warn_if_shared(root);
    if !existed && let Some(parent) = root.parent() {
        let parent = if parent.as_os_str().is_empty() {
            Path::new(".")
        } else {
            parent
        };
        sync_dir(parent)?;
    }
    sync_dir(root)?;

    let lock_path = root.join(LOCK);
    let lock = private_file()
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(io_error(&lock_path, "opening"))?;
    match lock.try_lock() {
        Ok(()) => Ok(lock),
        Err(TryLockError::WouldBlock) => Err(FilesError::Locked {
            root: root.to_path_buf(),
            lock: lock_path,
        }),
        Err(TryLockError::Error(e)) => Err(io_error(&lock_path, "locking")(e)),
    }
}

/// Logs where the data directory, created before the server made its files private, lets
/// other users in: the files hold every dataset's name and rows.
fn warn_if_shared(root: &Path) {
    if let Ok(meta) = fs::metadata(root)
        && meta.permissions().mode() & 0o077 != 0
    {
        tracing::warn!(
            data_dir = %root.display(),
            mode = format!("{:o}", meta.permissions().mode() & 0o777),
            "the data directory is open to other users; `chmod 700` it (the server creates it so)"
        );
    }
}
