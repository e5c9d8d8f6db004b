//! `shm-read`: a read staged in shared memory, for a process on this node (pandas, Polars,
//! DuckDB, a Spark executor) to map without a copy and without the network.
//!
//! The read is the one `GetFlightInfo` plans for the same read command (columns, `where`,
//! compression), and its tickets are read through the same pipeline as `DoGet`'s: chunk by
//! chunk off the backend (device to host on a GPU), several in flight. The batches are written
//! into up to [`MAX_SHARED_FILES`] memory files at once (`crate::store`: paid for before they
//! are written, sealed once done), each by its own IPC writer on its own blocking thread,
//! while the next chunks are read, so the whole dataset is never on the heap. One writer
//! copies at a few GB/s (the IPC encoder's copy, then `write(2)` allocating pages); several,
//! each into a file of its own (writes into one file serialize on it), copy at the node's
//! rate. Batch `i` goes to file `i % K`, where `K` is the number of files: the consumer reads
//! them back in that order.
//!
//! The reply carries a one-time token for the files, which the consumer sends on the server's
//! Unix side channel (`crate::server`) to receive their descriptors; docs/protocol.md says why
//! descriptors rather than paths.

use std::sync::Arc;
use std::time::Duration;

use arrow::ipc::writer::IpcWriteOptions;
use arrow::record_batch::RecordBatch;
use arrow_flight::FlightDescriptor;
use futures::StreamExt;

use super::action;
use super::call::Call;
use super::descriptor::{self, ReadCommand, ReadOptions, ReadTarget};
use super::ipc_export::rfc3339;
use super::read::Reading;
use super::{Service, sql};
use crate::auth::{Origin, Principal};
use crate::error::Error;
use crate::store::{FileSetWriter, ShareTerms, StagedFile, StoreError};

/// Batches read ahead of each file's writer.
const WRITE_QUEUE: usize = 2;

/// Most files one read is written as (and descriptors one claim passes: the kernel allows
/// 253 in a message).
pub const MAX_SHARED_FILES: usize = 8;

/// Files a read is written as at most where the server is not told: half the CPUs (the read
/// pipeline and the other calls keep the rest), within [`MAX_SHARED_FILES`].
pub fn default_writers() -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    (cpus / 2).clamp(1, MAX_SHARED_FILES)
}

/// The `shm-read` result.
#[derive(Debug, serde::Serialize)]
struct ShmReadResult {
    /// Pass to `ipc-release` when done with the file.
    lease: String,
    /// Send on `socket`, once, before `token_expires_at`.
    token: String,
    socket: String,
    /// The files' sizes, together.
    bytes: u64,
    num_rows: u64,
    /// The files, in the order the descriptors come: batch `i` of the read is in file
    /// `i % files.len()`, as its batch `i / files.len()`.
    files: Vec<FileSummary>,
    /// How the batches are spread over the files: `round-robin`, as `files` says.
    order: &'static str,
    token_expires_at: String,
    /// How long the lease lasts once the token is claimed.
    lease_seconds: u64,
}

/// One file of a `shm-read`.
#[derive(Debug, serde::Serialize)]
struct FileSummary {
    bytes: u64,
    num_rows: u64,
}

/// Stages `read` in shared memory for `caller`, whose call came from `origin`.
pub(super) async fn shm_read(
    service: &Service,
    read: ReadCommand,
    lease_seconds: u64,
    caller: &Principal,
    origin: Option<Origin>,
    call: Option<&Arc<Call>>,
) -> Result<serde_json::Value, Error> {
    let options = &service.options.shared_memory;
    let Some(socket) = &options.socket else {
        return Err(Error::SharedMemoryUnavailable(
            "this server offers no shared memory: start it with --shm-socket".to_owned(),
        ));
    };
    // A caller on a Unix socket is bound to its user: only that user may claim the file.
    let uid = match origin {
        Some(Origin::UnixUser(Some(uid))) => Some(uid),
        Some(Origin::UnixUser(None)) => {
            return Err(Error::SharedMemoryUnavailable(
                "the kernel did not say which user this Unix-socket caller is, so its file \
                 could not be bound to it"
                    .to_owned(),
            ));
        }
        Some(Origin::Ip(_)) | None => None,
    };
    let _running = service.lifecycle.track();
    let name = read.name.clone();
    let dataset = service.store.get(&name)?;
    let readings = open(service, read, call)?;
    // Every ticket was checked against the version its plan saw: if that is still the one
    // read first, the file holds one version.
    if service.store.get(&name)?.version_id() != dataset.version_id() {
        return Err(Error::ChangedWhileReading(name));
    }
    if let Some(call) = call {
        call.set_subject(format!("shm-read {name}").as_str());
    }
    let Some(first) = readings.first() else {
        return Err(Error::Internal("a read planned no endpoints".to_owned()));
    };
    let schema = Arc::clone(&first.schema);
    let write_options = IpcWriteOptions::default()
        .try_with_compression(first.compression)
        .map_err(|e| Error::Internal(format!("choosing the file's compression: {e}")))?;
    let columns = schema.fields().iter().map(|f| f.name().clone()).collect();
    let files =
        service
            .store
            .shared_writer(&caller.name, &schema, write_options, &options.limits)?;
    let max_files = options
        .writers
        .unwrap_or_else(default_writers)
        .clamp(1, MAX_SHARED_FILES);
    let staged = stage(readings, &files, max_files).await?;
    drop(files);
    let terms = ShareTerms {
        owner: caller.name.to_string(),
        columns,
        uid,
        lease_duration: Duration::from_secs(lease_seconds),
    };
    let summaries: Vec<FileSummary> = staged
        .iter()
        .map(|file| FileSummary {
            bytes: file.bytes,
            num_rows: file.rows,
        })
        .collect();
    let grant = service
        .store
        .grant_shared(&dataset, staged, terms, &options.limits)?;
    tracing::info!(
        lease = action::lease_prefix(&grant.lease.id),
        owner = %caller.name,
        dataset = %name,
        bytes = grant.bytes,
        rows = grant.rows,
        files = summaries.len(),
        bound_to_uid = ?uid,
        "rows staged in shared memory"
    );
    action::to_value(&ShmReadResult {
        lease: grant.lease.id,
        token: grant.token,
        socket: socket.display().to_string(),
        bytes: grant.bytes,
        num_rows: grant.rows,
        files: summaries,
        order: "round-robin",
        token_expires_at: rfc3339(grant.token_expires_at),
        lease_seconds,
    })
}

