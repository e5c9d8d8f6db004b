//! The catalog of datasets, the put lifecycle and memory accounting.
//!
//! The store knows nothing of gRPC: it takes names, schemas and host record batches, and hands
//! out [`Dataset`]s. It owns the rules the protocol relies on:
//!
//! - **Atomic puts.** A [`PendingPut`] collects uploaded partitions privately. Only
//!   [`PendingPut::commit`] makes them visible, in one catalog operation; dropping a pending put
//!   (bad input, a vanished client, shutdown) frees everything it uploaded.
//! - **Budgets.** Every partition is paid for by a [`memory::Reservation`] taken *before* the
//!   upload, so a put beyond the memory limit fails without disturbing other datasets.
//! - **Snapshot reads.** Datasets are immutable; readers hold an `Arc`, so `drop`, `replace` and
//!   `append` never cut a running stream short.
//! - **Tiers.** A partition lives on its device, spilled to host memory when the device needs
//!   room, or (under `--data-dir`) only on disk until it is read.
//! - **Leases.** An `ipc-export` lease holds its dataset like a reader does, so memory other
//!   processes have mapped outlives `drop` and `replace` until the lease ends.
//!
//! [`Store`] is a thin facade over components, each owning its state and handed the ones it
//! uses (`Arc`s) when it is built, in one order; a file imports only files before it (checked
//! by `tests/module_graph.rs`), and none imports this one:
//!
//! 1. `files` (the data directory's formats and filesystem; nothing else of the store);
//! 2. `error`, `options`, `stats` (every counter), `memory` (budgets, reservations, charges),
//!    `progress` (puts in flight), `memfile` (sealed memory files, paid for as written);
//! 3. `slot` (a partition's place: its [`Tier`] and what pays for it there), then `tier` (the
//!    budgets of the tiers, reserving on a device, spilling);
//! 4. `compactor`: the one place partitions are compacted (puts, moves, loads, background);
//! 5. `load`: partitions back into memory from the disk tier, and onto devices from the host;
//! 6. `dataset`: an immutable version, and reading it;
//! 7. `durable`: persistence, the writer of the catalog's changes into `files`;
//! 8. `catalog`: names, versions and damaged datasets, opened from `--data-dir`;
//! 9. `background` (compacting appended partitions after their commit), then `import`
//!    (`ipc-import`'s columns checked and planned, the producer's device), `put`,
//!    `relocate` (moves and copies), `lease`, `export` (`ipc-export`), `shared` (`shm-read`'s
//!    files and tokens) and `status`;
//! 10. this facade, which builds them and delegates.

mod background;
mod catalog;
mod compactor;
mod dataset;
mod durable;
mod error;
mod export;
mod files;
mod import;
mod lease;
mod load;
mod memfile;
pub mod memory;
mod options;
mod progress;
mod put;
mod relocate;
mod shared;
mod slot;
mod stats;
mod status;
#[cfg(test)]
mod testing;
mod tier;

use std::sync::Arc;
use std::time::Duration;

pub use catalog::{Damaged, Dropped};
pub use dataset::{Dataset, FilteredChunk, TierBytes, Version};
pub use error::StoreError;
pub use export::{
    Access, DEFAULT_MAX_EXPORT_LEASES, Export, ExportRequest, ExportedPartition,
    MAX_EXPORT_PARTITIONS, column_indices,
};
pub use import::CheckedImport;
pub use lease::{Lease, LeaseTerms};
pub use memfile::{SharedFileWriter, SharedLimits, StagedFile};
pub use memory::ARRAY_OVERHEAD;
pub use options::{Durability, PutMode, StoreOptions, default_host_memory_limit};
pub use progress::PutProgress;
pub use put::{PendingPut, PutSummary, Upload};
pub use relocate::{CopySummary, MoveSummary};
pub use shared::{ClaimedFile, FileSetWriter, ShareTerms, SharedGrant};
pub use slot::{StoredPartition, Tier};
pub use status::{DeviceStatus, LeaseStatus, PersistenceStatus, StoreStatus, TierStatus};

use crate::backend::Backend;
use background::Background;
use catalog::Catalog;
use compactor::Compactor;
use export::Exporter;
use lease::Leases;
use load::Loader;
use memory::{MemoryBudget, Reservation};
use progress::InFlight;
use put::Puts;
use relocate::Mover;
use shared::SharedFiles;
use stats::Stats;
use tier::Tiers;

