//! `ipc-export`: columns of a dataset handed to another process under a lease.
//!
//! Every partition is described, each on the device that holds it. A consumer may name its
//! own device: partitions there are exported as they are; partitions on another GPU are
//! either exported for peer access (the consumer maps them on its own GPU, which reads them
//! over the link between the two) or, with `copy`, replicated onto the consumer's GPU. A
//! replica is paid for on that device's budget before it is made, belongs to the lease, and
//! is freed when the lease ends.

use std::sync::Arc;
use std::time::Duration;

use super::background::Background;
use super::catalog::Catalog;
use super::dataset::Dataset;
use super::error::StoreError;
use super::lease::{Lease, LeaseTerms, Leases};
use super::load::Loader;
use super::memory::{ARRAY_OVERHEAD, charge};
use super::relocate::Mover;
use super::slot::{Resident, StoredPartition, Tier};
use super::tier::Tiers;
use crate::arrays::type_array_count;
use crate::backend::{Backend, BackendError, ExportDevice, ExportedColumn};

/// What `ipc-export` asks for.
#[derive(Debug, Clone)]
pub struct ExportRequest {
    pub name: String,
    /// Column names; `None` for all.
    pub columns: Option<Vec<String>>,
    pub duration: Duration,
    /// Renew this lease (of the same dataset) instead of granting a new one.
    pub renew: Option<String>,
    /// Who asks, recorded on a new lease.
    pub owner: String,
    /// The device the consumer computes on, if it says.
    pub consumer: Option<u32>,
    /// Replicate partitions held by other devices onto `consumer`'s, for this lease.
    pub copy: bool,
    /// The caller can describe only one partition (document version 1): refuse datasets of
    /// several rather than grant a lease on them.
    pub one_partition: bool,
    /// Leases `owner` may hold at once (`--ipc-max-leases`); a new one past them is refused.
    pub max_leases: u32,
}

/// Leases one principal may hold at once without `--ipc-max-leases`.
pub const DEFAULT_MAX_EXPORT_LEASES: u32 = 1024;

impl ExportRequest {
    /// A new lease on all columns of `name`, for a consumer that does not say where it runs.
    pub fn new(name: impl Into<String>, duration: Duration, owner: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            columns: None,
            duration,
            renew: None,
            owner: owner.into(),
            consumer: None,
            copy: false,
            one_partition: false,
            max_leases: DEFAULT_MAX_EXPORT_LEASES,
        }
    }
}

/// How a consumer reaches an exported partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Access {
    /// On the consumer's device, or the consumer named none: map it on the device holding it.
    Local,
    /// On another GPU than the consumer's, which can reach it: map it on the consumer's GPU.
    Peer,
    /// A copy on the consumer's GPU, made for this lease and freed when it ends.
    Replica,
}

/// An exported dataset under its lease.
#[derive(Debug, Clone)]
pub struct Export {
    pub lease: Lease,
    /// Indices of the exported columns in the dataset's schema, as each partition lists them.
    pub columns: Vec<usize>,
    /// In row order.
    pub partitions: Vec<ExportedPartition>,
}

/// One partition of an export: where it is, how a consumer reaches it, and its columns.
#[derive(Debug, Clone)]
pub struct ExportedPartition {
    pub rows: u64,
    /// The device holding these columns (the consumer's, for a replica), as this store
    /// numbers its devices.
    pub device: u32,
    pub access: Access,
    /// That device as a consumer identifies it, whatever its `CUDA_VISIBLE_DEVICES`.
    pub gpu: ExportDevice,
    /// The exported columns, in the order the export lists them.
    pub columns: Vec<ExportedColumn>,
}

/// Grants and renews `ipc-export` leases.
#[derive(Debug)]
pub(crate) struct Exporter {
    backend: Arc<dyn Backend>,
    tiers: Arc<Tiers>,
    pub(super) loader: Arc<Loader>,
    catalog: Arc<Catalog>,
    background: Arc<Background>,
    mover: Arc<Mover>,
    leases: Arc<Leases>,
}

impl Exporter {
    pub(crate) fn new(
        backend: Arc<dyn Backend>,
        tiers: Arc<Tiers>,
        loader: Arc<Loader>,
        catalog: Arc<Catalog>,
        background: Arc<Background>,
        mover: Arc<Mover>,
        leases: Arc<Leases>,
    ) -> Self {
        Self {
            backend,
            tiers,
            loader,
            catalog,
            background,
            mover,
            leases,
        }
    }

