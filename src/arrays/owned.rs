//! Copies of decoded arrays in buffers of their own, sized to what the arrays use.
//!
//! Arrays decoded from a Flight message point into that message's body, so keeping any of them
//! keeps the whole body: bytes after the last buffer, buffers longer than their rows need,
//! whatever else the client sent alongside. A backend that keeps host arrays keeps copies made
//! here instead, so the memory it holds is what the budget charged for, unless the batch's
//! allocations hold nothing else ([`batch_owns_its_allocations`]).

use std::collections::HashMap;

use arrow::array::{Array, ArrayData, BinaryViewArray, MutableArrayData, StringViewArray};
use arrow::datatypes::DataType;
use arrow::error::ArrowError;
use arrow::record_batch::RecordBatch;

use crate::arrays::{array_bytes, batch_bytes};

/// Bytes an allocation may hold beyond what its array uses and still count as the array's own:
/// Arrow rounds allocations up to 64 bytes, and the IPC format pads buffers to 8.
const ROUNDING_SLACK: u64 = 64;

/// Whether `data` can be kept as it is: every buffer (children and dictionaries included) is an
/// allocation of its own, not a slice of something larger such as the message body, and the
/// allocations hold no more than the array's rows use, give or take rounding. That is how
/// Arrow's IPC decoder leaves the buffers it realigns; a client's oversized buffers fail the
/// second test. Views never pass: their data buffers may hold bytes no view points at.
pub(crate) fn owns_its_buffers(data: &ArrayData) -> bool {
    fn allocations(data: &ArrayData, total: &mut u64, count: &mut u64) -> bool {
        if matches!(data.data_type(), DataType::Utf8View | DataType::BinaryView) {
            return false;
        }
        let nulls = data.nulls().map(|n| n.buffer());
        for buffer in data.buffers().iter().chain(nulls) {
            // A slice; or, capacity zero, memory Arrow does not own. (A `Buffer` over
            // `bytes::Bytes` reports its length as its capacity, so this test cannot see what
            // else a message holds: the decoder copies arrays decoded in place from a message
            // unless their body came alone and holds only them.)
            if buffer.capacity() == 0 || buffer.ptr_offset() != 0 {
                return false;
            }
            *total += buffer.capacity() as u64;
            *count += 1;
        }
        data.child_data()
            .iter()
            .all(|child| allocations(child, total, count))
    }
    let (mut total, mut count) = (0, 0);
    allocations(data, &mut total, &mut count) && total <= array_bytes(data) + count * ROUNDING_SLACK
}

/// Whether `batch` can be kept as it is, its arrays sharing allocations: every buffer (children
/// and dictionaries included) lies in allocations that together hold no more than the batch's
/// arrays use, give or take rounding. That is how `DoPut` leaves a record batch decoded in place
/// from a body read into an allocation of its own (`flight::put_stream`), which holds its
/// columns one after another. Views never pass, as in [`owns_its_buffers`].
pub(crate) fn batch_owns_its_allocations(batch: &RecordBatch) -> bool {
    fn allocations(data: &ArrayData, seen: &mut HashMap<usize, usize>, count: &mut u64) -> bool {
        if matches!(data.data_type(), DataType::Utf8View | DataType::BinaryView) {
            return false;
        }
        let nulls = data.nulls().map(|n| n.buffer());
        for buffer in data.buffers().iter().chain(nulls) {
            if buffer.capacity() == 0 {
                return false;
            }
            // A slice starts `ptr_offset` bytes into its allocation.
            let start = (buffer.as_ptr() as usize).wrapping_sub(buffer.ptr_offset());
            seen.insert(start, buffer.capacity());
            *count += 1;
        }
        data.child_data()
            .iter()
            .all(|child| allocations(child, seen, count))
    }
    let (mut seen, mut count) = (HashMap::new(), 0u64);
    let all = batch
        .columns()
        .iter()
        .all(|column| allocations(&column.to_data(), &mut seen, &mut count));
    let held: u64 = seen.values().map(|&capacity| capacity as u64).sum();
    all && held <= batch_bytes(batch) + (count + 1) * ROUNDING_SLACK
}

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

    use arrow::array::{ArrayRef, DictionaryArray, Int64Array, ListArray, StringArray, make_array};
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
    fn only_tight_allocations_of_their_own_are_kept() {
        let fresh = Int64Array::from_iter_values(0..1000).to_data();
        assert!(owns_its_buffers(&fresh));
        // Builders keep spare capacity: not tight, so copied; the copy is tight.
        let built = StringArray::from(vec![Some("a"), None, Some("ccc")]).to_data();
        assert!(!owns_its_buffers(&built));
        assert!(owns_its_buffers(&owned(&built).expect("copy")));
        // A slice of a larger allocation, as arrays decoded in place from a message are.
        assert!(!owns_its_buffers(&fresh.slice(10, 5)));
        let body = Buffer::from_vec(vec![7u8; 1 << 20]);
        let part = ArrayData::builder(DataType::UInt8)
            .len(16)
            .add_buffer(body.slice(64))
            .build()
            .expect("array");
        assert!(!owns_its_buffers(&part));
        // An allocation of its own, but far larger than its rows: a client's padding.
        let oversized = ArrayData::builder(DataType::UInt8)
            .len(16)
            .add_buffer(body)
            .build()
            .expect("array");
        assert!(!owns_its_buffers(&oversized));
    }

    #[test]
    fn a_batch_may_share_an_allocation_that_holds_nothing_else() {
        // Two columns one after another in one allocation, as a body read whole holds them.
        let batch_in = |body: &Buffer| {
            let column = |at: usize| {
                make_array(
                    ArrayData::builder(DataType::Int64)
                        .len(1000)
                        .add_buffer(body.slice_with_length(at, 8000))
                        .build()
                        .expect("array"),
                )
            };
            RecordBatch::try_from_iter([("a", column(0)), ("b", column(8000))]).expect("batch")
        };
        let tight = Buffer::from_vec(vec![7u8; 16_000]);
        let batch = batch_in(&tight);
        assert!(batch_owns_its_allocations(&batch));
        assert!(
            batch
                .columns()
                .iter()
                .all(|c| !owns_its_buffers(&c.to_data())),
            "no column alone owns its buffer"
        );
        // The same columns in an allocation with room to spare, or half of them: not kept.
        let roomy = Buffer::from_vec(vec![7u8; 1 << 20]);
        assert!(!batch_owns_its_allocations(&batch_in(&roomy)));
        assert!(!batch_owns_its_allocations(
            &batch.project(&[0]).expect("one")
        ));
        // Views never.
        let views: ArrayRef = Arc::new(StringViewArray::from_iter_values(["a"; 10]));
        let views = RecordBatch::try_from_iter([("v", views)]).expect("batch");
        assert!(!batch_owns_its_allocations(&views));
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
