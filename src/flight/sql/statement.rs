//! SELECT statements: the endpoints that read one, and the rows they stream.
//!
//! A statement reads its dataset through the same tickets as a plain read (the version current
//! when it was planned, a row range, and the columns it needs: its output, then those only its
//! filter reads), each wrapped in a Flight SQL ticket with the statement's filter, output and
//! limit. `DoGet` opens the plain ticket, with every check a plain read gets, and filters each
//! chunk as it streams, so nothing is held whole: where the chunk lives, when its backend can
//! run the filter there (`backend::filter`: on a GPU, so that only the rows kept cross PCIe),
//! and otherwise with arrow's kernels here. A limit ends the read as soon as it is met. A
//! statement with a limit is one endpoint (a limit per endpoint would not be the statement's);
//! one without has the plain read's endpoints, for parallel readers.

use std::sync::Arc;

use arrow::datatypes::Schema;
use arrow::record_batch::RecordBatch;
use arrow_flight::sql::{ProstMessageExt, TicketStatementQuery};
use arrow_flight::{FlightDescriptor, FlightEndpoint, FlightInfo, Ticket};
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use prost::Message;
use serde::{Deserialize, Serialize};

use super::predicate::{Filter, Predicate};
use super::query::Query;
use crate::error::Error;
use crate::flight::descriptor::{self, ReadOptions};
use crate::flight::read::{self, Reading};
use crate::flight::{Service, ticket};
use crate::store::{FilteredChunk, column_indices};

/// What a statement's ticket holds, as JSON in `TicketStatementQuery.statement_handle`: the
/// statement's own SQL (parsed again by `DoGet`: far smaller than its parsed filter) and the
/// parameters bound to it. A client could alter it: `open` checks it all again.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct StatementTicket {
    /// The plain ticket of the rows and columns read, base64.
    read: String,
    /// The statement whose filter the rows pass.
    sql: String,
    /// Its parameters: one row, an Arrow IPC stream in base64.
    parameters: Option<String>,
    /// The output columns, as positions among the columns read.
    output: Vec<usize>,
    limit: Option<u64>,
}

/// Largest statement ticket: it must fit `DoGet`'s request limit (`--max-request-bytes`, 64 KiB
/// by default) with room to spare.
const MAX_TICKET_BYTES: usize = 48 << 10;

/// Most bytes the statement tickets of one `FlightInfo` add up to, as for projections: a
/// statement whose tickets would pass it is read through one endpoint.
const MAX_TICKETS_BYTES: usize = 1 << 20;

/// Where a statement comes from, which its tickets carry: its SQL, and the parameters bound.
pub(crate) struct Source {
    pub sql: String,
    pub parameters: Option<RecordBatch>,
}

fn encode_parameters(batch: &RecordBatch) -> Result<String, Error> {
    let mut bytes = Vec::new();
    let mut writer = arrow::ipc::writer::StreamWriter::try_new(&mut bytes, &batch.schema())
        .and_then(|mut writer| writer.write(batch).map(|()| writer))
        .map_err(|e| Error::Internal(format!("encoding a statement's parameters: {e}")))?;
    writer
        .finish()
        .map_err(|e| Error::Internal(format!("encoding a statement's parameters: {e}")))?;
    drop(writer);
    Ok(BASE64.encode(bytes))
}

fn decode_parameters(text: &str) -> Result<RecordBatch, Error> {
    let bytes = BASE64
        .decode(text)
        .map_err(|e| Error::InvalidTicket(format!("a statement ticket's parameters: {e}")))?;
    let mut reader =
        arrow::ipc::reader::StreamReader::try_new(std::io::Cursor::new(bytes), None)
            .map_err(|e| Error::InvalidTicket(format!("a statement ticket's parameters: {e}")))?;
    match reader.next() {
        Some(Ok(batch)) if batch.num_rows() == 1 => Ok(batch),
        _ => Err(Error::InvalidTicket(
            "a statement ticket's parameters are not one row".to_owned(),
        )),
    }
}

/// What a statement reads of `schema`: the positions of the columns it reads (its output's,
/// then those only its filter needs), and its output's positions among them.
struct Plan {
    read: Vec<usize>,
    output: Vec<usize>,
    output_schema: Schema,
}

fn plan(query: &Query, schema: &Schema) -> Result<Plan, Error> {
    let output = match &query.columns {
        None => (0..schema.fields().len()).collect(),
        Some(names) => descriptor::projection(&query.table, schema, names)?,
    };
    let mut read = output.clone();
    if let Some(filter) = &query.filter {
        // A prepared statement's parameters are checked once bound.
        if filter.placeholders() == 0 {
            filter.check(schema)?;
        }
        for index in column_indices(&query.table, schema, &filter.columns())? {
            if !read.contains(&index) {
                read.push(index);
            }
        }
    }
    let output_schema = schema
        .project(&output)
        .map_err(|e| Error::Internal(format!("projecting a statement's schema: {e}")))?;
    Ok(Plan {
        output: (0..output.len()).collect(),
        read,
        output_schema,
    })
}

