//! A host backend that hands out blocks for `DoPut` message bodies, as the CUDA backend does
//! from its pinned host memory: the server then receives large bodies straight into a block and
//! decodes them there, a path no other backend reaches and mutated streams must not break. Every
//! block and pinned copy is counted until its memory is freed, so a case that leaves one behind
//! once its datasets are dropped fails; and blocks run out, as pinned memory does, so the
//! fallback (the body where the reader put it) is taken too.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use arrow::buffer::Buffer;
use arrow::datatypes::Schema;
use arrow::record_batch::RecordBatch;
use futures::future::BoxFuture;
use gpu_flight::backend::{Backend, BackendError, BodyBlock, DeviceInfo, HostBackend, Partition};

/// Bytes of blocks and copies held at once, beyond which none is handed out (the CUDA backend's
/// pinned memory is full): one large body of the corpus at a time, so that the second batch of
/// `int64-large` (whose first one its dataset holds) finds none.
const HELD_AT_MOST: usize = 640 << 10;

/// Bytes held now in blocks and pinned copies, how many blocks were ever handed out, and how
/// many blocks and copies were refused for want of room.
static HELD: AtomicUsize = AtomicUsize::new(0);
static BLOCKS: AtomicU64 = AtomicU64::new(0);
static REFUSED: AtomicU64 = AtomicU64::new(0);

/// Bytes of blocks and pinned copies not yet freed.
pub(crate) fn held() -> usize {
    HELD.load(Ordering::Acquire)
}

/// Body blocks handed out since the process started.
pub(crate) fn blocks_handed_out() -> u64 {
    BLOCKS.load(Ordering::Acquire)
}

/// Blocks and pinned copies refused since the process started, the limit reached.
pub(crate) fn refused() -> u64 {
    REFUSED.load(Ordering::Acquire)
}

/// Memory counted in [`HELD`] until dropped, 64-byte aligned as the pinned arena's blocks are.
#[derive(Debug)]
struct Counted {
    bytes: Vec<u8>,
    start: usize,
    len: usize,
}

impl Counted {
    fn take(len: usize) -> Option<Self> {
        let room = HELD.fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
            held.checked_add(len).filter(|&total| total <= HELD_AT_MOST)
        });
        if room.is_err() {
            REFUSED.fetch_add(1, Ordering::AcqRel);
            return None;
        }
        // Filled with a byte no body is made of alone, so that a part left unwritten shows.
        let bytes = vec![0xA5; len + 64];
        let start = bytes.as_ptr().align_offset(64).min(64);
        Some(Self { bytes, start, len })
    }

    fn into_buffer(self) -> Buffer {
        let range = self.start..self.start + self.len;
        Buffer::from(bytes::Bytes::from_owner(self).slice(range))
    }
}

impl AsRef<[u8]> for Counted {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        HELD.fetch_sub(self.len, Ordering::AcqRel);
    }
}

impl BodyBlock for Counted {
    fn size(&self) -> usize {
        self.len
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.bytes[self.start..self.start + self.len]
    }

    fn into_buffer(self: Box<Self>) -> Buffer {
        Counted::into_buffer(*self)
    }
}

/// The host backend, but with body blocks and pinned copies, as a device backend has, and
/// `keeps_decoded_arrays` false, as a device backend's is: the decoder then leaves arrays in
/// their block, and the host backend keeps a batch whose buffers hold nothing else as it is, so
/// a committed dataset holds its blocks until it is dropped (a device backend copies them to
/// the device and frees them at once).
#[derive(Debug)]
pub(crate) struct BlockHost {
    host: HostBackend,
}

impl BlockHost {
    pub(crate) fn new() -> Self {
        Self {
            host: HostBackend::new(),
        }
    }
}

impl Backend for BlockHost {
    fn name(&self) -> &'static str {
        self.host.name()
    }

    fn devices(&self) -> Vec<DeviceInfo> {
        self.host.devices()
    }

    fn stored_size(&self, batch: &RecordBatch) -> Result<u64, BackendError> {
        self.host.stored_size(batch)
    }

    fn upload(
        &self,
        device: u32,
        batch: RecordBatch,
    ) -> BoxFuture<'static, Result<Arc<dyn Partition>, BackendError>> {
        self.host.upload(device, batch)
    }

    fn pinned_copy(&self, bytes: &[u8]) -> Option<Buffer> {
        let mut copy = Counted::take(bytes.len())?;
        BodyBlock::as_mut_slice(&mut copy).copy_from_slice(bytes);
        Some(copy.into_buffer())
    }

    fn body_block(&self, len: usize) -> Option<Box<dyn BodyBlock>> {
        let block = Counted::take(len)?;
        BLOCKS.fetch_add(1, Ordering::AcqRel);
        Some(Box::new(block))
    }

    fn keeps_decoded_arrays(&self) -> bool {
        false
    }

    fn holds_host_memory(&self) -> bool {
        self.host.holds_host_memory()
    }

    fn compacts(&self, schema: &Schema, partitions: &[Arc<dyn Partition>]) -> bool {
        self.host.compacts(schema, partitions)
    }

    fn compacted_size(&self, partitions: &[Arc<dyn Partition>]) -> Result<u64, BackendError> {
        self.host.compacted_size(partitions)
    }

    fn compact(
        &self,
        partitions: Vec<Arc<dyn Partition>>,
    ) -> BoxFuture<'static, Result<Arc<dyn Partition>, BackendError>> {
        self.host.compact(partitions)
    }

    fn copied_size(
        &self,
        partition: &Arc<dyn Partition>,
        columns: &[usize],
    ) -> Result<u64, BackendError> {
        self.host.copied_size(partition, columns)
    }

    fn copy_to(
        &self,
        partition: Arc<dyn Partition>,
        columns: Vec<usize>,
        device: u32,
    ) -> BoxFuture<'static, Result<Arc<dyn Partition>, BackendError>> {
        self.host.copy_to(partition, columns, device)
    }

    fn counters(&self) -> serde_json::Map<String, serde_json::Value> {
        self.host.counters()
    }
}
