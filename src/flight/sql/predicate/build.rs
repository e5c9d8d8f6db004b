//! Builds a [`Predicate`] from sqlparser's AST, refusing every expression outside the supported
//! grammar with a message that names what was found.
//!
//! `AND`/`OR` chains are walked with a loop, not recursion: sqlparser builds them left-deep
//! without counting depth, so a long chain must not cost a stack frame per term.

use chrono::NaiveDate;
use sqlparser::ast::{BinaryOperator, DataType, Expr, InTarget, UnaryOperator, Value};

use super::number::Exact;
use super::{CmpOp, Literal, Operand, Predicate};
use crate::flight::sql::error::SqlError;

/// The most values one `IN` list may hold.
pub const MAX_IN_LIST: usize = 10_000;

/// The highest parameter number (`$n`) and the most `?` a statement may take.
pub const MAX_PARAMETERS: usize = 10_000;

/// Predicate nesting beyond sqlparser's own limit (which counts parser calls, not our levels).
const MAX_DEPTH: usize = 128;

/// Builds the predicate of a `WHERE` clause and checks its parameters: `?` and `$n` are not
/// mixed, and `$1..$n` all appear.
pub(in crate::flight::sql) fn from_expr(expr: &Expr) -> Result<Predicate, SqlError> {
    let mut builder = Builder::default();
    let predicate = builder.predicate(expr, 0)?;
    if let Some(missing) = (0..builder.numbered.len()).find(|&i| !builder.numbered[i]) {
        return Err(SqlError::invalid(format!(
            "parameter ${} is missing: a statement with ${} must use each of $1..${}",
            missing + 1,
            builder.numbered.len(),
            builder.numbered.len()
        )));
    }
    Ok(predicate)
}

#[derive(Default)]
struct Builder {
    /// How many `?` were seen.
    positional: usize,
    /// Which `$n` were seen (index n - 1).
    numbered: Vec<bool>,
}

impl Builder {
    fn predicate(&mut self, expr: &Expr, depth: usize) -> Result<Predicate, SqlError> {
        if depth > MAX_DEPTH {
            return Err(SqlError::invalid(format!(
                "the WHERE clause is nested more than {MAX_DEPTH} levels deep"
            )));
        }
        let depth = depth + 1;
        match expr {
            Expr::Nested(inner) => self.predicate(inner, depth),
            Expr::BinaryOp {
                op: op @ (BinaryOperator::And | BinaryOperator::Or),
                ..
            } => {
                let mut children = Vec::new();
                let mut stack = vec![expr];
                while let Some(e) = stack.pop() {
                    match e {
                        Expr::BinaryOp { left, op: o, right } if o == op => {
                            stack.push(right);
                            stack.push(left);
                        }
                        other => children.push(self.predicate(other, depth)?),
                    }
                }
                Ok(match op {
                    BinaryOperator::And => Predicate::And(children),
                    _ => Predicate::Or(children),
                })
            }
            Expr::BinaryOp { left, op, right } => match cmp_op(op) {
                Some(op) => self.compare(left, op, right, depth),
                None => Err(SqlError::unsupported(format!("the operator {op}"))),
            },
            Expr::UnaryOp {
                op: UnaryOperator::Not,
                expr,
            } => Ok(Predicate::Not(Box::new(self.predicate(expr, depth)?))),
            Expr::IsNull(e) | Expr::IsNotNull(e) => Ok(Predicate::IsNull {
                column: column(e)?,
                negated: matches!(expr, Expr::IsNotNull(_)),
            }),
            Expr::In {
                expr,
                target,
                negated,
                global,
            } => {
                let (InTarget::List(list), false) = (target, global) else {
                    return Err(SqlError::unsupported(
                        "IN with something other than a list of values",
                    ));
                };
                let column = column(expr)?;
                if list.is_empty() {
                    return Err(SqlError::invalid("an IN list needs at least one value"));
                }
                if list.len() > MAX_IN_LIST {
                    return Err(SqlError::invalid(format!(
                        "an IN list holds {} values; at most {MAX_IN_LIST} are accepted",
                        list.len()
                    )));
                }
                let list = list
                    .iter()
                    .map(|e| self.operand(e, depth))
                    .collect::<Result<_, _>>()?;
                Ok(Predicate::InList {
                    column,
                    list,
                    negated: *negated,
                })
            }
            Expr::Between {
                expr,
                negated,
                low,
                high,
            } => Ok(Predicate::Between {
                column: column(expr)?,
                low: self.operand(low, depth)?,
                high: self.operand(high, depth)?,
                negated: *negated,
            }),
            // A boolean column alone is a condition: `WHERE flag`.
            Expr::Identifier(_) => Ok(Predicate::Compare {
                column: column(expr)?,
                op: CmpOp::Eq,
                value: Operand::Literal(Literal::Boolean(true)),
            }),
            other => Err(SqlError::unsupported(format!(
                "{} as a condition",
                describe(other)
            ))),
        }
    }

