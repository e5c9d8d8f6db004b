//! The gRPC service as tonic sees it: every Flight method routed here, before any handler runs.
//!
//! The service arrow-flight generates would do the routing, but it decides things a data
//! server on a network must decide itself, so each method is dispatched here instead:
//!
//! - **Message limits, checked at the length prefix.** Each method has a limit (`DoPut`:
//!   `--max-put-message-bytes`; every other request: `--max-request-bytes`). [`GuardedBody`]
//!   reads each gRPC message's 5-byte prefix as it arrives and refuses a declared length over the
//!   limit before tonic reserves a buffer for it; for `DoPut` it also charges each message's
//!   bytes to the memory budget as they arrive, and hands the charge to the handler with the
//!   message ([`Inbound`]).
//! - **A clean end, or no end.** Two layers below us turn a broken request stream into an
//!   ordinary end of it: hyper reports a stream reset with NO_ERROR (which is also how it
//!   abandons streams when a keepalive ping goes unanswered) as the end of the body, and tonic
//!   ends a request stream without error when its body fails with CANCELLED. A put would then
//!   commit what it had. So [`GuardedBody`] asks h2 whether END_STREAM really arrived, and
//!   reports every failure to tonic with a code tonic does not swallow.
//! - **Codes.** Undecodable protobuf is INVALID_ARGUMENT ([`StrictCodec`]), not INTERNAL.
//! - **Panics.** A handler that panics answers INTERNAL and logs an error; the server stays up.
//! - **Who is calling.** Every method but `Handshake` is authenticated here, and the caller's
//!   role checked against the method, before the request body is read: a refused call costs
//!   nothing. The [`Principal`] goes to the handler in the request's extensions (actions
//!   check their own role: `drop` needs write).
//! - **Accounting.** Each request opens a [`Call`], which logs and counts it when its reply
//!   ends, and counts as an open stream on its connection ([`ConnectionStreams`]) until then,
//!   which is what the idle timeout reads.
//!
//! `DoGet` goes to `doget::respond`, whose reply body hands hyper the Arrow buffers without
//! copying them; everything else is encoded with prost. `DoGet` reads its one ticket and
//! answers without waiting for the request's END_STREAM, so the checks [`GuardedBody`] makes
//! at the end of a request do not apply to it.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::Instant;

use arrow_flight::FlightData;
use arrow_flight::flight_service_server::FlightService;
use bytes::{Buf, Bytes};
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt, TryFutureExt};
use http_body::{Body as HttpBody, Frame, SizeHint};
use tonic::body::Body;
use tonic::codec::{Codec, DecodeBuf, Decoder};
use tonic::server::{Grpc, NamedService, ServerStreamingService, StreamingService, UnaryService};
use tonic::{Code, Request, Response, Status, Streaming};

use super::Service;
use super::call::Call;
use crate::auth::{ClientCertificate, Origin, Presented, Principal, Role};
use crate::error::Error;
use crate::store::Store;
use crate::store::memory::Reservation;
use crate::task::panic_message;

const SERVICE: &str = "/arrow.flight.protocol.FlightService/";

/// The Flight service, ready for `tonic::transport::Server::add_service`.
#[derive(Debug, Clone)]
pub struct FlightRouter {
    service: Arc<Service>,
}

impl FlightRouter {
    pub(super) fn new(service: Service) -> Self {
        Self {
            service: Arc::new(service),
        }
    }
}

impl NamedService for FlightRouter {
    const NAME: &'static str = "arrow.flight.protocol.FlightService";
}

/// Open streams on one connection and when the last one ended, shared between the router
/// (which counts requests) and the connection (which closes itself when idle too long).
#[derive(Debug)]
pub struct ConnectionStreams {
    open: AtomicUsize,
    last_active: Mutex<Instant>,
}

impl Default for ConnectionStreams {
    fn default() -> Self {
        Self {
            open: AtomicUsize::new(0),
            last_active: Mutex::new(Instant::now()),
        }
    }
}

