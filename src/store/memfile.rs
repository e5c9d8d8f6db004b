//! Sealed memory files: an Arrow IPC file written into an anonymous memory file (Linux
//! `memfd`), paid for before each byte is written, then sealed so that nobody, the server
//! included, can change its bytes under a consumer's mapping. `shared` hands them out.
//!
//! The seals leave one thing open: shrinking. When a [`StagedFile`] goes (its lease ended) it
//! truncates the file to nothing, which frees the pages whoever else still holds the
//! descriptor or a mapping (their reads then fault): memory the budget no longer pays for
//! cannot outlive its charge in another process.
//!
//! Every byte is paid for twice before it is written: on the memory budget (a
//! [`Reservation`] the caller chose) and on its principal's quota of files and bytes
//! ([`Quotas`]), so one principal cannot take all of it. Both are returned when the file goes.

use std::collections::HashMap;
use std::io::{BufWriter, Write};
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arrow::datatypes::Schema;
use arrow::ipc::writer::{FileWriter, IpcWriteOptions};
use arrow::record_batch::RecordBatch;
use nix::errno::Errno;
use nix::fcntl::{FcntlArg, SealFlag, fcntl};
use nix::sys::memfd::{MFdFlags, memfd_create};

use super::error::StoreError;
use super::memory::Reservation;
use super::tier::Tiers;

/// The budget and quota grow by at least this much at a time: a charge per IPC message
/// (some are a few bytes) would cost more than the copy.
const GROW_BYTES: u64 = 64 << 20;

/// How large a write the file takes at once: large enough that a column's buffer goes
/// straight from the batch to the file.
const WRITE_BUFFER_BYTES: usize = 1 << 20;

/// What one principal may hold in shared-memory files, and how long a token lasts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedLimits {
    /// `shm-read`s held at once (`--shm-max-files`), each one set of files however many
    /// it is written as.
    pub max_files: u32,
    /// Bytes held at once (`--shm-max-bytes`); `None`: only the memory budget bounds them.
    pub max_bytes: Option<u64>,
    /// How long a token may wait for its claim.
    pub token_ttl: Duration,
}

impl Default for SharedLimits {
    fn default() -> Self {
        Self {
            max_files: 16,
            max_bytes: None,
            token_ttl: Duration::from_secs(30),
        }
    }
}

/// What each principal holds now: file sets (one a `shm-read`) and bytes.
#[derive(Debug, Default)]
pub(crate) struct Quotas {
    held: Mutex<HashMap<String, (u32, u64)>>,
}

impl Quotas {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (u32, u64)>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Forgets `owner` once it holds nothing.
    fn tidy(held: &mut HashMap<String, (u32, u64)>, owner: &str) {
        if held.get(owner) == Some(&(0, 0)) {
            held.remove(owner);
        }
    }
}

/// One set of files on its principal's quota (the files of one `shm-read`), returned when the
/// last file of the set goes.
#[derive(Debug)]
struct SetCharge {
    quotas: Arc<Quotas>,
    owner: String,
}

impl Drop for SetCharge {
    fn drop(&mut self) {
        let mut held = self.quotas.lock();
        if let Some(entry) = held.get_mut(&self.owner) {
            entry.0 = entry.0.saturating_sub(1);
        }
        Quotas::tidy(&mut held, &self.owner);
    }
}

/// One file's share of its principal's quota: its bytes, and its set's place among the sets.
/// Returned on drop.
#[derive(Debug)]
pub(crate) struct QuotaCharge {
    set: Arc<SetCharge>,
    bytes: u64,
    max_bytes: Option<u64>,
}

impl QuotaCharge {
    /// The first file of a new set for `owner`, or an error where it holds
    /// `limits.max_files` sets already.
    pub(crate) fn open(
        quotas: &Arc<Quotas>,
        owner: &str,
        limits: &SharedLimits,
    ) -> Result<Self, StoreError> {
        let mut held = quotas.lock();
        let entry = held.entry(owner.to_owned()).or_default();
        if entry.0 >= limits.max_files {
            let files = entry.0;
            Quotas::tidy(&mut held, owner);
            return Err(StoreError::SharedMemoryLimit {
                owner: owner.to_owned(),
                what: format!(
                    "{} shared-memory reads (the limit is {})",
                    files + 1,
                    limits.max_files
                ),
                flag: "--shm-max-files",
            });
        }
        entry.0 += 1;
        let set = SetCharge {
            quotas: Arc::clone(quotas),
            owner: owner.to_owned(),
        };
        Ok(Self {
            set: Arc::new(set),
            bytes: 0,
            max_bytes: limits.max_bytes,
        })
    }

