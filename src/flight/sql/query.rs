//! A Flight SQL statement: `SELECT <* | column, ...> FROM <dataset> [WHERE <predicate>]
//! [LIMIT n]`, parsed with sqlparser's generic dialect, and its parameters bound from the record
//! batch a client sends.
//!
//! Names are case-sensitive, as the datasets' columns are: an unquoted name is matched as
//! written (`Price` is not `price`), a double-quoted one exactly; dataset names with `-`, `.` or
//! `/` are written in double quotes.

use arrow::array::{Array, AsArray};
use arrow::datatypes::*;
use arrow::record_batch::RecordBatch;
use serde::{Deserialize, Serialize};
use sqlparser::ast::{
    Expr, GroupByExpr, LimitClause, ObjectNamePart, SelectFlavor, SelectItem, SetExpr, Statement,
    TableFactor, Value,
};
use sqlparser::dialect::GenericDialect;
use sqlparser::parser::{Parser, ParserError};

pub use super::error::SqlError;
use super::predicate::{self, Literal, Predicate};

/// The longest SQL text accepted, checked before parsing.
pub const MAX_SQL_BYTES: usize = 64 * 1024;

/// sqlparser's recursion limit: how deeply parentheses, `NOT` and subexpressions may nest.
pub const MAX_NESTING: usize = 40;

/// What one supported statement reads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Query {
    /// The dataset's name, as written (quoted names exactly).
    pub table: String,
    /// The selected columns in order, as written; `None` for `*`.
    pub columns: Option<Vec<String>>,
    pub filter: Option<Predicate>,
    pub limit: Option<u64>,
}

/// Parses one supported statement; anything else is [`SqlError::Unsupported`] (valid SQL that is
/// not run here) or [`SqlError::Invalid`].
pub fn parse(sql: &str) -> Result<Query, SqlError> {
    if sql.len() > MAX_SQL_BYTES {
        return Err(SqlError::invalid(format!(
            "the SQL text is {} bytes; at most {MAX_SQL_BYTES} are accepted",
            sql.len()
        )));
    }
    let mut statements = Parser::new(&GenericDialect {})
        .with_recursion_limit(MAX_NESTING)
        .try_with_sql(sql)
        .and_then(|mut parser| parser.parse_statements())
        .map_err(|e| match e {
            ParserError::RecursionLimitExceeded => SqlError::invalid(format!(
                "the statement nests more than {MAX_NESTING} levels deep"
            )),
            other => SqlError::invalid(format!("SQL syntax: {other}")),
        })?;
    let statement = match (statements.pop(), statements.len()) {
        (Some(statement), 0) => statement,
        (None, _) => return Err(SqlError::invalid("the SQL text holds no statement")),
        (Some(_), n) => return Err(SqlError::unsupported(format!("{} statements", n + 1))),
    };
    let Statement::Query(mut query) = statement else {
        let first = sql.split_whitespace().next().unwrap_or_default();
        let first: String = first.chars().take(24).collect();
        return Err(SqlError::unsupported(format!(
            "a statement starting with {first}"
        )));
    };
    let found = |what: &str| Err(SqlError::unsupported(what));
    if query.with.is_some() {
        return found("WITH");
    }
    if query.order_by.is_some() {
        return found("ORDER BY");
    }
    if query.fetch.is_some() {
        return found("FETCH");
    }
    let limit = match query.limit_clause.take() {
        None => None,
        Some(LimitClause::LimitOffset {
            limit,
            offset,
            limit_by,
        }) => {
            if offset.is_some() {
                return found("OFFSET");
            }
            if !limit_by.is_empty() {
                return found("LIMIT BY");
            }
            limit.map(|l| parse_limit(&l)).transpose()?
        }
        Some(LimitClause::OffsetCommaLimit { .. }) => return found("LIMIT offset, count"),
    };
    let SetExpr::Select(select) = query.body.as_mut() else {
        return found(match query.body.as_ref() {
            SetExpr::SetOperation { .. } => "UNION, INTERSECT or EXCEPT",
            SetExpr::Values(_) => "VALUES",
            SetExpr::Query(_) => "a query in parentheses",
            _ => "a statement other than SELECT",
        });
    };
    if select.distinct.is_some() {
        return found("DISTINCT");
    }
    if select.top.is_some() {
        return found("TOP");
    }
    if select.into.is_some() {
        return found("SELECT INTO");
    }
    if select.group_by != GroupByExpr::Expressions(vec![], vec![]) {
        return found("GROUP BY");
    }
    if select.having.is_some() {
        return found("HAVING");
    }
    if select.qualify.is_some() || !select.named_window.is_empty() {
        return found("window clauses");
    }
    if select.flavor != SelectFlavor::Standard {
        return found("FROM before SELECT");
    }
    let table = match select.from.as_slice() {
        [] => return found("SELECT without FROM"),
        [one] if !one.joins.is_empty() => return found("JOIN"),
        [one] => match &one.relation {
            TableFactor::Table { name, alias, .. } => {
                if alias.is_some() {
                    return found("a table alias");
                }
                match name.0.as_slice() {
                    [ObjectNamePart::Identifier(ident)] => ident.value.clone(),
                    _ => {
                        return found(
                            "a qualified dataset name (schema.name; write names holding '.' in \
                             double quotes: FROM \"a.b\")",
                        );
                    }
                }
            }
            _ => return found("a subquery, function or join in FROM"),
        },
        _ => return found("several tables in FROM"),
    };
    if table.is_empty() {
        return Err(SqlError::invalid("the dataset name is empty"));
    }
    let columns = projection(&select.projection)?;
    let selection = select.selection.take();
    // What remains must print as the plain statement: anything else sqlparser accepted (hints,
    // modifiers, clauses of other dialects) is refused here. The WHERE clause and LIMIT were
    // taken out first, so this prints only names.
    let plain = match &columns {
        None => format!("SELECT * FROM {}", select.from[0]),
        Some(_) => format!(
            "SELECT {} FROM {}",
            select
                .projection
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", "),
            select.from[0]
        ),
    };
    if query.to_string() != plain {
        return found("a clause beyond SELECT ... FROM ... WHERE ... LIMIT");
    }
    let filter = selection.as_ref().map(predicate::from_expr).transpose()?;
    Ok(Query {
        table,
        columns,
        filter,
        limit,
    })
}

