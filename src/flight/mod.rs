//! The Arrow Flight protocol: the `FlightService` implementation and the pieces it parses.
//!
//! Handlers are thin: parse the request (descriptor, ticket or action), call the store, encode
//! the answer. Each returns `Result<_, Error>` internally and converts once, in
//! `crate::error`, to the gRPC status a client sees. The server serves them through
//! arrow-flight's generated `FlightServiceServer`, behind layers (`crate::server`) that bound
//! requests, authenticate callers, contain panics and account for each call: a handler finds
//! the caller ([`Principal`]), its `Call` and, for `DoPut`, the `Inbound` ledger in the
//! request's extensions.
//!
//! - [`descriptor`]: dataset names and `DoPut` commands.
//! - [`ticket`]: the tickets `GetFlightInfo` issues and `DoGet` reads.
//! - [`action`]: the custom actions (`drop`, `status`, `ipc-export`, `ipc-release`,
//!   `lease-renew`, `shm-read`, `ipc-import`, `move`, `copy`).
//! - [`ipc_export`]: the document `ipc-export` returns (and Rust consumers parse), and the one
//!   `ipc-import` takes; `ipc_import`: a producer's GPU columns committed as a put.
//! - `put`, `put_stream` and `decode`: the `DoPut` ingest loop, its messages read from the
//!   HTTP/2 frames with one copy (the `do_put` handler reads them through tonic's codec), and
//!   the checked decoding of each.
//! - `read`: what a `DoGet` ticket reads; `doget`: the framed fast path that sends it without
//!   copying (the `do_get` handler is the plain encoder, arrow-flight's).
//! - `shared`: `shm-read`, the same read staged in shared memory for a process on this node.
//! - [`sql`]: Flight SQL (ADBC): the catalog, SELECT statements, bulk ingestion.
//! - `lifecycle`: shutdown, and the streams it waits for.
//! - `call`: each call's log line, progress and metrics.
//! - `stages`: where streaming time goes (staging, encoding, waiting for the client), as
//!   `status` shows it.

pub mod action;
mod call;
mod decode;
pub mod descriptor;
pub(crate) mod doget;
pub mod ipc_export;
mod ipc_import;
mod lifecycle;
mod message_size;
pub(crate) mod put;
mod put_stream;
mod read;
mod shared;
pub mod sql;
mod stages;
pub mod ticket;

use std::ops::Range;
use std::sync::Arc;

use arrow::ipc::writer::IpcWriteOptions;
use arrow_flight::encode::{DictionaryHandling, FlightDataEncoderBuilder};
use arrow_flight::error::FlightError;
use arrow_flight::flight_service_server::FlightService;
use arrow_flight::{
    Action, ActionType, Criteria, Empty, FlightData, FlightDescriptor, FlightEndpoint, FlightInfo,
    HandshakeRequest, HandshakeResponse, PollInfo, PutResult, SchemaAsIpc, SchemaResult, Ticket,
};
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use tonic::{Request, Response, Status, Streaming};

use crate::auth::{self, Auth, Operation, Origin, Principal};
use crate::backend::ExportDevice;
use crate::error::Error;
use crate::store::{Dataset, ExportRequest, SharedLimits, Store};
use action::ActionRequest;
pub(crate) use call::Call;
pub use decode::MAX_BATCH_ROWS;
use descriptor::ReadOptions;
pub use lifecycle::{Lifecycle, StreamGuard};
use prost::Message;
pub(crate) use put_stream::Inbound;
#[cfg(test)]
pub(crate) use put_stream::Scripted;
pub use shared::{MAX_SHARED_FILES, default_writers};
pub use stages::{DoGetStages, PutStages, StagesDocument};
use ticket::{DatasetMetadata, EndpointMetadata};

/// The Flight specification's actions on a `FlightInfo`'s endpoints.
const CANCEL_FLIGHT_INFO: &str = "CancelFlightInfo";
const RENEW_FLIGHT_ENDPOINT: &str = "RenewFlightEndpoint";

/// The location that means "the server and connection this came from".
const REUSE_CONNECTION: &str = "arrow-flight-reuse-connection://?";

/// What Handshake answers on a server without authentication, where tokens are not checked.
const UNCHECKED_TOKEN: &str = "unauthenticated";

/// Most endpoints one `GetFlightInfo` reply lists (about 100 bytes each).
const MAX_ENDPOINTS: u64 = 4096;

/// Most bytes the column lists of a projection's tickets add to a `GetFlightInfo` reply: each
/// ticket repeats the list, so a wide projection is read through fewer endpoints.
const MAX_PROJECTION_BYTES: u64 = 1 << 20;

