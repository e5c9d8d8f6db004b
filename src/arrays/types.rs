//! Questions about nested Arrow types, answered by one walk over every type a field contains.

use arrow::datatypes::DataType;

/// Whether `data_type`, or any type nested in it (list items, struct and union fields, map
/// entries, run-end encoded parts, dictionary values), satisfies `matches`.
pub fn contains(data_type: &DataType, matches: &impl Fn(&DataType) -> bool) -> bool {
    matches(data_type)
        || match data_type {
            DataType::List(child)
            | DataType::LargeList(child)
            | DataType::ListView(child)
            | DataType::LargeListView(child)
            | DataType::FixedSizeList(child, _)
            | DataType::Map(child, _) => contains(child.data_type(), matches),
            DataType::Struct(fields) => fields.iter().any(|f| contains(f.data_type(), matches)),
            DataType::Union(fields, _) => {
                fields.iter().any(|(_, f)| contains(f.data_type(), matches))
            }
            DataType::RunEndEncoded(ends, values) => {
                contains(ends.data_type(), matches) || contains(values.data_type(), matches)
            }
            DataType::Dictionary(_, values) => contains(values, matches),
            _ => false,
        }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::datatypes::{Field, UnionFields};

    use super::*;

    #[test]
    fn finds_types_at_any_depth() {
        let is_union = |t: &DataType| matches!(t, DataType::Union(_, _));
        let union = DataType::Union(
            UnionFields::try_new([0], [Field::new("a", DataType::Int32, true)]).expect("fields"),
            arrow::datatypes::UnionMode::Sparse,
        );
        let nested = DataType::Struct(
            vec![Field::new(
                "l",
                DataType::List(Arc::new(Field::new("item", union, true))),
                true,
            )]
            .into(),
        );
        assert!(contains(&nested, &is_union));
        assert!(!contains(&DataType::Utf8, &is_union));
        let dictionary = DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8));
        assert!(contains(&dictionary, &|t| matches!(t, DataType::Utf8)));
    }
}
