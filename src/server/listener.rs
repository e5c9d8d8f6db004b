//! Where connections come from: TCP addresses, and Unix domain sockets for clients on the same
//! host (`--listen unix:///run/gpu-flight.sock`, pyarrow's `grpc+unix://`), which skip the TCP/IP
//! stack.
//!
//! A Unix socket is a file: who may connect is decided by its permissions, like any local
//! resource, so it counts as local for the protected mode just as loopback does. A socket file
//! left by a server that died is replaced; one a live server answers on is not. The file is
//! removed when the listener is dropped. What a Unix-socket client sends passes through
//! [`AuthorityRewriter`], which makes the HTTP/2 authority of stock gRPC clients one h2 accepts.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};

use super::peer::Peer;
use super::unix_authority::AuthorityRewriter;

/// The prefix of a Unix socket in `--listen`.
const UNIX_SCHEME: &str = "unix://";
/// The same as a Flight location, as the server prints it.
const GRPC_UNIX_SCHEME: &str = "grpc+unix://";
/// Flight locations of TCP listeners, as the server prints them and clients write them; the
/// second says whether the scheme is TLS.
const TCP_SCHEMES: [(&str, bool); 3] = [
    ("grpc://", false),
    ("grpc+tcp://", false),
    ("grpc+tls://", true),
];

/// One `--listen` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    /// `HOST:PORT`, resolved when bound.
    Tcp(String),
    /// `unix:///absolute/path` (or `unix://relative/path`).
    Unix(PathBuf),
}

impl ListenAddr {
    /// `HOST:PORT`, `unix:///path`, or a Flight location (`grpc://`, `grpc+tcp://`,
    /// `grpc+tls://`, `grpc+unix://`): a location the server printed can be given back to it.
    pub fn parse(spec: &str) -> Result<Self, String> {
        if let Some(path) = spec
            .strip_prefix(UNIX_SCHEME)
            .or_else(|| spec.strip_prefix(GRPC_UNIX_SCHEME))
        {
            if path.is_empty() {
                return Err(format!(
                    "{spec:?} names no socket file; write unix:///path/to/gpu-flight.sock"
                ));
            }
            return Ok(Self::Unix(PathBuf::from(path)));
        }
        if spec.starts_with("unix:") || spec.starts_with("grpc+unix:") {
            return Err(format!(
                "{spec:?}: a Unix socket is written unix:///path/to/gpu-flight.sock"
            ));
        }
        for (scheme, _) in TCP_SCHEMES {
            if let Some(address) = spec.strip_prefix(scheme) {
                return Ok(Self::Tcp(address.trim_end_matches('/').to_owned()));
            }
        }
        if let Some((scheme, _)) = spec.split_once("://") {
            return Err(format!(
                "{spec:?}: {scheme}:// is not a scheme gpu-flight listens with; write HOST:PORT, \
                 grpc://HOST:PORT, grpc+tls://HOST:PORT or unix:///path/to.sock"
            ));
        }
        Ok(Self::Tcp(spec.to_owned()))
    }

    /// Whether a `--listen` value's scheme asks for TLS (`grpc+tls://`) or plain text
    /// (`grpc://`, `grpc+tcp://`); `None` for one that says neither.
    pub fn tls_scheme(spec: &str) -> Option<bool> {
        TCP_SCHEMES
            .iter()
            .find(|(scheme, _)| spec.starts_with(scheme))
            .map(|&(_, tls)| tls)
    }
}

/// A bound listener of either kind.
#[derive(Debug)]
pub enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener, SocketFile),
}

impl From<TcpListener> for Listener {
    fn from(listener: TcpListener) -> Self {
        Self::Tcp(listener)
    }
}

impl Listener {
    /// Binds a TCP listener (for `Listener::from`, or a side listener), with an error that names the address (and `flag`, for a listener
    /// other than `--listen`) and says what the usual causes mean.
    pub async fn bind_tcp(address: SocketAddr, flag: &str) -> Result<TcpListener, String> {
        TcpListener::bind(address).await.map_err(|error| {
            let hint = match error.kind() {
                io::ErrorKind::AddrInUse => {
                    ": another process holds this address (EADDRINUSE): stop it, or choose another \
                     port (port 0 picks a free one)"
                }
                io::ErrorKind::PermissionDenied => {
                    ": ports below 1024 need root or the CAP_NET_BIND_SERVICE capability"
                }
                io::ErrorKind::AddrNotAvailable => ": no network interface of this machine has it",
                _ => "",
            };
            format!("cannot listen on {address} ({flag}): {error}{hint}")
        })
    }

