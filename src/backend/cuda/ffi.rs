//! Every `unsafe` line of gpu-flight: the CUDA driver calls, through cudarc's thin `result`
//! wrappers, and the RAII types that own what they return.
//!
//! - [`Context`]: the device's primary context, made current on whichever thread calls.
//! - [`DeviceAllocation`]: device memory from plain `cuMemAlloc`. Not cudarc's stream-ordered
//!   pool: pool memory cannot be exported with `cuIpcGetMemHandle`, which zero-copy export needs.
//! - [`PinnedBuffer`]: page-locked host memory from `cuMemHostAlloc(…, 0)`: cacheable, so the CPU
//!   reads it at full speed (cudarc's `alloc_pinned` is write-combined, slow for the CPU to read).
//! - [`Stream`] and [`CopyBatch`]: asynchronous copies whose source and destination stay borrowed
//!   until the stream has synchronized, so no buffer can be freed or reused under a running copy.

use std::marker::PhantomData;
use std::panic::RefUnwindSafe;
use std::ptr::NonNull;
use std::sync::Arc;

use arrow::buffer::Buffer;
use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;

use crate::backend::BackendError;

/// Whether a CUDA driver library can be loaded. cudarc panics on first use without one, so
/// everything else here must only run after this returned true.
pub(super) fn driver_present() -> bool {
    // SAFETY: only attempts to load the library by name; nothing is called through it.
    unsafe { sys::is_culib_present() }
}

pub(super) fn device_error(what: &str, error: DriverError) -> BackendError {
    BackendError::Device(format!("{what}: {error}"))
}

/// The number of CUDA devices (after initializing the driver).
pub(super) fn device_count() -> Result<i32, BackendError> {
    result::init().map_err(|e| device_error("cuInit", e))?;
    result::device::get_count().map_err(|e| device_error("cuDeviceGetCount", e))
}

/// A device's primary context.
#[derive(Debug)]
pub(super) struct Context {
    raw: sys::CUcontext,
    device: sys::CUdevice,
    ordinal: i32,
}

// SAFETY: a CUcontext handle may be used from any thread; we make it current per call.
unsafe impl Send for Context {}
// SAFETY: as above; the driver synchronizes access to the context internally.
unsafe impl Sync for Context {}

impl Context {
    pub(super) fn open(ordinal: i32) -> Result<Arc<Self>, BackendError> {
        result::init().map_err(|e| device_error("cuInit", e))?;
        let device = result::device::get(ordinal).map_err(|e| device_error("cuDeviceGet", e))?;
        // SAFETY: `device` is a valid device handle; the retain is balanced by Drop's release.
        let raw = unsafe { result::primary_ctx::retain(device) }
            .map_err(|e| device_error("cuDevicePrimaryCtxRetain", e))?;
        let context = Arc::new(Self {
            raw,
            device,
            ordinal,
        });
        context.bind()?;
        Ok(context)
    }

    pub(super) fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// Makes the context current on this thread; every driver call below starts with it.
    pub(super) fn bind(&self) -> Result<(), BackendError> {
        // SAFETY: `raw` is a retained primary context, alive as long as `self`.
        unsafe { result::ctx::set_current(self.raw) }
            .map_err(|e| device_error("cuCtxSetCurrent", e))
    }

    pub(super) fn name(&self) -> Result<String, BackendError> {
        result::device::get_name(self.device).map_err(|e| device_error("cuDeviceGetName", e))
    }

    pub(super) fn total_bytes(&self) -> Result<u64, BackendError> {
        // SAFETY: `device` is a valid device handle.
        let total = unsafe { result::device::total_mem(self.device) }
            .map_err(|e| device_error("cuDeviceTotalMem", e))?;
        Ok(total as u64)
    }

    /// (free, total) bytes as the driver sees them, all processes included.
    pub(super) fn memory_info(&self) -> Result<(u64, u64), BackendError> {
        self.bind()?;
        let (free, total) = result::mem_get_info().map_err(|e| device_error("cuMemGetInfo", e))?;
        Ok((free as u64, total as u64))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `open`.
        if let Err(error) = unsafe { result::primary_ctx::release(self.device) } {
            tracing::warn!(%error, "releasing the primary context failed");
        }
    }
}