/// The read `read` asks for, as `GetFlightInfo` plans it, every ticket opened.
fn open(
    service: &Service,
    read: ReadCommand,
    call: Option<&Arc<Call>>,
) -> Result<Vec<Reading>, Error> {
    let target = ReadTarget {
        name: read.name,
        options: ReadOptions {
            compression: read.compression,
        },
        columns: read.columns,
        filter: read.filter,
    };
    let info = match target.filter.clone() {
        Some(text) => {
            let descriptor = FlightDescriptor::new_path(vec![target.name.clone()]);
            sql::filtered_info(service, target, &text, descriptor)?
        }
        None => {
            let dataset = service.store.get(&target.name)?;
            let columns = target
                .columns
                .as_ref()
                .map(|names| descriptor::projection(&target.name, &dataset.schema(), names))
                .transpose()?;
            service.flight_info(&dataset, target.options, columns.as_deref(), None)?
        }
    };
    info.endpoint
        .iter()
        .map(|endpoint| {
            let ticket = endpoint
                .ticket
                .as_ref()
                .ok_or_else(|| Error::Internal("an endpoint without a ticket".to_owned()))?;
            service.open_ticket(ticket, call.cloned())
        })
        .collect()
}

/// One file being written on a blocking thread, fed batches as they are read. Dropping the
/// sender without the end marker (`None`) abandons the file.
struct FileTask {
    sender: tokio::sync::mpsc::Sender<Option<RecordBatch>>,
    writing: tokio::task::JoinHandle<Result<Option<StagedFile>, StoreError>>,
}

impl FileTask {
    fn start(files: &FileSetWriter) -> Result<Self, StoreError> {
        let mut writer = files.file()?;
        let (sender, mut receiver) = tokio::sync::mpsc::channel(WRITE_QUEUE);
        let writing = tokio::task::spawn_blocking(move || {
            while let Some(message) = receiver.blocking_recv() {
                match message {
                    Some(batch) => writer.write(&batch)?,
                    None => return writer.finish().map(Some),
                }
            }
            Ok(None)
        });
        Ok(Self { sender, writing })
    }
}

/// Writes every batch of `readings` into files of `files`, batch `i` into file
/// `i % max_files`, each file started when its first batch comes (so a read of fewer batches
/// has fewer files, and one of none one empty file). Every file is finished, or none is kept:
/// a failed read or writer abandons all of them, and their memory and charges return.
async fn stage(
    readings: Vec<Reading>,
    files: &FileSetWriter,
    max_files: usize,
) -> Result<Vec<StagedFile>, Error> {
    let mut tasks = vec![FileTask::start(files)?];
    let fed = feed(readings, files, max_files, &mut tasks).await;
    let mut staged = Vec::with_capacity(tasks.len());
    let mut failure = None;
    for task in tasks {
        if fed.is_ok() {
            // A writer that has gone failed, and says why below.
            let _ = task.sender.send(None).await;
        }
        drop(task.sender);
        let written = task
            .writing
            .await
            .map_err(|e| Error::Internal(format!("a shared-memory writer failed: {e}")));
        match written {
            Ok(Ok(Some(file))) => staged.push(file),
            Ok(Ok(None)) => {
                failure.get_or_insert(Error::Internal(
                    "a shared-memory writer stopped early".to_owned(),
                ));
            }
            Ok(Err(error)) => {
                failure.get_or_insert(error.into());
            }
            Err(error) => {
                failure.get_or_insert(error);
            }
        }
    }
    fed?;
    match failure {
        Some(error) => Err(error),
        None => Ok(staged),
    }
}

/// Sends every batch of `readings` to its file's writer, starting files as their first batch
/// comes. Stops early where a writer has gone (it failed, and says why).
async fn feed(
    readings: Vec<Reading>,
    files: &FileSetWriter,
    max_files: usize,
    tasks: &mut Vec<FileTask>,
) -> Result<(), Error> {
    let mut index = 0usize;
    for reading in readings {
        let mut batches = reading.batches;
        while let Some(batch) = batches.next().await {
            let batch = batch?;
            let file = index % max_files;
            index += 1;
            if file == tasks.len() {
                tasks.push(FileTask::start(files)?);
            }
            let Some(task) = tasks.get(file) else {
                return Err(Error::Internal(
                    "a shared-memory file out of order".to_owned(),
                ));
            };
            if task.sender.send(Some(batch)).await.is_err() {
                return Ok(());
            }
        }
    }
    Ok(())
}