/// The catalog of datasets over one backend. Cheap to clone: all clones share the components.
#[derive(Debug, Clone)]
pub struct Store {
    backend: Arc<dyn Backend>,
    stats: Arc<Stats>,
    tiers: Arc<Tiers>,
    catalog: Arc<Catalog>,
    background: Arc<Background>,
    puts: Arc<Puts>,
    mover: Arc<Mover>,
    leases: Arc<Leases>,
    exporter: Arc<Exporter>,
    shared: Arc<SharedFiles>,
    in_flight: Arc<InFlight>,
}

/// The components below the catalog, which opening a data directory needs first.
struct Below {
    backend: Arc<dyn Backend>,
    stats: Arc<Stats>,
    tiers: Arc<Tiers>,
    compactor: Arc<Compactor>,
    loader: Arc<Loader>,
}

impl Below {
    fn new(backend: Arc<dyn Backend>, options: &StoreOptions) -> Self {
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
            .unwrap_or_else(|| default_host_memory_limit(backend.as_ref()));
        let stats = Arc::new(Stats::default());
        let tiers = Arc::new(Tiers::new(
            Arc::clone(&backend),
            MemoryBudget::new(limits),
            host_limit,
            Arc::clone(&stats),
        ));
        let compactor = Arc::new(Compactor::new(
            Arc::clone(&backend),
            Arc::clone(&tiers),
            Arc::clone(&stats),
        ));
        let loader = Arc::new(Loader::new(
            Arc::clone(&backend),
            Arc::clone(&tiers),
            Arc::clone(&compactor),
            Arc::clone(&stats),
        ));
        Self {
            backend,
            stats,
            tiers,
            compactor,
            loader,
        }
    }

    /// The store of these components and `catalog`.
    fn with(self, catalog: Catalog) -> Store {
        let Self {
            backend,
            stats,
            tiers,
            compactor,
            loader,
        } = self;
        let catalog = Arc::new(catalog);
        let background = Arc::new(Background::new(
            Arc::clone(&catalog),
            Arc::clone(&compactor),
            Arc::clone(&stats),
        ));
        let in_flight = Arc::new(InFlight::default());
        let puts = Arc::new(Puts::new(
            Arc::clone(&backend),
            Arc::clone(&tiers),
            Arc::clone(&compactor),
            Arc::clone(&catalog),
            Arc::clone(&background),
            Arc::clone(&in_flight),
        ));
        let mover = Arc::new(Mover::new(
            Arc::clone(&backend),
            Arc::clone(&tiers),
            Arc::clone(&compactor),
            Arc::clone(&loader),
            Arc::clone(&catalog),
        ));
        let leases = Arc::new(Leases::default());
        let exporter = Arc::new(Exporter::new(
            Arc::clone(&backend),
            Arc::clone(&tiers),
            loader,
            Arc::clone(&catalog),
            Arc::clone(&background),
            Arc::clone(&mover),
            Arc::clone(&leases),
        ));
        let shared = Arc::new(SharedFiles::new(Arc::clone(&tiers), Arc::clone(&leases)));
        Store {
            backend,
            stats,
            tiers,
            catalog,
            background,
            puts,
            mover,
            leases,
            exporter,
            shared,
            in_flight,
        }
    }
}

impl Store {
    /// A store over `backend` that keeps everything in memory (`options.data_dir` is not
    /// read: see [`Store::open`]).
    pub fn new(backend: Arc<dyn Backend>, options: StoreOptions) -> Self {
        Below::new(backend, &options).with(Catalog::default())
    }

