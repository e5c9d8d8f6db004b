//! `ipc-import`'s columns, checked before any device is touched.
//!
//! A producer describes its columns as `ipc-export` describes the server's (an IPC handle, the
//! allocation's size, each buffer's offset from the allocation's base; a buffer in another
//! allocation than its column's names that one): [`ExportedColumn`]s.
//! Every number in them comes from a client, so before anything is opened or allocated this
//! checks what can be checked from the numbers alone: that each array has exactly the buffers
//! and children its type has, as long as its rows need, lying inside the allocation declared;
//! and that the description stays within the limits below. What only the bytes can say (that
//! offsets stay inside their data, strings are UTF-8, dictionary keys index their dictionary)
//! is checked by the backend after it copied them into memory of its own (for CUDA,
//! `cuda::ingest`), so a producer cannot change them after they were checked.
//!
//! The arrays are in the layout `ipc-export` publishes: they start at row 0, offsets start at
//! 0, and children hold exactly the rows their parent references.
//!
//! A backend then plans the import once ([`PreparedImport`]): the store reserves what the
//! plan allocates and hands the same plan to the copy.

use std::any::Any;

use arrow::datatypes::{DataType, Schema};

use super::{BackendError, BufferKind, ExportedArray, ExportedColumn};

/// An import a backend planned with `Backend::plan_import`: the device bytes it allocates,
/// and the backend's own plan, which only that backend's `Backend::import` opens.
#[derive(Debug)]
pub struct PreparedImport {
    allocated_bytes: u64,
    plan: Box<dyn Any + Send>,
}

impl PreparedImport {
    /// `plan`, which allocates `allocated_bytes` bytes of device memory.
    pub fn new(allocated_bytes: u64, plan: impl Any + Send) -> Self {
        Self {
            allocated_bytes,
            plan: Box::new(plan),
        }
    }

    /// Device bytes the import allocates: what the store reserves before it runs.
    pub fn allocated_bytes(&self) -> u64 {
        self.allocated_bytes
    }

    /// The backend's own plan; an error where another backend made it (a bug, never client
    /// input).
    pub fn into_plan<T: Any>(self, backend: &'static str) -> Result<T, BackendError> {
        self.plan.downcast::<T>().map(|plan| *plan).map_err(|_| {
            BackendError::Device(format!(
                "an import planned by another backend was given to {backend}"
            ))
        })
    }
}

/// Most columns one import carries.
pub const MAX_IMPORT_COLUMNS: usize = 4096;
/// Most arrays (columns, their children and dictionaries) one import describes.
pub const MAX_IMPORT_ARRAYS: usize = 16_384;
/// Deepest nesting of children and dictionaries.
pub const MAX_IMPORT_DEPTH: usize = 64;

/// Checks `columns` against `schema` and `rows`, and trims each buffer a producer declared
/// longer than its rows need to what they need (allocators round buffers up), so that only
/// those bytes are copied. String and binary bytes keep their declared length, which must
/// then equal the last offset (checked once the offsets are copied).
pub fn check_columns(
    schema: &Schema,
    rows: u64,
    columns: &mut [ExportedColumn],
) -> Result<(), BackendError> {
    if columns.len() != schema.fields().len() {
        return Err(refused(format!(
            "the schema has {} fields but the document describes {} columns",
            schema.fields().len(),
            columns.len()
        )));
    }
    if columns.len() > MAX_IMPORT_COLUMNS {
        return Err(refused(format!(
            "an import carries at most {MAX_IMPORT_COLUMNS} columns, not {}",
            columns.len()
        )));
    }
    let rows = usize::try_from(rows).map_err(|_| refused(format!("{rows} rows is too many")))?;
    let mut arrays = 0;
    for (field, column) in schema.fields().iter().zip(columns.iter_mut()) {
        let mut check = Check {
            allocation_bytes: column.allocation_bytes,
            arrays: &mut arrays,
        };
        check.array(
            field.name(),
            field.data_type(),
            Some(rows),
            &mut column.array,
            0,
        )?;
    }
    Ok(())
}

