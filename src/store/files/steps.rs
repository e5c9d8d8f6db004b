//! The file-system steps that change a data directory, each one a place where tests inject a
//! fault.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::{FilesError, io_error, sync_dir};

/// A fault for tests: the `step`-th file-system step (counted from 0 after
/// [`DataDir::inject`]; a write, an fsync, a rename, a create or a delete) fails. `torn` makes a
/// failing write put half its bytes on disk first; `crash` makes every later step fail too, as
/// if the process had died there, so no cleanup runs.
#[cfg(test)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct FaultPlan {
    pub(crate) step: u64,
    pub(crate) torn: bool,
    pub(crate) crash: bool,
}

/// The file-system steps that change the disk, each one a place a fault can be injected. With
/// no plan (outside tests), a step costs one atomic increment.
#[derive(Debug, Default)]
pub(super) struct Fs {
    pub(super) fail_at: Option<u64>,
    pub(super) torn: bool,
    pub(super) crash: bool,
    pub(super) steps: AtomicU64,
    pub(super) fired: AtomicBool,
}

enum Step {
    Go,
    Fail,
    Tear,
}

impl Fs {
    fn step(&self) -> Step {
        let step = self.steps.fetch_add(1, Ordering::Relaxed);
        let Some(fail_at) = self.fail_at else {
            return Step::Go;
        };
        if step < fail_at || (step > fail_at && !self.crash) {
            return Step::Go;
        }
        self.fired.store(true, Ordering::Relaxed);
        if step == fail_at && self.torn {
            Step::Tear
        } else {
            Step::Fail
        }
    }

    fn check(&self) -> io::Result<()> {
        match self.step() {
            Step::Go => Ok(()),
            Step::Fail | Step::Tear => Err(injected()),
        }
    }

    pub(super) fn create(&self, path: &Path) -> io::Result<File> {
        self.check()?;
        File::create(path)
    }

    pub(super) fn write(&self, file: &mut File, buf: &[u8]) -> io::Result<usize> {
        match self.step() {
            Step::Go => file.write(buf),
            Step::Fail => Err(injected()),
            Step::Tear => {
                file.write_all(&buf[..buf.len() / 2])?;
                Err(injected())
            }
        }
    }

    pub(super) fn sync(&self, file: &File) -> io::Result<()> {
        self.check()?;
        file.sync_all()
    }

    pub(super) fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.check()?;
        fs::rename(from, to)
    }

    pub(super) fn sync_dir(&self, dir: &Path) -> Result<(), FilesError> {
        self.check().map_err(io_error(dir, "syncing directory"))?;
        sync_dir(dir)
    }

    pub(super) fn remove(&self, path: &Path) -> io::Result<()> {
        self.check()?;
        fs::remove_file(path)
    }
}

fn injected() -> io::Error {
    io::Error::new(io::ErrorKind::StorageFull, "injected fault")
}

/// A file being written through [`Fs`], with the CRC-32 and size of what reached it.
pub(super) struct Tracked<'a> {
    pub(super) file: File,
    pub(super) fs: &'a Fs,
    pub(super) hasher: crc32fast::Hasher,
    pub(super) bytes: u64,
}

impl<'a> Tracked<'a> {
    pub(super) fn new(file: File, fs: &'a Fs) -> Self {
        Self {
            file,
            fs,
            hasher: crc32fast::Hasher::new(),
            bytes: 0,
        }
    }
}

impl Write for Tracked<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let written = self.fs.write(&mut self.file, buf)?;
        self.hasher.update(&buf[..written]);
        self.bytes += written as u64;
        Ok(written)
    }

    /// `File` buffers nothing; durability is the explicit fsync's job.
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
