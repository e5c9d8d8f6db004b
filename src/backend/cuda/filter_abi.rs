//! The filter kernels' ABI: what `kernels/filter.cu` and the host must agree on.
//!
//! The records the kernels read ([`FilterColumn`], [`FilterOp`], keys as [`FilterKey`],
//! strings as [`FilterString`] into a byte pool), the tile size, and the translation of a
//! [`RowFilter`]'s program into them ([`Program`]). Here, apart from
//! `filter` (which plans a filtered read) and `ffi` (which launches it), so that both depend
//! on it and not on each other. A test reads the kernel's source and checks that they agree.

use crate::backend::filter::{ColumnType, Op, RowFilter, Test};

/// Rows a block takes, and threads per block: `TILE` in the kernel.
pub(super) const TILE: usize = 1024;

/// A column a filter reads: `struct Column` in the kernel. Addresses are filled in by `ffi`,
/// which checks the extents they span.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct FilterColumn {
    /// Values, string offsets, or dictionary keys, from row 0.
    pub(super) values: u64,
    pub(super) validity: u64,
    /// Strings' bytes (a dictionary's), and how many there are.
    pub(super) data: u64,
    pub(super) data_len: u64,
    /// A dictionary's string offsets, and how many strings it holds.
    pub(super) dictionary_offsets: u64,
    pub(super) dictionary_len: u64,
    /// [`column_code`]'s two numbers.
    pub(super) kind: u32,
    pub(super) aux: u32,
}

/// An IN list's string: `struct Str` in the kernel, a range of the byte pool.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct FilterString {
    pub(super) start: u32,
    pub(super) len: u32,
}

/// `Type` in the kernel for a column: a [`KeyType`]'s number, or `STRINGS` (aux: the offsets'
/// width) or `DICTIONARY` (aux: the keys' [`KeyType`] number, and the offsets' width times 256).
pub(super) fn column_code(column: ColumnType) -> (u32, u32) {
    match column {
        ColumnType::Key(key) => (key as u32, 0),
        ColumnType::Strings { offsets } => (STRINGS, offsets as u32),
        ColumnType::Dictionary { keys, offsets } => {
            (DICTIONARY, keys as u32 | (offsets as u32) << 8)
        }
    }
}

/// `STRINGS` and `DICTIONARY` in the kernel's `Type`.
pub(super) const STRINGS: u32 = 13;
pub(super) const DICTIONARY: u32 = 14;

/// What the kernel reads of a program, as the host built it.
#[derive(Debug, Default)]
pub(super) struct Program {
    pub(super) ops: Vec<FilterOp>,
    pub(super) keys: Vec<FilterKey>,
    pub(super) strings: Vec<FilterString>,
    pub(super) bytes: Vec<u8>,
}

/// One step of a program: `struct Op` in the kernel.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct FilterOp {
    pub(super) code: u32,
    pub(super) column: u32,
    pub(super) cmp: u32,
    pub(super) arg: u32,
    pub(super) key_lo: u64,
    pub(super) key_hi: i64,
    pub(super) list_start: u32,
    pub(super) list_len: u32,
}

/// A key as the kernel reads it: `struct Key`, an i128 with its low half first.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct FilterKey {
    pub(super) lo: u64,
    pub(super) hi: i64,
}

impl From<i128> for FilterKey {
    fn from(key: i128) -> Self {
        #[allow(clippy::cast_possible_truncation)]
        Self {
            lo: key as u64,
            hi: (key >> 64) as i64,
        }
    }
}

impl FilterOp {
    pub(super) const COMPARE: u32 = 0;
    pub(super) const IS_NULL: u32 = 1;
    pub(super) const IS_NOT_NULL: u32 = 2;
    pub(super) const CONSTANT: u32 = 3;
    pub(super) const ALWAYS_NULL: u32 = 4;
    pub(super) const IN_LIST: u32 = 5;
    pub(super) const AND: u32 = 6;
    pub(super) const OR: u32 = 7;
    pub(super) const NOT: u32 = 8;
    pub(super) const COMPARE_BYTES: u32 = 9;
    pub(super) const IN_STRINGS: u32 = 10;
}

