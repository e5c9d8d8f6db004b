//! TLS for the Flight port, with rustls: the server's certificate and key, and for mutual TLS
//! the CA that client certificates must be signed by.
//!
//! The handshake is done here rather than by tonic, which drops a failed one with a debug line
//! naming neither the client nor, usefully, the reason: an operator whose clients are refused
//! (an X.509 v1 certificate, an unknown CA) must be able to see why in the log. Handshakes run
//! on tasks of their own, so a slow client does not hold up the others, and are bounded by the
//! handshake timeout. A verified client certificate's names go with the connection, for the
//! token file's `[[certificates]]` entries.

use std::fmt;
use std::io;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::{Stream, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::task::JoinSet;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{self, RootCertStore, ServerConfig};
use tonic::transport::server::Connected;

use super::connection::Connection;
use super::peer::{ConnectionInfo, Peer};
use crate::auth::ClientCertificate;

/// TLS as configured by its PEM files, read once at start.
#[derive(Clone)]
pub struct TlsFiles {
    config: Arc<ServerConfig>,
    mutual: bool,
}

impl fmt::Debug for TlsFiles {
    /// Never the key.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsFiles")
            .field("mutual", &self.mutual)
            .finish_non_exhaustive()
    }
}

/// The files' contents.
struct Pem {
    cert: Vec<u8>,
    key: Vec<u8>,
    client_ca: Option<Vec<u8>>,
}

impl TlsFiles {
    /// Reads the files and checks that rustls accepts them, so that a bad file stops the
    /// server at start with a message naming it, not at the first connection.
    pub fn load(cert: &Path, key: &Path, client_ca: Option<&Path>) -> Result<Self, String> {
        let read = |path: &Path, what: &str| {
            std::fs::read(path)
                .map_err(|e| format!("cannot read the {what} {}: {e}", path.display()))
        };
        let pem = Pem {
            cert: read(cert, "TLS certificate (--tls-cert)")?,
            key: read(key, "TLS key (--tls-key)")?,
            client_ca: client_ca
                .map(|ca| read(ca, "client CA (--tls-client-ca)"))
                .transpose()?,
        };
        let mutual = pem.client_ca.is_some();
        let config = pem.config().map_err(|e| {
            format!(
                "the TLS files are not usable ({e}): --tls-cert must be a PEM certificate chain, \
                 --tls-key its PEM private key{}",
                if mutual {
                    ", --tls-client-ca PEM CA certificates"
                } else {
                    ""
                }
            )
        })?;
        Ok(Self { config, mutual })
    }

    /// Whether clients must present a certificate.
    pub fn is_mutual(&self) -> bool {
        self.mutual
    }

    pub(super) fn config(&self) -> Arc<ServerConfig> {
        Arc::clone(&self.config)
    }
}

impl Pem {
    fn config(&self) -> Result<Arc<ServerConfig>, String> {
        let chain = CertificateDer::pem_slice_iter(&self.cert)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("certificate: {e}"))?;
        if chain.is_empty() {
            return Err("no certificate in --tls-cert".to_owned());
        }
        let key = PrivateKeyDer::from_pem_slice(&self.key).map_err(|e| format!("key: {e}"))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?;
        let builder = match &self.client_ca {
            None => builder.with_no_client_auth(),
            Some(pem) => {
                let mut roots = RootCertStore::empty();
                for ca in CertificateDer::pem_slice_iter(pem) {
                    let ca = ca.map_err(|e| format!("client CA: {e}"))?;
                    roots.add(ca).map_err(|e| format!("client CA: {e}"))?;
                }
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                        .build()
                        .map_err(|e| format!("client CA: {e}"))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder
            .with_single_cert(chain, key)
            .map_err(|e| e.to_string())?;
        // gRPC clients insist on HTTP/2 being negotiated.
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(config))
    }
}

/// A connection whose TLS handshake succeeded.
#[derive(Debug)]
pub(crate) struct TlsConnection {
    stream: tokio_rustls::server::TlsStream<Connection>,
    certificate: Option<Arc<ClientCertificate>>,
}

/// The connections of `incoming` that complete a TLS handshake within `timeout`; the others
/// are logged and closed.
pub(super) fn accept(
    incoming: impl Stream<Item = Result<Connection, io::Error>> + Send + 'static,
    config: Arc<ServerConfig>,
    timeout: Duration,
) -> impl Stream<Item = Result<TlsConnection, io::Error>> {
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let state = (incoming.boxed(), JoinSet::new());
    futures::stream::unfold(state, move |(mut incoming, mut handshakes)| {
        let acceptor = acceptor.clone();
        async move {
            loop {
                tokio::select! {
                    accepted = incoming.next() => match accepted {
                        Some(Ok(connection)) => {
                            handshakes.spawn(handshake(acceptor.clone(), connection, timeout));
                        }
                        Some(Err(_)) => {}
                        None => return None,
                    },
                    Some(done) = handshakes.join_next() => {
                        if let Ok(Some(connection)) = done {
                            return Some((Ok(connection), (incoming, handshakes)));
                        }
                    }
                }
            }
        }
    })
}

async fn handshake(
    acceptor: tokio_rustls::TlsAcceptor,
    connection: Connection,
    timeout: Duration,
) -> Option<TlsConnection> {
    let peer = connection.peer();
    let stream = match tokio::time::timeout(timeout, acceptor.accept(connection)).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(error)) => {
            log_failure(peer, &error);
            return None;
        }
        Err(_) => {
            tracing::info!(
                %peer,
                timeout_seconds = timeout.as_secs(),
                "TLS handshake failed: not finished within the handshake timeout"
            );
            return None;
        }
    };
    let certificate = stream
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|chain| chain.first())
        .and_then(|leaf| match ClientCertificate::from_der(leaf) {
            Ok(names) => Some(Arc::new(names)),
            Err(error) => {
                tracing::info!(%peer, %error, "a verified client certificate's names cannot be read; it maps to no principal");
                None
            }
        });
    Some(TlsConnection {
        stream,
        certificate,
    })
}

/// Certificates refused are warnings (a client or a CA needs fixing); the rest, which scanners
/// and clients that hang up cause too, are information.
fn log_failure(peer: Peer, error: &io::Error) {
    let tls = error
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>());
    match tls {
        Some(
            reason @ (rustls::Error::InvalidCertificate(_)
            | rustls::Error::NoCertificatesPresented
            | rustls::Error::InvalidCertRevocationList(_)),
        ) => {
            let hint = if format!("{reason:?}").contains("UnsupportedCertVersion") {
                " (only X.509 v3 certificates are accepted: reissue it as v3)"
            } else {
                ""
            };
            tracing::warn!(%peer, error = %reason, "TLS handshake failed: client certificate refused{hint}");
        }
        Some(reason) => tracing::info!(%peer, error = %reason, "TLS handshake failed"),
        None => tracing::info!(%peer, %error, "TLS handshake failed"),
    }
}

impl Connected for TlsConnection {
    type ConnectInfo = ConnectionInfo;

    fn connect_info(&self) -> ConnectionInfo {
        ConnectionInfo {
            certificate: self.certificate.clone(),
            ..self.stream.get_ref().0.connect_info()
        }
    }
}

impl AsyncRead for TlsConnection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsConnection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}
