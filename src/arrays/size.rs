//! How many bytes of Arrow buffers a record batch really references.
//!
//! Arrow's own measures answer other questions: `get_buffer_memory_size` counts whole shared
//! buffers (a slice of a 1 GiB batch reports 1 GiB), and `get_slice_memory_size` counts the whole
//! child of a sliced list. Splitting `DoGet` replies to a message size and accounting memory both
//! need the bytes a slice would occupy if written out, which is what this module computes.

use arrow::array::ArrayData;
use arrow::datatypes::{DataType, Field, Schema};
use arrow::record_batch::RecordBatch;

/// Bytes the batch's columns occupy when written compactly (validity, offsets, values, children),
/// without alignment padding.
pub fn batch_bytes(batch: &RecordBatch) -> u64 {
    batch
        .columns()
        .iter()
        .map(|column| array_bytes(&column.to_data()))
        .sum()
}

/// Bytes one array occupies when written compactly; see [`batch_bytes`].
pub fn array_bytes(data: &ArrayData) -> u64 {
    let len = data.len();
    let validity = if data.nulls().is_some() {
        len.div_ceil(8) as u64
    } else {
        0
    };
    let nested = match data.data_type() {
        DataType::List(_) | DataType::Map(_, _) => Some(list_bytes::<i32>(data)),
        DataType::LargeList(_) => Some(list_bytes::<i64>(data)),
        DataType::FixedSizeList(_, size) => {
            let size = usize::try_from(*size).unwrap_or(0);
            let child = &data.child_data()[0];
            Some(array_bytes(&child.slice(data.offset() * size, len * size)))
        }
        DataType::Struct(_) => Some(
            data.child_data()
                .iter()
                .map(|child| array_bytes(&child.slice(data.offset(), len)))
                .sum(),
        ),
        // Views: 16 bytes each, plus the bytes of the values too long to be inline. Arrow's own
        // measure counts every data buffer a slice can reach, whole.
        DataType::Utf8View | DataType::BinaryView => {
            let start = data.offset() * 16;
            let views = data
                .buffers()
                .first()
                .and_then(|views| views.as_slice().get(start..start + len * 16))
                .unwrap_or_default();
            let out_of_line: u64 = views
                .chunks_exact(16)
                .map(|view| u32::from_le_bytes([view[0], view[1], view[2], view[3]]))
                .filter(|&length| length > 12)
                .map(u64::from)
                .sum();
            Some(16 * len as u64 + out_of_line)
        }
        DataType::Dictionary(key_type, _) => {
            let keys = (len * key_type.primitive_width().unwrap_or(8)) as u64;
            let values: u64 = data.child_data().iter().map(array_bytes).sum();
            Some(keys + values)
        }
        _ => None,
    };
    match nested {
        Some(bytes) => validity + bytes,
        // Leaf layouts (and the rare nested ones handled above only approximately, such as
        // unions) are measured by Arrow itself, which is exact for them.
        None => data
            .get_slice_memory_size()
            .map(|b| b as u64)
            .unwrap_or_else(|_| data.get_buffer_memory_size() as u64),
    }
}

/// Arrays in the batch, children included: each costs its headers (`ArrayData`, buffers,
/// `Arc`s) whatever its length.
pub fn array_count(batch: &RecordBatch) -> u64 {
    fn count(data: &ArrayData) -> u64 {
        1 + data.child_data().iter().map(count).sum::<u64>()
    }
    batch.columns().iter().map(|c| count(&c.to_data())).sum()
}

/// The arrays a column of `data_type` is, as [`array_count`] counts them: itself, and its
/// children's and a dictionary's values, recursively. Known from the type alone, before any
/// array exists.
pub fn type_array_count(data_type: &DataType) -> u64 {
    let children: u64 = match data_type {
        DataType::List(child)
        | DataType::LargeList(child)
        | DataType::ListView(child)
        | DataType::LargeListView(child)
        | DataType::FixedSizeList(child, _)
        | DataType::Map(child, _) => type_array_count(child.data_type()),
        DataType::Struct(fields) => fields.iter().map(|f| type_array_count(f.data_type())).sum(),
        DataType::Union(fields, _) => fields
            .iter()
            .map(|(_, f)| type_array_count(f.data_type()))
            .sum(),
        DataType::Dictionary(_, values) => type_array_count(values),
        DataType::RunEndEncoded(run_ends, values) => {
            type_array_count(run_ends.data_type()) + type_array_count(values.data_type())
        }
        _ => 0,
    };
    1 + children
}

