//! How a record batch lies in device memory: the layout contract, and upload plans.
//!
//! **The layout (the contract `ipc-export` publishes).** Every array lies in one device
//! allocation: its validity bitmap (when it has nulls), then its own buffers (values; offsets
//! then bytes for strings and binary; offsets for lists; keys for dictionaries), then its
//! children depth first (list items, struct fields, a dictionary's values), each at a 64-byte
//! aligned offset; [`DeviceArray`] records where. Arrays start at row 0: bitmaps at bit 0,
//! offsets at 0, children hold exactly the rows their parent references. Allocations are
//! rounded up to 2 MiB, the driver's sub-allocation granularity: a CUDA IPC handle exposes the
//! whole underlying block, so rounding guarantees no block ever holds bytes of two datasets.
//!
//! An uploaded batch is one allocation holding all its columns in order; the staging buffer
//! has the same layout, so an upload is one host-to-device copy. Compaction (`concat`) lays
//! the compacted columns out the same way, in one allocation.
//!
//! Pure bookkeeping: nothing here touches the device, so it is unit-tested without one.
//! Reading rows back through this layout is `read`'s job.

use std::ops::Range;

use arrow::array::{ArrayData, ArrayRef, MutableArrayData, make_array};
use arrow::buffer::Buffer;
use arrow::datatypes::DataType;
use arrow::record_batch::RecordBatch;

use crate::arrays::copy_all;
use crate::backend::{BackendError, BufferKind, ExportedArray, ExportedBuffer};

/// Alignment of every buffer in device and staging memory.
pub(super) const ALIGNMENT: usize = 64;
/// `cuMemAlloc`'s sub-allocation granularity; see the module docs.
pub(super) const ALLOCATION_GRANULARITY: usize = 2 << 20;

/// A byte range of a partition's device allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Region {
    pub(super) offset: usize,
    pub(super) len: usize,
}

/// How one array's bytes are addressed by row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Null,
    /// Values of this many bytes each.
    Fixed(usize),
    /// Bit-packed booleans.
    Bits,
    /// Offsets of this width into a byte buffer (strings, binary).
    VarLen(usize),
    /// Offsets of this width into child rows (lists, maps).
    List(usize),
    /// This many child rows per row.
    FixedList(usize),
    Struct,
    /// Keys of this width, and the whole dictionary.
    Dictionary(usize),
}

pub(super) fn kind(data_type: &DataType) -> Result<Kind, BackendError> {
    let kind = match data_type {
        DataType::Null => Kind::Null,
        DataType::Boolean => Kind::Bits,
        DataType::Utf8 | DataType::Binary => Kind::VarLen(4),
        DataType::LargeUtf8 | DataType::LargeBinary => Kind::VarLen(8),
        DataType::List(_) | DataType::Map(_, _) => Kind::List(4),
        DataType::LargeList(_) => Kind::List(8),
        DataType::FixedSizeList(_, size) => Kind::FixedList(usize::try_from(*size).unwrap_or(0)),
        DataType::FixedSizeBinary(size) => Kind::Fixed(usize::try_from(*size).unwrap_or(0)),
        DataType::Struct(_) => Kind::Struct,
        DataType::Dictionary(key, _) => Kind::Dictionary(key.primitive_width().unwrap_or(0)),
        other => match other.primitive_width() {
            Some(width) => Kind::Fixed(width),
            None => {
                return Err(BackendError::UnsupportedType {
                    backend: "cuda",
                    data_type: other.to_string(),
                });
            }
        },
    };
    Ok(kind)
}

/// Where one array lives in its partition's allocation.
#[derive(Debug, Clone)]
pub(super) struct DeviceArray {
    pub(super) data_type: DataType,
    pub(super) kind: Kind,
    pub(super) len: usize,
    pub(super) null_count: usize,
    pub(super) validity: Option<Region>,
    pub(super) buffers: Vec<Region>,
    pub(super) children: Vec<DeviceArray>,
    /// For a dictionary: a host copy of its values (also on the device, as `children[0]`), so
    /// concatenation can merge dictionaries without reading them back. Dictionaries are small.
    pub(super) dictionary: Option<ArrayRef>,
}