/// Bytes of `len + 1` offsets of `width` bytes: what `len` rows of strings or lists need.
fn offsets_bytes(path: &str, len: usize, width: usize) -> Result<usize, BackendError> {
    let count = len
        .checked_add(1)
        .ok_or_else(|| refused(format!("{path}: {len} rows overflow")))?;
    times(path, count, width)
}

/// Bytes `length` values of `width` bytes take, or an error naming `path`.
fn times(path: &str, length: usize, width: usize) -> Result<usize, BackendError> {
    length
        .checked_mul(width)
        .ok_or_else(|| refused(format!("{path}: {length} values of {width} bytes overflow")))
}

pub(crate) fn refused(reason: String) -> BackendError {
    BackendError::ImportRefused(reason)
}

/// What an array of a type holds besides its validity bitmap.
enum Shape {
    /// No buffers, no children (the Null type).
    Nothing,
    /// One values buffer of this many bytes.
    Values(usize),
    /// Offsets of this width and bytes (strings, binary).
    VarLen(usize),
    /// Offsets of this width and one child of as many rows as the last offset says.
    List(usize),
    /// One child of this many rows.
    FixedList(usize),
    /// A child per field, each of the parent's rows.
    Struct,
    /// Keys of this width, and a dictionary.
    Dictionary(usize),
}

fn shape(path: &str, data_type: &DataType, len: usize) -> Result<Shape, BackendError> {
    let unsupported = || BackendError::UnsupportedType {
        backend: "cuda",
        data_type: data_type.to_string(),
    };
    Ok(match data_type {
        DataType::Null => Shape::Nothing,
        DataType::Boolean => Shape::Values(len.div_ceil(8)),
        DataType::Utf8 | DataType::Binary => Shape::VarLen(4),
        DataType::LargeUtf8 | DataType::LargeBinary => Shape::VarLen(8),
        DataType::List(_) | DataType::Map(_, _) => Shape::List(4),
        DataType::LargeList(_) => Shape::List(8),
        DataType::FixedSizeList(_, size) => {
            let size = usize::try_from(*size).map_err(|_| unsupported())?;
            Shape::FixedList(times(path, len, size)?)
        }
        DataType::Struct(_) => Shape::Struct,
        DataType::Dictionary(key, _) => match key.primitive_width() {
            Some(width) if key.is_integer() => Shape::Dictionary(times(path, len, width)?),
            _ => return Err(unsupported()),
        },
        DataType::FixedSizeBinary(size) => {
            let size = usize::try_from(*size).map_err(|_| unsupported())?;
            Shape::Values(times(path, len, size)?)
        }
        other => match other.primitive_width() {
            Some(width) => Shape::Values(times(path, len, width)?),
            None => return Err(unsupported()),
        },
    })
}

struct Check<'a> {
    allocation_bytes: u64,
    arrays: &'a mut usize,
}

