//! A [`Predicate`] resolved against a schema, and its evaluation with arrow's kernels.
//!
//! Resolution reads each literal as a value of its column's type, once per schema, so that
//! evaluation is only kernel calls. Integer, date and timestamp columns compare exactly with
//! literals between two of their values: `x > 2.5` becomes `x > 2` and `x = 2.5` is false on every
//! non-NULL row; a literal beyond the type's range becomes a constant.

use std::sync::Arc;

use arrow::array::timezone::Tz;
use arrow::array::{
    Array, ArrayRef, ArrowPrimitiveType, BooleanArray, Datum, LargeStringArray, PrimitiveArray,
    Scalar, StringArray, StringViewArray,
};
use arrow::buffer::BooleanBuffer;
use arrow::compute::kernels::boolean::{and_kleene, not, or_kleene};
use arrow::compute::kernels::cast_utils::string_to_datetime;
use arrow::compute::kernels::cmp;
use arrow::compute::{is_not_null, is_null};
use arrow::datatypes::*;
use arrow::error::ArrowError;
use arrow::record_batch::RecordBatch;

use super::number::{Bound, Exact};
use super::{CmpOp, Literal, Operand, Predicate};
use crate::backend::filter::{self, Cell, Comparison, RowFilter, RowFilterBuilder};
use crate::flight::sql::error::SqlError;

/// A predicate ready to evaluate over batches of one schema.
#[derive(Debug, Clone)]
pub struct Filter {
    root: Node,
    /// The columns the filter reads: index, name and type, checked against each batch.
    columns: Vec<(usize, FieldRef)>,
}

#[derive(Debug, Clone)]
enum Node {
    Leaf { column: usize, test: Test },
    And(Vec<Node>),
    Or(Vec<Node>),
    Not(Box<Node>),
}

#[derive(Debug, Clone)]
enum Test {
    Compare(CmpOp, Scalar<ArrayRef>),
    IsNull,
    IsNotNull,
    /// The same answer on every non-NULL value (NULL on NULL ones): a literal no value can equal,
    /// or beyond the type's range.
    Constant(bool),
    /// NULL on every row: a comparison with NULL.
    Null,
    /// Membership of a long IN list, by hash in one pass (an OR of equalities takes one pass
    /// per item): `values` are the list's values of the column's type, `null` whether it held
    /// NULL (then a value not found is NULL, not false).
    In {
        values: ArrayRef,
        null: bool,
    },
}

/// IN lists at least this long are tested by hash.
const HASHED_IN: usize = 8;

impl Filter {
    pub(super) fn new(predicate: &Predicate, schema: &Schema) -> Result<Self, SqlError> {
        let mut columns = Vec::new();
        let root = resolve(predicate, schema, &mut columns)?;
        Ok(Self { root, columns })
    }

    /// Evaluates the filter over `batch` (of the schema it was prepared for): true where a row
    /// matches, false or NULL where it does not.
    pub fn evaluate(&self, batch: &RecordBatch) -> Result<BooleanArray, SqlError> {
        let schema = batch.schema_ref();
        for (index, field) in &self.columns {
            let same = schema
                .fields()
                .get(*index)
                .is_some_and(|f| f.name() == field.name() && f.data_type() == field.data_type());
            if !same {
                return Err(SqlError::invalid(format!(
                    "the batch has no column \"{}\" of type {} at position {index}: the filter \
                     was prepared for another schema",
                    field.name(),
                    field.data_type()
                )));
            }
        }
        evaluate(&self.root, batch)
    }
}

impl Filter {
    /// The filter as a backend runs it where the data lives ([`RowFilter`]), or `None` where
    /// it reads a column a backend filter cannot (float16, wide decimals, string views): then
    /// it runs on the host, as [`Filter::evaluate`].
    pub fn for_backend(&self) -> Option<RowFilter> {
        let mut builder = RowFilterBuilder::default();
        lower(&self.root, &self.columns, &mut builder)?;
        builder.finish()
    }
}

/// Writes `node` as postfix steps. AND and OR of many children are folded pairwise, so the
/// stack stays as shallow as the predicate's nesting however long its chains.
fn lower(node: &Node, columns: &[(usize, FieldRef)], builder: &mut RowFilterBuilder) -> Option<()> {
    match node {
        Node::Leaf { column, test } => {
            let field = &columns.iter().find(|(index, _)| index == column)?.1;
            let data_type = field.data_type();
            let test = match test {
                Test::Compare(op, value) => {
                    let op = match op {
                        CmpOp::Eq => Comparison::Eq,
                        CmpOp::NotEq => Comparison::NotEq,
                        CmpOp::Lt => Comparison::Lt,
                        CmpOp::LtEq => Comparison::LtEq,
                        CmpOp::Gt => Comparison::Gt,
                        CmpOp::GtEq => Comparison::GtEq,
                    };
                    let value = value.clone().into_inner();
                    return match filter::cell(value.as_ref(), 0)? {
                        Cell::Key(key) => {
                            builder.test(*column, data_type, filter::Test::Compare(op, key))
                        }
                        Cell::Bytes(bytes) => builder.compare_bytes(*column, data_type, op, bytes),
                        Cell::Null => None,
                    };
                }
                Test::IsNull => filter::Test::IsNull,
                Test::IsNotNull => filter::Test::IsNotNull,
                Test::Constant(answer) => filter::Test::Constant(*answer),
                Test::Null => filter::Test::Null,
                Test::In { values, null } => {
                    let cells = (0..values.len())
                        .map(|i| filter::cell(values.as_ref(), i))
                        .collect::<Option<Vec<_>>>()?;
                    let keys: Option<Vec<i128>> = cells
                        .iter()
                        .map(|c| match c {
                            Cell::Key(key) => Some(*key),
                            _ => None,
                        })
                        .collect();
                    if let Some(keys) = keys {
                        return builder.in_list(*column, data_type, keys, *null);
                    }
                    let strings: Vec<&[u8]> = cells
                        .iter()
                        .map(|c| match c {
                            Cell::Bytes(bytes) => Some(*bytes),
                            _ => None,
                        })
                        .collect::<Option<_>>()?;
                    return builder.in_bytes(*column, data_type, strings, *null);
                }
            };
            builder.test(*column, data_type, test)
        }
        Node::And(children) | Node::Or(children) => {
            let and = matches!(node, Node::And(_));
            let Some((first, rest)) = children.split_first() else {
                if and {
                    builder.and(0)
                } else {
                    builder.or(0)
                }
                return Some(());
            };
            lower(first, columns, builder)?;
            for child in rest {
                lower(child, columns, builder)?;
                if and { builder.and(2) } else { builder.or(2) }
            }
            Some(())
        }
        Node::Not(child) => {
            lower(child, columns, builder)?;
            builder.not();
            Some(())
        }
    }
}