    /// Binds a Unix socket at `path`, replacing a stale socket file but never a live one or
    /// a file of another kind.
    pub async fn bind_unix(path: &Path) -> io::Result<Self> {
        match std::fs::symlink_metadata(path) {
            Ok(metadata) => {
                use std::os::unix::fs::FileTypeExt;
                if !metadata.file_type().is_socket() {
                    return Err(io::Error::new(
                        io::ErrorKind::AlreadyExists,
                        "the path exists and is not a socket; remove it or choose another",
                    ));
                }
                // Only a refused connection means nobody listens: a full backlog or a
                // permission error says nothing about that, and the file is left alone.
                match UnixStream::connect(path).await {
                    Err(error) if error.kind() == io::ErrorKind::ConnectionRefused => {
                        std::fs::remove_file(path)?;
                    }
                    Ok(_) => {
                        return Err(io::Error::new(
                            io::ErrorKind::AddrInUse,
                            "another server is listening on this socket",
                        ));
                    }
                    Err(error) => {
                        return Err(io::Error::new(
                            error.kind(),
                            format!("cannot tell whether a server listens on this socket: {error}"),
                        ));
                    }
                }
            }
            Err(error) if error.kind() == io::ErrorKind::NotFound => {}
            Err(error) => return Err(error),
        }
        let listener = UnixListener::bind(path)?;
        let file = SocketFile::new(path)?;
        Ok(Self::Unix(listener, file))
    }

    /// How clients reach this listener, as a Flight location (`grpc://127.0.0.1:8815`,
    /// `grpc+unix:///run/gpu-flight.sock`); `tls` for TCP listeners serving TLS.
    pub fn location(&self, tls: bool) -> io::Result<String> {
        Ok(match self {
            Self::Tcp(listener) => {
                let scheme = if tls { "grpc+tls" } else { "grpc" };
                format!("{scheme}://{}", listener.local_addr()?)
            }
            Self::Unix(_, file) => format!("grpc+unix://{}", file.path.display()),
        })
    }

    /// A Unix listener's socket and the path it is bound at.
    pub(crate) fn unix(&self) -> Option<(&UnixListener, &Path)> {
        match self {
            Self::Unix(listener, file) => Some((listener, &file.path)),
            Self::Tcp(_) => None,
        }
    }

    pub fn is_unix(&self) -> bool {
        matches!(self, Self::Unix(..))
    }

    pub(crate) fn poll_accept(&self, cx: &mut Context<'_>) -> Poll<io::Result<(Socket, Peer)>> {
        match self {
            Self::Tcp(listener) => listener.poll_accept(cx).map_ok(|(socket, address)| {
                // Flight messages are large and latency matters for the small ones.
                let _ = socket.set_nodelay(true);
                (Socket::Tcp(socket), Peer::Tcp(address))
            }),
            Self::Unix(listener, _) => listener.poll_accept(cx).map_ok(|(socket, _)| {
                let credentials = socket.peer_cred().ok();
                let peer = Peer::Unix {
                    pid: credentials.as_ref().and_then(|c| c.pid()),
                    uid: credentials.map(|c| c.uid()),
                };
                // gRPC clients send the socket's path as the HTTP/2 authority, which h2 refuses.
                (
                    Socket::Unix(Box::new(AuthorityRewriter::new(socket, peer))),
                    peer,
                )
            }),
        }
    }
}

/// A Unix socket's file, removed when its listener goes unless another server has bound a
/// socket at that path since (it is then another file).
#[derive(Debug)]
pub struct SocketFile {
    path: PathBuf,
    identity: (u64, u64),
}

impl SocketFile {
    fn new(path: &Path) -> io::Result<Self> {
        Ok(Self {
            path: path.to_owned(),
            identity: identity(path)?,
        })
    }
}

/// The device and inode of the file at `path` (not following links).
fn identity(path: &Path) -> io::Result<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let metadata = std::fs::symlink_metadata(path)?;
    Ok((metadata.dev(), metadata.ino()))
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        if identity(&self.path).is_ok_and(|now| now == self.identity) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// An accepted connection of either kind.
#[derive(Debug)]
pub(crate) enum Socket {
    Tcp(TcpStream),
    Unix(Box<AuthorityRewriter<UnixStream>>),
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Tcp(spec) => f.write_str(spec),
            Self::Unix(path) => write!(f, "{UNIX_SCHEME}{}", path.display()),
        }
    }
}