/// `filter`'s program as the kernel's records; `None` where a count does not fit the kernel's
/// 32-bit fields. The program must have passed [`RowFilter::check`].
pub(super) fn program(filter: &RowFilter) -> Option<Program> {
    let count = |n: usize| u32::try_from(n).ok();
    let ops = filter
        .ops()
        .iter()
        .map(|op| {
            let mut record = FilterOp::default();
            match op {
                Op::And(n) => {
                    record.code = FilterOp::AND;
                    record.arg = count(*n)?;
                }
                Op::Or(n) => {
                    record.code = FilterOp::OR;
                    record.arg = count(*n)?;
                }
                Op::Not => record.code = FilterOp::NOT,
                Op::Test { column, test } => {
                    record.column = count(*column)?;
                    match test {
                        Test::Compare(cmp, key) => {
                            let key = FilterKey::from(*key);
                            record.code = FilterOp::COMPARE;
                            record.cmp = *cmp as u32;
                            record.key_lo = key.lo;
                            record.key_hi = key.hi;
                        }
                        Test::IsNull => record.code = FilterOp::IS_NULL,
                        Test::IsNotNull => record.code = FilterOp::IS_NOT_NULL,
                        Test::Constant(answer) => {
                            record.code = FilterOp::CONSTANT;
                            record.arg = u32::from(*answer);
                        }
                        Test::Null => record.code = FilterOp::ALWAYS_NULL,
                        Test::In { keys, null } => {
                            record.code = FilterOp::IN_LIST;
                            record.arg = u32::from(*null);
                            record.list_start = count(keys.start)?;
                            record.list_len = count(keys.len())?;
                        }
                        Test::CompareBytes(cmp, literal) => {
                            record.code = FilterOp::COMPARE_BYTES;
                            record.cmp = *cmp as u32;
                            record.list_start = count(literal.start)?;
                            record.list_len = count(literal.len())?;
                        }
                        Test::InBytes { strings, null } => {
                            record.code = FilterOp::IN_STRINGS;
                            record.arg = u32::from(*null);
                            record.list_start = count(strings.start)?;
                            record.list_len = count(strings.len())?;
                        }
                    }
                }
            }
            Some(record)
        })
        .collect::<Option<Vec<_>>>()?;
    let keys = filter.keys().iter().map(|&k| FilterKey::from(k)).collect();
    let strings = filter
        .strings()
        .iter()
        .map(|s| {
            Some(FilterString {
                start: count(s.start)?,
                len: count(s.len())?,
            })
        })
        .collect::<Option<Vec<_>>>()?;
    count(filter.bytes().len())?;
    Some(Program {
        ops,
        keys,
        strings,
        bytes: filter.bytes().to_vec(),
    })
}

/// Checks what the kernel trusts of a program before it runs: the stack stays within
/// `MAX_STACK` and ends with one answer, tests name listed columns, IN lists lie in the keys.
/// `RowFilter::check` checked the same of the program these records came from; this checks
/// the records themselves, just before the launch.
pub(super) fn check_program(program: &Program, columns: usize) -> Result<(), &'static str> {
    let within = |start: u32, len: u32, of: usize| u64::from(start) + u64::from(len) <= of as u64;
    if !program
        .strings
        .iter()
        .all(|s| within(s.start, s.len, program.bytes.len()))
    {
        return Err("an IN list's string lies outside the byte pool");
    }
    let mut depth = 0usize;
    for op in &program.ops {
        match op.code {
            FilterOp::AND | FilterOp::OR => {
                depth = depth
                    .checked_sub(op.arg as usize)
                    .ok_or("AND or OR pops more than the stack holds")?
                    + 1;
            }
            FilterOp::NOT if depth == 0 => return Err("NOT on an empty stack"),
            FilterOp::NOT => {}
            FilterOp::COMPARE..=FilterOp::IN_LIST
            | FilterOp::COMPARE_BYTES
            | FilterOp::IN_STRINGS => {
                if op.column as usize >= columns {
                    return Err("a test reads a column that is not listed");
                }
                let fits = match op.code {
                    FilterOp::IN_LIST => within(op.list_start, op.list_len, program.keys.len()),
                    FilterOp::COMPARE_BYTES => {
                        within(op.list_start, op.list_len, program.bytes.len())
                    }
                    FilterOp::IN_STRINGS => {
                        within(op.list_start, op.list_len, program.strings.len())
                    }
                    _ => true,
                };
                if !fits {
                    return Err("a test's literals lie outside the program's");
                }
                depth += 1;
            }
            _ => return Err("an unknown operation"),
        }
        if depth > crate::backend::filter::MAX_STACK {
            return Err("the program overflows the stack");
        }
    }
    if depth == 1 {
        Ok(())
    } else {
        Err("the program does not end with one answer")
    }
}

