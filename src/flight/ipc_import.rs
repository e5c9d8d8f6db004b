//! `ipc-import`: columns a producer on this node holds on one of the server's GPUs, committed
//! as a put of them would be.
//!
//! The document is checked from its numbers first and planned by the backend, once
//! (`Store::check_import`), before anything is opened or allocated; then the put begins on
//! the server's device that is the producer's GPU, declares the schema, pays for the copy, has
//! the backend copy and check the columns, and commits in one catalog operation, exactly as
//! `DoPut` does (same modes, same role). A failure anywhere drops the pending put: nothing is
//! committed and its memory returns.

use std::sync::Arc;

use super::Service;
use super::ipc_export::ImportDocument;
use crate::error::Error;
use crate::store::{PutMode, PutSummary};

/// Runs an `ipc-import` of `document` for `owner`.
pub(super) async fn import(
    service: &Service,
    document: ImportDocument,
    owner: &str,
) -> Result<PutSummary, Error> {
    let store = &service.store;
    let schema = Arc::new(document.decode_schema().map_err(Error::InvalidCommand)?);
    let columns = document.columns(&schema).map_err(Error::InvalidCommand)?;
    // A backend that cannot import says so before the device is looked for.
    let checked = store.check_import(schema, document.num_rows, columns)?;
    let device = store.producer_device(&document.device.uuid, &document.device.pci_bus_id)?;
    let mode = document.mode.unwrap_or(PutMode::Create);
    let mut pending = store.begin_put_on(document.name, mode, owner, Some(device))?;
    let started = std::time::Instant::now();
    pending.import(checked).await?;
    let imported = started.elapsed();
    let summary = pending.commit().await?;
    tracing::info!(
        import_ms = imported.as_secs_f64() * 1e3,
        commit_ms = (started.elapsed() - imported).as_secs_f64() * 1e3,
        "ipc-import timings"
    );
    Ok(summary)
}
