//! What callers prove themselves with, loaded before anything listens: the token file of
//! `--auth-tokens` (checked to name somebody) and the TLS files of `--tls-cert`, `--tls-key`
//! and `--tls-client-ca`. Errors are the messages the server refuses to start with.

use std::sync::Arc;
use std::time::Duration;

use crate::auth::{Auth, Authenticator};
use crate::config::{self, ServeArgs};
use crate::server::TlsFiles;

/// How callers are authenticated, from `--auth-tokens` and `--session-hours`.
pub fn load_auth(args: &ServeArgs) -> Result<Auth, String> {
    let Some(path) = &args.auth_tokens else {
        return Ok(Auth::Off);
    };
    let ttl = Duration::from_secs(args.session_hours * 3600);
    let authenticator = Authenticator::load(path, ttl).map_err(|e| e.to_string())?;
    let loaded = authenticator.loaded();
    tracing::info!(
        path = %path.display(),
        tokens = loaded.tokens,
        users = loaded.users,
        "authentication on"
    );
    if let Some(warning) = config::check_token_file(loaded, path, args.allow_unauthenticated)
        .map_err(|e| e.to_string())?
    {
        tracing::warn!("{warning}");
    }
    Ok(Auth::Tokens(Arc::new(authenticator)))
}

/// The TLS files, when `--tls-cert` and `--tls-key` are given.
pub fn load_tls(args: &ServeArgs) -> Result<Option<TlsFiles>, String> {
    match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => {
            TlsFiles::load(cert, key, args.tls_client_ca.as_deref()).map(Some)
        }
        _ => Ok(None),
    }
}