/// The schema a statement's rows have (for prepared statements' results).
pub(crate) fn output_schema(service: &Service, query: &Query) -> Result<Schema, Error> {
    let dataset = service.store.get(&query.table)?;
    Ok(plan(query, &dataset.schema())?.output_schema)
}

/// The statement a read command's `where` is the predicate of.
pub(crate) fn where_statement(text: &str) -> String {
    format!("SELECT * FROM t WHERE {text}")
}

/// A read command's `where`: the predicate of `SELECT * FROM t WHERE <text>`, and nothing
/// else (no parameters, no limit, nothing after it).
pub(crate) fn where_predicate(text: &str) -> Result<Predicate, Error> {
    let refused = || {
        Error::InvalidCommand(format!(
            "\"where\" is the predicate of a WHERE clause (comparisons, IS NULL, IN, BETWEEN, \
             AND, OR, NOT), without parameters or anything after it: {text:?}"
        ))
    };
    let parsed = super::query::parse(&where_statement(text))?;
    match parsed {
        Query {
            columns: None,
            filter: Some(filter),
            limit: None,
            table,
        } if table == "t" && filter.placeholders() == 0 => Ok(filter),
        _ => Err(refused()),
    }
}

pub(crate) fn flight_info(
    service: &Service,
    query: Query,
    source: Source,
    descriptor: FlightDescriptor,
) -> Result<FlightInfo, Error> {
    flight_info_with(service, query, source, ReadOptions::default(), descriptor)
}

/// The `FlightInfo` of a statement whose chunks are encoded as `read` says.
pub(crate) fn flight_info_with(
    service: &Service,
    query: Query,
    source: Source,
    read: ReadOptions,
    descriptor: FlightDescriptor,
) -> Result<FlightInfo, Error> {
    let dataset = service.store.get(&query.table)?;
    let schema = dataset.schema();
    let plan = plan(&query, &schema)?;
    let parameters = source
        .parameters
        .as_ref()
        .map(encode_parameters)
        .transpose()?;
    // The size of each ticket but its plain read: what decides how many endpoints fit.
    let statement_bytes = source.sql.len() + parameters.as_ref().map_or(0, String::len) + 512;
    if statement_bytes > MAX_TICKET_BYTES {
        return Err(Error::InvalidCommand(format!(
            "this statement and its parameters take {statement_bytes} bytes, and its tickets at \
             most {MAX_TICKET_BYTES}: shorten it (fewer IN items or OR terms)"
        )));
    }
    let every_column: Vec<usize> = (0..schema.fields().len()).collect();
    let columns = (plan.read != every_column).then_some(plan.read.as_slice());
    let plain = match query.limit {
        Some(_) => Vec::new(),
        None => service.flight_info(&dataset, read, columns, None)?.endpoint,
    };
    let plain: Vec<FlightEndpoint> = match plain.len() {
        n if n > 0 && n * statement_bytes <= MAX_TICKETS_BYTES => plain,
        _ => {
            let rows = 0..dataset.num_rows();
            let ticket = ticket::encode(dataset.name(), dataset.version_id(), rows, read, columns);
            vec![service.located(FlightEndpoint::new().with_ticket(Ticket::new(ticket)))]
        }
    };
    let mut info = FlightInfo::new()
        .try_with_schema(&plan.output_schema)
        .map_err(|e| Error::Internal(format!("encoding a statement's schema: {e}")))?
        .with_descriptor(descriptor)
        .with_ordered(true)
        .with_total_bytes(-1);
    let rows = dataset.num_rows();
    info = info.with_total_records(match (&query.filter, query.limit) {
        (Some(_), _) => -1,
        (None, limit) => i64::try_from(limit.map_or(rows, |limit| limit.min(rows))).unwrap_or(-1),
    });
    for endpoint in plain {
        let Some(read) = endpoint.ticket else {
            continue;
        };
        let handle = serde_json::to_vec(&StatementTicket {
            read: BASE64.encode(&read.ticket),
            sql: source.sql.clone(),
            parameters: parameters.clone(),
            output: plan.output.clone(),
            limit: query.limit,
        })
        .map_err(|e| Error::Internal(format!("encoding a statement ticket: {e}")))?;
        let ticket = TicketStatementQuery {
            statement_handle: handle.into(),
        };
        info = info.with_endpoint(FlightEndpoint {
            ticket: Some(Ticket::new(ticket.as_any().encode_to_vec())),
            ..endpoint
        });
    }
    Ok(info)
}

