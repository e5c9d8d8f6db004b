//! Every `unsafe` line of gpu-flight: the CUDA driver calls, through cudarc's thin `result`
//! wrappers, and the RAII types that own what they return. The crate denies `unsafe_code`
//! (Cargo.toml); this module alone allows it.
//!
//! - [`Context`]: the device's primary context, made current on whichever thread calls.
//! - [`DeviceAllocation`]: device memory from plain `cuMemAlloc`. Not cudarc's stream-ordered
//!   pool: pool memory cannot be exported with `cuIpcGetMemHandle`, which zero-copy export needs.
//! - [`PinnedBuffer`]: page-locked host memory, mapped and faulted in by this process, then
//!   registered with the driver (`cuMemHostRegister`): cacheable, so the CPU reads it at full
//!   speed (cudarc's `alloc_pinned` is write-combined, slow for the CPU to read), and pinned
//!   without holding the driver for long. [`PinnedArena`]: one such buffer, made once, handed
//!   out in blocks to message bodies and spills.
//! - [`Stream`] and [`CopyBatch`]: asynchronous copies and kernel launches whose memory stays
//!   borrowed until the stream has synchronized, so no buffer can be freed or reused under them.
//!   A batch is only lent to a closure ([`Stream::copies`]), never owned by a caller, so even
//!   `mem::forget` cannot end those borrows early.
//! - [`Kernel`]: a function of a PTX module, loaded once.
//! - [`read_back_array`]: arrays rebuilt from the server's own device memory without checking
//!   every value again.

#![allow(unsafe_code)]

use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::panic::RefUnwindSafe;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use arrow::array::{ArrayData, ArrayDataBuilder};
use arrow::buffer::{Buffer, MutableBuffer};
use arrow::error::ArrowError;
use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;

use super::abi::{self, ConcatTask, TaskOwners};
use super::arena::Ranges;
use super::filter_abi::{self, FilterColumn, FilterOp, Program, TILE};
use crate::backend::BackendError;
use crate::backend::filter::ColumnType;

/// The parameter array `cuLaunchKernel` takes: a pointer to each argument, in the kernel's
/// order.
macro_rules! kernel_params {
    ($($argument:ident),+ $(,)?) => {
        [$((&raw mut $argument).cast::<std::ffi::c_void>()),+]
    };
}

/// An array rebuilt from bytes this server copied back from its own device memory, checked for
/// structure only ([`ArrayData::validate`]: buffer sizes, the first and last offsets, children),
/// not value by value: checking every offset and every string's UTF-8 again cost more than the
/// copies themselves, for data nothing but the server has written since it was checked.
pub(super) fn read_back_array(builder: ArrayDataBuilder) -> Result<ArrayData, ArrowError> {
    // SAFETY: the values are byte copies of arrays that Arrow's IPC decoder fully validated when
    // they were put (every offset, every string's UTF-8, dictionary keys); on the device they
    // are only ever moved whole, by copies and the concatenation kernel, which rebases offsets
    // into the ranges it writes, and by the filter kernels, which copy whole values and whole
    // strings and write offsets that are running sums of the strings' lengths (their clamps,
    // which could cut a string, only act on offsets that disagree with their data, which a
    // validated put never stores); `read_rows` rebases the copied offsets by their own first one.
    // The structure is still checked below before anything can read through the array.
    let data = unsafe { builder.build_unchecked() };
    data.validate()?;
    Ok(data)
}

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

/// How a thread waiting for the device waits, from `GPU_FLIGHT_CUDA_SYNC` (`spin`, `yield`,
/// `blocking`; unset or anything else: the driver's choice, which spins while there are
/// fewer active contexts than cores). A knob for same-run comparisons: a spinning wait holds
/// a core that the server's other work and its clients may need.
/// `cuCtxSetFlags` came with CUDA 12.1; on an older driver the variable is ignored.
fn schedule_from_env() -> Option<sys::CUctx_flags> {
    let value = std::env::var("GPU_FLIGHT_CUDA_SYNC").ok()?;
    let flags = match value.as_str() {
        "spin" => sys::CUctx_flags::CU_CTX_SCHED_SPIN,
        "yield" => sys::CUctx_flags::CU_CTX_SCHED_YIELD,
        "blocking" => sys::CUctx_flags::CU_CTX_SCHED_BLOCKING_SYNC,
        other => {
            tracing::warn!(
                value = other,
                "GPU_FLIGHT_CUDA_SYNC is spin, yield or blocking; ignored"
            );
            return None;
        }
    };
    let mut version = 0;
    // SAFETY: writes one integer through a pointer to a live local.
    let known = unsafe { sys::cuDriverGetVersion(&raw mut version) };
    if known != sys::CUresult::CUDA_SUCCESS || version < 12010 {
        tracing::warn!(
            version,
            "GPU_FLIGHT_CUDA_SYNC needs a CUDA 12.1 driver; ignored"
        );
        return None;
    }
    Some(flags)
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
        if let Some(schedule) = schedule_from_env() {
            result::ctx::set_flags(schedule).map_err(|e| device_error("cuCtxSetFlags", e))?;
        }
        Ok(context)
    }

    pub(super) fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// Whether the device has stream-ordered memory pools (`cuMemAllocAsync`).
    pub(super) fn supports_memory_pools(&self) -> bool {
        let attribute = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED;
        // SAFETY: `device` is a valid device handle; the attribute is an integer.
        unsafe { result::device::get_attribute(self.device, attribute) }.is_ok_and(|v| v != 0)
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

    /// The device's UUID as `nvidia-smi` prints it: `GPU-` and 32 hex digits in 8-4-4-4-12.
    pub(super) fn uuid(&self) -> Result<String, BackendError> {
        let uuid = result::device::get_uuid(self.device)
            .map_err(|e| device_error("cuDeviceGetUuid", e))?;
        let hex: String = uuid
            .bytes
            .iter()
            .map(|b| format!("{:02x}", *b as u8))
            .collect();
        Ok(format!(
            "GPU-{}-{}-{}-{}-{}",
            &hex[..8],
            &hex[8..12],
            &hex[12..16],
            &hex[16..20],
            &hex[20..]
        ))
    }

    /// The device's PCI bus id, `domain:bus:device.function` (lower-case hex, as CuPy and
    /// `nvidia-smi` print it).
    pub(super) fn pci_bus_id(&self) -> Result<String, BackendError> {
        let mut raw = [0 as std::ffi::c_char; 32];
        // SAFETY: the driver writes at most `len` bytes, NUL-terminated, into `raw`.
        unsafe { sys::cuDeviceGetPCIBusId(raw.as_mut_ptr(), raw.len() as i32, self.device) }
            .result()
            .map_err(|e| device_error("cuDeviceGetPCIBusId", e))?;
        let bytes: Vec<u8> = raw
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        Ok(String::from_utf8_lossy(&bytes).to_lowercase())
    }

    /// Whether this device can read and write `peer`'s memory directly (NVLink or PCIe peer
    /// access), as `cuDeviceCanAccessPeer` says.
    pub(super) fn can_access_peer(&self, peer: &Context) -> Result<bool, BackendError> {
        if self.device == peer.device {
            return Ok(true);
        }
        let mut can = 0;
        // SAFETY: both are valid device handles; the driver writes one int into `can`.
        unsafe { sys::cuDeviceCanAccessPeer(&mut can, self.device, peer.device) }
            .result()
            .map_err(|e| device_error("cuDeviceCanAccessPeer", e))?;
        Ok(can != 0)
    }

    /// Lets this context read and write `peer`'s memory directly, so copies between them
    /// take the direct link (NVLink or PCIe) instead of a trip through host memory. Only for
    /// a pair [`Context::can_access_peer`] allows; enabling twice is not an error.
    pub(super) fn enable_peer_access(&self, peer: &Context) -> Result<(), BackendError> {
        if self.device == peer.device {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: `peer.raw` is a retained primary context, alive as long as `peer`; flags
        // must be 0.
        match unsafe { sys::cuCtxEnablePeerAccess(peer.raw, 0) } {
            sys::cudaError_enum::CUDA_SUCCESS
            | sys::cudaError_enum::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
            error => Err(device_error("cuCtxEnablePeerAccess", DriverError(error))),
        }
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
    /// From the device's stream-ordered pool ([`DeviceAllocation::scratch`]), not exportable:
    /// the stream it was allocated on, where it is freed (kept alive until then).
    pooled: Option<Arc<StreamHandle>>,
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
                pooled: None,
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

    /// Working memory for a stream's kernels, from the device's stream-ordered pool, allocated
    /// and freed in `stream`'s order: it needs no device-wide synchronization, unlike
    /// `cuMemAlloc`/`cuMemFree`, but is never exportable. Only for memory no partition keeps,
    /// used on `stream` alone.
    pub(super) fn scratch(stream: &Stream, bytes: usize) -> Result<Self, BackendError> {
        let context = &stream.context;
        context.bind()?;
        // SAFETY: the context is current and `stream` belongs to it; the memory is
        // uninitialized and only read after kernels or copies on this stream wrote it.
        match unsafe { result::malloc_async(stream.raw, bytes.max(1)) } {
            Ok(ptr) => Ok(Self {
                ptr,
                bytes,
                context: Arc::clone(context),
                pooled: Some(Arc::clone(&stream.handle)),
            }),
            Err(DriverError(sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY)) => {
                Err(BackendError::OutOfMemory {
                    device: context.ordinal() as u32,
                    requested: bytes as u64,
                })
            }
            Err(error) => Err(device_error("cuMemAllocAsync", error)),
        }
    }

    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Moves the memory out, leaving an empty allocation whose drop frees nothing: how a
    /// holder that hands its memory on when dropped does so.
    pub(super) fn take(&mut self) -> Self {
        Self {
            ptr: std::mem::take(&mut self.ptr),
            bytes: std::mem::take(&mut self.bytes),
            context: Arc::clone(&self.context),
            pooled: self.pooled.take(),
        }
    }

    /// Whether this holds memory from `cuMemAlloc` ([`DeviceAllocation::new`]), not from a
    /// stream's pool.
    pub(super) fn is_exportable(&self) -> bool {
        self.pooled.is_none() && self.ptr != 0
    }

    /// The device address of the first byte, for kernel task tables.
    pub(super) fn address(&self) -> u64 {
        self.ptr
    }

    /// The CUDA IPC handle another process opens to map this whole allocation.
    pub(super) fn ipc_handle(&self) -> Result<[u8; 64], BackendError> {
        // A cuMemAlloc allocation of this context: exportable, unlike pool allocations.
        ipc_handle_of(&self.context, self.ptr)
    }

    /// Copies `bytes` to the start of the allocation and waits for the copy (producers
    /// without a CUDA library of their own, and tests of `ipc-import`).
    pub(super) fn write(&self, bytes: &[u8]) -> Result<(), BackendError> {
        check_device_range(self, 0, bytes.len())?;
        self.context.bind()?;
        // SAFETY: the destination range lies inside this allocation (checked), alive for
        // `&self`; the source is an ordinary host slice the synchronous copy reads before it
        // returns.
        unsafe { result::memcpy_htod_sync(self.ptr, bytes) }
            .map_err(|e| device_error("cuMemcpyHtoD", e))
    }

    /// Sets every byte to `value` (tests poison outputs so unwritten bytes show).
    pub(super) fn fill(&self, value: u8) -> Result<(), BackendError> {
        self.context.bind()?;
        // SAFETY: the whole range lies inside this allocation; `&self` keeps it alive.
        unsafe { result::memset_d8_sync(self.ptr, value, self.bytes) }
            .map_err(|e| device_error("cuMemsetD8", e))
    }
}

impl Drop for DeviceAllocation {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return; // moved out by `take`
        }
        let freed = self.context.bind().and_then(|()| {
            if let Some(stream) = &self.pooled {
                // SAFETY: `ptr` came from cuMemAllocAsync on `stream` in this context, which
                // `pooled` keeps alive; the free is ordered after the allocation and after
                // every use (all on that stream), whether or not the host synchronized.
                unsafe { result::free_async(self.ptr, stream.raw) }
                    .map_err(|e| device_error("cuMemFreeAsync", e))
            } else {
                // SAFETY: `ptr` came from cuMemAlloc in this context and no copy can still use
                // it: copies borrow the allocation until their stream synchronized.
                unsafe { result::free_sync(self.ptr) }.map_err(|e| device_error("cuMemFree", e))
            }
        });
        if let Err(error) = freed {
            tracing::warn!(%error, "freeing device memory failed");
        }
    }
}

