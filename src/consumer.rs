//! A Rust consumer of `ipc-export`: asks a co-located server for a dataset's columns and maps
//! them into this process without copying them through the network.
//!
//! ```no_run
//! # async fn run(mut client: arrow_flight::FlightClient) -> Result<(), gpu_flight::consumer::ConsumerError> {
//! use gpu_flight::consumer::{ExportOptions, MappedDataset, export, release};
//! let options = ExportOptions::default().on_device(0)?; // where this process computes
//! let document = export(&mut client, "trips", &options).await?;
//! let mapped = MappedDataset::open(&document)?;
//! for partition in mapped.partitions() {
//!     let fares = partition.column_buffers(0)?; // device pointers, for kernels
//! }
//! let copy = mapped.read_column(0)?; // or a host copy of every partition, as Arrow
//! drop(mapped);                       // unmap first...
//! release(&mut client, &document.lease).await?; // ...then end the lease
//! # Ok(()) }
//! ```
//!
//! A producer goes the other way with [`import_document`] and [`import`]: columns it holds on
//! a GPU of the server's node, described by their device pointers, are copied by the server
//! into a dataset (`ipc-import`), device to device; the producer may free them once
//! [`import`] returns.

use std::collections::HashMap;
use std::sync::Arc;

use arrow::array::{ArrayData, ArrayRef, make_array};
use arrow::buffer::Buffer;
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use arrow::ipc::writer::IpcWriteOptions;
use arrow_flight::{Action, FlightClient};
use arrow_flight::{IpcMessage, SchemaAsIpc};
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use futures::TryStreamExt;

use crate::backend::cuda::{ImportDevice, ImportedAllocation};
use crate::backend::{BackendError, BufferKind};
use crate::flight::ipc_export::{
    ArrayDocument, BufferDocument, ColumnDocument, DeviceDocument, ExportDocument, IMPORT_VERSION,
    ImportDocument, PartitionDocument, VERSION,
};
use crate::store::{Access, PutMode, PutSummary};

