//! Row filters a backend runs where its data lives.
//!
//! A [`RowFilter`] is a `WHERE` clause compiled for backends: a postfix program of tests on
//! fixed-width columns, joined under SQL's three-valued logic. Every value a test reads is
//! compared as a 128-bit key that orders as the values do: integers, decimals, dates, times
//! and timestamps as their numbers, booleans as 0 and 1, floats in IEEE 754's total order
//! (the order Arrow's comparison kernels use: -0.0 below +0.0, NaN above infinity and equal
//! to itself), so one comparison serves every type and a literal is converted once.
//!
//! String columns (and dictionaries of strings) are compared as bytes, as Arrow orders them:
//! a literal, or an IN list's strings sorted, kept in the filter's byte pool.
//!
//! The SQL layer builds one where its predicate allows; a backend that can filter on its
//! device runs it there (the CUDA backend: `kernels/filter.cu`), so only the rows kept leave
//! device memory. Anything a filter cannot express (float16, wide decimals, string views)
//! stays with the SQL layer's filter on the host.

use std::ops::Range;

use arrow::array::{Array, AsArray};
use arrow::datatypes::*;

/// Most values a filter's stack holds while a row is evaluated (`MAX_STACK` in the kernel).
pub const MAX_STACK: usize = 16;
/// Most operations in one filter; longer ones are filtered on the host.
pub const MAX_OPS: usize = 4096;

/// How a column's values are read into keys (`Type` in the kernel).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum KeyType {
    Int8 = 1,
    Int16 = 2,
    Int32 = 3,
    Int64 = 4,
    UInt8 = 5,
    UInt16 = 6,
    UInt32 = 7,
    UInt64 = 8,
    Float32 = 9,
    Float64 = 10,
    Int128 = 11,
    /// Bit-packed booleans.
    Bits = 12,
}

/// How a filter reads a column's values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ColumnType {
    /// Fixed-width or boolean values, compared as keys.
    Key(KeyType),
    /// Strings: offsets of this many bytes into their bytes, compared as bytes.
    Strings { offsets: usize },
    /// Dictionary keys of `keys` (an integer type), each naming a string of the dictionary,
    /// whose offsets take `offsets` bytes.
    Dictionary { keys: KeyType, offsets: usize },
}

impl ColumnType {
    /// How a filter reads a column of `data_type`, if it can.
    pub fn of(data_type: &DataType) -> Option<Self> {
        let strings = |data_type: &DataType| match data_type {
            DataType::Utf8 => Some(4),
            DataType::LargeUtf8 => Some(8),
            _ => None,
        };
        Some(match data_type {
            DataType::Dictionary(keys, values) => {
                let keys = match keys.as_ref() {
                    DataType::Int8 => KeyType::Int8,
                    DataType::Int16 => KeyType::Int16,
                    DataType::Int32 => KeyType::Int32,
                    DataType::Int64 => KeyType::Int64,
                    DataType::UInt8 => KeyType::UInt8,
                    DataType::UInt16 => KeyType::UInt16,
                    DataType::UInt32 => KeyType::UInt32,
                    DataType::UInt64 => KeyType::UInt64,
                    _ => return None,
                };
                Self::Dictionary {
                    keys,
                    offsets: strings(values)?,
                }
            }
            other => match strings(other) {
                Some(offsets) => Self::Strings { offsets },
                None => Self::Key(KeyType::of(other)?),
            },
        })
    }

    fn compares_bytes(self) -> bool {
        !matches!(self, Self::Key(_))
    }
}

