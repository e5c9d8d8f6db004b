//! What the store holds, for the `status` action and the metrics.

use std::sync::Arc;
use std::time::SystemTime;

use super::catalog::{Catalog, Damaged};
use super::lease::Leases;
use super::options::Durability;
use super::progress::{InFlight, PutProgress};
use super::slot::Slot;
use super::stats::Stats;
use super::tier::Tiers;
use crate::backend::{Backend, DeviceInfo};

/// A snapshot of what the store holds, for the `status` action.
#[derive(Debug, Clone)]
pub struct StoreStatus {
    pub backend: &'static str,
    pub devices: Vec<DeviceStatus>,
    pub datasets: usize,
    /// Backend memory held by committed datasets.
    pub bytes: u64,
    /// Arrow bytes in committed datasets.
    pub data_bytes: u64,
    pub counters: serde_json::Map<String, serde_json::Value>,
    /// `peer_access[a][b]`: whether device `a` can access device `b`'s memory directly.
    pub peer_access: Vec<Vec<bool>>,
    pub leases: Vec<LeaseStatus>,
    /// Backend memory held only by leases: datasets dropped or replaced while exported, and
    /// replicas made for consumers on other devices.
    pub leased_only_bytes: u64,
    /// Puts being received, oldest first.
    pub puts: Vec<Arc<PutProgress>>,
    /// Compactions of batches into one partition (at commit, and background compactions of
    /// appended partitions), and the time they took.
    pub concatenations: u64,
    /// Arrow bytes the compactions copied.
    pub concatenated_bytes: u64,
    pub concatenation_seconds: f64,
    /// Background compactions of appended partitions, published (each also counted in
    /// `concatenations`). Both keep the names `status` and the metrics have always shown.
    pub merges: u64,
    pub tiers: TierStatus,
    /// Under `--data-dir`: what the disk holds and owes.
    pub persistence: Option<PersistenceStatus>,
}

/// Persistence under `--data-dir`, for `status`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PersistenceStatus {
    pub data_dir: String,
    pub durability: Durability,
    /// Changes committed in memory and not yet on disk.
    pub pending: u64,
    /// Segment files written, and their bytes.
    pub segments: u64,
    pub written_bytes: u64,
    /// Changes the disk refused (each logged).
    pub failures: u64,
    /// Datasets found damaged at start, not served until restored, dropped or replaced.
    pub damaged: Vec<DamagedStatus>,
}

/// A dataset the data directory holds damaged, for `status`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DamagedStatus {
    pub name: String,
    #[serde(flatten)]
    pub damage: Damaged,
}

/// The memory tiers, for `status` and the metrics.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct TierStatus {
    /// Bytes committed datasets hold on devices.
    pub device_bytes: u64,
    /// Bytes committed datasets hold spilled to host memory.
    pub host_bytes: u64,
    /// The host tier's budget (`--host-memory-limit`; 0: nothing spills) and what it holds,
    /// puts' messages paid for there included.
    pub host_limit_bytes: u64,
    pub host_used_bytes: u64,
    /// Partitions spilled to host memory, their bytes there, and the time spilling took.
    pub spills: u64,
    pub spilled_bytes: u64,
    pub spill_seconds: f64,
    /// Partitions brought back onto their devices, their bytes there, and the time it took.
    pub restores: u64,
    pub restored_bytes: u64,
    pub restore_seconds: f64,
    /// Bytes of datasets only in the data directory's files (not loaded since the start).
    pub disk_bytes: u64,
    /// Partitions loaded from the data directory, the bytes of their files, and the time
    /// loading took.
    pub loads: u64,
    pub loaded_bytes: u64,
    pub load_seconds: f64,
    /// Partitions loaded from the data directory and dropped back to it (not copied) when
    /// memory was needed.
    pub evictions: u64,
}

/// A live lease, for `status`.
#[derive(Debug, Clone)]
pub struct LeaseStatus {
    pub id: String,
    /// The principal that was granted the lease.
    pub owner: String,
    pub dataset: String,
    pub version: u64,
    pub columns: Vec<String>,
    /// The device the consumer said it computes on.
    pub device: Option<u32>,
    /// Backend memory of the leased dataset.
    pub bytes: u64,
    /// Backend memory of the replicas made for this lease alone.
    pub replica_bytes: u64,
    /// Bytes of the shared-memory file of a `shm-read` lease (0 for an export's).
    pub staged_bytes: u64,
    pub expires_at: SystemTime,
    /// Whether the leased version is still the one in the catalog.
    pub in_catalog: bool,
}

/// One device's memory as the store accounts it.
#[derive(Debug, Clone)]
pub struct DeviceStatus {
    pub info: DeviceInfo,
    /// The budget: `--memory-limit`, else the device's capacity.
    pub limit_bytes: Option<u64>,
    /// Bytes reserved: committed datasets and puts in flight.
    pub used_bytes: u64,
}