    /// Another file of the same set, holding no bytes yet.
    pub(crate) fn another(&self) -> Self {
        Self {
            set: Arc::clone(&self.set),
            bytes: 0,
            max_bytes: self.max_bytes,
        }
    }

    /// Adds `bytes`, or fails leaving the charge as it was.
    fn try_grow(&mut self, bytes: u64) -> Result<(), StoreError> {
        let owner = &self.set.owner;
        let mut held = self.set.quotas.lock();
        let entry = held.entry(owner.clone()).or_default();
        let wanted = entry.1.saturating_add(bytes);
        if let Some(limit) = self.max_bytes
            && wanted > limit
        {
            return Err(StoreError::SharedMemoryLimit {
                owner: owner.clone(),
                what: format!("{wanted} bytes (the limit is {limit})"),
                flag: "--shm-max-bytes",
            });
        }
        entry.1 = wanted;
        self.bytes += bytes;
        Ok(())
    }

    /// Gives back `bytes` of the charge.
    fn shrink_by(&mut self, bytes: u64) {
        let freed = bytes.min(self.bytes);
        let mut held = self.set.quotas.lock();
        if let Some(entry) = held.get_mut(&self.set.owner) {
            entry.1 = entry.1.saturating_sub(freed);
        }
        Quotas::tidy(&mut held, &self.set.owner);
        self.bytes -= freed;
    }
}

impl Drop for QuotaCharge {
    fn drop(&mut self) {
        self.shrink_by(self.bytes);
    }
}

/// A memory file being written, paid for a step ahead of what it holds.
#[derive(Debug)]
struct ChargedFile {
    file: std::fs::File,
    written: u64,
    reservation: Reservation,
    /// What grows `reservation`, making way where the data directory holds partitions.
    tiers: Arc<Tiers>,
    quota: QuotaCharge,
    /// Why the last write was refused, for the caller (the IPC writer sees only an I/O error).
    refused: Option<StoreError>,
}

impl ChargedFile {
    /// Pays for `bytes` more beyond what is written: a step ahead where that fits, else
    /// exactly what is missing, so that a file near a limit still fits.
    fn pay_for(&mut self, bytes: u64) -> Result<(), StoreError> {
        let end = self.written.saturating_add(bytes);
        let missing = end.saturating_sub(self.reservation.bytes());
        if missing == 0 {
            return Ok(());
        }
        match self.grow(missing.max(GROW_BYTES)) {
            Err(_) if missing < GROW_BYTES => self.grow(missing),
            paid => paid,
        }
    }

    /// Grows the quota and the budget by `bytes`, or neither.
    fn grow(&mut self, bytes: u64) -> Result<(), StoreError> {
        self.quota.try_grow(bytes)?;
        if let Err(error) = self.tiers.grow_host_copy(&mut self.reservation, bytes) {
            self.quota.shrink_by(bytes);
            return Err(error);
        }
        Ok(())
    }
}

impl Write for ChargedFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Err(error) = self.pay_for(buf.len() as u64) {
            let message = error.to_string();
            self.refused = Some(error);
            return Err(std::io::Error::other(message));
        }
        let written = match self.file.write(buf) {
            Ok(written) => written,
            Err(error) => {
                let refused = io_failure("writing the file", &error);
                let message = refused.to_string();
                self.refused = Some(refused);
                return Err(std::io::Error::new(error.kind(), message));
            }
        };
        self.written += written as u64;
        Ok(written)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// An Arrow IPC file being written into shared memory, batch by batch. Dropped unfinished,
/// its memory and charges are returned.
pub struct SharedFileWriter {
    ipc: FileWriter<BufWriter<ChargedFile>>,
    rows: u64,
}

impl std::fmt::Debug for SharedFileWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedFileWriter")
            .field("rows", &self.rows)
            .finish_non_exhaustive()
    }
}

impl SharedFileWriter {
    /// A new memory file of rows of `schema`, written as `options` say, paid for by
    /// `reservation` (grown on its budget by `tiers`) and `quota`.
    pub(crate) fn create(
        reservation: Reservation,
        tiers: Arc<Tiers>,
        quota: QuotaCharge,
        schema: &Schema,
        options: IpcWriteOptions,
    ) -> Result<Self, StoreError> {
        let fd = memfd_create(
            c"gpu-flight-shm-read",
            MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
        )
        .map_err(|e| os_failure("memfd_create", e))?;
        let charged = ChargedFile {
            file: std::fs::File::from(fd),
            written: 0,
            reservation,
            tiers,
            quota,
            refused: None,
        };
        let buffered = BufWriter::with_capacity(WRITE_BUFFER_BYTES, charged);
        let ipc = FileWriter::try_new_with_options(buffered, schema, options)
            .map_err(|e| StoreError::SharedMemory(format!("starting the file: {e}")))?;
        Ok(Self { ipc, rows: 0 })
    }

