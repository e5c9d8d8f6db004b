//! Request limits, as a tower layer: every Flight request's body passes through a
//! [`GuardedBody`] before tonic reads a byte of it.
//!
//! - **Message limits, checked at the length prefix.** Each method has a limit (`DoPut`:
//!   `--max-put-message-bytes`; every other request: `--max-request-bytes`). The guard reads
//!   each gRPC message's 5-byte prefix as it arrives and refuses a declared length over the
//!   limit before tonic reserves a buffer for it.
//! - **`DoPut` pays as it receives.** Each message's bytes are charged to the memory budget as
//!   they arrive, and the charge is left for the handler in the request's [`Inbound`] ledger,
//!   in message order, with the reason if the guard failed the body.
//! - **Undecodable protobuf is the client's mistake.** The messages of every other method are
//!   small; the guard decodes each one as its method's request type and refuses bytes that are
//!   not one with INVALID_ARGUMENT, where tonic's prost codec would answer INTERNAL. (`DoPut`'s
//!   large messages are not decoded twice: its handler reads tonic's decode failure instead.)
//! - **A clean end, or no end.** Two layers below us turn a broken request stream into an
//!   ordinary end of it: hyper reports a stream reset with NO_ERROR (which is also how it
//!   abandons streams when a keepalive ping goes unanswered) as the end of the body, and tonic
//!   ends a request stream without error when its body fails with CANCELLED. A put would then
//!   commit what it had. So the guard asks h2 whether END_STREAM really arrived, and reports
//!   every failure to tonic with a code tonic does not swallow.
//!
//! `DoGet` reads its one ticket and answers without waiting for the request's END_STREAM, so
//! the checks made at the end of a request do not apply to it.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use arrow_flight::{
    Action, Criteria, Empty, FlightData, FlightDescriptor, HandshakeRequest, Ticket,
};
use bytes::{Buf, Bytes};
use http_body::{Body as HttpBody, Frame, SizeHint};
use tonic::body::Body;
use tonic::{Code, Status};

use super::method::{Method, method_of};
use crate::error::Error;
use crate::flight::{Call, Inbound};
use crate::store::Store;
use crate::store::memory::Reservation;

/// The layer: wraps each request's body in a [`GuardedBody`] with its method's limits.
#[derive(Debug, Clone)]
pub(super) struct RequestLimits {
    /// Where `DoPut` messages are charged.
    pub(super) store: Store,
    /// `--max-request-bytes`.
    pub(super) max_request_bytes: usize,
    /// `--max-put-message-bytes`.
    pub(super) max_put_message_bytes: usize,
}

impl<S> tower::Layer<S> for RequestLimits {
    type Service = Limited<S>;

    fn layer(&self, inner: S) -> Limited<S> {
        Limited {
            inner,
            limits: self.clone(),
        }
    }
}

/// A service whose requests' bodies are guarded ([`RequestLimits`]).
#[derive(Debug, Clone)]
pub(super) struct Limited<S> {
    inner: S,
    limits: RequestLimits,
}

impl<S> tower::Service<http::Request<Body>> for Limited<S>
where
    S: tower::Service<http::Request<Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> S::Future {
        let limits = &self.limits;
        let small = |check: Check, needs_message| Guard {
            limit: limits.max_request_bytes,
            too_large: request_too_large,
            charge: None,
            check: Some(check),
            needs_message,
        };
        let guard = match method_of(&request) {
            Method::DoPut => Guard {
                limit: limits.max_put_message_bytes,
                too_large: put_too_large,
                charge: Some((limits.store.clone(), Inbound::default())),
                check: None,
                needs_message: false,
            },
            Method::Handshake => small(decodes::<HandshakeRequest>, false),
            Method::DoExchange => small(decodes::<FlightData>, false),
            Method::DoGet => small(decodes::<Ticket>, true),
            Method::GetFlightInfo | Method::PollFlightInfo | Method::GetSchema => {
                small(decodes::<FlightDescriptor>, true)
            }
            Method::ListFlights => small(decodes::<Criteria>, true),
            Method::DoAction => small(decodes::<Action>, true),
            Method::ListActions => small(decodes::<Empty>, true),
            // Answered without reading the body.
            Method::Unknown => return self.inner.call(request),
        };
        self.inner.call(guard.apply(request))
    }
}

