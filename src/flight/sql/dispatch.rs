//! Which Flight SQL request a call carries, and the handler of each.
//!
//! A request is Flight SQL when its descriptor command, ticket or action body is a protobuf
//! `Any` of a Flight SQL message (arrow-flight's `sql` types decode it). Our own JSON commands
//! and tickets never are: JSON starts with `{`, a ticket with NUL or a dataset name, and an
//! `Any` with the control character 0x0A, which no name may hold.

use arrow_flight::sql::{
    ActionClosePreparedStatementRequest, ActionCreatePreparedStatementRequest, Any, Command,
    CommandStatementIngest, ProstMessageExt,
};
use arrow_flight::sql::{TableExistsOption, TableNotExistOption};
use arrow_flight::{Action, FlightDescriptor, FlightEndpoint, FlightInfo, Ticket};
use futures::StreamExt;
use prost::Message;

use super::metadata::{self, CATALOG, DB_SCHEMA, Listing};
use super::{query, statement};
use crate::auth::Principal;
use crate::error::Error;
use crate::flight::Service;
use crate::flight::descriptor::{PutTarget, parse_name};
use crate::flight::read::Reading;
use crate::store::PutMode;

const SQL_TYPES: &str = "type.googleapis.com/arrow.flight.protocol.sql.";

/// The Flight SQL actions, as `ListActions` names them.
pub(super) const CREATE_PREPARED_STATEMENT: &str = "CreatePreparedStatement";
pub(super) const CLOSE_PREPARED_STATEMENT: &str = "ClosePreparedStatement";
const UNSUPPORTED_ACTIONS: [&str; 6] = [
    "BeginTransaction",
    "EndTransaction",
    "BeginSavepoint",
    "EndSavepoint",
    "CancelQuery",
    "CreatePreparedSubstraitPlan",
];

/// The Flight SQL command in `bytes`, or `None` where they are not one.
pub(crate) fn decode(bytes: &[u8]) -> Result<Option<Command>, Error> {
    let Ok(any) = Any::decode(bytes) else {
        return Ok(None);
    };
    if !any.type_url.starts_with(SQL_TYPES) {
        return Ok(None);
    }
    Command::try_from(any)
        .map(Some)
        .map_err(|e| Error::InvalidCommand(format!("an undecodable Flight SQL message: {e}")))
}

