//! The token file read again while the server runs (on SIGHUP, from `launch::serve`): a file that fails
//! to load is logged and the previous one stays in force, so a typo never locks everyone out.

use std::sync::Arc;

use futures::{Stream, StreamExt};

use crate::auth::Authenticator;

/// Reads the token file again on each item of `hangups`, until it ends.
pub async fn reload_on(authenticator: Arc<Authenticator>, hangups: impl Stream<Item = ()>) {
    let mut hangups = std::pin::pin!(hangups);
    while hangups.next().await.is_some() {
        match authenticator.reload() {
            Ok(loaded) => tracing::info!(
                path = %authenticator.path().display(),
                tokens = loaded.tokens,
                users = loaded.users,
                "token file reloaded"
            ),
            Err(error) => tracing::error!(
                %error,
                "token file NOT reloaded; the previous one stays in force"
            ),
        }
    }
}