fn resolve(
    predicate: &Predicate,
    schema: &Schema,
    columns: &mut Vec<(usize, FieldRef)>,
) -> Result<Node, SqlError> {
    Ok(match predicate {
        Predicate::Compare { column, op, value } => {
            let (column, field) = find(schema, column, columns)?;
            let test = compare(field, *op, value)?;
            Node::Leaf { column, test }
        }
        Predicate::IsNull { column, negated } => {
            let (column, _) = find(schema, column, columns)?;
            let test = if *negated {
                Test::IsNotNull
            } else {
                Test::IsNull
            };
            Node::Leaf { column, test }
        }
        Predicate::InList {
            column,
            list,
            negated,
        } => {
            let (column, field) = find(schema, column, columns)?;
            let tests = list
                .iter()
                .map(|value| compare(field, CmpOp::Eq, value))
                .collect::<Result<Vec<_>, SqlError>>()?;
            let any = match hashed(field, &tests)? {
                Some(test) => Node::Leaf { column, test },
                None => Node::Or(
                    tests
                        .into_iter()
                        .map(|test| Node::Leaf { column, test })
                        .collect(),
                ),
            };
            negate(any, *negated)
        }
        Predicate::Between {
            column,
            low,
            high,
            negated,
        } => {
            let (column, field) = find(schema, column, columns)?;
            let low = compare(field, CmpOp::GtEq, low)?;
            let high = compare(field, CmpOp::LtEq, high)?;
            let within = Node::And(vec![
                Node::Leaf { column, test: low },
                Node::Leaf { column, test: high },
            ]);
            negate(within, *negated)
        }
        Predicate::And(children) => Node::And(resolve_all(children, schema, columns)?),
        Predicate::Or(children) => Node::Or(resolve_all(children, schema, columns)?),
        Predicate::Not(child) => Node::Not(Box::new(resolve(child, schema, columns)?)),
    })
}

fn resolve_all(
    children: &[Predicate],
    schema: &Schema,
    columns: &mut Vec<(usize, FieldRef)>,
) -> Result<Vec<Node>, SqlError> {
    children
        .iter()
        .map(|c| resolve(c, schema, columns))
        .collect()
}

fn negate(node: Node, negated: bool) -> Node {
    if negated {
        Node::Not(Box::new(node))
    } else {
        node
    }
}

/// A long IN list's equalities as one hashed test, where the column's values and the list's
/// are of one type (not a dictionary, whose values the list holds).
fn hashed(field: &Field, tests: &[Test]) -> Result<Option<Test>, SqlError> {
    if tests.len() < HASHED_IN || matches!(field.data_type(), DataType::Dictionary(..)) {
        return Ok(None);
    }
    let mut values = Vec::with_capacity(tests.len());
    let mut null = false;
    for test in tests {
        match test {
            Test::Compare(CmpOp::Eq, value) => values.push(value.clone().into_inner()),
            Test::Null => null = true,
            Test::Constant(false) => {} // no value equals it
            _ => return Ok(None),
        }
    }
    let values = match values.as_slice() {
        [] => arrow::array::new_empty_array(field.data_type()),
        many => {
            let refs: Vec<&dyn Array> = many.iter().map(AsRef::as_ref).collect();
            arrow::compute::concat(&refs)
                .map_err(|e| SqlError::invalid(format!("preparing an IN list: {e}")))?
        }
    };
    Ok(Some(Test::In { values, null }))
}

/// `array`'s membership in `values` (of its type): one pass over Arrow's row encoding of both.
fn member(array: &ArrayRef, values: &ArrayRef, null: bool) -> Result<BooleanArray, ArrowError> {
    use arrow::row::{RowConverter, SortField};
    let converter = RowConverter::new(vec![SortField::new(array.data_type().clone())])?;
    let list = converter.convert_columns(&[Arc::clone(values)])?;
    let set: std::collections::HashSet<&[u8]> = list.iter().map(|row| row.data()).collect();
    let rows = converter.convert_columns(&[Arc::clone(array)])?;
    let nulls = array.logical_nulls();
    Ok((0..array.len())
        .map(|i| {
            if nulls.as_ref().is_some_and(|n| n.is_null(i)) {
                None
            } else if set.contains(rows.row(i).data()) {
                Some(true)
            } else if null {
                None
            } else {
                Some(false)
            }
        })
        .collect())
}

