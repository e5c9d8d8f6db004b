//! Panic containment: a handler that panics answers INTERNAL and logs an error; the server
//! stays up.
//!
//! tower-http's `CatchPanic` catches a panic in a handler's call or future and answers with the
//! status, trailers-only, as any refusal. A streamed reply's body is polled later, by hyper,
//! outside that future, so [`Contained`] also catches a panic while a reply is produced, and
//! ends the reply with the same status in its trailers.

use std::any::Any;
use std::convert::Infallible;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use tonic::Status;
use tonic::body::Body;
use tower::ServiceBuilder;
use tower_http::catch_panic::CatchPanicLayer;

use crate::error::Error;
use crate::task::panic_message;

/// `inner`, with its panics answered as INTERNAL, whether in its future or its reply's body.
pub(super) fn contain<S>(
    inner: S,
) -> impl tower::Service<
    http::Request<Body>,
    Response = http::Response<Body>,
    Error = Infallible,
    Future = impl Send + 'static,
> + Clone
+ Send
+ Sync
+ 'static
where
    S: tower::Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    ServiceBuilder::new()
        .map_response(|response: http::Response<_>| response.map(Body::new))
        .layer(CatchPanicLayer::custom(
            respond as fn(Box<dyn Any + Send>) -> http::Response<Body>,
        ))
        .map_response(|response: http::Response<Body>| {
            response.map(|body| Body::new(Contained { body, done: false }))
        })
        .service(inner)
}

/// The status a panic answers with, logged as the error it is.
fn panicked(panic: &(dyn Any + Send)) -> Status {
    let reason = panic_message(panic);
    tracing::error!(reason = %reason.escape_debug(), "a request handler panicked");
    Status::from(Error::Internal(format!(
        "a request handler panicked: {reason}"
    )))
}

fn respond(panic: Box<dyn Any + Send>) -> http::Response<Body> {
    panicked(panic.as_ref()).into_http()
}

/// A reply body whose polling cannot unwind into hyper: a panic ends it with INTERNAL.
struct Contained {
    body: Body,
    /// A panic ended the body: nothing follows its trailers.
    done: bool,
}

impl HttpBody for Contained {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if self.done {
            return Poll::Ready(None);
        }
        let body = &mut self.body;
        match std::panic::catch_unwind(AssertUnwindSafe(|| Pin::new(body).poll_frame(cx))) {
            Ok(frame) => frame,
            Err(panic) => {
                self.done = true;
                let status = panicked(panic.as_ref());
                let mut trailers = http::HeaderMap::new();
                match status.add_header(&mut trailers) {
                    Ok(()) => Poll::Ready(Some(Ok(Frame::trailers(trailers)))),
                    Err(status) => Poll::Ready(Some(Err(status))),
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        if self.done {
            SizeHint::default()
        } else {
            self.body.size_hint()
        }
    }
}
