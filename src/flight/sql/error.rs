//! The one error type of the SQL layer, shared by parsing, binding and evaluation.

/// Why a statement cannot be run. Messages are written for the client that sent the SQL.
#[derive(Debug, thiserror::Error)]
pub enum SqlError {
    /// Valid SQL that this server does not run; the message says exactly what is supported.
    #[error("{0}")]
    Unsupported(String),
    /// Not valid, or not meaningful for this dataset: syntax errors, unknown columns, type
    /// mismatches, bad parameter counts.
    #[error("{0}")]
    Invalid(String),
}

impl SqlError {
    pub(super) fn invalid(message: impl Into<String>) -> Self {
        Self::Invalid(message.into())
    }
}

/// The statements and conditions this server runs, quoted in every refusal.
pub const SUPPORTED: &str = "this server runs only SELECT * | column[, column ...] FROM dataset \
[WHERE condition] [LIMIT n]; a condition is column op value (op: = <> != < <= > >=, the column \
on either side), column IS [NOT] NULL, column [NOT] IN (value, ...), column [NOT] BETWEEN value AND \
value, a boolean column alone, or conditions joined by AND, OR, NOT and parentheses; a value is a \
number, a 'string', TRUE, FALSE, NULL, DATE '...', TIMESTAMP '...', or a parameter (? or $1, $2, \
...); names with characters other than letters, digits and _ are written in double quotes";

impl SqlError {
    /// A refusal of valid SQL: what was found, then the supported grammar.
    pub(super) fn unsupported(found: impl std::fmt::Display) -> Self {
        Self::Unsupported(format!("{found} is not supported: {SUPPORTED}"))
    }
}