    fn compare(
        &mut self,
        left: &Expr,
        op: CmpOp,
        right: &Expr,
        depth: usize,
    ) -> Result<Predicate, SqlError> {
        match (as_column(left), as_column(right)) {
            (Some(_), Some(_)) => Err(SqlError::unsupported(
                "comparing a column with another column",
            )),
            (Some(_), None) => Ok(Predicate::Compare {
                column: column(left)?,
                op,
                value: self.operand(right, depth)?,
            }),
            (None, Some(_)) => Ok(Predicate::Compare {
                column: column(right)?,
                op: op.flip(),
                value: self.operand(left, depth)?,
            }),
            (None, None) if is_placeholder(left) || is_placeholder(right) => {
                Err(untyped_parameter(&format!(
                    "compared with {}",
                    describe(if is_placeholder(left) { right } else { left })
                )))
            }
            (None, None) => Err(SqlError::unsupported(format!(
                "a comparison of {} with {} (one side must be a column)",
                describe(left),
                describe(right)
            ))),
        }
    }

    fn operand(&mut self, expr: &Expr, depth: usize) -> Result<Operand, SqlError> {
        if depth > MAX_DEPTH {
            return Err(SqlError::invalid(format!(
                "a value is nested more than {MAX_DEPTH} levels deep"
            )));
        }
        let literal = match expr {
            Expr::Nested(inner) => return self.operand(inner, depth + 1),
            Expr::Value(v) => match &v.value {
                Value::Number(text, _) => number(text)?,
                Value::SingleQuotedString(s)
                | Value::EscapedStringLiteral(s)
                | Value::NationalStringLiteral(s)
                | Value::UnicodeStringLiteral(s) => Literal::String(s.clone()),
                Value::Boolean(b) => Literal::Boolean(*b),
                Value::Null => Literal::Null,
                Value::Placeholder(p) => return self.placeholder(p).map(Operand::Placeholder),
                other => {
                    return Err(SqlError::unsupported(format!("the literal {other}")));
                }
            },
            Expr::UnaryOp {
                op: op @ (UnaryOperator::Minus | UnaryOperator::Plus),
                expr: inner,
            } => match self.operand(inner, depth + 1)? {
                Operand::Literal(Literal::Number(text)) if *op == UnaryOperator::Minus => {
                    let negated = match text.strip_prefix('-') {
                        Some(positive) => positive.to_owned(),
                        None => format!("-{text}"),
                    };
                    Literal::Number(negated)
                }
                Operand::Literal(Literal::Number(text)) => Literal::Number(text),
                _ => {
                    return Err(SqlError::unsupported(format!(
                        "the sign {op} before something other than a number"
                    )));
                }
            },
            Expr::TypedString(typed) => {
                let Some(text) = typed.value.value.clone().into_string() else {
                    return Err(SqlError::unsupported(format!(
                        "{} followed by something other than a 'string'",
                        typed.data_type
                    )));
                };
                match &typed.data_type {
                    DataType::Date => date(text)?,
                    DataType::Timestamp(..) => timestamp(text)?,
                    other => {
                        return Err(SqlError::unsupported(format!(
                            "the typed literal {other} '...' (only DATE '...' and TIMESTAMP '...')"
                        )));
                    }
                }
            }
            other => {
                return Err(SqlError::unsupported(format!(
                    "{} where a value was expected",
                    describe(other)
                )));
            }
        };
        Ok(Operand::Literal(literal))
    }

    fn placeholder(&mut self, text: &str) -> Result<usize, SqlError> {
        if text == "?" {
            if !self.numbered.is_empty() {
                return Err(mixed());
            }
            self.positional += 1;
            if self.positional > MAX_PARAMETERS {
                return Err(too_many());
            }
            return Ok(self.positional - 1);
        }
        let Some(n) = text.strip_prefix('$').and_then(|n| n.parse::<usize>().ok()) else {
            return Err(SqlError::unsupported(format!(
                "the parameter {text} (parameters are ? or $1, $2, ...)"
            )));
        };
        if self.positional > 0 {
            return Err(mixed());
        }
        if n == 0 || n > MAX_PARAMETERS {
            return Err(if n == 0 {
                SqlError::invalid("parameters are numbered from $1")
            } else {
                too_many()
            });
        }
        if self.numbered.len() < n {
            self.numbered.resize(n, false);
        }
        self.numbered[n - 1] = true;
        Ok(n - 1)
    }
}

fn mixed() -> SqlError {
    SqlError::invalid("a statement uses either ? or $n parameters, not both")
}

fn too_many() -> SqlError {
    SqlError::invalid(format!(
        "a statement takes at most {MAX_PARAMETERS} parameters"
    ))
}

fn number(text: &str) -> Result<Literal, SqlError> {
    match Exact::parse(text) {
        Some(_) => Ok(Literal::Number(text.to_owned())),
        None => Err(SqlError::invalid(format!(
            "{text} is not a number this server reads (or its exponent is out of range)"
        ))),
    }
}

