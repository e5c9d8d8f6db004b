//! Merging the dictionaries of many batches of one dictionary column, for concatenation.
//!
//! Batches of a dictionary column each carry their own dictionary. Appending the dictionaries
//! one after another (what a plain buffer concatenation does) repeats values, and consumers
//! break on that: pandas refuses a `Categorical` whose categories repeat. So both backends
//! concatenate dictionary columns the same way: the result's dictionary holds every distinct
//! value of the inputs' dictionaries once, in order of first appearance (first dictionary
//! first), and each batch's keys are mapped to it. All values count, referenced or not, so the
//! merge needs only the dictionaries, never the keys: the CUDA backend merges on the host from
//! its host copies of the (small) dictionaries and maps the keys on the device.
//!
//! A key is mapped through `map[key]`; a key outside its dictionary (possible only under a
//! null) becomes 0. The host and CUDA backends produce identical bytes.

use std::collections::HashMap;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, ArrowPrimitiveType, DictionaryArray, PrimitiveArray};
use arrow::buffer::ScalarBuffer;
use arrow::compute::interleave;
use arrow::datatypes::{
    ArrowDictionaryKeyType, ArrowNativeType, DataType, Int8Type, Int16Type, Int32Type, Int64Type,
    UInt8Type, UInt16Type, UInt32Type, UInt64Type,
};
use arrow::row::{RowConverter, SortField};

use super::BackendError;

/// The merged dictionary of a column, and how each input's keys map into it.
#[derive(Debug)]
pub(crate) struct MergedDictionary {
    pub(crate) values: ArrayRef,
    /// `key_maps[i][k]` is the new key of value `k` of input dictionary `i`.
    pub(crate) key_maps: Vec<Vec<u64>>,
}

impl MergedDictionary {
    /// Whether input `index`'s keys stay as they are.
    pub(crate) fn keeps_keys(&self, index: usize) -> bool {
        self.key_maps[index]
            .iter()
            .enumerate()
            .all(|(old, &new)| old as u64 == new)
    }
}

/// Merges `dictionaries` (the values of one column's batches) for keys of type `key_type`.
/// Fails with `CannotCompact` when the merged dictionary has more values than the keys
/// can index.
pub(crate) fn merge(
    dictionaries: &[ArrayRef],
    key_type: &DataType,
) -> Result<MergedDictionary, BackendError> {
    let first = dictionaries
        .first()
        .ok_or_else(|| BackendError::Device("no dictionaries to merge".to_owned()))?;
    let cannot = |reason: String| BackendError::CannotCompact { reason };
    let converter =
        RowConverter::new(vec![SortField::new(first.data_type().clone())]).map_err(|e| {
            cannot(format!(
                "dictionary values of type {}: {e}",
                first.data_type()
            ))
        })?;
    let rows = dictionaries
        .iter()
        .map(|values| converter.convert_columns(std::slice::from_ref(values)))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| cannot(format!("comparing dictionary values: {e}")))?;

    let capacity = dictionaries.iter().map(|d| d.len()).sum();
    let mut positions = HashMap::with_capacity(capacity);
    let mut picks: Vec<(usize, usize)> = Vec::with_capacity(capacity);
    let key_maps = rows
        .iter()
        .enumerate()
        .map(|(input, rows)| {
            rows.iter()
                .enumerate()
                .map(|(value, row)| {
                    *positions.entry(row).or_insert_with(|| {
                        picks.push((input, value));
                        picks.len() as u64 - 1
                    })
                })
                .collect()
        })
        .collect();

    let limit = max_key(key_type)
        .ok_or_else(|| cannot(format!("{key_type} is not a dictionary key type")))?;
    if picks.len() > limit.saturating_add(1) {
        return Err(cannot(format!(
            "the batches' dictionaries hold {} distinct values, more than {key_type} keys can index",
            picks.len()
        )));
    }
    let inputs: Vec<&dyn Array> = dictionaries.iter().map(|d| d.as_ref()).collect();
    let values = interleave(&inputs, &picks)
        .map_err(|e| cannot(format!("building the merged dictionary: {e}")))?;
    Ok(MergedDictionary { values, key_maps })
}

/// The largest key value of a dictionary key type.
fn max_key(key_type: &DataType) -> Option<usize> {
    let max = match key_type {
        DataType::Int8 => i8::MAX as usize,
        DataType::Int16 => i16::MAX as usize,
        DataType::Int32 => i32::MAX as usize,
        DataType::Int64 => i64::MAX as usize,
        DataType::UInt8 => u8::MAX as usize,
        DataType::UInt16 => u16::MAX as usize,
        DataType::UInt32 => u32::MAX as usize,
        DataType::UInt64 => usize::MAX,
        _ => return None,
    };
    Some(max)
}