impl KeyType {
    /// The key type of a column of `data_type`, if a filter can read it.
    pub fn of(data_type: &DataType) -> Option<Self> {
        Some(match data_type {
            DataType::Int8 => Self::Int8,
            DataType::Int16 => Self::Int16,
            DataType::Int32 | DataType::Date32 | DataType::Time32(_) => Self::Int32,
            DataType::Int64
            | DataType::Date64
            | DataType::Time64(_)
            | DataType::Timestamp(_, _)
            | DataType::Duration(_) => Self::Int64,
            DataType::UInt8 => Self::UInt8,
            DataType::UInt16 => Self::UInt16,
            DataType::UInt32 => Self::UInt32,
            DataType::UInt64 => Self::UInt64,
            DataType::Float32 => Self::Float32,
            DataType::Float64 => Self::Float64,
            DataType::Decimal128(_, _) => Self::Int128,
            DataType::Boolean => Self::Bits,
            _ => return None,
        })
    }

    /// Bytes a value takes; `None` for bit-packed booleans.
    pub fn width(self) -> Option<usize> {
        match self {
            Self::Int8 | Self::UInt8 => Some(1),
            Self::Int16 | Self::UInt16 => Some(2),
            Self::Int32 | Self::UInt32 | Self::Float32 => Some(4),
            Self::Int64 | Self::UInt64 | Self::Float64 => Some(8),
            Self::Int128 => Some(16),
            Self::Bits => None,
        }
    }
}

/// The key of `array[index]`, ordered as the values are (see the module docs); `None` for a
/// null or a type filters do not read.
pub fn key(array: &dyn Array, index: usize) -> Option<i128> {
    if index >= array.len() || array.is_null(index) {
        return None;
    }
    fn int<T: ArrowPrimitiveType>(array: &dyn Array, index: usize) -> i128
    where
        T::Native: Into<i128>,
    {
        array.as_primitive::<T>().value(index).into()
    }
    Some(match array.data_type() {
        DataType::Int8 => int::<Int8Type>(array, index),
        DataType::Int16 => int::<Int16Type>(array, index),
        DataType::Int32 => int::<Int32Type>(array, index),
        DataType::Date32 => int::<Date32Type>(array, index),
        DataType::Time32(TimeUnit::Second) => int::<Time32SecondType>(array, index),
        DataType::Time32(_) => int::<Time32MillisecondType>(array, index),
        DataType::Int64 => int::<Int64Type>(array, index),
        DataType::Date64 => int::<Date64Type>(array, index),
        DataType::Time64(TimeUnit::Microsecond) => int::<Time64MicrosecondType>(array, index),
        DataType::Time64(_) => int::<Time64NanosecondType>(array, index),
        DataType::Timestamp(TimeUnit::Second, _) => int::<TimestampSecondType>(array, index),
        DataType::Timestamp(TimeUnit::Millisecond, _) => {
            int::<TimestampMillisecondType>(array, index)
        }
        DataType::Timestamp(TimeUnit::Microsecond, _) => {
            int::<TimestampMicrosecondType>(array, index)
        }
        DataType::Timestamp(TimeUnit::Nanosecond, _) => {
            int::<TimestampNanosecondType>(array, index)
        }
        DataType::Duration(TimeUnit::Second) => int::<DurationSecondType>(array, index),
        DataType::Duration(TimeUnit::Millisecond) => int::<DurationMillisecondType>(array, index),
        DataType::Duration(TimeUnit::Microsecond) => int::<DurationMicrosecondType>(array, index),
        DataType::Duration(TimeUnit::Nanosecond) => int::<DurationNanosecondType>(array, index),
        DataType::UInt8 => int::<UInt8Type>(array, index),
        DataType::UInt16 => int::<UInt16Type>(array, index),
        DataType::UInt32 => int::<UInt32Type>(array, index),
        DataType::UInt64 => int::<UInt64Type>(array, index),
        DataType::Decimal128(_, _) => array.as_primitive::<Decimal128Type>().value(index),
        DataType::Float32 => {
            let bits = array.as_primitive::<Float32Type>().value(index).to_bits() as i32;
            i128::from(bits ^ (((bits >> 31) as u32) >> 1) as i32)
        }
        DataType::Float64 => {
            let bits = array.as_primitive::<Float64Type>().value(index).to_bits() as i64;
            i128::from(bits ^ (((bits >> 63) as u64) >> 1) as i64)
        }
        DataType::Boolean => i128::from(array.as_boolean().value(index)),
        _ => return None,
    })
}

