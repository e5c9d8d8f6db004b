//! The catalog: names to datasets, dataset versions, and datasets found damaged; opening it
//! from what `--data-dir` holds, and every change to it queued for the disk in the order it
//! was made.
//!
//! The catalog is a `DashMap`: lookups from many concurrent `DoGet`s never contend on one
//! lock, and no shard lock is ever held across an `.await`. A change holds the name's entry
//! while it queues its job for the persistence writer, so the writer sees a name's versions
//! in commit order.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use dashmap::DashMap;
use dashmap::mapref::entry::Entry;

use super::dataset::{Dataset, Version};
use super::durable::{self, Done, Durable, Job, Persisted};
use super::error::StoreError;
use super::files::{DatasetEntry, FilesError};
use super::load::Loader;
use super::memory::MemoryBudget;
use super::options::{Durability, PutMode};
use super::stats::Stats;
use super::tier::Tiers;

/// A dataset of the data directory whose files failed the checks at start: listed by `status`,
/// read as DATA_LOSS, and kept on disk until it is dropped or replaced.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Damaged {
    /// What is wrong, naming the file.
    pub reason: String,
    /// Rows and file bytes the manifest records for it.
    pub rows: u64,
    pub bytes: u64,
}

/// What a drop removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dropped {
    pub rows: u64,
    /// Arrow bytes of its rows, and the memory they held (nothing for a damaged dataset).
    pub bytes: u64,
    pub memory_bytes: u64,
}

/// Names to datasets, and what reaches the disk of their changes.
#[derive(Debug)]
pub(crate) struct Catalog {
    datasets: DashMap<String, Arc<Dataset>>,
    /// Datasets of the data directory whose files were found damaged at start: not served,
    /// kept on disk until dropped or replaced.
    damaged: DashMap<String, Damaged>,
    next_version: AtomicU64,
    /// The persistence writer, under `--data-dir`.
    durable: Option<Durable>,
}

impl Default for Catalog {
    fn default() -> Self {
        Self {
            datasets: DashMap::new(),
            damaged: DashMap::new(),
            next_version: AtomicU64::new(1),
            durable: None,
        }
    }
}

impl Catalog {
    /// The dataset named `name`.
    pub(crate) fn get(&self, name: &str) -> Result<Arc<Dataset>, StoreError> {
        self.datasets
            .get(name)
            .map(|entry| Arc::clone(entry.value()))
            .ok_or_else(|| self.missing(name))
    }

    /// Why `name` is not in the catalog: damaged on disk, or unknown.
    fn missing(&self, name: &str) -> StoreError {
        match self.damaged.get(name) {
            Some(damaged) => StoreError::Damaged {
                name: name.to_owned(),
                reason: damaged.reason.clone(),
            },
            None => StoreError::NotFound {
                name: name.to_owned(),
            },
        }
    }

    /// Datasets of the data directory found damaged at start, sorted by name.
    pub(crate) fn damaged(&self) -> Vec<(String, Damaged)> {
        let mut damaged: Vec<_> = self
            .damaged
            .iter()
            .map(|entry| (entry.key().clone(), entry.value().clone()))
            .collect();
        damaged.sort_by(|a, b| a.0.cmp(&b.0));
        damaged
    }

    /// Whether a put of `mode` may commit under `name`: over a damaged dataset only a
    /// `replace` may (a `create` would hide it, an `append` build on rows it cannot read).
    pub(crate) fn check_damage(&self, name: &str, mode: PutMode) -> Result<(), StoreError> {
        match mode {
            PutMode::Replace => Ok(()),
            PutMode::Create | PutMode::Append => match self.damaged.get(name) {
                Some(damaged) => Err(StoreError::Damaged {
                    name: name.to_owned(),
                    reason: damaged.reason.clone(),
                }),
                None => Ok(()),
            },
        }
    }

    /// A change that replaced `name` is durable: a damaged dataset of that name is gone from
    /// the disk too.
    pub(crate) fn replaced_on_disk(&self, name: &str) {
        self.damaged.remove(name);
    }