impl Check<'_> {
    /// Checks one array named `path` of `data_type`, of `expected` rows where its parent
    /// decides them.
    fn array(
        &mut self,
        path: &str,
        data_type: &DataType,
        expected: Option<usize>,
        array: &mut ExportedArray,
        depth: usize,
    ) -> Result<(), BackendError> {
        *self.arrays += 1;
        if *self.arrays > MAX_IMPORT_ARRAYS {
            return Err(refused(format!(
                "an import describes at most {MAX_IMPORT_ARRAYS} arrays (columns, children and \
                 dictionaries)"
            )));
        }
        if depth > MAX_IMPORT_DEPTH {
            return Err(refused(format!(
                "{path}: arrays nest at most {MAX_IMPORT_DEPTH} deep"
            )));
        }
        if &array.data_type != data_type {
            return Err(refused(format!(
                "{path}: described as {} but the schema says {data_type}",
                array.data_type
            )));
        }
        let len = usize::try_from(array.length)
            .map_err(|_| refused(format!("{path}: {} rows is too many", array.length)))?;
        if let Some(expected) = expected
            && len != expected
        {
            return Err(refused(format!(
                "{path} has {len} rows where {expected} are expected"
            )));
        }
        if array.null_count > array.length {
            return Err(refused(format!(
                "{path}: {} nulls in {len} rows",
                array.null_count
            )));
        }
        let shape = shape(path, data_type, len)?;
        let has_validity = array
            .buffers
            .first()
            .is_some_and(|b| b.kind == BufferKind::Validity);
        if !has_validity && array.null_count > 0 {
            return Err(refused(format!(
                "{path} declares {} nulls but has no validity bitmap",
                array.null_count
            )));
        }
        if matches!(shape, Shape::Nothing) && has_validity {
            return Err(refused(format!("{path}: a Null array has no buffers")));
        }
        // The buffers this type has after the bitmap, with the bytes `len` rows need (`None`:
        // as declared, checked against the offsets once they are copied).
        let own: Vec<(BufferKind, Option<usize>)> = match shape {
            Shape::Nothing | Shape::FixedList(_) | Shape::Struct => vec![],
            Shape::Values(bytes) | Shape::Dictionary(bytes) => {
                vec![(BufferKind::Values, Some(bytes))]
            }
            Shape::VarLen(width) => vec![
                (BufferKind::Offsets, Some(offsets_bytes(path, len, width)?)),
                (BufferKind::Values, None),
            ],
            Shape::List(width) => {
                vec![(BufferKind::Offsets, Some(offsets_bytes(path, len, width)?))]
            }
        };
        let mut expected_buffers: Vec<(BufferKind, Option<usize>)> = Vec::new();
        if has_validity {
            expected_buffers.push((BufferKind::Validity, Some(len.div_ceil(8))));
        }
        expected_buffers.extend(own);
        let kinds = |buffers: &mut dyn Iterator<Item = BufferKind>| {
            buffers
                .map(|k| format!("{k:?}").to_lowercase())
                .collect::<Vec<_>>()
                .join(", ")
        };
        if array.buffers.len() != expected_buffers.len()
            || array
                .buffers
                .iter()
                .zip(&expected_buffers)
                .any(|(b, (kind, _))| b.kind != *kind)
        {
            return Err(refused(format!(
                "{path}: an array of type {data_type} has the buffers [{}] (validity first, \
                 where it has one), not [{}]",
                kinds(&mut expected_buffers.iter().map(|(k, _)| *k)),
                kinds(&mut array.buffers.iter().map(|b| b.kind)),
            )));
        }
        for (buffer, (kind, needed)) in array.buffers.iter_mut().zip(&expected_buffers) {
            if let Some(needed) = needed {
                let needed = *needed as u64;
                if buffer.length < needed {
                    return Err(refused(format!(
                        "{path}: its {kind:?} buffer has {} bytes; {len} rows of {data_type} \
                         need {needed}",
                        buffer.length
                    )));
                }
                buffer.length = needed;
            } else if matches!(data_type, DataType::Utf8 | DataType::Binary)
                && buffer.length > i32::MAX as u64
            {
                return Err(refused(format!(
                    "{path}: {} bytes cannot be indexed by 32-bit offsets",
                    buffer.length
                )));
            }
            let allocation_bytes = buffer.allocation.map_or(self.allocation_bytes, |a| a.bytes);
            if buffer
                .offset
                .checked_add(buffer.length)
                .is_none_or(|end| end > allocation_bytes)
            {
                return Err(refused(format!(
                    "{path}: bytes {}..+{} lie outside the allocation of {allocation_bytes} bytes",
                    buffer.offset, buffer.length
                )));
            }
        }
        // Children, as the type has them; their rows where the parent decides them.
        let children: Vec<(String, DataType, Option<usize>)> = match (data_type, &shape) {
            (DataType::List(f) | DataType::LargeList(f) | DataType::Map(f, _), _) => {
                vec![(f.name().clone(), f.data_type().clone(), None)]
            }
            (DataType::FixedSizeList(f, _), Shape::FixedList(rows)) => {
                vec![(f.name().clone(), f.data_type().clone(), Some(*rows))]
            }
            (DataType::Struct(fields), _) => fields
                .iter()
                .map(|f| (f.name().clone(), f.data_type().clone(), Some(len)))
                .collect(),
            _ => Vec::new(),
        };
        if array.children.len() != children.len() {
            return Err(refused(format!(
                "{path}: an array of type {data_type} has {} children, not {}",
                children.len(),
                array.children.len()
            )));
        }
        for ((name, child_type, rows), child) in children.iter().zip(array.children.iter_mut()) {
            self.array(
                &format!("{path}.{name}"),
                child_type,
                *rows,
                child,
                depth + 1,
            )?;
        }
        match (data_type, array.dictionary.as_deref_mut()) {
            (DataType::Dictionary(_, value_type), Some(values)) => self.array(
                &format!("{path}.values"),
                value_type,
                None,
                values,
                depth + 1,
            ),
            (DataType::Dictionary(..), None) => Err(refused(format!(
                "{path}: a dictionary array needs its dictionary"
            ))),
            (_, Some(_)) => Err(refused(format!(
                "{path}: only dictionary arrays have a dictionary"
            ))),
            (_, None) => Ok(()),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::Arc;

    use arrow::datatypes::Field;

    use super::*;
    use crate::backend::ExportedBuffer;

    /// A buffer of an import document (also for `backend::cuda::ingest`'s tests).
    pub(crate) fn buffer(kind: BufferKind, offset: u64, length: u64) -> ExportedBuffer {
        ExportedBuffer {
            kind,
            offset,
            length,
            allocation: None,
        }
    }

    /// An array of an import document, without nulls or children.
    pub(crate) fn array(
        data_type: DataType,
        length: u64,
        buffers: Vec<ExportedBuffer>,
    ) -> ExportedArray {
        ExportedArray {
            data_type,
            length,
            null_count: 0,
            buffers,
            children: vec![],
            dictionary: None,
        }
    }

    fn column(array: ExportedArray) -> ExportedColumn {
        ExportedColumn {
            handle: [7; 64],
            allocation_bytes: 1 << 20,
            array,
        }
    }

    fn check(fields: Vec<Field>, rows: u64, columns: &mut [ExportedColumn]) -> Result<(), String> {
        check_columns(&Schema::new(fields), rows, columns).map_err(|e| e.to_string())
    }

    #[test]
    fn well_formed_columns_pass_and_padded_buffers_are_trimmed() {
        let mut ints = column(array(
            DataType::Int64,
            10,
            vec![
                buffer(BufferKind::Validity, 0, 64),
                buffer(BufferKind::Values, 64, 128),
            ],
        ));
        ints.array.null_count = 3;
        let strings = column(array(
            DataType::Utf8,
            2,
            vec![
                buffer(BufferKind::Offsets, 0, 12),
                buffer(BufferKind::Values, 64, 5),
            ],
        ));
        let mut list = column(array(
            DataType::List(Arc::new(Field::new("item", DataType::Int32, true))),
            2,
            vec![buffer(BufferKind::Offsets, 0, 12)],
        ));
        list.array.children = vec![array(
            DataType::Int32,
            3,
            vec![buffer(BufferKind::Values, 64, 12)],
        )];
        let mut dictionary = column(array(
            DataType::Dictionary(Box::new(DataType::Int16), Box::new(DataType::Utf8)),
            4,
            vec![buffer(BufferKind::Values, 0, 8)],
        ));
        dictionary.array.dictionary = Some(Box::new(array(
            DataType::Utf8,
            1,
            vec![
                buffer(BufferKind::Offsets, 64, 8),
                buffer(BufferKind::Values, 128, 1),
            ],
        )));
        let mut columns = [ints, strings, list, dictionary];
        let fields = columns
            .iter()
            .enumerate()
            .map(|(i, c)| Field::new(format!("c{i}"), c.array.data_type.clone(), true))
            .collect();
        let rows = [10, 2, 2, 4];
        // Each column checked alone, with its own row count.
        let fields: Vec<Field> = fields;
        for (index, rows) in rows.into_iter().enumerate() {
            let mut one = vec![columns[index].clone()];
            check(vec![fields[index].clone()], rows, &mut one).expect("well formed");
            columns[index] = one.remove(0);
        }
        assert_eq!(columns[0].array.buffers[0].length, 2, "10 bits in 2 bytes");
        assert_eq!(columns[0].array.buffers[1].length, 80, "10 int64s");
        assert_eq!(
            columns[1].array.buffers[1].length, 5,
            "string bytes as declared"
        );
    }

    #[test]
    fn forged_numbers_are_refused_with_what_is_wrong() {
        let field = |t: DataType| vec![Field::new("c", t, true)];
        let ints = |buffers| column(array(DataType::Int64, 10, buffers));
        let cases: Vec<(Vec<Field>, u64, ExportedColumn, &str)> = vec![
            (
                field(DataType::Int64),
                10,
                ints(vec![buffer(BufferKind::Values, 0, 79)]),
                "need 80",
            ),
            (
                field(DataType::Int64),
                10,
                ints(vec![buffer(BufferKind::Values, (1 << 20) - 8, 80)]),
                "outside the allocation",
            ),
            (
                field(DataType::Int64),
                10,
                ints(vec![buffer(BufferKind::Values, u64::MAX, 80)]),
                "outside the allocation",
            ),
            (
                field(DataType::Int64),
                11,
                ints(vec![buffer(BufferKind::Values, 0, 80)]),
                "11 are expected",
            ),
            (
                field(DataType::Int64),
                10,
                ints(vec![
                    buffer(BufferKind::Values, 0, 80),
                    buffer(BufferKind::Values, 0, 80),
                ]),
                "has the buffers [values]",
            ),
            (
                field(DataType::Int64),
                10,
                ints(vec![buffer(BufferKind::Offsets, 0, 88)]),
                "not [offsets]",
            ),
            (
                field(DataType::Utf8),
                10,
                ints(vec![buffer(BufferKind::Values, 0, 80)]),
                "schema says Utf8",
            ),
            (
                field(DataType::Int64),
                10,
                {
                    let mut c = ints(vec![buffer(BufferKind::Values, 0, 80)]);
                    c.array.null_count = 1;
                    c
                },
                "no validity bitmap",
            ),
            (
                field(DataType::Int64),
                10,
                {
                    let mut c = ints(vec![buffer(BufferKind::Values, 0, 80)]);
                    c.array.children = vec![array(DataType::Int64, 10, vec![])];
                    c
                },
                "children",
            ),
            (
                field(DataType::Int64),
                u64::MAX,
                column(array(
                    DataType::Int64,
                    u64::MAX,
                    vec![buffer(BufferKind::Values, 0, 8)],
                )),
                "overflow",
            ),
            (
                vec![Field::new(
                    "c",
                    DataType::Union(
                        arrow::datatypes::UnionFields::empty(),
                        arrow::datatypes::UnionMode::Sparse,
                    ),
                    true,
                )],
                0,
                column(array(
                    DataType::Union(
                        arrow::datatypes::UnionFields::empty(),
                        arrow::datatypes::UnionMode::Sparse,
                    ),
                    0,
                    vec![],
                )),
                "cannot be stored",
            ),
            // Offsets for as many rows as a usize holds: len * 4 fits, len * 4 + 4 does not.
            (
                field(DataType::Utf8),
                (usize::MAX / 4) as u64,
                column(array(
                    DataType::Utf8,
                    (usize::MAX / 4) as u64,
                    vec![
                        buffer(BufferKind::Offsets, 0, 8),
                        buffer(BufferKind::Values, 0, 0),
                    ],
                )),
                "overflow",
            ),
        ];
        for (fields, rows, column, expected) in cases {
            let mut columns = vec![column];
            let error = check(fields, rows, &mut columns).expect_err(expected);
            assert!(error.contains(expected), "{expected}: {error}");
        }
        let error = check(vec![], 0, &mut [column(array(DataType::Null, 0, vec![]))])
            .expect_err("more columns than fields");
        assert!(error.contains("0 fields"), "{error}");
    }

    #[test]
    fn nesting_and_width_are_bounded() {
        let mut data_type = DataType::Int32;
        let mut described = array(DataType::Int32, 0, vec![buffer(BufferKind::Values, 0, 0)]);
        for _ in 0..=MAX_IMPORT_DEPTH {
            let field = Arc::new(Field::new("s", data_type.clone(), true));
            data_type = DataType::Struct(vec![field].into());
            let mut parent = array(data_type.clone(), 0, vec![]);
            parent.children = vec![described];
            described = parent;
        }
        let error = check(
            vec![Field::new("c", data_type, true)],
            0,
            &mut [column(described)],
        )
        .expect_err("too deep");
        assert!(error.contains("nest"), "{error}");
    }
}