/// A comparison of a column's key with a literal's (`Cmp` in the kernel).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Comparison {
    Eq = 0,
    NotEq = 1,
    Lt = 2,
    LtEq = 3,
    Gt = 4,
    GtEq = 5,
}

impl Comparison {
    fn holds(self, order: std::cmp::Ordering) -> bool {
        match self {
            Self::Eq => order.is_eq(),
            Self::NotEq => order.is_ne(),
            Self::Lt => order.is_lt(),
            Self::LtEq => order.is_le(),
            Self::Gt => order.is_gt(),
            Self::GtEq => order.is_ge(),
        }
    }
}

/// A test of one column's value in a row. On a NULL value every test but the NULL tests is
/// NULL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Test {
    Compare(Comparison, i128),
    IsNull,
    IsNotNull,
    /// The same answer on every non-NULL value.
    Constant(bool),
    /// NULL on every row.
    Null,
    /// Whether the key is one of `keys` (a range of the filter's sorted keys); a key not found
    /// is NULL where the list held a NULL, false otherwise.
    In {
        keys: Range<usize>,
        null: bool,
    },
    /// A string compared with bytes `literal` of the filter's byte pool.
    CompareBytes(Comparison, Range<usize>),
    /// Whether a string is one of `strings` (a range of the filter's sorted strings), with
    /// NULL as for [`Test::In`].
    InBytes {
        strings: Range<usize>,
        null: bool,
    },
}

/// One step of a filter's program.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Pushes the test's answer on `columns[column]`.
    Test { column: usize, test: Test },
    /// Pops this many answers and pushes their conjunction (true for none).
    And(usize),
    /// Pops this many answers and pushes their disjunction (false for none).
    Or(usize),
    /// Negates the answer on top.
    Not,
}

/// A filter a backend can run: see the module docs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RowFilter {
    /// The columns tests read: a position among the columns read, and how to read it.
    columns: Vec<(usize, ColumnType)>,
    ops: Vec<Op>,
    /// The IN lists' keys, each list sorted and without repeats.
    keys: Vec<i128>,
    /// String literals' bytes, one after another.
    bytes: Vec<u8>,
    /// The string IN lists' items, ranges of `bytes`, each list sorted and without repeats.
    strings: Vec<Range<usize>>,
}

/// A column's value in one row, as [`RowFilter::evaluate_row`] reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cell<'a> {
    Null,
    Key(i128),
    Bytes(&'a [u8]),
}

/// The cell of `array[index]` (a column a filter reads), `None` where the filter does not read
/// such a column.
pub fn cell(array: &dyn Array, index: usize) -> Option<Cell<'_>> {
    if index >= array.len() {
        return None;
    }
    if array.logical_nulls().is_some_and(|n| n.is_null(index)) {
        return Some(Cell::Null);
    }
    Some(match array.data_type() {
        DataType::Utf8 => Cell::Bytes(array.as_string::<i32>().value(index).as_bytes()),
        DataType::LargeUtf8 => Cell::Bytes(array.as_string::<i64>().value(index).as_bytes()),
        DataType::Dictionary(_, _) => {
            let dictionary = array.as_any_dictionary();
            let key = dictionary.normalized_keys()[index];
            return cell(dictionary.values().as_ref(), key);
        }
        _ => Cell::Key(key(array, index)?),
    })
}

/// Builds a [`RowFilter`] in program order.
#[derive(Debug, Default)]
pub struct RowFilterBuilder {
    filter: RowFilter,
}