/// The largest `DoGet` message by default: as large as every gRPC client takes without raising
/// its receive limit (4 MiB by default in grpc-core, grpc-java, grpc-go and tonic), less 64 KiB
/// of slack (the framed reply measures each message exactly; the slack is for any client that
/// counts a message otherwise). A client pays per message, not only per byte: reading strings
/// from the host backend, pyarrow's client spent about a quarter less CPU per GB in messages of
/// this size than in the 2 MiB ones sent before (docs/performance-notes.md, run (w)).
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = (4 << 20) - (64 << 10);

/// What a `GetFlightInfo` reply adds to the dataset's schema at most: its endpoints
/// ([`MAX_ENDPOINTS`], about 100 bytes each), their projection lists
/// ([`MAX_PROJECTION_BYTES`]) and the caller's descriptor.
const INFO_ROOM_BYTES: usize = 2 << 20;

/// The largest schema message a put may carry: within `max_message_bytes` (`DoGet` sends it as
/// one message), leaving [`INFO_ROOM_BYTES`] of that limit to what a `GetFlightInfo` reply adds
/// to the schema, but always 2 MiB where the limit allows it, as when the limit was 2 MiB. At
/// the default limit a schema takes 2 MiB, so that every reply carrying one stays under the
/// 4 MiB that clients take by default.
pub(crate) fn schema_limit(max_message_bytes: usize) -> usize {
    max_message_bytes.min(
        max_message_bytes
            .saturating_sub(INFO_ROOM_BYTES)
            .max(2 << 20),
    )
}

/// Protocol settings.
#[derive(Debug, Clone)]
pub struct FlightOptions {
    /// Where clients reach this server (`--advertise-uri`): every endpoint's locations.
    pub advertise: Vec<String>,
    /// Rows per endpoint in `GetFlightInfo`, so clients can read partitions in parallel.
    pub rows_per_endpoint: u64,
    /// Largest FlightData message `DoGet` sends.
    pub max_message_bytes: usize,
    /// Bytes a `DoGet` reads from the backend at a time (one device-to-host copy).
    pub read_chunk_bytes: u64,
    /// Chunk reads kept in flight ahead of the encoder.
    pub read_prefetch: usize,
    /// `DoGet` messages encoded ahead of the connection (the framed reply).
    pub doget_encode_ahead: usize,
    /// `DoPut` batches being uploaded while more are received.
    pub put_pipeline_depth: usize,
    /// Largest `DoPut` message accepted (`--max-put-message-bytes`).
    pub max_put_message_bytes: usize,
    /// Largest message of any other request: tickets, descriptors, actions
    /// (`--max-request-bytes`).
    pub max_request_bytes: usize,
    /// Time between progress lines of a long call (`--progress-seconds`).
    pub progress_interval: std::time::Duration,
    /// Whether filters run where the rows live when the backend can (`--filter-on`).
    pub filter_on_device: bool,
    /// `shm-read`: its side channel and limits.
    pub shared_memory: SharedMemoryOptions,
    /// `ipc-export` leases one principal may hold at once (`--ipc-max-leases`).
    pub max_export_leases: u32,
}

/// Shared-memory reads (`shm-read`).
#[derive(Debug, Clone, Default)]
pub struct SharedMemoryOptions {
    /// The Unix socket consumers fetch their files' descriptors from (`--shm-socket`), which
    /// the server fills in once it listens there; `None`: the server offers no shared memory.
    pub socket: Option<std::path::PathBuf>,
    pub limits: SharedLimits,
    /// Files a read is written as at most, at once (`--shm-writers`, hidden); `None`: as
    /// [`shared::default_writers`] says.
    pub writers: Option<usize>,
}

impl Default for FlightOptions {
    fn default() -> Self {
        Self {
            advertise: Vec::new(),
            rows_per_endpoint: 1 << 20,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            read_chunk_bytes: 16 << 20,
            read_prefetch: 2,
            doget_encode_ahead: 4,
            put_pipeline_depth: 4,
            max_put_message_bytes: 1 << 30,
            max_request_bytes: 64 << 10,
            progress_interval: std::time::Duration::from_secs(5),
            filter_on_device: true,
            shared_memory: SharedMemoryOptions::default(),
            max_export_leases: crate::store::DEFAULT_MAX_EXPORT_LEASES,
        }
    }
}

/// The Flight handlers over `store`: replies bounded by `options.max_message_bytes`, `Handshake`
/// answered through `auth`, refusals once `lifecycle` shuts down.
#[derive(Debug)]
pub(crate) struct Service {
    store: Store,
    options: FlightOptions,
    lifecycle: Lifecycle,
    auth: Auth,
    prepared: sql::Prepared,
    stages: Arc<stages::Stages>,
}