/// Page-locked, CPU-cacheable host memory: mapped by this process, then registered with the
/// driver (`cuMemHostRegister`); unregistered and unmapped on drop.
///
/// Pinned as `cuMemHostAlloc`'s is, but in two steps, so that the slow one holds no driver
/// lock: `cuMemHostAlloc` faults in, zeroes and pins every page inside the driver, where every
/// other driver call of the process waits for it (697 ms for 1 GiB on the H200 machine). Here
/// the calling thread has the pages faulted in first (on its NUMA node, since that thread
/// touches them first), as transparent huge pages where the kernel allows, and registering
/// them then took the driver 53 ms for the same GiB; several threads can pin at once. A copy
/// must not span two registrations (the driver refuses it), so each buffer is one. Where the
/// driver cannot register host memory (`CUDA_ERROR_NOT_SUPPORTED`), it allocates it instead
/// (`cuMemHostAlloc`), as before.
#[derive(Debug)]
pub(super) struct PinnedBuffer {
    ptr: NonNull<u8>,
    bytes: usize,
    memory: PinnedMemory,
}

/// Where a [`PinnedBuffer`]'s memory comes from, and how it goes back.
#[derive(Debug)]
enum PinnedMemory {
    /// This process's mapping of `mapped` bytes (`bytes`, at least 1), registered in `context`
    /// while it is `Some` (unregistered before the mapping is unmapped).
    Mapped {
        mapped: usize,
        registered: Option<Arc<Context>>,
    },
    /// `cuMemHostAlloc`'s, freed with `cuMemFreeHost` in `context`.
    Allocated { context: Arc<Context> },
}

// SAFETY: the buffer exclusively owns its memory; access goes through &/&mut self.
unsafe impl Send for PinnedBuffer {}
// SAFETY: shared access is read-only (`as_slice`), or, for a PinnedArena's memory, through
// the disjoint ranges of its blocks, each written by its one owner (`ArenaBlock`).
unsafe impl Sync for PinnedBuffer {}
impl RefUnwindSafe for PinnedBuffer {}

impl PinnedBuffer {
    /// Pinned memory for `context`'s GPU.
    pub(super) fn new(context: &Arc<Context>, bytes: usize) -> Result<Self, BackendError> {
        Self::pin(context, bytes, false)
    }

    /// Pinned memory every context of the process can copy to and from, not only `context`'s
    /// (portable): for what all the GPUs share.
    fn portable(context: &Arc<Context>, bytes: usize) -> Result<Self, BackendError> {
        Self::pin(context, bytes, true)
    }

    fn pin(context: &Arc<Context>, bytes: usize, portable: bool) -> Result<Self, BackendError> {
        /// Set once the driver has refused to register host memory: every later buffer is
        /// allocated by the driver at once, not mapped and faulted in only to be thrown away.
        static CANNOT_REGISTER: std::sync::atomic::AtomicBool =
            std::sync::atomic::AtomicBool::new(false);
        if CANNOT_REGISTER.load(std::sync::atomic::Ordering::Relaxed) {
            return Self::allocate(context, bytes, portable);
        }
        let mut buffer = Self::map(bytes)?;
        let PinnedMemory::Mapped { mapped, registered } = &mut buffer.memory else {
            return Err(BackendError::Device(
                "a mapping of host memory was not mapped".to_owned(),
            ));
        };
        context.bind()?;
        let flags = if portable {
            sys::CU_MEMHOSTREGISTER_PORTABLE
        } else {
            0
        };
        // SAFETY: the range is the buffer's whole mapping (whole pages), alive until `drop`,
        // which unregisters it before unmapping it; `flags` is 0 or PORTABLE (never DEVICEMAP
        // or IOMEMORY).
        match unsafe { sys::cuMemHostRegister_v2(buffer.ptr.as_ptr().cast(), *mapped, flags) }
            .result()
        {
            Ok(()) => {
                *registered = Some(Arc::clone(context));
                Ok(buffer)
            }
            Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_SUPPORTED)) => {
                drop(buffer);
                CANNOT_REGISTER.store(true, std::sync::atomic::Ordering::Relaxed);
                tracing::info!(
                    "the CUDA driver cannot register host memory: pinned memory comes from \
                     cuMemHostAlloc, which holds the driver while it pins"
                );
                Self::allocate(context, bytes, portable)
            }
            Err(error) => Err(device_error("cuMemHostRegister", error)),
        }
    }

    /// `bytes` of this process's memory in whole pages (at least one), faulted in by the
    /// calling thread.
    fn map(bytes: usize) -> Result<Self, BackendError> {
        use nix::sys::mman::{MapFlags, MmapAdvise, ProtFlags, madvise, mmap_anonymous};
        /// Every page is written once, at this stride, to fault it in: the smallest page size,
        /// so none is missed whatever the kernel backs them with. The mapping is whole pages
        /// of it too, which is what the driver registers.
        const PAGE: usize = 4096;
        let mapped = bytes
            .max(1)
            .checked_next_multiple_of(PAGE)
            .ok_or_else(|| BackendError::Device(format!("{bytes} bytes of host memory")))?;
        let length = std::num::NonZeroUsize::MIN.saturating_add(mapped - 1);
        // SAFETY: a new private anonymous mapping at an address the kernel chooses: it
        // overlaps nothing this process uses.
        let base = unsafe {
            mmap_anonymous(
                None,
                length,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_PRIVATE,
            )
        }
        .map_err(|e| BackendError::Device(format!("mapping {bytes} bytes of host memory: {e}")))?;
        // From here on, dropping `buffer` unmaps it.
        let buffer = Self {
            ptr: base.cast(),
            bytes,
            memory: PinnedMemory::Mapped {
                mapped,
                registered: None,
            },
        };
        // SAFETY: the range is the whole mapping made above; huge pages change only how its
        // pages are backed when first touched. Where they are off the call fails or does
        // nothing, and small pages are used: ignored.
        let _ = unsafe { madvise(base, mapped, MmapAdvise::MADV_HUGEPAGE) };
        // SAFETY: the same range; a child process, were one ever forked, gets none of it
        // rather than sharing the pages to be pinned copy-on-write. Only advice: ignored.
        let _ = unsafe { madvise(base, mapped, MmapAdvise::MADV_DONTFORK) };
        // Faulted in page by page, not with one `MADV_POPULATE_WRITE`: with that, a put sent
        // at start took 0.2 s beside the default GiB being pinned and 1.2-1.8 s beside 8 GiB,
        // against 6 ms this way (the other threads that map memory seem to wait for the whole
        // range: the process's memory map is busy meanwhile).
        for offset in (0..mapped).step_by(PAGE) {
            // SAFETY: `offset < mapped`, inside the mapping, which nothing else refers to yet;
            // anonymous memory reads as zero, so writing a zero changes nothing but faults the
            // page in.
            unsafe { buffer.ptr.as_ptr().add(offset).write_volatile(0) };
        }
        Ok(buffer)
    }

    /// `cuMemHostAlloc`'s pinned memory, for a driver that cannot register this process's.
    fn allocate(
        context: &Arc<Context>,
        bytes: usize,
        portable: bool,
    ) -> Result<Self, BackendError> {
        context.bind()?;
        let flags = if portable {
            sys::CU_MEMHOSTALLOC_PORTABLE
        } else {
            0
        };
        // SAFETY: the context is current; `flags` is 0 or PORTABLE, never WRITECOMBINED, so
        // this is plain (cacheable) pinned memory.
        let raw = unsafe { result::malloc_host(bytes.max(1), flags) }
            .map_err(|e| device_error("cuMemHostAlloc", e))?;
        let ptr = NonNull::new(raw.cast::<u8>())
            .ok_or_else(|| BackendError::Device("cuMemHostAlloc returned null".to_owned()))?;
        Ok(Self {
            ptr,
            bytes,
            memory: PinnedMemory::Allocated {
                context: Arc::clone(context),
            },
        })
    }

    pub(super) fn len(&self) -> usize {
        self.bytes
    }

    fn base(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub(super) fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `bytes` bytes we own, all of them initialized (a mapping
        // starts zeroed; the driver's pinned memory is ordinary host memory, its contents
        // unspecified but readable).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.bytes) }
    }

    pub(super) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.bytes) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        match &mut self.memory {
            PinnedMemory::Allocated { context } => {
                let freed = context.bind().and_then(|()| {
                    // SAFETY: `ptr` came from cuMemHostAlloc and is freed once, here; no copy
                    // can still use it (see CopyBatch, which borrows the memory until its
                    // stream is synchronized).
                    unsafe { result::free_host(self.ptr.as_ptr().cast()) }
                        .map_err(|e| device_error("cuMemFreeHost", e))
                });
                if let Err(error) = freed {
                    tracing::warn!(%error, "freeing pinned memory failed");
                }
            }
            PinnedMemory::Mapped { mapped, registered } => {
                if let Some(context) = registered.take() {
                    let unregistered = context.bind().and_then(|()| {
                        // SAFETY: registered once, in `pin`; no copy can still use it (as
                        // above).
                        unsafe { sys::cuMemHostUnregister(self.ptr.as_ptr().cast()) }
                            .result()
                            .map_err(|e| device_error("cuMemHostUnregister", e))
                    });
                    if let Err(error) = unregistered {
                        // Unmapping memory the driver may still have pinned would leave it
                        // pinned to no one and its addresses free for reuse: leak it instead.
                        tracing::warn!(%error, "unregistering pinned host memory failed; left mapped");
                        return;
                    }
                }
                // SAFETY: the whole mapping made in `map`, unmapped once; nothing refers to it.
                if let Err(error) = unsafe { nix::sys::mman::munmap(self.ptr.cast(), *mapped) } {
                    tracing::warn!(%error, "unmapping host memory failed");
                }
            }
        }
    }
}