/// Whether `bytes` are a valid protobuf `M`, as the client is told.
fn decodes<M: prost::Message + Default>(bytes: &[u8]) -> Result<(), Error> {
    M::decode(bytes).map(drop).map_err(|error| {
        Error::Undecodable(format!(
            "the request is not a valid {} protobuf message: {error}",
            std::any::type_name::<M>()
                .rsplit("::")
                .next()
                .unwrap_or("Flight")
        ))
    })
}

fn put_too_large(declared: usize, limit: usize) -> Error {
    Error::MessageTooLarge {
        declared,
        limit,
        flag: "--max-put-message-bytes",
        hint: "write smaller record batches (pyarrow: writer.write_table(table, max_chunksize=...))",
    }
}

fn request_too_large(declared: usize, limit: usize) -> Error {
    Error::RequestTooLarge {
        declared,
        limit,
        flag: "--max-request-bytes",
    }
}

/// A check of one whole message.
type Check = fn(&[u8]) -> Result<(), Error>;

/// One method's limits.
struct Guard {
    limit: usize,
    too_large: fn(usize, usize) -> Error,
    /// `DoPut`: where each message is charged, and the ledger its handler reads.
    charge: Option<(Store, Inbound)>,
    /// Checks each whole message (small requests: that it decodes).
    check: Option<Check>,
    /// Whether the method needs at least one message (unary requests): tonic reports a body
    /// without one as INTERNAL.
    needs_message: bool,
}

impl Guard {
    /// Wraps the request's body in a [`GuardedBody`], and leaves `DoPut`'s ledger in its
    /// extensions.
    fn apply(self, mut request: http::Request<Body>) -> http::Request<Body> {
        if let Some((_, inbound)) = &self.charge {
            request.extensions_mut().insert(inbound.clone());
        }
        let call = request.extensions().get::<Arc<Call>>().cloned();
        request.map(|body| {
            Body::new(GuardedBody {
                inner: body,
                call,
                guard: self,
                messages: 0,
                receiving: None,
                message: Vec::new(),
                done: false,
                prefix: [0; 5],
                prefix_len: 0,
                remaining: 0,
                failed: false,
            })
        })
    }
}

/// A request body that checks each gRPC message's length prefix against a limit (and, for
/// `DoPut`, reserves the message's bytes) as it arrives, and fails a body that ends without
/// END_STREAM. Its errors are tonic `Status`es, which tonic passes to the handler (streams) or
/// the client (unary requests) unchanged.
struct GuardedBody {
    inner: Body,
    /// Counts the bytes received.
    call: Option<Arc<Call>>,
    guard: Guard,
    messages: usize,
    /// `DoPut`: the bytes received of the current message, grown as they arrive (a length
    /// prefix alone reserves nothing: a client pays for what it really sent).
    receiving: Option<Reservation>,
    /// Small requests: the bytes of the current message, for its check.
    message: Vec<u8>,
    /// The body has returned its last frame (or error).
    done: bool,
    prefix: [u8; 5],
    prefix_len: usize,
    /// Bytes of the current message still to come.
    remaining: usize,
    failed: bool,
}