/// Refuses `what` unless the call came from this node: over a Unix socket, or from a loopback
/// address (an unknown origin is refused).
fn from_this_node(origin: Option<Origin>, what: &'static str) -> Result<(), Error> {
    match origin {
        Some(Origin::UnixUser(_)) => Ok(()),
        // `to_canonical`: a dual-stack listener sees 127.0.0.1 as ::ffff:127.0.0.1.
        Some(Origin::Ip(ip)) if ip.to_canonical().is_loopback() => Ok(()),
        _ => Err(Error::NotOnThisNode(what)),
    }
}

impl Service {
    pub(crate) fn new(
        store: Store,
        options: FlightOptions,
        lifecycle: Lifecycle,
        auth: Auth,
    ) -> Self {
        Self {
            store,
            options,
            lifecycle,
            auth,
            prepared: sql::Prepared::default(),
            stages: Arc::default(),
        }
    }
}

/// The caller, as the server's authentication layer found them. A request without one did not
/// come through that layer, and is refused rather than trusted.
fn principal<T>(request: &Request<T>) -> Result<Principal, Error> {
    request
        .extensions()
        .get::<Principal>()
        .cloned()
        .ok_or_else(|| Error::Internal("a request reached a handler unauthenticated".to_owned()))
}

/// The call's record, where the accounting layer opened one.
fn call<T>(request: &Request<T>) -> Option<Arc<Call>> {
    request.extensions().get::<Arc<Call>>().cloned()
}

type Stream<T> = BoxStream<'static, Result<T, Status>>;

/// The head and body of a request served past tonic's generated server (`DoGet`, `DoPut`), or
/// the reply refusing it where it is compressed ([`unsupported_encoding`]).
fn uncompressed(
    request: http::Request<tonic::body::Body>,
) -> Result<(http::request::Parts, tonic::body::Body), Box<http::Response<tonic::body::Body>>> {
    match unsupported_encoding(request.headers()) {
        Some(refused) => Err(Box::new(refused.into_http())),
        None => Ok(request.into_parts()),
    }
}

/// A request compressed with anything but `identity` is UNIMPLEMENTED, naming the encoding
/// this server accepts, as gRPC asks (and as tonic answers for the other methods).
fn unsupported_encoding(headers: &http::HeaderMap) -> Option<Status> {
    let encoding = headers.get("grpc-encoding")?;
    if encoding.as_bytes() == b"identity" {
        return None;
    }
    let mut metadata = tonic::metadata::MetadataMap::new();
    metadata.insert(
        "grpc-accept-encoding",
        tonic::metadata::MetadataValue::from_static("identity"),
    );
    Some(Status::with_metadata(
        tonic::Code::Unimplemented,
        format!(
            "the request is compressed with {:?}, which this server does not accept; send it \
             uncompressed",
            String::from_utf8_lossy(encoding.as_bytes())
        ),
        metadata,
    ))
}

impl Service {
    fn ensure_serving(&self) -> Result<(), Error> {
        if self.lifecycle.is_shutting_down() {
            Err(Error::ShuttingDown)
        } else {
            Ok(())
        }
    }

    /// A whole `DoPut`, whichever reader its messages come from, and the one result it answers.
    async fn put(
        &self,
        request: Request<impl put_stream::PutMessages>,
    ) -> Result<PutResult, Error> {
        self.ensure_serving()?;
        let _running = self.lifecycle.track();
        let caller = principal(&request)?;
        let metadata = match put::receive(self, request, &caller).await? {
            put::Answer::Put(summary) => serde_json::to_vec(&summary)
                .map_err(|e| Error::Internal(format!("encoding put summary: {e}")))?,
            put::Answer::Ingested(summary) => arrow_flight::sql::DoPutUpdateResult {
                record_count: i64::try_from(summary.rows).unwrap_or(i64::MAX),
            }
            .encode_to_vec(),
            put::Answer::Bound(handle) => arrow_flight::sql::DoPutPreparedStatementResult {
                prepared_statement_handle: Some(handle),
            }
            .encode_to_vec(),
        };
        Ok(PutResult {
            app_metadata: metadata.into(),
        })
    }

