//! Large memory copies spread over the CPU's cores (rayon's pool).
//!
//! One core copies 5-10 GB/s into memory it has touched before and 2-4 GB/s into fresh pages
//! (the kernel clears each page on its first touch), while the links these copies feed or drain
//! move ~50 GB/s (pinned host-to-device copies): uploads, spills and restores need several
//! cores per copy to keep up. Small copies stay on the calling thread, where a hand-over would
//! cost more than the copy.

use arrow::array::ArrayData;
use arrow::buffer::{Buffer, MutableBuffer};
use arrow::error::ArrowError;
use rayon::prelude::*;

/// Copies are split into pieces of this many bytes, one core each; shorter ones are not split.
const PIECE_BYTES: usize = 2 << 20;

/// Copies every `(source, target)` pair (of equal lengths), the large ones split over the
/// cores.
///
/// # Panics
/// Where a pair's lengths differ: a caller's bug, never data's.
pub(crate) fn copy_all(pairs: Vec<(&[u8], &mut [u8])>) {
    let total: usize = pairs.iter().map(|(source, _)| source.len()).sum();
    if total < 2 * PIECE_BYTES {
        for (source, target) in pairs {
            target.copy_from_slice(source);
        }
        return;
    }
    let pieces: Vec<(&[u8], &mut [u8])> = pairs
        .into_iter()
        .flat_map(|(source, target)| {
            assert_eq!(source.len(), target.len(), "a copy between unequal ranges");
            source
                .chunks(PIECE_BYTES)
                .zip(target.chunks_mut(PIECE_BYTES))
        })
        .collect();
    pieces
        .into_par_iter()
        .for_each(|(source, target)| target.copy_from_slice(source));
}

/// A new buffer holding `source`'s bytes, copied by several cores where it is large.
pub(crate) fn copied_buffer(source: &[u8]) -> Buffer {
    if source.len() < 2 * PIECE_BYTES {
        return Buffer::from_slice_ref(source);
    }
    // Zeroed by the allocator without touching fresh pages: each core then faults in its own.
    let mut target = MutableBuffer::from_len_zeroed(source.len());
    copy_all(vec![(source, target.as_slice_mut())]);
    target.into()
}

/// Whether [`copied_array`] copies `data` as it is: fixed-width values and validity, nothing
/// whose checks would read every value again (strings, nested and dictionary arrays).
pub(crate) fn copies_as_is(data: &ArrayData) -> bool {
    let data_type = data.data_type();
    data.child_data().is_empty()
        && (data_type.is_primitive() || matches!(data_type, arrow::datatypes::DataType::Boolean))
}

/// `data`, fixed-width (see [`copies_as_is`]), in buffers of its own: each buffer copied as it
/// is, by several cores where it is large; offset, length and nulls kept.
pub(crate) fn copied_array(data: &ArrayData) -> Result<ArrayData, ArrowError> {
    let buffers = data.buffers().iter().map(|b| copied_buffer(b)).collect();
    let nulls = data.nulls().map(|nulls| {
        let bits = nulls.inner();
        let copy = copied_buffer(bits.inner().as_slice());
        arrow::buffer::NullBuffer::new(arrow::buffer::BooleanBuffer::new(
            copy,
            bits.offset(),
            bits.len(),
        ))
    });
    data.clone()
        .into_builder()
        .buffers(buffers)
        .nulls(nulls)
        .build()
}

#[cfg(test)]
mod tests {
    use arrow::array::{Array, BooleanArray, Int64Array};

    use super::*;

    #[test]
    fn every_pair_is_copied_whole_split_or_not() {
        let sizes = [
            0,
            1,
            7,
            PIECE_BYTES - 1,
            PIECE_BYTES,
            3 * PIECE_BYTES + 5,
            100,
        ];
        let sources: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| (0..n).map(|b| (b * 31 + i) as u8).collect())
            .collect();
        let mut targets: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0xAA; n]).collect();
        copy_all(
            sources
                .iter()
                .map(Vec::as_slice)
                .zip(targets.iter_mut().map(Vec::as_mut_slice))
                .collect(),
        );
        assert_eq!(sources, targets);
        // A few small pairs take the calling thread's path.
        let mut small = [0u8; 3];
        copy_all(vec![(&[1, 2, 3], &mut small)]);
        assert_eq!(small, [1, 2, 3]);
    }

    #[test]
    fn large_buffers_copy_to_new_memory() {
        let source: Vec<u8> = (0..5 * PIECE_BYTES + 3).map(|b| (b % 251) as u8).collect();
        let copy = copied_buffer(&source);
        assert_eq!(copy.as_slice(), source.as_slice());
        assert_ne!(copy.as_ptr(), source.as_ptr());
    }

    #[test]
    fn fixed_width_arrays_copy_with_their_offsets_and_nulls() {
        let big = Int64Array::from_iter((0..1_000_000).map(|i| (i % 7 != 0).then_some(i)));
        for array in [big.slice(0, 1_000_000), big.slice(13, 600_000)] {
            let data = array.to_data();
            assert!(copies_as_is(&data));
            let copy = copied_array(&data).expect("copy");
            assert_eq!(copy, data);
            assert_ne!(copy.buffers()[0].as_ptr(), data.buffers()[0].as_ptr());
        }
        let flags = BooleanArray::from_iter((0..100_000).map(|i| Some(i % 3 == 0)));
        let copy = copied_array(&flags.slice(5, 50_000).to_data()).expect("copy");
        assert_eq!(BooleanArray::from(copy), flags.slice(5, 50_000));
        let strings = arrow::array::StringArray::from(vec!["a"]);
        assert!(!copies_as_is(&strings.to_data()));
        assert_eq!(flags.null_count(), 0);
    }
}