/// Concatenates dictionary arrays (one column's batches) on the host: merged dictionary,
/// keys mapped into it.
pub(crate) fn concat_on_host(arrays: &[&dyn Array]) -> Result<ArrayRef, BackendError> {
    let first = arrays
        .first()
        .ok_or_else(|| BackendError::Device("nothing to concatenate".to_owned()))?;
    match first.data_type() {
        DataType::Dictionary(key, _) => match key.as_ref() {
            DataType::Int8 => concat_typed::<Int8Type>(arrays),
            DataType::Int16 => concat_typed::<Int16Type>(arrays),
            DataType::Int32 => concat_typed::<Int32Type>(arrays),
            DataType::Int64 => concat_typed::<Int64Type>(arrays),
            DataType::UInt8 => concat_typed::<UInt8Type>(arrays),
            DataType::UInt16 => concat_typed::<UInt16Type>(arrays),
            DataType::UInt32 => concat_typed::<UInt32Type>(arrays),
            DataType::UInt64 => concat_typed::<UInt64Type>(arrays),
            other => Err(BackendError::Device(format!(
                "{other} is not a dictionary key type"
            ))),
        },
        other => Err(BackendError::Device(format!(
            "{other} is not a dictionary type"
        ))),
    }
}

fn concat_typed<K: ArrowDictionaryKeyType>(
    arrays: &[&dyn Array],
) -> Result<ArrayRef, BackendError> {
    let typed: Vec<&DictionaryArray<K>> = arrays
        .iter()
        .map(|a| {
            a.as_any()
                .downcast_ref::<DictionaryArray<K>>()
                .ok_or_else(|| BackendError::Device("batches of mixed key types".to_owned()))
        })
        .collect::<Result<_, _>>()?;
    let dictionaries: Vec<ArrayRef> = typed.iter().map(|d| Arc::clone(d.values())).collect();
    let merged = merge(&dictionaries, &K::DATA_TYPE)?;
    let mapped: Vec<PrimitiveArray<K>> = typed
        .iter()
        .zip(&merged.key_maps)
        .map(|(array, map)| map_keys(array.keys(), map))
        .collect();
    let parts: Vec<&dyn Array> = mapped.iter().map(|k| k as &dyn Array).collect();
    let keys = arrow::compute::concat(&parts)
        .map_err(|e| BackendError::Device(format!("concatenating dictionary keys: {e}")))?;
    let keys = keys
        .as_any()
        .downcast_ref::<PrimitiveArray<K>>()
        .ok_or_else(|| BackendError::Device("concatenated keys changed type".to_owned()))?
        .clone();
    let array = DictionaryArray::<K>::try_new(keys, merged.values).map_err(|e| {
        BackendError::Device(format!("building the concatenated dictionary array: {e}"))
    })?;
    Ok(Arc::new(array))
}

/// `keys` mapped through `map`; keys outside the map (only possible under nulls) become 0.
fn map_keys<K: ArrowPrimitiveType>(keys: &PrimitiveArray<K>, map: &[u64]) -> PrimitiveArray<K> {
    let values: ScalarBuffer<K::Native> = keys
        .values()
        .iter()
        .map(|key| {
            map.get(key.as_usize())
                .and_then(|&new| K::Native::from_usize(new as usize))
                .unwrap_or_default()
        })
        .collect();
    PrimitiveArray::new(values, keys.nulls().cloned())
}

#[cfg(test)]
mod tests {
    use arrow::array::{AsArray, Int8Array, StringArray};

    use super::*;

    fn strings(values: &[Option<&str>]) -> ArrayRef {
        Arc::new(StringArray::from(values.to_vec()))
    }

    #[test]
    fn merged_dictionaries_hold_each_value_once_in_order_of_first_appearance() {
        let merged = merge(
            &[
                strings(&[Some("b"), Some("a")]),
                strings(&[Some("c"), Some("a"), None]),
                strings(&[Some("b"), Some("a")]),
            ],
            &DataType::Int32,
        )
        .expect("merge");
        assert_eq!(
            merged.values.as_ref(),
            strings(&[Some("b"), Some("a"), Some("c"), None]).as_ref()
        );
        assert_eq!(merged.key_maps, vec![vec![0, 1], vec![2, 1, 3], vec![0, 1]]);
        assert!(merged.keeps_keys(0));
        assert!(!merged.keeps_keys(1));
        assert!(merged.keeps_keys(2));
    }

    #[test]
    fn a_merge_beyond_the_key_range_is_refused() {
        let many: ArrayRef = Arc::new(StringArray::from_iter_values(
            (0..100).map(|i| i.to_string()),
        ));
        let more: ArrayRef = Arc::new(StringArray::from_iter_values(
            (100..200).map(|i| i.to_string()),
        ));
        let error = merge(&[many, more], &DataType::Int8).expect_err("200 values, int8 keys");
        assert!(
            matches!(error, BackendError::CannotCompact { .. }),
            "{error}"
        );
    }

    #[test]
    fn host_concatenation_maps_keys_and_zeroes_keys_outside_the_dictionary() {
        let first = DictionaryArray::<Int8Type>::try_new(
            Int8Array::from(vec![Some(0), Some(1), None]),
            strings(&[Some("x"), Some("y")]),
        )
        .expect("first");
        // A null whose key points outside the dictionary, as some writers leave them.
        let keys = Int8Array::new(vec![1, 0, 57].into(), Some(vec![true, true, false].into()));
        let second = DictionaryArray::<Int8Type>::new(keys, strings(&[Some("z"), Some("x")]));
        let out = concat_on_host(&[&first, &second]).expect("concat");
        let out = out.as_dictionary::<Int8Type>();
        assert_eq!(
            out.values().as_ref(),
            strings(&[Some("x"), Some("y"), Some("z")]).as_ref()
        );
        assert_eq!(out.keys().values().to_vec(), vec![0, 1, 0, 0, 2, 0]);
        assert_eq!(out.null_count(), 2);
    }
}
