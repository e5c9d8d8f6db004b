//! The listeners the flags name: `--listen` values resolved (host names to every address they
//! name, without repeats) and bound, and the side listeners of `--metrics-listen` and
//! `--health-listen`. Errors are the messages the server refuses to start with.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use tokio::net::TcpListener;

use crate::config;
use crate::server::{ListenAddr, Listener};

/// What the `--listen` values name: TCP addresses and Unix socket paths, in order, without
/// repeats.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenAddresses {
    pub tcp: Vec<SocketAddr>,
    pub unix: Vec<PathBuf>,
}

impl ListenAddresses {
    /// Parses and resolves the `--listen` values.
    pub async fn resolve(specs: &[String]) -> Result<Self, String> {
        let mut tcp = Vec::new();
        let mut unix = Vec::new();
        for spec in specs {
            match ListenAddr::parse(spec)? {
                ListenAddr::Tcp(spec) => tcp.push(spec),
                ListenAddr::Unix(path) if !unix.contains(&path) => unix.push(path),
                ListenAddr::Unix(_) => {}
            }
        }
        let tcp = if tcp.is_empty() {
            Vec::new()
        } else {
            resolve(&tcp).await?
        };
        Ok(Self { tcp, unix })
    }

    /// Binds every address and socket, TCP first.
    pub async fn bind(&self) -> Result<Vec<Listener>, String> {
        let mut listeners: Vec<Listener> = Vec::new();
        for address in &self.tcp {
            let listener = Listener::bind_tcp(*address, "--listen").await?;
            listeners.push(listener.into());
        }
        for path in &self.unix {
            let listener = Listener::bind_unix(path)
                .await
                .map_err(|error| format!("cannot listen on unix://{}: {error}", path.display()))?;
            listeners.push(listener);
        }
        Ok(listeners)
    }
}

/// Every address the `HOST:PORT` values name, in order, without repeats.
pub async fn resolve(specs: &[String]) -> Result<Vec<SocketAddr>, String> {
    let mut addresses = Vec::new();
    for spec in specs {
        let resolved = tokio::net::lookup_host(spec.as_str()).await.map_err(|error| {
            format!(
                "cannot resolve the listen address {spec:?} ({error}); it is HOST:PORT, such as \
                 127.0.0.1:8815, localhost:8815 or [::1]:8815 (or unix:///path/to.sock)"
            )
        })?;
        for address in resolved {
            if !addresses.contains(&address) {
                addresses.push(address);
            }
        }
    }
    if addresses.is_empty() {
        return Err("no address to listen on".to_owned());
    }
    Ok(addresses)
}

/// The listener of a flag that takes one address (the first it resolves to), if given; a
/// warning is logged when other hosts may reach it, as it has neither authentication nor TLS.
pub async fn bind_side(spec: Option<&str>, flag: &str) -> Result<Option<TcpListener>, String> {
    let Some(spec) = spec else {
        return Ok(None);
    };
    let address = *resolve(&[spec.to_owned()])
        .await
        .map_err(|error| format!("{flag}: {error}"))?
        .first()
        .ok_or_else(|| format!("{flag} {spec} resolves to no address"))?;
    let listener = Listener::bind_tcp(address, flag).await?;
    if let Some(warning) = config::exposed_listener_warning(flag, address) {
        tracing::warn!("{warning}");
    }
    Ok(Some(listener))
}

/// The side channel of shared-memory reads (`--shm-socket`): at `spec`, or for `auto` in a
/// directory of this user's alone; `None` without the flag.
pub async fn bind_shared_memory(spec: Option<&Path>) -> Result<Option<Listener>, String> {
    let Some(spec) = spec else {
        return Ok(None);
    };
    let path = if spec == Path::new("auto") {
        private_dir()?.join(format!("shm-{}.sock", std::process::id()))
    } else {
        spec.to_owned()
    };
    Listener::bind_unix(&path).await.map(Some).map_err(|error| {
        format!(
            "cannot listen on {} (--shm-socket): {error}",
            path.display()
        )
    })
}

/// `$XDG_RUNTIME_DIR/gpu-flight`, else `/tmp/gpu-flight-UID`: made with mode 0700 where it
/// is missing, and refused unless it is a directory this user owns that nobody else can
/// enter (another user could otherwise have made it first, and hold it open).
fn private_dir() -> Result<PathBuf, String> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    let uid = nix::unistd::getuid().as_raw();
    let dir = match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(run) if !run.is_empty() => PathBuf::from(run).join("gpu-flight"),
        _ => std::env::temp_dir().join(format!("gpu-flight-{uid}")),
    };
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(error) => {
            return Err(format!(
                "cannot make {} for --shm-socket auto: {error}",
                dir.display()
            ));
        }
    }
    let metadata = std::fs::symlink_metadata(&dir)
        .map_err(|error| format!("cannot read {} (--shm-socket auto): {error}", dir.display()))?;
    if !metadata.is_dir() || metadata.uid() != uid || metadata.mode() & 0o077 != 0 {
        return Err(format!(
            "{} is not a directory of this user's alone (mode 0700, owner {uid}), so \
             --shm-socket auto will not put its socket there: remove it, or name a socket path",
            dir.display()
        ));
    }
    Ok(dir)
}
