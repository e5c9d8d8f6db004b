//! The file system as the data directory uses it. Every step that changes the disk after open
//! goes through [`Fs`], where tests inject faults (a failed or torn write, fsync, rename,
//! truncation or delete, or a crash from that step on); beside it are the few plain helpers:
//! private files, directory fsyncs, and the removals open makes before any fault can be
//! planned.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::error::{FilesError, io_error};

/// A fault for tests: the `step`-th file-system step (counted from 0 after `DataDir::inject`;
/// a write, an fsync, a rename, a create, a truncation or a delete) fails. `torn` makes a
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
/// no plan (outside tests), a step costs two relaxed atomic operations. Shared by the commits
/// and the background merges, which write segments beside them.
#[derive(Debug)]
pub(super) struct Fs {
    /// The step that fails; `u64::MAX` for none.
    fail_at: AtomicU64,
    torn: AtomicBool,
    crash: AtomicBool,
    steps: AtomicU64,
    fired: AtomicBool,
}

impl Default for Fs {
    fn default() -> Self {
        Self {
            fail_at: AtomicU64::new(u64::MAX),
            torn: AtomicBool::new(false),
            crash: AtomicBool::new(false),
            steps: AtomicU64::new(0),
            fired: AtomicBool::new(false),
        }
    }
}

enum Step {
    Go,
    Fail,
    Tear,
}

impl Fs {
    /// Makes `plan` the fault to come, counting steps from now.
    #[cfg(test)]
    pub(super) fn inject(&self, plan: FaultPlan) {
        self.torn.store(plan.torn, Ordering::Relaxed);
        self.crash.store(plan.crash, Ordering::Relaxed);
        self.fired.store(false, Ordering::Relaxed);
        self.steps.store(0, Ordering::Relaxed);
        self.fail_at.store(plan.step, Ordering::Relaxed);
    }

    /// Whether the injected fault happened.
    #[cfg(test)]
    pub(super) fn fired(&self) -> bool {
        self.fired.load(Ordering::Relaxed)
    }

    fn step(&self) -> Step {
        let step = self.steps.fetch_add(1, Ordering::Relaxed);
        let fail_at = self.fail_at.load(Ordering::Relaxed);
        if fail_at == u64::MAX
            || step < fail_at
            || (step > fail_at && !self.crash.load(Ordering::Relaxed))
        {
            return Step::Go;
        }
        self.fired.store(true, Ordering::Relaxed);
        if step == fail_at && self.torn.load(Ordering::Relaxed) {
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
        private_file().truncate(true).open(path)
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

    /// Writes all of `buf` at the end of `file`, which is `at` bytes long: one step, which a
    /// fault may tear.
    pub(super) fn append(&self, file: &mut File, at: u64, buf: &[u8]) -> io::Result<()> {
        file.seek(SeekFrom::Start(at))?;
        let mut written = 0;
        while written < buf.len() {
            match self.write(file, &buf[written..])? {
                0 => return Err(io::ErrorKind::WriteZero.into()),
                n => written += n,
            }
        }
        Ok(())
    }

    /// Cuts `file` to `len` bytes and makes that durable: the two steps of undoing appends.
    pub(super) fn truncate(&self, file: &File, len: u64) -> io::Result<()> {
        self.check()?;
        file.set_len(len)?;
        self.sync(file)
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
pub(super) struct ChecksummedFile<'a> {
    pub(super) file: File,
    pub(super) fs: &'a Fs,
    pub(super) hasher: crc32fast::Hasher,
    pub(super) bytes: u64,
}

impl<'a> ChecksummedFile<'a> {
    pub(super) fn new(file: File, fs: &'a Fs) -> Self {
        Self {
            file,
            fs,
            hasher: crc32fast::Hasher::new(),
            bytes: 0,
        }
    }
}

impl Write for ChecksummedFile<'_> {
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

/// Creates `path` holding `text`, fsync'd.
pub(super) fn write_file(fs: &Fs, path: &Path, text: &[u8]) -> Result<(), FilesError> {
    let file = fs.create(path).map_err(io_error(path, "creating"))?;
    let mut out = ChecksummedFile::new(file, fs);
    out.write_all(text).map_err(io_error(path, "writing"))?;
    fs.sync(&out.file).map_err(io_error(path, "syncing"))
}

/// Options that create a file only the server's user may read or write (dataset names and
/// rows are in these files); the caller adds the access it needs.
pub(super) fn private_file() -> OpenOptions {
    let mut options = OpenOptions::new();
    options.create(true).write(true).mode(0o600);
    options
}

pub(super) fn remove_if_present(path: &Path) -> Result<(), FilesError> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_error(path, "deleting")(e)),
        _ => Ok(()),
    }
}

/// A rename or a new file's entry is durable only once its directory is.
pub(super) fn sync_dir(dir: &Path) -> Result<(), FilesError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_error(dir, "syncing directory"))
}
