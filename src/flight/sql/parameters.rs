//! The parameter schema of a prepared statement: the Arrow type each placeholder takes, which
//! clients read to build the record batch they bind (JDBC types its `setXxx` calls by it).
//!
//! The grammar puts every placeholder beside a column (`column op ?`, `? op column`, an `IN`
//! list, `BETWEEN` bounds), so a parameter takes that column's type: a dictionary column's
//! value type, as a parameter is one value. A placeholder beside no column (`$1 = $2`,
//! `? < 3`) has no type to tell: it is refused as INVALID_ARGUMENT when the statement is
//! parsed, saying so (`LIMIT ?` is refused as unimplemented, as every LIMIT but a number). One
//! parameter compared with columns of different types (`a = $1 OR b = $1`, `a` int32 and `b`
//! float64) has no single type: it is typed Null, the wildcard Flight SQL's specification
//! suggests for parameters without one, and takes any value its columns accept when bound, as
//! every parameter does.
//!
//! Fields are named `parameter_1`, `parameter_2`, ... in parameter order (the names Arrow's
//! own Flight SQL servers give unnamed parameters; clients bind by position), and are nullable:
//! NULL may be bound.

use arrow::datatypes::{DataType, Field, Schema};

use super::error::SqlError;
use super::predicate::{Operand, Predicate};
use super::query::Query;

/// The schema of the parameters `query` takes, its columns' types read from `dataset`.
pub(super) fn schema(query: &Query, dataset: &Schema) -> Result<Schema, SqlError> {
    let mut uses: Vec<Vec<&str>> = vec![Vec::new(); query.placeholders()];
    if let Some(filter) = &query.filter {
        collect(filter, &mut uses);
    }
    let fields = uses
        .iter()
        .enumerate()
        .map(|(i, columns)| {
            let mut types = columns.iter().map(|column| {
                dataset
                    .field_with_name(column)
                    .map(|field| value_type(field.data_type()))
                    .map_err(|_| {
                        SqlError::invalid(format!("the dataset has no column \"{column}\""))
                    })
            });
            let first = types.next().transpose()?;
            let mut data_type = first.clone().unwrap_or(DataType::Null);
            for other in types {
                if Some(other?) != first {
                    data_type = DataType::Null;
                }
            }
            Ok(Field::new(format!("parameter_{}", i + 1), data_type, true))
        })
        .collect::<Result<Vec<_>, SqlError>>()?;
    Ok(Schema::new(fields))
}

/// Records, for each placeholder in `predicate`, the column it is compared with.
fn collect<'a>(predicate: &'a Predicate, uses: &mut [Vec<&'a str>]) {
    let mut note = |column: &'a str, operand: &Operand| {
        if let Operand::Placeholder(i) = operand
            && let Some(columns) = uses.get_mut(*i)
        {
            columns.push(column);
        }
    };
    match predicate {
        Predicate::Compare { column, value, .. } => note(column, value),
        Predicate::IsNull { .. } => {}
        Predicate::InList { column, list, .. } => list.iter().for_each(|o| note(column, o)),
        Predicate::Between {
            column, low, high, ..
        } => {
            note(column, low);
            note(column, high);
        }
        Predicate::And(children) | Predicate::Or(children) => {
            children.iter().for_each(|child| collect(child, uses));
        }
        Predicate::Not(child) => collect(child, uses),
    }
}