    /// Appends `batch` (of the schema the writer was opened with).
    pub fn write(&mut self, batch: &RecordBatch) -> Result<(), StoreError> {
        self.ipc.write(batch).map_err(|e| self.failure(&e))?;
        self.rows += batch.num_rows() as u64;
        Ok(())
    }

    /// Ends the file (its footer), seals it and gives back what was paid beyond its size.
    pub fn finish(mut self) -> Result<StagedFile, StoreError> {
        self.ipc.finish().map_err(|e| self.failure(&e))?;
        let rows = self.rows;
        let mut charged = self
            .ipc
            .into_inner()
            .map_err(|e| StoreError::SharedMemory(format!("ending the file: {e}")))?
            .into_inner()
            .map_err(|e| {
                let error = io_failure("ending the file", e.error());
                e.into_inner().get_mut().refused.take().unwrap_or(error)
            })?;
        fcntl(
            &charged.file,
            // Not F_SEAL_SHRINK: the server truncates the file when its lease ends.
            FcntlArg::F_ADD_SEALS(
                SealFlag::F_SEAL_WRITE | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL,
            ),
        )
        .map_err(|e| StoreError::SharedMemory(format!("sealing the file: {e}")))?;
        let bytes = charged.written;
        charged.reservation.resize(bytes)?;
        let beyond = charged.quota.bytes.saturating_sub(bytes);
        charged.quota.shrink_by(beyond);
        let ChargedFile {
            file,
            reservation,
            quota,
            ..
        } = charged;
        Ok(StagedFile {
            fd: OwnedFd::from(file),
            bytes,
            rows,
            _reservation: reservation,
            _quota: quota,
        })
    }

    /// What a write that failed with `error` failed of: a refused charge, else the file.
    fn failure(&mut self, error: &arrow::error::ArrowError) -> StoreError {
        match self.ipc.get_mut().get_mut().refused.take() {
            Some(refused) => refused,
            None => StoreError::SharedMemory(format!("writing the file: {error}")),
        }
    }
}

/// A sealed memory file holding an Arrow IPC file, and what pays for it.
#[derive(Debug)]
pub struct StagedFile {
    fd: OwnedFd,
    /// The file's size.
    pub bytes: u64,
    pub rows: u64,
    _reservation: Reservation,
    _quota: QuotaCharge,
}

impl StagedFile {
    /// A new descriptor of the file, to hand to a consumer.
    pub(crate) fn share(&self) -> Result<OwnedFd, StoreError> {
        self.fd
            .try_clone()
            .map_err(|e| io_failure("duplicating the descriptor", &e))
    }
}

impl Drop for StagedFile {
    /// Revokes the file: its pages go now, whoever else holds the descriptor or maps it.
    fn drop(&mut self) {
        if let Err(error) = nix::unistd::ftruncate(&self.fd, 0) {
            tracing::warn!(%error, bytes = self.bytes, "a shared-memory file could not be revoked");
        }
    }
}

/// What the OS refusing `what` with `errno` is: out of memory or descriptors is a resource
/// running out, anything else a failure.
fn os_failure(what: &str, errno: Errno) -> StoreError {
    let message = format!("{what}: {errno}");
    match errno {
        Errno::ENOMEM | Errno::ENOSPC | Errno::EMFILE | Errno::ENFILE => {
            StoreError::SharedMemoryExhausted(message)
        }
        _ => StoreError::SharedMemory(message),
    }
}

fn io_failure(what: &str, error: &std::io::Error) -> StoreError {
    match error.raw_os_error() {
        Some(code) => os_failure(what, Errno::from_raw(code)),
        None => StoreError::SharedMemory(format!("{what}: {error}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn running_out_of_memory_or_descriptors_is_exhaustion() {
        for errno in [Errno::ENOMEM, Errno::ENOSPC, Errno::EMFILE, Errno::ENFILE] {
            let error = io_failure(
                "memfd_create",
                &std::io::Error::from_raw_os_error(errno as i32),
            );
            assert!(
                matches!(error, StoreError::SharedMemoryExhausted(_)),
                "{errno}: {error}"
            );
        }
        let other = os_failure("sealing the file", Errno::EINVAL);
        assert!(matches!(other, StoreError::SharedMemory(_)), "{other}");
    }
}
