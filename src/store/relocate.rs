//! Moving a dataset to another device, atomically for its readers.
//!
//! Every partition not yet on the target is read back in chunks and uploaded there, paid for
//! by reservations on the target taken before each upload; the moved partitions are then
//! compacted on the target as a put's would be. The new version replaces the old in one
//! catalog operation, and only if nothing committed to the name meanwhile: readers see the
//! old version or the new one, never a mix, and keep reading the version they started on.
//! The old partitions' memory returns when their last reader is done.
//!
//! The copy goes through host memory (a device backend's read, then its upload), which works
//! between any two devices; peer copies between GPUs that can reach each other directly are
//! the faster path still to come.

use std::sync::Arc;

use dashmap::mapref::entry::Entry;
use futures::TryStreamExt;

use super::dataset::StoredPartition;
use super::{Dataset, Store, StoreError};
use crate::batch_size::batch_bytes;

/// Rows are copied in chunks of about this many bytes, so a move holds little host memory.
const MOVE_CHUNK_BYTES: u64 = 64 << 20;

/// What a move did.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct MoveSummary {
    pub name: String,
    /// The device the dataset is on now.
    pub device: u32,
    /// Arrow bytes copied (0 when it was there already).
    pub moved_bytes: u64,
    /// The dataset's version after the move.
    pub version: u64,
}

impl Store {
    /// Moves every partition of `name` onto `device`. Fails, changing nothing, when the device
    /// has no room or the dataset changed while it was being copied.
    pub async fn move_dataset(&self, name: &str, device: u32) -> Result<MoveSummary, StoreError> {
        let inner = &self.inner;
        let devices = inner.budget.devices();
        if device >= devices {
            return Err(StoreError::UnknownDevice { device, devices });
        }
        let base = self.get(name)?;
        if base.partitions().iter().all(|p| p.device() == device) {
            return Ok(MoveSummary {
                name: name.to_owned(),
                device,
                moved_bytes: 0,
                version: base.version(),
            });
        }
        let mut partitions: Vec<StoredPartition> = Vec::new();
        let mut moved_bytes = 0;
        for (index, partition) in base.partitions().iter().enumerate() {
            if partition.device() == device {
                partitions.push(partition.clone());
                continue;
            }
            let mut chunks = base.read(base.partition_rows(index), MOVE_CHUNK_BYTES, 2)?;
            while let Some(batch) = chunks.try_next().await? {
                let reservation = inner
                    .budget
                    .try_reserve(device, self.stored_charge(&batch)?)?;
                let data_bytes = batch_bytes(&batch);
                let data = inner.backend.upload(device, batch).await?;
                moved_bytes += data_bytes;
                partitions.push(StoredPartition {
                    data,
                    reservation: Arc::new(reservation),
                    data_bytes,
                });
            }
        }
        let schema = base.schema();
        let partitions = self.compact_runs(&schema, partitions).await?;
        let version = self.next_version();
        match inner.catalog.entry(name.to_owned()) {
            Entry::Occupied(mut entry) if entry.get().version() == base.version() => {
                entry.insert(Arc::new(Dataset::new(
                    name.to_owned(),
                    schema,
                    version,
                    partitions,
                    Arc::clone(base.schema_charge()),
                )));
            }
            _ => {
                return Err(StoreError::ChangedDuringMove {
                    name: name.to_owned(),
                });
            }
        }
        tracing::info!(dataset = name, device, moved_bytes, "dataset moved");
        Ok(MoveSummary {
            name: name.to_owned(),
            device,
            moved_bytes,
            version,
        })
    }
}