/// Whether `action` is one of Flight SQL's (its body then holds an `Any`).
pub(crate) fn is_action(action: &Action) -> bool {
    action.r#type == CREATE_PREPARED_STATEMENT
        || action.r#type == CLOSE_PREPARED_STATEMENT
        || UNSUPPORTED_ACTIONS.contains(&action.r#type.as_str())
}

/// The answer to `GetFlightInfo` (and, through its schema, `GetSchema`) for a Flight SQL
/// command.
pub(crate) fn flight_info(
    service: &Service,
    command: Command,
    descriptor: FlightDescriptor,
    caller: &Principal,
) -> Result<FlightInfo, Error> {
    match command {
        Command::CommandStatementQuery(command) => {
            if command.transaction_id.is_some() {
                return Err(Error::Unsupported(
                    "Flight SQL transactions (statements run on their own)",
                ));
            }
            let parsed = query::parse(&command.query)?;
            if parsed.placeholders() > 0 {
                return Err(Error::InvalidCommand(format!(
                    "this statement has {} parameters: prepare it and bind them",
                    parsed.placeholders()
                )));
            }
            let source = statement::Source {
                sql: command.query,
                parameters: None,
            };
            statement::flight_info(service, parsed, source, descriptor)
        }
        Command::CommandPreparedStatementQuery(command) => {
            let (bound, source) = service
                .prepared
                .bound_query(&command.prepared_statement_handle, caller)?;
            statement::flight_info(service, bound, source, descriptor)
        }
        Command::CommandStatementSubstraitPlan(_) => Err(Error::Unsupported(
            "Substrait plans (send SQL: SELECT columns FROM dataset WHERE ... LIMIT n)",
        )),
        Command::CommandStatementUpdate(_) | Command::CommandPreparedStatementUpdate(_) => Err(
            Error::Unsupported("SQL updates (write with DoPut or Flight SQL bulk ingestion)"),
        ),
        command => {
            let listing = listing(service, command.clone())?;
            let ticket = Ticket::new(command.into_any().encode_to_vec());
            FlightInfo::new()
                .try_with_schema(&listing.schema)
                .map_err(|e| Error::Internal(format!("encoding a Flight SQL schema: {e}")))
                .map(|info| {
                    info.with_descriptor(descriptor)
                        .with_endpoint(service.located(FlightEndpoint::new().with_ticket(ticket)))
                        .with_total_records(listing.batch.num_rows() as i64)
                        .with_ordered(true)
                })
        }
    }
}

/// What a catalog command lists; other commands are not listings.
fn listing(service: &Service, command: Command) -> Result<Listing, Error> {
    match command {
        Command::CommandGetSqlInfo(command) => metadata::sql_info_listing(command),
        Command::CommandGetCatalogs(command) => metadata::catalogs(command),
        Command::CommandGetDbSchemas(command) => metadata::db_schemas(command),
        Command::CommandGetTables(command) => metadata::tables(command, &service.store),
        Command::CommandGetTableTypes(command) => metadata::table_types(command),
        Command::CommandGetPrimaryKeys(command) => metadata::primary_keys(command),
        Command::CommandGetXdbcTypeInfo(command) => metadata::xdbc_type_info(command),
        Command::CommandGetExportedKeys(_)
        | Command::CommandGetImportedKeys(_)
        | Command::CommandGetCrossReference(_) => {
            Err(Error::Unsupported("foreign keys (datasets have no keys)"))
        }
        command => Err(Error::InvalidCommand(format!(
            "{} is not a Flight SQL request this server answers",
            command.type_url()
        ))),
    }
}

/// What a Flight SQL ticket reads: a statement's rows, or a catalog command's listing.
pub(crate) fn open(service: &Service, command: Command) -> Result<Reading, Error> {
    match command {
        Command::TicketStatementQuery(ticket) => statement::open(service, &ticket.statement_handle),
        command => {
            let listing = listing(service, command)?;
            Ok(Reading {
                batches: futures::stream::once(futures::future::ready(Ok(listing.batch))).boxed(),
                schema: listing.schema,
                compression: None,
                running: service.lifecycle.track(),
            })
        }
    }
}

/// What a `DoPut` with a Flight SQL command does.
pub(crate) enum SqlPut {
    /// Bulk ingestion: a put, answered with the row count.
    Ingest(PutTarget, IngestCheck),
    /// The parameters of a prepared statement.
    Parameters(bytes::Bytes),
}

/// What must hold of the table an ingestion writes to (ADBC's `append` mode does not create
/// it): checked when the put begins and again as it commits (`PendingPut::require_existing`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IngestCheck {
    None,
    MustExist,
}

/// The Flight SQL meaning of a `DoPut` descriptor, or `None` for our own.
pub(crate) fn put_command(descriptor: Option<&FlightDescriptor>) -> Result<Option<SqlPut>, Error> {
    let Some(descriptor) = descriptor else {
        return Ok(None);
    };
    let Some(command) = decode(&descriptor.cmd)? else {
        return Ok(None);
    };
    match command {
        Command::CommandStatementIngest(ingest) => ingest_target(ingest).map(Some),
        Command::CommandPreparedStatementQuery(command) => {
            Ok(Some(SqlPut::Parameters(command.prepared_statement_handle)))
        }
        Command::CommandStatementUpdate(_) | Command::CommandPreparedStatementUpdate(_) => Err(
            Error::Unsupported("SQL updates (write with DoPut or Flight SQL bulk ingestion)"),
        ),
        Command::CommandStatementSubstraitPlan(_) => Err(Error::Unsupported("Substrait plans")),
        command => Err(Error::InvalidCommand(format!(
            "DoPut takes Flight SQL bulk ingestion or a prepared statement's parameters, not {}",
            command.type_url()
        ))),
    }
}

