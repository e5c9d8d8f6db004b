//! The row predicate of a `WHERE` clause: comparisons of one column with a literal or a
//! parameter, `IS [NOT] NULL`, `[NOT] IN (...)`, `[NOT] BETWEEN`, joined by `AND`, `OR`, `NOT`.
//!
//! A [`Predicate`] is what the statement says, independent of any schema; it is serialised into
//! tickets. `build` makes one from sqlparser's AST; `eval` resolves it against a schema into a
//! [`Filter`] (each literal read as a value of its column's type) and evaluates that with
//! arrow's kernels under SQL's three-valued logic.

mod build;
mod eval;
mod number;

use arrow::array::BooleanArray;
use arrow::datatypes::Schema;
use arrow::record_batch::RecordBatch;
use serde::{Deserialize, Serialize};

use super::error::SqlError;
pub use build::{MAX_IN_LIST, MAX_PARAMETERS};
pub(super) use build::{describe, from_expr};
pub use eval::Filter;

/// A boolean condition on the rows of one dataset.
///
/// `AND` and `OR` are n-ary so that long chains (`a = 1 OR a = 2 OR ...`) stay shallow.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Predicate {
    /// `column op value`; `value op column` is stored with the operator flipped.
    Compare {
        column: String,
        op: CmpOp,
        value: Operand,
    },
    /// `column IS NULL`, or `IS NOT NULL` when `negated`.
    IsNull {
        column: String,
        negated: bool,
    },
    /// `column IN (list)`, or `NOT IN` when `negated`.
    InList {
        column: String,
        list: Vec<Operand>,
        negated: bool,
    },
    /// `column BETWEEN low AND high` (both ends included), or `NOT BETWEEN` when `negated`.
    Between {
        column: String,
        low: Operand,
        high: Operand,
        negated: bool,
    },
    And(Vec<Predicate>),
    Or(Vec<Predicate>),
    Not(Box<Predicate>),
}

/// A comparison operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum CmpOp {
    Eq,
    NotEq,
    Lt,
    LtEq,
    Gt,
    GtEq,
}

impl CmpOp {
    /// The operator that gives the same answer with its operands swapped (`5 < x` is `x > 5`).
    pub fn flip(self) -> Self {
        match self {
            Self::Eq => Self::Eq,
            Self::NotEq => Self::NotEq,
            Self::Lt => Self::Gt,
            Self::LtEq => Self::GtEq,
            Self::Gt => Self::Lt,
            Self::GtEq => Self::LtEq,
        }
    }
}

/// What a column is compared with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Operand {
    Literal(Literal),
    /// A parameter (`?` or `$n`), numbered from 0 in the order the statement's parameters take.
    Placeholder(usize),
}

/// A literal as the statement wrote it. Its meaning depends on the column it is compared with
/// (`'2024-01-01'` is a date for a date column, a string for a string column), so conversion
/// happens when the predicate meets a schema, never here.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Literal {
    Null,
    Boolean(bool),
    /// An exact number: integer, decimal or exponent form (`42`, `-2.50`, `1e-3`), kept as text
    /// so that comparisons with integer and decimal columns are exact.
    Number(String),
    String(String),
    /// `DATE '...'`: `YYYY-MM-DD`.
    Date(String),
    /// `TIMESTAMP '...'`: RFC 3339-like, with or without a zone; without one it is read in the
    /// column's time zone (UTC for a column without one).
    Timestamp(String),
}

impl Predicate {
    /// The columns the predicate reads, each once, in order of first appearance.
    pub fn columns(&self) -> Vec<String> {
        let mut out = Vec::new();
        self.visit_columns(&mut |column| {
            if !out.iter().any(|c| c == column) {
                out.push(column.to_owned());
            }
        });
        out
    }

    fn visit_columns(&self, f: &mut impl FnMut(&str)) {
        match self {
            Self::Compare { column, .. }
            | Self::IsNull { column, .. }
            | Self::InList { column, .. }
            | Self::Between { column, .. } => f(column),
            Self::And(children) | Self::Or(children) => {
                children.iter().for_each(|c| c.visit_columns(f));
            }
            Self::Not(child) => child.visit_columns(f),
        }
    }

    /// How many parameters the predicate takes: one more than the highest placeholder number.
    pub fn placeholders(&self) -> usize {
        let mut count = 0;
        self.visit_operands(&mut |operand| {
            if let Operand::Placeholder(i) = operand {
                count = count.max(i.saturating_add(1));
            }
        });
        count
    }

    fn visit_operands(&self, f: &mut impl FnMut(&Operand)) {
        match self {
            Self::Compare { value, .. } => f(value),
            Self::IsNull { .. } => {}
            Self::InList { list, .. } => list.iter().for_each(f),
            Self::Between { low, high, .. } => {
                f(low);
                f(high);
            }
            Self::And(children) | Self::Or(children) => {
                children.iter().for_each(|c| c.visit_operands(f));
            }
            Self::Not(child) => child.visit_operands(f),
        }
    }

    /// The predicate with each placeholder `i` replaced by `values[i]`.
    pub fn bind(&self, values: &[Literal]) -> Result<Predicate, SqlError> {
        let operand =
            |o: &Operand| match o {
                Operand::Literal(_) => Ok(o.clone()),
                Operand::Placeholder(i) => values
                    .get(*i)
                    .cloned()
                    .map(Operand::Literal)
                    .ok_or_else(|| {
                        SqlError::invalid(format!(
                            "parameter {} has no value: {} given",
                            i.saturating_add(1),
                            values.len()
                        ))
                    }),
            };
        Ok(match self {
            Self::Compare { column, op, value } => Self::Compare {
                column: column.clone(),
                op: *op,
                value: operand(value)?,
            },
            Self::IsNull { .. } => self.clone(),
            Self::InList {
                column,
                list,
                negated,
            } => Self::InList {
                column: column.clone(),
                list: list.iter().map(operand).collect::<Result<_, _>>()?,
                negated: *negated,
            },
            Self::Between {
                column,
                low,
                high,
                negated,
            } => Self::Between {
                column: column.clone(),
                low: operand(low)?,
                high: operand(high)?,
                negated: *negated,
            },
            Self::And(children) => Self::And(bind_all(children, values)?),
            Self::Or(children) => Self::Or(bind_all(children, values)?),
            Self::Not(child) => Self::Not(Box::new(child.bind(values)?)),
        })
    }

    /// Resolves the predicate against `schema`: each column found, each literal read as a value
    /// of its column's type. Errors name unknown columns, and a literal that cannot be compared
    /// with its column's type with both types.
    pub fn prepare(&self, schema: &Schema) -> Result<Filter, SqlError> {
        Filter::new(self, schema)
    }

    /// Checks that the predicate can be evaluated over rows of `schema` (see [`Self::prepare`]).
    pub fn check(&self, schema: &Schema) -> Result<(), SqlError> {
        self.prepare(schema).map(drop)
    }

    /// Evaluates the predicate over `batch` with SQL's three-valued logic: a row is kept where
    /// the result is true (NULL is not true). Prepare once with [`Self::prepare`] to evaluate
    /// many batches of one schema.
    pub fn evaluate(&self, batch: &RecordBatch) -> Result<BooleanArray, SqlError> {
        self.prepare(batch.schema_ref())?.evaluate(batch)
    }
}

fn bind_all(children: &[Predicate], values: &[Literal]) -> Result<Vec<Predicate>, SqlError> {
    children.iter().map(|c| c.bind(values)).collect()
}