impl RowFilterBuilder {
    /// Pushes `test` of the column at `position` (among the columns read), of `data_type`.
    /// `None` where filters cannot read that type.
    pub fn test(&mut self, position: usize, data_type: &DataType, test: Test) -> Option<()> {
        let column_type = ColumnType::of(data_type)?;
        let fits = match test {
            Test::Compare(..) | Test::In { .. } => !column_type.compares_bytes(),
            Test::CompareBytes(..) | Test::InBytes { .. } => column_type.compares_bytes(),
            Test::IsNull | Test::IsNotNull | Test::Constant(_) | Test::Null => true,
        };
        fits.then_some(())?;
        let column = match self.filter.columns.iter().position(|c| c.0 == position) {
            Some(column) => column,
            None => {
                self.filter.columns.push((position, column_type));
                self.filter.columns.len() - 1
            }
        };
        (self.filter.columns[column].1 == column_type).then_some(())?;
        self.filter.ops.push(Op::Test { column, test });
        Some(())
    }

    /// Pushes the comparison of a string column with `literal`.
    pub fn compare_bytes(
        &mut self,
        position: usize,
        data_type: &DataType,
        op: Comparison,
        literal: &[u8],
    ) -> Option<()> {
        let literal = self.pool(literal);
        self.test(position, data_type, Test::CompareBytes(op, literal))
    }

    /// Pushes the membership test of a string column in `strings` (any order, repeats
    /// allowed).
    pub fn in_bytes(
        &mut self,
        position: usize,
        data_type: &DataType,
        mut strings: Vec<&[u8]>,
        null: bool,
    ) -> Option<()> {
        strings.sort_unstable();
        strings.dedup();
        let start = self.filter.strings.len();
        for string in strings {
            let range = self.pool(string);
            self.filter.strings.push(range);
        }
        let test = Test::InBytes {
            strings: start..self.filter.strings.len(),
            null,
        };
        self.test(position, data_type, test)
    }

    fn pool(&mut self, bytes: &[u8]) -> Range<usize> {
        let start = self.filter.bytes.len();
        self.filter.bytes.extend_from_slice(bytes);
        start..self.filter.bytes.len()
    }

    /// Pushes the membership test of `keys` (in any order, repeats allowed).
    pub fn in_list(
        &mut self,
        position: usize,
        data_type: &DataType,
        mut keys: Vec<i128>,
        null: bool,
    ) -> Option<()> {
        keys.sort_unstable();
        keys.dedup();
        let start = self.filter.keys.len();
        self.filter.keys.extend(keys);
        let test = Test::In {
            keys: start..self.filter.keys.len(),
            null,
        };
        self.test(position, data_type, test)
    }

    pub fn and(&mut self, children: usize) {
        self.filter.ops.push(Op::And(children));
    }

    pub fn or(&mut self, children: usize) {
        self.filter.ops.push(Op::Or(children));
    }

    pub fn not(&mut self) {
        self.filter.ops.push(Op::Not);
    }

    /// The filter, if its program is well formed (one answer at the end, never more than
    /// [`MAX_STACK`] on the stack, at most [`MAX_OPS`] steps).
    pub fn finish(self) -> Option<RowFilter> {
        let filter = self.filter;
        (filter.ops.len() <= MAX_OPS && filter.check().is_ok()).then_some(filter)
    }
}

impl RowFilter {
    pub fn columns(&self) -> &[(usize, ColumnType)] {
        &self.columns
    }

    pub fn ops(&self) -> &[Op] {
        &self.ops
    }

    pub fn keys(&self) -> &[i128] {
        &self.keys
    }

    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    pub fn strings(&self) -> &[Range<usize>] {
        &self.strings
    }

