//! The SQL that Flight SQL clients (ADBC, Polars, DBeaver-style tools) send: one statement form,
//! `SELECT <* | columns> FROM <dataset> [WHERE <predicate>] [LIMIT n]`, parsed with `sqlparser`
//! into a [`query::Query`] small enough to travel inside a ticket, and a row predicate that is
//! checked against a dataset's schema and evaluated with arrow's compute kernels.
//!
//! Pure functions of text, parameters and record batches: the protocol (`crate::flight`) decides
//! what a statement reads and where its filter runs.

pub mod error;
pub mod predicate;
pub mod query;