impl ConnectionStreams {
    /// When the connection's last stream ended (or it was opened), if no stream is open now.
    pub fn idle_since(&self) -> Option<Instant> {
        if self.open.load(Ordering::Acquire) > 0 {
            return None;
        }
        Some(*self.last_active.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn begin(self: &Arc<Self>) -> OpenStream {
        self.open.fetch_add(1, Ordering::AcqRel);
        OpenStream(Arc::clone(self))
    }
}

/// What the router learns of a request's connection (tonic's connect info).
#[derive(Debug, Clone)]
pub struct ConnectionInfo {
    pub streams: Arc<ConnectionStreams>,
    pub peer: Peer,
    /// The client's certificate, verified by mutual TLS.
    pub certificate: Option<Arc<ClientCertificate>>,
}

impl ConnectionInfo {
    /// Where failed authentication from this connection is counted.
    pub fn origin(&self) -> Origin {
        match self.peer {
            Peer::Tcp(address) => Origin::Ip(address.ip()),
            Peer::Unix { uid, .. } => Origin::UnixUser(uid),
        }
    }
}

/// Who is at the other end of a connection, as logs name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    Tcp(SocketAddr),
    /// A Unix socket's peer: its process and user, as the kernel reports them.
    Unix {
        pid: Option<i32>,
        uid: Option<u32>,
    },
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Tcp(address) => address.fmt(f),
            Self::Unix { pid, uid } => {
                f.write_str("unix")?;
                if let Some(pid) = pid {
                    write!(f, " pid={pid}")?;
                }
                if let Some(uid) = uid {
                    write!(f, " uid={uid}")?;
                }
                Ok(())
            }
        }
    }
}

/// One request counted as open on its connection until dropped.
#[derive(Debug)]
struct OpenStream(Arc<ConnectionStreams>);

impl Drop for OpenStream {
    fn drop(&mut self) {
        *self.0.last_active.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        self.0.open.fetch_sub(1, Ordering::AcqRel);
    }
}

impl tower_service::Service<http::Request<Body>> for FlightRouter {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut request: http::Request<Body>) -> Self::Future {
        let connection = request.extensions().get::<ConnectionInfo>().cloned();
        let open = connection.as_ref().map(|c| c.streams.begin());
        let service = Arc::clone(&self.service);
        let method = Method::of(request.uri().path());
        let call = Call::new(
            method.name(),
            connection.as_ref().map(|c| c.peer),
            service.options.progress_interval,
            service.metrics.clone(),
        );
        Box::pin(async move {
            let response = match authorize(&service, method, &request, connection.as_ref()) {
                Ok(principal) => {
                    if let Some(principal) = principal {
                        call.set_principal(Arc::clone(&principal.name));
                        request.extensions_mut().insert(principal);
                    }
                    request.extensions_mut().insert(Arc::clone(&call));
                    route(service, method, request).await
                }
                Err(error) => Status::from(error).into_http(),
            };
            // An error before any reply is sent travels in the headers (trailers-only).
            if let Some(status) = Status::from_header_map(response.headers()) {
                call.set_status(status.code(), status.message());
            }
            // The stream stays open until its response body is done (or dropped).
            Ok(response.map(|body| {
                Body::new(Tracked {
                    body,
                    call,
                    _open: open,
                })
            }))
        })
    }
}

/// The Flight methods, by the last segment of their path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Method {
    Handshake,
    ListFlights,
    GetFlightInfo,
    PollFlightInfo,
    GetSchema,
    DoGet,
    DoPut,
    DoExchange,
    DoAction,
    ListActions,
    Unknown,
}

impl Method {
    fn name(self) -> &'static str {
        match self {
            Self::Handshake => "Handshake",
            Self::ListFlights => "ListFlights",
            Self::GetFlightInfo => "GetFlightInfo",
            Self::PollFlightInfo => "PollFlightInfo",
            Self::GetSchema => "GetSchema",
            Self::DoGet => "DoGet",
            Self::DoPut => "DoPut",
            Self::DoExchange => "DoExchange",
            Self::DoAction => "DoAction",
            Self::ListActions => "ListActions",
            Self::Unknown => "unknown",
        }
    }

    /// The role a caller needs for this method; `None` for Handshake, which is how callers
    /// authenticate. `DoAction` needs read here; each action checks its own role.
    fn role(self) -> Option<Role> {
        match self {
            Self::Handshake => None,
            Self::DoPut | Self::DoExchange => Some(Role::Write),
            Self::ListFlights
            | Self::GetFlightInfo
            | Self::PollFlightInfo
            | Self::GetSchema
            | Self::DoGet
            | Self::DoAction
            | Self::ListActions
            | Self::Unknown => Some(Role::Read),
        }
    }

    fn of(path: &str) -> Self {
        match path.strip_prefix(SERVICE).unwrap_or_default() {
            "Handshake" => Self::Handshake,
            "ListFlights" => Self::ListFlights,
            "GetFlightInfo" => Self::GetFlightInfo,
            "PollFlightInfo" => Self::PollFlightInfo,
            "GetSchema" => Self::GetSchema,
            "DoGet" => Self::DoGet,
            "DoPut" => Self::DoPut,
            "DoExchange" => Self::DoExchange,
            "DoAction" => Self::DoAction,
            "ListActions" => Self::ListActions,
            _ => Self::Unknown,
        }
    }
}