/// What can go wrong consuming an export.
#[derive(Debug, thiserror::Error)]
pub enum ConsumerError {
    #[error("the server refused: {0}")]
    Flight(#[from] arrow_flight::error::FlightError),
    #[error("unexpected export document: {0}")]
    Document(String),
    #[error(
        "the dataset lives on GPU {uuid} (PCI {pci_bus_id}), which this process cannot see: \
         run on the server's node with that GPU visible, or read the dataset with DoGet"
    )]
    DeviceNotVisible { uuid: String, pci_bus_id: String },
    #[error(transparent)]
    Device(#[from] BackendError),
    #[error("rebuilding a column: {0}")]
    Arrow(#[from] arrow::error::ArrowError),
}

/// What to ask `ipc-export` for.
#[derive(Debug, Clone)]
pub struct ExportOptions {
    /// Column names; all when `None`.
    pub columns: Option<Vec<String>>,
    pub lease_seconds: u64,
    /// The UUID of the GPU this process computes on. Partitions on another GPU are then
    /// exported for peer access from it, or copied onto it with `copy`.
    pub device: Option<String>,
    /// Replicate partitions held by other GPUs onto `device` for the lease (the server needs
    /// the memory; the caller needs the write role).
    pub copy: bool,
}

impl Default for ExportOptions {
    fn default() -> Self {
        Self {
            columns: None,
            lease_seconds: 300,
            device: None,
            copy: false,
        }
    }
}

impl ExportOptions {
    /// These options for a process computing on its device `ordinal` (as it numbers them).
    pub fn on_device(mut self, ordinal: u32) -> Result<Self, ConsumerError> {
        self.device = Some(ImportDevice::by_ordinal(ordinal)?.uuid()?);
        Ok(self)
    }
}

/// Calls `ipc-export` for `name` and returns its document (version 2).
pub async fn export(
    client: &mut FlightClient,
    name: &str,
    options: &ExportOptions,
) -> Result<ExportDocument, ConsumerError> {
    let mut body = serde_json::json!({
        "name": name,
        "lease_seconds": options.lease_seconds,
        "version": VERSION,
    });
    if let Some(columns) = &options.columns {
        body["columns"] = serde_json::json!(columns);
    }
    if let Some(device) = &options.device {
        body["device"] = serde_json::json!(device);
        body["copy"] = serde_json::json!(options.copy);
    }
    let reply = action(client, "ipc-export", &body).await?;
    let document: ExportDocument =
        serde_json::from_slice(&reply).map_err(|e| ConsumerError::Document(e.to_string()))?;
    if document.version != VERSION {
        return Err(ConsumerError::Document(format!(
            "version {} (this consumer reads version {VERSION})",
            document.version
        )));
    }
    Ok(document)
}

/// Ends the lease of an export. Drop the [`MappedDataset`] first.
pub async fn release(client: &mut FlightClient, lease: &str) -> Result<(), ConsumerError> {
    action(
        client,
        "ipc-release",
        &serde_json::json!({ "lease": lease }),
    )
    .await?;
    Ok(())
}

async fn action(
    client: &mut FlightClient,
    name: &str,
    body: &serde_json::Value,
) -> Result<bytes::Bytes, ConsumerError> {
    let results: Vec<bytes::Bytes> = client
        .do_action(Action::new(name, body.to_string()))
        .await?
        .try_collect()
        .await?;
    results
        .into_iter()
        .next()
        .ok_or_else(|| ConsumerError::Document(format!("{name} returned no result")))
}

/// One Arrow array this process holds on a GPU, by device addresses, for [`import_document`]:
/// in the layout `ipc-export` publishes (starting at row 0, offsets from 0, children of
/// exactly the rows their parent references). Its buffers may lie in any allocations.
#[derive(Debug, Clone, Default)]
pub struct DeviceColumn {
    pub length: u64,
    pub null_count: u64,
    /// In Arrow's order, the validity bitmap (where there are nulls) first.
    pub buffers: Vec<DeviceBuffer>,
    pub children: Vec<DeviceColumn>,
    /// A dictionary array's values.
    pub dictionary: Option<Box<DeviceColumn>>,
}

/// The `ipc-import` document for `columns` (of `schema`, `num_rows` rows) that this process
/// holds on `device`: each buffer's allocation found by its address, with its IPC handle.
/// Fails for memory that cannot be shared (stream-ordered pool memory).
pub fn import_document(
    device: &ImportDevice,
    name: &str,
    mode: PutMode,
    schema: &Schema,
    num_rows: u64,
    columns: &[DeviceColumn],
) -> Result<ImportDocument, ConsumerError> {
    let options = IpcWriteOptions::default();
    let message = IpcMessage::try_from(SchemaAsIpc::new(schema, &options))?;
    let mut described = Vec::with_capacity(columns.len());
    for column in columns {
        let first = first_address(column);
        let own = match first {
            Some(address) => Some(device.allocation_of(address)?),
            None => None,
        };
        described.push(ColumnDocument {
            handle: BASE64.encode(own.map_or([0; 64], |a| a.handle)),
            allocation_bytes: own.map_or(0, |a| a.bytes),
            array: import_array(device, own.as_ref(), column)?,
        });
    }
    Ok(ImportDocument {
        version: Some(IMPORT_VERSION),
        name: name.to_owned(),
        mode: Some(mode),
        device: DeviceDocument {
            device: None,
            ordinal: device.ordinal(),
            uuid: device.uuid()?,
            pci_bus_id: device.pci_bus_id()?,
        },
        num_rows,
        schema: BASE64.encode(&message.0),
        columns: described,
    })
}

/// The address of the first buffer with bytes of `column`, its children's or dictionary's.
fn first_address(column: &DeviceColumn) -> Option<u64> {
    column
        .buffers
        .iter()
        .find(|b| b.length > 0)
        .map(|b| b.address)
        .or_else(|| column.children.iter().find_map(first_address))
        .or_else(|| column.dictionary.as_deref().and_then(first_address))
}

fn import_array(
    device: &ImportDevice,
    own: Option<&crate::backend::cuda::ProducerAllocation>,
    column: &DeviceColumn,
) -> Result<ArrayDocument, ConsumerError> {
    let mut buffers = Vec::with_capacity(column.buffers.len());
    for buffer in &column.buffers {
        let (offset, handle, allocation_bytes) = if buffer.length == 0 {
            (0, None, None)
        } else {
            let allocation = match own {
                Some(own) if (own.base..own.base + own.bytes).contains(&buffer.address) => *own,
                _ => device.allocation_of(buffer.address)?,
            };
            let theirs = own.is_none_or(|own| own.handle != allocation.handle);
            (
                buffer.address - allocation.base,
                theirs.then(|| BASE64.encode(allocation.handle)),
                theirs.then_some(allocation.bytes),
            )
        };
        buffers.push(BufferDocument {
            kind: buffer.kind,
            offset,
            length: buffer.length,
            handle,
            allocation_bytes,
        });
    }
    Ok(ArrayDocument {
        name: String::new(),
        data_type: String::new(),
        length: column.length,
        null_count: column.null_count,
        buffers,
        children: column
            .children
            .iter()
            .map(|child| import_array(device, own, child))
            .collect::<Result<_, _>>()?,
        dictionary: column
            .dictionary
            .as_deref()
            .map(|values| import_array(device, own, values).map(Box::new))
            .transpose()?,
    })
}

/// Calls `ipc-import` with `document`: the server copies the columns into the dataset and
/// commits as a put would. The producer's memory may be freed once this returns.
pub async fn import(
    client: &mut FlightClient,
    document: &ImportDocument,
) -> Result<PutSummary, ConsumerError> {
    let body =
        serde_json::to_value(document).map_err(|e| ConsumerError::Document(e.to_string()))?;
    let reply = action(client, "ipc-import", &body).await?;
    serde_json::from_slice(&reply).map_err(|e| ConsumerError::Document(e.to_string()))
}

/// One Arrow buffer of a mapped column, in this process's address space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceBuffer {
    pub kind: BufferKind,
    pub address: u64,
    pub length: u64,
}

