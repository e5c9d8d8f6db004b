//! The catalog: names to datasets, and dataset versions.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use dashmap::DashMap;

use super::memory::MemoryBudget;
use super::{Dataset, Inner, Store, StoreError, StoreOptions, lease};
use crate::backend::Backend;

impl Store {
    pub fn new(backend: Arc<dyn Backend>, options: StoreOptions) -> Self {
        let limits = backend
            .devices()
            .iter()
            .map(|device| match (options.memory_limit, device.total_bytes) {
                (Some(limit), Some(total)) => Some(limit.min(total)),
                (Some(limit), None) => Some(limit),
                (None, _) => device.default_limit_bytes.or(device.total_bytes),
            })
            .collect();
        let host_limit = options
            .host_memory_limit
            .unwrap_or_else(|| super::default_host_memory_limit(backend.as_ref()));
        Self {
            inner: Arc::new(Inner {
                budget: MemoryBudget::new(limits),
                backend,
                catalog: DashMap::new(),
                next_version: AtomicU64::new(1),
                leases: lease::Leases::default(),
                tiers: super::tier::Tiers::new(host_limit),
                puts: Arc::default(),
                concatenations: AtomicU64::new(0),
                concatenated_bytes: AtomicU64::new(0),
                concatenation_nanos: AtomicU64::new(0),
            }),
        }
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.inner.backend
    }

    /// The dataset named `name`.
    pub fn get(&self, name: &str) -> Result<Arc<Dataset>, StoreError> {
        self.inner
            .catalog
            .get(name)
            .map(|entry| Arc::clone(entry.value()))
            .ok_or_else(|| StoreError::NotFound {
                name: name.to_owned(),
            })
    }

    /// Datasets whose names start with `prefix`, sorted by name.
    pub fn list(&self, prefix: &str) -> Vec<Arc<Dataset>> {
        let mut datasets: Vec<_> = self
            .inner
            .catalog
            .iter()
            .filter(|entry| entry.key().starts_with(prefix))
            .map(|entry| Arc::clone(entry.value()))
            .collect();
        datasets.sort_by(|a, b| a.name().cmp(b.name()));
        datasets
    }

    /// Removes `name` from the catalog. Its memory returns once running reads finish.
    pub fn remove(&self, name: &str) -> Result<Arc<Dataset>, StoreError> {
        self.inner
            .catalog
            .remove(name)
            .map(|(_, dataset)| dataset)
            .ok_or_else(|| StoreError::NotFound {
                name: name.to_owned(),
            })
    }

    pub(super) fn next_version(&self) -> u64 {
        self.inner.next_version.fetch_add(1, Ordering::Relaxed)
    }
}