    /// The FlightInfo of `dataset`, whose tickets read `columns` (all for `None`; checked
    /// against its schema) as `read` says; it carries `descriptor` (the caller's, for
    /// GetFlightInfo), else the dataset's PATH.
    fn flight_info(
        &self,
        dataset: &Dataset,
        read: ReadOptions,
        columns: Option<&[usize]>,
        descriptor: Option<FlightDescriptor>,
    ) -> Result<FlightInfo, Error> {
        let rows = dataset.num_rows();
        // Endpoints follow --rows-per-endpoint, but never more than MAX_ENDPOINTS of them (nor
        // more than a projection's lists fit in MAX_PROJECTION_BYTES): the reply must fit a
        // client's 4 MiB message limit whatever row count a dataset declares.
        let max_endpoints = match columns {
            None => MAX_ENDPOINTS,
            Some(columns) => {
                let listed: u64 = columns.iter().map(|c| c.to_string().len() as u64 + 1).sum();
                MAX_ENDPOINTS
                    .min(MAX_PROJECTION_BYTES / listed.max(1))
                    .max(1)
            }
        };
        let step = self
            .options
            .rows_per_endpoint
            .max(rows.div_ceil(max_endpoints))
            .max(1);
        let (schema, bytes) = match columns {
            None => (dataset.schema(), dataset.data_bytes()),
            Some(columns) => (
                Arc::new(project_schema(&dataset.schema(), columns)?),
                dataset.projected_data_bytes(columns),
            ),
        };
        let mut info = FlightInfo::new()
            .try_with_schema(&schema)
            .map_err(|e| Error::Internal(format!("encoding schema: {e}")))?
            .with_descriptor(
                descriptor
                    .unwrap_or_else(|| FlightDescriptor::new_path(vec![dataset.name().to_owned()])),
            )
            .with_total_records(i64::try_from(rows).unwrap_or(i64::MAX))
            .with_total_bytes(i64::try_from(bytes).unwrap_or(i64::MAX))
            .with_ordered(true)
            .with_app_metadata(
                DatasetMetadata {
                    version: dataset.version(),
                    tiers: dataset.tier_bytes(),
                }
                .encode()?,
            );
        // Endpoints follow the devices too: each one's rows lie on one device, which its
        // app_metadata names, so parallel readers pull from every device at once. A dataset
        // scattered over more runs than the reply may list is split by rows alone.
        let mut runs: Vec<(Range<u64>, Option<u32>)> = dataset
            .device_runs()
            .into_iter()
            .map(|(rows, device)| (rows, Some(device)))
            .collect();
        if runs.is_empty() || runs.len() as u64 > max_endpoints / 2 {
            runs = vec![(0..rows, None)];
        }
        for (run, device) in runs {
            let mut start = run.start;
            loop {
                let end = run.end.min(start.saturating_add(step));
                let ticket = ticket::encode(
                    dataset.name(),
                    dataset.version_id(),
                    start..end,
                    read,
                    columns,
                );
                let mut endpoint =
                    self.located(FlightEndpoint::new().with_ticket(Ticket::new(ticket)));
                if let Some(device) = device {
                    endpoint = endpoint.with_app_metadata(EndpointMetadata { device }.encode()?);
                }
                info = info.with_endpoint(endpoint);
                start = end;
                if start >= run.end {
                    break;
                }
            }
        }
        Ok(info)
    }

    /// What `GetFlightInfo` (and `PollFlightInfo`) answer: a dataset's read, or a Flight SQL
    /// command's.
    fn info_for(&self, request: Request<FlightDescriptor>) -> Result<FlightInfo, Error> {
        self.ensure_serving()?;
        if let Some(command) = sql_command(request.get_ref())? {
            let caller = principal(&request)?;
            let info = sql::flight_info(self, command, request.into_inner(), &caller)?;
            return Ok(info);
        }
        let target = descriptor::read_target(request.get_ref())?;
        if let Some(call) = call(&request) {
            call.set_subject(target.name.as_str());
        }
        if let Some(text) = target.filter.clone() {
            return sql::filtered_info(self, target, &text, request.into_inner());
        }
        let dataset = self.store.get(&target.name)?;
        let columns = target
            .columns
            .map(|names| descriptor::projection(&target.name, &dataset.schema(), &names))
            .transpose()?;
        let descriptor = request.into_inner();
        self.flight_info(
            &dataset,
            target.options,
            columns.as_deref(),
            Some(descriptor),
        )
    }