/// Bytes an array's regions span (validity, buffers, children, a dictionary's values),
/// without the alignment between them.
pub(super) fn used_bytes(array: &DeviceArray) -> u64 {
    let regions: usize = array
        .validity
        .iter()
        .chain(&array.buffers)
        .map(|r| r.len)
        .sum();
    (regions as u64).saturating_add(array.children.iter().map(used_bytes).sum::<u64>())
}

impl DeviceArray {
    /// Moves every region `by` bytes further into the allocation.
    pub(super) fn shift(&mut self, by: usize) {
        let move_region = |region: &mut Region| region.offset += by;
        self.validity.iter_mut().for_each(move_region);
        self.buffers.iter_mut().for_each(move_region);
        self.children.iter_mut().for_each(|child| child.shift(by));
    }

    /// The bytes the array's regions (its children's included) span, which lie together in
    /// its allocation; `None` when it has none.
    pub(super) fn span(&self) -> Option<Region> {
        let mut regions = Vec::new();
        self.collect_regions(&mut regions);
        let start = regions.iter().map(|r| r.offset).min()?;
        let end = regions.iter().map(|r| r.offset + r.len).max()?;
        Some(Region {
            offset: start,
            len: end - start,
        })
    }

    /// Every region of the array: its validity, its buffers and its children's (a
    /// dictionary's values among them), depth first.
    pub(super) fn collect_regions(&self, out: &mut Vec<Region>) {
        out.extend(self.validity);
        out.extend(&self.buffers);
        self.children.iter().for_each(|c| c.collect_regions(out));
    }

    /// The same array with its span moved from `from` to `to` (every region's offset is at
    /// least `from`).
    fn moved(&self, from: usize, to: usize) -> Self {
        let mut array = self.clone();
        array.relocate(from, to);
        array
    }

    fn relocate(&mut self, from: usize, to: usize) {
        let move_region = |region: &mut Region| region.offset = region.offset - from + to;
        self.validity.iter_mut().for_each(move_region);
        self.buffers.iter_mut().for_each(move_region);
        self.children.iter_mut().for_each(|c| c.relocate(from, to));
    }
}

/// Columns copied out of their allocations into one of their own (a replica of some of a
/// partition's columns): each column's span, where it goes, and the column there.
#[derive(Debug)]
pub(super) struct SpanCopy {
    /// Per column: the span it is copied from (`None`: no bytes), and its offset in the copy.
    pub(super) spans: Vec<(Option<Region>, usize)>,
    /// The columns as they lie in the copy.
    pub(super) columns: Vec<DeviceArray>,
    /// Bytes the copy's columns span, before rounding.
    pub(super) used_bytes: usize,
}

impl SpanCopy {
    pub(super) fn new(arrays: &[&DeviceArray]) -> Self {
        let mut end = 0_usize;
        let mut spans = Vec::with_capacity(arrays.len());
        let mut columns = Vec::with_capacity(arrays.len());
        for array in arrays {
            let to = end.next_multiple_of(ALIGNMENT);
            match array.span() {
                Some(span) => {
                    columns.push(array.moved(span.offset, to));
                    spans.push((Some(span), to));
                    end = to + span.len;
                }
                None => {
                    columns.push((*array).clone());
                    spans.push((None, to));
                }
            }
        }
        Self {
            spans,
            columns,
            used_bytes: end,
        }
    }
}

/// The layout of one batch, and the host bytes that fill it.
#[derive(Debug)]
pub(super) struct UploadPlan {
    pub(super) columns: Vec<DeviceArray>,
    /// Host bytes to place at each region, in allocation order.
    pub(super) sources: Vec<(Region, Buffer)>,
    /// Bytes the buffers span, before rounding.
    pub(super) used_bytes: usize,
}

impl UploadPlan {
    /// Plans `batch`'s layout. Arrays that are not compact (slices; offsets not starting at 0;
    /// children holding rows nobody references) are copied to fresh buffers first, so every
    /// device array starts at its row 0 and concatenation can work on whole fragments.
    pub(super) fn new(batch: &RecordBatch) -> Result<Self, BackendError> {
        let mut plan = Self::starting_at(0);
        for column in batch.columns() {
            let array = plan.place(&column.to_data())?;
            plan.columns.push(array);
        }
        Ok(plan)
    }

    /// An empty plan whose first buffer goes at (the next aligned offset from) `offset`.
    pub(super) fn starting_at(offset: usize) -> Self {
        Self {
            columns: Vec::new(),
            sources: Vec::new(),
            used_bytes: offset,
        }
    }