/// The column named exactly `name` (names are case-sensitive), noted in `columns`.
fn find<'a>(
    schema: &'a Schema,
    name: &str,
    columns: &mut Vec<(usize, FieldRef)>,
) -> Result<(usize, &'a Field), SqlError> {
    if let Some((index, field)) = schema.fields().find(name) {
        if !columns.iter().any(|(i, _)| *i == index) {
            columns.push((index, Arc::clone(field)));
        }
        return Ok((index, field));
    }
    let hint = match schema
        .fields()
        .iter()
        .find(|f| f.name().eq_ignore_ascii_case(name))
    {
        Some(f) => format!(
            " (column names are case-sensitive: \"{}\" exists)",
            f.name()
        ),
        None => String::new(),
    };
    Err(SqlError::invalid(format!(
        "unknown column \"{name}\"{hint}"
    )))
}

/// The test `column op value`, the value read as one of the column's type.
fn compare(field: &Field, op: CmpOp, value: &Operand) -> Result<Test, SqlError> {
    let literal = match value {
        Operand::Literal(literal) => literal,
        Operand::Placeholder(i) => {
            return Err(SqlError::invalid(format!(
                "parameter {} has no value: bind the statement's parameters first",
                i.saturating_add(1)
            )));
        }
    };
    if *literal == Literal::Null {
        return Ok(Test::Null);
    }
    // Arrow's comparison kernels look through one dictionary layer: compare with its values.
    let data_type = match field.data_type() {
        DataType::Dictionary(_, values) => values.as_ref(),
        other => other,
    };
    let mismatch = || {
        SqlError::invalid(format!(
            "column \"{}\" ({}) cannot be compared with {}",
            field.name(),
            field.data_type(),
            describe(literal)
        ))
    };
    let number = || match literal {
        Literal::Number(text) => Exact::parse(text).ok_or_else(mismatch),
        _ => Err(mismatch()),
    };
    let float = || match literal {
        Literal::Number(text) => text.parse::<f64>().map_err(|_| mismatch()),
        _ => Err(mismatch()),
    };
    let instant = |zone: Option<&str>, unit_nanos: i128| match literal {
        Literal::Date(text) | Literal::Timestamp(text) | Literal::String(text) => nanos(text, zone)
            .map(|n| Bound {
                floor: n.div_euclid(unit_nanos),
                exact: n.rem_euclid(unit_nanos) == 0,
            }),
        _ => Err(mismatch()),
    };
    let string = || match literal {
        Literal::String(s) => Ok(s.as_str()),
        _ => Err(mismatch()),
    };
    const DAY: i128 = 86_400_000_000_000;
    Ok(match data_type {
        DataType::Int8 => integer::<Int8Type>(op, number()?.bound(), data_type),
        DataType::Int16 => integer::<Int16Type>(op, number()?.bound(), data_type),
        DataType::Int32 => integer::<Int32Type>(op, number()?.bound(), data_type),
        DataType::Int64 => integer::<Int64Type>(op, number()?.bound(), data_type),
        DataType::UInt8 => integer::<UInt8Type>(op, number()?.bound(), data_type),
        DataType::UInt16 => integer::<UInt16Type>(op, number()?.bound(), data_type),
        DataType::UInt32 => integer::<UInt32Type>(op, number()?.bound(), data_type),
        DataType::UInt64 => integer::<UInt64Type>(op, number()?.bound(), data_type),
        // A literal is read as the nearest value of the column's float type, so that
        // `x = 0.1` finds the float32 written as 0.1.
        DataType::Float16 => {
            let v = <Float16Type as ArrowPrimitiveType>::Native::from_f64(float()?);
            scalar::<Float16Type>(op, v, data_type)
        }
        #[allow(clippy::cast_possible_truncation)]
        DataType::Float32 => scalar::<Float32Type>(op, float()? as f32, data_type),
        DataType::Float64 => scalar::<Float64Type>(op, float()?, data_type),
        // Raw decimal128 values are integers of at most `precision` digits: compared exactly
        // as integer columns are (`m > 1.234` on a scale of 2 means `m >= 1.24`). Wider ones
        // pass `Exact::bound`'s clamp, so they take the literal only where it fits.
        DataType::Decimal128(precision, scale) if *precision <= 30 => {
            integer::<Decimal128Type>(op, number()?.shifted(*scale).bound(), data_type)
        }
        DataType::Decimal128(precision, scale) | DataType::Decimal256(precision, scale) => {
            let digits = number()?.scaled(*precision, *scale).ok_or_else(|| {
                SqlError::invalid(format!(
                    "{} does not fit column \"{}\" ({}): it must have at most {} digits, {} \
                     after the point",
                    describe(literal),
                    field.name(),
                    field.data_type(),
                    precision,
                    scale
                ))
            })?;
            let parse_error = || SqlError::invalid(format!("{digits} is not a decimal value"));
            if matches!(data_type, DataType::Decimal128(..)) {
                let raw = digits.parse::<i128>().map_err(|_| parse_error())?;
                scalar::<Decimal128Type>(op, raw, data_type)
            } else {
                let raw = i256::from_string(&digits).ok_or_else(parse_error)?;
                scalar::<Decimal256Type>(op, raw, data_type)
            }
        }
        DataType::Date32 => integer::<Date32Type>(op, instant(None, DAY)?, data_type),
        DataType::Date64 => integer::<Date64Type>(op, instant(None, 1_000_000)?, data_type),
        DataType::Timestamp(unit, zone) => {
            let zone = zone.as_deref();
            match unit {
                TimeUnit::Second => {
                    integer::<TimestampSecondType>(op, instant(zone, 1_000_000_000)?, data_type)
                }
                TimeUnit::Millisecond => {
                    integer::<TimestampMillisecondType>(op, instant(zone, 1_000_000)?, data_type)
                }
                TimeUnit::Microsecond => {
                    integer::<TimestampMicrosecondType>(op, instant(zone, 1_000)?, data_type)
                }
                TimeUnit::Nanosecond => {
                    integer::<TimestampNanosecondType>(op, instant(zone, 1)?, data_type)
                }
            }
        }
        DataType::Boolean => match literal {
            Literal::Boolean(b) => compare_with(op, Arc::new(BooleanArray::from(vec![*b]))),
            _ => return Err(mismatch()),
        },
        DataType::Utf8 => compare_with(op, Arc::new(StringArray::from(vec![string()?]))),
        DataType::LargeUtf8 => compare_with(op, Arc::new(LargeStringArray::from(vec![string()?]))),
        DataType::Utf8View => compare_with(op, Arc::new(StringViewArray::from(vec![string()?]))),
        _ => {
            return Err(SqlError::Unsupported(format!(
                "column \"{}\" has type {}, which WHERE does not filter: conditions take integer, \
                 float, decimal, date, timestamp, boolean and string columns (and dictionaries \
                 of them)",
                field.name(),
                field.data_type()
            )));
        }
    })
}