/// Host memory pinned once, at startup, that `DoPut` bodies are copied into, spills and reads
/// copy into straight from the device, and uploads copy from, handed out in
/// blocks ([`ArenaBlock`]; the bookkeeping is [`Ranges`]). Portable: every GPU's context
/// copies to and from it.
#[derive(Debug)]
pub(super) struct PinnedArena {
    memory: PinnedBuffer,
    ranges: Mutex<Ranges>,
}

impl PinnedArena {
    pub(super) fn new(context: &Arc<Context>, bytes: usize) -> Result<Arc<Self>, BackendError> {
        let memory = PinnedBuffer::portable(context, bytes)?;
        Ok(Arc::new(Self {
            ranges: Mutex::new(Ranges::new(memory.len())),
            memory,
        }))
    }

    pub(super) fn len(&self) -> usize {
        self.memory.len()
    }

    /// Bytes of blocks in use.
    pub(super) fn used(&self) -> usize {
        self.lock().used()
    }

    /// A block of `len` bytes, or `None` where no free range holds one.
    pub(super) fn take(self: &Arc<Self>, len: usize) -> Option<ArenaBlock> {
        self.take_within(len, usize::MAX)
    }

    /// A block of `len` bytes, or `None` where no free range holds one or the blocks in use
    /// would then hold more than `most` bytes.
    pub(super) fn take_within(self: &Arc<Self>, len: usize, most: usize) -> Option<ArenaBlock> {
        let range = self.lock().take(len, most)?;
        Some(ArenaBlock {
            arena: Arc::clone(self),
            range,
            len,
        })
    }

    /// Whether `bytes` lie in one block of this arena that is in use (and so are pinned).
    pub(super) fn holds(&self, bytes: &[u8]) -> bool {
        let start = bytes.as_ptr() as usize;
        start
            .checked_add(bytes.len())
            .is_some_and(|end| self.holds_addresses(start..end))
    }

    /// Whether the host addresses `span` (end exclusive) lie in one block in use.
    pub(super) fn holds_addresses(&self, span: std::ops::Range<usize>) -> bool {
        let base = self.memory.base() as usize;
        match (span.start.checked_sub(base), span.end.checked_sub(base)) {
            (Some(start), Some(end)) if start <= end => {
                self.lock().block_holding(&(start..end)).is_some()
            }
            _ => false,
        }
    }

