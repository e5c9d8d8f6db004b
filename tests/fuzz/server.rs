//! The server under test, on a runtime of its own, and the client's runtime and channel.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use gpu_flight::backend::Backend;
use gpu_flight::flight::{FlightOptions, SharedMemoryOptions};
use gpu_flight::server::ServeOptions;
use gpu_flight::store::{SharedLimits, StoreOptions};
use tonic::transport::Channel;

/// The device budget of the server under test (no host tier).
const MEMORY_LIMIT: u64 = 256 << 20;

/// The server on its own runtime: a handler stuck in a loop then cannot starve the client's
/// timers (so the 30 s limit is enforced), and a failed test does not wait for it on exit.
pub(crate) struct Served {
    runtime: Option<tokio::runtime::Runtime>,
    server: Option<crate::common::TestServer>,
    pub(crate) addr: SocketAddr,
}

impl Served {
    pub(crate) fn start(backend: Arc<dyn Backend>, options: ServeOptions) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("fuzz-server")
            .enable_all()
            .build()
            .expect("server runtime");
        // `shm-read` stages its files for real, so that they too must return their memory.
        let socket =
            std::env::temp_dir().join(format!("gpu-flight-fuzz-{}.sock", std::process::id()));
        let server = runtime.block_on(crate::common::TestServer::start_with_shared_memory(
            backend,
            StoreOptions {
                memory_limit: Some(MEMORY_LIMIT),
                // The device's limit alone: no host tier to spill to.
                host_memory_limit: Some(0),
                ..StoreOptions::default()
            },
            options,
            &socket,
        ));
        let addr = server.addr;
        Self {
            runtime: Some(runtime),
            server: Some(server),
            addr,
        }
    }

    pub(crate) fn stop(mut self) {
        if let (Some(runtime), Some(server)) = (self.runtime.as_ref(), self.server.take()) {
            runtime.block_on(server.shutdown_and_wait());
        }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.server.take();
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

/// Small endpoints and messages, so that small datasets still span several of each.
pub(crate) fn serve_options() -> ServeOptions {
    ServeOptions {
        flight: FlightOptions {
            rows_per_endpoint: 64,
            max_message_bytes: 64 << 10,
            // Files staged by `shm-read` and never claimed go within the settle's wait.
            shared_memory: SharedMemoryOptions {
                socket: None,
                limits: SharedLimits {
                    token_ttl: Duration::from_millis(200),
                    ..SharedLimits::default()
                },
                // Several files a read, whatever the machine.
                writers: Some(3),
            },
            ..FlightOptions::default()
        },
        ..ServeOptions::default()
    }
}

pub(crate) fn client_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("client runtime")
}

pub(crate) async fn open_channel(addr: SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .expect("uri")
        .connect()
        .await
        .expect("connect")
}
