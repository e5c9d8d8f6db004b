//! Flight SQL, for ADBC and the tools built on it (Polars, SQL clients), on the same port as
//! plain Flight and with the same authentication and roles.
//!
//! The SQL clients send is one statement form, `SELECT <* | columns> FROM <dataset> [WHERE
//! <predicate>] [LIMIT n]`, parsed with `sqlparser` into a [`query::Query`] small enough to
//! travel inside a ticket, with a row predicate checked against a dataset's schema and
//! evaluated with arrow's compute kernels (`query`, `predicate`: pure functions of text,
//! parameters and batches). The datasets are the tables of one catalog and schema
//! (`metadata`). Statements are read through the plain read's tickets and filtered as they
//! stream (`statement`), directly or prepared with parameters bound through `DoPut`
//! (`prepared`; `parameters` types each by the column it is compared with); bulk ingestion is
//! a put; `dispatch` recognises which request a call carries. Updates, transactions and
//! Substrait are refused as unimplemented.

mod dispatch;
pub mod error;
mod metadata;
mod parameters;
pub mod predicate;
mod prepared;
pub mod query;
mod statement;

pub(crate) use dispatch::{
    IngestCheck, SqlPut, action_types, decode, flight_info, is_action, open, put_command,
    run_action,
};
pub(crate) use prepared::{MAX_PARAMETER_BYTES, Prepared};

/// The `FlightInfo` of a read command with a `where`: its dataset's rows that match, read
/// as a statement's are.
pub(crate) fn filtered_info(
    service: &crate::flight::Service,
    target: crate::flight::descriptor::ReadTarget,
    text: &str,
    descriptor: arrow_flight::FlightDescriptor,
) -> Result<arrow_flight::FlightInfo, crate::error::Error> {
    let query = query::Query {
        table: target.name,
        columns: target.columns,
        filter: Some(statement::where_predicate(text)?),
        limit: None,
    };
    let source = statement::Source {
        sql: statement::where_statement(text),
        parameters: None,
    };
    statement::flight_info_with(service, query, source, target.options, descriptor)
}

impl From<error::SqlError> for crate::error::Error {
    fn from(error: error::SqlError) -> Self {
        match error {
            error::SqlError::Unsupported(message) => Self::SqlUnsupported(message),
            error::SqlError::Invalid(message) => Self::SqlInvalid(message),
        }
    }
}