/// The caller of `request`, allowed to call `method`; `None` for Handshake.
fn authorize(
    service: &Service,
    method: Method,
    request: &http::Request<Body>,
    connection: Option<&ConnectionInfo>,
) -> Result<Option<Principal>, Error> {
    let Some(needed) = method.role() else {
        return Ok(None);
    };
    let presented = Presented {
        authorization: request
            .headers()
            .get(http::header::AUTHORIZATION)
            .map(http::HeaderValue::as_bytes),
        certificate: connection.and_then(|c| c.certificate.as_deref()),
        origin: connection.map(ConnectionInfo::origin),
    };
    let principal = service.auth.authenticate(&presented)?;
    principal.require(needed, method.name())?;
    Ok(Some(principal))
}

async fn route(
    service: Arc<Service>,
    method: Method,
    request: http::Request<Body>,
) -> http::Response<Body> {
    let service = &service;
    match method {
        Method::DoPut => {
            let inbound = Inbound::default();
            let limit = service.options.max_put_message_bytes;
            let charge = Some((service.store.clone(), inbound.clone()));
            let mut request = guard(request, limit, put_too_large, charge, false);
            request.extensions_mut().insert(inbound);
            grpc::<arrow_flight::PutResult, FlightData>(limit)
                .streaming(
                    stream_handler(service, |s, r| async move { s.do_put(r).await }.boxed()),
                    request,
                )
                .await
        }
        Method::DoGet => super::doget::respond(service, request).await,
        Method::GetFlightInfo => {
            unary(service, request, |s, r| {
                async move { s.get_flight_info(r).await }.boxed()
            })
            .await
        }
        Method::PollFlightInfo => {
            unary(service, request, |s, r| {
                async move { s.poll_flight_info(r).await }.boxed()
            })
            .await
        }
        Method::GetSchema => {
            unary(service, request, |s, r| {
                async move { s.get_schema(r).await }.boxed()
            })
            .await
        }
        Method::ListFlights => {
            listing(service, request, |s, r| {
                async move { s.list_flights(r).await }.boxed()
            })
            .await
        }
        Method::DoAction => {
            listing(service, request, |s, r| {
                async move { s.do_action(r).await }.boxed()
            })
            .await
        }
        Method::ListActions => {
            listing(service, request, |s, r| {
                async move { s.list_actions(r).await }.boxed()
            })
            .await
        }
        Method::Handshake => {
            exchange(service, request, |s, r| {
                async move { s.handshake(r).await }.boxed()
            })
            .await
        }
        Method::DoExchange => {
            exchange(service, request, |s, r| {
                async move { s.do_exchange(r).await }.boxed()
            })
            .await
        }
        Method::Unknown => Status::unimplemented(
            "no such method; gpu-flight serves arrow.flight.protocol.FlightService",
        )
        .into_http(),
    }
}

/// A unary method, its request bounded by `--max-request-bytes`.
async fn unary<Req, Res>(
    service: &Arc<Service>,
    request: http::Request<Body>,
    call: HandlerFn<Req, Res>,
) -> http::Response<Body>
where
    Req: prost::Message + Default + Send + 'static,
    Res: prost::Message + Send + 'static,
{
    let limit = service.options.max_request_bytes;
    let request = guard(request, limit, request_too_large, None, true);
    grpc::<Res, Req>(limit)
        .unary(handler(service, call), request)
        .await
}

/// A method with one small request and a stream of replies.
async fn listing<Req, T>(
    service: &Arc<Service>,
    request: http::Request<Body>,
    call: HandlerFn<Req, ReplyStream<T>>,
) -> http::Response<Body>
where
    Req: prost::Message + Default + Send + 'static,
    T: prost::Message + Send + 'static,
{
    let limit = service.options.max_request_bytes;
    let request = guard(request, limit, request_too_large, None, true);
    grpc::<T, Req>(limit)
        .server_streaming(stream_handler(service, call), request)
        .await
}

