//! The Flight SQL catalog: the server's facts (`GetSqlInfo`), and the datasets as the tables
//! of one catalog and one schema (`GetCatalogs`, `GetDbSchemas`, `GetTables`, `GetTableTypes`,
//! `GetPrimaryKeys`, `GetXdbcTypeInfo`).
//!
//! arrow-flight's builders lay the results out as the Flight SQL specification says and apply
//! the clients' filter patterns; this module says what there is.

use std::sync::{Arc, LazyLock};

use arrow::array::{ArrayRef, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use arrow_flight::sql::metadata::{SqlInfoData, SqlInfoDataBuilder, XdbcTypeInfoData};
use arrow_flight::sql::{
    CommandGetCatalogs, CommandGetDbSchemas, CommandGetPrimaryKeys, CommandGetSqlInfo,
    CommandGetTableTypes, CommandGetTables, CommandGetXdbcTypeInfo, SqlInfo,
    SqlSupportedCaseSensitivity, SqlSupportedTransaction,
};

use crate::error::Error;
use crate::store::Store;

/// The one catalog, and its one schema, that hold every dataset as a table.
pub(super) const CATALOG: &str = "gpu_flight";
pub(super) const DB_SCHEMA: &str = "main";
/// Every dataset is a table of this type.
pub(super) const TABLE_TYPE: &str = "TABLE";

fn arrow_error<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> Error + '_ {
    move |e| Error::Internal(format!("building the {what} result: {e}"))
}

/// What `GetSqlInfo` answers: the server and the SQL it runs (`super::query`).
static SQL_INFO: LazyLock<Result<SqlInfoData, String>> = LazyLock::new(|| {
    let mut info = SqlInfoDataBuilder::new();
    info.append(SqlInfo::FlightSqlServerName, "gpu-flight");
    info.append(SqlInfo::FlightSqlServerVersion, env!("CARGO_PKG_VERSION"));
    info.append(SqlInfo::FlightSqlServerArrowVersion, "60");
    info.append(SqlInfo::FlightSqlServerReadOnly, false);
    info.append(SqlInfo::FlightSqlServerSql, true);
    info.append(SqlInfo::FlightSqlServerSubstrait, false);
    info.append(
        SqlInfo::FlightSqlServerTransaction,
        SqlSupportedTransaction::None as i32,
    );
    info.append(SqlInfo::FlightSqlServerCancel, false);
    info.append(SqlInfo::FlightSqlServerBulkIngestion, true);
    info.append(SqlInfo::FlightSqlServerIngestTransactionsSupported, false);
    info.append(SqlInfo::FlightSqlServerStatementTimeout, 0i32);
    info.append(SqlInfo::FlightSqlServerTransactionTimeout, 0i32);
    info.append(SqlInfo::SqlDdlCatalog, false);
    info.append(SqlInfo::SqlDdlSchema, false);
    info.append(SqlInfo::SqlDdlTable, false);
    info.append(
        SqlInfo::SqlIdentifierCase,
        SqlSupportedCaseSensitivity::SqlCaseSensitivityUnknown as i32,
    );
    // Names are matched as written, quoted or not (datasets' names and columns are
    // case-sensitive), which the specification's choices do not describe.
    info.append(SqlInfo::SqlIdentifierQuoteChar, "\"");
    info.append(
        SqlInfo::SqlQuotedIdentifierCase,
        SqlSupportedCaseSensitivity::SqlCaseSensitivityUnknown as i32,
    );
    info.append(SqlInfo::SqlAllTablesAreSelectable, true);
    info.append(SqlInfo::SqlTransactionsSupported, false);
    info.append(SqlInfo::SqlSupportsColumnAliasing, false);
    info.append(SqlInfo::SqlNullPlusNullIsNull, true);
    info.append(SqlInfo::SqlSupportsTableCorrelationNames, false);
    info.append(SqlInfo::SqlSupportsOrderByUnrelated, false);
    info.append(SqlInfo::SqlSupportsExpressionsInOrderBy, false);
    info.append(SqlInfo::SqlSupportsLikeEscapeClause, false);
    info.append(SqlInfo::SqlSupportsNonNullableColumns, true);
    info.append(SqlInfo::SqlCatalogTerm, "catalog");
    info.append(SqlInfo::SqlSchemaTerm, "schema");
    info.append(SqlInfo::SqlCatalogAtStart, true);
    info.append(SqlInfo::SqlSelectForUpdateSupported, false);
    info.append(SqlInfo::SqlStoredProceduresSupported, false);
    info.append(SqlInfo::SqlBatchUpdatesSupported, false);
    info.append(SqlInfo::SqlSavepointsSupported, false);
    info.append(SqlInfo::SqlNamedParametersSupported, false);
    info.append(SqlInfo::SqlLocatorsUpdateCopy, false);
    info.append(SqlInfo::SqlStoredFunctionsUsingCallSyntaxSupported, false);
    info.build().map_err(|e| e.to_string())
});

