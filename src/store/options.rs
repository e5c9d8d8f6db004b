//! What the configuration and clients choose: the store's settings, when commits are
//! acknowledged, and how a put treats an existing dataset.

use crate::backend::Backend;

/// How a put treats an existing dataset of the same name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PutMode {
    /// Fail with ALREADY_EXISTS if the name is taken.
    Create,
    /// Swap the dataset atomically; readers of the old one finish undisturbed.
    Replace,
    /// Add rows to the dataset (creating it if absent); the fields must be identical.
    Append,
}

/// Settings the store needs from the configuration.
#[derive(Debug, Clone, Default)]
pub struct StoreOptions {
    /// Bytes each device may hold; `None` leaves only the device's own capacity.
    pub memory_limit: Option<u64>,
    /// Bytes the host tier may hold; `None` for the default ([`default_host_memory_limit`]).
    pub host_memory_limit: Option<u64>,
    /// Where committed datasets are made durable (`--data-dir`); `None`: nowhere, nothing
    /// touches the disk. Only `Store::open` reads it.
    pub data_dir: Option<std::path::PathBuf>,
    /// When a commit is acknowledged under `data_dir`.
    pub durability: Durability,
}

/// The host tier's budget without `--host-memory-limit`: half the memory this process may use
/// (the machine's, or its cgroup's limit where lower) for a backend of device memory, and none
/// for the host backend, whose datasets are in host memory already.
pub fn default_host_memory_limit(backend: &dyn Backend) -> u64 {
    if backend.holds_host_memory() {
        0
    } else {
        crate::backend::host_memory_bytes().map_or(0, |bytes| bytes / 2)
    }
}

/// When a commit is acknowledged under `--data-dir`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Durability {
    /// Once it is on disk (fsync'd): an acknowledged put survives a crash.
    #[default]
    Sync,
    /// At once; the disk catches up in commit order. A crash may lose the latest commits,
    /// never tear one.
    Async,
}