fn projection(items: &[SelectItem]) -> Result<Option<Vec<String>>, SqlError> {
    if let [SelectItem::Wildcard(_)] = items {
        return Ok(None);
    }
    let mut columns: Vec<String> = Vec::with_capacity(items.len());
    for item in items {
        let name = match item {
            SelectItem::UnnamedExpr(Expr::Identifier(ident)) => ident.value.clone(),
            SelectItem::Wildcard(_) => return Err(SqlError::unsupported("* beside other columns")),
            SelectItem::QualifiedWildcard(..) => return Err(SqlError::unsupported("table.*")),
            SelectItem::ExprWithAlias { .. } => {
                return Err(SqlError::unsupported("an alias (AS) in the select list"));
            }
            SelectItem::UnnamedExpr(e) => {
                return Err(SqlError::unsupported(format!(
                    "{} in the select list",
                    predicate::describe(e)
                )));
            }
            SelectItem::ExprWithAliases { .. } => {
                return Err(SqlError::unsupported("aliases in the select list"));
            }
        };
        if columns.contains(&name) {
            return Err(SqlError::invalid(format!(
                "column \"{name}\" is selected twice"
            )));
        }
        columns.push(name);
    }
    Ok(Some(columns))
}

fn parse_limit(limit: &Expr) -> Result<u64, SqlError> {
    match limit {
        Expr::Value(v) => match &v.value {
            Value::Number(text, _) => text.parse::<u64>().map_err(|_| {
                SqlError::invalid(format!(
                    "LIMIT {text}: LIMIT takes a whole number from 0 to {}",
                    u64::MAX
                ))
            }),
            Value::Placeholder(_) => Err(SqlError::unsupported("a parameter in LIMIT")),
            _ => Err(SqlError::unsupported(
                "LIMIT with something other than a number",
            )),
        },
        _ => Err(SqlError::unsupported(format!(
            "{} in LIMIT (LIMIT takes a whole number)",
            predicate::describe(limit)
        ))),
    }
}

impl Query {
    /// How many parameters (`?` or `$1..$n`) the statement takes.
    pub fn placeholders(&self) -> usize {
        self.filter.as_ref().map_or(0, Predicate::placeholders)
    }

    /// The statement with its placeholders replaced by row `row` of `params`: one column per
    /// parameter, in order (ADBC binds a record batch). Whether each value can be compared with
    /// its column is checked with the filter ([`Predicate::check`]).
    pub fn bind(&self, params: &RecordBatch, row: usize) -> Result<Query, SqlError> {
        let expected = self.placeholders();
        if params.num_columns() != expected {
            return Err(SqlError::invalid(format!(
                "the statement takes {expected} parameters; {} were bound",
                params.num_columns()
            )));
        }
        if expected == 0 {
            return Ok(self.clone());
        }
        if row >= params.num_rows() {
            return Err(SqlError::invalid(format!(
                "parameter row {row} does not exist: {} rows were bound",
                params.num_rows()
            )));
        }
        let values = params
            .columns()
            .iter()
            .enumerate()
            .map(|(i, column)| literal(column.as_ref(), row, i + 1))
            .collect::<Result<Vec<_>, _>>()?;
        let filter = match &self.filter {
            Some(filter) => Some(filter.bind(&values)?),
            None => None,
        };
        Ok(Query {
            filter,
            ..self.clone()
        })
    }
}

