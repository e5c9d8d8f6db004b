//! The Flight endpoint as tonic serves it: arrow-flight's generated `FlightServiceServer` over
//! the handlers (`crate::flight`), behind the layers, outermost first:
//!
//! 1. accounting (`accounting`): each call's log line and metrics, and its connection's open
//!    streams;
//! 2. authentication and roles (`authenticate`);
//! 3. request limits and clean ends (`limits`);
//! 4. panic containment (`panics`).
//!
//! Inside them, `DoGet` goes to the framed fast path (`crate::flight::doget`) unless
//! `--doget-encoder plain` picks arrow-flight's encoder, and `DoPut` to its reader of the HTTP/2
//! frames (`crate::flight::put`) unless `--doput-decoder plain` picks tonic's codec; the
//! generated server runs every other method. Paths the protocol does not have are answered here.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use arrow_flight::flight_service_server::FlightServiceServer;
use futures::future::BoxFuture;
use tonic::Status;
use tonic::body::Body;
use tonic::server::NamedService;
use tower::ServiceBuilder;
use tower::util::BoxCloneSyncService;

use super::accounting::Accounting;
use super::authenticate::Authenticate;
use super::limits::RequestLimits;
use super::method::{Method, method_of};
use super::panics;
use crate::auth::Auth;
use crate::flight::{FlightOptions, Lifecycle, Service, doget, put};
use crate::metrics::Metrics;
use crate::store::Store;

/// How `DoGet` replies are encoded: a hidden switch, kept for measuring one against the other
/// (docs/performance-notes.md has the A/B that kept the framed path).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum DoGetEncoder {
    /// Framed by the server itself, handing hyper the Arrow buffers without copying them.
    #[default]
    Framed,
    /// arrow-flight's `FlightDataEncoderBuilder`, through the generated server.
    Plain,
}

/// How `DoPut` messages are read: a hidden switch, kept for measuring one against the other
/// (docs/performance-notes.md has the A/B).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum DoPutDecoder {
    /// Straight from the HTTP/2 frames, each body copied once into aligned memory.
    #[default]
    Framed,
    /// tonic's codec, through the generated server.
    Plain,
}

/// The Flight service with its layers, ready for `tonic::transport::Server::add_service`.
#[derive(Clone)]
pub(super) struct FlightEndpoint(
    BoxCloneSyncService<http::Request<Body>, http::Response<Body>, Infallible>,
);

impl std::fmt::Debug for FlightEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FlightEndpoint")
    }
}

impl NamedService for FlightEndpoint {
    const NAME: &'static str = <FlightServiceServer<Service> as NamedService>::NAME;
}

impl tower::Service<http::Request<Body>> for FlightEndpoint {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<http::Response<Body>, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        self.0.call(request)
    }
}

/// Builds the endpoint over `store`. Requests are bounded by `max_put_message_bytes` (`DoPut`)
/// and `max_request_bytes` (everything else). `DoGet` replies keep to `max_message_bytes`;
/// the others are bounded by what they carry (a schema within `flight::schema_limit`, at most
/// `MAX_ENDPOINTS` endpoints), not checked here. Callers are authenticated by `auth`; calls are
/// counted in `metrics`, if any.
pub(super) fn flight(
    store: Store,
    options: FlightOptions,
    encoder: DoGetEncoder,
    decoder: DoPutDecoder,
    lifecycle: Lifecycle,
    auth: Auth,
    metrics: Option<Arc<Metrics>>,
) -> FlightEndpoint {
    let accounting = Accounting {
        progress_interval: options.progress_interval,
        metrics,
    };
    let authenticate = Authenticate { auth: auth.clone() };
    let limits = RequestLimits {
        store: store.clone(),
        max_request_bytes: options.max_request_bytes,
        max_put_message_bytes: options.max_put_message_bytes,
    };
    // The limits layer has refused every message over its method's limit, with a clearer
    // error; tonic's check is the backstop.
    let largest = options.max_put_message_bytes.max(options.max_request_bytes);
    let service = Arc::new(Service::new(store, options, lifecycle, auth));
    let routes = Routes {
        generated: FlightServiceServer::from_arc(Arc::clone(&service))
            .max_decoding_message_size(largest)
            .max_encoding_message_size(usize::MAX),
        service,
        encoder,
        decoder,
    };
    FlightEndpoint(BoxCloneSyncService::new(
        ServiceBuilder::new()
            .layer(accounting)
            .layer(authenticate)
            .layer(limits)
            .layer_fn(panics::contain)
            .service(routes),
    ))
}

/// Where each request goes once the layers have let it through.
#[derive(Clone)]
struct Routes {
    generated: FlightServiceServer<Service>,
    service: Arc<Service>,
    encoder: DoGetEncoder,
    decoder: DoPutDecoder,
}

impl tower::Service<http::Request<Body>> for Routes {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<http::Response<Body>, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        match method_of(&request) {
            Method::DoGet if self.encoder == DoGetEncoder::Framed => {
                let service = Arc::clone(&self.service);
                Box::pin(async move { Ok(doget::respond(&service, request).await) })
            }
            Method::DoPut if self.decoder == DoPutDecoder::Framed => {
                let service = Arc::clone(&self.service);
                Box::pin(async move { Ok(put::respond(&service, request).await) })
            }
            Method::Unknown => Box::pin(std::future::ready(Ok(Status::unimplemented(
                "no such method; gpu-flight serves arrow.flight.protocol.FlightService",
            )
            .into_http()))),
            _ => self.generated.call(request),
        }
    }
}