macro_rules! either {
    ($socket:expr, $inner:ident => $body:expr) => {
        match $socket.get_mut() {
            Socket::Tcp($inner) => {
                let $inner = Pin::new($inner);
                $body
            }
            Socket::Unix($inner) => {
                let $inner = Pin::new($inner);
                $body
            }
        }
    };
}

impl AsyncRead for Socket {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        either!(self, socket => socket.poll_read(cx, buf))
    }
}

impl AsyncWrite for Socket {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        either!(self, socket => socket.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        either!(self, socket => socket.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Self::Tcp(socket) => socket.is_write_vectored(),
            Self::Unix(socket) => socket.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        either!(self, socket => socket.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        either!(self, socket => socket.poll_shutdown(cx))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_values_are_tcp_or_unix() {
        assert_eq!(
            ListenAddr::parse("unix:///run/gf.sock"),
            Ok(ListenAddr::Unix("/run/gf.sock".into()))
        );
        assert_eq!(
            ListenAddr::parse("localhost:8815"),
            Ok(ListenAddr::Tcp("localhost:8815".into()))
        );
        assert!(ListenAddr::parse("unix://").is_err());
        assert!(ListenAddr::parse("unix:/run/gf.sock").is_err());
        // Flight locations, as the server prints them.
        for (spec, tls) in [
            ("grpc://127.0.0.1:0", Some(false)),
            ("grpc+tcp://127.0.0.1:0/", Some(false)),
            ("grpc+tls://127.0.0.1:0", Some(true)),
            ("127.0.0.1:0", None),
        ] {
            assert_eq!(
                ListenAddr::parse(spec),
                Ok(ListenAddr::Tcp("127.0.0.1:0".into())),
                "{spec}"
            );
            assert_eq!(ListenAddr::tls_scheme(spec), tls, "{spec}");
        }
        assert_eq!(
            ListenAddr::parse("grpc+unix:///run/gf.sock"),
            Ok(ListenAddr::Unix("/run/gf.sock".into()))
        );
        assert!(ListenAddr::parse("grpc+unix://").is_err());
        assert!(ListenAddr::parse("http://127.0.0.1:0").is_err());
    }

    #[tokio::test]
    async fn an_address_in_use_is_named_with_its_cause() {
        let taken = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = taken.local_addr().expect("address");
        let error = Listener::bind_tcp(address, "--metrics-listen")
            .await
            .expect_err("in use");
        assert!(
            error.contains(&address.to_string())
                && error.contains("--metrics-listen")
                && error.contains("another process")
                && error.contains("EADDRINUSE"),
            "{error}"
        );
    }

    #[tokio::test]
    async fn a_stale_socket_file_is_replaced_and_a_live_one_is_not() {
        let directory = std::env::temp_dir().join(format!("gpu-flight-uds-{}", std::process::id()));
        std::fs::create_dir_all(&directory).expect("scratch directory");
        let path = directory.join("server.sock");
        // A socket file whose listener is gone, as a killed server leaves it.
        drop(std::os::unix::net::UnixListener::bind(&path).expect("bind"));
        assert!(path.exists());
        let live = Listener::bind_unix(&path)
            .await
            .expect("stale file replaced");
        let error = Listener::bind_unix(&path)
            .await
            .expect_err("live socket kept");
        assert_eq!(error.kind(), io::ErrorKind::AddrInUse);
        drop(live);
        assert!(!path.exists(), "the socket file goes with its listener");
        // A listener whose file was replaced by another server's leaves that one alone.
        let first = Listener::bind_unix(&path).await.expect("bind");
        std::fs::remove_file(&path).expect("remove");
        let second = Listener::bind_unix(&path).await.expect("bind again");
        drop(first);
        assert!(path.exists(), "the newer server's socket is kept");
        drop(second);
        assert!(!path.exists());
        std::fs::write(&path, b"not a socket").expect("write");
        let error = Listener::bind_unix(&path)
            .await
            .expect_err("other files kept");
        assert_eq!(error.kind(), io::ErrorKind::AlreadyExists);
        std::fs::remove_dir_all(&directory).expect("clean up");
    }
}