/// An export's partitions, mapped into this process until dropped. Each distinct handle is
/// opened once per device it is mapped on.
#[derive(Debug)]
pub struct MappedDataset {
    document: ExportDocument,
    schema: SchemaRef,
    partitions: Vec<MappedPartition>,
}

/// One partition's columns, mapped on one device of this process.
#[derive(Debug)]
pub struct MappedPartition {
    document: PartitionDocument,
    schema: SchemaRef,
    device: ImportDevice,
    /// One mapping per column, shared by columns packed into one allocation.
    mappings: Vec<Arc<ImportedAllocation>>,
}

impl MappedDataset {
    /// Maps every column of every partition: on the GPU holding it, or for `peer` access on
    /// the consumer's GPU.
    pub fn open(document: &ExportDocument) -> Result<Self, ConsumerError> {
        let schema = Arc::new(document.decode_schema().map_err(ConsumerError::Document)?);
        let mut devices: HashMap<String, ImportDevice> = HashMap::new();
        let mut find = |wanted: &DeviceDocument| -> Result<ImportDevice, ConsumerError> {
            if let Some(device) = devices.get(&wanted.uuid) {
                return Ok(device.clone());
            }
            let found = ImportDevice::find(&wanted.uuid, &wanted.pci_bus_id)?.ok_or_else(|| {
                ConsumerError::DeviceNotVisible {
                    uuid: wanted.uuid.clone(),
                    pci_bus_id: wanted.pci_bus_id.clone(),
                }
            })?;
            devices.insert(wanted.uuid.clone(), found.clone());
            Ok(found)
        };
        let mut opened: HashMap<(u32, &str), Arc<ImportedAllocation>> = HashMap::new();
        let mut partitions = Vec::with_capacity(document.partitions.len());
        for partition in &document.partitions {
            if schema.fields().len() != partition.columns.len() {
                return Err(ConsumerError::Document(format!(
                    "the schema has {} fields but a partition describes {} columns",
                    schema.fields().len(),
                    partition.columns.len()
                )));
            }
            let on = match partition.access {
                Access::Peer => document.consumer_device.as_ref().ok_or_else(|| {
                    ConsumerError::Document(
                        "a partition is for peer access but no consumer device is named".to_owned(),
                    )
                })?,
                Access::Local | Access::Replica => &partition.device,
            };
            let device = find(on)?;
            let mut mappings = Vec::with_capacity(partition.columns.len());
            for column in &partition.columns {
                let key = (device.ordinal(), column.handle.as_str());
                let mapping = match opened.get(&key) {
                    Some(mapping) => Arc::clone(mapping),
                    None => {
                        let handle = column.handle_bytes().map_err(ConsumerError::Document)?;
                        let mapping = Arc::new(device.open(&handle, column.allocation_bytes)?);
                        opened.insert(key, Arc::clone(&mapping));
                        mapping
                    }
                };
                mappings.push(mapping);
            }
            partitions.push(MappedPartition {
                document: partition.clone(),
                schema: Arc::clone(&schema),
                device,
                mappings,
            });
        }
        Ok(Self {
            document: document.clone(),
            schema,
            partitions,
        })
    }

    pub fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    pub fn num_rows(&self) -> u64 {
        self.document.num_rows
    }

    /// In row order.
    pub fn partitions(&self) -> &[MappedPartition] {
        &self.partitions
    }

    /// Distinct mappings opened.
    pub fn mapped_allocations(&self) -> usize {
        let mut bases: Vec<(u32, u64)> = self
            .partitions
            .iter()
            .flat_map(|p| {
                p.mappings
                    .iter()
                    .map(|m| (p.device.ordinal(), m.device_address()))
            })
            .collect();
        bases.sort_unstable();
        bases.dedup();
        bases.len()
    }