    /// The Flight specification's own actions: `CancelFlightInfo` (nothing a `FlightInfo`
    /// starts runs until its tickets are read, so there is nothing to cancel) and
    /// `RenewFlightEndpoint` (tickets do not expire by time; they name a dataset version,
    /// which a replace or append ends). `None` for other actions.
    fn flight_action(&self, action: &Action, caller: &Principal) -> Result<Option<Vec<u8>>, Error> {
        let undecodable = |e: prost::DecodeError| {
            Error::InvalidCommand(format!("the {} action's body: {e}", action.r#type))
        };
        let body = match action.r#type.as_str() {
            CANCEL_FLIGHT_INFO => {
                caller.authorize(Operation::Action(auth::Action::FlightInfo))?;
                arrow_flight::CancelFlightInfoRequest::decode(action.body.as_ref())
                    .map_err(undecodable)?;
                arrow_flight::CancelFlightInfoResult::new(
                    arrow_flight::CancelStatus::NotCancellable,
                )
                .encode_to_vec()
            }
            RENEW_FLIGHT_ENDPOINT => {
                caller.authorize(Operation::Action(auth::Action::FlightInfo))?;
                let request =
                    arrow_flight::RenewFlightEndpointRequest::decode(action.body.as_ref())
                        .map_err(undecodable)?;
                let endpoint = request.endpoint.ok_or_else(|| {
                    Error::InvalidCommand(
                        "RenewFlightEndpoint needs the endpoint to renew".to_owned(),
                    )
                })?;
                endpoint.encode_to_vec()
            }
            _ => return Ok(None),
        };
        Ok(Some(body))
    }

    /// Starts reading what a `DoGet` ticket names: a Flight SQL statement or listing, or
    /// rows of a dataset (`read`).
    pub(crate) fn open_ticket(
        &self,
        ticket: &Ticket,
        call: Option<Arc<Call>>,
    ) -> Result<read::Reading, Error> {
        self.ensure_serving()?;
        match sql::decode(&ticket.ticket)? {
            Some(command) => {
                if let Some(call) = &call {
                    let kind = command
                        .type_url()
                        .rsplit('.')
                        .next()
                        .unwrap_or("Flight SQL");
                    call.set_subject(kind);
                }
                sql::open(self, command)
            }
            None => read::open(self, ticket, call),
        }
    }

    /// `endpoint` with this server's locations: those it advertises, then
    /// `arrow-flight-reuse-connection://?` (the connection the caller is on), as the Flight
    /// specification describes.
    fn located(&self, endpoint: FlightEndpoint) -> FlightEndpoint {
        self.options
            .advertise
            .iter()
            .map(String::as_str)
            .chain([REUSE_CONNECTION])
            .fold(endpoint, |endpoint, uri| endpoint.with_location(uri))
    }

    async fn run_action(
        &self,
        action: &Action,
        caller: &Principal,
        call: Option<&Arc<Call>>,
        origin: Option<Origin>,
    ) -> Result<serde_json::Value, Error> {
        let request = action::parse(action)?;
        if let Some(call) = call {
            call.set_subject(request.subject());
        }
        caller.authorize(request.operation())?;
        if let Some(what) = request.same_node_only() {
            from_this_node(origin, what)?;
        }
        match request {
            ActionRequest::Drop { name } => {
                let dropped = self.store.drop_dataset(&name).await?;
                tracing::info!(dataset = ?name, bytes = dropped.memory_bytes, "dataset dropped");
                action::to_value(&action::DropResult {
                    name,
                    rows: dropped.rows,
                    bytes: dropped.bytes,
                })
            }
            ActionRequest::Status => {
                action::status_document(&self.store.status(), self.stages.document(), caller)
            }
            ActionRequest::Move { name, device } => {
                let device = put::resolve_device(&self.store, device)?;
                let summary = self.store.move_dataset(&name, device).await?;
                action::to_value(&summary)
            }
            ActionRequest::Copy { name, copy, device } => {
                let devices = self.store.backend().devices().len();
                let device =
                    put::resolve_device(&self.store, action::copy_device(device, devices)?)?;
                let summary = self.store.copy_dataset(&name, &copy, device).await?;
                action::to_value(&summary)
            }
            ActionRequest::IpcExport {
                name,
                columns,
                lease_seconds,
                renew,
                device,
                copy,
                version,
            } => {
                if let Some(columns) = &columns {
                    descriptor::distinct_columns(columns)?;
                }
                let consumer = device
                    .map(|device| put::resolve_device(&self.store, device))
                    .transpose()?;
                let mut request = ExportRequest::new(
                    name,
                    std::time::Duration::from_secs(lease_seconds),
                    caller.name.to_string(),
                );
                let renewal = renew.is_some();
                request.columns = columns;
                request.renew = renew;
                request.consumer = consumer;
                request.copy = copy;
                request.one_partition = version == ipc_export::VERSION_1;
                request.max_leases = self.options.max_export_leases;
                let export = self.store.export(request).await?;
                let consumer_identity = export.lease.terms.consumer.and_then(|index| {
                    let devices = self.store.backend().devices();
                    devices.get(index as usize).map(|info| ExportDevice {
                        ordinal: info.ordinal,
                        uuid: info.uuid.clone().unwrap_or_default(),
                        pci_bus_id: info.pci_bus_id.clone().unwrap_or_default(),
                    })
                });
                let document = ipc_export::document(
                    &export.lease.dataset,
                    &export,
                    version,
                    consumer_identity.as_ref(),
                );
                let document = match document {
                    Ok(document) => document,
                    Err(error) => {
                        // Nobody would learn the lease id: end a new lease (and its replicas)
                        // now rather than at expiry.
                        if !renewal {
                            self.store.release(&export.lease.id, None).ok();
                        }
                        return Err(error);
                    }
                };
                tracing::info!(
                    lease = action::lease_prefix(&export.lease.id),
                    owner = %caller.name,
                    dataset = export.lease.dataset.name(),
                    columns = export.columns.len(),
                    partitions = export.partitions.len(),
                    replica_bytes = export.lease.terms.replica_bytes(),
                    lease_seconds,
                    "dataset exported"
                );
                Ok(document)
            }
            ActionRequest::ShmRead {
                read,
                lease_seconds,
            } => shared::shm_read(self, read, lease_seconds, caller, origin, call).await,
            ActionRequest::IpcImport { document } => {
                // CUDA IPC handles carry no access control: only a process on this node can
                // hold a real one, and a remote caller would make the server its deputy
                // (refused above, with the other same-node paths).
                let summary = ipc_import::import(self, *document, &caller.name).await?;
                tracing::info!(
                    dataset = ?summary.name,
                    mode = ?summary.mode,
                    rows = summary.rows,
                    bytes = summary.bytes,
                    total_rows = summary.total_rows,
                    principal = %caller.name,
                    "ipc-import committed"
                );
                action::to_value(&summary)
            }
            ActionRequest::LeaseRenew {
                lease,
                lease_seconds,
            } => {
                let duration = lease_seconds.map(std::time::Duration::from_secs);
                let renewed = self.store.renew_lease(&lease, &caller.name, duration)?;
                tracing::debug!(
                    lease = action::lease_prefix(&lease),
                    dataset = ?renewed.dataset.name(),
                    "lease renewed"
                );
                action::to_value(&action::RenewResult {
                    lease,
                    expires_at: ipc_export::rfc3339(renewed.expires_at),
                })
            }
            ActionRequest::IpcRelease { lease } => {
                // Its owner's to end; an admin may end anyone's (to free what it holds).
                let owner = (!caller.sees_everyone()).then_some(&*caller.name);
                let released = self.store.release(&lease, owner)?;
                tracing::info!(
                    lease = action::lease_prefix(&lease),
                    dataset = ?released.dataset.name(),
                    "lease released"
                );
                action::to_value(&action::ReleaseResult {
                    name: released.dataset.name().to_owned(),
                    lease,
                })
            }
        }
    }
}

/// The Flight SQL command a CMD descriptor holds, if it holds one.
fn sql_command(descriptor: &FlightDescriptor) -> Result<Option<arrow_flight::sql::Command>, Error> {
    use arrow_flight::flight_descriptor::DescriptorType;
    if DescriptorType::try_from(descriptor.r#type) != Ok(DescriptorType::Cmd) {
        return Ok(None);
    }
    sql::decode(&descriptor.cmd)
}

/// The status a plain `DoGet` reply ends with: our own errors keep their codes (arrow-flight's
/// conversion would make every one INTERNAL).
fn reply_failure(error: FlightError) -> Status {
    match error {
        FlightError::ExternalError(error) => match error.downcast::<Error>() {
            Ok(error) => Status::from(*error),
            Err(error) => Status::from(Error::Internal(format!("reading the reply: {error}"))),
        },
        error => Status::from(Error::Internal(format!("encoding the reply: {error}"))),
    }
}

fn one<T: Send + 'static>(item: T) -> Stream<T> {
    futures::stream::once(futures::future::ready(Ok(item))).boxed()
}

