//! The store's state as Prometheus metrics, read from [`Store::status`] at each scrape, so a
//! figure can never drift from what `status` reports.
//!
//! Each metric is one row of a table (name, help, unit, how to read it from the status), in
//! the order a scrape lists them; a new figure in `status` is a new row. Then come the
//! per-device budgets, labelled by device, and the backend's own counters under names of
//! their own.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Unit;

use crate::store::{DeviceStatus, Store, StoreStatus};

/// The store's state, read at each scrape.
#[derive(Debug)]
pub(super) struct StoreCollector {
    pub(super) store: Store,
}

/// A figure read from the status, and how it is exposed.
enum Reading {
    /// A level that goes up and down (exposed as a signed integer, capped at `i64::MAX`).
    Gauge(u64),
    /// A total that only grows, counted in whole events or bytes.
    Count(u64),
    /// A total that only grows, written as a float (seconds, and the tiers' counters, which
    /// have always been exposed so).
    Total(f64),
}

/// One metric of the store's state.
struct Row {
    name: &'static str,
    help: &'static str,
    unit: Option<Unit>,
    read: fn(&StoreStatus) -> Reading,
}

const BYTES: Option<Unit> = Some(Unit::Bytes);
const SECONDS: Option<Unit> = Some(Unit::Seconds);

/// Every metric of the store's state that has no labels, in the order a scrape lists them.
const ROWS: &[Row] = &[
    Row {
        name: "datasets",
        help: "Datasets in the catalog",
        unit: None,
        read: |s| Reading::Gauge(s.datasets as u64),
    },
    Row {
        name: "dataset_memory",
        help: "Backend memory held by committed datasets",
        unit: BYTES,
        read: |s| Reading::Gauge(s.bytes),
    },
    Row {
        name: "dataset_data",
        help: "Arrow bytes in committed datasets",
        unit: BYTES,
        read: |s| Reading::Gauge(s.data_bytes),
    },
    Row {
        name: "leases",
        help: "Live ipc-export leases",
        unit: None,
        read: |s| Reading::Gauge(s.leases.len() as u64),
    },
    Row {
        name: "leased_only_memory",
        help: "Backend memory held only by leases (datasets dropped or replaced while exported)",
        unit: BYTES,
        read: |s| Reading::Gauge(s.leased_only_bytes),
    },
    Row {
        name: "puts_in_flight",
        help: "DoPut calls being received",
        unit: None,
        read: |s| Reading::Gauge(s.puts.len() as u64),
    },
    Row {
        name: "puts_in_flight_received",
        help: "Arrow bytes received so far by the puts in flight",
        unit: BYTES,
        read: |s| Reading::Gauge(s.puts.iter().map(|p| p.bytes()).sum()),
    },
    Row {
        name: "concatenations",
        help: "Compactions of a put's batches at commit, and background merges of appended \
               partitions",
        unit: None,
        read: |s| Reading::Count(s.concatenations),
    },
    Row {
        name: "concatenated",
        help: "Arrow bytes copied by compactions",
        unit: BYTES,
        read: |s| Reading::Count(s.concatenated_bytes),
    },
    Row {
        name: "concatenation",
        help: "Time spent in compactions",
        unit: SECONDS,
        read: |s| Reading::Total(s.concatenation_seconds),
    },
    Row {
        name: "merges",
        help: "Background merges of appended partitions with their neighbours",
        unit: None,
        read: |s| Reading::Count(s.merges),
    },
    Row {
        name: "tier_device",
        help: "Bytes committed datasets hold on devices",
        unit: BYTES,
        read: |s| Reading::Gauge(s.tiers.device_bytes),
    },
    Row {
        name: "tier_host",
        help: "Bytes committed datasets hold spilled to host memory",
        unit: BYTES,
        read: |s| Reading::Gauge(s.tiers.host_bytes),
    },
    Row {
        name: "tier_disk",
        help: "Bytes of datasets only in the data directory's files, not loaded yet",
        unit: BYTES,
        read: |s| Reading::Gauge(s.tiers.disk_bytes),
    },
    Row {
        name: "host_tier_used",
        help: "Bytes the host tier holds: spilled partitions and puts' messages paid for there",
        unit: BYTES,
        read: |s| Reading::Gauge(s.tiers.host_used_bytes),
    },
    Row {
        name: "host_tier_limit",
        help: "The host tier's budget (--host-memory-limit; 0: nothing spills)",
        unit: BYTES,
        read: |s| Reading::Gauge(s.tiers.host_limit_bytes),
    },
    Row {
        name: "spills",
        help: "Partitions spilled to host memory",
        unit: None,
        read: |s| Reading::Total(s.tiers.spills as f64),
    },
    Row {
        name: "spilled",
        help: "Bytes spilled to host memory",
        unit: BYTES,
        read: |s| Reading::Total(s.tiers.spilled_bytes as f64),
    },
    Row {
        name: "spill",
        help: "Time spent spilling",
        unit: SECONDS,
        read: |s| Reading::Total(s.tiers.spill_seconds),
    },
    Row {
        name: "restores",
        help: "Spilled partitions brought back onto their devices",
        unit: None,
        read: |s| Reading::Total(s.tiers.restores as f64),
    },
    Row {
        name: "restored",
        help: "Bytes brought back onto devices",
        unit: BYTES,
        read: |s| Reading::Total(s.tiers.restored_bytes as f64),
    },
    Row {
        name: "restore",
        help: "Time spent restoring",
        unit: SECONDS,
        read: |s| Reading::Total(s.tiers.restore_seconds),
    },
    Row {
        name: "loads",
        help: "Partitions loaded from the data directory",
        unit: None,
        read: |s| Reading::Total(s.tiers.loads as f64),
    },
    Row {
        name: "loaded",
        help: "Bytes of files loaded from the data directory",
        unit: BYTES,
        read: |s| Reading::Total(s.tiers.loaded_bytes as f64),
    },
    Row {
        name: "load",
        help: "Time spent loading from the data directory",
        unit: SECONDS,
        read: |s| Reading::Total(s.tiers.load_seconds),
    },
    Row {
        name: "evictions",
        help: "Partitions dropped back to the data directory's files to free memory",
        unit: None,
        read: |s| Reading::Total(s.tiers.evictions as f64),
    },
];