    /// Whether a dataset is named `name`.
    pub(crate) fn contains(&self, name: &str) -> bool {
        self.datasets.contains_key(name)
    }

    /// `name`'s entry, held while a change to it is made and queued for the disk.
    pub(crate) fn entry(&self, name: &str) -> Entry<'_, String, Arc<Dataset>> {
        self.datasets.entry(name.to_owned())
    }

    /// Every dataset, in no order.
    pub(crate) fn all(&self) -> Vec<Arc<Dataset>> {
        self.datasets
            .iter()
            .map(|entry| Arc::clone(entry.value()))
            .collect()
    }

    /// The persistence writer, under `--data-dir`.
    pub(crate) fn durable(&self) -> Option<&Durable> {
        self.durable.as_ref()
    }

    /// Datasets whose names start with `prefix`, sorted by name.
    pub(crate) fn list(&self, prefix: &str) -> Vec<Arc<Dataset>> {
        let mut datasets: Vec<_> = self
            .datasets
            .iter()
            .filter(|entry| entry.key().starts_with(prefix))
            .map(|entry| Arc::clone(entry.value()))
            .collect();
        datasets.sort_by(|a, b| a.name().cmp(b.name()));
        datasets
    }

    /// Removes `name` from the catalog. Its memory returns once running reads finish. Under
    /// `--data-dir` its files go too, once the disk catches up: see [`Catalog::drop_dataset`].
    pub(crate) fn remove(&self, name: &str) -> Result<Arc<Dataset>, StoreError> {
        self.remove_queued(name).map(|(dataset, _)| dataset)
    }

    /// [`Catalog::remove`], acknowledged as `--durability` says: under `sync`, once the
    /// dataset is gone from the disk too. A dataset found damaged at start is dropped too
    /// (its files with it).
    pub(crate) async fn drop_dataset(&self, name: &str) -> Result<Dropped, StoreError> {
        // The name's entry is held while the drop is queued, vacant or not: a put committing
        // under the name meanwhile queues its write before or after the drop, never between
        // the check and the queueing (which would drop what it made durable).
        let (dropped, persisted, damaged) = match self.datasets.entry(name.to_owned()) {
            Entry::Occupied(entry) => {
                let persisted = self.persist(|done| Job::Remove {
                    name: name.to_owned(),
                    done,
                });
                let dataset = entry.remove();
                let dropped = Dropped {
                    rows: dataset.num_rows(),
                    bytes: dataset.data_bytes(),
                    memory_bytes: dataset.memory_bytes(),
                };
                (dropped, persisted, None)
            }
            Entry::Vacant(_held) => {
                let Some((_, damaged)) = self.damaged.remove(name) else {
                    return Err(StoreError::NotFound {
                        name: name.to_owned(),
                    });
                };
                let persisted = self.persist(|done| Job::Remove {
                    name: name.to_owned(),
                    done,
                });
                let dropped = Dropped {
                    rows: damaged.rows,
                    bytes: damaged.bytes,
                    memory_bytes: 0,
                };
                (dropped, persisted, Some(damaged))
            }
        };
        if let Err(error) = durable::wait(persisted).await {
            // Still on disk: still damaged, for a retry to drop.
            if let Some(damaged) = damaged
                && !self.datasets.contains_key(name)
            {
                self.damaged.insert(name.to_owned(), damaged);
            }
            return Err(error);
        }
        Ok(dropped)
    }

    fn remove_queued(&self, name: &str) -> Result<(Arc<Dataset>, Persisted), StoreError> {
        match self.datasets.entry(name.to_owned()) {
            Entry::Occupied(entry) => {
                let persisted = self.persist(|done| Job::Remove {
                    name: name.to_owned(),
                    done,
                });
                Ok((entry.remove(), persisted))
            }
            Entry::Vacant(_) => Err(StoreError::NotFound {
                name: name.to_owned(),
            }),
        }
    }

    /// Queues a change for the disk under `--data-dir`; the caller holds the catalog entry
    /// it changed, so changes to a name reach the disk in the order they were made.
    pub(crate) fn persist(&self, job: impl FnOnce(Done) -> Job) -> Persisted {
        self.durable.as_ref().and_then(|durable| durable.queue(job))
    }

    /// Queues all of `dataset` for the disk (see [`Catalog::persist`]).
    pub(crate) fn persist_whole(&self, dataset: &Arc<Dataset>) -> Persisted {
        self.persist(|done| Job::Write {
            dataset: Arc::clone(dataset),
            base: None,
            rows: 0..dataset.num_rows(),
            done,
        })
    }

    /// Puts `name` back as it was before a change (version `version`) the disk refused,
    /// unless something changed it since, and queues that state for the disk again.
    pub(crate) fn undo(&self, name: &str, version: u64, previous: Option<Arc<Dataset>>) {
        if let Entry::Occupied(mut entry) = self.datasets.entry(name.to_owned())
            && entry.get().version() == version
        {
            match previous {
                Some(previous) => {
                    let rows = 0..previous.num_rows();
                    let _ = self.persist(|_| Job::Write {
                        dataset: Arc::clone(&previous),
                        base: None,
                        rows,
                        done: None,
                    });
                    entry.insert(previous);
                }
                // Over a dataset found damaged at start, the disk still holds that one: the
                // refused change never replaced it there.
                None if self.damaged.contains_key(name) => {
                    entry.remove();
                }
                None => {
                    let _ = self.persist(|_| Job::Remove {
                        name: name.to_owned(),
                        done: None,
                    });
                    entry.remove();
                }
            }
        }
    }

    /// Under `--data-dir`, waits until every change committed so far is on disk, and closes
    /// the directory: later changes stay in memory only. For a clean shutdown.
    pub(crate) async fn close(&self) {
        if let Some(durable) = &self.durable {
            durable.close().await;
        }
    }

    /// The catalog of data directory `root`: every dataset it holds, on disk (homed on the
    /// devices of `tiers`, loaded by `loader`), and then every commit made durable there as
    /// `durability` says. Only the manifest and each dataset's schema are read now; rows are
    /// loaded when they are first needed (`load`), so the catalog is ready at once whatever
    /// the directory holds. Fails, naming the file, where the directory cannot be read or a
    /// file the manifest names is missing or of another size: a server never starts without
    /// data it was trusted with.
    pub(crate) async fn open(
        root: PathBuf,
        durability: Durability,
        tiers: &Tiers,
        loader: &Arc<Loader>,
        stats: Arc<Stats>,
    ) -> Result<Self, StoreError> {
        let mut store = Self::default();
        let started = std::time::Instant::now();
        let (dir, manifest) = durable::open(root.clone()).await?;
        let files = dir.segment_files();
        for (name, damage) in dir.damaged() {
            store.quarantine(name, &manifest.datasets[name], damage.reason.clone());
        }
        let entries: Vec<_> = manifest
            .datasets
            .iter()
            .filter(|(name, _)| !store.damaged.contains_key(*name))
            .map(|(name, entry)| (name.clone(), entry.segments.clone()))
            .collect();
        // Numbers go on from the highest on disk, so none repeats within this run; the tags
        // tell them from versions of earlier runs, other servers or copies of the directory.
        let highest = manifest.datasets.values().map(|e| e.version).max();
        store.next_version.store(
            highest.map_or(1, |v| v.saturating_add(1)),
            Ordering::Relaxed,
        );
        let versions: HashMap<String, Version> = manifest
            .datasets
            .iter()
            .map(|(name, entry)| {
                let version = match entry.tag {
                    Some(tag) => Version {
                        number: entry.version,
                        tag,
                    },
                    // Written before versions had tags: a tag of this run's, until the
                    // dataset is next written (tickets of earlier runs had none either).
                    None => Version::new(entry.version),
                };
                (name.clone(), version)
            })
            .collect();
        let schemas = {
            let files = Arc::clone(&files);
            let manifest_path = root.join("manifest.json");
            tokio::task::spawn_blocking(move || {
                entries
                    .into_iter()
                    .map(|(name, segments)| {
                        let schema = match segments.first() {
                            Some(first) => files.pin(first).read_schema(),
                            None => Err(FilesError::Corrupt {
                                path: manifest_path.clone(),
                                reason: format!("dataset {name:?} has no segments"),
                            }),
                        };
                        (name, segments, schema)
                    })
                    .collect::<Vec<_>>()
            })
            .await
            .map_err(|e| StoreError::Persist(format!("a disk task failed: {e}")))?
        };
        // Placed like puts, on the device with the most room, counting what is placed there
        // already as if it were loaded.
        let budget: &Arc<MemoryBudget> = tiers.budget();
        let mut planned = vec![0u64; budget.devices().max(1) as usize];
        let mut loaded = HashMap::new();
        for (name, segments, schema) in schemas {
            // Only this dataset is not served: every other one is, and this one stays on disk
            // for an operator to restore (or to drop).
            let schema = match schema {
                Ok(schema) => schema,
                Err(error) => {
                    store.quarantine(&name, &manifest.datasets[&name], error.to_string());
                    continue;
                }
            };
            let device = (0..planned.len())
                .rev()
                .max_by_key(|&d| budget.free(d as u32).saturating_sub(planned[d]))
                .unwrap_or(0);
            let context = |error: StoreError| {
                StoreError::Persist(format!(
                    "opening dataset {name:?} in {}: {error}",
                    root.display()
                ))
            };
            let schema_charge = budget
                .try_reserve(device as u32, crate::arrays::schema_bytes(&schema))
                .map_err(context)?;
            let partitions = match loader.disk_partitions(&files, &schema, &segments, device as u32)
            {
                Ok(partitions) => partitions,
                Err(error) => {
                    store.quarantine(&name, &manifest.datasets[&name], error.to_string());
                    continue;
                }
            };
            for partition in &partitions {
                planned[device] = planned[device].saturating_add(partition.data_bytes);
            }
            let version = versions
                .get(&name)
                .copied()
                .unwrap_or_else(|| store.next_version());
            let dataset = Dataset::new(
                name.clone(),
                schema,
                version,
                partitions,
                Arc::new(schema_charge),
            );
            store.datasets.insert(name.clone(), Arc::new(dataset));
            loaded.insert(name, version.number);
        }
        tracing::info!(
            data_dir = %root.display(),
            datasets = loaded.len(),
            damaged = store.damaged.len(),
            bytes = tiers.disk_used(),
            seconds = started.elapsed().as_secs_f64(),
            "data directory opened; datasets load as they are read"
        );
        store.durable = Some(Durable::start(
            dir,
            manifest,
            loaded,
            durability,
            Arc::downgrade(loader),
            stats,
        ));
        Ok(store)
    }

    /// Keeps `name` out of the catalog, as damaged for `reason` (which names the file).
    fn quarantine(&self, name: &str, entry: &DatasetEntry, reason: String) {
        tracing::error!(
            dataset = ?name,
            %reason,
            "a dataset in the data directory is damaged and is not served; every other \
             dataset is. Restore the file from a backup and restart, or drop or replace the dataset"
        );
        let rows = entry
            .segments
            .iter()
            .fold(0u64, |n, s| n.saturating_add(s.rows));
        let bytes = entry
            .segments
            .iter()
            .fold(0u64, |n, s| n.saturating_add(s.bytes));
        self.damaged.insert(
            name.to_owned(),
            Damaged {
                reason,
                rows,
                bytes,
            },
        );
    }

    /// A version number no dataset of this store holds, with a tag of its own.
    pub(crate) fn next_version(&self) -> Version {
        Version::new(self.next_version.fetch_add(1, Ordering::Relaxed))
    }
}