    /// Bytes the device allocation takes, rounded to the allocation granularity.
    pub(super) fn allocation_bytes(&self) -> usize {
        allocation_bytes(self.used_bytes)
    }

    fn region(&mut self, buffer: &Buffer, len: usize) -> Region {
        let offset = self.used_bytes.next_multiple_of(ALIGNMENT);
        let region = Region { offset, len };
        self.used_bytes = offset + len;
        if len > 0 {
            self.sources
                .push((region, buffer.slice_with_length(0, len)));
        }
        region
    }

    /// Lays out `data` (compacted first if it is not) after what is planned so far.
    pub(super) fn place(&mut self, data: &ArrayData) -> Result<DeviceArray, BackendError> {
        let data = compact(data.clone())?;
        self.place_compact(&data)
    }

    fn place_compact(&mut self, data: &ArrayData) -> Result<DeviceArray, BackendError> {
        let kind = kind(data.data_type())?;
        let len = data.len();
        let validity = data
            .nulls()
            .map(|nulls| self.region(nulls.buffer(), len.div_ceil(8)));
        let mut buffers = Vec::new();
        let mut children = Vec::new();
        let mut dictionary = None;
        match kind {
            Kind::Null => {}
            Kind::Fixed(width) => buffers.push(self.region(&data.buffers()[0], len * width)),
            Kind::Bits => buffers.push(self.region(&data.buffers()[0], len.div_ceil(8))),
            Kind::VarLen(width) => {
                buffers.push(self.region(&data.buffers()[0], (len + 1) * width));
                let end = last_offset(&data.buffers()[0], len, width);
                buffers.push(self.region(&data.buffers()[1], end));
            }
            Kind::List(width) => {
                buffers.push(self.region(&data.buffers()[0], (len + 1) * width));
                children.push(self.place_compact(&data.child_data()[0])?);
            }
            Kind::FixedList(_) | Kind::Struct => {
                for child in data.child_data() {
                    children.push(self.place_compact(child)?);
                }
            }
            Kind::Dictionary(width) => {
                buffers.push(self.region(&data.buffers()[0], len * width));
                let values = &data.child_data()[0];
                children.push(self.place_compact(values)?);
                dictionary = Some(owned_copy(values)?);
            }
        }
        Ok(DeviceArray {
            data_type: data.data_type().clone(),
            kind,
            len,
            null_count: data.null_count(),
            validity,
            buffers,
            children,
            dictionary,
        })
    }
}

/// How `array` is published by `ipc-export`: its buffers in Arrow's order, by role.
pub(super) fn exported(array: &DeviceArray) -> ExportedArray {
    let buffer = |kind, region: Region| ExportedBuffer {
        kind,
        offset: region.offset as u64,
        length: region.len as u64,
        allocation: None,
    };
    let mut buffers: Vec<ExportedBuffer> = array
        .validity
        .map(|v| buffer(BufferKind::Validity, v))
        .into_iter()
        .collect();
    let mut children: Vec<ExportedArray> = array.children.iter().map(exported).collect();
    let mut dictionary = None;
    match array.kind {
        Kind::Null | Kind::FixedList(_) | Kind::Struct => {}
        Kind::Fixed(_) | Kind::Bits => buffers.push(buffer(BufferKind::Values, array.buffers[0])),
        Kind::VarLen(_) => buffers.extend([
            buffer(BufferKind::Offsets, array.buffers[0]),
            buffer(BufferKind::Values, array.buffers[1]),
        ]),
        Kind::List(_) => buffers.push(buffer(BufferKind::Offsets, array.buffers[0])),
        Kind::Dictionary(_) => {
            buffers.push(buffer(BufferKind::Values, array.buffers[0]));
            dictionary = children.pop().map(Box::new);
        }
    }
    ExportedArray {
        data_type: array.data_type.clone(),
        length: array.len as u64,
        null_count: array.null_count as u64,
        buffers,
        children,
        dictionary,
    }
}

/// `used` bytes rounded up to the allocation granularity (at least one granule).
pub(super) fn allocation_bytes(used: usize) -> usize {
    used.max(1).div_ceil(ALLOCATION_GRANULARITY) * ALLOCATION_GRANULARITY
}

