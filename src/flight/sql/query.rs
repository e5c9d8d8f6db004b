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

/// The catalog and schema of every dataset, as the Flight SQL catalog commands list them.
const CATALOG: &str = "gpu_flight";
const SCHEMA: &str = "main";

/// sqlparser's recursion limit: how deeply parentheses, `NOT` and subexpressions may nest.
pub const MAX_NESTING: usize = 40;

/// The stack of the thread that parses. sqlparser recurses once per nesting level with large
/// frames (39 nested `NOT` overflowed 2 MiB in a debug build), and builds `a + a + ...` and
/// `AND` chains left-deep without counting them, so dropping a 64 KiB statement recurses some
/// 30,000 levels. Only the pages used are committed.
const PARSE_STACK_BYTES: usize = 256 * 1024 * 1024;

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
///
/// Parsing runs on a short-lived thread of its own (see `PARSE_STACK_BYTES`) and takes well
/// under a millisecond for the longest text accepted.
pub fn parse(sql: &str) -> Result<Query, SqlError> {
    if sql.len() > MAX_SQL_BYTES {
        return Err(SqlError::invalid(format!(
            "the SQL text is {} bytes; at most {MAX_SQL_BYTES} are accepted",
            sql.len()
        )));
    }
    let _turn = ParseTurn::take();
    std::thread::scope(|scope| {
        let parser = std::thread::Builder::new()
            .name("sql-parse".to_owned())
            .stack_size(PARSE_STACK_BYTES)
            .spawn_scoped(scope, || parse_here(sql))
            .map_err(|e| SqlError::invalid(format!("cannot start the SQL parser: {e}")))?;
        parser
            .join()
            .unwrap_or_else(|_| Err(SqlError::invalid("the SQL parser failed")))
    })
}

/// Most parser threads at once: a flood of statements waits its turn rather than reserving
/// `PARSE_STACK_BYTES` of address space per request.
const MAX_PARSERS: usize = 4;

/// One of the [`MAX_PARSERS`] turns, held while a statement is parsed.
struct ParseTurn;

static PARSERS: (std::sync::Mutex<usize>, std::sync::Condvar) =
    (std::sync::Mutex::new(0), std::sync::Condvar::new());

impl ParseTurn {
    fn take() -> Self {
        let (count, freed) = &PARSERS;
        let mut running = count.lock().unwrap_or_else(|e| e.into_inner());
        while *running >= MAX_PARSERS {
            running = freed.wait(running).unwrap_or_else(|e| e.into_inner());
        }
        *running += 1;
        Self
    }
}

impl Drop for ParseTurn {
    fn drop(&mut self) {
        let (count, freed) = &PARSERS;
        let mut running = count.lock().unwrap_or_else(|e| e.into_inner());
        *running = running.saturating_sub(1);
        freed.notify_one();
    }
}

