//! The consumer's side of `ipc-export`: mapping allocations another process exported.
//!
//! A consumer finds the exporting GPU among the devices it can see by UUID or PCI bus id (its
//! ordinals depend on its own `CUDA_VISIBLE_DEVICES`), then opens each distinct handle once.
//! An [`ImportedAllocation`] unmaps on drop; the exporter's lease must outlive it.
//!
//! The other way, `ipc-import`: [`ImportDevice::allocation_of`] finds the allocation holding a
//! producer's device pointer and its IPC handle, and [`ImportDevice::upload`] gives a producer
//! without a CUDA library of its own exportable device memory.

use std::sync::Arc;

use super::ffi::{self, Context, DeviceAllocation, IpcMapping};
use crate::backend::BackendError;

/// A visible CUDA device, opened to map allocations exported from it.
#[derive(Debug, Clone)]
pub struct ImportDevice {
    context: Arc<Context>,
}

impl ImportDevice {
    /// The visible device with this UUID or PCI bus id; `None` if this process cannot see it
    /// (another node, or hidden by `CUDA_VISIBLE_DEVICES`).
    pub fn find(uuid: &str, pci_bus_id: &str) -> Result<Option<Self>, BackendError> {
        if !ffi::driver_present() {
            return Err(BackendError::Device(
                "no NVIDIA driver library (libcuda) could be loaded".to_owned(),
            ));
        }
        for ordinal in 0..ffi::device_count()? {
            let context = Context::open(ordinal)?;
            if context.uuid()? == uuid || context.pci_bus_id()?.eq_ignore_ascii_case(pci_bus_id) {
                return Ok(Some(Self { context }));
            }
        }
        Ok(None)
    }

    /// Device `ordinal` as this process numbers it (after `CUDA_VISIBLE_DEVICES`).
    pub fn by_ordinal(ordinal: u32) -> Result<Self, BackendError> {
        if !ffi::driver_present() {
            return Err(BackendError::Device(
                "no NVIDIA driver library (libcuda) could be loaded".to_owned(),
            ));
        }
        let ordinal = i32::try_from(ordinal)
            .map_err(|_| BackendError::Device(format!("device ordinal {ordinal} is too large")))?;
        Ok(Self {
            context: Context::open(ordinal)?,
        })
    }

    /// The device's UUID, as `nvidia-smi` prints it: what a consumer tells `ipc-export`.
    pub fn uuid(&self) -> Result<String, BackendError> {
        self.context.uuid()
    }

    /// The device's PCI bus id, `domain:bus:device.function`.
    pub fn pci_bus_id(&self) -> Result<String, BackendError> {
        self.context.pci_bus_id()
    }

    /// The allocation of this process holding device address `address`: its base, its size
    /// and its IPC handle, what an `ipc-import` document names. Fails for memory that cannot
    /// be exported: stream-ordered pool memory (`cudaMallocAsync`, the default of some
    /// allocators) has no IPC handle; allocate with `cudaMalloc`/`cuMemAlloc` instead.
    pub fn allocation_of(&self, address: u64) -> Result<ProducerAllocation, BackendError> {
        let (base, bytes) = ffi::allocation_range(&self.context, address)?;
        let handle = ffi::ipc_handle_of(&self.context, base).map_err(|e| {
            BackendError::Device(format!(
                "{e}: this memory cannot be shared with another process (stream-ordered pool \
                 memory, from cudaMallocAsync, cannot); allocate it with cudaMalloc"
            ))
        })?;
        Ok(ProducerAllocation {
            handle,
            base,
            bytes: bytes as u64,
        })
    }

    /// `bytes` copied into a new device allocation of this process (plain `cuMemAlloc`,
    /// which can be shared), freed when the returned memory is dropped.
    pub fn upload(&self, bytes: &[u8]) -> Result<DeviceMemory, BackendError> {
        let allocation = DeviceAllocation::new(&self.context, bytes.len())?;
        allocation.write(bytes)?;
        Ok(DeviceMemory { allocation })
    }

    /// This process's ordinal for the device.
    pub fn ordinal(&self) -> u32 {
        self.context.ordinal() as u32
    }

    /// Maps an exported allocation of `bytes` bytes from its 64-byte handle.
    pub fn open(&self, handle: &[u8; 64], bytes: u64) -> Result<ImportedAllocation, BackendError> {
        Ok(ImportedAllocation {
            mapping: IpcMapping::open(&self.context, handle)?,
            bytes,
        })
    }
}

/// Another process's device allocation, mapped into this one until dropped.
#[derive(Debug)]
pub struct ImportedAllocation {
    mapping: IpcMapping,
    bytes: u64,
}

impl ImportedAllocation {
    /// The allocation's base address in this process, for kernels and libraries that take
    /// device pointers.
    pub fn device_address(&self) -> u64 {
        self.mapping.address()
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Copies `len` bytes at `offset` into host memory.
    pub fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, BackendError> {
        if offset.checked_add(len).is_none_or(|end| end > self.bytes) {
            return Err(BackendError::Device(format!(
                "bytes {offset}..+{len} lie outside an exported allocation of {} bytes",
                self.bytes
            )));
        }
        let mut host = vec![0u8; len as usize];
        if len > 0 {
            self.mapping.copy_to_host(offset, &mut host)?;
        }
        Ok(host)
    }
}

/// A device allocation of a producer, as `ipc-import` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProducerAllocation {
    pub handle: [u8; 64],
    /// Its first byte's device address in this process.
    pub base: u64,
    pub bytes: u64,
}

/// Device memory this process allocated, freed on drop.
#[derive(Debug)]
pub struct DeviceMemory {
    allocation: DeviceAllocation,
}

impl DeviceMemory {
    /// The device address of its first byte.
    pub fn address(&self) -> u64 {
        self.allocation.address()
    }

    pub fn bytes(&self) -> u64 {
        self.allocation.bytes() as u64
    }
}
