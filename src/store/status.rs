//! What the store holds, for the `status` action and the metrics.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use super::{PutProgress, Store};
use crate::backend::DeviceInfo;

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
    /// Compactions of batches into one partition (at commit, and background merges of
    /// appended partitions), and the time they took.
    pub concatenations: u64,
    /// Arrow bytes the compactions copied.
    pub concatenated_bytes: u64,
    pub concatenation_seconds: f64,
    /// Background merges of appended partitions, published (each also a concatenation).
    pub merges: u64,
    pub tiers: TierStatus,
    /// Under `--data-dir`: what the disk holds and owes.
    pub persistence: Option<PersistenceStatus>,
}

/// Persistence under `--data-dir`, for `status`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PersistenceStatus {
    pub data_dir: String,
    pub durability: super::Durability,
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
    pub damage: super::Damaged,
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

impl Store {
    pub fn status(&self) -> StoreStatus {
        let inner = &self.inner;
        let devices = inner
            .backend
            .devices()
            .into_iter()
            .enumerate()
            .map(|(index, info)| DeviceStatus {
                info,
                limit_bytes: inner.budget.limit(index as u32),
                used_bytes: inner.budget.used(index as u32),
            })
            .collect();
        let (mut datasets, mut bytes, mut data_bytes) = (0, 0, 0);
        let (mut device_bytes, mut host_bytes) = (0, 0);
        for entry in inner.catalog.iter() {
            let dataset = entry.value();
            let tiers = dataset.tier_bytes();
            datasets += 1;
            bytes += tiers.device + tiers.host + dataset.schema_charge().bytes();
            data_bytes += dataset.data_bytes();
            device_bytes += tiers.device;
            host_bytes += tiers.host;
        }
        let t = &inner.tiers;
        let seconds = |nanos: &std::sync::atomic::AtomicU64| {
            Duration::from_nanos(nanos.load(Ordering::Relaxed)).as_secs_f64()
        };
        let tiers = TierStatus {
            device_bytes,
            host_bytes,
            host_limit_bytes: t.host_limit(),
            host_used_bytes: t.host_used(),
            spills: t.spills.load(Ordering::Relaxed),
            spilled_bytes: t.spilled_bytes.load(Ordering::Relaxed),
            spill_seconds: seconds(&t.spill_nanos),
            restores: t.restores.load(Ordering::Relaxed),
            restored_bytes: t.restored_bytes.load(Ordering::Relaxed),
            restore_seconds: seconds(&t.restore_nanos),
            disk_bytes: t.disk_used(),
            loads: t.loads.load(Ordering::Relaxed),
            loaded_bytes: t.loaded_bytes.load(Ordering::Relaxed),
            load_seconds: seconds(&t.load_nanos),
            evictions: t.evictions.load(Ordering::Relaxed),
        };
        let mut leases = Vec::new();
        // By address, so that memory several leases hold counts once. Partitions, not
        // versions: an append's version shares its base's partitions, and a background merge
        // changes a version's partitions but not its number.
        let mut leased_only = std::collections::HashMap::new();
        let mut replicas = 0;
        for lease in inner.leases.list() {
            let dataset = &lease.dataset;
            let current = inner
                .catalog
                .get(dataset.name())
                .map(|entry| Arc::clone(entry.value()));
            let in_catalog = current
                .as_ref()
                .is_some_and(|current| current.version() == dataset.version());
            let catalog_holds: std::collections::HashSet<*const super::tier::Slot> = current
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
            replicas += replica_bytes;
            leases.push(LeaseStatus {
                id: lease.id,
                owner: lease.owner,
                dataset: dataset.name().to_owned(),
                version: dataset.version(),
                columns: lease.terms.columns,
                device: lease.terms.consumer,
                bytes: dataset.memory_bytes(),
                replica_bytes,
                expires_at: lease.expires_at,
                in_catalog,
            });
        }
        StoreStatus {
            backend: inner.backend.name(),
            devices,
            datasets,
            bytes,
            data_bytes,
            counters: inner.backend.counters(),
            peer_access: inner.backend.peer_access(),
            leases,
            leased_only_bytes: leased_only.values().sum::<u64>() + replicas,
            puts: inner.puts.list(),
            concatenations: inner.concatenations.load(Ordering::Relaxed),
            concatenated_bytes: inner.concatenated_bytes.load(Ordering::Relaxed),
            concatenation_seconds: Duration::from_nanos(
                inner.concatenation_nanos.load(Ordering::Relaxed),
            )
            .as_secs_f64(),
            merges: inner.merges.load(Ordering::Relaxed),
            tiers,
            persistence: inner.durable.get().map(|durable| {
                let counters = &durable.counters;
                PersistenceStatus {
                    data_dir: durable.root.display().to_string(),
                    durability: durable.durability,
                    pending: counters.pending.load(Ordering::Relaxed),
                    segments: counters.segments.load(Ordering::Relaxed),
                    written_bytes: counters.written_bytes.load(Ordering::Relaxed),
                    failures: counters.failures.load(Ordering::Relaxed),
                    damaged: self
                        .damaged()
                        .into_iter()
                        .map(|(name, damage)| DamagedStatus { name, damage })
                        .collect(),
                }
            }),
        }
    }
}
