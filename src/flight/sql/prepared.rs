//! Prepared statements: SELECTs parsed once, run with the parameters a client binds through
//! `DoPut`, until closed. Preparing answers with the schemas of the rows and of the parameters
//! (`parameters`).
//!
//! A statement belongs to the principal that prepared it: others are told it does not exist
//! (NOT_FOUND, as for one closed). There are at most [`MAX_STATEMENTS`]; one unused for
//! [`IDLE`] is closed to make room, so a client that never closes its statements cannot fill
//! the server.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use arrow::ipc::writer::IpcWriteOptions;
use arrow::record_batch::RecordBatch;
use arrow_flight::sql::ActionCreatePreparedStatementResult;
use arrow_flight::{IpcMessage, SchemaAsIpc};
use bytes::Bytes;
use dashmap::DashMap;

use super::query::{self, Query};
use super::{parameters, statement};
use crate::auth::Principal;
use crate::error::Error;
use crate::flight::Service;

/// Most prepared statements a server holds at once (each holds at most a 64 KiB statement),
/// and one principal: a principal's least recently used makes room for its next, so a client
/// that never closes its statements (a JDBC tool preparing every query) crowds out only itself.
pub(super) const MAX_STATEMENTS: usize = 1024;
pub(super) const MAX_PER_PRINCIPAL: usize = 256;
/// A statement unused this long may be closed to make room for a new one.
pub(super) const IDLE: Duration = Duration::from_secs(3600);
/// Most bytes of parameters bound to one statement, and to all of them.
pub(crate) const MAX_PARAMETER_BYTES: usize = 1 << 20;
pub(super) const MAX_ALL_PARAMETER_BYTES: usize = 64 << 20;

struct Statement {
    owner: Arc<str>,
    /// The statement as prepared, which its tickets carry.
    sql: String,
    query: Query,
    parameters: Option<RecordBatch>,
    /// What `parameters` count in `Prepared::bound`.
    parameter_bytes: usize,
    used: Instant,
}

/// The server's prepared statements, by handle.
#[derive(Default)]
pub(crate) struct Prepared {
    statements: DashMap<Bytes, Statement>,
    /// Bytes of the parameters bound to all statements.
    bound: std::sync::atomic::AtomicUsize,
}

impl std::fmt::Debug for Prepared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prepared")
            .field("statements", &self.statements.len())
            .finish()
    }
}

fn unknown() -> Error {
    Error::UnknownPreparedStatement(format!(
        "no such prepared statement: it was closed, made room for newer ones (a principal holds \
         at most {MAX_PER_PRINCIPAL}, and one idle for an hour may be closed), or was prepared \
         by another principal; prepare it again"
    ))
}

impl Prepared {
    pub(crate) fn create(
        &self,
        service: &Service,
        sql: &str,
        caller: &Principal,
    ) -> Result<ActionCreatePreparedStatementResult, Error> {
        let query = query::parse(sql)?;
        let schema = statement::output_schema(service, &query)?;
        let parameter_schema =
            parameters::schema(&query, &service.store.get(&query.table)?.schema())?;
        let mine: Vec<(Bytes, Instant)> = self
            .statements
            .iter()
            .filter(|entry| entry.owner == caller.name)
            .map(|entry| (entry.key().clone(), entry.used))
            .collect();
        if mine.len() >= MAX_PER_PRINCIPAL
            && let Some((oldest, _)) = mine.iter().min_by_key(|(_, used)| *used)
            && let Some((_, evicted)) = self.statements.remove(oldest)
        {
            self.bound
                .fetch_sub(evicted.parameter_bytes, Ordering::Relaxed);
        }
        if self.statements.len() >= MAX_STATEMENTS {
            let bound = &self.bound;
            self.statements.retain(|_, statement| {
                let keep = statement.used.elapsed() < IDLE;
                if !keep {
                    bound.fetch_sub(statement.parameter_bytes, Ordering::Relaxed);
                }
                keep
            });
            if self.statements.len() >= MAX_STATEMENTS {
                return Err(Error::PreparedStatementsFull(format!(
                    "too many prepared statements: at most {MAX_STATEMENTS} (those idle for an \
                     hour make room); close statements when done"
                )));
            }
        }
        let mut handle = [0u8; 16];
        getrandom::fill(&mut handle)
            .map_err(|e| Error::Internal(format!("no randomness for a handle: {e}")))?;
        let handle = Bytes::from(hex::encode(handle));
        let encode = |schema: &arrow::datatypes::Schema| {
            let options = IpcWriteOptions::default();
            let message: Result<IpcMessage, _> = SchemaAsIpc::new(schema, &options).try_into();
            message.map(|message| message.0).map_err(|e| {
                Error::Internal(format!("encoding a prepared statement's schemas: {e}"))
            })
        };
        let dataset_schema = encode(&schema)?;
        let parameter_schema = encode(&parameter_schema)?;
        self.statements.insert(
            handle.clone(),
            Statement {
                owner: Arc::clone(&caller.name),
                sql: sql.to_owned(),
                query,
                parameters: None,
                parameter_bytes: 0,
                used: Instant::now(),
            },
        );
        Ok(ActionCreatePreparedStatementResult {
            prepared_statement_handle: handle,
            dataset_schema,
            parameter_schema,
        })
    }