/// Nanoseconds since the epoch of a date or timestamp text, read in `zone` (UTC without one)
/// where the text names no zone; i128, so that no valid date overflows.
fn nanos(text: &str, zone: Option<&str>) -> Result<i128, SqlError> {
    let tz: Tz = zone
        .unwrap_or("+00:00")
        .parse()
        .map_err(|e: ArrowError| SqlError::invalid(format!("time zone {zone:?}: {e}")))?;
    let at = string_to_datetime(&tz, text)
        .map_err(|e| SqlError::invalid(format!("'{text}' is not a date or timestamp: {e}")))?;
    Ok(i128::from(at.timestamp()) * 1_000_000_000 + i128::from(at.timestamp_subsec_nanos()))
}

/// `column op value` on a column of integers (or days, or time units) for a value that may lie
/// between two of them or beyond the type's range.
fn integer<T>(op: CmpOp, value: Bound, data_type: &DataType) -> Test
where
    T: ArrowPrimitiveType,
    T::Native: TryFrom<i128>,
{
    let (op, at) = match (op, value.exact) {
        (CmpOp::Eq, false) => return Test::Constant(false),
        (CmpOp::NotEq, false) => return Test::Constant(true),
        // floor < value < floor + 1
        (CmpOp::Lt, false) => (CmpOp::LtEq, value.floor),
        (CmpOp::GtEq, false) => (CmpOp::Gt, value.floor),
        (op, _) => (op, value.floor),
    };
    match T::Native::try_from(at) {
        Ok(v) => scalar::<T>(op, v, data_type),
        // Every integer type holds 0, so a value it cannot hold lies above or below all of it.
        Err(_) => Test::Constant(match op {
            CmpOp::Eq => false,
            CmpOp::NotEq => true,
            CmpOp::Lt | CmpOp::LtEq => at > 0,
            CmpOp::Gt | CmpOp::GtEq => at < 0,
        }),
    }
}

fn scalar<T: ArrowPrimitiveType>(op: CmpOp, value: T::Native, data_type: &DataType) -> Test {
    let array = PrimitiveArray::<T>::from_value(value, 1).with_data_type(data_type.clone());
    compare_with(op, Arc::new(array))
}

fn compare_with(op: CmpOp, value: ArrayRef) -> Test {
    Test::Compare(op, Scalar::new(value))
}

fn describe(literal: &Literal) -> String {
    match literal {
        Literal::Null => "NULL".to_owned(),
        Literal::Boolean(b) => format!("the boolean {}", if *b { "TRUE" } else { "FALSE" }),
        Literal::Number(n) => format!("the number {n}"),
        Literal::String(s) => format!("the string '{s}'"),
        Literal::Date(d) => format!("DATE '{d}'"),
        Literal::Timestamp(t) => format!("TIMESTAMP '{t}'"),
    }
}

fn evaluate(node: &Node, batch: &RecordBatch) -> Result<BooleanArray, SqlError> {
    let rows = batch.num_rows();
    let kernel_error = |e: ArrowError| SqlError::invalid(format!("evaluating WHERE: {e}"));
    match node {
        Node::Leaf { column, test } => {
            let array = batch.column(*column);
            match test {
                Test::Compare(op, value) => compare_kernel(*op, array, value).map_err(kernel_error),
                Test::IsNull => is_null(array).map_err(kernel_error),
                Test::IsNotNull => is_not_null(array).map_err(kernel_error),
                Test::Constant(answer) => {
                    let values = if *answer {
                        BooleanBuffer::new_set(rows)
                    } else {
                        BooleanBuffer::new_unset(rows)
                    };
                    Ok(BooleanArray::new(values, array.logical_nulls()))
                }
                Test::Null => Ok(BooleanArray::new_null(rows)),
                Test::In { values, null } => member(array, values, *null).map_err(kernel_error),
            }
        }
        Node::And(children) => fold(children, batch, true, and_kleene),
        Node::Or(children) => fold(children, batch, false, or_kleene),
        Node::Not(child) => not(&evaluate(child, batch)?).map_err(kernel_error),
    }
}

/// Combines the children's answers with `kernel`; `empty` is the answer of no children.
fn fold(
    children: &[Node],
    batch: &RecordBatch,
    empty: bool,
    kernel: fn(&BooleanArray, &BooleanArray) -> Result<BooleanArray, ArrowError>,
) -> Result<BooleanArray, SqlError> {
    let Some((first, rest)) = children.split_first() else {
        let values = if empty {
            BooleanBuffer::new_set(batch.num_rows())
        } else {
            BooleanBuffer::new_unset(batch.num_rows())
        };
        return Ok(BooleanArray::new(values, None));
    };
    let mut acc = evaluate(first, batch)?;
    for child in rest {
        acc = kernel(&acc, &evaluate(child, batch)?)
            .map_err(|e| SqlError::invalid(format!("evaluating WHERE: {e}")))?;
    }
    Ok(acc)
}