/// Starts streaming the rows of a statement's ticket.
pub(crate) fn open(service: &Service, handle: &[u8]) -> Result<Reading, Error> {
    let ticket: StatementTicket = serde_json::from_slice(handle).map_err(|e| {
        Error::InvalidTicket(format!("a statement ticket that does not parse: {e}"))
    })?;
    let read = BASE64
        .decode(&ticket.read)
        .map_err(|e| Error::InvalidTicket(format!("a statement ticket's read: {e}")))?;
    let planned = read::plan(service, &Ticket::new(read), None)?;
    let read_schema = Arc::clone(&planned.schema);
    let columns = read_schema.fields().len();
    let mut seen = vec![false; columns];
    for &position in &ticket.output {
        match seen.get_mut(position) {
            Some(seen) if !*seen => *seen = true,
            _ => {
                return Err(Error::InvalidTicket(
                    "corrupt statement ticket: an output column is repeated or not read".to_owned(),
                ));
            }
        }
    }
    // The statement's filter, parsed again and bound; its literals converted to the columns'
    // types once, not per chunk.
    let mut query = super::query::parse(&ticket.sql)?;
    if let Some(parameters) = &ticket.parameters {
        query = query.bind(&decode_parameters(parameters)?, 0)?;
    }
    let filter = query
        .filter
        .as_ref()
        .map(|filter| filter.prepare(&read_schema))
        .transpose()?;
    let schema = Arc::new(
        read_schema
            .project(&ticket.output)
            .map_err(|e| Error::Internal(format!("projecting a statement's schema: {e}")))?,
    );
    let output: Arc<[usize]> = Arc::from(ticket.output);
    let prefetch = service.options.read_prefetch;
    let dataset = &planned.dataset;
    // Where the backend can, it filters where the rows live (a GPU's kernels: only the rows
    // kept are copied off it); other chunks are filtered here.
    let on_device = filter
        .as_ref()
        .filter(|_| service.options.filter_on_device)
        .and_then(Filter::for_backend);
    let chunks = match on_device {
        Some(device) => {
            let read: Arc<[usize]> = match planned.columns {
                Some(read) => Arc::from(read),
                None => (0..columns).collect(),
            };
            dataset.read_filtered(
                planned.rows,
                read,
                Arc::new(device),
                Arc::clone(&output),
                planned.chunk_bytes,
                prefetch,
            )?
        }
        None => dataset
            .read_columns(
                planned.rows,
                planned.columns.map(Arc::from),
                planned.chunk_bytes,
                prefetch,
            )?
            .map_ok(FilteredChunk::Unfiltered)
            .boxed(),
    };
    let batches = select(
        chunks.map_err(Error::from).boxed(),
        filter.map(Arc::new),
        output,
        ticket.limit.unwrap_or(u64::MAX),
    );
    Ok(Reading {
        batches,
        schema,
        compression: planned.compression,
        running: service.lifecycle.track(),
    })
}

/// `chunks` filtered (those the backend did not filter), projected onto `output`, and cut at
/// `limit` rows; the read ends (and stops reading) once the limit is met.
fn select(
    chunks: BoxStream<'static, Result<FilteredChunk, Error>>,
    filter: Option<Arc<Filter>>,
    output: Arc<[usize]>,
    limit: u64,
) -> BoxStream<'static, Result<RecordBatch, Error>> {
    futures::stream::unfold((chunks, limit), move |(mut chunks, remaining)| {
        let filter = filter.clone();
        let output = Arc::clone(&output);
        async move {
            if remaining == 0 {
                return None;
            }
            loop {
                let chosen = match chunks.next().await? {
                    Ok(FilteredChunk::Filtered(batch)) => Ok(batch),
                    // Filtering is CPU work proportional to the chunk: off the async workers.
                    Ok(FilteredChunk::Unfiltered(batch)) if filter.is_some() => {
                        let (filter, output) = (filter.clone(), Arc::clone(&output));
                        tokio::task::spawn_blocking(move || {
                            choose(&batch, filter.as_deref(), &output)
                        })
                        .await
                        .unwrap_or_else(|e| {
                            Err(Error::Internal(format!(
                                "filtering a statement's rows: {e}"
                            )))
                        })
                    }
                    Ok(FilteredChunk::Unfiltered(batch)) => choose(&batch, None, &output),
                    Err(error) => Err(error),
                };
                let chosen = match chosen {
                    Ok(chosen) => chosen,
                    Err(error) => return Some((Err(error), (chunks, 0))),
                };
                if chosen.num_rows() == 0 {
                    continue;
                }
                let take = remaining.min(chosen.num_rows() as u64);
                return Some((
                    Ok(chosen.slice(0, take as usize)),
                    (chunks, remaining - take),
                ));
            }
        }
    })
    .boxed()
}

fn choose(
    batch: &RecordBatch,
    filter: Option<&Filter>,
    output: &[usize],
) -> Result<RecordBatch, Error> {
    let kept = match filter {
        None => batch.clone(),
        Some(filter) => {
            let mask = filter.evaluate(batch)?;
            arrow::compute::filter_record_batch(batch, &mask)
                .map_err(|e| Error::Internal(format!("filtering a statement's rows: {e}")))?
        }
    };
    kept.project(output)
        .map_err(|e| Error::Internal(format!("projecting a statement's rows: {e}")))
}