/// What the components hold and did, for `status`.
pub(crate) fn status(
    backend: &dyn Backend,
    tiers: &Tiers,
    catalog: &Catalog,
    leases: &Leases,
    in_flight: &InFlight,
    stats: &Stats,
) -> StoreStatus {
    {
        let budget = tiers.budget();
        let devices = backend
            .devices()
            .into_iter()
            .enumerate()
            .map(|(index, info)| DeviceStatus {
                info,
                limit_bytes: budget.limit(index as u32),
                used_bytes: budget.used(index as u32),
            })
            .collect();
        let (mut datasets, mut bytes, mut data_bytes) = (0, 0, 0);
        let (mut device_bytes, mut host_bytes) = (0, 0);
        for dataset in catalog.all() {
            let tiers = dataset.tier_bytes();
            datasets += 1;
            bytes += tiers.device + tiers.host + dataset.schema_charge().bytes();
            data_bytes += dataset.data_bytes();
            device_bytes += tiers.device;
            host_bytes += tiers.host;
        }
        let tier_status = TierStatus {
            device_bytes,
            host_bytes,
            host_limit_bytes: tiers.host_limit(),
            host_used_bytes: tiers.host_used(),
            spills: Stats::get(&stats.spills),
            spilled_bytes: Stats::get(&stats.spilled_bytes),
            spill_seconds: Stats::seconds(&stats.spill_nanos),
            restores: Stats::get(&stats.restores),
            restored_bytes: Stats::get(&stats.restored_bytes),
            restore_seconds: Stats::seconds(&stats.restore_nanos),
            disk_bytes: tiers.disk_used(),
            loads: Stats::get(&stats.loads),
            loaded_bytes: Stats::get(&stats.loaded_bytes),
            load_seconds: Stats::seconds(&stats.load_nanos),
            evictions: Stats::get(&stats.evictions),
        };
        let mut lease_status = Vec::new();
        // By address, so that memory several leases hold counts once. Partitions, not
        // versions: an append's version shares its base's partitions, and a background compaction
        // changes a version's partitions but not its number.
        let mut leased_only = std::collections::HashMap::new();
        let mut replicas = 0;
        for lease in leases.list() {
            let dataset = &lease.dataset;
            let current = catalog.get(dataset.name()).ok();
            let in_catalog = current
                .as_ref()
                .is_some_and(|current| current.version() == dataset.version());
            let catalog_holds: std::collections::HashSet<*const Slot> = current
                .iter()
                .flat_map(|current| current.partitions())
                .map(|partition| Arc::as_ptr(&partition.slot))
                .collect();
            for partition in dataset.partitions() {
                let slot = Arc::as_ptr(&partition.slot);
                if !catalog_holds.contains(&slot) {
                    leased_only.insert(slot as usize, partition.memory_bytes());
                }
            }
            let schema_charge = dataset.schema_charge();
            if !current.is_some_and(|current| Arc::ptr_eq(current.schema_charge(), schema_charge)) {
                leased_only.insert(Arc::as_ptr(schema_charge) as usize, schema_charge.bytes());
            }
            let replica_bytes = lease.terms.replica_bytes();
            let staged_bytes = lease.terms.staged_bytes();
            replicas += replica_bytes + staged_bytes;
            lease_status.push(LeaseStatus {
                id: lease.id,
                owner: lease.owner,
                dataset: dataset.name().to_owned(),
                version: dataset.version(),
                columns: lease.terms.columns,
                device: lease.terms.consumer,
                bytes: dataset.memory_bytes(),
                replica_bytes,
                staged_bytes,
                expires_at: lease.expires_at,
                in_catalog,
            });
        }
        StoreStatus {
            backend: backend.name(),
            devices,
            datasets,
            bytes,
            data_bytes,
            counters: backend.counters(),
            peer_access: backend.peer_access(),
            leases: lease_status,
            leased_only_bytes: leased_only.values().sum::<u64>() + replicas,
            puts: in_flight.list(),
            concatenations: Stats::get(&stats.compactions),
            concatenated_bytes: Stats::get(&stats.compacted_bytes),
            concatenation_seconds: Stats::seconds(&stats.compaction_nanos),
            merges: Stats::get(&stats.background_compactions),
            tiers: tier_status,
            persistence: catalog.durable().map(|durable| PersistenceStatus {
                data_dir: durable.root.display().to_string(),
                durability: durable.durability,
                pending: Stats::get(&stats.pending_writes),
                segments: Stats::get(&stats.segments_written),
                written_bytes: Stats::get(&stats.written_bytes),
                failures: Stats::get(&stats.write_failures),
                damaged: catalog
                    .damaged()
                    .into_iter()
                    .map(|(name, damage)| DamagedStatus { name, damage })
                    .collect(),
            }),
        }
    }
}