    /// Copies column `index` of every partition to host memory as one Arrow array.
    pub fn read_column(&self, index: usize) -> Result<ArrayRef, ConsumerError> {
        let parts = self
            .partitions
            .iter()
            .map(|p| p.read_column(index))
            .collect::<Result<Vec<_>, _>>()?;
        match parts.as_slice() {
            [one] => Ok(Arc::clone(one)),
            _ => {
                let arrays: Vec<&dyn arrow::array::Array> =
                    parts.iter().map(|a| a.as_ref()).collect();
                Ok(arrow::compute::concat(&arrays)?)
            }
        }
    }
}

impl MappedPartition {
    pub fn num_rows(&self) -> u64 {
        self.document.num_rows
    }

    /// How the server said to reach it.
    pub fn access(&self) -> Access {
        self.document.access
    }

    /// The server's device holding the memory.
    pub fn holder(&self) -> &DeviceDocument {
        &self.document.device
    }

    /// This process's ordinal of the GPU the columns are mapped on.
    pub fn device_ordinal(&self) -> u32 {
        self.device.ordinal()
    }

    /// Column `index`'s mapping and description.
    fn column(
        &self,
        index: usize,
    ) -> Result<(&ImportedAllocation, &ColumnDocument), ConsumerError> {
        match (self.mappings.get(index), self.document.columns.get(index)) {
            (Some(mapping), Some(column)) => Ok((mapping, column)),
            _ => Err(ConsumerError::Document(format!(
                "no column {index}: the export has {}",
                self.mappings.len()
            ))),
        }
    }

    /// Column `index`'s own buffers as device pointers (children: see the document).
    pub fn column_buffers(&self, index: usize) -> Result<Vec<DeviceBuffer>, ConsumerError> {
        let (mapping, column) = self.column(index)?;
        let base = mapping.device_address();
        column
            .array
            .buffers
            .iter()
            .map(|b| {
                let address = base.checked_add(b.offset).ok_or_else(|| {
                    ConsumerError::Document(format!("a buffer offset of {} overflows", b.offset))
                })?;
                Ok(DeviceBuffer {
                    kind: b.kind,
                    address,
                    length: b.length,
                })
            })
            .collect()
    }

    /// Copies column `index` (children and dictionary included) to host memory as an Arrow
    /// array, validated like any input.
    pub fn read_column(&self, index: usize) -> Result<ArrayRef, ConsumerError> {
        let (mapping, column) = self.column(index)?;
        let field = self.schema.field(index);
        Ok(make_array(read_array(mapping, field, &column.array)?))
    }
}

fn read_array(
    mapping: &ImportedAllocation,
    field: &Field,
    array: &ArrayDocument,
) -> Result<ArrayData, ConsumerError> {
    let read = |offset, length| -> Result<Buffer, ConsumerError> {
        Ok(Buffer::from(mapping.read(offset, length)?))
    };
    let mut validity = None;
    let mut buffers = Vec::new();
    for buffer in &array.buffers {
        let bytes = read(buffer.offset, buffer.length)?;
        match buffer.kind {
            BufferKind::Validity => validity = Some(bytes),
            BufferKind::Offsets | BufferKind::Values => buffers.push(bytes),
        }
    }
    let child_fields: Vec<Field> = match field.data_type() {
        DataType::List(f)
        | DataType::LargeList(f)
        | DataType::FixedSizeList(f, _)
        | DataType::Map(f, _) => vec![f.as_ref().clone()],
        DataType::Struct(fields) => fields.iter().map(|f| f.as_ref().clone()).collect(),
        _ => Vec::new(),
    };
    if child_fields.len() != array.children.len() {
        return Err(ConsumerError::Document(format!(
            "{} has {} children in the document and {} in the schema",
            array.name,
            array.children.len(),
            child_fields.len()
        )));
    }
    let mut children = child_fields
        .iter()
        .zip(&array.children)
        .map(|(f, c)| read_array(mapping, f, c))
        .collect::<Result<Vec<_>, _>>()?;
    if let (DataType::Dictionary(_, value_type), Some(values)) =
        (field.data_type(), &array.dictionary)
    {
        let values_field = Field::new("values", value_type.as_ref().clone(), true);
        children.push(read_array(mapping, &values_field, values)?);
    }
    let length = usize::try_from(array.length)
        .map_err(|_| ConsumerError::Document(format!("{} is too long", array.name)))?;
    Ok(ArrayData::builder(field.data_type().clone())
        .len(length)
        .null_bit_buffer(validity)
        .buffers(buffers)
        .child_data(children)
        .build()?)
}
