//! Redis' protected mode, for Flight: without authentication, the server listens only on
//! loopback addresses, unless the operator says otherwise (`--allow-unauthenticated`, and then
//! a warning); with authentication but without TLS, a warning that credentials cross the
//! network in clear text.

use std::net::SocketAddr;

/// What listening on some addresses exposes, as [`check`] finds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Exposure {
    /// Only loopback addresses, or authenticated over TLS: nothing to say.
    Safe,
    /// Other hosts may reach these addresses, and nobody is asked who they are
    /// (`--allow-unauthenticated`).
    Unauthenticated { addresses: String },
    /// Other hosts may reach these addresses, and credentials cross the network unencrypted.
    Cleartext { addresses: String },
}

/// Refuses addresses other hosts may reach without authentication (token file or mutual TLS)
/// unless `allow_unauthenticated`; the error is the message the server refuses to start with.
pub fn check(
    addresses: &[SocketAddr],
    authenticated: bool,
    tls: bool,
    allow_unauthenticated: bool,
) -> Result<Exposure, String> {
    let exposed: Vec<String> = addresses
        .iter()
        .filter(|address| !address.ip().is_loopback())
        .map(ToString::to_string)
        .collect();
    if exposed.is_empty() {
        return Ok(Exposure::Safe);
    }
    let addresses = exposed.join(", ");
    if !authenticated {
        if !allow_unauthenticated {
            return Err(format!(
                "refusing to listen on {addresses} without authentication: anyone who can connect \
                 could read, replace and drop every dataset. Give --auth-tokens FILE (or \
                 --tls-client-ca for mutual TLS), listen on a loopback address (127.0.0.1, \
                 [::1], localhost), or add --allow-unauthenticated if a firewall or network \
                 policy already limits who can connect."
            ));
        }
        return Ok(Exposure::Unauthenticated { addresses });
    }
    if !tls {
        return Ok(Exposure::Cleartext { addresses });
    }
    Ok(Exposure::Safe)
}

impl Exposure {
    /// Logs the warning this exposure deserves, if any.
    pub fn warn(&self) {
        match self {
            Self::Safe => {}
            Self::Unauthenticated { addresses } => tracing::warn!(
                addresses = %addresses,
                "serving WITHOUT authentication on addresses other hosts may reach \
                 (--allow-unauthenticated): anyone who can connect may read, replace and drop \
                 every dataset"
            ),
            Self::Cleartext { addresses } => tracing::warn!(
                addresses = %addresses,
                "authentication without TLS: tokens and passwords cross the network in clear \
                 text; give --tls-cert and --tls-key"
            ),
        }
    }
}