/// Device memory from `cuMemAlloc`, freed on drop.
#[derive(Debug)]
pub(super) struct DeviceAllocation {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    context: Arc<Context>,
}

impl DeviceAllocation {
    pub(super) fn new(context: &Arc<Context>, bytes: usize) -> Result<Self, BackendError> {
        context.bind()?;
        // SAFETY: the context is current; the memory is uninitialized device memory, which we
        // only ever fill by copies before reading.
        match unsafe { result::malloc_sync(bytes.max(1)) } {
            Ok(ptr) => Ok(Self {
                ptr,
                bytes,
                context: Arc::clone(context),
            }),
            Err(DriverError(sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY)) => {
                Err(BackendError::OutOfMemory {
                    device: context.ordinal() as u32,
                    requested: bytes as u64,
                })
            }
            Err(error) => Err(device_error("cuMemAlloc", error)),
        }
    }

    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DeviceAllocation {
    fn drop(&mut self) {
        let freed = self.context.bind().and_then(|()| {
            // SAFETY: `ptr` came from cuMemAlloc in this context and no copy can still use it:
            // copies borrow the allocation until their stream synchronized.
            unsafe { result::free_sync(self.ptr) }.map_err(|e| device_error("cuMemFree", e))
        });
        if let Err(error) = freed {
            tracing::warn!(%error, "freeing device memory failed");
        }
    }
}

/// Page-locked, CPU-cacheable host memory, freed on drop.
#[derive(Debug)]
pub(super) struct PinnedBuffer {
    ptr: NonNull<u8>,
    bytes: usize,
    context: Arc<Context>,
}

// SAFETY: the buffer exclusively owns its allocation; access goes through &/&mut self.
unsafe impl Send for PinnedBuffer {}
// SAFETY: shared access is read-only (`as_slice`).
unsafe impl Sync for PinnedBuffer {}
impl RefUnwindSafe for PinnedBuffer {}

impl PinnedBuffer {
    pub(super) fn new(context: &Arc<Context>, bytes: usize) -> Result<Self, BackendError> {
        context.bind()?;
        // SAFETY: the context is current; flags 0 asks for plain (cacheable) pinned memory.
        let raw = unsafe { result::malloc_host(bytes.max(1), 0) }
            .map_err(|e| device_error("cuMemHostAlloc", e))?;
        let ptr = NonNull::new(raw.cast::<u8>())
            .ok_or_else(|| BackendError::Device("cuMemHostAlloc returned null".to_owned()))?;
        Ok(Self {
            ptr,
            bytes,
            context: Arc::clone(context),
        })
    }

    pub(super) fn len(&self) -> usize {
        self.bytes
    }

    pub(super) fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `bytes` bytes we own; pinned memory is initialized by the
        // driver as ordinary host memory (its contents are unspecified but readable).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.bytes) }
    }

    pub(super) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.bytes) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        let freed = self.context.bind().and_then(|()| {
            // SAFETY: `ptr` came from cuMemHostAlloc; no copy can still use it (see CopyBatch).
            unsafe { result::free_host(self.ptr.as_ptr().cast()) }
                .map_err(|e| device_error("cuMemFreeHost", e))
        });
        if let Err(error) = freed {
            tracing::warn!(%error, "freeing pinned memory failed");
        }
    }
}

/// Wraps `range` of pinned memory owned by `owner` as an Arrow buffer without copying. The
/// memory stays alive (and out of the pool) until every Arrow buffer over it is dropped.
pub(super) fn arrow_buffer<O>(owner: Arc<O>, range: std::ops::Range<usize>) -> Buffer
where
    O: AsRef<PinnedBuffer> + RefUnwindSafe + Send + Sync + 'static,
{
    let pinned: &PinnedBuffer = (*owner).as_ref();
    let slice = &pinned.as_slice()[range];
    let ptr = NonNull::from(slice).cast::<u8>();
    let len = slice.len();
    // SAFETY: `ptr..ptr+len` lies inside the pinned allocation that `owner` keeps alive for
    // as long as the Buffer exists; nobody writes to it once it is shared.
    unsafe { Buffer::from_custom_allocation(ptr, len, owner) }
}