fn compare_kernel(
    op: CmpOp,
    array: &dyn Datum,
    value: &dyn Datum,
) -> Result<BooleanArray, ArrowError> {
    match op {
        CmpOp::Eq => cmp::eq(array, value),
        CmpOp::NotEq => cmp::neq(array, value),
        CmpOp::Lt => cmp::lt(array, value),
        CmpOp::LtEq => cmp::lt_eq(array, value),
        CmpOp::Gt => cmp::gt(array, value),
        CmpOp::GtEq => cmp::gt_eq(array, value),
    }
}

#[cfg(test)]
mod tests {
    use arrow::array::{
        Date32Array, Decimal128Array, DictionaryArray, Float32Array, Int8Array, Int64Array,
        TimestampSecondArray, UInt64Array,
    };

    use super::*;
    use crate::flight::sql::query::parse;

    /// The rows `condition` keeps over a one-column batch named `x`, as Some(true/false) or None.
    fn run(array: ArrayRef, condition: &str) -> Vec<Option<bool>> {
        let schema = Arc::new(Schema::new(vec![Field::new(
            "x",
            array.data_type().clone(),
            true,
        )]));
        let batch = RecordBatch::try_new(schema, vec![array]).expect("a batch");
        let query = parse(&format!("SELECT * FROM t WHERE {condition}")).expect("parsed");
        let filter = query.filter.expect("a filter");
        let rows: Vec<Option<bool>> = filter
            .evaluate(&batch)
            .unwrap_or_else(|e| panic!("{condition}: {e}"))
            .iter()
            .collect();
        assert_backend_agrees(&filter, &batch, &rows, condition);
        rows
    }

    /// Where `predicate` lowers to a backend filter, that filter's answers are `rows`.
    /// Returns whether it lowered.
    fn assert_backend_agrees(
        predicate: &Predicate,
        batch: &RecordBatch,
        rows: &[Option<bool>],
        condition: &str,
    ) -> bool {
        let prepared = predicate.prepare(batch.schema_ref()).expect("prepared");
        let Some(program) = prepared.for_backend() else {
            return false;
        };
        let answers: Vec<Option<bool>> = (0..batch.num_rows())
            .map(|row| {
                program.evaluate_row(|c| {
                    let (position, _) = program.columns()[c];
                    filter::cell(batch.column(position).as_ref(), row).expect("a cell")
                })
            })
            .collect();
        assert_eq!(answers, rows, "{condition}: the backend's filter disagrees");
        true
    }

    fn error(array: ArrayRef, condition: &str) -> String {
        let schema = Schema::new(vec![Field::new("x", array.data_type().clone(), true)]);
        let query = parse(&format!("SELECT * FROM t WHERE {condition}")).expect("parsed");
        query
            .filter
            .expect("a filter")
            .check(&schema)
            .expect_err(condition)
            .to_string()
    }

    const T: Option<bool> = Some(true);
    const F: Option<bool> = Some(false);
    const N: Option<bool> = None;

    #[test]
    fn integers_compare_exactly() {
        let x: ArrayRef = Arc::new(Int64Array::from(vec![Some(1), Some(2), Some(3), None]));
        assert_eq!(run(Arc::clone(&x), "x > 2.5"), [F, F, T, N]);
        assert_eq!(run(Arc::clone(&x), "x >= 2.5"), [F, F, T, N]);
        assert_eq!(run(Arc::clone(&x), "x < 2.5"), [T, T, F, N]);
        assert_eq!(run(Arc::clone(&x), "x <= 2.5"), [T, T, F, N]);
        assert_eq!(run(Arc::clone(&x), "x = 2.5"), [F, F, F, N]);
        assert_eq!(run(Arc::clone(&x), "x <> 2.5"), [T, T, T, N]);
        assert_eq!(run(Arc::clone(&x), "x = 2.0"), [F, T, F, N]);
        assert_eq!(run(Arc::clone(&x), "2 < x"), [F, F, T, N]);
        assert_eq!(run(Arc::clone(&x), "x < -2.5"), [F, F, F, N]);
        assert_eq!(run(Arc::clone(&x), "x < 1e30"), [T, T, T, N]);
        assert_eq!(
            run(Arc::clone(&x), "x > 99999999999999999999999"),
            [F, F, F, N]
        );
        assert_eq!(run(Arc::clone(&x), "x = NULL"), [N, N, N, N]);
        assert_eq!(run(Arc::clone(&x), "x IN (1, 3.5, 3)"), [T, F, T, N]);
        assert_eq!(run(Arc::clone(&x), "x IN (1, NULL)"), [T, N, N, N]);
        assert_eq!(run(Arc::clone(&x), "x NOT IN (1, NULL)"), [F, N, N, N]);
        assert_eq!(run(Arc::clone(&x), "x BETWEEN 1.5 AND 3"), [F, T, T, N]);
        assert_eq!(run(Arc::clone(&x), "x NOT BETWEEN 1.5 AND 3"), [T, F, F, N]);
        assert_eq!(run(Arc::clone(&x), "x IS NULL"), [F, F, F, T]);
        assert_eq!(run(Arc::clone(&x), "NOT x IS NOT NULL"), [F, F, F, T]);
        let small: ArrayRef = Arc::new(Int8Array::from(vec![-128, 127]));
        assert_eq!(run(Arc::clone(&small), "x > 127"), [F, F]);
        assert_eq!(run(Arc::clone(&small), "x >= -128"), [T, T]);
        assert_eq!(run(small, "x < 300"), [T, T]);
        let wide: ArrayRef = Arc::new(UInt64Array::from(vec![u64::MAX, 0]));
        assert_eq!(run(Arc::clone(&wide), "x = 18446744073709551615"), [T, F]);
        assert_eq!(run(wide, "x < -1"), [F, F]);
        let e = error(Arc::new(Int64Array::from(vec![1])), "x = 'a'");
        assert!(
            e.contains("\"x\" (Int64)") && e.contains("the string 'a'"),
            "{e}"
        );
    }

