//! Copies of decoded arrays in buffers of their own, sized to what the arrays use.
//!
//! Arrays decoded from a Flight message point into that message's body, so keeping any of them
//! keeps the whole body: bytes after the last buffer, buffers longer than their rows need,
//! whatever else the client sent alongside. A backend that keeps host arrays keeps copies made
//! here instead, so the memory it holds is what the budget charged for.

use arrow::array::{Array, ArrayData, BinaryViewArray, MutableArrayData, StringViewArray};
use arrow::datatypes::DataType;
use arrow::error::ArrowError;

/// `data` copied into fresh buffers holding exactly its rows (rounded up to Arrow's 64-byte
/// allocation granularity), dictionaries and view data included.
pub(crate) fn owned(data: &ArrayData) -> Result<ArrayData, ArrowError> {
    let mut copy = MutableArrayData::new(vec![data], false, data.len());
    copy.try_extend(0, 0, data.len())?;
    own_shared(copy.freeze())
}

/// `data` with the data buffers of its string and binary views holding only what its views
/// point at.
pub(crate) fn compact_views(data: ArrayData) -> ArrayData {
    match data.data_type() {
        DataType::Utf8View => StringViewArray::from(data).gc().into_data(),
        DataType::BinaryView => BinaryViewArray::from(data).gc().into_data(),
        _ => data,
    }
}

/// `MutableArrayData` copies keys and views but shares the dictionary and the view data
/// buffers of its single input; copy those too, at any depth.
fn own_shared(data: ArrayData) -> Result<ArrayData, ArrowError> {
    let data = compact_views(data);
    let is_dictionary = matches!(data.data_type(), DataType::Dictionary(_, _));
    if data.child_data().is_empty() {
        return Ok(data);
    }
    let children = data
        .child_data()
        .iter()
        .map(|child| {
            if is_dictionary {
                owned(child)
            } else {
                own_shared(child.clone())
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    data.into_builder().child_data(children).build()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{ArrayRef, DictionaryArray, Int64Array, ListArray, StringArray};
    use arrow::buffer::Buffer;
    use arrow::datatypes::{Int32Type, Int64Type};

    use super::*;

    #[test]
    fn a_slice_of_a_large_buffer_is_copied_to_its_own_size() {
        let big = Int64Array::from_iter_values(0..1_000_000);
        let one = big.slice(500, 1).to_data();
        let copy = owned(&one).expect("copy");
        assert_eq!(
            copy.buffers()[0].capacity(),
            64,
            "8 bytes, one allocation unit"
        );
        assert_eq!(Int64Array::from(copy).value(0), 500);
    }

    #[test]
    fn dictionaries_are_copied_at_any_depth() {
        let values: ArrayRef = Arc::new(StringArray::from(vec!["a", "b", "c"]));
        let keys = arrow::array::Int32Array::from(vec![0, 2, 1]);
        let dictionary =
            DictionaryArray::<Int32Type>::try_new(keys, Arc::clone(&values)).expect("dictionary");
        let copy = owned(&dictionary.to_data()).expect("copy");
        let original = values.to_data().buffers()[1].as_ptr();
        assert_ne!(copy.child_data()[0].buffers()[1].as_ptr(), original);
        assert_eq!(copy, dictionary.to_data());

        let list = ListArray::from_iter_primitive::<Int64Type, _, _>(vec![Some(vec![Some(1)])]);
        assert_eq!(owned(&list.to_data()).expect("copy"), list.to_data());
    }

    #[test]
    fn view_data_is_copied_down_to_what_the_views_use() {
        let long = "x".repeat(100);
        let array = StringViewArray::from_iter_values([long.as_str(); 1000]);
        let one = array.slice(10, 1).to_data();
        let copy = owned(&one).expect("copy");
        let data_bytes: usize = copy.buffers()[1..].iter().map(|b| b.capacity()).sum();
        assert!(
            data_bytes < 1024,
            "{data_bytes} bytes of view data kept for one string"
        );
        assert_eq!(StringViewArray::from(copy).value(0), long);
    }

    #[test]
    fn trailing_bytes_are_not_kept() {
        let body = Buffer::from_vec(vec![7u8; 1 << 20]);
        let data = ArrayData::builder(DataType::UInt8)
            .len(16)
            .add_buffer(body)
            .build()
            .expect("array");
        let copy = owned(&data).expect("copy");
        assert!(copy.buffers()[0].capacity() < 1024);
    }
}
