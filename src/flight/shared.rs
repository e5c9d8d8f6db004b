//! `shm-read`: a read staged in shared memory, for a process on this node (pandas, Polars,
//! DuckDB, a Spark executor) to map without a copy and without the network.
//!
//! The read is the one `GetFlightInfo` plans for the same read command (columns, `where`,
//! compression), and its tickets are read through the same pipeline as `DoGet`'s: chunk by
//! chunk off the backend (device to host on a GPU), several in flight. Each batch is written
//! into a memory file (`crate::store`: paid for before it is written, sealed once done) on a
//! blocking thread while the next chunks are read, so the whole dataset is never on the heap.
//! The reply carries a one-time token for the file, which the consumer sends on the server's
//! Unix side channel (`crate::server`) to receive the file's descriptor; docs/protocol.md
//! says why a descriptor rather than a path.

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
use crate::store::{ShareTerms, StagedFile, StoreError};

/// Batches read ahead of the file's writer.
const WRITE_QUEUE: usize = 2;

/// The `shm-read` result.
#[derive(Debug, serde::Serialize)]
struct ShmReadResult {
    /// Pass to `ipc-release` when done with the file.
    lease: String,
    /// Send on `socket`, once, before `token_expires_at`.
    token: String,
    socket: String,
    /// The Arrow IPC file's size.
    bytes: u64,
    num_rows: u64,
    token_expires_at: String,
    /// How long the lease lasts once the token is claimed.
    lease_seconds: u64,
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
    let writer =
        service
            .store
            .shared_writer(&caller.name, &schema, write_options, &options.limits)?;

    // The writer runs on a blocking thread, fed batches as they are read. Dropping the
    // sender without the end marker (`None`) abandons the file: a failed read, or a caller
    // gone, leaves nothing behind.
    let (sender, mut receiver) = tokio::sync::mpsc::channel::<Option<RecordBatch>>(WRITE_QUEUE);
    let writing = tokio::task::spawn_blocking(move || -> Result<Option<StagedFile>, StoreError> {
        let mut writer = writer;
        while let Some(message) = receiver.blocking_recv() {
            match message {
                Some(batch) => writer.write(&batch)?,
                None => return writer.finish().map(Some),
            }
        }
        Ok(None)
    });
    let fed = feed(readings, &sender).await;
    drop(sender);
    let staged = writing
        .await
        .map_err(|e| Error::Internal(format!("the shared-memory writer failed: {e}")))?;
    let staged = match (fed, staged) {
        (Err(error), _) => return Err(error),
        (Ok(()), Err(error)) => return Err(error.into()),
        (Ok(()), Ok(Some(staged))) => staged,
        (Ok(()), Ok(None)) => {
            return Err(Error::Internal(
                "the shared-memory writer stopped early".to_owned(),
            ));
        }
    };
    let terms = ShareTerms {
        owner: caller.name.to_string(),
        columns,
        uid,
        lease_duration: Duration::from_secs(lease_seconds),
    };
    let grant = service
        .store
        .grant_shared(&dataset, staged, terms, &options.limits)?;
    tracing::info!(
        lease = action::lease_prefix(&grant.lease.id),
        owner = %caller.name,
        dataset = %name,
        bytes = grant.bytes,
        rows = grant.rows,
        bound_to_uid = ?uid,
        "rows staged in shared memory"
    );
    action::to_value(&ShmReadResult {
        lease: grant.lease.id,
        token: grant.token,
        socket: socket.display().to_string(),
        bytes: grant.bytes,
        num_rows: grant.rows,
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

/// Sends every batch of `readings` to the writer, then the end marker. Stops early, without
/// the marker, where the writer has gone (it failed, and says why).
async fn feed(
    readings: Vec<Reading>,
    sender: &tokio::sync::mpsc::Sender<Option<RecordBatch>>,
) -> Result<(), Error> {
    for reading in readings {
        let mut batches = reading.batches;
        while let Some(batch) = batches.next().await {
            if sender.send(Some(batch?)).await.is_err() {
                return Ok(());
            }
        }
    }
    let _ = sender.send(None).await;
    Ok(())
}
