//! TLS for the Flight port, with tonic's rustls support: the server's certificate and key,
//! and for mutual TLS the CA that client certificates must be signed by.

use std::fmt;
use std::path::Path;

use tonic::transport::{Certificate, Identity, Server, ServerTlsConfig};

/// The PEM files TLS is configured with, read once at start.
#[derive(Clone)]
pub struct TlsFiles {
    cert: Vec<u8>,
    key: Vec<u8>,
    client_ca: Option<Vec<u8>>,
}

impl fmt::Debug for TlsFiles {
    /// Never the key.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsFiles")
            .field("cert_bytes", &self.cert.len())
            .field("mutual", &self.client_ca.is_some())
            .finish_non_exhaustive()
    }
}

impl TlsFiles {
    /// Reads the files and checks that rustls accepts them, so that a bad file stops the
    /// server at start with a message naming it, not at the first connection.
    pub fn load(cert: &Path, key: &Path, client_ca: Option<&Path>) -> Result<Self, String> {
        let read = |path: &Path, what: &str| {
            std::fs::read(path)
                .map_err(|e| format!("cannot read the {what} {}: {e}", path.display()))
        };
        let files = Self {
            cert: read(cert, "TLS certificate (--tls-cert)")?,
            key: read(key, "TLS key (--tls-key)")?,
            client_ca: client_ca
                .map(|ca| read(ca, "client CA (--tls-client-ca)"))
                .transpose()?,
        };
        Server::builder().tls_config(files.config()).map_err(|e| {
            format!(
                "the TLS files are not usable ({e}): --tls-cert must be a PEM certificate chain, \
                 --tls-key its PEM private key{}",
                if files.client_ca.is_some() {
                    ", --tls-client-ca PEM CA certificates"
                } else {
                    ""
                }
            )
        })?;
        Ok(files)
    }

    /// Whether clients must present a certificate.
    pub fn is_mutual(&self) -> bool {
        self.client_ca.is_some()
    }

    pub(super) fn config(&self) -> ServerTlsConfig {
        let config = ServerTlsConfig::new().identity(Identity::from_pem(&self.cert, &self.key));
        match &self.client_ca {
            Some(ca) => config.client_ca_root(Certificate::from_pem(ca)),
            None => config,
        }
    }
}