#[cfg(test)]
mod tests {
    use arrow::datatypes::DataType;

    use super::*;
    use crate::backend::filter::{Comparison, KeyType, MAX_STACK, RowFilterBuilder};

    const KERNEL: &str = include_str!("../../../kernels/filter.cu");

    /// `name = value` as the kernel's source defines it (`#define` or enum member).
    fn defined(name: &str) -> u64 {
        KERNEL
            .lines()
            .find_map(|line| {
                let line = line.trim().trim_end_matches(',');
                let rest = line
                    .strip_prefix(&format!("#define {name} "))
                    .or_else(|| line.strip_prefix(&format!("{name} = ")))?;
                let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
                digits.parse().ok()
            })
            .unwrap_or_else(|| panic!("{name} is not defined in kernels/filter.cu"))
    }

    #[test]
    fn the_kernel_and_the_host_agree() {
        assert_eq!(defined("TILE"), TILE as u64);
        assert_eq!(defined("MAX_STACK"), MAX_STACK as u64);
        assert_eq!(defined("STRINGS"), u64::from(STRINGS));
        assert_eq!(defined("DICTIONARY"), u64::from(DICTIONARY));
        for (name, code) in [
            ("COMPARE", FilterOp::COMPARE),
            ("IS_NULL", FilterOp::IS_NULL),
            ("IS_NOT_NULL", FilterOp::IS_NOT_NULL),
            ("CONSTANT", FilterOp::CONSTANT),
            ("ALWAYS_NULL", FilterOp::ALWAYS_NULL),
            ("IN_LIST", FilterOp::IN_LIST),
            ("AND", FilterOp::AND),
            ("OR", FilterOp::OR),
            ("NOT", FilterOp::NOT),
            ("COMPARE_BYTES", FilterOp::COMPARE_BYTES),
            ("IN_STRINGS", FilterOp::IN_STRINGS),
        ] {
            assert_eq!(defined(name), u64::from(code), "{name}");
        }
        for (name, cmp) in [
            ("EQ", Comparison::Eq),
            ("NE", Comparison::NotEq),
            ("LT", Comparison::Lt),
            ("LE", Comparison::LtEq),
            ("GT", Comparison::Gt),
            ("GE", Comparison::GtEq),
        ] {
            assert_eq!(defined(name), cmp as u64, "{name}");
        }
        for (name, key_type) in [
            ("INT8", KeyType::Int8),
            ("INT16", KeyType::Int16),
            ("INT32", KeyType::Int32),
            ("INT64", KeyType::Int64),
            ("UINT8", KeyType::UInt8),
            ("UINT16", KeyType::UInt16),
            ("UINT32", KeyType::UInt32),
            ("UINT64", KeyType::UInt64),
            ("FLOAT32", KeyType::Float32),
            ("FLOAT64", KeyType::Float64),
            ("INT128", KeyType::Int128),
            ("BITS", KeyType::Bits),
        ] {
            assert_eq!(defined(name), key_type as u64, "{name}");
        }
        // Sizes of the records, field by field as the kernel lays them out.
        assert_eq!(std::mem::size_of::<FilterColumn>(), 6 * 8 + 4 + 4);
        assert_eq!(std::mem::size_of::<FilterString>(), 8);
        assert_eq!(std::mem::size_of::<FilterOp>(), 4 * 4 + 8 + 8 + 4 + 4);
        assert_eq!(std::mem::size_of::<FilterKey>(), 16);
    }

