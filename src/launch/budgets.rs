//! The budgets the server runs with: the open-file limit raised as far as the hard limit
//! allows with `--max-connections` kept under it, and one log line with every budget, as
//! chosen from the flags and the machine: what an operator checks first when memory or
//! connections run out.

use crate::config::ServeArgs;
use crate::server::ServeOptions;
use crate::store::Store;

/// File descriptors kept for everything but client connections: the listener, logs, the
/// driver's, the runtime's.
pub const RESERVED_FILES: u64 = 64;

/// Raises the open-file limit as far as the hard limit allows, and keeps `--max-connections`
/// under it: a connection limit above the file limit does not limit anything.
pub fn connection_budget(mut options: ServeOptions) -> ServeOptions {
    let files = match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(files) => files,
        Err(error) => {
            tracing::warn!(%error, "cannot read or raise the open-file limit");
            return options;
        }
    };
    let wanted = options.connections.max_connections as u64;
    if let Some(possible) = connections_within(wanted, files) {
        tracing::warn!(
            max_connections = wanted,
            open_file_limit = files,
            "--max-connections is above what the open-file limit allows; using {possible}"
        );
        options.connections.max_connections = usize::try_from(possible).unwrap_or(usize::MAX);
    }
    options
}

/// The connections `open_files` descriptors allow when `wanted` is more than that; `None`
/// when `wanted` fits.
pub fn connections_within(wanted: u64, open_files: u64) -> Option<u64> {
    let possible = open_files.saturating_sub(RESERVED_FILES).max(1);
    (wanted > possible).then_some(possible)
}

/// Logs the `budgets` line.
pub fn log_budgets(args: &ServeArgs, store: &Store, options: &ServeOptions) {
    let status = store.status();
    let memory_limits: Vec<String> = status
        .devices
        .iter()
        .map(|device| {
            device
                .limit_bytes
                .map_or("unlimited".to_owned(), |b| b.to_string())
        })
        .collect();
    tracing::info!(
        // Device by device, in the order puts and endpoints number them.
        memory_limit_bytes = %memory_limits.join(","),
        host_memory_limit_bytes = status.tiers.host_limit_bytes,
        max_message_bytes = options.flight.max_message_bytes,
        max_put_message_bytes = options.flight.max_put_message_bytes,
        max_request_bytes = options.flight.max_request_bytes,
        max_connections = options.connections.max_connections,
        max_streams_per_connection = options.max_streams_per_connection,
        data_dir = %args.data_dir.as_ref().map_or("none".into(), |dir| dir.display().to_string()),
        durability = if args.data_dir.is_some() {
            format!("{:?}", args.durability).to_lowercase()
        } else {
            "none (nothing is written to disk)".to_owned()
        },
        "budgets"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_stay_under_the_open_file_limit() {
        assert_eq!(connections_within(1000, 1 << 20), None);
        assert_eq!(connections_within(1000, 1024), Some(1024 - RESERVED_FILES));
        assert_eq!(connections_within(960, 1024), None);
        // A limit below the reserve still allows one connection.
        assert_eq!(connections_within(10, 16), Some(1));
    }
}