fn parse_here(sql: &str) -> Result<Query, SqlError> {
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
                // SQL tools qualify names with the catalog and schema the catalog commands
                // list (gpu_flight.main.t, main.t): those are the only ones.
                let parts: Vec<&str> = name
                    .0
                    .iter()
                    .map(|part| match part {
                        ObjectNamePart::Identifier(ident) => Some(ident.value.as_str()),
                        _ => None,
                    })
                    .collect::<Option<_>>()
                    .unwrap_or_default();
                match parts.as_slice() {
                    [table] | [SCHEMA, table] | [CATALOG, SCHEMA, table] => (*table).to_owned(),
                    _ => {
                        return found(
                            "a dataset name qualified other than gpu_flight.main.name or \
                             main.name (write names holding '.' in double quotes: FROM \"a.b\")",
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{
        ArrayRef, BooleanArray, Float64Array, Int64Array, NullArray, StringArray,
        TimestampMicrosecondArray,
    };

    use super::*;
    use crate::flight::sql::predicate::{CmpOp, Operand};

    fn ok(sql: &str) -> Query {
        parse(sql).unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    fn refused(sql: &str) -> (bool, String) {
        match parse(sql) {
            Ok(q) => panic!("{sql} was accepted: {q:?}"),
            Err(SqlError::Unsupported(m)) => (true, m),
            Err(SqlError::Invalid(m)) => (false, m),
        }
    }

    fn lit(l: Literal) -> Operand {
        Operand::Literal(l)
    }

    #[test]
    fn parses_the_supported_forms() {
        // Qualified as the catalog commands list datasets (SQL tools write them so).
        for qualified in [
            r#"SELECT * FROM main."t""#,
            r#"SELECT * FROM gpu_flight.main.t"#,
        ] {
            assert_eq!(ok(qualified).table, "t", "{qualified}");
        }
        let q = ok("SELECT * FROM t");
        assert_eq!(
            q,
            Query {
                table: "t".into(),
                columns: None,
                filter: None,
                limit: None
            }
        );
        let q = ok("select a, \"B c\", Price from \"my-data.v1/x\" limit 10;");
        assert_eq!(q.table, "my-data.v1/x");
        assert_eq!(
            q.columns,
            Some(vec!["a".into(), "B c".into(), "Price".into()])
        );
        assert_eq!(q.limit, Some(10));
        let q = ok("SELECT * FROM t LIMIT 18446744073709551615");
        assert_eq!(q.limit, Some(u64::MAX));
        let q = ok("SELECT * FROM t WHERE 5 < x");
        assert_eq!(
            q.filter,
            Some(Predicate::Compare {
                column: "x".into(),
                op: CmpOp::Gt,
                value: lit(Literal::Number("5".into()))
            })
        );
        let q = ok("SELECT * FROM t WHERE a = 1 AND b <> -2.5e1 AND c IS NULL AND d IS NOT NULL");
        let Some(Predicate::And(parts)) = q.filter else {
            panic!("{q:?}")
        };
        assert_eq!(parts.len(), 4);
        assert_eq!(
            parts[1],
            Predicate::Compare {
                column: "b".into(),
                op: CmpOp::NotEq,
                value: lit(Literal::Number("-2.5e1".into()))
            }
        );
        let q = ok(
            "SELECT * FROM t WHERE (a IN (1, 'x', NULL) OR b NOT IN (TRUE)) \
                    AND NOT c BETWEEN DATE '2024-01-01' AND TIMESTAMP '2024-02-01 10:00:00+01:00' \
                    AND flag",
        );
        let Some(Predicate::And(parts)) = q.filter else {
            panic!("{q:?}")
        };
        assert!(matches!(&parts[0], Predicate::Or(o) if o.len() == 2));
        assert!(matches!(&parts[1], Predicate::Not(b) if matches!(**b, Predicate::Between { .. })));
        assert_eq!(
            parts[2],
            Predicate::Compare {
                column: "flag".into(),
                op: CmpOp::Eq,
                value: lit(Literal::Boolean(true))
            }
        );
    }

    #[test]
    fn refuses_what_it_does_not_run() {
        for (sql, word) in [
            ("SELECT a, b FROM t JOIN u ON t.a = u.a", "JOIN"),
            ("SELECT a FROM t GROUP BY a", "GROUP BY"),
            ("SELECT a FROM t ORDER BY a", "ORDER BY"),
            ("SELECT a + 1 FROM t", "operator +"),
            ("SELECT a AS b FROM t", "alias"),
            ("SELECT * FROM (SELECT * FROM t)", "subquery"),
            ("SELECT * FROM t; SELECT * FROM u", "2 statements"),
            ("SELECT * FROM t LIMIT 5 OFFSET 2", "OFFSET"),
            ("SELECT DISTINCT a FROM t", "DISTINCT"),
            ("SELECT upper(a) FROM t", "function upper"),
            ("INSERT INTO t VALUES (1)", "INSERT"),
            ("UPDATE t SET a = 1", "UPDATE"),
            ("CREATE TABLE t (a INT)", "CREATE"),
            ("DROP TABLE t", "DROP"),
            ("SELECT * FROM t WHERE a = b", "another column"),
            ("SELECT * FROM t WHERE a + 1 = 2", "operator +"),
            ("SELECT * FROM t WHERE a LIKE 'x%'", "LIKE"),
            (
                "SELECT * FROM t WHERE a IN (SELECT b FROM u)",
                "IN with something other",
            ),
            (
                "SELECT * FROM s.t",
                "qualified other than gpu_flight.main.name",
            ),
            ("SELECT t.a FROM t", "qualified name"),
            ("SELECT * FROM t WHERE t.a = 1", "qualified column"),
            ("SELECT * FROM t, u", "several tables"),
            ("SELECT 1", "without FROM"),
            ("SELECT * FROM t AS x", "alias"),
            ("SELECT * FROM t UNION SELECT * FROM u", "UNION"),
            ("WITH x AS (SELECT * FROM t) SELECT * FROM x", "WITH"),
            ("SELECT * FROM t LIMIT ?", "parameter in LIMIT"),
            ("SELECT *, a FROM t", "* beside"),
            ("SELECT * FROM t WHERE a = CAST(1 AS INT)", "CAST"),
            ("SELECT * FROM t WHERE a = INTERVAL '1' DAY", "expression"),
            ("SELECT * FROM t WHERE a = :name", "parameter :name"),
        ] {
            let (unsupported, message) = refused(sql);
            assert!(unsupported, "{sql}: {message}");
            assert!(message.contains(word), "{sql}: {message}");
            assert!(message.contains("runs only SELECT"), "{sql}: {message}");
        }
    }

    #[test]
    fn refuses_invalid_statements() {
        for (sql, word) in [
            ("SELEC * FROM t", "syntax"),
            ("SELECT a, a FROM t", "twice"),
            ("SELECT * FROM t LIMIT 18446744073709551616", "LIMIT"),
            ("SELECT * FROM t LIMIT 1.5", "LIMIT"),
            ("", "no statement"),
            ("SELECT * FROM t WHERE a = ? AND b = $1", "not both"),
            ("SELECT * FROM t WHERE a = $2", "$1 is missing"),
            ("SELECT * FROM t WHERE a = $0", "from $1"),
            ("SELECT * FROM t WHERE d = DATE '2024-13-01'", "not a date"),
            (
                "SELECT * FROM t WHERE d = TIMESTAMP 'noon'",
                "not a timestamp",
            ),
            ("SELECT * FROM t WHERE a = 1e999999", "not a number"),
            ("SELECT * FROM \"\"", "empty"),
        ] {
            let (unsupported, message) = refused(sql);
            assert!(!unsupported, "{sql}: {message}");
            assert!(message.contains(word), "{sql}: {message}");
        }
    }

    #[test]
    fn bounds_hostile_input() {
        let long = format!("SELECT * FROM t WHERE a = '{}'", "x".repeat(MAX_SQL_BYTES));
        let (_, message) = refused(&long);
        assert!(message.contains("65536"), "{message}");
        let nested = format!(
            "SELECT * FROM t WHERE {}a = 1{}",
            "(".repeat(100),
            ")".repeat(100)
        );
        let (_, message) = refused(&nested);
        assert!(message.contains("nests more than"), "{message}");
        let list = (0..=predicate::MAX_IN_LIST)
            .map(|i| i.to_string())
            .collect::<Vec<_>>();
        let (_, message) = refused(&format!("SELECT * FROM t WHERE a IN ({})", list.join(",")));
        assert!(message.contains("at most 10000"), "{message}");
        // A long chain is flat, not deep.
        let chain = vec!["a = 1"; 3000].join(" OR ");
        let q = ok(&format!("SELECT * FROM t WHERE {chain}"));
        assert!(matches!(q.filter, Some(Predicate::Or(ref v)) if v.len() == 3000));
    }

    #[test]
    fn never_panics() {
        let mut inputs: Vec<String> = Vec::new();
        let seeds = [
            "SELECT a, b FROM t WHERE a > 1 AND (b IN (1, 2) OR c BETWEEN 1 AND 2) LIMIT 5",
            "SELECT * FROM \"x\" WHERE d = DATE '2024-01-01' OR t < TIMESTAMP '2024-01-01 00:00Z'",
            "SELECT * FROM t WHERE a = ? AND b = $1 AND NOT c IS NULL",
        ];
        for seed in seeds {
            for cut in 0..seed.len() {
                inputs.push(seed[..cut].to_owned());
                inputs.push(seed[cut..].to_owned());
            }
        }
        for depth in [10, 39, 40, 41, 200, 5000] {
            inputs.push(format!(
                "SELECT * FROM t WHERE {}a=1{}",
                "(".repeat(depth),
                ")".repeat(depth)
            ));
            inputs.push(format!("SELECT * FROM t WHERE {}a", "NOT ".repeat(depth)));
            inputs.push(format!("SELECT * FROM t WHERE a = {}1", "-".repeat(depth)));
            inputs.push(format!(
                "SELECT * FROM t WHERE a{}",
                " IS NULL".repeat(depth)
            ));
            inputs.push(format!(
                "SELECT * FROM t WHERE {}",
                vec!["a"; depth].join("+")
            ));
            inputs.push(format!(
                "SELECT * FROM t WHERE a = 1{}",
                " = 1".repeat(depth)
            ));
        }
        // The longest accepted text as one left-deep chain.
        inputs.push(format!(
            "SELECT * FROM t WHERE a{}",
            "+a".repeat(MAX_SQL_BYTES / 2 - 20)
        ));
        inputs.push(format!(
            "SELECT * FROM t WHERE a{}",
            " AND a".repeat(MAX_SQL_BYTES / 6 - 10)
        ));
        for n in [
            "1e",
            "9".repeat(5000).as_str(),
            "1e-99999999999",
            "0.",
            ".e1",
            "1e100001",
        ] {
            inputs.push(format!("SELECT * FROM t WHERE a < {n} LIMIT {n}"));
        }
        for garbage in [
            "'",
            "\"",
            "$",
            "$99999999999999999999",
            "?",
            "\u{0}",
            "é",
            "--",
            "/*",
            ";;;",
        ] {
            inputs.push(format!("SELECT * FROM t WHERE a = {garbage}"));
            inputs.push(garbage.repeat(1000));
        }
        assert!(inputs.len() > 300, "{}", inputs.len());
        let schema = Schema::new(vec![Field::new("a", DataType::Int64, true)]);
        for input in &inputs {
            if let Ok(Query {
                filter: Some(f), ..
            }) = parse(input)
            {
                let _ = f.check(&schema);
            }
        }
    }

    fn batch(columns: Vec<ArrayRef>) -> RecordBatch {
        let fields: Vec<Field> = columns
            .iter()
            .enumerate()
            .map(|(i, c)| Field::new(format!("p{i}"), c.data_type().clone(), true))
            .collect();
        RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).expect("a batch")
    }

    #[test]
    fn binds_parameters() {
        let q = ok("SELECT * FROM t WHERE a = ? AND b IN (?, 'z') AND c BETWEEN ? AND ? AND d = ?");
        assert_eq!(q.placeholders(), 5);
        let params = batch(vec![
            Arc::new(Int64Array::from(vec![Some(7), Some(8)])),
            Arc::new(StringArray::from(vec!["x", "y"])),
            Arc::new(Float64Array::from(vec![0.1, 2.0])),
            Arc::new(NullArray::new(2)),
            Arc::new(
                TimestampMicrosecondArray::from(vec![1_700_000_000_000_001, 0])
                    .with_timezone("+02:00"),
            ),
        ]);
        let bound = q.bind(&params, 1).expect("bound");
        assert_eq!(bound.placeholders(), 0);
        let Some(Predicate::And(parts)) = &bound.filter else {
            panic!("{bound:?}")
        };
        assert_eq!(
            parts[0],
            Predicate::Compare {
                column: "a".into(),
                op: CmpOp::Eq,
                value: lit(Literal::Number("8".into()))
            }
        );
        assert_eq!(
            parts[1],
            Predicate::InList {
                column: "b".into(),
                list: vec![
                    lit(Literal::String("y".into())),
                    lit(Literal::String("z".into()))
                ],
                negated: false
            }
        );
        let Predicate::Between { low, high, .. } = &parts[2] else {
            panic!()
        };
        assert_eq!(
            (low, high),
            (&lit(Literal::Number("2".into())), &lit(Literal::Null))
        );
        let first = q.bind(&params, 0).expect("bound");
        let Some(Predicate::And(parts)) = &first.filter else {
            panic!()
        };
        assert_eq!(
            parts[3],
            Predicate::Compare {
                column: "d".into(),
                op: CmpOp::Eq,
                value: lit(Literal::Timestamp("2023-11-14T22:13:20.000001Z".into()))
            }
        );
        let Predicate::Between { low, .. } = &parts[2] else {
            panic!()
        };
        assert_eq!(low, &lit(Literal::Number("0.1".into())));

        let two = batch(vec![
            Arc::new(Int64Array::from(vec![1])),
            Arc::new(Int64Array::from(vec![1])),
        ]);
        let err = q.bind(&two, 0).expect_err("too few");
        assert!(
            err.to_string().contains("takes 5 parameters; 2 were bound"),
            "{err}"
        );
        let err = q.bind(&params, 2).expect_err("no row 2");
        assert!(err.to_string().contains("row 2"), "{err}");
        let nan = batch(vec![Arc::new(Float64Array::from(vec![f64::NAN]))]);
        let err = ok("SELECT * FROM t WHERE a = $1 OR b = $1")
            .bind(&nan, 0)
            .expect_err("NaN");
        assert!(err.to_string().contains("not a finite number"), "{err}");
        let flags = batch(vec![Arc::new(BooleanArray::from(vec![true]))]);
        let err = ok("SELECT * FROM t WHERE a = ?")
            .bind(&flags, 0)
            .expect("bound");
        assert!(err.filter.is_some());
        // Unbound placeholders are an error at evaluation, not a panic.
        let schema = Schema::new(vec![Field::new("a", DataType::Int64, true)]);
        let err = ok("SELECT * FROM t WHERE a = ?")
            .filter
            .expect("a filter")
            .check(&schema)
            .expect_err("unbound");
        assert!(
            err.to_string().contains("parameter 1 has no value"),
            "{err}"
        );
    }

    #[test]
    fn round_trips_through_json() {
        let q = ok(
            "SELECT a, \"b\" FROM \"d-1\" WHERE (a IN (1, 2.5, NULL) OR NOT b BETWEEN \
                    DATE '2024-01-01' AND TIMESTAMP '2024-01-01 10:00:00') AND c = ? AND e IS NULL \
                    LIMIT 3",
        );
        let json = serde_json::to_string(&q).expect("json");
        let back: Query = serde_json::from_str(&json).expect("read back");
        assert_eq!(back, q);
    }
}