/// A copy of `data` in buffers of its own, so that keeping it does not keep alive the message
/// it was decoded from.
fn owned_copy(data: &ArrayData) -> Result<ArrayRef, BackendError> {
    crate::arrays::owned(data)
        .map(make_array)
        .map_err(|e| BackendError::Device(format!("copying a dictionary: {e}")))
}

/// The array itself if it is compact, else a fresh copy that is.
fn compact(data: ArrayData) -> Result<ArrayData, BackendError> {
    if is_compact(&data) {
        return Ok(data);
    }
    let len = data.len();
    let mut copy = MutableArrayData::new(vec![&data], false, len);
    copy.try_extend(0, 0, len)
        .map_err(|e| BackendError::Device(format!("compacting a sliced array: {e}")))?;
    Ok(copy.freeze())
}

/// Starts at row 0 everywhere; offsets start at 0; children hold exactly the rows referenced.
fn is_compact(data: &ArrayData) -> bool {
    let len = data.len();
    let own = data.offset() == 0 && data.nulls().is_none_or(|n| n.offset() == 0);
    let layout = match kind(data.data_type()) {
        Ok(Kind::VarLen(width)) => offset_at(data.buffers()[0].as_slice(), 0, width) == 0,
        Ok(Kind::List(width)) => {
            let offsets = data.buffers()[0].as_slice();
            offset_at(offsets, 0, width) == 0
                && data.child_data()[0].len() == offset_at(offsets, len, width)
        }
        Ok(Kind::FixedList(size)) => data.child_data()[0].len() == len * size,
        Ok(Kind::Struct) => data.child_data().iter().all(|c| c.len() == len),
        _ => true,
    };
    own && layout && data.child_data().iter().all(is_compact)
}

/// `offsets[index]` of an offsets buffer of `width`-byte integers, as usize.
pub(super) fn offset_at(bytes: &[u8], index: usize, width: usize) -> usize {
    let at = index * width;
    if width == 4 {
        let mut raw = [0; 4];
        raw.copy_from_slice(&bytes[at..at + 4]);
        i32::from_le_bytes(raw).max(0) as usize
    } else {
        let mut raw = [0; 8];
        raw.copy_from_slice(&bytes[at..at + 8]);
        i64::from_le_bytes(raw).max(0) as usize
    }
}

fn last_offset(offsets: &Buffer, len: usize, width: usize) -> usize {
    offset_at(offsets.as_slice(), len, width)
}

/// Subtracts `base` from `count` offsets in place.
pub(super) fn rebase_offsets(bytes: &mut [u8], count: usize, width: usize, base: usize) {
    for index in 0..count {
        let at = index * width;
        if width == 4 {
            let value = offset_at(bytes, index, 4) - base;
            bytes[at..at + 4].copy_from_slice(&(value as i32).to_le_bytes());
        } else {
            let value = offset_at(bytes, index, 8) - base;
            bytes[at..at + 8].copy_from_slice(&(value as i64).to_le_bytes());
        }
    }
}

/// Fills `target` (staging) with the plan's host bytes in `range` of the allocation, laid out
/// as there: byte `range.start` at `target`'s start. Bytes between regions are zeroed: staging
/// is reused, and what it held before (another dataset's bytes) must not reach device memory
/// that `ipc-export` maps.
///
/// # Panics
/// Where `target` is shorter than `range`: a caller's bug.
pub(super) fn fill_staging(plan: &UploadPlan, range: Range<usize>, target: &mut [u8]) {
    // The regions are in allocation order and disjoint: the target splits into them, and
    // the copies run on several cores at once.
    let mut rest = &mut target[..range.len()];
    let mut at = range.start;
    let mut pairs = Vec::with_capacity(plan.sources.len());
    for (region, source) in &plan.sources {
        let start = region.offset.max(range.start);
        let end = (region.offset + region.len).min(range.end);
        if start >= end {
            if region.offset >= range.end {
                break;
            }
            continue;
        }
        let (gap, from_region) = std::mem::take(&mut rest).split_at_mut(start - at);
        gap.fill(0);
        let (target, after) = from_region.split_at_mut(end - start);
        pairs.push((
            &source.as_slice()[start - region.offset..end - region.offset],
            target,
        ));
        rest = after;
        at = end;
    }
    rest.fill(0);
    copy_all(pairs);
}