    /// The bytes from the start of `first` to the end of `last`, the bytes between them
    /// included, where that span lies in one block of this arena that is in use.
    pub(super) fn span<'s>(&self, first: &'s [u8], last: &'s [u8]) -> Option<&'s [u8]> {
        let base = self.memory.base() as usize;
        let start = (first.as_ptr() as usize).checked_sub(base)?;
        let end = (last.as_ptr() as usize)
            .checked_sub(base)?
            .checked_add(last.len())?;
        if end < start {
            return None;
        }
        self.lock().block_holding(&(start..end))?;
        // SAFETY: `start..end` lies inside one block in use (checked under the lock), so inside
        // the arena's allocation, and pinned memory holds valid `u8`s (see
        // `ArenaBlock::as_mut_slice`). That block stays in use, and unwritten, for `'s`: `first`
        // lies in it, and a block is written only by its one owner before it is shared, and
        // goes back only when the last buffer over it is dropped.
        Some(unsafe { std::slice::from_raw_parts(self.memory.base().add(start), end - start) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ranges> {
        self.ranges.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A block of a [`PinnedArena`]: written by its one owner ([`as_mut_slice`](Self::as_mut_slice)),
/// then shared read-only as an Arrow buffer ([`into_buffer`](Self::into_buffer)). Its range goes
/// back to the arena when it is dropped, which for a buffer is when the last slice of it is.
#[derive(Debug)]
pub(super) struct ArenaBlock {
    arena: Arc<PinnedArena>,
    /// The block, relative to the arena's base: `len` rounded up to the block alignment.
    range: std::ops::Range<usize>,
    len: usize,
}

impl ArenaBlock {
    /// The length asked for.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// The block's first `len` bytes (the length asked for).
    pub(super) fn as_mut_slice(&mut self) -> &mut [u8] {
        let base = self.arena.memory.base();
        // SAFETY: `range` (which holds `len` bytes) lies inside the arena's allocation:
        // `Ranges` hands out ranges of `0..memory.len()` only, disjoint from every other block
        // in use, and takes one back only when its block is dropped; `&mut self` makes this
        // the only access to it. Pinned memory is ordinary, initialized host memory (contents
        // unspecified), so any bytes there are valid `u8`s.
        unsafe { std::slice::from_raw_parts_mut(base.add(self.range.start), self.len) }
    }

    /// The block's bytes as an Arrow buffer, without a copy. The owner has written every one
    /// of its `len` bytes first: what `PinnedArena::span` hands out between two buffers of the
    /// block is read as the owner wrote it (the message body, the spilled image).
    pub(super) fn into_buffer(mut self) -> Buffer {
        let slice = self.as_mut_slice();
        let len = slice.len();
        let ptr = NonNull::from(slice).cast::<u8>();
        // SAFETY: `ptr..ptr+len` is the block's (see `as_mut_slice`), which the block, as the
        // buffer's owner, keeps out of every other hand until the buffer and all its slices
        // are dropped; nothing writes to it once it is shared.
        unsafe { Buffer::from_custom_allocation(ptr, len, Arc::new(self)) }
    }
}

impl Drop for ArenaBlock {
    fn drop(&mut self) {
        self.arena.lock().give_back(self.range.clone());
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

/// `range` of `buffer` as a buffer of its own, whose capacity is its length, keeping all of
/// `buffer`'s memory alive: a slice of a shared buffer reports the whole of it as its capacity,
/// and what Arrow says an array holds (which arrow-flight's encoder splits batches by) is then
/// that of everything it shares memory with.
pub(super) fn own_slice(buffer: &Buffer, range: std::ops::Range<usize>) -> Buffer {
    let slice = &buffer.as_slice()[range];
    let ptr = NonNull::from(slice).cast::<u8>();
    let len = slice.len();
    // SAFETY: `ptr..ptr+len` lies inside `buffer`'s memory, which the clone the new buffer owns
    // keeps alive; nobody writes an Arrow buffer's memory once it is shared.
    unsafe { Buffer::from_custom_allocation(ptr, len, Arc::new(buffer.clone())) }
}

/// A host buffer of `len` bytes (64-byte aligned) that `write` fills without its being zeroed
/// first: the global allocator (mimalloc) clears reused memory on one core at about 100 ms a
/// GiB, more than a spill's whole copy of it. `write` gets the uninitialized bytes and returns
/// the pieces it wrote, as initialized slices of them ([`write_bytes`]); they must cover the buffer exactly,
/// or the buffer is dropped unread and this fails.
pub(super) fn host_buffer_written<E>(
    len: usize,
    write: impl for<'a> FnOnce(&'a mut [MaybeUninit<u8>]) -> Result<Vec<&'a mut [u8]>, E>,
    incomplete: impl FnOnce() -> E,
) -> Result<Buffer, E> {
    let mut buffer = MutableBuffer::with_capacity(len);
    let base = buffer.as_mut_ptr();
    // SAFETY: the allocation holds at least `len` bytes (its capacity) and nothing else refers
    // to them while the slice lives; `MaybeUninit` makes no claim about their contents.
    let uninit = unsafe { std::slice::from_raw_parts_mut(base.cast::<MaybeUninit<u8>>(), len) };
    let mut written = Vec::new();
    for piece in write(uninit)? {
        let Some(start) = (piece.as_ptr() as usize).checked_sub(base as usize) else {
            return Err(incomplete());
        };
        written.push((start, piece.len()));
    }
    written.sort_unstable();
    let mut covered = 0;
    for (start, piece) in written {
        if start != covered {
            return Err(incomplete());
        }
        covered += piece;
    }
    if covered != len {
        return Err(incomplete());
    }
    // SAFETY: every byte of `0..len` lies in a slice `write` returned as `&mut [u8]`, which
    // safe code can only make of bytes it has written (checked above: the slices tile the
    // range exactly), and `len` is within the capacity.
    unsafe { buffer.set_len(len) };
    Ok(buffer.into())
}

/// Copies `source` into `target` (of the same length) and returns `target` as the bytes it
/// now holds (`<[MaybeUninit<u8>]>::write_copy_of_slice`, which needs Rust 1.93).
///
/// # Panics
/// Where the lengths differ: a caller's bug.
pub(super) fn write_bytes<'a>(target: &'a mut [MaybeUninit<u8>], source: &[u8]) -> &'a mut [u8] {
    assert_eq!(target.len(), source.len(), "a copy between unequal ranges");
    // SAFETY: both ranges are `source.len()` bytes long (checked) and cannot overlap (one is
    // borrowed mutably); after the copy every byte of `target` is initialized, so viewing it
    // as `[u8]` for the same lifetime is sound.
    unsafe {
        std::ptr::copy_nonoverlapping(
            source.as_ptr(),
            target.as_mut_ptr().cast::<u8>(),
            source.len(),
        );
        std::slice::from_raw_parts_mut(target.as_mut_ptr().cast::<u8>(), target.len())
    }
}

/// `len` zero bytes from the system allocator, as an Arrow buffer that costs nothing until it
/// is read: for large sizes `calloc` maps fresh pages, which the kernel zeroes only when they
/// are touched (the global allocator, mimalloc, reuses freed memory and clears it: 100 ms a
/// GiB). For stand-ins that validation measures but never reads (`ingest`).
pub(super) fn untouched_zeroes(len: usize) -> Buffer {
    use std::alloc::{GlobalAlloc, Layout, System};

    /// Memory from `System.alloc_zeroed`, returned to it on drop.
    struct Zeroes {
        ptr: NonNull<u8>,
        layout: Layout,
    }
    // SAFETY: the memory is only ever read (through the Buffer), from any thread.
    unsafe impl Send for Zeroes {}
    // SAFETY: as above.
    unsafe impl Sync for Zeroes {}
    impl RefUnwindSafe for Zeroes {}
    impl Drop for Zeroes {
        fn drop(&mut self) {
            // SAFETY: `ptr` came from `System.alloc_zeroed(layout)` and is freed once, here.
            unsafe { System.dealloc(self.ptr.as_ptr(), self.layout) }
        }
    }

    // No more than malloc's own alignment (16 bytes, enough for every Arrow type): a larger
    // one makes the system allocator align and clear the memory itself, touching every page.
    let Ok(layout) = Layout::from_size_align(len.max(1), 16) else {
        return Buffer::from(arrow::buffer::MutableBuffer::from_len_zeroed(len));
    };
    // SAFETY: `layout` has a non-zero size.
    let Some(ptr) = NonNull::new(unsafe { System.alloc_zeroed(layout) }) else {
        return Buffer::from(arrow::buffer::MutableBuffer::from_len_zeroed(len));
    };
    let owner = Arc::new(Zeroes { ptr, layout });
    // SAFETY: `ptr..ptr+len` is zeroed memory that `owner` keeps allocated for as long as the
    // Buffer exists, and nobody writes to it.
    unsafe { Buffer::from_custom_allocation(ptr, len, owner) }
}

/// A CUDA stream of this context.
#[derive(Debug)]
pub(super) struct Stream {
    raw: sys::CUstream,
    context: Arc<Context>,
    /// Owns the stream: destroyed when this and every scratch allocation made on it are gone.
    handle: Arc<StreamHandle>,
}

/// The stream's handle, destroyed on drop.
#[derive(Debug)]
pub(super) struct StreamHandle {
    raw: sys::CUstream,
    context: Arc<Context>,
}

// SAFETY: stream handles may be used from any thread (the context is bound per call).
unsafe impl Send for Stream {}
// SAFETY: as above; the handle is only read.
unsafe impl Send for StreamHandle {}
// SAFETY: as above.
unsafe impl Sync for StreamHandle {}

impl Stream {
    pub(super) fn new(context: &Arc<Context>) -> Result<Self, BackendError> {
        context.bind()?;
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|e| device_error("cuStreamCreate", e))?;
        Ok(Self {
            raw,
            context: Arc::clone(context),
            handle: Arc::new(StreamHandle {
                raw,
                context: Arc::clone(context),
            }),
        })
    }

    /// Runs `queue` to queue asynchronous copies (and launches) on this stream, then waits
    /// until they have all completed, whether `queue` succeeded, failed or panicked. The batch
    /// exists only inside this call, so it cannot be leaked (`mem::forget`) to end the borrows
    /// of its buffers while the device still uses them.
    pub(super) fn copies<'a, T>(
        &'a mut self,
        queue: impl FnOnce(&mut CopyBatch<'a>) -> Result<T, BackendError>,
    ) -> Result<T, BackendError> {
        self.context.bind()?;
        let mut batch = CopyBatch {
            stream: self,
            synchronized: false,
            _borrows: PhantomData,
        };
        // A panic in `queue` unwinds through `batch`, whose drop synchronizes.
        let queued = queue(&mut batch);
        let synchronized = batch.synchronize();
        batch.synchronized = true;
        match (queued, synchronized) {
            (Ok(value), Ok(())) => Ok(value),
            (Ok(_), Err(error)) => Err(error),
            (Err(error), synchronized) => {
                if let Err(sync_error) = synchronized {
                    tracing::warn!(%sync_error, "synchronizing after a failed copy batch failed");
                }
                Err(error)
            }
        }
    }
}

impl Drop for StreamHandle {
    fn drop(&mut self) {
        let destroyed = self.context.bind().and_then(|()| {
            // SAFETY: `raw` was created in this context and nothing else holds it: the
            // `Stream` and every scratch allocation freed on it are gone (work they queued
            // still completes: destroying a stream does not cancel it).
            unsafe { result::stream::destroy(self.raw) }
                .map_err(|e| device_error("cuStreamDestroy", e))
        });
        if let Err(error) = destroyed {
            tracing::warn!(%error, "destroying a stream failed");
        }
    }
}

/// A concatenation's task table as the host built it (see `concat`).
#[derive(Debug, Clone, Copy)]
pub(super) struct ConcatTable<'t> {
    pub(super) tasks: &'t [ConcatTask],
    pub(super) owners: &'t [TaskOwners],
    pub(super) unit_starts: &'t [u64],
    pub(super) maps: &'t [u64],
}

/// Asynchronous copies queued on one stream, only ever lent out by [`Stream::copies`].
/// Everything a copy touches is borrowed for `'a`, and `copies` synchronizes the stream
/// before it returns (the drop does, if a panic unwinds through it), so a buffer can never be
/// freed, reused or read while a copy still runs.
#[derive(Debug)]
pub(super) struct CopyBatch<'a> {
    stream: &'a mut Stream,
    synchronized: bool,
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

    /// Queues a host-to-device copy of `src`, host memory a [`PinnedArena`] block holds, to
    /// `dst` at byte `offset`. (Pageable memory would be copied too, by the driver, through
    /// its own staging, before the call returns: correct, only slow.)
    pub(super) fn copy_arena_to_device(
        &mut self,
        dst: &'a DeviceAllocation,
        offset: usize,
        src: &'a [u8],
    ) -> Result<(), BackendError> {
        check_device_range(dst, offset, src.len())?;
        // SAFETY: the destination range lies inside `dst` (checked); the source is borrowed,
        // like `dst`, until the stream is synchronized.
        unsafe { result::memcpy_htod_async(dst.ptr + offset as u64, src, self.stream.raw) }
            .map_err(|e| device_error("cuMemcpyHtoDAsync", e))
    }

    /// Queues a copy of `len` bytes from `src` at `src_offset` to `dst` at `dst_offset`.
    pub(super) fn copy_within_device(
        &mut self,
        dst: &'a DeviceAllocation,
        dst_offset: usize,
        src: &'a DeviceAllocation,
        src_offset: usize,
        len: usize,
    ) -> Result<(), BackendError> {
        check_device_range(dst, dst_offset, len)?;
        check_device_range(src, src_offset, len)?;
        // SAFETY: both ranges lie inside their allocations (checked), which stay borrowed
        // until the stream is synchronized.
        unsafe {
            result::memcpy_dtod_async(
                dst.ptr + dst_offset as u64,
                src.ptr + src_offset as u64,
                len,
                self.stream.raw,
            )
        }
        .map_err(|e| device_error("cuMemcpyDtoDAsync", e))
    }

    /// Queues a copy of `len` bytes at `src_offset` of another process's allocation, mapped
    /// in this context, to `dst` at `dst_offset`.
    pub(super) fn copy_from_mapping(
        &mut self,
        dst: &'a DeviceAllocation,
        dst_offset: usize,
        src: &'a IpcMapping,
        src_offset: usize,
        len: usize,
    ) -> Result<(), BackendError> {
        check_device_range(dst, dst_offset, len)?;
        if src_offset
            .checked_add(len)
            .is_none_or(|end| end > src.bytes)
        {
            return Err(BackendError::Device(format!(
                "copy of {len} bytes at {src_offset} exceeds a mapped allocation of {} bytes",
                src.bytes
            )));
        }
        // SAFETY: the destination range lies inside `dst` and the source range inside the
        // mapped allocation, as large as the driver reported it (both checked); both stay
        // borrowed until the stream is synchronized. A producer that frees its memory before
        // the mapping is closed breaks CUDA's IPC contract (undefined by the driver's
        // documentation): the protocol requires it to wait for the call's answer, and the
        // server's own memory is only ever the copy's destination.
        unsafe {
            result::memcpy_dtod_async(
                dst.ptr + dst_offset as u64,
                src.ptr + src_offset as u64,
                len,
                self.stream.raw,
            )
        }
        .map_err(|e| device_error("cuMemcpyDtoDAsync", e))
    }

    /// Queues a copy of `len` bytes from `src` at `src_offset`, on any GPU, to `dst` at
    /// `dst_offset`, on any GPU (`cuMemcpyPeerAsync`: direct where peer access is enabled,
    /// through host memory by the driver otherwise).
    pub(super) fn copy_between_devices(
        &mut self,
        dst: &'a DeviceAllocation,
        dst_offset: usize,
        src: &'a DeviceAllocation,
        src_offset: usize,
        len: usize,
    ) -> Result<(), BackendError> {
        check_device_range(dst, dst_offset, len)?;
        check_device_range(src, src_offset, len)?;
        // SAFETY: both ranges lie inside their allocations (checked), each named with the
        // context it was allocated in; both stay borrowed until the stream is synchronized.
        unsafe {
            sys::cuMemcpyPeerAsync(
                dst.ptr + dst_offset as u64,
                dst.context.raw,
                src.ptr + src_offset as u64,
                src.context.raw,
                len,
                self.stream.raw,
            )
        }
        .result()
        .map_err(|e| device_error("cuMemcpyPeerAsync", e))
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
        // callers pass slices of a PinnedBuffer or an ArenaBlock), borrowed until the stream
        // synchronized.
        unsafe { result::memcpy_dtoh_async(dst, src.ptr + offset as u64, self.stream.raw) }
            .map_err(|e| device_error("cuMemcpyDtoHAsync", e))
    }

    /// Queues the concatenation kernel over `table.tasks`, after checking that every range a
    /// task reads lies in its source allocation (or, for key maps, in `table.maps`) and every
    /// range it writes lies in its destination allocation (`table.owners` names both): with
    /// that, and the borrows held until the stream synchronized, the launch cannot touch
    /// memory it does not own. `device_table` holds the
    /// tasks, then the unit starts, then the maps, copied there earlier in this batch.
    pub(super) fn launch_concat(
        &mut self,
        kernel: &'a Kernel,
        device_table: &'a DeviceAllocation,
        table: ConcatTable<'_>,
        sources: &[&'a DeviceAllocation],
        destinations: &[&'a DeviceAllocation],
    ) -> Result<(), BackendError> {
        let ConcatTable {
            tasks,
            owners,
            unit_starts,
            maps,
        } = table;
        let tasks_bytes = std::mem::size_of_val(tasks) as u64;
        let starts_bytes = std::mem::size_of_val(unit_starts) as u64;
        let table_bytes = tasks_bytes + starts_bytes + std::mem::size_of_val(maps) as u64;
        if (device_table.bytes() as u64) < table_bytes
            || unit_starts.len() != tasks.len() + 1
            || owners.len() != tasks.len()
        {
            return Err(BackendError::Device(
                "malformed concatenation task table".to_owned(),
            ));
        }
        let span = |allocation: &&DeviceAllocation| {
            allocation.ptr..allocation.ptr + allocation.bytes as u64
        };
        for (task, owners) in tasks.iter().zip(owners) {
            let source = sources.get(owners.source as usize).map(span);
            let destination = destinations.get(owners.destination as usize).map(span);
            abi::check_task(task, source, destination, maps.len() as u64)?;
        }
        let total_units = unit_starts.last().copied().unwrap_or(0);
        if total_units == 0 {
            return Ok(());
        }
        let grid = abi::grid(total_units);
        let mut tasks_address = device_table.ptr;
        let mut starts_address = device_table.ptr + tasks_bytes;
        let mut maps_address = device_table.ptr + tasks_bytes + starts_bytes;
        let mut task_count = u32::try_from(tasks.len())
            .map_err(|_| BackendError::Device("too many concatenation tasks".to_owned()))?;
        let mut units = total_units;
        let mut params = kernel_params![
            tasks_address,
            starts_address,
            maps_address,
            task_count,
            units
        ];
        // SAFETY: the parameters match the kernel's signature (three device pointers, u32,
        // u64); every address a task touches was checked above to lie in memory this batch
        // borrows until the stream synchronizes; the table was copied in earlier on the same
        // stream.
        unsafe {
            result::launch_kernel(
                kernel.function,
                (grid, 1, 1),
                (abi::BLOCK, 1, 1),
                0,
                self.stream.raw,
                &mut params,
            )
        }
        .map_err(|e| device_error("cuLaunchKernel", e))
    }

    fn synchronize(&self) -> Result<(), BackendError> {
        // SAFETY: the stream is alive for 'a.
        unsafe { result::stream::synchronize(self.stream.raw) }
            .map_err(|e| device_error("cuStreamSynchronize", e))
    }
}

impl Drop for CopyBatch<'_> {
    fn drop(&mut self) {
        if !self.synchronized
            && let Err(error) = self.synchronize()
        {
            tracing::warn!(%error, "synchronizing a copy batch after a panic failed");
        }
    }
}

/// Another process's allocation, mapped into this one from its IPC handle; unmapped on drop.
#[derive(Debug)]
pub(super) struct IpcMapping {
    ptr: sys::CUdeviceptr,
    /// The mapped allocation's size, as the driver reports it.
    bytes: usize,
    context: Arc<Context>,
}

// SAFETY: the mapping is a device address valid in the context from any thread.
unsafe impl Send for IpcMapping {}
// SAFETY: shared access only reads (copies out).
unsafe impl Sync for IpcMapping {}

/// Whose failure it is that an IPC handle did not open, told from the driver's error: what
/// `ipc-import` answers a producer depends on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum OpenFailure {
    /// The handle maps nothing this process may open: forged, stale (its memory freed, its
    /// process gone), this process's own (`CUDA_ERROR_INVALID_CONTEXT`: the driver's rule), or
    /// of a GPU this one cannot reach.
    Handle,
    /// This GPU lacks what a mapping takes now (memory, peer mappings): the server's state.
    Exhausted,
    /// The driver failed otherwise.
    Driver,
}

impl OpenFailure {
    /// The failure `cuIpcOpenMemHandle`'s `error` means.
    pub(super) fn of(error: sys::CUresult) -> Self {
        use sys::cudaError_enum as E;
        match error {
            E::CUDA_ERROR_INVALID_VALUE
            | E::CUDA_ERROR_INVALID_HANDLE
            | E::CUDA_ERROR_INVALID_CONTEXT
            | E::CUDA_ERROR_INVALID_DEVICE
            | E::CUDA_ERROR_MAP_FAILED
            | E::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED => Self::Handle,
            E::CUDA_ERROR_OUT_OF_MEMORY | E::CUDA_ERROR_TOO_MANY_PEERS => Self::Exhausted,
            _ => Self::Driver,
        }
    }
}

/// Why [`IpcMapping::open`] failed: whose failure it is, and the driver's words. A plain
/// device error where the caller need not tell them apart.
#[derive(Debug)]
pub(super) struct MappingError {
    pub(super) failure: OpenFailure,
    pub(super) error: BackendError,
}

impl From<MappingError> for BackendError {
    fn from(error: MappingError) -> Self {
        error.error
    }
}

impl IpcMapping {
    pub(super) fn open(context: &Arc<Context>, handle: &[u8; 64]) -> Result<Self, MappingError> {
        let driver = |error| MappingError {
            failure: OpenFailure::Driver,
            error,
        };
        context.bind().map_err(driver)?;
        let handle = sys::CUipcMemHandle {
            reserved: handle.map(|b| b as std::ffi::c_char),
        };
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `handle` is 64 bytes as the driver expects; an invalid one is refused with
        // an error, not undefined behaviour. The mapping is closed exactly once, on drop.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                handle,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result()
        .map_err(|e| MappingError {
            failure: OpenFailure::of(e.0),
            error: device_error("cuIpcOpenMemHandle", e),
        })?;
        let mut mapping = Self {
            ptr,
            bytes: 0,
            context: Arc::clone(context),
        };
        // Closed by the drop if this fails.
        let (base, bytes) = allocation_range(context, ptr).map_err(driver)?;
        if base != ptr {
            return Err(driver(BackendError::Device(
                "an IPC handle mapped somewhere other than its allocation's base".to_owned(),
            )));
        }
        mapping.bytes = bytes;
        Ok(mapping)
    }