    /// The statement's query with its parameters bound (one row), and what its tickets carry.
    pub(crate) fn bound_query(
        &self,
        handle: &[u8],
        caller: &Principal,
    ) -> Result<(Query, statement::Source), Error> {
        let mut statement = self.statements.get_mut(handle).ok_or_else(unknown)?;
        if statement.owner != caller.name {
            return Err(unknown());
        }
        statement.used = Instant::now();
        let wanted = statement.query.placeholders();
        if wanted == 0 {
            let source = statement::Source {
                sql: statement.sql.clone(),
                parameters: None,
            };
            return Ok((statement.query.clone(), source));
        }
        let Some(parameters) = &statement.parameters else {
            return Err(Error::InvalidCommand(format!(
                "this statement takes {wanted} parameters: bind them first"
            )));
        };
        if parameters.num_rows() != 1 {
            return Err(Error::InvalidCommand(format!(
                "a query runs with one row of parameters; {} were bound",
                parameters.num_rows()
            )));
        }
        let source = statement::Source {
            sql: statement.sql.clone(),
            parameters: Some(parameters.clone()),
        };
        Ok((statement.query.bind(parameters, 0)?, source))
    }

    /// Binds `batches` (concatenated) as the statement's parameters.
    pub(crate) fn bind(
        &self,
        handle: &[u8],
        batches: Vec<RecordBatch>,
        caller: &Principal,
    ) -> Result<(), Error> {
        let mut statement = self.statements.get_mut(handle).ok_or_else(unknown)?;
        if statement.owner != caller.name {
            return Err(unknown());
        }
        self.bound
            .fetch_sub(statement.parameter_bytes, Ordering::Relaxed);
        statement.parameters = None;
        statement.parameter_bytes = 0;
        let Some(first) = batches.first() else {
            return Ok(());
        };
        let parameters = arrow::compute::concat_batches(&first.schema(), &batches)
            .map_err(|e| Error::InvalidIpc(format!("parameters of differing schemas: {e}")))?;
        let bytes = parameters.get_array_memory_size();
        if self.bound.fetch_add(bytes, Ordering::Relaxed) + bytes > MAX_ALL_PARAMETER_BYTES {
            self.bound.fetch_sub(bytes, Ordering::Relaxed);
            return Err(Error::PreparedStatementsFull(format!(
                "the parameters bound to all prepared statements are at most \
                 {MAX_ALL_PARAMETER_BYTES} bytes; close statements when done"
            )));
        }
        statement.parameters = Some(parameters);
        statement.parameter_bytes = bytes;
        statement.used = Instant::now();
        Ok(())
    }

    /// Closes the caller's statement under `handle`. Closing one that is not there (closed
    /// already, or closed to make room) succeeds, as it does in Arrow's Java example server: ADBC
    /// closes a cursor's statement before preparing the cursor's next, and closes it with the
    /// cursor, so a cursor whose statement the server closed could otherwise neither prepare
    /// again nor close. Another principal's statement stays, and the caller learns nothing of it.
    pub(crate) fn close(&self, handle: &[u8], caller: &Principal) {
        if let Some((_, statement)) = self
            .statements
            .remove_if(handle, |_, statement| statement.owner == caller.name)
        {
            self.bound
                .fetch_sub(statement.parameter_bytes, Ordering::Relaxed);
        }
    }
}