    /// Exports columns of a dataset for zero-copy use by other processes, under a new or
    /// renewed lease. Fails, granting nothing and keeping no replica, where the dataset cannot
    /// be exported.
    pub(crate) async fn export(&self, request: ExportRequest) -> Result<Export, StoreError> {
        if let Some(device) = request.consumer {
            self.tiers.budget().check_device(device)?;
        }
        if let Some(id) = &request.renew {
            let lease = self.leases.renew(
                id,
                &request.name,
                &request.owner,
                request.duration,
                |lease| {
                    let terms = &lease.terms;
                    if terms.staged.is_some() {
                        return Err(StoreError::NotAnExportLease {
                            lease: id.to_owned(),
                        });
                    }
                    if request
                        .columns
                        .as_ref()
                        .is_some_and(|c| c != &terms.columns)
                        || request.consumer.is_some_and(|d| Some(d) != terms.consumer)
                        || (request.copy && !terms.copy)
                    {
                        return Err(StoreError::RenewalChangesTerms {
                            lease: id.to_owned(),
                        });
                    }
                    check_partitions(&lease.dataset, request.one_partition)
                },
            )?;
            return self.describe(lease);
        }
        // Refused before anything is restored or copied; checked again as it is granted.
        self.leases
            .check_exports(&request.owner, request.max_leases)?;
        let mut dataset = self.catalog.get(&request.name)?;
        if request.one_partition && dataset.num_partitions() > 1 {
            // Appends leave their partitions to a background compaction, which may make the
            // dataset compact: let it run (again, should memory have been freed since),
            // rather than refuse a dataset just appended to.
            self.background.schedule(&request.name);
            self.background.settled_for(&request.name).await;
            dataset = self.catalog.get(&request.name)?;
        }
        let names = match request.columns {
            Some(names) => names,
            None => dataset
                .schema()
                .fields()
                .iter()
                .map(|f| f.name().clone())
                .collect(),
        };
        let columns = column_indices(dataset.name(), &dataset.schema(), &names)?;
        check_partitions(&dataset, request.one_partition)?;
        // Where the memory cannot be exported at all (host memory), say so before copying.
        if self.backend.holds_host_memory() {
            return Err(BackendError::NotExportable {
                backend: self.backend.name(),
            }
            .into());
        }
        // Spilled partitions come back to their devices first; the lease holds what it
        // exports there, so no spill can free it while the lease lasts.
        let mut held = Vec::with_capacity(dataset.num_partitions());
        for partition in dataset.partitions() {
            partition.slot.touch();
            held.push(self.loader.restore(partition).await?);
        }
        if let Some(first) = held.first() {
            first.data.export(&columns)?;
        }
        let peer_access = self.backend.peer_access();
        let mut replicas = Vec::with_capacity(dataset.num_partitions());
        for (partition, resident) in dataset.partitions().iter().zip(&held) {
            let holder = partition.device();
            let replica = match request.consumer {
                Some(consumer) if consumer != holder && request.copy => Some(
                    self.replicate(&dataset, Arc::clone(resident), &columns, consumer)
                        .await?,
                ),
                Some(consumer) if consumer != holder => {
                    let reachable = peer_access
                        .get(consumer as usize)
                        .and_then(|row| row.get(holder as usize))
                        .copied()
                        .unwrap_or(false);
                    if !reachable {
                        return Err(StoreError::NoPeerAccess {
                            name: dataset.name().to_owned(),
                            holder,
                            consumer,
                        });
                    }
                    None
                }
                _ => None,
            };
            replicas.push(replica.map(super::lease::replica_held));
        }
        let terms = LeaseTerms {
            columns: names,
            consumer: request.consumer,
            copy: request.copy,
            held: Arc::new(held),
            replicas: Arc::new(replicas),
            staged: None,
        };
        let lease = Lease::new(dataset, terms, request.duration, request.owner);
        let export = self.describe(lease)?;
        self.leases
            .insert_export(export.lease.clone(), request.max_leases)?;
        Ok(export)
    }

    /// A copy of `columns` of `partition` (of `dataset`) on `device`, paid for there first
    /// as a put of those columns would be.
    async fn replicate(
        &self,
        dataset: &Dataset,
        partition: Arc<Resident>,
        columns: &[usize],
        device: u32,
    ) -> Result<StoredPartition, StoreError> {
        let bytes = self.backend.copied_size(&partition.data, columns)?;
        let rows = partition.data.num_rows() as u64;
        let schema = dataset.schema();
        let arrays: u64 = columns
            .iter()
            .map(|&c| type_array_count(schema.field(c).data_type()))
            .sum();
        let cost = charge(bytes, rows).saturating_add(ARRAY_OVERHEAD.saturating_mul(arrays));
        let reservation = self.tiers.reserve_on(device, cost).await?;
        let replica = self
            .mover
            .copy_partition(partition, columns, device, reservation, bytes)
            .await?;
        tracing::debug!(bytes, device, "partition replicated for an export");
        Ok(replica)
    }