impl GuardedBody {
    fn fail(&mut self, error: Error) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        self.failed = true;
        let mut status = error.quiet_status();
        if status.code() == Code::Cancelled {
            // tonic ends a request stream *cleanly* when its body fails with CANCELLED; the
            // handler learns the real cause from `Inbound`.
            status = Status::aborted(status.message());
        }
        match &self.guard.charge {
            Some((_, inbound)) => inbound.set_failure(error),
            None => {
                tracing::info!(message = %status.message().escape_debug(), code = ?status.code(), "request refused")
            }
        }
        Poll::Ready(Some(Err(status)))
    }

    /// Follows the message framing through `data`, checking each prefix as it completes and
    /// charging each message's bytes as they arrive.
    fn scan(&mut self, mut data: &[u8]) -> Result<(), Error> {
        while !data.is_empty() {
            if self.remaining > 0 {
                let n = self.remaining.min(data.len());
                self.remaining -= n;
                if self.guard.check.is_some() {
                    self.message.extend_from_slice(&data[..n]);
                }
                data.advance(n);
                if let (Some(receiving), Some((store, _))) =
                    (&mut self.receiving, &self.guard.charge)
                {
                    store.grow_message(receiving, n as u64)?;
                }
                self.message_complete()?;
                continue;
            }
            let n = (5 - self.prefix_len).min(data.len());
            self.prefix[self.prefix_len..self.prefix_len + n].copy_from_slice(&data[..n]);
            self.prefix_len += n;
            data.advance(n);
            if self.prefix_len < 5 {
                break;
            }
            self.prefix_len = 0;
            if self.prefix[0] != 0 {
                return Err(Error::Undecodable(
                    "compressed gRPC messages are not accepted; send them uncompressed".to_owned(),
                ));
            }
            let declared = u32::from_be_bytes([
                self.prefix[1],
                self.prefix[2],
                self.prefix[3],
                self.prefix[4],
            ]) as usize;
            if declared > self.guard.limit {
                return Err((self.guard.too_large)(declared, self.guard.limit));
            }
            if let Some((store, _)) = &self.guard.charge {
                self.receiving = Some(store.reserve_message(0)?);
            }
            self.messages += 1;
            self.remaining = declared;
            self.message_complete()?;
        }
        Ok(())
    }

    /// Once a message is whole: checks it, or hands its charge to the handler, in arrival
    /// order.
    fn message_complete(&mut self) -> Result<(), Error> {
        if self.remaining > 0 {
            return Ok(());
        }
        if let Some(check) = self.guard.check {
            check(&self.message)?;
            self.message.clear();
        }
        if let Some(receiving) = self.receiving.take()
            && let Some((_, inbound)) = &self.guard.charge
        {
            inbound.push_charge(receiving);
        }
        Ok(())
    }

    /// What a body that ends here (END_STREAM, or trailers) must have been: whole messages,
    /// and at least one where the method needs it.
    fn check_end(&self) -> Result<(), Error> {
        if self.prefix_len > 0 || self.remaining > 0 {
            return Err(Error::Undecodable(
                "the request ended in the middle of a gRPC message".to_owned(),
            ));
        }
        if self.guard.needs_message && self.messages == 0 {
            return Err(Error::Undecodable(
                "the request carried no message".to_owned(),
            ));
        }
        Ok(())
    }
}