    #[test]
    fn three_valued_logic() {
        let x: ArrayRef = Arc::new(Int64Array::from(vec![Some(1), Some(5), None]));
        assert_eq!(run(Arc::clone(&x), "x > 2 OR x IS NULL"), [F, T, T]);
        assert_eq!(run(Arc::clone(&x), "x > 2 OR x = 1"), [T, T, N]);
        assert_eq!(run(Arc::clone(&x), "x > 2 AND x < 9"), [F, T, N]);
        assert_eq!(run(Arc::clone(&x), "NOT (x > 2)"), [T, F, N]);
        assert_eq!(run(Arc::clone(&x), "x = NULL OR x = 1"), [T, N, N]);
        assert_eq!(run(Arc::clone(&x), "x = NULL AND x = 1"), [N, F, N]);
        assert_eq!(run(x, "NOT (x = NULL)"), [N, N, N]);
    }

    #[test]
    fn long_in_lists_are_hashed_with_sqls_nulls() {
        let x: ArrayRef = Arc::new(Int64Array::from(vec![
            Some(1),
            Some(2),
            Some(3),
            None,
            Some(100),
        ]));
        let odd = "1, 3, 5, 7, 9, 11, 13, 15, 17";
        assert_eq!(
            run(Arc::clone(&x), &format!("x IN ({odd})")),
            [T, F, T, N, F]
        );
        assert_eq!(
            run(Arc::clone(&x), &format!("x NOT IN ({odd})")),
            [F, T, F, N, T]
        );
        let with_null = "1, 3, 5, 7, 9, 11, 13, 15, NULL";
        assert_eq!(
            run(Arc::clone(&x), &format!("x IN ({with_null})")),
            [T, N, T, N, N]
        );
        assert_eq!(
            run(Arc::clone(&x), &format!("x NOT IN ({with_null})")),
            [F, N, F, N, N]
        );
        // Items no integer equals (2.5) or beyond the type drop out, as equalities would.
        let odd_and_more = "2.5, 1e30, 1, 3, 5, 7, 9, 11, 13";
        assert_eq!(run(x, &format!("x IN ({odd_and_more})")), [T, F, T, N, F]);
        let s: ArrayRef = Arc::new(StringArray::from(vec![Some("a"), Some("zz"), None]));
        let letters = "'a', 'b', 'c', 'd', 'e', 'f', 'g', 'h', 'i'";
        assert_eq!(run(s, &format!("x IN ({letters})")), [T, F, N]);
        let d: ArrayRef = Arc::new(
            Decimal128Array::from(vec![Some(12345), Some(-100), None])
                .with_precision_and_scale(10, 2)
                .expect("a decimal"),
        );
        let amounts = "0.5, 123.45, 1.005, 2, 3, 4, 5, 6, 7";
        assert_eq!(run(d, &format!("x IN ({amounts})")), [T, F, N]);
    }

    #[test]
    fn floats_decimals_strings_booleans() {
        let f: ArrayRef = Arc::new(Float32Array::from(vec![Some(0.1), Some(2.5), None]));
        assert_eq!(run(Arc::clone(&f), "x = 0.1"), [T, F, N]);
        assert_eq!(run(f, "x > 1"), [F, T, N]);
        let d: ArrayRef = Arc::new(
            Decimal128Array::from(vec![Some(12345), Some(-100), None])
                .with_precision_and_scale(10, 2)
                .expect("a decimal"),
        );
        assert_eq!(run(Arc::clone(&d), "x = 123.45"), [T, F, N]);
        assert_eq!(run(Arc::clone(&d), "x = 123.450"), [T, F, N]);
        assert_eq!(run(Arc::clone(&d), "x < -0.99"), [F, T, N]);
        // Literals with more digits than the column compare exactly, as with integers.
        assert_eq!(run(Arc::clone(&d), "x = 123.451"), [F, F, N]);
        assert_eq!(run(Arc::clone(&d), "x <> 123.451"), [T, T, N]);
        assert_eq!(run(Arc::clone(&d), "x > 123.449"), [T, F, N]);
        assert_eq!(run(Arc::clone(&d), "x >= 123.451"), [F, F, N]);
        assert_eq!(run(Arc::clone(&d), "x < -0.999"), [F, T, N]);
        assert_eq!(run(Arc::clone(&d), "x IN (0.5, 123.45, 1.005)"), [T, F, N]);
        assert_eq!(run(Arc::clone(&d), "x < 123456789012"), [T, T, N]);
        assert_eq!(run(Arc::clone(&d), "x > -123456789012.5"), [T, T, N]);
        // Beyond 30 digits the literal must fit the column.
        let wide: ArrayRef = Arc::new(
            Decimal128Array::from(vec![Some(1), None])
                .with_precision_and_scale(38, 2)
                .expect("a decimal"),
        );
        let e = error(wide, "x = 1.234");
        assert!(
            e.contains("does not fit") && e.contains("Decimal128(38, 2)"),
            "{e}"
        );
        let s: ArrayRef = Arc::new(StringArray::from(vec![Some("a"), Some("b"), None]));
        assert_eq!(run(Arc::clone(&s), "x = 'b'"), [F, T, N]);
        assert_eq!(
            run(Arc::clone(&s), "x >= 'a' AND x IN ('a', 'c')"),
            [T, F, N]
        );
        let e = error(s, "x = 1");
        assert!(e.contains("(Utf8)") && e.contains("number 1"), "{e}");
        let dict: ArrayRef = Arc::new(
            vec![Some("p"), None, Some("q"), Some("p")]
                .into_iter()
                .collect::<DictionaryArray<Int32Type>>(),
        );
        assert_eq!(run(Arc::clone(&dict), "x = 'p'"), [T, N, F, T]);
        assert_eq!(run(dict, "x IS NULL"), [F, T, F, F]);
        let b: ArrayRef = Arc::new(BooleanArray::from(vec![Some(true), Some(false), None]));
        assert_eq!(run(Arc::clone(&b), "x"), [T, F, N]);
        assert_eq!(run(Arc::clone(&b), "NOT x"), [F, T, N]);
        assert_eq!(run(b, "x = FALSE"), [F, T, N]);
    }

