//! The checks that turn a configuration that cannot be what the operator meant into a refusal
//! to start, naming the flag and why, or a warning: the flags against each other
//! ([`ServeArgs::validate`]), the memory budgets against the machine
//! ([`ServeArgs::check_capacity`]), the token file's entries, and side listeners other hosts
//! may reach. All run before anything listens.

use std::net::SocketAddr;

use bytesize::ByteSize;

use super::ServeArgs;
use crate::auth::Loaded;
use crate::backend::{BackendChoice, DeviceInfo, GpuSelection};
use crate::server::ListenAddr;
use crate::store::Durability;

/// The smallest `--memory-limit` (and non-zero `--host-memory-limit`) the server starts with.
/// Below it no useful dataset fits (a put is refused once one schema message and a batch's
/// buffers are charged), so such a value is a unit left out (`--memory-limit 8` for 8GiB), not
/// a budget.
pub const MIN_MEMORY_LIMIT: u64 = 1 << 20;

/// A configuration the server refuses to start with: the message names the flag and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

impl ServeArgs {
    /// Checks the flags against each other, before anything is read or started. What cannot
    /// be what the operator meant is an error; the server then does not start.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.check_floors()?;
        self.check_pinned_host_memory()?;
        if self.durability == Durability::Async && self.data_dir.is_none() {
            return Err(ConfigError(
                "--durability async applies to --data-dir, which is not given: without a data \
                 directory nothing is written to disk, so there is nothing to acknowledge before \
                 it is. Give --data-dir DIR, or leave --durability out"
                    .to_owned(),
            ));
        }
        if self.backend == BackendChoice::Host
            && let GpuSelection::Ordinals(ordinals) = self.gpus()
        {
            let flag = if self.device.is_some() {
                "--device"
            } else {
                "--devices"
            };
            let ordinals: Vec<String> = ordinals.iter().map(ToString::to_string).collect();
            return Err(ConfigError(format!(
                "{flag} {} selects GPUs, but --backend host keeps datasets in host memory, which \
                 has no GPUs to select: this server's devices would be 0..{} (host memory). Use \
                 --backend cuda (or auto) to serve from GPUs, or leave {flag} out",
                ordinals.join(","),
                self.host_devices - 1
            )));
        }
        check_advertised(&self.advertise_uri)?;
        let tls = self.tls_cert.is_some();
        for spec in &self.listen {
            match ListenAddr::tls_scheme(spec) {
                Some(true) if !tls => {
                    return Err(ConfigError(format!(
                        "--listen {spec}: grpc+tls:// serves TLS, which needs --tls-cert and \
                         --tls-key; give them, or listen with grpc:// (plain text)"
                    )));
                }
                Some(false) if tls => {
                    return Err(ConfigError(format!(
                        "--listen {spec} says plain text, but with --tls-cert every TCP listener \
                         serves TLS; write grpc+tls://{} (or HOST:PORT)",
                        spec.split_once("://")
                            .map_or(spec.as_str(), |(_, rest)| rest)
                    )));
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// `--memory-limit` and a non-zero `--host-memory-limit` must be at least
    /// [`MIN_MEMORY_LIMIT`].
    fn check_floors(&self) -> Result<(), ConfigError> {
        let limits = [
            ("--memory-limit", self.memory_limit, false),
            ("--host-memory-limit", self.host_memory_limit, true),
        ];
        for (flag, limit, zero_allowed) in limits {
            let Some(limit) = limit.map(|limit| limit.as_u64()) else {
                continue;
            };
            if limit < MIN_MEMORY_LIMIT && !(zero_allowed && limit == 0) {
                let zero = if zero_allowed { " (or 0 for none)" } else { "" };
                return Err(ConfigError(format!(
                    "{flag} {limit} B is below the least this server runs with, 1 MiB \
                     ({MIN_MEMORY_LIMIT} bytes): no dataset would fit. A size without a unit \
                     is bytes; write it with one, such as 8GiB or 512MiB{zero}"
                )));
            }
        }
        Ok(())
    }

    /// `--pinned-host-memory` is for the CUDA backend's transfers: the host backend has none.
    fn check_pinned_host_memory(&self) -> Result<(), ConfigError> {
        let pinned = self.pinned_host_memory.map_or(0, |bytes| bytes.as_u64());
        if pinned > 0 && self.backend == BackendChoice::Host {
            return Err(ConfigError(
                "--pinned-host-memory pins host memory for the CUDA backend's transfers \
                 between host memory and the GPUs, and --backend host has none: its datasets \
                 are in host memory already. Leave --pinned-host-memory out, or serve with \
                 --backend cuda (or auto)"
                    .to_owned(),
            ));
        }
        Ok(())
    }

    /// Checks the memory budgets against what there is: each device's capacity (`devices`, as
    /// the backend reports them) and the memory this process may use (`host_memory`: the
    /// machine's, or its cgroup's limit where lower). A budget above the memory it divides
    /// is refused: the store would cap it at the capacity without a word, so the operator's
    /// number would mean nothing, and on the host backend the kernel's OOM killer, not the
    /// budget, would stop the puts that exceed the memory (and every dataset with them).
    /// Returns warnings for the log.
    pub fn check_capacity(
        &self,
        devices: &[DeviceInfo],
        host_memory: Option<u64>,
        holds_host_memory: bool,
    ) -> Result<Vec<String>, ConfigError> {
        let mut warnings = Vec::new();
        let limit = self.memory_limit.map(|limit| limit.as_u64());
        if let Some(limit) = limit {
            for (index, device) in devices.iter().enumerate() {
                if let Some(total) = device.total_bytes
                    && limit > total
                {
                    let shared = if devices.len() > 1 && holds_host_memory {
                        format!(" (the host's memory shared by {} devices)", devices.len())
                    } else {
                        String::new()
                    };
                    return Err(ConfigError(format!(
                        "--memory-limit {limit} bytes ({}) is more than device {index} ({}) \
                         has: {total} bytes ({}){shared}. The budget cannot be more than the \
                         memory; give at most {total}, or leave --memory-limit out for the \
                         default ({})",
                        ByteSize::b(limit).display().iec(),
                        device.name,
                        ByteSize::b(total).display().iec(),
                        device
                            .default_limit_bytes
                            .map_or("the device's capacity".to_owned(), |bytes| {
                                format!("{bytes} bytes")
                            }),
                    )));
                }
            }
        }
        let pinned = self.pinned_host_memory.map_or(0, |bytes| bytes.as_u64());
        if let Some(memory) = host_memory
            && pinned > memory / 2
        {
            return Err(ConfigError(format!(
                "--pinned-host-memory {pinned} bytes ({}) is more than half the memory this \
                 process may use ({memory} bytes, {}): pinned memory cannot be swapped out or \
                 used by anything else, and the server needs the rest. Give at most {}",
                ByteSize::b(pinned).display().iec(),
                ByteSize::b(memory).display().iec(),
                memory / 2,
            )));
        }
        let host_limit = self.host_memory_limit.map(|limit| limit.as_u64());
        if let (Some(host_limit), Some(memory)) = (host_limit, host_memory) {
            if host_limit > memory {
                return Err(ConfigError(format!(
                    "--host-memory-limit {host_limit} bytes ({}) is more than the memory this \
                     process may use: {memory} bytes ({}; the machine's memory, or the \
                     container's memory limit where lower). Give at most {memory}, or leave it \
                     out for the default",
                    ByteSize::b(host_limit).display().iec(),
                    ByteSize::b(memory).display().iec(),
                )));
            }
            // On the host backend both tiers are the same memory.
            if holds_host_memory && host_limit > 0 {
                let device_budgets: u64 = devices
                    .iter()
                    .map(|device| limit.or(device.default_limit_bytes).unwrap_or(0))
                    .sum();
                let together = device_budgets.saturating_add(host_limit);
                if together > memory {
                    warnings.push(format!(
                        "--memory-limit (all devices: {device_budgets} bytes) and \
                         --host-memory-limit ({host_limit} bytes) are both host memory on the \
                         host backend, and together ({together} bytes) more than this process \
                         may use ({memory} bytes): the operating system may refuse memory \
                         before the budgets do"
                    ));
                }
            }
        }
        Ok(warnings)
    }
}

/// A token file with nobody in it lets no call through: a server started with one serves no
/// one (and on a network address looks protected while useless). Refused unless
/// `--allow-unauthenticated` says the operator means it (to fill the file in and reload it);
/// then a warning.
pub fn check_token_file(
    loaded: Loaded,
    path: &std::path::Path,
    allow_unauthenticated: bool,
) -> Result<Option<String>, ConfigError> {
    if loaded.tokens > 0 || loaded.users > 0 {
        return Ok(None);
    }
    let problem = format!(
        "the token file {} has no tokens and no users: no principal could ever call",
        path.display()
    );
    if allow_unauthenticated {
        return Ok(Some(format!(
            "{problem} until entries are added and the file is reloaded (SIGHUP)"
        )));
    }
    Err(ConfigError(format!(
        "{problem}. Add one (`gpu-flight new-token --principal NAME --role write >> {}`), or \
         leave --auth-tokens out on a loopback address",
        path.display()
    )))
}

/// The warning for a plain-HTTP or plain-gRPC side listener (`--metrics-listen`,
/// `--health-listen`) bound where other hosts can reach it: it has no authentication and no
/// TLS. `None` on loopback.
pub fn exposed_listener_warning(flag: &str, address: SocketAddr) -> Option<String> {
    if address.ip().is_loopback() {
        return None;
    }
    let what = if flag == "--metrics-listen" {
        "metrics (counts and sizes)"
    } else {
        "the health service (whether the server is serving)"
    };
    Some(format!(
        "{flag} {address} serves {what} without authentication or TLS on an address other hosts \
         may reach: make sure a firewall or network policy limits who can connect"
    ))
}

/// Most `--advertise-uri` values, and the longest: every endpoint repeats them all.
const MAX_ADVERTISED: usize = 8;
const MAX_ADVERTISED_BYTES: usize = 256;

/// `--advertise-uri`: Flight locations a client can connect to.
fn check_advertised(uris: &[String]) -> Result<(), ConfigError> {
    if uris.len() > MAX_ADVERTISED {
        return Err(ConfigError(format!(
            "--advertise-uri is given {} times; at most {MAX_ADVERTISED} (every endpoint lists them \
             all)",
            uris.len()
        )));
    }
    for uri in uris {
        let known = ["grpc://", "grpc+tcp://", "grpc+tls://", "grpc+unix://"]
            .iter()
            .any(|scheme| uri.starts_with(scheme) && uri.len() > scheme.len());
        if !known || uri.len() > MAX_ADVERTISED_BYTES || uri.chars().any(char::is_control) {
            return Err(ConfigError(format!(
                "--advertise-uri {uri:?} is not a Flight location clients can connect to: \
                 grpc://HOST:PORT, grpc+tls://HOST:PORT or grpc+unix:///path, at most \
                 {MAX_ADVERTISED_BYTES} bytes"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::config::Cli;

    fn serve(flags: &[&str]) -> ServeArgs {
        Cli::try_parse_from(["gpu-flight", "serve"].iter().chain(flags))
            .expect("flags parse")
            .into_serve_args()
            .expect("serve")
    }

    fn refusal(flags: &[&str]) -> String {
        serve(flags).validate().expect_err("refused").0
    }

    #[test]
    fn advertised_uris_are_flight_locations() {
        let args = serve(&[
            "--advertise-uri",
            "grpc://node-3:8815",
            "--advertise-uri",
            "grpc+unix:///run/gpu-flight.sock",
        ]);
        args.validate().expect("valid");
        assert_eq!(args.flight_options().advertise.len(), 2);
        for bad in ["node-3:8815", "http://node-3", "grpc://", "grpc://a\nb"] {
            assert!(
                refusal(&["--advertise-uri", bad]).contains("not a Flight location"),
                "{bad:?}"
            );
        }
        let many: Vec<String> = (0..9)
            .map(|i| format!("--advertise-uri=grpc://n{i}:1"))
            .collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        assert!(refusal(&many).contains("at most 8"));
    }

    #[test]
    fn limits_below_the_floor_are_refused_and_zero_host_memory_is_not() {
        assert!(refusal(&["--memory-limit", "1048575"]).contains("--memory-limit"));
        assert!(refusal(&["--host-memory-limit", "1KiB"]).contains("--host-memory-limit"));
        for fine in [
            &["--memory-limit", "1MiB"][..],
            &["--host-memory-limit", "0"],
            &["--memory-limit", "3MB", "--host-memory-limit", "0"],
        ] {
            assert_eq!(serve(fine).validate(), Ok(()), "{fine:?}");
        }
        let error = refusal(&["--memory-limit", "0"]);
        assert!(!error.contains("0 for none"), "{error}");
    }

    #[test]
    fn async_durability_needs_a_data_dir() {
        assert!(refusal(&["--durability", "async"]).contains("--data-dir"));
        let with_dir = serve(&["--durability", "async", "--data-dir", "/tmp/d"]);
        assert_eq!(with_dir.validate(), Ok(()));
        assert_eq!(serve(&["--durability", "sync"]).validate(), Ok(()));
    }

    #[test]
    fn the_host_backend_selects_no_gpus() {
        let error = refusal(&["--backend", "host", "--devices", "0,1"]);
        assert!(error.contains("--devices 0,1"), "{error}");
        let error = refusal(&["--backend", "host", "--host-devices", "3", "--device", "2"]);
        assert!(
            error.contains("--device 2") && error.contains("0..2"),
            "{error}"
        );
        assert_eq!(
            serve(&["--backend", "host", "--devices", "all"]).validate(),
            Ok(())
        );
        assert_eq!(
            serve(&["--backend", "cuda", "--device", "1"]).validate(),
            Ok(())
        );
    }

    #[test]
    fn listen_schemes_agree_with_the_tls_flags() {
        let tls = ["--tls-cert", "c.pem", "--tls-key", "k.pem"];
        let with_tls = |listen: &str| {
            let mut flags = vec!["--listen", listen];
            flags.extend(tls);
            serve(&flags).validate()
        };
        assert_eq!(with_tls("grpc+tls://0.0.0.0:8815"), Ok(()));
        assert_eq!(with_tls("0.0.0.0:8815"), Ok(()));
        let error = with_tls("grpc://0.0.0.0:8815")
            .expect_err("plain text with TLS")
            .0;
        assert!(error.contains("grpc+tls://0.0.0.0:8815"), "{error}");
        assert!(with_tls("grpc+tcp://0.0.0.0:8815").is_err());
        assert!(refusal(&["--listen", "grpc+tls://127.0.0.1:0"]).contains("--tls-cert"));
        assert_eq!(
            serve(&["--listen", "grpc://127.0.0.1:0"]).validate(),
            Ok(())
        );
    }

    fn device(total: u64) -> DeviceInfo {
        DeviceInfo {
            ordinal: 0,
            name: "test memory".to_owned(),
            total_bytes: Some(total),
            default_limit_bytes: Some(total / 4 * 3),
            uuid: None,
            pci_bus_id: None,
            numa_node: None,
        }
    }

    #[test]
    fn budgets_above_the_memory_are_refused_naming_both_numbers() {
        const GIB: u64 = 1 << 30;
        let devices = [device(24 * GIB)];
        let error = serve(&["--memory-limit", "1TiB"])
            .check_capacity(&devices, Some(24 * GIB), true)
            .expect_err("more than there is")
            .0;
        assert!(
            error.contains("--memory-limit")
                && error.contains(&(1u64 << 40).to_string())
                && error.contains(&(24 * GIB).to_string()),
            "{error}"
        );
        // A device's own capacity decides, whatever the host has.
        let error = serve(&["--memory-limit", "80GiB"])
            .check_capacity(&[device(79 * GIB)], Some(512 * GIB), false)
            .expect_err("more than the GPU has")
            .0;
        assert!(error.contains("device 0 (test memory)"), "{error}");
        let error = serve(&["--host-memory-limit", "32GiB"])
            .check_capacity(&devices, Some(24 * GIB), false)
            .expect_err("more than the host has")
            .0;
        assert!(
            error.contains("--host-memory-limit") && error.contains(&(24 * GIB).to_string()),
            "{error}"
        );
        let fine = serve(&["--memory-limit", "24GiB", "--host-memory-limit", "0"]);
        assert_eq!(
            fine.check_capacity(&devices, Some(24 * GIB), true),
            Ok(vec![])
        );
        // Unknown capacities are not checked.
        let unknown = DeviceInfo {
            total_bytes: None,
            ..device(0)
        };
        let any = serve(&["--memory-limit", "1TiB", "--host-memory-limit", "1TiB"]);
        assert_eq!(any.check_capacity(&[unknown], None, true), Ok(vec![]));
    }

    #[test]
    fn the_cuda_backend_pins_a_gibibyte_by_default_or_a_sixteenth_of_a_small_host() {
        const GIB: u64 = 1 << 30;
        let default = serve(&[]);
        assert_eq!(default.pinned_host_memory_bytes(Some(128 * GIB)), GIB);
        assert_eq!(default.pinned_host_memory_bytes(None), GIB);
        assert_eq!(default.pinned_host_memory_bytes(Some(8 * GIB)), GIB / 2);
        let none = serve(&["--pinned-host-memory", "0"]);
        assert_eq!(none.pinned_host_memory_bytes(Some(128 * GIB)), 0);
        let asked = serve(&["--pinned-host-memory", "4GiB"]);
        assert_eq!(asked.pinned_host_memory_bytes(Some(16 * GIB)), 4 * GIB);
    }

    #[test]
    fn at_most_half_of_the_free_memory_is_pinned() {
        const GIB: u64 = 1 << 30;
        assert_eq!(crate::config::pinnable(GIB, Some(64 * GIB)), GIB);
        assert_eq!(crate::config::pinnable(GIB, Some(GIB)), GIB / 2);
        assert_eq!(crate::config::pinnable(8 * GIB, Some(3 * GIB)), 3 * GIB / 2);
        assert_eq!(crate::config::pinnable(GIB, Some(0)), 0);
        // Where nothing says what is free, what was asked for.
        assert_eq!(crate::config::pinnable(GIB, None), GIB);
    }

    #[test]
    fn pinned_host_memory_needs_a_gpu_and_memory_left_over() {
        const GIB: u64 = 1 << 30;
        let error = refusal(&["--backend", "host", "--pinned-host-memory", "1GiB"]);
        assert!(error.contains("--backend host"), "{error}");
        for fine in [
            &[
                "--pinned-host-memory",
                "4GiB",
                "--host-memory-limit",
                "4GiB",
            ][..],
            &["--pinned-host-memory", "2GiB"],
            &["--backend", "host", "--pinned-host-memory", "0"],
        ] {
            assert_eq!(serve(fine).validate(), Ok(()), "{fine:?}");
        }
        let devices = [device(80 * GIB)];
        let error = serve(&["--pinned-host-memory", "20GiB"])
            .check_capacity(&devices, Some(32 * GIB), false)
            .expect_err("more than half the host's memory")
            .0;
        assert!(error.contains("--pinned-host-memory"), "{error}");
        assert_eq!(
            serve(&["--pinned-host-memory", "16GiB"]).check_capacity(
                &devices,
                Some(32 * GIB),
                false
            ),
            Ok(vec![])
        );
    }

    #[test]
    fn host_backend_tiers_that_together_exceed_the_memory_are_warned_about() {
        const GIB: u64 = 1 << 30;
        let args = serve(&["--memory-limit", "16GiB", "--host-memory-limit", "16GiB"]);
        let warnings = args
            .check_capacity(&[device(24 * GIB)], Some(24 * GIB), true)
            .expect("each fits");
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        // On a GPU the two are different memories.
        let gpu = args
            .check_capacity(&[device(24 * GIB)], Some(24 * GIB), false)
            .expect("each fits");
        assert!(gpu.is_empty(), "{gpu:?}");
    }

    #[test]
    fn an_empty_token_file_is_refused_unless_unauthenticated_access_is_allowed() {
        let path = std::path::Path::new("/etc/gpu-flight/tokens.toml");
        let empty = Loaded {
            tokens: 0,
            users: 0,
        };
        let error = check_token_file(empty, path, false)
            .expect_err("nobody can call")
            .0;
        assert!(error.contains("/etc/gpu-flight/tokens.toml"), "{error}");
        assert!(matches!(check_token_file(empty, path, true), Ok(Some(_))));
        for loaded in [
            Loaded {
                tokens: 1,
                users: 0,
            },
            Loaded {
                tokens: 0,
                users: 1,
            },
        ] {
            assert_eq!(check_token_file(loaded, path, false), Ok(None));
        }
    }

    #[test]
    fn side_listeners_off_loopback_are_warned_about() {
        for address in ["0.0.0.0:9090", "[::]:9090", "10.0.0.5:9090"] {
            let address = address.parse().expect("address");
            let warning = exposed_listener_warning("--metrics-listen", address).expect("warned");
            assert!(warning.contains("--metrics-listen"), "{warning}");
        }
        for address in ["127.0.0.1:9090", "[::1]:9090"] {
            let address = address.parse().expect("address");
            assert_eq!(exposed_listener_warning("--health-listen", address), None);
        }
    }
}
