//! The Flight method a request calls, read once from its path by the outermost layer and left
//! in the request's extensions for the layers inside it.

use tonic::body::Body;

/// Where tonic routes the Flight service's requests; the method's name follows.
const SERVICE: &str = "/arrow.flight.protocol.FlightService/";

/// The Flight methods, by the last segment of their path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Method {
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
    /// The method's name in the protocol, as logs, metrics and the role table name it.
    pub(super) fn name(self) -> &'static str {
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

    fn of_path(path: &str) -> Self {
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

    /// The method `request` calls: as an outer layer recorded it, else from its path.
    pub(super) fn of(request: &http::Request<Body>) -> Self {
        match request.extensions().get::<Self>() {
            Some(method) => *method,
            None => Self::of_path(request.uri().path()),
        }
    }
}