    /// What `lease` exports, partition by partition.
    fn describe(&self, lease: Lease) -> Result<Export, StoreError> {
        let dataset = &lease.dataset;
        let columns = column_indices(dataset.name(), &dataset.schema(), &lease.terms.columns)?;
        let replica_columns: Vec<usize> = (0..columns.len()).collect();
        let partitions = dataset
            .partitions()
            .iter()
            .zip(lease.terms.held.iter())
            .zip(lease.terms.replicas.iter())
            .map(|((partition, held), replica)| {
                let (stored, columns, access) = match (replica, lease.terms.consumer) {
                    (Some(replica), _) => (Arc::clone(replica), &replica_columns, Access::Replica),
                    (None, Some(consumer)) if consumer != partition.device() => {
                        (Arc::clone(held), &columns, Access::Peer)
                    }
                    (None, _) => (Arc::clone(held), &columns, Access::Local),
                };
                let (gpu, columns) = stored.data.export(columns)?;
                Ok(ExportedPartition {
                    rows: stored.data.num_rows() as u64,
                    device: stored.reservation.device(),
                    access,
                    gpu,
                    columns,
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        Ok(Export {
            lease,
            columns,
            partitions,
        })
    }
}

/// The schema positions of columns `names` of dataset `name`, whose schema is `schema`; an
/// error names every unknown one.
pub fn column_indices(
    name: &str,
    schema: &arrow::datatypes::Schema,
    names: &[String],
) -> Result<Vec<usize>, StoreError> {
    // A map, not `Schema::index_of`'s scan: a client's list may be as long as its document.
    let mut positions = std::collections::HashMap::with_capacity(schema.fields().len());
    for (index, field) in schema.fields().iter().enumerate() {
        positions.entry(field.name().as_str()).or_insert(index);
    }
    let mut unknown = Vec::new();
    let indices: Vec<usize> = names
        .iter()
        .filter_map(|column| match positions.get(column.as_str()) {
            Some(&index) => Some(index),
            None => {
                unknown.push(column.clone());
                None
            }
        })
        .collect();
    if !unknown.is_empty() {
        return Err(StoreError::UnknownColumn {
            name: name.to_owned(),
            columns: unknown,
            available: format!(
                "{:?}",
                schema.fields().iter().map(|f| f.name()).collect::<Vec<_>>()
            ),
        });
    }
    Ok(indices)
}

/// Most partitions an export describes: its document grows with partitions times columns.
pub const MAX_EXPORT_PARTITIONS: usize = 4096;

/// Refuses a dataset with nothing to export, with more partitions than a document describes,
/// or with several where the caller can describe only one.
fn check_partitions(dataset: &Dataset, one_partition: bool) -> Result<(), StoreError> {
    let partitions = dataset.partitions();
    if partitions.is_empty() {
        return Err(StoreError::EmptyDataset {
            name: dataset.name().to_owned(),
        });
    }
    if partitions.len() > MAX_EXPORT_PARTITIONS {
        return Err(StoreError::TooManyPartitions {
            name: dataset.name().to_owned(),
            partitions: partitions.len(),
            max: MAX_EXPORT_PARTITIONS,
        });
    }
    if one_partition && partitions.len() > 1 {
        let spread = partitions
            .iter()
            .any(|p| p.device() != partitions[0].device());
        let on_disk = partitions.iter().any(|p| p.tier() == Tier::Disk);
        return Err(StoreError::NotCompact {
            name: dataset.name().to_owned(),
            partitions: partitions.len(),
            reason: if spread {
                "it is spread over several devices"
            } else if on_disk {
                "it was loaded from the data directory in parts of at most a quarter of its \
                 device's budget each"
            } else {
                "appended rows are merged only with partitions of comparable size, and only \
                 where memory is free for the merged copy (or a merged dictionary would \
                 outgrow its key type)"
            },
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::HostBackend;
    use crate::store::lease::Lease;
    use crate::store::testing::{DataDir, batch, open_host, put, reopened};
    use crate::store::{PutMode, Store, StoreOptions};

    /// A store over the host backend holding a dataset `t`.
    async fn store_of_t() -> Store {
        let store = Store::new(Arc::new(HostBackend::new()), StoreOptions::default());
        put(&store, PutMode::Create, vec![batch(0..10)])
            .await
            .commit()
            .await
            .expect("commit");
        store
    }

    fn terms() -> LeaseTerms {
        LeaseTerms {
            columns: vec!["x".to_owned()],
            consumer: None,
            copy: false,
            held: Arc::new(vec![]),
            replicas: Arc::new(vec![]),
            staged: None,
        }
    }

    /// Each lease holds memory (a dropped dataset's, a replica's) for up to a day: one
    /// principal may hold only so many, and the next is refused before anything is done.
    #[tokio::test]
    async fn a_principal_holds_at_most_its_lease_limit() {
        let store = store_of_t().await;
        let dataset = store.get("t").expect("t");
        for _ in 0..2 {
            let lease = Lease::new(
                Arc::clone(&dataset),
                terms(),
                Duration::from_secs(60),
                "owner".to_owned(),
            );
            store
                .leases
                .insert_export(lease, 2)
                .expect("within the limit");
        }
        let export = |owner: &str| {
            let mut request = ExportRequest::new("t", Duration::from_secs(60), owner);
            request.max_leases = 2;
            store.export(request)
        };
        let refused = export("owner").await.map(|_| ());
        assert!(
            matches!(refused, Err(StoreError::TooManyLeases { max: 2, .. })),
            "{refused:?}"
        );
        let lease = Lease::new(
            dataset,
            terms(),
            Duration::from_secs(60),
            "owner".to_owned(),
        );
        assert!(matches!(
            store.leases.insert_export(lease, 2),
            Err(StoreError::TooManyLeases { .. })
        ));
        assert_eq!(store.status().leases.len(), 2);
        // Another principal's are its own (here refused only as host memory).
        let other = export("other").await.map(|_| ());
        assert!(
            matches!(
                other,
                Err(StoreError::Backend(BackendError::NotExportable { .. }))
            ),
            "{other:?}"
        );
    }

    /// A lease id is shown to its owner (and admins): renewing it through `ipc-export`, like
    /// `lease-renew`, is for its owner alone.
    #[tokio::test]
    async fn an_export_renews_only_its_owners_lease() {
        let store = store_of_t().await;
        let dataset = store.get("t").expect("t");
        let lease = Lease::new(dataset, terms(), Duration::from_secs(5), "owner".to_owned());
        store.leases.insert(lease.clone());
        let renewal = |owner: &str| {
            let mut request = ExportRequest::new("t", Duration::from_secs(60), owner);
            request.renew = Some(lease.id.clone());
            store.export(request)
        };
        let refused = renewal("stranger").await.map(|_| ());
        assert!(
            matches!(refused, Err(StoreError::LeaseNotYours { .. })),
            "{refused:?}"
        );
        assert_eq!(store.status().leases[0].expires_at, lease.expires_at);
        let owned = renewal("owner").await.map(|_| ());
        assert!(
            !matches!(owned, Err(StoreError::LeaseNotYours { .. })),
            "{owned:?}"
        );
        assert!(store.status().leases[0].expires_at > lease.expires_at);

        // A shared-memory read's lease is renewed with lease-renew, and the refusal says so.
        let mut staged = terms();
        staged.staged = Some(Arc::new(Vec::new()));
        let dataset = store.get("t").expect("t");
        let shared = Lease::new(dataset, staged, Duration::from_secs(5), "owner".to_owned());
        store.leases.insert(shared.clone());
        let mut request = ExportRequest::new("t", Duration::from_secs(60), "owner");
        request.renew = Some(shared.id.clone());
        let refused = store.export(request).await.map(|_| ());
        assert!(
            matches!(refused, Err(StoreError::NotAnExportLease { .. })),
            "{refused:?}"
        );
    }

    /// A dataset loaded from the data directory in several parts cannot be described by a
    /// version 1 document, and the refusal says why (and, as every such refusal, that
    /// version 2 can).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_version_1_export_of_a_dataset_loaded_in_parts_says_so() {
        let dir = DataDir::new("parts");
        let options = dir.options(Some(16 << 20), 0);
        let store = open_host(&options).await;
        for i in 0..3 {
            let mode = if i == 0 {
                PutMode::Create
            } else {
                PutMode::Append
            };
            put(&store, mode, vec![batch(i * 600_000..(i + 1) * 600_000)])
                .await
                .commit()
                .await
                .expect("4.8 MB more");
        }
        let store = reopened(store, Arc::new(HostBackend::new()), &options).await;
        assert!(store.get("t").expect("t").num_partitions() > 1, "in parts");
        let mut request = ExportRequest::new("t", Duration::from_secs(60), "owner");
        request.one_partition = true;
        let refused = store.export(request).await.map(|_| ());
        let Err(error @ StoreError::NotCompact { .. }) = refused else {
            panic!("{refused:?}");
        };
        let message = error.to_string();
        assert!(message.contains("data directory"), "{message}");
        assert!(message.contains("version\": 2"), "{message}");
        store.close().await;
    }
}