fn sql_info() -> Result<&'static SqlInfoData, Error> {
    SQL_INFO
        .as_ref()
        .map_err(|e| Error::Internal(format!("building the SqlInfo table: {e}")))
}

/// The result of one catalog command: the batch and its schema (what `GetFlightInfo`
/// announces, computed from the same builder).
pub(crate) struct Listing {
    pub schema: SchemaRef,
    pub batch: RecordBatch,
}

pub(crate) fn sql_info_listing(command: CommandGetSqlInfo) -> Result<Listing, Error> {
    let builder = command.into_builder(sql_info()?);
    let schema = builder.schema();
    let batch = builder.build().map_err(arrow_error("GetSqlInfo"))?;
    Ok(Listing { schema, batch })
}

pub(crate) fn catalogs(command: CommandGetCatalogs) -> Result<Listing, Error> {
    let mut builder = command.into_builder();
    builder.append(CATALOG);
    let schema = builder.schema();
    let batch = builder.build().map_err(arrow_error("GetCatalogs"))?;
    Ok(Listing { schema, batch })
}

pub(crate) fn db_schemas(command: CommandGetDbSchemas) -> Result<Listing, Error> {
    let mut builder = command.into_builder();
    builder.append(CATALOG, DB_SCHEMA);
    let schema = builder.schema();
    let batch = builder.build().map_err(arrow_error("GetDbSchemas"))?;
    Ok(Listing { schema, batch })
}

/// Every dataset, with its Arrow schema when the client asks (`include_schema`).
pub(crate) fn tables(command: CommandGetTables, store: &Store) -> Result<Listing, Error> {
    let mut builder = command.into_builder();
    for dataset in store.list("") {
        builder
            .append(
                CATALOG,
                DB_SCHEMA,
                dataset.name(),
                TABLE_TYPE,
                &dataset.schema(),
            )
            .map_err(arrow_error("GetTables"))?;
    }
    let schema = builder.schema();
    let batch = builder.build().map_err(arrow_error("GetTables"))?;
    Ok(Listing { schema, batch })
}

pub(crate) fn table_types(command: CommandGetTableTypes) -> Result<Listing, Error> {
    let _ = command; // it has no fields
    let schema = Arc::new(Schema::new(vec![Field::new(
        "table_type",
        DataType::Utf8,
        false,
    )]));
    let types: ArrayRef = Arc::new(StringArray::from(vec![TABLE_TYPE]));
    let batch = RecordBatch::try_new(Arc::clone(&schema), vec![types])
        .map_err(arrow_error("GetTableTypes"))?;
    Ok(Listing { schema, batch })
}

/// Datasets have no keys: the specification's columns, no rows.
pub(crate) fn primary_keys(command: CommandGetPrimaryKeys) -> Result<Listing, Error> {
    let _ = command;
    let schema = Arc::new(Schema::new(vec![
        Field::new("catalog_name", DataType::Utf8, true),
        Field::new("db_schema_name", DataType::Utf8, true),
        Field::new("table_name", DataType::Utf8, false),
        Field::new("column_name", DataType::Utf8, false),
        Field::new("key_name", DataType::Utf8, true),
        Field::new("key_sequence", DataType::Int32, false),
    ]));
    let batch = RecordBatch::new_empty(Arc::clone(&schema));
    Ok(Listing { schema, batch })
}

/// No types are described: the specification's columns, no rows.
pub(crate) fn xdbc_type_info(command: CommandGetXdbcTypeInfo) -> Result<Listing, Error> {
    static NONE: LazyLock<Result<XdbcTypeInfoData, String>> = LazyLock::new(|| {
        arrow_flight::sql::metadata::XdbcTypeInfoDataBuilder::new()
            .build()
            .map_err(|e| e.to_string())
    });
    let data = NONE
        .as_ref()
        .map_err(|e| Error::Internal(format!("building the XdbcTypeInfo table: {e}")))?;
    let builder = command.into_builder(data);
    let schema = builder.schema();
    let batch = builder.build().map_err(arrow_error("GetXdbcTypeInfo"))?;
    Ok(Listing { schema, batch })
}