fn ingest_target(ingest: CommandStatementIngest) -> Result<SqlPut, Error> {
    if ingest.temporary {
        return Err(Error::InvalidCommand(
            "temporary tables are not supported: every dataset lasts until it is dropped"
                .to_owned(),
        ));
    }
    if ingest.transaction_id.is_some() {
        return Err(Error::Unsupported(
            "Flight SQL transactions (an ingestion commits atomically on its own)",
        ));
    }
    if let Some(catalog) = ingest.catalog.as_deref().filter(|c| *c != CATALOG) {
        return Err(Error::InvalidCommand(format!(
            "the only catalog is {CATALOG:?}, not {catalog:?}"
        )));
    }
    if let Some(schema) = ingest.schema.as_deref().filter(|s| *s != DB_SCHEMA) {
        return Err(Error::InvalidCommand(format!(
            "the only schema is {DB_SCHEMA:?}, not {schema:?}"
        )));
    }
    let options = ingest.table_definition_options.unwrap_or_default();
    let must_exist = TableNotExistOption::try_from(options.if_not_exist)
        .is_ok_and(|option| option == TableNotExistOption::Fail);
    let mode = match TableExistsOption::try_from(options.if_exists) {
        Ok(TableExistsOption::Append) => PutMode::Append,
        Ok(TableExistsOption::Replace) => PutMode::Replace,
        Ok(TableExistsOption::Fail | TableExistsOption::Unspecified) | Err(_) => PutMode::Create,
    };
    let target = PutTarget {
        name: parse_name(ingest.table.as_bytes())?,
        mode,
        device: None,
    };
    let check = if must_exist {
        IngestCheck::MustExist
    } else {
        IngestCheck::None
    };
    Ok(SqlPut::Ingest(target, check))
}

/// Runs a Flight SQL action; its results, each an `Any`-packed message.
pub(crate) fn run_action(
    service: &Service,
    action: &Action,
    caller: &Principal,
) -> Result<Vec<bytes::Bytes>, Error> {
    match action.r#type.as_str() {
        CREATE_PREPARED_STATEMENT => {
            let request = unpack::<ActionCreatePreparedStatementRequest>(&action.body)?;
            if request.transaction_id.is_some() {
                return Err(Error::Unsupported(
                    "Flight SQL transactions (statements run on their own)",
                ));
            }
            let result = service.prepared.create(service, &request.query, caller)?;
            Ok(vec![result.as_any().encode_to_vec().into()])
        }
        CLOSE_PREPARED_STATEMENT => {
            let request = unpack::<ActionClosePreparedStatementRequest>(&action.body)?;
            service
                .prepared
                .close(&request.prepared_statement_handle, caller);
            Ok(Vec::new())
        }
        _ => Err(Error::Unsupported(
            "Flight SQL transactions, savepoints, cancellation and Substrait",
        )),
    }
}

fn unpack<M: ProstMessageExt>(body: &[u8]) -> Result<M, Error> {
    let any = Any::decode(body)
        .map_err(|e| Error::InvalidCommand(format!("a Flight SQL action body: {e}")))?;
    any.unpack::<M>()
        .map_err(|e| Error::InvalidCommand(format!("a Flight SQL action body: {e}")))?
        .ok_or_else(|| {
            Error::InvalidCommand(format!(
                "a Flight SQL action body of type {}, not {}",
                any.type_url,
                M::type_url()
            ))
        })
}

/// The Flight SQL action types `ListActions` adds.
pub(crate) fn action_types() -> Vec<arrow_flight::ActionType> {
    [
        (
            CREATE_PREPARED_STATEMENT,
            "Flight SQL: prepares a SELECT; body ActionCreatePreparedStatementRequest",
        ),
        (
            CLOSE_PREPARED_STATEMENT,
            "Flight SQL: closes a prepared statement; body ActionClosePreparedStatementRequest",
        ),
    ]
    .into_iter()
    .map(|(name, description)| arrow_flight::ActionType {
        r#type: name.to_owned(),
        description: description.to_owned(),
    })
    .collect()
}
