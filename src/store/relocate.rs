//! Moving a dataset to another device, atomically for its readers, and copying one to a new
//! name on a device (the `move` and `copy` actions).
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

use super::catalog::Catalog;
use super::compactor::Compactor;
use super::dataset::Dataset;
use super::durable::{self, Job};
use super::error::StoreError;
use super::load::Loader;
use super::memory::Reservation;
use super::options::PutMode;
use super::slot::{Resident, StoredPartition, Tier};
use super::tier::Tiers;
use crate::arrays::schema_bytes;
use crate::backend::{Backend, BackendError};

/// What a copy did.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct CopySummary {
    pub name: String,
    /// The new dataset's name.
    #[serde(rename = "as")]
    pub copy: String,
    pub device: u32,
    /// Arrow bytes copied.
    pub copied_bytes: u64,
    /// The new dataset's version.
    pub version: u64,
}

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

/// Copies partitions between devices: moves, copies and `ipc-export` replicas.
#[derive(Debug)]
pub(crate) struct Mover {
    backend: Arc<dyn Backend>,
    tiers: Arc<Tiers>,
    compactor: Arc<Compactor>,
    loader: Arc<Loader>,
    catalog: Arc<Catalog>,
}

impl Mover {
    pub(crate) fn new(
        backend: Arc<dyn Backend>,
        tiers: Arc<Tiers>,
        compactor: Arc<Compactor>,
        loader: Arc<Loader>,
        catalog: Arc<Catalog>,
    ) -> Self {
        Self {
            backend,
            tiers,
            compactor,
            loader,
            catalog,
        }
    }

    /// Moves every partition of `name` onto `device`. Fails, changing nothing, when the device
    /// has no room or the dataset changed while it was being copied.
    pub(crate) async fn move_dataset(
        &self,
        name: &str,
        device: u32,
    ) -> Result<MoveSummary, StoreError> {
        self.tiers.budget().check_device(device)?;
        let catalog = &self.catalog;
        let base = catalog.get(name)?;
        if base
            .partitions()
            .iter()
            .all(|p| p.tier() == Tier::Device(device))
        {
            return Ok(MoveSummary {
                name: name.to_owned(),
                device,
                moved_bytes: 0,
                version: base.version(),
            });
        }
        let schema = base.schema();
        let (partitions, moved_bytes) = self.copy_partitions(&base, device, true).await?;
        let version = catalog.next_version();
        match catalog.entry(name) {
            Entry::Occupied(mut entry) if entry.get().version() == base.version() => {
                // The same rows elsewhere: on disk only the version changes.
                let _ = catalog.persist(|_| Job::Rename {
                    name: name.to_owned(),
                    from: base.version(),
                    to: version.number,
                });
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
            version: version.number,
        })
    }

    /// Copies every row of `name` onto `device` as a new dataset `copy`, which must not
    /// exist. The original is untouched; readers of `copy` see all of it or nothing.
    pub(crate) async fn copy_dataset(
        &self,
        name: &str,
        copy: &str,
        device: u32,
    ) -> Result<CopySummary, StoreError> {
        self.tiers.budget().check_device(device)?;
        let catalog = &self.catalog;
        if catalog.contains(copy) {
            return Err(StoreError::AlreadyExists {
                name: copy.to_owned(),
            });
        }
        catalog.check_damage(copy, PutMode::Create)?;
        let base = catalog.get(name)?;
        let schema = base.schema();
        let schema_charge = self.tiers.reserve_on(device, schema_bytes(&schema)).await?;
        let (partitions, copied_bytes) = self.copy_partitions(&base, device, false).await?;
        let version = catalog.next_version();
        let persisted = match catalog.entry(copy) {
            Entry::Vacant(entry) => {
                catalog.check_damage(copy, PutMode::Create)?;
                let dataset = Arc::new(Dataset::new(
                    copy.to_owned(),
                    schema,
                    version,
                    partitions,
                    Arc::new(schema_charge),
                ));
                let persisted = catalog.persist_whole(&dataset);
                entry.insert(dataset);
                persisted
            }
            Entry::Occupied(_) => {
                return Err(StoreError::AlreadyExists {
                    name: copy.to_owned(),
                });
            }
        };
        if let Err(error) = durable::wait(persisted).await {
            catalog.undo(copy, version.number, None);
            return Err(error);
        }
        tracing::info!(dataset = name, copy, device, copied_bytes, "dataset copied");
        Ok(CopySummary {
            name: name.to_owned(),
            copy: copy.to_owned(),
            device,
            copied_bytes,
            version: version.number,
        })
    }

    /// Copies `columns` of `partition` onto `device`, paid for by `reservation`. The copy
    /// runs on a task of its own that holds the reservation until the copy's memory is
    /// returned, so a caller that goes away mid-copy cannot free the budget while the backend
    /// still holds the memory.
    pub(crate) async fn copy_partition(
        &self,
        resident: Arc<Resident>,
        columns: &[usize],
        device: u32,
        reservation: Reservation,
        data_bytes: u64,
    ) -> Result<StoredPartition, StoreError> {
        let copying = self
            .backend
            .copy_to(Arc::clone(&resident.data), columns.to_vec(), device);
        // Dropped in field order if nobody awaits it: the copy, then what paid for it (and
        // the original, which a spill must not free while it is read).
        let (data, reservation, _resident) =
            tokio::spawn(async move { (copying.await, reservation, resident) })
                .await
                .map_err(|e| BackendError::Device(format!("a copy task failed: {e}")))?;
        Ok(self.tiers.hold(data?, reservation, data_bytes))
    }

    /// `base`'s partitions on `device`, compacted there: copies of those elsewhere (or spilled
    /// to the host tier), paid for on `device` before each is made, and of those already there
    /// too unless `keep_local`. Returns them with the Arrow bytes copied.
    async fn copy_partitions(
        &self,
        base: &Dataset,
        device: u32,
        keep_local: bool,
    ) -> Result<(Vec<StoredPartition>, u64), StoreError> {
        let schema = base.schema();
        let all_columns: Vec<usize> = (0..schema.fields().len()).collect();
        let mut partitions: Vec<StoredPartition> = Vec::new();
        let mut copied_bytes = 0;
        for partition in base.partitions() {
            if keep_local && partition.tier() == Tier::Device(device) {
                partitions.push(partition.clone());
                continue;
            }
            let resident = partition.slot.resident();
            copied_bytes += partition.data_bytes;
            if !matches!(resident.tier, Tier::Device(_)) {
                partitions.push(
                    self.loader
                        .upload_resident(&resident, device, partition.data_bytes)
                        .await?,
                );
                continue;
            }
            // The copy has the original's layout, so it costs what the original does.
            let reservation = self
                .tiers
                .reserve_on(device, resident.reservation.bytes())
                .await?;
            partitions.push(
                self.copy_partition(
                    resident,
                    &all_columns,
                    device,
                    reservation,
                    partition.data_bytes,
                )
                .await?,
            );
        }
        let partitions = self.compactor.compact_runs(&schema, partitions).await?;
        Ok((partitions, copied_bytes))
    }
}