/// A method streaming both ways, other than `DoPut`: its messages are small.
async fn exchange<Req, T>(
    service: &Arc<Service>,
    request: http::Request<Body>,
    call: HandlerFn<Streaming<Req>, ReplyStream<T>>,
) -> http::Response<Body>
where
    Req: prost::Message + Default + Send + 'static,
    T: prost::Message + Send + 'static,
{
    let limit = service.options.max_request_bytes;
    let request = guard(request, limit, request_too_large, None, false);
    grpc::<T, Req>(limit)
        .streaming(stream_handler(service, call), request)
        .await
}

/// A tonic server for one method, with decoding bounded by `limit` (which [`GuardedBody`] has
/// already enforced with a better message; tonic's check is the backstop).
fn grpc<E, D>(limit: usize) -> Grpc<StrictCodec<E, D>>
where
    E: prost::Message + Send + 'static,
    D: prost::Message + Default + Send + 'static,
{
    Grpc::new(StrictCodec(PhantomData)).apply_max_message_size_config(Some(limit), Some(usize::MAX))
}

fn put_too_large(declared: usize, limit: usize) -> Error {
    Error::MessageTooLarge {
        declared,
        limit,
        flag: "--max-put-message-bytes",
        hint: "write smaller record batches (pyarrow: writer.write_table(table, max_chunksize=...))",
    }
}

pub(super) fn request_too_large(declared: usize, limit: usize) -> Error {
    Error::RequestTooLarge {
        declared,
        limit,
        flag: "--max-request-bytes",
    }
}

/// Wraps the request body in a [`GuardedBody`].
pub(super) fn guard(
    request: http::Request<Body>,
    limit: usize,
    too_large: fn(usize, usize) -> Error,
    charge: Option<(Store, Inbound)>,
    needs_message: bool,
) -> http::Request<Body> {
    let call = request.extensions().get::<Arc<Call>>().cloned();
    request.map(|body| {
        Body::new(GuardedBody {
            inner: body,
            call,
            limit,
            too_large,
            charge,
            needs_message,
            messages: 0,
            receiving: None,
            done: false,
            prefix: [0; 5],
            prefix_len: 0,
            remaining: 0,
            failed: false,
        })
    })
}

/// A handler as tonic's server traits want it, with panics turned into INTERNAL. Function
/// pointers rather than closures, and generic over message types only: the compiler cannot
/// prove `Send` for futures holding closures or `dyn` types among these generics.
struct Handler<Req, Res> {
    service: Arc<Service>,
    call: HandlerFn<Req, Res>,
}

/// [`Handler`] for methods that reply with a stream of `T`, whose polling must not unwind into
/// tonic either.
struct StreamHandler<Req, T> {
    service: Arc<Service>,
    call: HandlerFn<Req, ReplyStream<T>>,
}

fn handler<Req, Res>(service: &Arc<Service>, call: HandlerFn<Req, Res>) -> Handler<Req, Res> {
    Handler {
        service: Arc::clone(service),
        call,
    }
}

fn stream_handler<Req, T>(
    service: &Arc<Service>,
    call: HandlerFn<Req, ReplyStream<T>>,
) -> StreamHandler<Req, T> {
    StreamHandler {
        service: Arc::clone(service),
        call,
    }
}

pub(super) type ReplyStream<T> = futures::stream::BoxStream<'static, Result<T, Status>>;
pub(super) type Reply<Res> = BoxFuture<'static, Result<Response<Res>, Status>>;
/// A handler: what runs for one request, given the service.
pub(super) type HandlerFn<Req, Res> = fn(Arc<Service>, Request<Req>) -> Reply<Res>;

fn contain_panics<Res: 'static>(future: Reply<Res>) -> Reply<Res> {
    AssertUnwindSafe(future)
        .catch_unwind()
        .map(|result| result.unwrap_or_else(|panic| Err(panicked(panic.as_ref()))))
        .boxed()
}

fn contain_stream_panics<T: Send + 'static>(
    future: Reply<ReplyStream<T>>,
) -> Reply<ReplyStream<T>> {
    contain_panics(future)
        .map_ok(|response| {
            response.map(|stream| {
                AssertUnwindSafe(stream)
                    .catch_unwind()
                    .map(|item| item.unwrap_or_else(|panic| Err(panicked(panic.as_ref()))))
                    .boxed()
            })
        })
        .boxed()
}

