//! `ipc-export`: columns of a dataset handed to another process under a lease.

use std::sync::Arc;
use std::time::Duration;

use super::{Lease, Store, StoreError, lease};
use crate::backend::PartitionExport;

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
}

/// An exported dataset under its lease.
#[derive(Debug, Clone)]
pub struct Export {
    pub lease: Lease,
    /// Indices of the exported columns in the dataset's schema, as `partition` lists them.
    pub columns: Vec<usize>,
    pub partition: PartitionExport,
}

impl Store {
    /// Exports columns of a dataset for zero-copy use by another process, under a new or
    /// renewed lease. Fails, granting nothing, where the dataset cannot be exported.
    pub fn export(&self, request: ExportRequest) -> Result<Export, StoreError> {
        let inner = &self.inner;
        let renewed = match &request.renew {
            Some(id) => Some(inner.leases.renew(id, &request.name, request.duration)?),
            None => None,
        };
        let dataset = match &renewed {
            Some(lease) => Arc::clone(&lease.dataset),
            None => self.get(&request.name)?,
        };
        let schema = dataset.schema();
        let names: Vec<String> = match request.columns {
            Some(names) => names,
            None => schema.fields().iter().map(|f| f.name().clone()).collect(),
        };
        let columns = names
            .iter()
            .map(|column| {
                schema
                    .index_of(column)
                    .map_err(|_| StoreError::UnknownColumn {
                        name: dataset.name().to_owned(),
                        column: column.clone(),
                        available: format!(
                            "{:?}",
                            schema.fields().iter().map(|f| f.name()).collect::<Vec<_>>()
                        ),
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let partition = match dataset.partitions() {
            [] => {
                return Err(StoreError::EmptyDataset {
                    name: dataset.name().to_owned(),
                });
            }
            [partition] => partition,
            many => {
                let spread = many.iter().any(|p| p.device() != many[0].device());
                return Err(StoreError::NotCompact {
                    name: dataset.name().to_owned(),
                    partitions: many.len(),
                    reason: if spread {
                        "it is spread over several devices; the move action puts it on one"
                    } else {
                        "its batches could not be concatenated, e.g. their merged dictionary \
                         outgrew the key type"
                    },
                });
            }
        };
        let partition = partition.data.export(&columns)?;
        let lease = match renewed {
            Some(lease) => lease,
            None => inner
                .leases
                .grant(dataset, names, request.duration, request.owner),
        };
        Ok(Export {
            lease,
            columns,
            partition,
        })
    }

    /// Ends lease `id`. Memory that only the lease held is freed.
    pub fn release(&self, id: &str) -> Result<Lease, StoreError> {
        self.inner
            .leases
            .release(id)
            .ok_or_else(|| StoreError::LeaseNotFound {
                lease: id.to_owned(),
            })
    }

    /// Starts the task that ends expired leases, checking every `period`. It stops by itself
    /// when the store is dropped.
    pub fn spawn_lease_reaper(&self, period: Duration) -> tokio::task::JoinHandle<()> {
        lease::spawn_reaper(Arc::downgrade(&self.inner), period)
    }
}
