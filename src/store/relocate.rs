//! Moving a dataset to another device, atomically for its readers.
//!
//! Every partition not yet on the target is copied there by the backend (peer to peer between
//! GPUs, through host memory by the driver where they cannot reach each other), paid for by a
//! reservation on the target taken before the copy; the moved partitions are then compacted
//! on the target as a put's would be. The new version replaces the old in one catalog
//! operation, and only if nothing committed to the name meanwhile: readers see the old
//! version or the new one, never a mix, and keep reading the version they started on. The old
//! partitions' memory returns when their last reader is done.

use std::sync::Arc;

use dashmap::mapref::entry::Entry;

use super::dataset::StoredPartition;
use super::{Dataset, Store, StoreError};

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
        let schema = base.schema();
        let all_columns: Vec<usize> = (0..schema.fields().len()).collect();
        let mut partitions: Vec<StoredPartition> = Vec::new();
        let mut moved_bytes = 0;
        for partition in base.partitions() {
            if partition.device() == device {
                partitions.push(partition.clone());
                continue;
            }
            // The copy has the original's layout, so it costs what the original does.
            let reservation = inner
                .budget
                .try_reserve(device, partition.reservation.bytes())?;
            let data = inner
                .backend
                .copy_to(Arc::clone(&partition.data), all_columns.clone(), device)
                .await?;
            moved_bytes += partition.data_bytes;
            partitions.push(StoredPartition {
                data,
                reservation: Arc::new(reservation),
                data_bytes: partition.data_bytes,
            });
        }
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
