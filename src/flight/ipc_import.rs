//! `ipc-import`: columns a producer on this node holds on one of the server's GPUs, committed
//! as a put of them would be.
//!
//! The document is checked from its numbers first (`backend::ingest`), before anything is
//! opened or allocated; then the put begins on the server's device that is the producer's GPU,
//! declares the schema, pays for the copy, has the backend copy and check the columns, and
//! commits in one catalog operation, exactly as `DoPut` does (same modes, same role). A
//! failure anywhere drops the pending put: nothing is committed and its memory returns.

use std::sync::Arc;

use super::Service;
use super::ipc_export::{DeviceDocument, ImportDocument};
use crate::backend::ingest;
use crate::error::Error;
use crate::store::{PutMode, PutSummary, Store};

/// Runs an `ipc-import` of `document` for `owner`.
pub(super) async fn import(
    service: &Service,
    document: ImportDocument,
    owner: &str,
) -> Result<PutSummary, Error> {
    let store = &service.store;
    let schema = Arc::new(document.decode_schema().map_err(Error::InvalidCommand)?);
    let mut columns = document.columns(&schema).map_err(Error::InvalidCommand)?;
    ingest::check_columns(&schema, document.num_rows, &mut columns)?;
    // A backend that cannot import says so before the device is looked for.
    store.backend().imported_size(&columns)?;
    let device = producer_device(store, &document.device)?;
    let mode = document.mode.unwrap_or(PutMode::Create);
    let mut pending = store.begin_put_on(document.name, mode, owner, Some(device))?;
    pending.declare_schema(schema)?;
    let started = std::time::Instant::now();
    pending.import(document.num_rows, columns).await?;
    let imported = started.elapsed();
    let summary = pending.commit().await?;
    tracing::info!(
        import_ms = imported.as_secs_f64() * 1e3,
        commit_ms = (started.elapsed() - imported).as_secs_f64() * 1e3,
        "ipc-import timings"
    );
    Ok(summary)
}

/// The server's device that is the producer's GPU: by UUID, else by PCI bus id (the same GPU
/// whatever either process's `CUDA_VISIBLE_DEVICES`).
fn producer_device(store: &Store, wanted: &DeviceDocument) -> Result<u32, Error> {
    let devices = store.backend().devices();
    let by_uuid = devices.iter().position(|d| {
        d.uuid
            .as_deref()
            .is_some_and(|u| u.eq_ignore_ascii_case(&wanted.uuid))
    });
    let by_bus = || {
        devices.iter().position(|d| {
            d.pci_bus_id
                .as_deref()
                .is_some_and(|b| b.eq_ignore_ascii_case(&wanted.pci_bus_id))
        })
    };
    match by_uuid.or_else(by_bus) {
        Some(index) => Ok(index as u32),
        None => Err(Error::Store(crate::store::StoreError::Backend(
            ingest::refused(format!(
                "the producer's GPU ({:?}, PCI {:?}) is not one this server holds datasets on; \
                 the status action lists them",
                wanted.uuid.chars().take(64).collect::<String>(),
                wanted.pci_bus_id.chars().take(32).collect::<String>()
            )),
        ))),
    }
}