/// The ranges of `0..len` that no region of `regions` covers, in order: what an allocation
/// holds besides its arrays. `ipc-export` maps allocations whole, and an allocation (reused,
/// or fresh from the driver) still holds whatever was there before, so whoever fills one
/// zeroes these.
pub(super) fn gaps(regions: &mut [Region], len: usize) -> Vec<Region> {
    regions.sort_unstable_by_key(|region| region.offset);
    let mut gaps = Vec::new();
    let mut at = 0;
    for region in regions.iter().filter(|region| region.len > 0) {
        let start = region.offset.min(len);
        if start > at {
            gaps.push(Region {
                offset: at,
                len: start - at,
            });
        }
        at = at.max(region.offset.saturating_add(region.len).min(len));
    }
    if len > at {
        gaps.push(Region {
            offset: at,
            len: len - at,
        });
    }
    gaps
}

/// Groups `sources` (regions in allocation order, each with the host address its bytes start
/// at) into runs that one host-to-device copy each can fill: a region joins the run before it
/// where it starts right where the run ends, both on the device and in host memory, and
/// `one_block` says the run's whole source span (addresses, end exclusive) lies in one block
/// of pinned memory. A run holds its buffers' bytes and nothing else: the padding a writer
/// leaves between buffers is never copied (the gaps between runs are zeroed instead). Returns
/// each run as a range of indices into `sources`.
///
/// A message body laid out as the device allocation is (buffers of whole 64-byte multiples,
/// as fixed-width columns of 8 rows' multiples are) becomes one copy instead of one per
/// buffer.
pub(super) fn copy_runs(
    sources: &[(Region, usize)],
    one_block: impl Fn(Range<usize>) -> bool,
) -> Vec<Range<usize>> {
    let mut runs: Vec<Range<usize>> = Vec::new();
    for (index, &(region, address)) in sources.iter().enumerate() {
        let joins = runs.last().is_some_and(|run| {
            let (_, first_address) = sources[run.start];
            let (last, last_address) = sources[index - 1];
            last.offset.checked_add(last.len) == Some(region.offset)
                && last_address.checked_add(last.len) == Some(address)
                && address
                    .checked_add(region.len)
                    .is_some_and(|end| one_block(first_address..end))
        });
        match runs.last_mut() {
            Some(run) if joins => run.end = index + 1,
            _ => runs.push(index..index + 1),
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{Int64Array, ListArray, StringArray};
    use arrow::datatypes::Int32Type;

    use super::*;

    fn batch() -> RecordBatch {
        let ids: ArrayRef = Arc::new(Int64Array::from(vec![Some(1), None, Some(3), Some(4)]));
        let words: ArrayRef = Arc::new(StringArray::from(vec!["a", "bcd", "", "ef"]));
        let lists: ArrayRef = Arc::new(ListArray::from_iter_primitive::<Int32Type, _, _>([
            Some(vec![Some(1), Some(2)]),
            None,
            Some(vec![]),
            Some(vec![Some(3)]),
        ]));
        RecordBatch::try_from_iter([("id", ids), ("word", words), ("list", lists)]).expect("batch")
    }

    #[test]
    fn a_copy_of_some_columns_packs_their_spans_and_moves_their_regions_with_them() {
        let plan = UploadPlan::new(&batch()).expect("plan");
        // The string and list columns, not the first: each moves as a block.
        let chosen = [&plan.columns[2], &plan.columns[1]];
        let copy = SpanCopy::new(&chosen);
        let mut at = 0_usize;
        for ((span, to), (original, moved)) in
            copy.spans.iter().zip(chosen.iter().zip(&copy.columns))
        {
            let span = span.expect("bytes");
            assert_eq!(*to, at.next_multiple_of(ALIGNMENT));
            assert_eq!(moved.span().expect("bytes").offset, *to);
            let (mut from, mut into) = (Vec::new(), Vec::new());
            original.collect_regions(&mut from);
            moved.collect_regions(&mut into);
            for (a, b) in from.iter().zip(&into) {
                assert_eq!(a.len, b.len);
                assert_eq!(
                    a.offset - span.offset,
                    b.offset - to,
                    "the same place in the span"
                );
            }
            at = to + span.len;
        }
        assert_eq!(copy.used_bytes, at);
        assert!(copy.used_bytes < plan.used_bytes, "only the chosen columns");
    }

    #[test]
    fn staging_filled_in_pieces_holds_what_staging_filled_at_once_does() {
        let plan = UploadPlan::new(&batch()).expect("plan");
        let len = plan.used_bytes;
        // Staging that held other bytes before: every byte of the range is written.
        let mut whole = vec![0xAB_u8; len];
        fill_staging(&plan, 0..len, &mut whole);
        for piece in [1, 7, 64, 100, len] {
            let mut pieced = vec![0u8; len];
            for start in (0..len).step_by(piece) {
                let range = start..(start + piece).min(len);
                let mut staging = vec![0xCD_u8; piece];
                fill_staging(&plan, range.clone(), &mut staging);
                pieced[range.clone()].copy_from_slice(&staging[..range.len()]);
            }
            assert_eq!(pieced, whole, "pieces of {piece} bytes");
        }
        assert!(whole.iter().any(|&b| b != 0));
        assert!(
            !whole.contains(&0xAB),
            "the gaps between regions are zeroed"
        );
    }

    #[test]
    fn every_buffer_lies_aligned_in_order_without_overlap() {
        let plan = UploadPlan::new(&batch()).expect("plan");
        let mut all = Vec::new();
        plan.columns
            .iter()
            .for_each(|c| c.collect_regions(&mut all));
        let mut end = 0;
        for region in &all {
            assert_eq!(region.offset % ALIGNMENT, 0, "{region:?}");
            assert!(
                region.offset >= end,
                "depth-first order, no overlap: {all:?}"
            );
            end = region.offset + region.len;
        }
        assert_eq!(plan.used_bytes, end);
        assert_eq!(plan.allocation_bytes(), ALLOCATION_GRANULARITY);
        // The staging buffer is filled from these sources at exactly these regions.
        let placed: Vec<Region> = plan.sources.iter().map(|(r, _)| *r).collect();
        assert_eq!(
            placed,
            all.into_iter().filter(|r| r.len > 0).collect::<Vec<_>>()
        );
    }

    #[test]
    fn buffers_have_the_sizes_their_rows_need() {
        let plan = UploadPlan::new(&batch()).expect("plan");
        let [id, word, list] = &plan.columns[..] else {
            panic!("three columns");
        };
        assert_eq!(id.validity.map(|v| v.len), Some(1), "4 rows of bits");
        assert_eq!(id.buffers[0].len, 32);
        assert_eq!(word.kind, Kind::VarLen(4));
        assert_eq!((word.buffers[0].len, word.buffers[1].len), (20, 6));
        assert_eq!(
            list.children[0].len, 3,
            "the child holds exactly the referenced rows"
        );
    }

    #[test]
    fn used_bytes_count_a_columns_regions_and_children() {
        let plan = UploadPlan::new(&batch()).expect("plan");
        let [id, word, list] = &plan.columns[..] else {
            panic!("three columns");
        };
        assert_eq!(used_bytes(id), 1 + 32, "validity and values");
        assert_eq!(used_bytes(word), 20 + 6, "offsets and values");
        let child: usize = list.children[0]
            .validity
            .iter()
            .chain(&list.children[0].buffers)
            .map(|r| r.len)
            .sum();
        let own: usize = list
            .validity
            .iter()
            .chain(&list.buffers)
            .map(|r| r.len)
            .sum();
        assert_eq!(
            used_bytes(list),
            (own + child) as u64,
            "the child's rows too"
        );
    }

    #[test]
    fn slices_are_compacted_to_start_at_row_zero() {
        let sliced = batch().slice(1, 3);
        let plan = UploadPlan::new(&sliced).expect("plan");
        let word = &plan.columns[1];
        let (_, offsets) = plan
            .sources
            .iter()
            .find(|(region, _)| *region == word.buffers[0])
            .expect("the offsets' source");
        assert_eq!(offset_at(offsets.as_slice(), 0, 4), 0, "offsets start at 0");
        assert_eq!(
            word.buffers[1].len, 5,
            "only the slice's bytes: bcd, '', ef"
        );
    }

    #[test]
    fn exports_name_each_buffer_by_role() {
        let plan = UploadPlan::new(&batch()).expect("plan");
        let kinds = |array: &DeviceArray| -> Vec<BufferKind> {
            exported(array).buffers.iter().map(|b| b.kind).collect()
        };
        assert_eq!(
            kinds(&plan.columns[0]),
            [BufferKind::Validity, BufferKind::Values]
        );
        assert_eq!(
            kinds(&plan.columns[1]),
            [BufferKind::Offsets, BufferKind::Values]
        );
        let list = exported(&plan.columns[2]);
        assert_eq!(list.children.len(), 1);
        assert_eq!(
            list.buffers[1].offset,
            plan.columns[2].buffers[0].offset as u64
        );
    }

    #[test]
    fn offsets_are_rebased_in_place() {
        let mut bytes: Vec<u8> = [7i32, 9, 12].iter().flat_map(|o| o.to_le_bytes()).collect();
        rebase_offsets(&mut bytes, 3, 4, 7);
        let rebased: Vec<usize> = (0..3).map(|i| offset_at(&bytes, i, 4)).collect();
        assert_eq!(rebased, [0, 2, 5]);
        assert_eq!(allocation_bytes(0), ALLOCATION_GRANULARITY);
        assert_eq!(
            allocation_bytes(ALLOCATION_GRANULARITY + 1),
            2 * ALLOCATION_GRANULARITY
        );
    }
    fn run(regions: &[(usize, usize, usize)]) -> Vec<Range<usize>> {
        let sources: Vec<(Region, usize)> = regions
            .iter()
            .map(|&(offset, len, address)| (Region { offset, len }, address))
            .collect();
        // One block: 10_000..20_000.
        copy_runs(&sources, |span| span.start >= 10_000 && span.end <= 20_000)
    }

    #[test]
    fn regions_whose_sources_lie_as_they_do_are_copied_as_one() {
        // A body laid out as the allocation: one run.
        assert_eq!(
            run(&[(0, 64, 10_000), (64, 128, 10_064), (192, 8, 10_192)]),
            vec![0..3]
        );
        // Padding between two buffers, the same on both sides, is not copied: a new run.
        assert_eq!(
            run(&[(0, 64, 10_000), (64, 100, 10_064), (192, 8, 10_192)]),
            vec![0..2, 2..3]
        );
        // The second source 8 bytes on from where the layout puts it (pyarrow pads to 8):
        // a new run there, which the third continues.
        assert_eq!(
            run(&[(0, 100, 10_000), (128, 64, 10_104), (192, 64, 10_168)]),
            vec![0..1, 1..3]
        );
        // Regions out of order never join (nor panic).
        assert_eq!(run(&[(64, 64, 10_064), (0, 64, 10_000)]), vec![0..1, 1..2]);
        // Sources in another order than the regions.
        assert_eq!(run(&[(0, 64, 10_128), (64, 64, 10_000)]), vec![0..1, 1..2]);
    }

    #[test]
    fn a_run_never_spans_two_blocks_or_wraps() {
        // Spaced as the regions are, but the second source is outside the block: the bytes
        // between would be another block's.
        assert_eq!(run(&[(0, 64, 19_936), (64, 64, 20_000)]), vec![0..1, 1..2]);
        // The second source ends past the block.
        assert_eq!(run(&[(0, 64, 19_872), (64, 65, 19_936)]), vec![0..1, 1..2]);
        // Addresses near the top of the address space do not wrap.
        let top = usize::MAX - 10;
        let sources = [
            (Region { offset: 0, len: 4 }, top),
            (Region { offset: 4, len: 20 }, top + 4),
        ];
        assert_eq!(copy_runs(&sources, |_| true), vec![0..1, 1..2]);
        assert_eq!(copy_runs(&[], |_| true), Vec::<Range<usize>>::new());
    }
    #[test]
    fn gaps_are_what_no_region_covers() {
        let region = |offset, len| Region { offset, len };
        let mut regions = vec![
            region(128, 10),
            region(0, 64),
            region(64, 0),
            region(200, 56),
        ];
        assert_eq!(
            gaps(&mut regions, 1000),
            vec![region(64, 64), region(138, 62), region(256, 744)]
        );
        // Overlapping and touching regions, one past the end.
        let mut regions = vec![
            region(10, 20),
            region(0, 15),
            region(30, 5),
            region(990, 50),
        ];
        assert_eq!(gaps(&mut regions, 1000), vec![region(35, 955)]);
        assert_eq!(gaps(&mut [], 64), vec![region(0, 64)]);
        assert_eq!(gaps(&mut [region(0, 64)], 64), Vec::<Region>::new());
    }
}