    pub(super) fn address(&self) -> u64 {
        self.ptr
    }

    /// The mapped allocation's size, as the driver reports it: what its handle really maps,
    /// whatever the document that named it says.
    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Copies `dst.len()` bytes from `offset` of the mapping. The caller vouches that the
    /// range lies in the exported allocation (its size comes with the handle); the driver
    /// reports an error for addresses outside any mapping.
    pub(super) fn copy_to_host(&self, offset: u64, dst: &mut [u8]) -> Result<(), BackendError> {
        self.context.bind()?;
        // SAFETY: `dst` is writable for its length; the source is device memory of this
        // mapping, alive for `&self`.
        unsafe { result::memcpy_dtoh_sync(dst, self.ptr + offset) }
            .map_err(|e| device_error("cuMemcpyDtoH", e))
    }
}

/// The base and size of the device allocation that contains `address` in this context, as
/// `cuMemGetAddressRange` reports them; an error for an address in no allocation.
pub(super) fn allocation_range(
    context: &Context,
    address: u64,
) -> Result<(u64, usize), BackendError> {
    context.bind()?;
    let mut base: sys::CUdeviceptr = 0;
    let mut bytes: usize = 0;
    // SAFETY: the driver only looks `address` up (an unknown one is an error, not undefined
    // behaviour) and writes one value into each out-parameter.
    unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut bytes, address) }
        .result()
        .map_err(|e| device_error("cuMemGetAddressRange", e))?;
    Ok((base, bytes))
}

