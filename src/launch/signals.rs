//! The signals the server acts on: SIGINT and SIGTERM stop it (gracefully), SIGHUP reloads the
//! token file ([`super::reload`]).

use futures::stream::BoxStream;

/// Listens for SIGINT and SIGTERM from this call on, and returns a future that completes on
/// the first of them. (`tokio::signal::ctrl_c` would install its handler only when polled.)
pub fn shutdown() -> impl Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let interrupt = signal(SignalKind::interrupt());
        let terminate = signal(SignalKind::terminate());
        async move {
            match (interrupt, terminate) {
                (Ok(mut interrupt), Ok(mut terminate)) => {
                    tokio::select! {
                        _ = interrupt.recv() => {}
                        _ = terminate.recv() => {}
                    }
                }
                (Ok(mut only), Err(error)) | (Err(error), Ok(mut only)) => {
                    tracing::warn!(%error, "cannot listen for one of SIGINT and SIGTERM");
                    only.recv().await;
                }
                (Err(error), Err(_)) => {
                    tracing::warn!(%error, "cannot listen for SIGINT or SIGTERM; stop the server by killing it");
                    std::future::pending::<()>().await;
                }
            }
        }
    }
    #[cfg(not(unix))]
    {
        async {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Each SIGHUP from this call on, as a stream; `None` (after a warning) where they cannot be
/// listened for.
pub fn hangups() -> Option<BoxStream<'static, ()>> {
    #[cfg(unix)]
    {
        use futures::StreamExt;
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::hangup()) {
            Ok(hangups) => Some(
                futures::stream::unfold(hangups, |mut hangups| async move {
                    hangups.recv().await.map(|()| ((), hangups))
                })
                .boxed(),
            ),
            Err(error) => {
                tracing::warn!(%error, "cannot listen for SIGHUP; the token file will not be reloaded");
                None
            }
        }
    }
    #[cfg(not(unix))]
    {
        None
    }
}
