//! How much of a `DoGet` message the Arrow body may take ([`body_budget`]), and read chunks
//! sized to whole messages of it ([`whole_messages`]): the read's planning (`read`) and the
//! encoder that splits its chunks (`doget`) must agree on both.

use arrow::datatypes::{DataType, Field, SchemaRef};

/// Smallest body budget: below this, headers dominate and splitting further helps nobody.
const MIN_BODY_BYTES: usize = 16 * 1024;

/// The part of a message left for the body once the IPC header, flatbuffer field nodes and
/// buffer alignment padding (64 bytes per buffer at most) are paid for.
pub(crate) fn body_budget(schema: &SchemaRef, max_message_bytes: usize) -> usize {
    let nodes: usize = schema.fields().iter().map(|f| count_nodes(f)).sum();
    let overhead = 1024 + nodes * (16 + 3 * (16 + 64));
    max_message_bytes
        .saturating_sub(overhead)
        .max(MIN_BODY_BYTES)
}

fn count_nodes(field: &Field) -> usize {
    1 + match field.data_type() {
        DataType::List(child)
        | DataType::LargeList(child)
        | DataType::FixedSizeList(child, _)
        | DataType::Map(child, _)
        | DataType::ListView(child)
        | DataType::LargeListView(child) => count_nodes(child),
        DataType::Struct(fields) => fields.iter().map(|f| count_nodes(f)).sum(),
        DataType::Union(fields, _) => fields.iter().map(|(_, f)| count_nodes(f)).sum(),
        DataType::Dictionary(_, value) => {
            count_nodes(&Field::new("", value.as_ref().clone(), true))
        }
        DataType::RunEndEncoded(ends, values) => count_nodes(ends) + count_nodes(values),
        _ => 0,
    }
}

/// `chunk_bytes` (what a read copies at a time) rounded down to a whole number of messages of
/// `budget` body bytes, each less a 64th. A chunk is split into equal pieces, as few as fit
/// `budget`: 16 MiB against a budget just under 4 MiB went as five messages of 3.2 MiB where
/// four of 3.9 would do, and clients pay per message as well as per byte. The margin absorbs
/// chunks of variable-length rows, which are sized by their partition's mean row. A chunk
/// already within one message is left as it is.
pub(crate) fn whole_messages(chunk_bytes: u64, budget: usize) -> u64 {
    let budget = budget.max(1) as u64;
    if chunk_bytes <= budget {
        return chunk_bytes;
    }
    (chunk_bytes / budget) * (budget - budget / 64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_whole_numbers_of_messages() {
        let budget = 4_125_696;
        // Four messages nearly full, not five of 3.2 MiB.
        let chunk = whole_messages(16 << 20, budget);
        assert_eq!(chunk, 4 * (budget as u64 - budget as u64 / 64));
        assert_eq!(chunk.div_ceil(budget as u64), 4);
        // Rows 1.5% larger than the mean still fit the four.
        assert_eq!((chunk + chunk * 3 / 200).div_ceil(budget as u64), 4);
        // Exactly whole already: still a 64th under each, for variable-length rows.
        assert_eq!(
            whole_messages(2 * budget as u64, budget),
            2 * (4_125_696 - 64_464)
        );
        // A chunk within one message is left as it is.
        assert_eq!(whole_messages(1 << 20, budget), 1 << 20);
        assert_eq!(whole_messages(budget as u64, budget), budget as u64);
    }
}