    #[test]
    fn dates_and_timestamps() {
        let d: ArrayRef = Arc::new(Date32Array::from(vec![Some(19723), Some(19724), None]));
        assert_eq!(run(Arc::clone(&d), "x = DATE '2024-01-01'"), [T, F, N]);
        assert_eq!(run(Arc::clone(&d), "x > '2024-01-01'"), [F, T, N]);
        assert_eq!(
            run(Arc::clone(&d), "x > TIMESTAMP '2024-01-01 12:00:00'"),
            [F, T, N]
        );
        assert_eq!(run(d, "x = TIMESTAMP '2024-01-01 12:00:00'"), [F, F, N]);
        // 2024-01-01 00:00:00 UTC and one second later, in a column zoned +02:00.
        let ts: ArrayRef = Arc::new(
            TimestampSecondArray::from(vec![Some(1_704_067_200), Some(1_704_067_201), None])
                .with_timezone("+02:00"),
        );
        assert_eq!(
            run(Arc::clone(&ts), "x = TIMESTAMP '2024-01-01 02:00:00'"),
            [T, F, N]
        );
        assert_eq!(
            run(Arc::clone(&ts), "x = TIMESTAMP '2024-01-01 00:00:00Z'"),
            [T, F, N]
        );
        assert_eq!(
            run(Arc::clone(&ts), "x > TIMESTAMP '2024-01-01T00:00:00.5Z'"),
            [F, T, N]
        );
        assert_eq!(
            run(Arc::clone(&ts), "x = TIMESTAMP '2024-01-01T00:00:00.5Z'"),
            [F, F, N]
        );
        let named: ArrayRef = Arc::new(
            TimestampSecondArray::from(vec![1_704_067_200]).with_timezone("Europe/Berlin"),
        );
        assert_eq!(run(named, "x = TIMESTAMP '2024-01-01 01:00:00'"), [T]);
        let naive: ArrayRef = Arc::new(TimestampSecondArray::from(vec![1_704_067_200]));
        assert_eq!(run(Arc::clone(&naive), "x = '2024-01-01 00:00:00'"), [T]);
        let e = error(naive, "x = 5");
        assert!(e.contains("Timestamp(s)") || e.contains("Timestamp"), "{e}");
    }

    #[test]
    fn unknown_columns_and_schema_changes() {
        let schema = Schema::new(vec![Field::new("Price", DataType::Int64, true)]);
        let filter = parse("SELECT * FROM t WHERE price > 1")
            .expect("parsed")
            .filter;
        let e = filter
            .expect("a filter")
            .check(&schema)
            .expect_err("unknown");
        assert!(e.to_string().contains("unknown column \"price\""), "{e}");
        assert!(e.to_string().contains("case-sensitive"), "{e}");
        let filter = parse("SELECT * FROM t WHERE Price > 1 AND Price < 5")
            .expect("parsed")
            .filter
            .expect("a filter");
        assert_eq!(filter.columns(), ["Price"]);
        let prepared = filter.prepare(&schema).expect("prepared");
        let other = Arc::new(Schema::new(vec![Field::new(
            "Price",
            DataType::Int32,
            true,
        )]));
        let batch = RecordBatch::try_new(
            other,
            vec![Arc::new(arrow::array::Int32Array::from(vec![1]))],
        )
        .expect("a batch");
        let e = prepared.evaluate(&batch).expect_err("another schema");
        assert!(e.to_string().contains("another schema"), "{e}");
    }