    #[test]
    fn keys_split_low_half_first() {
        let key = FilterKey::from(-2i128);
        assert_eq!((key.lo, key.hi), (u64::MAX - 1, -1));
        let key = FilterKey::from(1i128 << 64 | 5);
        assert_eq!((key.lo, key.hi), (5, 1));
    }

    #[test]
    fn programs_translate_and_are_checked() {
        let mut builder = RowFilterBuilder::default();
        builder
            .test(3, &DataType::Int32, Test::Compare(Comparison::Gt, -1))
            .expect("int32");
        builder
            .in_list(5, &DataType::Float64, vec![1, 2], false)
            .expect("float64");
        builder.or(2);
        builder
            .in_bytes(6, &DataType::Utf8, vec![b"b", b"a", b"b"], true)
            .expect("utf8");
        builder
            .compare_bytes(6, &DataType::Utf8, Comparison::Lt, b"zz")
            .expect("utf8");
        builder.and(3);
        builder.not();
        let filter = builder.finish().expect("well formed");
        let program = program(&filter).expect("fits");
        assert_eq!(program.keys.len(), 2);
        assert_eq!(program.bytes, b"abzz", "sorted, without repeats");
        assert_eq!(
            program.strings,
            [
                FilterString { start: 0, len: 1 },
                FilterString { start: 1, len: 1 }
            ]
        );
        let ops = &program.ops;
        assert_eq!(ops[0].code, FilterOp::COMPARE);
        assert_eq!((ops[0].key_lo, ops[0].key_hi), (u64::MAX, -1));
        assert_eq!((ops[1].column, ops[1].list_len), (1, 2));
        assert_eq!(
            (ops[3].code, ops[3].column, ops[3].arg),
            (FilterOp::IN_STRINGS, 2, 1)
        );
        assert_eq!((ops[4].list_start, ops[4].list_len), (2, 2));
        assert_eq!(check_program(&program, 3), Ok(()));
        assert!(check_program(&program, 2).is_err(), "column 2 unlisted");
        let with = |change: &dyn Fn(&mut Program)| {
            let mut changed = Program {
                ops: program.ops.clone(),
                keys: program.keys.clone(),
                strings: program.strings.clone(),
                bytes: program.bytes.clone(),
            };
            change(&mut changed);
            check_program(&changed, 3)
        };
        assert!(with(&|p| p.keys.truncate(1)).is_err(), "list past the keys");
        assert!(
            with(&|p| p.bytes.truncate(3)).is_err(),
            "literal past the pool"
        );
        assert!(
            with(&|p| p.strings[1].len = 9).is_err(),
            "string past the pool"
        );
        assert!(
            with(&|p| p.strings.truncate(1)).is_err(),
            "list past the strings"
        );
        assert!(with(&|p| p.ops.truncate(2)).is_err(), "two answers");
        let deep = |p: &mut Program| {
            let test = p.ops[0];
            p.ops = vec![test; MAX_STACK + 1];
            p.ops.push(FilterOp {
                code: FilterOp::AND,
                arg: (MAX_STACK + 1) as u32,
                ..FilterOp::default()
            });
        };
        assert!(with(&deep).is_err(), "overflows");
        let unknown = |p: &mut Program| {
            p.ops = vec![FilterOp {
                code: 99,
                ..FilterOp::default()
            }];
        };
        assert!(with(&unknown).is_err(), "unknown code");
    }

    #[test]
    fn column_codes() {
        assert_eq!(column_code(ColumnType::Key(KeyType::Int64)), (4, 0));
        assert_eq!(
            column_code(ColumnType::Strings { offsets: 8 }),
            (STRINGS, 8)
        );
        assert_eq!(
            column_code(ColumnType::Dictionary {
                keys: KeyType::UInt16,
                offsets: 4
            }),
            (DICTIONARY, 6 | 4 << 8)
        );
    }
}