/// A gauge per device, labelled with its ordinal and name; a device without a figure (no
/// limit) has no sample.
struct DeviceRow {
    name: &'static str,
    help: &'static str,
    read: fn(&DeviceStatus) -> Option<u64>,
}

const DEVICE_ROWS: &[DeviceRow] = &[
    DeviceRow {
        name: "memory_used",
        help: "Bytes reserved on the device: datasets and puts in flight",
        read: |device| Some(device.used_bytes),
    },
    DeviceRow {
        name: "memory_limit",
        help: "The device's budget (--memory-limit, else its capacity)",
        read: |device| device.limit_bytes,
    },
];

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeviceLabels {
    device: String,
    name: String,
}

impl Collector for StoreCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let status = self.store.status();
        for row in ROWS {
            let unit = row.unit.as_ref();
            match (row.read)(&status) {
                Reading::Gauge(value) => {
                    let gauge = ConstGauge::new(clamp(value));
                    let metric =
                        encoder.encode_descriptor(row.name, row.help, unit, gauge.metric_type())?;
                    gauge.encode(metric)?;
                }
                Reading::Count(value) => encode_counter(&mut encoder, row, value)?,
                Reading::Total(value) => encode_counter(&mut encoder, row, value)?,
            }
        }
        for row in DEVICE_ROWS {
            let mut family = encoder.encode_descriptor(
                row.name,
                row.help,
                Some(&Unit::Bytes),
                MetricType::Gauge,
            )?;
            for device in &status.devices {
                let Some(bytes) = (row.read)(device) else {
                    continue;
                };
                let labels = DeviceLabels {
                    device: device.info.ordinal.to_string(),
                    name: device.info.name.clone(),
                };
                ConstGauge::new(clamp(bytes)).encode(family.encode_family(&labels)?)?;
            }
        }
        // The backend's own counters (the CUDA backend's pinned staging pool, transfers,
        // kernel launches), each as a gauge under its own name.
        for (key, value) in &status.counters {
            let Some(number) = value.as_f64() else {
                continue;
            };
            ConstGauge::new(number).encode(encoder.encode_descriptor(
                &backend_metric_name(key),
                "A counter of the backend, as `status` reports it under \"counters\"",
                None,
                MetricType::Gauge,
            )?)?;
        }
        Ok(())
    }
}

fn encode_counter<N>(
    encoder: &mut DescriptorEncoder,
    row: &Row,
    value: N,
) -> Result<(), std::fmt::Error>
where
    ConstCounter<N>: EncodeMetric,
{
    let counter = ConstCounter::new(value);
    let metric =
        encoder.encode_descriptor(row.name, row.help, row.unit.as_ref(), counter.metric_type())?;
    counter.encode(metric)
}

/// `backend_` and the counter's key, with every character a metric name cannot hold made `_`.
fn backend_metric_name(key: &str) -> String {
    let sanitized = key
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' });
    "backend_".chars().chain(sanitized).collect()
}

fn clamp(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_counters_are_named_with_what_a_metric_name_may_hold() {
        assert_eq!(
            backend_metric_name("staging.pool-bytes"),
            "backend_staging_pool_bytes"
        );
        assert_eq!(backend_metric_name("h2d_copies"), "backend_h2d_copies");
    }

    #[test]
    fn gauges_beyond_i64_are_capped() {
        assert_eq!(clamp(u64::MAX), i64::MAX);
        assert_eq!(clamp(42), 42);
    }

    #[test]
    fn every_row_has_a_name_of_its_own() {
        let mut names: Vec<&str> = ROWS.iter().map(|row| row.name).collect();
        names.extend(DEVICE_ROWS.iter().map(|row| row.name));
        let count = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), count);
    }
}