    /// Checks the program's stack discipline and references: what a device needs to trust
    /// before it runs the program.
    pub fn check(&self) -> Result<(), String> {
        let mut depth = 0usize;
        for op in &self.ops {
            match op {
                Op::Test { column, test } => {
                    if *column >= self.columns.len() {
                        return Err(format!("a test reads column {column}, which is not listed"));
                    }
                    let within = |range: &Range<usize>, len: usize| {
                        range.start <= range.end && range.end <= len
                    };
                    let fits = match test {
                        Test::In { keys, .. } => within(keys, self.keys.len()),
                        Test::CompareBytes(_, literal) => within(literal, self.bytes.len()),
                        Test::InBytes { strings, .. } => {
                            within(strings, self.strings.len())
                                && self.strings[strings.clone()]
                                    .iter()
                                    .all(|s| within(s, self.bytes.len()))
                        }
                        _ => true,
                    };
                    if !fits {
                        return Err("a test's literals lie outside the filter's".to_owned());
                    }
                    depth += 1;
                }
                Op::And(n) | Op::Or(n) => {
                    depth = depth
                        .checked_sub(*n)
                        .ok_or("AND or OR pops more than the stack holds")?
                        + 1;
                }
                Op::Not if depth == 0 => return Err("NOT on an empty stack".to_owned()),
                Op::Not => {}
            }
            if depth > MAX_STACK {
                return Err(format!(
                    "the program needs more than {MAX_STACK} stack slots"
                ));
            }
        }
        if depth == 1 {
            Ok(())
        } else {
            Err(format!("the program leaves {depth} answers, not one"))
        }
    }