    /// Random predicates over every type a backend filter reads: where one lowers, its
    /// answers are arrow's, row by row.
    #[test]
    fn backend_filters_agree_with_arrows_kernels() {
        use arrow::array::{BooleanArray, Decimal128Array, Float64Array, StringArray, UInt64Array};
        use rand::rngs::StdRng;
        use rand::{Rng, SeedableRng};

        let mut rng = StdRng::seed_from_u64(25);
        let rows = 200;
        let maybe = |rng: &mut StdRng| rng.random_ratio(1, 8);
        let ints: Vec<Option<i64>> = (0..rows)
            .map(|_| (!maybe(&mut rng)).then(|| rng.random_range(-20..20)))
            .collect();
        let small: Vec<Option<i8>> = (0..rows)
            .map(|_| (!maybe(&mut rng)).then(|| rng.random_range(-128..=127)))
            .collect();
        let unsigned: Vec<Option<u64>> = (0..rows)
            .map(|_| (!maybe(&mut rng)).then(|| rng.random_range(0..20) * (u64::MAX / 19)))
            .collect();
        let specials = [
            f64::NAN,
            -0.0,
            0.0,
            f64::INFINITY,
            f64::NEG_INFINITY,
            1.5,
            -1.5,
        ];
        let floats: Vec<Option<f64>> = (0..rows)
            .map(|_| (!maybe(&mut rng)).then(|| specials[rng.random_range(0..specials.len())]))
            .collect();
        let singles: Vec<Option<f32>> = floats.iter().map(|f| f.map(|f| f as f32)).collect();
        let flags: Vec<Option<bool>> = (0..rows)
            .map(|_| (!maybe(&mut rng)).then(|| rng.random()))
            .collect();
        let days: Vec<Option<i32>> = (0..rows)
            .map(|_| (!maybe(&mut rng)).then(|| rng.random_range(19_000..19_010)))
            .collect();
        let cents: Vec<Option<i128>> = (0..rows)
            .map(|_| (!maybe(&mut rng)).then(|| rng.random_range(-500..500)))
            .collect();
        let seconds: Vec<Option<i64>> = days
            .iter()
            .map(|d| d.map(|d| i64::from(d) * 86_400 + 7))
            .collect();
        let names: Vec<Option<&str>> = (0..rows)
            .map(|_| (!maybe(&mut rng)).then(|| ["a", "b", "c"][rng.random_range(0..3)]))
            .collect();
        let columns: Vec<ArrayRef> = vec![
            Arc::new(Int64Array::from(ints)),
            Arc::new(Int8Array::from(small)),
            Arc::new(UInt64Array::from(unsigned)),
            Arc::new(Float64Array::from(floats)),
            Arc::new(Float32Array::from(singles)),
            Arc::new(BooleanArray::from(flags)),
            Arc::new(Date32Array::from(days)),
            Arc::new(
                Decimal128Array::from(cents)
                    .with_precision_and_scale(10, 2)
                    .expect("decimal"),
            ),
            Arc::new(TimestampSecondArray::from(seconds).with_timezone("+02:00")),
            Arc::new(StringArray::from(names.clone())),
            Arc::new(arrow::array::LargeStringArray::from(names.clone())),
            Arc::new(
                names
                    .iter()
                    .copied()
                    .collect::<DictionaryArray<Int32Type>>(),
            ),
        ];
        let names = [
            "i", "s", "u", "f", "g", "b", "d", "m", "ts", "name", "large", "dict",
        ];
        let fields: Vec<Field> = names
            .iter()
            .zip(&columns)
            .map(|(name, column)| Field::new(*name, column.data_type().clone(), true))
            .collect();
        let batch = RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).expect("a batch");

        let literal = |rng: &mut StdRng, column: &str| -> String {
            match column {
                "i" => rng.random_range(-25..25).to_string(),
                "s" => ["-128", "127", "0", "-3.5", "300", "5"][rng.random_range(0..6)].to_owned(),
                "u" => ["0", "18446744073709551615", "-1", "970881267037344821"]
                    [rng.random_range(0..4)]
                .to_owned(),
                "f" | "g" => {
                    ["0", "-0.0", "1.5", "-1.5", "1e308", "2"][rng.random_range(0..6)].to_owned()
                }
                "b" => ["TRUE", "FALSE"][rng.random_range(0..2)].to_owned(),
                "d" => format!("DATE '2022-01-0{}'", rng.random_range(1..10)),
                "m" => ["1.25", "-2", "0.005", "4.99", "-5.00"][rng.random_range(0..5)].to_owned(),
                "ts" => format!("TIMESTAMP '2022-01-0{} 02:00:07'", rng.random_range(1..10)),
                _ => ["'a'", "'b'", "''", "'bb'", "'c'"][rng.random_range(0..5)].to_owned(),
            }
        };
        fn condition(
            rng: &mut StdRng,
            depth: u32,
            literal: &dyn Fn(&mut StdRng, &str) -> String,
        ) -> String {
            let columns = [
                "i", "s", "u", "f", "g", "b", "d", "m", "ts", "i", "f", "name", "large", "dict",
            ];
            let column = columns[rng.random_range(0..columns.len())];
            let choice = if depth > 2 {
                rng.random_range(0..5)
            } else {
                rng.random_range(0..8)
            };
            match choice {
                0 | 1 => {
                    let op = ["=", "<>", "<", "<=", ">", ">="][rng.random_range(0..6)];
                    format!("{column} {op} {}", literal(rng, column))
                }
                2 => format!("{column} IS {}NULL", ["", "NOT "][rng.random_range(0..2)]),
                3 => {
                    let count = [1, 3, 9, 12][rng.random_range(0..4)];
                    let mut items: Vec<String> = (0..count).map(|_| literal(rng, column)).collect();
                    if rng.random_ratio(1, 4) {
                        items.push("NULL".to_owned());
                    }
                    let not = ["", "NOT "][rng.random_range(0..2)];
                    format!("{column} {not}IN ({})", items.join(", "))
                }
                4 => format!(
                    "{column} {}BETWEEN {} AND {}",
                    ["", "NOT "][rng.random_range(0..2)],
                    literal(rng, column),
                    literal(rng, column)
                ),
                5 => format!("NOT ({})", condition(rng, depth + 1, literal)),
                _ => {
                    let joiner = [" AND ", " OR "][rng.random_range(0..2)];
                    let parts: Vec<String> = (0..rng.random_range(2..6))
                        .map(|_| format!("({})", condition(rng, depth + 1, literal)))
                        .collect();
                    parts.join(joiner)
                }
            }
        }
        let (mut lowered, mut cases) = (0, 0);
        while cases < 2_000 {
            let text = condition(&mut rng, 0, &literal);
            let Ok(query) = parse(&format!("SELECT * FROM t WHERE {text}")) else {
                continue;
            };
            let predicate = query.filter.expect("a filter");
            // Literals a column's type cannot take are refused, as on the host.
            let Ok(mask) = predicate.evaluate(&batch) else {
                continue;
            };
            let rows: Vec<Option<bool>> = mask.iter().collect();
            cases += 1;
            lowered += usize::from(assert_backend_agrees(&predicate, &batch, &rows, &text));
        }
        // Every type here is one a backend filter reads.
        assert_eq!(lowered, cases, "{lowered} of {cases} lowered");
    }
}