/// Bytes a schema holds in memory, approximately: names, metadata and a fixed cost per field.
/// Clients choose all of it (64 MiB of metadata is a valid schema), so the store charges it.
pub fn schema_bytes(schema: &Schema) -> u64 {
    /// A `Field` and its `DataType` on the heap, beyond the bytes of its strings.
    const FIELD_OVERHEAD: u64 = 128;
    fn metadata_bytes(metadata: &arrow::datatypes::Metadata) -> u64 {
        metadata
            .iter()
            .map(|(key, value)| (key.len() + value.len()) as u64 + 2 * 24)
            .sum()
    }
    fn field_bytes(field: &Field) -> u64 {
        let children: u64 = match field.data_type() {
            DataType::List(child)
            | DataType::LargeList(child)
            | DataType::ListView(child)
            | DataType::LargeListView(child)
            | DataType::FixedSizeList(child, _)
            | DataType::Map(child, _) => field_bytes(child),
            DataType::Struct(fields) => fields.iter().map(|f| field_bytes(f)).sum(),
            DataType::Union(fields, _) => fields.iter().map(|(_, f)| field_bytes(f)).sum(),
            DataType::RunEndEncoded(ends, values) => field_bytes(ends) + field_bytes(values),
            DataType::Timestamp(_, Some(zone)) => zone.len() as u64,
            _ => 0,
        };
        FIELD_OVERHEAD + field.name().len() as u64 + metadata_bytes(field.metadata()) + children
    }
    /// The dataset itself: its catalog entry, name and bookkeeping.
    const DATASET_OVERHEAD: u64 = 1024;
    DATASET_OVERHEAD
        + metadata_bytes(schema.metadata())
        + schema.fields().iter().map(|f| field_bytes(f)).sum::<u64>()
}

fn list_bytes<O: arrow::array::OffsetSizeTrait>(data: &ArrayData) -> u64 {
    let len = data.len();
    // `ArrayData::buffer` already starts at the array's offset.
    let offsets = &data.buffer::<O>(0)[..=len];
    let start = offsets[0].as_usize();
    let end = offsets[len].as_usize();
    let own = ((len + 1) * std::mem::size_of::<O>()) as u64;
    own + array_bytes(&data.child_data()[0].slice(start, end - start))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{Array, Int64Array, ListArray, StringArray};
    use arrow::datatypes::Int64Type;

    use super::*;

    #[test]
    fn arrays_counted_from_types_match_those_counted_from_data() {
        use arrow::array::{ArrayRef, DictionaryArray, StructArray};
        use arrow::datatypes::Int32Type;
        let list: ArrayRef = Arc::new(ListArray::from_iter_primitive::<Int64Type, _, _>(
            (0..5).map(|i| Some(vec![Some(i); 2])),
        ));
        let words: DictionaryArray<Int32Type> = ["a", "b", "a", "c", "b"].into_iter().collect();
        let nested: ArrayRef = Arc::new(StructArray::from(vec![
            (
                Arc::new(Field::new("n", DataType::Int64, false)),
                Arc::new(Int64Array::from_iter_values(0..5)) as ArrayRef,
            ),
            (
                Arc::new(Field::new("w", words.data_type().clone(), false)),
                Arc::new(words) as ArrayRef,
            ),
            (
                Arc::new(Field::new("l", list.data_type().clone(), true)),
                Arc::clone(&list),
            ),
        ]));
        let strings: ArrayRef = Arc::new(StringArray::from(vec!["x"; 5]));
        let batch = RecordBatch::try_from_iter([("l", list), ("s", nested), ("t", strings)])
            .expect("batch");
        let from_types: u64 = batch
            .schema()
            .fields()
            .iter()
            .map(|f| type_array_count(f.data_type()))
            .sum();
        assert_eq!(from_types, array_count(&batch));
    }

    #[test]
    fn sliced_primitive_counts_only_the_slice() {
        let array = Int64Array::from_iter_values(0..1000);
        assert_eq!(array_bytes(&array.to_data()), 8000);
        assert_eq!(array_bytes(&array.slice(10, 20).to_data()), 160);
    }

    #[test]
    fn sliced_strings_count_their_own_characters() {
        let array = StringArray::from(vec![Some("a"), None, Some("bbbb"), Some("cc")]);
        // 5 offsets of 4 bytes, 7 characters, 1 validity byte.
        assert_eq!(array_bytes(&array.to_data()), 20 + 7 + 1);
        let slice = array.slice(1, 2);
        assert_eq!(array_bytes(&slice.to_data()), 12 + 4 + 1);
    }

    #[test]
    fn sliced_list_counts_only_its_child_range() {
        let list = ListArray::from_iter_primitive::<Int64Type, _, _>(
            (0..100).map(|i| Some(vec![Some(i); 10])),
        );
        let whole = array_bytes(&list.to_data());
        assert_eq!(whole, 101 * 4 + 1000 * 8);
        let slice: Arc<dyn Array> = Arc::new(list.slice(50, 2));
        assert_eq!(array_bytes(&slice.to_data()), 3 * 4 + 20 * 8);
        // Sliced as `ArrayData` (as the children of nested lists are), the offset lives in the
        // data and must be applied once: twice read past the end.
        assert_eq!(array_bytes(&list.to_data().slice(60, 40)), 41 * 4 + 400 * 8);
        let lengths = ListArray::from_iter_primitive::<Int64Type, _, _>(
            (0..10).map(|i| Some(vec![Some(i); i as usize])),
        );
        assert_eq!(array_bytes(&lengths.to_data().slice(9, 1)), 2 * 4 + 9 * 8);
    }
}