impl HttpBody for GuardedBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if self.failed || self.done {
            return Poll::Ready(None);
        }
        match ready!(Pin::new(&mut self.inner).poll_frame(cx)) {
            Some(Ok(frame)) => {
                if let Some(data) = frame.data_ref() {
                    if let Some(call) = &self.call {
                        call.add_bytes_in(data.len() as u64);
                    }
                    if let Err(error) = self.scan(data) {
                        return self.fail(error);
                    }
                }
                // Trailers end a request as END_STREAM does (tonic stops reading there), so
                // they must find it whole too.
                if frame.is_trailers() {
                    if let Err(error) = self.check_end() {
                        return self.fail(error);
                    }
                    self.done = true;
                }
                Poll::Ready(Some(Ok(frame)))
            }
            // Whatever the transport says (tonic would take a CANCELLED here for a clean end).
            Some(Err(status)) => self.fail(Error::ClientGone(status.message().to_owned())),
            None => {
                if !self.inner.is_end_stream() {
                    return self.fail(Error::ClientGone(
                        "the request stream was reset or its connection closed before the \
                         client ended it"
                            .to_owned(),
                    ));
                }
                if let Err(error) = self.check_end() {
                    return self.fail(error);
                }
                self.done = true;
                Poll::Ready(None)
            }
        }
    }

    /// Only once this body has said its last word: tonic skips polling a body that claims to
    /// be over from the start (END_STREAM on the request headers), and the checks at the end
    /// must still run.
    fn is_end_stream(&self) -> bool {
        self.failed || self.done
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;
    use crate::flight::Scripted;

    fn body(guard: Guard, frames: Vec<Result<Bytes, Status>>, end_stream: bool) -> Body {
        let request = http::Request::new(Body::new(Scripted::new(frames, end_stream)));
        guard.apply(request).into_body()
    }

    fn put(frames: Vec<Result<Bytes, Status>>, end_stream: bool) -> (Body, Inbound) {
        let inbound = Inbound::default();
        let store = Store::new(
            Arc::new(crate::backend::HostBackend::new()),
            crate::store::StoreOptions::default(),
        );
        let guard = Guard {
            limit: 1 << 20,
            too_large: put_too_large,
            charge: Some((store, inbound.clone())),
            check: None,
            needs_message: false,
        };
        (body(guard, frames, end_stream), inbound)
    }

    fn message() -> Bytes {
        Bytes::from_static(&[0, 0, 0, 0, 3, 1, 2, 3])
    }

    async fn drain(body: Body) -> Result<(), Status> {
        body.collect().await.map(|_| ())
    }

    #[tokio::test]
    async fn a_stream_that_ends_without_end_stream_fails() {
        let (body, inbound) = put(vec![Ok(message())], false);
        let status = drain(body).await.expect_err("not a clean end");
        // Not CANCELLED: tonic would take that for a clean end of the request stream.
        assert_eq!(status.code(), Code::Aborted);
        assert!(matches!(inbound.take_failure(), Some(Error::ClientGone(_))));
    }

    #[tokio::test]
    async fn a_cancelled_transport_is_a_failure_not_an_end() {
        let (body, inbound) = put(vec![Ok(message()), Err(Status::cancelled("h2"))], true);
        let status = drain(body).await.expect_err("a failure");
        assert_ne!(status.code(), Code::Cancelled);
        assert!(matches!(inbound.take_failure(), Some(Error::ClientGone(_))));
    }

    #[tokio::test]
    async fn a_clean_end_passes_and_each_message_is_charged() {
        let (body, inbound) = put(vec![Ok(message()), Ok(message())], true);
        drain(body).await.expect("clean");
        assert_eq!(inbound.take_charge().map(|r| r.bytes()), Some(3));
        assert_eq!(inbound.take_charge().map(|r| r.bytes()), Some(3));
        assert!(inbound.take_failure().is_none());
    }

    #[tokio::test]
    async fn a_prefix_over_the_limit_fails_before_its_bytes_arrive() {
        let prefix = Bytes::from_static(&[0, 0xff, 0xff, 0xff, 0xff]);
        let (body, inbound) = put(vec![Ok(prefix)], false);
        let status = drain(body).await.expect_err("too large");
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert!(matches!(
            inbound.take_failure(),
            Some(Error::MessageTooLarge { .. })
        ));
    }

    #[tokio::test]
    async fn a_small_request_that_is_not_protobuf_is_invalid_argument() {
        let ticket = || Guard {
            limit: 1 << 10,
            too_large: request_too_large,
            charge: None,
            check: Some(decodes::<Ticket>),
            needs_message: true,
        };
        // Field 1, length-delimited, declaring 100 bytes where there are 2.
        let broken = Bytes::from_static(&[0, 0, 0, 0, 4, 0x0a, 100, 1, 2]);
        let status = drain(body(ticket(), vec![Ok(broken)], true))
            .await
            .expect_err("undecodable");
        assert_eq!(status.code(), Code::InvalidArgument);
        assert!(
            status
                .message()
                .starts_with("undecodable request: the request is not a valid Ticket protobuf"),
            "{status:?}"
        );
        let valid = Bytes::from_static(&[0, 0, 0, 0, 3, 0x0a, 1, b't']);
        drain(body(ticket(), vec![Ok(valid)], true))
            .await
            .expect("a ticket");
    }
}