/// A CUDA stream of this context.
#[derive(Debug)]
pub(super) struct Stream {
    raw: sys::CUstream,
    context: Arc<Context>,
}

// SAFETY: stream handles may be used from any thread (the context is bound per call).
unsafe impl Send for Stream {}

impl Stream {
    pub(super) fn new(context: &Arc<Context>) -> Result<Self, BackendError> {
        context.bind()?;
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|e| device_error("cuStreamCreate", e))?;
        Ok(Self {
            raw,
            context: Arc::clone(context),
        })
    }

    /// Starts a batch of asynchronous copies on this stream.
    pub(super) fn copies<'a>(&'a mut self) -> Result<CopyBatch<'a>, BackendError> {
        self.context.bind()?;
        Ok(CopyBatch {
            stream: self,
            finished: false,
            _borrows: PhantomData,
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let destroyed = self.context.bind().and_then(|()| {
            // SAFETY: `raw` was created in this context; CopyBatch synchronized it.
            unsafe { result::stream::destroy(self.raw) }
                .map_err(|e| device_error("cuStreamDestroy", e))
        });
        if let Err(error) = destroyed {
            tracing::warn!(%error, "destroying a stream failed");
        }
    }
}

/// Asynchronous copies queued on one stream. Everything a copy touches is borrowed for `'a`,
/// and the batch synchronizes the stream in [`CopyBatch::finish`] (or on drop, after an
/// error), so a buffer can never be freed, reused or read while a copy still runs.
#[derive(Debug)]
pub(super) struct CopyBatch<'a> {
    stream: &'a mut Stream,
    finished: bool,
    _borrows: PhantomData<&'a mut [u8]>,
}

impl<'a> CopyBatch<'a> {
    /// Queues a host-to-device copy of `src` to `dst` at byte `offset`.
    pub(super) fn copy_to_device(
        &mut self,
        dst: &'a DeviceAllocation,
        offset: usize,
        src: &'a PinnedBuffer,
        src_range: std::ops::Range<usize>,
    ) -> Result<(), BackendError> {
        let src = &src.as_slice()[src_range];
        check_device_range(dst, offset, src.len())?;
        // SAFETY: the destination range lies inside `dst` (checked), the source is pinned
        // memory; both stay borrowed until the stream is synchronized.
        unsafe { result::memcpy_htod_async(dst.ptr + offset as u64, src, self.stream.raw) }
            .map_err(|e| device_error("cuMemcpyHtoDAsync", e))
    }

    /// Queues a device-to-host copy of `len` bytes at `offset` of `src` into `dst`.
    pub(super) fn copy_to_host(
        &mut self,
        dst: &'a mut [u8],
        src: &'a DeviceAllocation,
        offset: usize,
    ) -> Result<(), BackendError> {
        check_device_range(src, offset, dst.len())?;
        // SAFETY: the source range lies inside `src` (checked); `dst` is pinned memory (the
        // only caller passes slices of PinnedBuffer) borrowed until the stream synchronized.
        unsafe { result::memcpy_dtoh_async(dst, src.ptr + offset as u64, self.stream.raw) }
            .map_err(|e| device_error("cuMemcpyDtoHAsync", e))
    }

    /// Waits until every queued copy has completed.
    pub(super) fn finish(mut self) -> Result<(), BackendError> {
        self.finished = true;
        self.synchronize()
    }

    fn synchronize(&self) -> Result<(), BackendError> {
        // SAFETY: the stream is alive for 'a.
        unsafe { result::stream::synchronize(self.stream.raw) }
            .map_err(|e| device_error("cuStreamSynchronize", e))
    }
}

impl Drop for CopyBatch<'_> {
    fn drop(&mut self) {
        if !self.finished
            && let Err(error) = self.synchronize()
        {
            tracing::warn!(%error, "synchronizing an abandoned copy batch failed");
        }
    }
}

fn check_device_range(
    allocation: &DeviceAllocation,
    offset: usize,
    len: usize,
) -> Result<(), BackendError> {
    match offset.checked_add(len) {
        Some(end) if end <= allocation.bytes => Ok(()),
        _ => Err(BackendError::Device(format!(
            "copy of {len} bytes at {offset} exceeds a device allocation of {} bytes",
            allocation.bytes
        ))),
    }
}