#[tonic::async_trait]
impl FlightService for Service {
    type HandshakeStream = Stream<HandshakeResponse>;
    type ListFlightsStream = Stream<FlightInfo>;
    type DoGetStream = Stream<FlightData>;
    type DoPutStream = Stream<PutResult>;
    type DoExchangeStream = Stream<FlightData>;
    type DoActionStream = Stream<arrow_flight::Result>;
    type ListActionsStream = Stream<ActionType>;

    /// With a token file: Basic credentials in, a session's bearer token out (in the
    /// `authorization` header, as pyarrow's `authenticate_basic_token` reads it, and as the
    /// payload); a bearer token is checked and echoed. Without one every caller is anonymous:
    /// any credentials are accepted and answered with a token that is never checked, so that
    /// a client written for a server with authentication also works against one without.
    async fn handshake(
        &self,
        request: Request<Streaming<HandshakeRequest>>,
    ) -> Result<Response<Self::HandshakeStream>, Status> {
        let authorization = request
            .metadata()
            .get("authorization")
            .map(|value| value.as_bytes());
        let origin = request.extensions().get::<Origin>().copied();
        let (principal, token) = match &self.auth {
            Auth::Tokens(authenticator) => authenticator
                .handshake(authorization, origin)
                .await
                .map_err(Error::from)?,
            Auth::Off => (Principal::anonymous(), UNCHECKED_TOKEN.to_owned()),
        };
        if let Some(call) = call(&request) {
            call.set_principal(Arc::clone(&principal.name));
        }
        tracing::debug!(principal = %principal.name, role = %principal.role, "handshake");
        let header = format!("Bearer {token}")
            .parse()
            .map_err(|_| Error::Internal("a session token is not a header value".to_owned()))?;
        let mut response = Response::new(one(HandshakeResponse {
            protocol_version: 0,
            payload: token.into_bytes().into(),
        }));
        response.metadata_mut().insert("authorization", header);
        Ok(response)
    }