/// The IPC handle of the allocation whose base is `base` in this context. Fails for memory
/// that cannot be exported, as stream-ordered pool memory (`cudaMallocAsync`) cannot.
pub(super) fn ipc_handle_of(context: &Context, base: u64) -> Result<[u8; 64], BackendError> {
    context.bind()?;
    let mut handle = std::mem::MaybeUninit::<sys::CUipcMemHandle>::uninit();
    // SAFETY: the driver checks `base` (memory it cannot export is an error, not undefined
    // behaviour) and fills `handle` when it succeeds.
    unsafe { sys::cuIpcGetMemHandle(handle.as_mut_ptr(), base) }
        .result()
        .map_err(|e| device_error("cuIpcGetMemHandle", e))?;
    // SAFETY: initialized by the successful call above.
    let handle = unsafe { handle.assume_init() };
    Ok(handle.reserved.map(|c| c as u8))
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        let closed = self.context.bind().and_then(|()| {
            // SAFETY: `ptr` came from cuIpcOpenMemHandle and is closed once, here.
            unsafe { sys::cuIpcCloseMemHandle(self.ptr) }
                .result()
                .map_err(|e| device_error("cuIpcCloseMemHandle", e))
        });
        if let Err(error) = closed {
            tracing::warn!(%error, "closing an IPC mapping failed");
        }
    }
}

/// A device kernel, loaded once from PTX and unloaded on drop.
#[derive(Debug)]
pub(super) struct Kernel {
    /// Owns the code `function` runs.
    _module: Module,
    function: sys::CUfunction,
}

/// A PTX module, JIT-compiled for one device, unloaded on drop.
#[derive(Debug)]
struct Module {
    raw: sys::CUmodule,
    context: Arc<Context>,
}

// SAFETY: module handles may be used from any thread of the context.
unsafe impl Send for Module {}
// SAFETY: as above; looking up functions does not mutate the handle.
unsafe impl Sync for Module {}

impl Module {
    fn load(context: &Arc<Context>, ptx: &str) -> Result<Self, BackendError> {
        context.bind()?;
        let image = std::ffi::CString::new(ptx)
            .map_err(|_| BackendError::Device("PTX contains a NUL byte".to_owned()))?;
        // SAFETY: `image` is a NUL-terminated PTX string that outlives the call.
        let raw = unsafe { result::module::load_data(image.as_ptr().cast()) }
            .map_err(|e| device_error("cuModuleLoadData", e))?;
        Ok(Self {
            raw,
            context: Arc::clone(context),
        })
    }

    fn function(&self, name: &str) -> Result<sys::CUfunction, BackendError> {
        let function_name = std::ffi::CString::new(name)
            .map_err(|_| BackendError::Device("kernel name contains a NUL byte".to_owned()))?;
        self.context.bind()?;
        // SAFETY: `raw` is a module loaded in this context, alive as long as `self`.
        unsafe { result::module::get_function(self.raw, function_name) }
            .map_err(|e| device_error("cuModuleGetFunction", e))
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        let unloaded = self.context.bind().and_then(|()| {
            // SAFETY: launches borrow their kernels (which own the module) until their stream
            // synchronized, so nothing runs code of this module any more.
            unsafe { result::module::unload(self.raw) }
                .map_err(|e| device_error("cuModuleUnload", e))
        });
        if let Err(error) = unloaded {
            tracing::warn!(%error, "unloading a kernel module failed");
        }
    }
}

// SAFETY: module and function handles may be used from any thread of the context.
unsafe impl Send for Kernel {}
// SAFETY: as above; launching does not mutate the handles.
unsafe impl Sync for Kernel {}

impl Kernel {
    /// JIT-compiles `ptx` for this device and looks up function `name`.
    pub(super) fn load(
        context: &Arc<Context>,
        ptx: &str,
        name: &str,
    ) -> Result<Self, BackendError> {
        let module = Module::load(context, ptx)?;
        let function = module.function(name)?;
        Ok(Self {
            _module: module,
            function,
        })
    }
}

/// The filter kernels of `kernels/filter.cu`, loaded once per device.
#[derive(Debug)]
pub(super) struct FilterKernels {
    _module: Module,
    filter: sys::CUfunction,
    scan: sys::CUfunction,
    string_bytes: sys::CUfunction,
    gather_fixed: sys::CUfunction,
    gather_bits: sys::CUfunction,
    gather_strings: sys::CUfunction,
}

// SAFETY: module and function handles may be used from any thread of the context.
unsafe impl Send for FilterKernels {}
// SAFETY: as above; launching does not mutate the handles.
unsafe impl Sync for FilterKernels {}

impl FilterKernels {
    pub(super) fn load(context: &Arc<Context>, ptx: &str) -> Result<Self, BackendError> {
        let module = Module::load(context, ptx)?;
        Ok(Self {
            filter: module.function("gpu_flight_filter")?,
            scan: module.function("gpu_flight_scan")?,
            string_bytes: module.function("gpu_flight_string_bytes")?,
            gather_fixed: module.function("gpu_flight_gather_fixed")?,
            gather_bits: module.function("gpu_flight_gather_bits")?,
            gather_strings: module.function("gpu_flight_gather_strings")?,
            _module: module,
        })
    }
}

/// Bytes `offset..offset + len` of a device allocation, as a kernel's argument.
#[derive(Debug, Clone, Copy)]
pub(super) struct Span<'a> {
    pub(super) allocation: &'a DeviceAllocation,
    pub(super) offset: usize,
    pub(super) len: usize,
}

impl Span<'_> {
    /// The span's device address, once it is known to lie in its allocation, to hold at least
    /// `needed` bytes, and to be aligned to `align` bytes.
    fn address(&self, needed: usize, align: u64, what: &str) -> Result<u64, BackendError> {
        check_device_range(self.allocation, self.offset, self.len)?;
        let address = self.allocation.ptr + self.offset as u64;
        if self.len < needed || !address.is_multiple_of(align) {
            return Err(BackendError::Device(format!(
                "{what}: {} bytes at {address:#x} where the kernel needs {needed}, aligned to \
                 {align}",
                self.len
            )));
        }
        Ok(address)
    }
}

/// A column a filter reads: its values (or bits) and validity from row 0 of the partition.
#[derive(Debug, Clone, Copy)]
pub(super) struct FilterInput<'a> {
    /// Values, string offsets, or dictionary keys, from row 0 of the partition.
    pub(super) values: Span<'a>,
    pub(super) validity: Option<Span<'a>>,
    /// Strings' bytes: the column's, or its dictionary's.
    pub(super) data: Option<Span<'a>>,
    /// A dictionary's string offsets, and how many strings it holds.
    pub(super) dictionary: Option<(Span<'a>, usize)>,
    pub(super) column: ColumnType,
}

impl FilterInput<'_> {
    /// The kernel's record of this column for reads of rows up to `end`, once every extent
    /// the kernel may touch is checked.
    fn record(&self, end: usize) -> Result<FilterColumn, BackendError> {
        let (kind, aux) = filter_abi::column_code(self.column);
        let mut record = FilterColumn {
            kind,
            aux,
            ..FilterColumn::default()
        };
        record.validity = match self.validity {
            Some(span) => span.address(bitmap_bytes(end), 1, "filtered validity")?,
            None => 0,
        };
        let data = |data: Option<Span<'_>>| {
            data.ok_or_else(|| BackendError::Device("filtered strings without bytes".to_owned()))
                .and_then(|span| Ok((span.address(0, 1, "filtered strings")?, span.len as u64)))
        };
        match self.column {
            ColumnType::Key(key) => {
                let (needed, align) = match key.width() {
                    Some(width) => (end * width, width.min(8) as u64),
                    None => (bitmap_bytes(end), 1),
                };
                record.values = self.values.address(needed, align, "filtered values")?;
            }
            ColumnType::Strings { offsets } => {
                let needed = (end + 1) * offsets;
                record.values = self
                    .values
                    .address(needed, offsets as u64, "filtered offsets")?;
                (record.data, record.data_len) = data(self.data)?;
            }
            ColumnType::Dictionary { keys, offsets } => {
                let width = keys.width().unwrap_or(8);
                record.values = self
                    .values
                    .address(end * width, width as u64, "filtered keys")?;
                let (span, strings) = self.dictionary.ok_or_else(|| {
                    BackendError::Device("a filtered dictionary without strings".to_owned())
                })?;
                let needed = (strings + 1) * offsets;
                record.dictionary_offsets =
                    span.address(needed, offsets as u64, "dictionary offsets")?;
                record.dictionary_len = strings as u64;
                (record.data, record.data_len) = data(self.data)?;
            }
        }
        Ok(record)
    }
}

