//! Call accounting, as a tower layer, outermost: each request opens a [`Call`] (in its
//! extensions, for the layers and handlers inside to fill), which logs and counts it when its
//! reply ends; until then the request counts as an open stream on its connection
//! ([`ConnectionStreams`](super::ConnectionStreams)), which is what the idle timeout reads.
//! The method, read once from the path, is left in the extensions too.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use http_body::{Body as HttpBody, Frame, SizeHint};
use tonic::Status;
use tonic::body::Body;

use super::method::method_of;
use super::peer::{ConnectionInfo, OpenStream};
use crate::flight::Call;
use crate::metrics::Metrics;

/// The layer: accounts for each call, logging progress every `progress_interval` and counting
/// calls in `metrics`, if any.
#[derive(Debug, Clone)]
pub(super) struct Accounting {
    pub(super) progress_interval: Duration,
    pub(super) metrics: Option<Arc<Metrics>>,
}

impl<S> tower::Layer<S> for Accounting {
    type Service = Accounted<S>;

    fn layer(&self, inner: S) -> Accounted<S> {
        Accounted {
            inner,
            accounting: self.clone(),
        }
    }
}

/// A service whose calls are accounted for ([`Accounting`]).
#[derive(Debug, Clone)]
pub(super) struct Accounted<S> {
    inner: S,
    accounting: Accounting,
}

impl<S> tower::Service<http::Request<Body>> for Accounted<S>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<http::Response<Body>, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<Body>) -> Self::Future {
        let method = method_of(&request);
        let connection = request.extensions().get::<ConnectionInfo>();
        let open = connection.map(|c| c.streams.begin());
        let call = Call::new(
            method.name(),
            connection.map(|c| c.peer.to_string()),
            self.accounting.progress_interval,
            self.accounting.metrics.clone(),
        );
        request.extensions_mut().insert(method);
        request.extensions_mut().insert(Arc::clone(&call));
        let reply = self.inner.call(request);
        Box::pin(async move {
            let Ok(response) = reply.await;
            // An error before any reply is sent travels in the headers (trailers-only).
            if let Some(status) = Status::from_header_map(response.headers()) {
                call.set_status(status.code(), status.message());
            }
            // The stream stays open until its response body is done (or dropped).
            Ok(response.map(|body| {
                Body::new(AccountedBody {
                    body,
                    call,
                    _open: open,
                })
            }))
        })
    }
}

/// A response body that holds its request's [`OpenStream`] and [`Call`] until it is done,
/// counting the bytes sent and reading the final status from the trailers.
struct AccountedBody {
    body: Body,
    call: Arc<Call>,
    _open: Option<OpenStream>,
}

impl HttpBody for AccountedBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let frame = ready!(Pin::new(&mut self.body).poll_frame(cx));
        match &frame {
            Some(Ok(frame)) => {
                if let Some(data) = frame.data_ref() {
                    self.call.add_bytes_out(data.len() as u64);
                } else if let Some(trailers) = frame.trailers_ref()
                    && let Some(status) = Status::from_header_map(trailers)
                {
                    self.call.set_status(status.code(), status.message());
                }
            }
            Some(Err(status)) => self.call.set_status(status.code(), status.message()),
            None => {}
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