/// The type of one value of a column of type `column`.
fn value_type(column: &DataType) -> DataType {
    match column {
        DataType::Dictionary(_, values) => values.as_ref().clone(),
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flight::sql::query::parse;

    fn dataset() -> Schema {
        Schema::new(vec![
            Field::new("i", DataType::Int64, false),
            Field::new("n", DataType::Int32, true),
            Field::new("f", DataType::Float64, true),
            Field::new("s", DataType::Utf8, true),
            Field::new(
                "k",
                DataType::Dictionary(Box::new(DataType::Int16), Box::new(DataType::LargeUtf8)),
                true,
            ),
            Field::new("d", DataType::Date32, true),
            Field::new(
                "t",
                DataType::Timestamp(arrow::datatypes::TimeUnit::Microsecond, Some("UTC".into())),
                true,
            ),
        ])
    }

    fn types(sql: &str) -> Vec<(String, DataType)> {
        let query = parse(sql).unwrap_or_else(|e| panic!("{sql}: {e}"));
        schema(&query, &dataset())
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .fields()
            .iter()
            .inspect(|field| assert!(field.is_nullable(), "{sql}: {field}"))
            .map(|field| (field.name().clone(), field.data_type().clone()))
            .collect()
    }

    fn named(types: &[DataType]) -> Vec<(String, DataType)> {
        types
            .iter()
            .enumerate()
            .map(|(i, t)| (format!("parameter_{}", i + 1), t.clone()))
            .collect()
    }

    #[test]
    fn each_parameter_takes_its_columns_type() {
        assert_eq!(types("SELECT * FROM x"), named(&[]));
        assert_eq!(types("SELECT i FROM x WHERE i > 3"), named(&[]));
        assert_eq!(
            types(
                "SELECT i FROM x WHERE i = ? AND ? < f AND s IN ('a', ?, ?) \
                 AND NOT (d BETWEEN ? AND DATE '2024-01-01' OR t IS NULL OR t >= ?) AND k <> ?"
            ),
            named(&[
                DataType::Int64,
                DataType::Float64,
                DataType::Utf8,
                DataType::Utf8,
                DataType::Date32,
                DataType::Timestamp(arrow::datatypes::TimeUnit::Microsecond, Some("UTC".into())),
                DataType::LargeUtf8,
            ])
        );
        // Numbered parameters in number order, whatever order they are written in; one used
        // twice with one type keeps it.
        assert_eq!(
            types("SELECT * FROM x WHERE s = $2 AND n BETWEEN $1 AND $3 OR n = $1"),
            named(&[DataType::Int32, DataType::Utf8, DataType::Int32])
        );
    }

    #[test]
    fn a_parameter_beside_columns_of_different_types_is_the_null_wildcard() {
        assert_eq!(
            types("SELECT * FROM x WHERE n = $1 OR f = $1 OR s = $2"),
            named(&[DataType::Null, DataType::Utf8])
        );
    }

    #[test]
    fn placeholders_beside_no_column_are_refused_when_parsed() {
        for sql in [
            "SELECT * FROM x WHERE $1 = $2",
            "SELECT * FROM x WHERE ? = 1",
            "SELECT * FROM x WHERE (1 < (?))",
            "SELECT * FROM x WHERE ? IS NULL",
            "SELECT * FROM x WHERE ? IN (1, 2)",
            "SELECT * FROM x WHERE ? BETWEEN 1 AND 2",
        ] {
            let error = parse(sql).expect_err(sql);
            assert!(matches!(error, SqlError::Invalid(_)), "{sql}: {error}");
            assert!(error.to_string().contains("has no type"), "{sql}: {error}");
        }
        // Not run at all, whatever its parameter's type.
        let error = parse("SELECT * FROM x LIMIT $1").expect_err("LIMIT $1");
        assert!(matches!(error, SqlError::Unsupported(_)), "{error}");
        // Comparisons of two literals are as unsupported as before.
        let error = parse("SELECT * FROM x WHERE 1 = 1").expect_err("1 = 1");
        assert!(matches!(error, SqlError::Unsupported(_)), "{error}");
    }

    #[test]
    fn an_unknown_column_is_named() {
        let query = parse("SELECT * FROM x WHERE nope = ?").expect("parsed");
        let error = schema(&query, &dataset()).expect_err("no column");
        assert!(error.to_string().contains("\"nope\""), "{error}");
    }
}