/// A filtered read's rows and the per-row and per-tile working memory its kernels share.
#[derive(Debug, Clone, Copy)]
pub(super) struct FilterRows<'a> {
    /// The first row read, and how many.
    pub(super) first: usize,
    pub(super) count: usize,
    /// A byte per row: whether it is kept.
    pub(super) flags: Span<'a>,
    /// The first output row of each tile (and the total after them).
    pub(super) tile_offsets: Span<'a>,
}

impl FilterRows<'_> {
    fn tiles(&self) -> usize {
        self.count.div_ceil(TILE)
    }

    fn end(&self) -> Result<usize, BackendError> {
        self.first
            .checked_add(self.count)
            .ok_or_else(|| BackendError::Device("a filtered read past usize".to_owned()))
    }

    /// The flags' and tile offsets' addresses, the grid, and the first row and count.
    fn arguments(&self) -> Result<(u64, u64, u32, u64, u64), BackendError> {
        let flags = self.flags.address(self.count, 1, "filter flags")?;
        let offsets = self
            .tile_offsets
            .address(self.tiles() * 8, 8, "filter tile offsets")?;
        Ok((
            flags,
            offsets,
            grid_of(self.tiles())?,
            self.first as u64,
            self.count as u64,
        ))
    }
}

fn grid_of(tiles: usize) -> Result<u32, BackendError> {
    u32::try_from(tiles)
        .ok()
        .filter(|&t| t < i32::MAX as u32)
        .ok_or_else(|| BackendError::Device(format!("{tiles} tiles is too many for one launch")))
}

/// Bytes of a bitmap of `bits` bits.
fn bitmap_bytes(bits: usize) -> usize {
    bits.div_ceil(8)
}

/// Where each part of a filter's table lies: columns, ops, keys, strings, bytes, and the end.
#[derive(Debug, Clone, Copy)]
struct TableLayout {
    ops: usize,
    keys: usize,
    strings: usize,
    bytes: usize,
    end: usize,
}

impl TableLayout {
    fn new(columns: usize, ops: usize, keys: usize, strings: usize, bytes: usize) -> Self {
        let ops_at = (columns * std::mem::size_of::<FilterColumn>()).next_multiple_of(64);
        let keys_at = (ops_at + ops * std::mem::size_of::<FilterOp>()).next_multiple_of(64);
        let strings_at = (keys_at + keys * 16).next_multiple_of(64);
        let bytes_at = (strings_at + strings * 8).next_multiple_of(64);
        Self {
            ops: ops_at,
            keys: keys_at,
            strings: strings_at,
            bytes: bytes_at,
            end: bytes_at + bytes,
        }
    }
}

/// Serialises the filter's column records and program as the kernel reads them, into `into`
/// (laid out as [`TableLayout`]).
fn write_program(
    into: &mut [u8],
    columns: &[FilterColumn],
    program: &Program,
    layout: TableLayout,
) -> Result<(), BackendError> {
    if into.len() < layout.end {
        return Err(BackendError::Device(
            "a filter program larger than its staging".to_owned(),
        ));
    }
    let mut put = |at: &mut usize, bytes: &[u8]| {
        into[*at..*at + bytes.len()].copy_from_slice(bytes);
        *at += bytes.len();
    };
    let mut at = 0;
    for column in columns {
        for field in [
            column.values,
            column.validity,
            column.data,
            column.data_len,
            column.dictionary_offsets,
            column.dictionary_len,
        ] {
            put(&mut at, &field.to_le_bytes());
        }
        put(&mut at, &column.kind.to_le_bytes());
        put(&mut at, &column.aux.to_le_bytes());
    }
    at = layout.ops;
    for op in &program.ops {
        for field in [op.code, op.column, op.cmp, op.arg] {
            put(&mut at, &field.to_le_bytes());
        }
        put(&mut at, &op.key_lo.to_le_bytes());
        put(&mut at, &op.key_hi.to_le_bytes());
        put(&mut at, &op.list_start.to_le_bytes());
        put(&mut at, &op.list_len.to_le_bytes());
    }
    at = layout.keys;
    for key in &program.keys {
        put(&mut at, &key.lo.to_le_bytes());
        put(&mut at, &key.hi.to_le_bytes());
    }
    at = layout.strings;
    for string in &program.strings {
        put(&mut at, &string.start.to_le_bytes());
        put(&mut at, &string.len.to_le_bytes());
    }
    at = layout.bytes;
    put(&mut at, &program.bytes);
    Ok(())
}

/// Bytes [`CopyBatch::launch_filter`] needs for a program's table over `columns` columns, in
/// device and staging memory.
pub(super) fn filter_program_bytes(columns: usize, program: &Program) -> usize {
    TableLayout::new(
        columns,
        program.ops.len(),
        program.keys.len(),
        program.strings.len(),
        program.bytes.len(),
    )
    .end
}

impl<'a> CopyBatch<'a> {
    fn launch(
        &mut self,
        function: sys::CUfunction,
        grid: u32,
        params: &mut [*mut std::ffi::c_void],
    ) -> Result<(), BackendError> {
        // SAFETY: every caller passes the parameters its kernel's signature names, in order,
        // and has checked every address the kernel touches against memory this batch borrows
        // until the stream synchronizes.
        unsafe {
            result::launch_kernel(
                function,
                (grid, 1, 1),
                (TILE as u32, 1, 1),
                0,
                self.stream.raw,
                params,
            )
        }
        .map_err(|e| device_error("cuLaunchKernel", e))
    }

    /// Queues zeroing `span`.
    pub(super) fn zero(&mut self, span: Span<'a>) -> Result<(), BackendError> {
        let address = span.address(0, 1, "zeroed range")?;
        // SAFETY: the range lies in the allocation (checked), borrowed until the stream
        // synchronized.
        unsafe { result::memset_d8_async(address, 0, span.len, self.stream.raw) }
            .map_err(|e| device_error("cuMemsetD8Async", e))
    }

    /// Queues the program's upload and `gpu_flight_filter`: a flag per row of `rows`, and each
    /// tile's count of rows kept into `tile_counts`. The program is checked first
    /// ([`filter_abi::check_program`]), each column's extents are checked
    /// ([`FilterInput::record`]), and all of it is written by this call into `staging`, then
    /// copied to `table` (see [`filter_program_bytes`]), so the kernel runs exactly what was
    /// checked.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_filter(
        &mut self,
        kernels: &'a FilterKernels,
        staging: &'a mut PinnedBuffer,
        table: Span<'a>,
        columns: &[FilterInput<'a>],
        program: &Program,
        rows: FilterRows<'a>,
        tile_counts: Span<'a>,
    ) -> Result<(), BackendError> {
        filter_abi::check_program(program, columns.len())
            .map_err(|e| BackendError::Device(format!("a malformed filter program: {e}")))?;
        let end = rows.end()?;
        let records = columns
            .iter()
            .map(|column| column.record(end))
            .collect::<Result<Vec<_>, BackendError>>()?;
        let layout = TableLayout::new(
            records.len(),
            program.ops.len(),
            program.keys.len(),
            program.strings.len(),
            program.bytes.len(),
        );
        write_program(staging.as_mut_slice(), &records, program, layout)?;
        let bytes = layout.end;
        let table_address = table.address(bytes, 64, "filter program")?;
        let staging: &'a PinnedBuffer = staging;
        // SAFETY: the destination lies in `table` (checked), the source in pinned memory; both
        // stay borrowed until the stream is synchronized.
        unsafe {
            result::memcpy_htod_async(table_address, &staging.as_slice()[..bytes], self.stream.raw)
        }
        .map_err(|e| device_error("cuMemcpyHtoDAsync", e))?;
        let (mut flags, _, grid, mut first, mut count) = rows.arguments()?;
        let mut counts = tile_counts.address(rows.tiles() * 8, 8, "filter tile counts")?;
        let mut columns_address = table_address;
        let mut ops_address = table_address + layout.ops as u64;
        let mut keys_address = table_address + layout.keys as u64;
        let mut strings_address = table_address + layout.strings as u64;
        let mut bytes_address = table_address + layout.bytes as u64;
        let mut op_count = u32::try_from(program.ops.len())
            .map_err(|_| BackendError::Device("a filter program too long".to_owned()))?;
        let mut params = kernel_params![
            columns_address,
            ops_address,
            op_count,
            keys_address,
            strings_address,
            bytes_address,
            first,
            count,
            flags,
            counts
        ];
        self.launch(kernels.filter, grid, &mut params)
    }