    /// The program's answer for one row: what the device runs, on the host, for tests.
    /// `column(c)` is the row's cell of `columns[c]`.
    pub fn evaluate_row<'a>(&self, column: impl Fn(usize) -> Cell<'a>) -> Option<bool> {
        let found = |found: bool, null: bool| match (found, null) {
            (true, _) => Some(true),
            (false, true) => None,
            (false, false) => Some(false),
        };
        let mut stack: Vec<Option<bool>> = Vec::with_capacity(MAX_STACK);
        for op in &self.ops {
            let answer = match op {
                Op::Test { column: c, test } => {
                    let value = column(*c);
                    match (test, value) {
                        (Test::IsNull, value) => Some(value == Cell::Null),
                        (Test::IsNotNull, value) => Some(value != Cell::Null),
                        (_, Cell::Null) | (Test::Null, _) => None,
                        (Test::Constant(answer), _) => Some(*answer),
                        (Test::Compare(op, literal), Cell::Key(value)) => {
                            Some(op.holds(value.cmp(literal)))
                        }
                        (Test::In { keys, null }, Cell::Key(value)) => {
                            found(self.keys[keys.clone()].binary_search(&value).is_ok(), *null)
                        }
                        (Test::CompareBytes(op, literal), Cell::Bytes(value)) => {
                            Some(op.holds(value.cmp(&self.bytes[literal.clone()])))
                        }
                        (Test::InBytes { strings, null }, Cell::Bytes(value)) => {
                            let listed = self.strings[strings.clone()]
                                .iter()
                                .any(|s| &self.bytes[s.clone()] == value);
                            found(listed, *null)
                        }
                        // A test of another kind of value than the column holds.
                        _ => None,
                    }
                }
                Op::And(n) => {
                    let popped = stack.split_off(stack.len() - n);
                    if popped.contains(&Some(false)) {
                        Some(false)
                    } else if popped.contains(&None) {
                        None
                    } else {
                        Some(true)
                    }
                }
                Op::Or(n) => {
                    let popped = stack.split_off(stack.len() - n);
                    if popped.contains(&Some(true)) {
                        Some(true)
                    } else if popped.contains(&None) {
                        None
                    } else {
                        Some(false)
                    }
                }
                Op::Not => stack.pop().flatten().map(|b| !b),
            };
            stack.push(answer);
        }
        stack.pop().flatten()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{ArrayRef, BooleanArray, Float32Array, Float64Array, Int64Array};

    use super::*;

    #[test]
    fn float_keys_follow_arrows_total_order() {
        let values = [
            f64::NEG_INFINITY,
            -1.5,
            -0.0,
            0.0,
            f64::MIN_POSITIVE,
            2.0,
            f64::INFINITY,
            f64::NAN,
        ];
        let array: ArrayRef = Arc::new(Float64Array::from(values.to_vec()));
        let keys: Vec<i128> = (0..values.len())
            .map(|i| key(&array, i).expect("key"))
            .collect();
        for (i, a) in values.iter().enumerate() {
            for (j, b) in values.iter().enumerate() {
                assert_eq!(keys[i].cmp(&keys[j]), a.total_cmp(b), "{a} vs {b}");
            }
        }
        let singles: ArrayRef = Arc::new(Float32Array::from(vec![-2.0f32, -0.0, 0.0, 1.0]));
        let keys: Vec<i128> = (0..4).map(|i| key(&singles, i).expect("key")).collect();
        assert!(keys.windows(2).all(|w| w[0] < w[1]), "{keys:?}");
    }

    #[test]
    fn nulls_and_unread_types_have_no_key() {
        let array: ArrayRef = Arc::new(Int64Array::from(vec![Some(-3), None]));
        assert_eq!(key(&array, 0), Some(-3));
        assert_eq!(key(&array, 1), None);
        assert_eq!(key(&array, 2), None, "past the end");
        let strings: ArrayRef = Arc::new(arrow::array::StringArray::from(vec!["a"]));
        assert_eq!(key(&strings, 0), None);
        let booleans: ArrayRef = Arc::new(BooleanArray::from(vec![true, false]));
        assert_eq!((key(&booleans, 0), key(&booleans, 1)), (Some(1), Some(0)));
    }

    #[test]
    fn malformed_programs_are_refused() {
        let mut builder = RowFilterBuilder::default();
        builder.and(2);
        assert!(builder.finish().is_none(), "AND of nothing on the stack");
        let mut builder = RowFilterBuilder::default();
        for _ in 0..=MAX_STACK {
            builder
                .test(0, &DataType::Int64, Test::IsNull)
                .expect("int64");
        }
        builder.and(MAX_STACK + 1);
        assert!(builder.finish().is_none(), "deeper than the stack");
        let mut builder = RowFilterBuilder::default();
        builder
            .test(0, &DataType::Int64, Test::IsNull)
            .expect("int64");
        builder
            .test(0, &DataType::Int64, Test::IsNull)
            .expect("int64");
        assert!(builder.finish().is_none(), "two answers");
        let mut builder = RowFilterBuilder::default();
        assert!(builder.test(0, &DataType::Utf8View, Test::IsNull).is_none());
        assert!(builder.test(0, &DataType::Float16, Test::IsNull).is_none());
        // A test of keys on strings, of bytes on keys: refused.
        let key_test = Test::Compare(Comparison::Eq, 1);
        assert!(builder.test(1, &DataType::Utf8, key_test).is_none());
        assert!(
            builder
                .compare_bytes(2, &DataType::Int64, Comparison::Eq, b"x")
                .is_none()
        );
        assert!(
            builder
                .test(3, &DataType::LargeUtf8, Test::IsNull)
                .is_some()
        );
    }

    #[test]
    fn three_valued_logic() {
        // (x < 5) OR (x IN (7, 9)) AND NOT (x IS NULL)
        let mut builder = RowFilterBuilder::default();
        let int = DataType::Int64;
        builder
            .test(0, &int, Test::Compare(Comparison::Lt, 5))
            .expect("int");
        builder.in_list(0, &int, vec![9, 7, 9], true).expect("int");
        builder.or(2);
        let filter = builder.finish().expect("well formed");
        let at = |x: Option<i128>| filter.evaluate_row(|_| x.map_or(Cell::Null, Cell::Key));
        assert_eq!(at(Some(3)), Some(true));
        assert_eq!(at(Some(7)), Some(true));
        assert_eq!(at(Some(8)), None, "not found in a list holding NULL");
        assert_eq!(at(None), None);
        assert_eq!(filter.keys(), &[7, 9]);
    }
}