impl<Req, Res: 'static> UnaryService<Req> for Handler<Req, Res> {
    type Response = Res;
    type Future = Reply<Res>;

    fn call(&mut self, request: Request<Req>) -> Reply<Res> {
        contain_panics((self.call)(Arc::clone(&self.service), request))
    }
}

impl<Req, T: Send + 'static> ServerStreamingService<Req> for StreamHandler<Req, T> {
    type Response = T;
    type ResponseStream = ReplyStream<T>;
    type Future = Reply<ReplyStream<T>>;

    fn call(&mut self, request: Request<Req>) -> Self::Future {
        contain_stream_panics((self.call)(Arc::clone(&self.service), request))
    }
}

impl<Req, T: Send + 'static> StreamingService<Req> for StreamHandler<Streaming<Req>, T> {
    type Response = T;
    type ResponseStream = ReplyStream<T>;
    type Future = Reply<ReplyStream<T>>;

    fn call(&mut self, request: Request<Streaming<Req>>) -> Self::Future {
        contain_stream_panics((self.call)(Arc::clone(&self.service), request))
    }
}

pub(super) fn panicked(panic: &(dyn std::any::Any + Send)) -> Status {
    let reason = panic_message(panic);
    tracing::error!(reason = %reason.escape_debug(), "a request handler panicked");
    Status::from(Error::Internal(format!(
        "a request handler panicked: {reason}"
    )))
}

/// Prost decoding that calls undecodable bytes the client's mistake.
pub(crate) struct StrictCodec<E, D>(PhantomData<fn(E) -> D>);

impl<E, D> Codec for StrictCodec<E, D>
where
    E: prost::Message + Send + 'static,
    D: prost::Message + Default + Send + 'static,
{
    type Encode = E;
    type Decode = D;
    type Encoder = <tonic_prost::ProstCodec<E, D> as Codec>::Encoder;
    type Decoder = StrictDecoder<D>;

    fn encoder(&mut self) -> Self::Encoder {
        tonic_prost::ProstCodec::<E, D>::default().encoder()
    }

    fn decoder(&mut self) -> Self::Decoder {
        StrictDecoder(PhantomData)
    }
}

pub(crate) struct StrictDecoder<D>(PhantomData<fn() -> D>);

impl<D> Default for StrictDecoder<D> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<D: prost::Message + Default> Decoder for StrictDecoder<D> {
    type Item = D;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<D>, Status> {
        D::decode(buf).map(Some).map_err(|error| {
            Status::from(Error::Undecodable(format!(
                "the request is not a valid {} protobuf message: {error}",
                std::any::type_name::<D>()
                    .rsplit("::")
                    .next()
                    .unwrap_or("Flight")
            )))
        })
    }
}

/// What the router learned about a `DoPut` body that its handler needs: the reservations paid
/// for each message, in arrival order, and why the body failed if it did.
#[derive(Debug, Clone, Default)]
pub(crate) struct Inbound(Arc<Mutex<InboundState>>);

#[derive(Debug, Default)]
struct InboundState {
    charges: VecDeque<Reservation>,
    failure: Option<Error>,
}

impl Inbound {
    fn lock(&self) -> std::sync::MutexGuard<'_, InboundState> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The reservation for the next message the handler receives.
    pub(crate) fn take_charge(&self) -> Option<Reservation> {
        self.lock().charges.pop_front()
    }

    /// Why the body failed, if [`GuardedBody`] failed it (rather than the transport).
    pub(crate) fn take_failure(&self) -> Option<Error> {
        self.lock().failure.take()
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
    limit: usize,
    too_large: fn(usize, usize) -> Error,
    charge: Option<(Store, Inbound)>,
    /// Whether the method needs at least one message (unary requests): tonic reports a body
    /// without one as INTERNAL.
    needs_message: bool,
    messages: usize,
    /// `DoPut`: the bytes received of the current message, grown as they arrive (a length
    /// prefix alone reserves nothing: a client pays for what it really sent).
    receiving: Option<Reservation>,
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
        match &self.charge {
            Some((_, inbound)) => inbound.lock().failure = Some(error),
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
                data.advance(n);
                if let (Some(receiving), Some((store, _))) = (&mut self.receiving, &self.charge) {
                    store.grow_message(receiving, n as u64)?;
                }
                self.message_complete();
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
            if declared > self.limit {
                return Err((self.too_large)(declared, self.limit));
            }
            if let Some((store, _)) = &self.charge {
                self.receiving = Some(store.reserve_message(0)?);
            }
            self.messages += 1;
            self.remaining = declared;
            self.message_complete();
        }
        Ok(())
    }