/// Value `row` of a parameter column as a literal, written so that it reads back exactly.
fn literal(array: &dyn Array, row: usize, number: usize) -> Result<Literal, SqlError> {
    if array.data_type() == &DataType::Null || array.logical_nulls().is_some_and(|n| n.is_null(row))
    {
        return Ok(Literal::Null);
    }
    let refuse =
        |why: &str| SqlError::invalid(format!("parameter {number} ({}) {why}", array.data_type()));
    let float = |v: f64| {
        if v.is_finite() {
            // Rust prints the shortest decimal that reads back as the same double.
            Ok(Literal::Number(format!("{v}")))
        } else {
            Err(refuse("is not a finite number"))
        }
    };
    let number = |text: String| Ok(Literal::Number(text));
    Ok(match array.data_type() {
        DataType::Int8 => number(array.as_primitive::<Int8Type>().value(row).to_string())?,
        DataType::Int16 => number(array.as_primitive::<Int16Type>().value(row).to_string())?,
        DataType::Int32 => number(array.as_primitive::<Int32Type>().value(row).to_string())?,
        DataType::Int64 => number(array.as_primitive::<Int64Type>().value(row).to_string())?,
        DataType::UInt8 => number(array.as_primitive::<UInt8Type>().value(row).to_string())?,
        DataType::UInt16 => number(array.as_primitive::<UInt16Type>().value(row).to_string())?,
        DataType::UInt32 => number(array.as_primitive::<UInt32Type>().value(row).to_string())?,
        DataType::UInt64 => number(array.as_primitive::<UInt64Type>().value(row).to_string())?,
        DataType::Float16 => float(array.as_primitive::<Float16Type>().value(row).to_f64())?,
        DataType::Float32 => float(f64::from(array.as_primitive::<Float32Type>().value(row)))?,
        DataType::Float64 => float(array.as_primitive::<Float64Type>().value(row))?,
        DataType::Decimal128(p, s) => number(Decimal128Type::format_decimal(
            array.as_primitive::<Decimal128Type>().value(row),
            *p,
            *s,
        ))?,
        DataType::Decimal256(p, s) => number(Decimal256Type::format_decimal(
            array.as_primitive::<Decimal256Type>().value(row),
            *p,
            *s,
        ))?,
        DataType::Boolean => Literal::Boolean(array.as_boolean().value(row)),
        DataType::Utf8 => Literal::String(array.as_string::<i32>().value(row).to_owned()),
        DataType::LargeUtf8 => Literal::String(array.as_string::<i64>().value(row).to_owned()),
        DataType::Utf8View => Literal::String(array.as_string_view().value(row).to_owned()),
        DataType::Date32 | DataType::Date64 | DataType::Timestamp(..) => {
            let at = match array.data_type() {
                DataType::Date32 => array.as_primitive::<Date32Type>().value_as_datetime(row),
                DataType::Date64 => array.as_primitive::<Date64Type>().value_as_datetime(row),
                DataType::Timestamp(TimeUnit::Second, _) => array
                    .as_primitive::<TimestampSecondType>()
                    .value_as_datetime(row),
                DataType::Timestamp(TimeUnit::Millisecond, _) => array
                    .as_primitive::<TimestampMillisecondType>()
                    .value_as_datetime(row),
                DataType::Timestamp(TimeUnit::Microsecond, _) => array
                    .as_primitive::<TimestampMicrosecondType>()
                    .value_as_datetime(row),
                _ => array
                    .as_primitive::<TimestampNanosecondType>()
                    .value_as_datetime(row),
            }
            .ok_or_else(|| refuse("is out of the range of dates this server reads"))?;
            match array.data_type() {
                // A zoned timestamp is an instant: written in UTC with its zone.
                DataType::Timestamp(_, Some(_)) => {
                    Literal::Timestamp(at.format("%Y-%m-%dT%H:%M:%S%.fZ").to_string())
                }
                DataType::Timestamp(..) => {
                    Literal::Timestamp(at.format("%Y-%m-%dT%H:%M:%S%.f").to_string())
                }
                _ if at.time() == chrono::NaiveTime::MIN => {
                    Literal::Date(at.format("%Y-%m-%d").to_string())
                }
                _ => Literal::Timestamp(at.format("%Y-%m-%dT%H:%M:%S%.f").to_string()),
            }
        }
        _ => {
            return Err(refuse(
                "has a type parameters cannot take: integers, floats, decimals, booleans, \
                 strings, dates and timestamps",
            ));
        }
    })
}
