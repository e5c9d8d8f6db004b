//! The gRPC service as tonic sees it: `DoGet` through [`FlightDataCodec`], which writes Arrow
//! buffers into frames with one copy; every other method through the service arrow-flight
//! generates from the Flight protocol definition.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use arrow_flight::Ticket;
use arrow_flight::flight_service_server::FlightServiceServer;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use tonic::body::Body;
use tonic::server::{Grpc, NamedService, ServerStreamingService};
use tonic::{Request, Response, Status};

use super::Service;
use super::ipc_message::{FlightDataCodec, IpcMessage};

const DO_GET_PATH: &str = "/arrow.flight.protocol.FlightService/DoGet";

/// The Flight service, ready for `tonic::transport::Server::add_service`.
#[derive(Debug, Clone)]
pub struct FlightRouter {
    generated: FlightServiceServer<Service>,
    service: Arc<Service>,
}

impl FlightRouter {
    pub(super) fn new(service: Service) -> Self {
        let service = Arc::new(service);
        // Clients' messages may be any size (pyarrow sends a record batch as one message).
        let generated = FlightServiceServer::from_arc(Arc::clone(&service))
            .max_decoding_message_size(usize::MAX)
            .max_encoding_message_size(usize::MAX);
        Self { generated, service }
    }
}

impl NamedService for FlightRouter {
    const NAME: &'static str = "arrow.flight.protocol.FlightService";
}

impl tower_service::Service<http::Request<Body>> for FlightRouter {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        if request.uri().path() != DO_GET_PATH {
            return self.generated.call(request);
        }
        let method = DoGet(Arc::clone(&self.service));
        Box::pin(async move {
            let mut grpc =
                Grpc::new(FlightDataCodec).apply_max_message_size_config(None, Some(usize::MAX));
            Ok(grpc.server_streaming(method, request).await)
        })
    }
}

struct DoGet(Arc<Service>);

impl ServerStreamingService<Ticket> for DoGet {
    type Response = IpcMessage;
    type ResponseStream = BoxStream<'static, Result<IpcMessage, Status>>;
    type Future = BoxFuture<'static, Result<Response<Self::ResponseStream>, Status>>;

    fn call(&mut self, request: Request<Ticket>) -> Self::Future {
        let service = Arc::clone(&self.0);
        Box::pin(async move { Ok(Response::new(service.do_get_stream(request.get_ref())?)) })
    }
}