fn date(text: String) -> Result<Literal, SqlError> {
    match NaiveDate::parse_from_str(&text, "%Y-%m-%d") {
        Ok(_) => Ok(Literal::Date(text)),
        Err(e) => Err(SqlError::invalid(format!(
            "DATE '{text}' is not a date (YYYY-MM-DD): {e}"
        ))),
    }
}

fn timestamp(text: String) -> Result<Literal, SqlError> {
    match arrow::compute::kernels::cast_utils::string_to_datetime(&chrono::Utc, &text) {
        Ok(_) => Ok(Literal::Timestamp(text)),
        Err(e) => Err(SqlError::invalid(format!(
            "TIMESTAMP '{text}' is not a timestamp (YYYY-MM-DD HH:MM:SS[.fff][zone]): {e}"
        ))),
    }
}

fn cmp_op(op: &BinaryOperator) -> Option<CmpOp> {
    Some(match op {
        BinaryOperator::Eq => CmpOp::Eq,
        BinaryOperator::NotEq => CmpOp::NotEq,
        BinaryOperator::Lt => CmpOp::Lt,
        BinaryOperator::LtEq => CmpOp::LtEq,
        BinaryOperator::Gt => CmpOp::Gt,
        BinaryOperator::GtEq => CmpOp::GtEq,
        _ => return None,
    })
}

/// A parameter takes the type of the column it is compared with: one without a column has none
/// a client could be told (`$1 = $2`), so the statement is not one this server can prepare.
fn untyped_parameter(found: &str) -> SqlError {
    SqlError::invalid(format!(
        "a parameter {found} has no type: each parameter must be compared with a column \
         (column op ?, column [NOT] IN (?, ...), column [NOT] BETWEEN ? AND ?), whose type it \
         takes"
    ))
}

fn is_placeholder(expr: &Expr) -> bool {
    match expr {
        Expr::Value(v) => matches!(v.value, Value::Placeholder(_)),
        Expr::Nested(inner) => is_placeholder(inner),
        _ => false,
    }
}

/// The column an expression names, looking through parentheses.
fn as_column(expr: &Expr) -> Option<&Expr> {
    match expr {
        Expr::Identifier(_) | Expr::CompoundIdentifier(_) => Some(expr),
        Expr::Nested(inner) => as_column(inner),
        _ => None,
    }
}

/// The name of the column `expr` names: unquoted names as written (column names are
/// case-sensitive), quoted ones exactly.
fn column(expr: &Expr) -> Result<String, SqlError> {
    if is_placeholder(expr) {
        return Err(untyped_parameter("where a column was expected"));
    }
    match as_column(expr) {
        Some(Expr::Identifier(ident)) => Ok(ident.value.clone()),
        Some(Expr::CompoundIdentifier(_)) => Err(SqlError::unsupported(
            "a qualified column name (table.column; write the column alone, in double quotes if it holds a '.')",
        )),
        _ => Err(SqlError::unsupported(format!(
            "{} where a column was expected",
            describe(expr)
        ))),
    }
}

/// Words for an expression in a refusal. Never the expression's own text: sqlparser prints
/// recursively, and a hostile statement can be deep.
pub(in crate::flight::sql) fn describe(expr: &Expr) -> String {
    match expr {
        Expr::Identifier(ident) => format!("the column {ident}"),
        Expr::CompoundIdentifier(_) => "a qualified name".to_owned(),
        Expr::Value(v) if matches!(v.value, Value::Placeholder(_)) => "a parameter".to_owned(),
        Expr::Value(_) | Expr::TypedString(_) => "a literal".to_owned(),
        Expr::BinaryOp { op, .. } => format!("the operator {op}"),
        Expr::UnaryOp { op, .. } => format!("the operator {op}"),
        Expr::Nested(inner) => describe(inner),
        Expr::Function(f) if f.name.0.len() == 1 => format!("the function {}", f.name),
        Expr::Function(_) => "a function".to_owned(),
        Expr::Cast { .. } => "a CAST".to_owned(),
        Expr::Case { .. } => "a CASE expression".to_owned(),
        Expr::Subquery(_) | Expr::Exists { .. } => "a subquery".to_owned(),
        Expr::Like { .. } | Expr::ILike { .. } | Expr::SimilarTo { .. } => "LIKE".to_owned(),
        Expr::IsTrue(_) | Expr::IsNotTrue(_) | Expr::IsFalse(_) | Expr::IsNotFalse(_) => {
            "IS [NOT] TRUE/FALSE".to_owned()
        }
        Expr::IsDistinctFrom(..) | Expr::IsNotDistinctFrom(..) => "IS DISTINCT FROM".to_owned(),
        Expr::Wildcard(_) | Expr::QualifiedWildcard(..) => "*".to_owned(),
        _ => "an expression".to_owned(),
    }
}
