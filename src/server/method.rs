//! The Flight method a request calls, read once from its path by the outermost layer and left
//! in the request's extensions for the layers inside it.

use tonic::body::Body;

/// Where tonic routes the Flight service's requests; the method's name follows.
const SERVICE: &str = "/arrow.flight.protocol.FlightService/";

pub(super) use crate::auth::Method;

/// The method `request` calls: as an outer layer recorded it, else from its path.
pub(super) fn method_of(request: &http::Request<Body>) -> Method {
    match request.extensions().get::<Method>() {
        Some(method) => *method,
        None => of_path(request.uri().path()),
    }
}

fn of_path(path: &str) -> Method {
    match path.strip_prefix(SERVICE).unwrap_or_default() {
        "Handshake" => Method::Handshake,
        "ListFlights" => Method::ListFlights,
        "GetFlightInfo" => Method::GetFlightInfo,
        "PollFlightInfo" => Method::PollFlightInfo,
        "GetSchema" => Method::GetSchema,
        "DoGet" => Method::DoGet,
        "DoPut" => Method::DoPut,
        "DoExchange" => Method::DoExchange,
        "DoAction" => Method::DoAction,
        "ListActions" => Method::ListActions,
        _ => Method::Unknown,
    }
}