    async fn list_flights(
        &self,
        request: Request<Criteria>,
    ) -> Result<Response<Self::ListFlightsStream>, Status> {
        self.ensure_serving()?;
        let expression = request.into_inner().expression;
        let prefix = std::str::from_utf8(&expression).map_err(|_| {
            Error::InvalidCommand("ListFlights criteria is a UTF-8 dataset name prefix".to_owned())
        })?;
        let infos: Vec<_> = self
            .store
            .list(prefix)
            .iter()
            .map(|dataset| {
                self.flight_info(dataset, ReadOptions::default(), None, None)
                    .map_err(Status::from)
            })
            .collect();
        Ok(Response::new(futures::stream::iter(infos).boxed()))
    }

    async fn get_flight_info(
        &self,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        Ok(Response::new(self.info_for(request)?))
    }

    /// Every read is planned at once: the answer is the complete `FlightInfo`, with nothing
    /// left to poll for.
    async fn poll_flight_info(
        &self,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<PollInfo>, Status> {
        let info = self.info_for(request)?;
        Ok(Response::new(PollInfo {
            info: Some(info),
            flight_descriptor: None,
            progress: Some(1.0),
            expiration_time: None,
        }))
    }

    async fn get_schema(
        &self,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<SchemaResult>, Status> {
        self.ensure_serving()?;
        if let Some(command) = sql_command(request.get_ref())? {
            let caller = principal(&request)?;
            let info = sql::flight_info(self, command, request.into_inner(), &caller)?;
            return Ok(Response::new(SchemaResult {
                schema: info.schema,
            }));
        }
        let target = descriptor::read_target(request.get_ref())?;
        if let Some(call) = call(&request) {
            call.set_subject(target.name.as_str());
        }
        if let Some(text) = target.filter.clone() {
            let info = sql::filtered_info(self, target, &text, request.into_inner())?;
            return Ok(Response::new(SchemaResult {
                schema: info.schema,
            }));
        }
        let dataset = self.store.get(&target.name).map_err(Error::from)?;
        let schema = match target.columns {
            None => dataset.schema(),
            Some(names) => {
                let columns = descriptor::projection(&target.name, &dataset.schema(), &names)?;
                Arc::new(project_schema(&dataset.schema(), &columns)?)
            }
        };
        let options = IpcWriteOptions::default();
        let result = SchemaAsIpc::new(&schema, &options).try_into().map_err(
            |e: arrow::error::ArrowError| Error::Internal(format!("encoding schema: {e}")),
        )?;
        Ok(Response::new(result))
    }

    /// The plain encoder: arrow-flight's, through the generated server. The server routes
    /// `DoGet` to the framed fast path (`doget`) instead unless `--doget-encoder plain`.
    async fn do_get(
        &self,
        request: Request<Ticket>,
    ) -> Result<Response<Self::DoGetStream>, Status> {
        let reading = self.open_ticket(request.get_ref(), call(&request))?;
        let options = IpcWriteOptions::default()
            .try_with_compression(reading.compression)
            .map_err(|e| Error::Internal(format!("choosing the reply's compression: {e}")))?;
        let running = reading.running;
        let batches = reading
            .batches
            .map_err(|error| FlightError::ExternalError(Box::new(error)));
        let messages = FlightDataEncoderBuilder::new()
            .with_schema(reading.schema)
            .with_options(options)
            // arrow-flight splits a batch by its buffers' bytes alone: half the limit leaves
            // the other half to each message's metadata and padding, far more than any but
            // the widest schemas need (the framed reply, the default, measures each message).
            .with_max_flight_data_size(self.options.max_message_bytes / 2)
            // Dictionary columns stay dictionaries, as they were stored.
            .with_dictionary_handling(DictionaryHandling::Resend)
            .build(batches)
            .map_err(reply_failure)
            // The reply counts as running until its last message: shutdown waits for it.
            .inspect(move |_| {
                let _running = &running;
            });
        Ok(Response::new(messages.boxed()))
    }

    async fn do_put(
        &self,
        request: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoPutStream>, Status> {
        let inbound = request
            .extensions()
            .get::<Inbound>()
            .cloned()
            .unwrap_or_default();
        let request = request.map(|stream| put_stream::TonicMessages::new(stream, inbound));
        Ok(Response::new(one(self.put(request).await?)))
    }

    async fn do_exchange(
        &self,
        _request: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoExchangeStream>, Status> {
        Err(Error::Unsupported("DoExchange").into())
    }

    async fn do_action(
        &self,
        request: Request<Action>,
    ) -> Result<Response<Self::DoActionStream>, Status> {
        self.ensure_serving()?;
        let caller = principal(&request)?;
        let call = call(&request);
        if let Some(body) = self.flight_action(request.get_ref(), &caller)? {
            if let Some(call) = &call {
                call.set_subject(request.get_ref().r#type.as_str());
            }
            let result = arrow_flight::Result { body: body.into() };
            return Ok(Response::new(one(result)));
        }
        if sql::is_action(request.get_ref()) {
            if let Some(call) = &call {
                call.set_subject(request.get_ref().r#type.as_str());
            }
            caller
                .authorize(Operation::Action(auth::Action::PreparedStatements))
                .map_err(Error::from)?;
            let results = sql::run_action(self, request.get_ref(), &caller)?
                .into_iter()
                .map(|body| Ok(arrow_flight::Result { body }));
            return Ok(Response::new(futures::stream::iter(results).boxed()));
        }
        let origin = request.extensions().get::<Origin>().copied();
        let result = self
            .run_action(request.get_ref(), &caller, call.as_ref(), origin)
            .await?;
        let body = serde_json::to_vec(&result)
            .map_err(|e| Error::Internal(format!("encoding action result: {e}")))?;
        Ok(Response::new(one(arrow_flight::Result {
            body: body.into(),
        })))
    }

    async fn list_actions(
        &self,
        _request: Request<Empty>,
    ) -> Result<Response<Self::ListActionsStream>, Status> {
        let mut actions = action::action_types();
        actions.extend(sql::action_types());
        for (name, description) in [
            (
                CANCEL_FLIGHT_INFO,
                "Flight: answers NOT_CANCELLABLE (reads run only as their tickets are read)",
            ),
            (
                RENEW_FLIGHT_ENDPOINT,
                "Flight: returns the endpoint as it is (tickets do not expire by time)",
            ),
        ] {
            actions.push(ActionType {
                r#type: name.to_owned(),
                description: description.to_owned(),
            });
        }
        let actions = actions.into_iter().map(Ok);
        Ok(Response::new(futures::stream::iter(actions).boxed()))
    }
}

/// `schema` cut down to `columns`, which are checked against it already.
pub(crate) fn project_schema(
    schema: &arrow::datatypes::Schema,
    columns: &[usize],
) -> Result<arrow::datatypes::Schema, Error> {
    schema
        .project(columns)
        .map_err(|e| Error::Internal(format!("projecting the schema: {e}")))
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

    use super::*;

    #[test]
    fn a_schema_takes_2_mib_or_leaves_room_for_what_replies_add() {
        const MIB: usize = 1 << 20;
        assert_eq!(schema_limit(MIB), MIB);
        assert_eq!(schema_limit(2 * MIB), 2 * MIB);
        // The default: every reply that carries the schema stays under 4 MiB.
        assert_eq!(schema_limit(DEFAULT_MAX_MESSAGE_BYTES), 2 * MIB);
        assert!(schema_limit(DEFAULT_MAX_MESSAGE_BYTES) + INFO_ROOM_BYTES <= 4 * MIB);
        assert_eq!(schema_limit(64 * MIB), 62 * MIB);
        assert_eq!(schema_limit(0), 0);
    }

    #[test]
    fn same_node_paths_are_refused_from_other_nodes() {
        let ip = |ip: IpAddr| from_this_node(Some(Origin::Ip(ip)), "ipc-import");
        assert!(ip(IpAddr::V4(Ipv4Addr::LOCALHOST)).is_ok());
        assert!(ip(IpAddr::V6(Ipv6Addr::LOCALHOST)).is_ok());
        assert!(ip(IpAddr::V6(Ipv4Addr::LOCALHOST.to_ipv6_mapped())).is_ok());
        assert!(from_this_node(Some(Origin::UnixUser(Some(1000))), "shm-read").is_ok());
        assert!(from_this_node(Some(Origin::UnixUser(None)), "shm-read").is_ok());
        for remote in [
            IpAddr::V4(Ipv4Addr::new(10, 0, 0, 7)),
            IpAddr::V6(Ipv4Addr::new(192, 0, 2, 1).to_ipv6_mapped()),
        ] {
            let error = ip(remote).expect_err("another node");
            assert!(matches!(error, Error::NotOnThisNode("ipc-import")));
        }
        assert!(
            from_this_node(None, "ipc-import").is_err(),
            "unknown origin"
        );
    }
}
