//! What a `DoGet` ticket reads: the ticket parsed and checked against the dataset's current
//! version, the rows read as a stream of record batches. Both reply encoders start here: the
//! plain one (arrow-flight's encoder, in the `FlightService` handler) and the framed fast path
//! (`doget`).

use std::sync::Arc;

use arrow::datatypes::SchemaRef;
use arrow::ipc::CompressionType;
use arrow::record_batch::RecordBatch;
use arrow_flight::Ticket;
use futures::StreamExt;
use futures::stream::BoxStream;

use super::Service;
use super::call::Call;
use super::descriptor::ReadOptions;
use super::lifecycle::StreamGuard;
use super::message_size::{body_budget, whole_messages};
use super::ticket::{self, TicketRequest};
use crate::error::Error;
use crate::store::{Dataset, StoreError};

/// Most a projection enlarges read chunks by. The scale is the dataset's, not each
/// partition's: where one partition's rows are mostly the chosen columns, its chunks are up to
/// this many times `--read-chunk-bytes` (pinned staging on a GPU, times the prefetch), so it
/// stays small.
const MAX_CHUNK_SCALE: u64 = 8;

/// The rows a ticket names, being read.
pub(crate) struct Reading {
    pub(crate) batches: BoxStream<'static, Result<RecordBatch, Error>>,
    pub(crate) schema: SchemaRef,
    /// The IPC buffer compression the ticket asks for.
    pub(crate) compression: Option<CompressionType>,
    /// Counts the reply as a running stream ([`super::Lifecycle`]) until dropped, so that
    /// shutdown waits for it: keep it as long as the reply.
    pub(crate) running: StreamGuard,
}

impl std::fmt::Debug for Reading {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reading")
            .field("schema", &self.schema)
            .field("compression", &self.compression)
            .finish_non_exhaustive()
    }
}

/// What a ticket reads, once checked: a dataset version's rows and columns, and how.
pub(crate) struct Planned {
    pub(crate) dataset: Arc<Dataset>,
    pub(crate) rows: std::ops::Range<u64>,
    /// Schema positions; `None` for every column.
    pub(crate) columns: Option<Vec<usize>>,
    /// The schema of the columns read.
    pub(crate) schema: SchemaRef,
    pub(crate) chunk_bytes: u64,
    pub(crate) compression: Option<CompressionType>,
}

/// Checks what `ticket` names: a dataset version and a row range (a bare name: the whole
/// current version), with every check a read gets.
pub(crate) fn plan(
    service: &Service,
    ticket: &Ticket,
    call: Option<&Arc<Call>>,
) -> Result<Planned, Error> {
    service.ensure_serving()?;
    let request = ticket::decode(&ticket.ticket)?;
    if let Some(call) = call {
        call.set_subject(request.name());
    }
    let (dataset, rows, read, columns) = match request {
        TicketRequest::Whole { name } => {
            let dataset = service.store.get(&name)?;
            let rows = 0..dataset.num_rows();
            (dataset, rows, ReadOptions::default(), None)
        }
        TicketRequest::Rows {
            name,
            version,
            rows,
            options,
            columns,
        } => {
            let dataset = service.store.get(&name)?;
            let current = dataset.version_id();
            if current.number != version.number {
                return Err(StoreError::StaleVersion {
                    name,
                    ticket: version.number,
                    current: current.number,
                }
                .into());
            }
            if current.tag != version.tag {
                return Err(StoreError::ForeignTicket { name }.into());
            }
            (dataset, rows, options, columns)
        }
    };
    tracing::debug!(dataset = dataset.name(), ?rows, ?columns, "DoGet");
    let schema = match &columns {
        None => dataset.schema(),
        Some(columns) => {
            check_columns(&dataset.schema(), columns)?;
            Arc::new(super::project_schema(&dataset.schema(), columns)?)
        }
    };
    let options = &service.options;
    // The bytes of the columns read in each chunk: whole messages of the framed encoder.
    let per_chunk = whole_messages(
        options.read_chunk_bytes,
        body_budget(&schema, options.max_message_bytes),
    );
    // Chunks are planned by the bytes a row holds in all columns: a projection reads the
    // same bytes per chunk through proportionally more rows (at most 8 times as many).
    let chunk_bytes = match &columns {
        None => per_chunk,
        Some(columns) => {
            let chosen = u128::from(dataset.projected_data_bytes(columns).max(1));
            let all = u128::from(dataset.data_bytes()).max(chosen);
            let scaled = u128::from(per_chunk) * all / chosen;
            let most = u128::from(per_chunk) * u128::from(MAX_CHUNK_SCALE);
            u64::try_from(scaled.min(most)).unwrap_or(u64::MAX)
        }
    };
    Ok(Planned {
        dataset,
        rows,
        columns,
        schema,
        chunk_bytes,
        compression: read.compression.map(Into::into),
    })
}

/// Starts reading what `ticket` names (see [`plan`]). The dataset reads the range as chunks,
/// several in flight, so a device backend's copies to host memory overlap with encoding and
/// sending.
pub(crate) fn open(
    service: &Service,
    ticket: &Ticket,
    call: Option<Arc<Call>>,
) -> Result<Reading, Error> {
    let planned = plan(service, ticket, call.as_ref())?;
    let mut batches = planned
        .dataset
        .read_columns(
            planned.rows,
            planned.columns.map(Arc::from),
            planned.chunk_bytes,
            service.options.read_prefetch,
        )?
        .map(|batch| batch.map_err(Error::from))
        .boxed();
    if let Some(call) = call {
        batches = batches
            .inspect(move |batch| {
                if let Ok(batch) = batch {
                    call.add_rows_out(batch.num_rows() as u64);
                }
            })
            .boxed();
    }
    Ok(Reading {
        batches,
        schema: planned.schema,
        compression: planned.compression,
        running: service.lifecycle.track(),
    })
}

/// A ticket's projection, which a client could have altered, against the schema of the
/// version it names: each column in it, at most once (the ticket was issued so).
fn check_columns(schema: &arrow::datatypes::Schema, columns: &[usize]) -> Result<(), Error> {
    let mut seen = vec![false; schema.fields().len()];
    for &column in columns {
        match seen.get_mut(column) {
            Some(seen) if !*seen => *seen = true,
            _ => {
                return Err(Error::InvalidTicket(format!(
                    "corrupt ticket: column {column} is repeated or not in the dataset"
                )));
            }
        }
    }
    Ok(())
}