    /// Hands a fully received message's charge to the handler, in arrival order.
    fn message_complete(&mut self) {
        if self.remaining == 0
            && let Some(receiving) = self.receiving.take()
            && let Some((_, inbound)) = &self.charge
        {
            inbound.lock().charges.push_back(receiving);
        }
    }

    /// What a body that ends here (END_STREAM, or trailers) must have been: whole messages,
    /// and at least one where the method needs it.
    fn check_end(&self) -> Result<(), Error> {
        if self.prefix_len > 0 || self.remaining > 0 {
            return Err(Error::Undecodable(
                "the request ended in the middle of a gRPC message".to_owned(),
            ));
        }
        if self.needs_message && self.messages == 0 {
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

/// A response body that holds its request's [`OpenStream`] and [`Call`] until it is done,
/// counting the bytes sent and reading the final status from the trailers.
struct Tracked {
    body: Body,
    call: Arc<Call>,
    _open: Option<OpenStream>,
}

impl HttpBody for Tracked {
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

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use http_body_util::BodyExt;

    use super::*;

    /// A request body that yields `frames`, then ends; `end_stream` is what h2 would say about
    /// whether END_STREAM arrived.
    struct Scripted {
        frames: VecDeque<Result<Bytes, Status>>,
        end_stream: bool,
    }

    impl HttpBody for Scripted {
        type Data = Bytes;
        type Error = Status;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
            Poll::Ready(self.frames.pop_front().map(|f| f.map(Frame::data)))
        }

        fn is_end_stream(&self) -> bool {
            self.frames.is_empty() && self.end_stream
        }
    }

    fn guarded(frames: Vec<Result<Bytes, Status>>, end_stream: bool) -> (GuardedBody, Inbound) {
        let inbound = Inbound::default();
        let store = Store::new(
            Arc::new(crate::backend::HostBackend::new()),
            crate::store::StoreOptions::default(),
        );
        let body = GuardedBody {
            inner: Body::new(Scripted {
                frames: frames.into(),
                end_stream,
            }),
            call: None,
            limit: 1 << 20,
            too_large: put_too_large,
            charge: Some((store, inbound.clone())),
            needs_message: false,
            messages: 0,
            receiving: None,
            done: false,
            prefix: [0; 5],
            prefix_len: 0,
            remaining: 0,
            failed: false,
        };
        (body, inbound)
    }

    fn message() -> Bytes {
        Bytes::from_static(&[0, 0, 0, 0, 3, 1, 2, 3])
    }

    async fn drain(body: GuardedBody) -> Result<(), Status> {
        body.collect().await.map(|_| ())
    }

    #[tokio::test]
    async fn a_stream_that_ends_without_end_stream_fails() {
        let (body, inbound) = guarded(vec![Ok(message())], false);
        let status = drain(body).await.expect_err("not a clean end");
        // Not CANCELLED: tonic would take that for a clean end of the request stream.
        assert_eq!(status.code(), Code::Aborted);
        assert!(matches!(inbound.take_failure(), Some(Error::ClientGone(_))));
    }

    #[tokio::test]
    async fn a_cancelled_transport_is_a_failure_not_an_end() {
        let (body, inbound) = guarded(vec![Ok(message()), Err(Status::cancelled("h2"))], true);
        let status = drain(body).await.expect_err("a failure");
        assert_ne!(status.code(), Code::Cancelled);
        assert!(matches!(inbound.take_failure(), Some(Error::ClientGone(_))));
    }

    #[tokio::test]
    async fn a_clean_end_passes_and_each_message_is_charged() {
        let (body, inbound) = guarded(vec![Ok(message()), Ok(message())], true);
        drain(body).await.expect("clean");
        assert_eq!(inbound.take_charge().map(|r| r.bytes()), Some(3));
        assert_eq!(inbound.take_charge().map(|r| r.bytes()), Some(3));
        assert!(inbound.take_failure().is_none());
    }

    #[tokio::test]
    async fn a_prefix_over_the_limit_fails_before_its_bytes_arrive() {
        let prefix = Bytes::from_static(&[0, 0xff, 0xff, 0xff, 0xff]);
        let (body, inbound) = guarded(vec![Ok(prefix)], false);
        let status = drain(body).await.expect_err("too large");
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert!(matches!(
            inbound.take_failure(),
            Some(Error::MessageTooLarge { .. })
        ));
    }
}