    /// A store over `backend` that, with `options.data_dir`, serves every dataset the
    /// directory holds and then makes every commit durable there. Only the manifest and each
    /// dataset's schema are read now; rows are loaded when they are first needed, so the store
    /// is ready at once whatever the directory holds. Fails, naming the file, where the
    /// directory cannot be read or a file the manifest names is missing or of another size: a
    /// server never starts without data it was trusted with.
    pub async fn open(
        backend: Arc<dyn Backend>,
        options: StoreOptions,
    ) -> Result<Self, StoreError> {
        let below = Below::new(backend, &options);
        let catalog = match options.data_dir {
            Some(root) => {
                Catalog::open(
                    root,
                    options.durability,
                    &below.tiers,
                    &below.loader,
                    Arc::clone(&below.stats),
                )
                .await?
            }
            None => Catalog::default(),
        };
        Ok(below.with(catalog))
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// Checks an `ipc-import`'s `columns`, `rows` rows of `schema`, from their numbers and has
    /// the backend plan them, once, for [`PendingPut::import`]. Refused where the description
    /// is malformed, then where the backend cannot import.
    pub fn check_import(
        &self,
        schema: arrow::datatypes::SchemaRef,
        rows: u64,
        columns: Vec<crate::backend::ExportedColumn>,
    ) -> Result<CheckedImport, StoreError> {
        CheckedImport::new(self.backend.as_ref(), schema, rows, columns)
    }

    /// The device that is a producer's GPU, named by its UUID or, failing that, its PCI bus
    /// id (the same GPU whatever either process's `CUDA_VISIBLE_DEVICES`); refused where the
    /// server holds no datasets on it.
    pub fn producer_device(&self, uuid: &str, pci_bus_id: &str) -> Result<u32, StoreError> {
        import::producer_device(&self.backend.devices(), uuid, pci_bus_id)
    }

    /// Whether the backend keeps the host arrays a put gives it (see
    /// [`crate::backend::Backend::keeps_decoded_arrays`]).
    pub fn keeps_decoded_arrays(&self) -> bool {
        self.backend.keeps_decoded_arrays()
    }

    /// `bytes` (a `DoPut` message body) copied into host memory the backend uploads from
    /// directly, where it has such memory free ([`Backend::pinned_copy`]).
    pub fn pinned_copy(&self, bytes: &[u8]) -> Option<arrow::buffer::Buffer> {
        self.backend.pinned_copy(bytes)
    }

    /// Host memory for a `DoPut` message body of `len` bytes to be received into, which the
    /// backend uploads from directly, where it has such memory free ([`Backend::body_block`]).
    pub fn body_block(&self, len: usize) -> Option<Box<dyn crate::backend::BodyBlock>> {
        self.backend.body_block(len)
    }

    /// Reserves `bytes` for a `DoPut` message being received (grown with
    /// [`Store::grow_message`] as its bytes arrive): bytes a client has sent but no dataset
    /// holds yet count against the budget like any other. They are charged to the device with
    /// the most free memory, or to the host tier where no device has room.
    pub fn reserve_message(&self, bytes: u64) -> Result<Reservation, StoreError> {
        self.tiers.reserve_message(bytes)
    }

    /// Grows `message` (from [`Store::reserve_message`]) by `bytes` as more of it arrives;
    /// where its device has no room, the whole message moves to the host tier.
    pub fn grow_message(&self, message: &mut Reservation, bytes: u64) -> Result<(), StoreError> {
        self.tiers.grow_message(message, bytes)
    }

    /// Starts a put by `owner`, placed by the store (see [`Store::begin_put_on`]).
    pub fn begin_put(
        &self,
        name: String,
        mode: PutMode,
        owner: &str,
    ) -> Result<PendingPut, StoreError> {
        self.begin_put_on(name, mode, owner, None)
    }

    /// Starts a put by `owner` on `device`, or placed by the store when `None`: on the device
    /// with the most free memory, moving to the next-freest one for each batch that no longer
    /// fits. `create` fails here already if the name is taken. The put is listed in
    /// [`Store::status`] until it commits or is dropped.
    pub fn begin_put_on(
        &self,
        name: String,
        mode: PutMode,
        owner: &str,
        device: Option<u32>,
    ) -> Result<PendingPut, StoreError> {
        self.puts.begin(name, mode, owner, device)
    }

    /// The dataset named `name`.
    pub fn get(&self, name: &str) -> Result<Arc<Dataset>, StoreError> {
        self.catalog.get(name)
    }

    /// Datasets whose names start with `prefix`, sorted by name.
    pub fn list(&self, prefix: &str) -> Vec<Arc<Dataset>> {
        self.catalog.list(prefix)
    }

    /// Datasets of the data directory found damaged at start, sorted by name.
    pub fn damaged(&self) -> Vec<(String, Damaged)> {
        self.catalog.damaged()
    }

    /// Removes `name` from the catalog. Its memory returns once running reads finish. Under
    /// `--data-dir` its files go too, once the disk catches up: see [`Store::drop_dataset`].
    pub fn remove(&self, name: &str) -> Result<Arc<Dataset>, StoreError> {
        self.catalog.remove(name)
    }

    /// [`Store::remove`], acknowledged as `--durability` says: under `sync`, once the
    /// dataset is gone from the disk too. A dataset found damaged at start is dropped too
    /// (its files with it).
    pub async fn drop_dataset(&self, name: &str) -> Result<Dropped, StoreError> {
        self.catalog.drop_dataset(name).await
    }

    /// Under `--data-dir`, waits until every change committed so far is on disk, and closes
    /// the directory: later changes stay in memory only. For a clean shutdown.
    pub async fn close(&self) {
        self.catalog.close().await;
    }

    /// Moves every partition of `name` onto `device`. Fails, changing nothing, when the device
    /// has no room or the dataset changed while it was being copied.
    pub async fn move_dataset(&self, name: &str, device: u32) -> Result<MoveSummary, StoreError> {
        self.mover.move_dataset(name, device).await
    }

    /// Copies every row of `name` onto `device` as a new dataset `copy`, which must not
    /// exist. The original is untouched; readers of `copy` see all of it or nothing.
    pub async fn copy_dataset(
        &self,
        name: &str,
        copy: &str,
        device: u32,
    ) -> Result<CopySummary, StoreError> {
        self.mover.copy_dataset(name, copy, device).await
    }

    /// Exports columns of a dataset for zero-copy use by other processes, under a new or
    /// renewed lease. Fails, granting nothing and keeping no replica, where the dataset cannot
    /// be exported.
    pub async fn export(&self, request: ExportRequest) -> Result<Export, StoreError> {
        self.exporter.export(request).await
    }

    /// A new set of shared-memory files for `owner`'s rows of `schema` (`shm-read`), each
    /// paid for as it is written; fails where `owner` holds `limits.max_files` sets already.
    pub fn shared_writer(
        &self,
        owner: &str,
        schema: &arrow::datatypes::Schema,
        options: arrow::ipc::writer::IpcWriteOptions,
        limits: &SharedLimits,
    ) -> Result<FileSetWriter, StoreError> {
        self.shared.writer(owner, schema, options, limits)
    }

    /// Grants `staged` (rows of `dataset`, in files read in this order) as `terms` say, under
    /// a lease and a one-time token that must be claimed within `limits.token_ttl`.
    pub fn grant_shared(
        &self,
        dataset: &Dataset,
        staged: Vec<StagedFile>,
        terms: ShareTerms,
        limits: &SharedLimits,
    ) -> Result<SharedGrant, StoreError> {
        self.shared.grant(dataset, staged, terms, limits)
    }

    /// The shared-memory file `token` opens for user `uid`, once.
    pub fn claim_shared(&self, token: &str, uid: Option<u32>) -> Result<ClaimedFile, StoreError> {
        self.shared.claim(token, uid)
    }

    /// Extends lease `id`, which `owner` must hold, to end `duration` from now (`None`: as
    /// long as it was last granted for).
    pub fn renew_lease(
        &self,
        id: &str,
        owner: &str,
        duration: Option<Duration>,
    ) -> Result<Lease, StoreError> {
        self.leases.extend(id, duration, |lease| {
            if lease.owner != owner {
                return Err(StoreError::LeaseNotYours {
                    lease: id.to_owned(),
                });
            }
            Ok(())
        })
    }

    /// Ends lease `id`, which `owner` must hold where given (`None`: an admin's release, or
    /// the server's own). Memory that only the lease held is freed.
    pub fn release(&self, id: &str, owner: Option<&str>) -> Result<Lease, StoreError> {
        self.leases.release_if(id, |lease| match owner {
            Some(owner) if lease.owner != owner => Err(StoreError::LeaseNotYours {
                lease: id.to_owned(),
            }),
            _ => Ok(()),
        })
    }

    /// Starts the task that ends expired leases, checking every `period`. It stops by itself
    /// when the store is dropped.
    pub fn spawn_lease_reaper(&self, period: Duration) -> tokio::task::JoinHandle<()> {
        lease::spawn_reaper(Arc::downgrade(&self.leases), period)
    }

    /// Waits until no background compaction is running or asked for. For tests and
    /// benchmarks, which look at partitions and copied bytes once the compactions their
    /// appends started are done; serving never needs to wait for one.
    pub async fn compactions_settled(&self) {
        self.background.settled().await;
    }

    /// A snapshot of what the store holds, for the `status` action and the metrics.
    pub fn status(&self) -> StoreStatus {
        status::status(
            self.backend.as_ref(),
            &self.tiers,
            &self.catalog,
            &self.leases,
            &self.in_flight,
            &self.stats,
        )
    }
}