    /// Queues `gpu_flight_scan`: `output[i]` = the sum of `input[..i]` for `i` in `0..=n`.
    pub(super) fn launch_scan(
        &mut self,
        kernels: &'a FilterKernels,
        input: Span<'a>,
        n: usize,
        output: Span<'a>,
    ) -> Result<(), BackendError> {
        let mut input = input.address(n * 8, 8, "scan input")?;
        let mut output = output.address((n + 1) * 8, 8, "scan output")?;
        let mut n = n as u64;
        let mut params = kernel_params![input, n, output];
        self.launch(kernels.scan, 1, &mut params)
    }

    /// Queues `gpu_flight_string_bytes`: each tile's bytes of kept strings, whose offsets of
    /// `width` bytes are `offsets` and whose data is `data_len` bytes.
    pub(super) fn launch_string_bytes(
        &mut self,
        kernels: &'a FilterKernels,
        rows: FilterRows<'a>,
        offsets: Span<'a>,
        width: usize,
        data_len: usize,
        tile_bytes: Span<'a>,
    ) -> Result<(), BackendError> {
        let (mut flags, _, grid, mut first, mut count) = rows.arguments()?;
        let mut offsets = offsets.address((rows.end()? + 1) * width, width as u64, "offsets")?;
        let mut tile_bytes = tile_bytes.address(rows.tiles() * 8, 8, "tile bytes")?;
        let mut width = offset_width(width)?;
        let mut data_len = data_len as u64;
        let mut params = kernel_params![flags, first, count, offsets, width, data_len, tile_bytes];
        self.launch(kernels.string_bytes, grid, &mut params)
    }

    /// Queues `gpu_flight_gather_fixed`: the kept rows' values of `width` bytes from `src`
    /// (from row 0 of the partition) to `dst` (at most `kept` of them).
    pub(super) fn launch_gather_fixed(
        &mut self,
        kernels: &'a FilterKernels,
        rows: FilterRows<'a>,
        kept: usize,
        width: usize,
        src: Span<'a>,
        dst: Span<'a>,
    ) -> Result<(), BackendError> {
        let (mut flags, mut offsets, grid, mut first, mut count) = rows.arguments()?;
        let align = width.clamp(1, 8) as u64;
        let align = if width.is_power_of_two() { align } else { 1 };
        let mut src = src.address(rows.end()? * width, align, "gathered values")?;
        let mut dst = dst.address(kept * width, align, "gathered output")?;
        let mut kept = kept as u64;
        let mut width = u32::try_from(width)
            .map_err(|_| BackendError::Device(format!("values of {width} bytes")))?;
        let mut params = kernel_params![flags, offsets, first, count, kept, width, src, dst];
        self.launch(kernels.gather_fixed, grid, &mut params)
    }

    /// Queues `gpu_flight_gather_bits`: the kept rows' bits of the bitmap `src` into `dst`,
    /// which must have been zeroed earlier in this batch and spans whole 32-bit words.
    pub(super) fn launch_gather_bits(
        &mut self,
        kernels: &'a FilterKernels,
        rows: FilterRows<'a>,
        kept: usize,
        src: Span<'a>,
        dst: Span<'a>,
    ) -> Result<(), BackendError> {
        let (mut flags, mut offsets, grid, mut first, mut count) = rows.arguments()?;
        let mut src = src.address(bitmap_bytes(rows.end()?), 1, "gathered bits")?;
        let mut dst = dst.address(kept.div_ceil(32) * 4, 4, "gathered bitmap")?;
        let mut kept = kept as u64;
        let mut params = kernel_params![flags, offsets, first, count, kept, src, dst];
        self.launch(kernels.gather_bits, grid, &mut params)
    }

    /// Queues `gpu_flight_gather_strings`: the kept rows' strings (offsets of `width` bytes in
    /// `src_offsets`, bytes in `src_data`) into `dst_offsets` (`kept + 1` of them) and
    /// `dst_data` (`total` bytes); `tile_bytes` holds each tile's first output byte.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_gather_strings(
        &mut self,
        kernels: &'a FilterKernels,
        rows: FilterRows<'a>,
        tile_bytes: Span<'a>,
        (kept, total): (usize, usize),
        width: usize,
        (src_offsets, src_data): (Span<'a>, Span<'a>),
        (dst_offsets, dst_data): (Span<'a>, Span<'a>),
    ) -> Result<(), BackendError> {
        let (mut flags, mut offsets, grid, mut first, mut count) = rows.arguments()?;
        let align = width as u64;
        let mut tile_bytes = tile_bytes.address(rows.tiles() * 8, 8, "tile bytes")?;
        let mut src_offsets =
            src_offsets.address((rows.end()? + 1) * width, align, "source offsets")?;
        let mut src_data_address = src_data.address(0, 1, "source strings")?;
        let mut data_len = src_data.len as u64;
        let mut dst_offsets = dst_offsets.address((kept + 1) * width, align, "output offsets")?;
        let mut dst_data = dst_data.address(total, 1, "output strings")?;
        let (mut kept, mut total) = (kept as u64, total as u64);
        let mut width = offset_width(width)?;
        let mut params = kernel_params![
            flags,
            offsets,
            tile_bytes,
            first,
            count,
            kept,
            total,
            width,
            src_offsets,
            src_data_address,
            data_len,
            dst_offsets,
            dst_data
        ];
        self.launch(kernels.gather_strings, grid, &mut params)
    }
}

fn offset_width(width: usize) -> Result<u32, BackendError> {
    match width {
        4 | 8 => Ok(width as u32),
        _ => Err(BackendError::Device(format!(
            "string offsets of {width} bytes"
        ))),
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

#[cfg(test)]
mod tests {
    use arrow::array::StringArray;
    use arrow::datatypes::DataType;

    use super::*;

    fn strings(offsets: &[i32], values: &[u8]) -> ArrayDataBuilder {
        ArrayDataBuilder::new(DataType::Utf8)
            .len(offsets.len() - 1)
            .add_buffer(Buffer::from_slice_ref(offsets))
            .add_buffer(Buffer::from_slice_ref(values))
    }

    #[test]
    fn a_host_buffer_is_what_its_pieces_wrote_and_only_whole_coverage_is_accepted() {
        let source: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let whole = host_buffer_written(
            source.len(),
            |uninit| {
                let (first, rest) = uninit.split_at_mut(4096);
                // Handed back out of order: coverage, not order, is what counts.
                Ok::<_, ()>(vec![
                    write_bytes(rest, &source[4096..]),
                    write_bytes(first, &source[..4096]),
                ])
            },
            || (),
        )
        .expect("covered");
        assert_eq!(whole.as_slice(), source.as_slice());
        assert_eq!(whole.as_ptr().align_offset(64), 0);
        let gap = host_buffer_written(
            100,
            |uninit| Ok(vec![write_bytes(&mut uninit[..40], &[1; 40])]),
            || "incomplete",
        );
        assert_eq!(gap.err(), Some("incomplete"));
        let hole = host_buffer_written(
            100,
            |uninit| {
                let (first, rest) = uninit.split_at_mut(40);
                let _ = first;
                Ok(vec![write_bytes(rest, &[2; 60])])
            },
            || "incomplete",
        );
        assert_eq!(hole.err(), Some("incomplete"));
        let empty = host_buffer_written(0, |_| Ok::<_, ()>(Vec::new()), || ()).expect("empty");
        assert!(empty.is_empty());
    }

    #[test]
    fn untouched_zeroes_are_zeroes_of_the_length_asked() {
        for len in [0, 1, 4096, 3 << 20] {
            let zeroes = untouched_zeroes(len);
            assert_eq!(zeroes.len(), len);
            assert!(zeroes.as_slice().iter().all(|&b| b == 0), "{len}");
        }
    }

    #[test]
    fn read_back_arrays_are_the_arrays_written() {
        let data = read_back_array(strings(&[0, 2, 2, 5], b"abcde")).expect("valid");
        let array = StringArray::from(data);
        assert_eq!(
            array.iter().collect::<Vec<_>>(),
            [Some("ab"), Some(""), Some("cde")]
        );
    }

    #[test]
    fn read_back_arrays_are_still_checked_for_structure() {
        // The last offset points past the values: nothing may read through such an array.
        let error = read_back_array(strings(&[0, 2, 9], b"abcde")).expect_err("out of bounds");
        assert!(error.to_string().contains("offset"), "{error}");
        // Fewer offsets than rows.
        let short = strings(&[0, 2], b"ab").len(3);
        assert!(read_back_array(short).is_err());
    }

    #[test]
    fn a_handle_that_does_not_open_is_the_producers_fault_only_where_the_handle_is() {
        use sys::cudaError_enum as E;
        for (error, failure) in [
            (E::CUDA_ERROR_INVALID_VALUE, OpenFailure::Handle),
            (E::CUDA_ERROR_INVALID_HANDLE, OpenFailure::Handle),
            (E::CUDA_ERROR_INVALID_CONTEXT, OpenFailure::Handle),
            (E::CUDA_ERROR_MAP_FAILED, OpenFailure::Handle),
            (E::CUDA_ERROR_OUT_OF_MEMORY, OpenFailure::Exhausted),
            (E::CUDA_ERROR_TOO_MANY_PEERS, OpenFailure::Exhausted),
            (E::CUDA_ERROR_UNKNOWN, OpenFailure::Driver),
            (E::CUDA_ERROR_DEINITIALIZED, OpenFailure::Driver),
            (E::CUDA_ERROR_ECC_UNCORRECTABLE, OpenFailure::Driver),
            (E::CUDA_ERROR_OPERATING_SYSTEM, OpenFailure::Driver),
        ] {
            assert_eq!(OpenFailure::of(error), failure, "{error:?}");
        }
    }
}
