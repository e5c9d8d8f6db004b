//! What a backend tells the protocol layer about columns another process maps zero-copy: the
//! device, and per column an IPC handle to its allocation plus where each Arrow buffer lies in
//! it (see the `ipc-export` action in the README for the document built from this).

use arrow::datatypes::DataType;

/// The GPU an export lives on, identified as a consumer can match it whatever its
/// `CUDA_VISIBLE_DEVICES`: by UUID or PCI bus id, not by ordinal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportDevice {
    /// The server's ordinal (meaningful only in the server's process).
    pub ordinal: u32,
    /// As `nvidia-smi` prints it: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
    pub uuid: String,
    /// `domain:bus:device.function`, e.g. `0000:3b:00.0`.
    pub pci_bus_id: String,
}

/// One column: the allocation holding all its buffers (children's and dictionary's too). Also
/// what a producer hands `ipc-import`, where a buffer may lie in an allocation of its own.
#[derive(Debug, Clone)]
pub struct ExportedColumn {
    /// The 64-byte `CUipcMemHandle` of the allocation. It maps the whole allocation from its
    /// base, so every buffer offset below counts from there.
    pub handle: [u8; 64],
    pub allocation_bytes: u64,
    pub array: ExportedArray,
}

/// One Arrow array's buffers in its column's allocation. Arrays start at row 0 (no offset).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportedArray {
    pub data_type: DataType,
    pub length: u64,
    pub null_count: u64,
    pub buffers: Vec<ExportedBuffer>,
    pub children: Vec<ExportedArray>,
    /// A dictionary array's values; its keys are this array's `values` buffer.
    pub dictionary: Option<Box<ExportedArray>>,
}

/// A buffer: its role, and its byte range from the allocation's base.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportedBuffer {
    pub kind: BufferKind,
    pub offset: u64,
    pub length: u64,
    /// The allocation the buffer lies in where it is not its column's: exports never say,
    /// while a producer's buffers (`ipc-import`) often lie in allocations of their own.
    pub allocation: Option<ForeignAllocation>,
}

/// Another process's allocation, as its IPC handle and its size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForeignAllocation {
    pub handle: [u8; 64],
    pub bytes: u64,
}

/// The role of a buffer, in the order Arrow lists an array's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BufferKind {
    /// The validity bitmap (LSB first; absent when the array has no nulls).
    Validity,
    /// `length + 1` int32 or int64 offsets (strings, binary, lists).
    Offsets,
    /// Fixed-width values, bit-packed booleans, dictionary keys, or string/binary bytes.
    Values,
}
