//! A Rust consumer of `ipc-export`: asks a co-located server for a dataset's columns and maps
//! them into this process without copying them through the network.
//!
//! ```no_run
//! # async fn run(mut client: arrow_flight::FlightClient) -> Result<(), gpu_flight::consumer::ConsumerError> {
//! use gpu_flight::consumer::{MappedDataset, export, release};
//! let document = export(&mut client, "trips", None, 300).await?;
//! let mapped = MappedDataset::open(&document)?;
//! let fares = mapped.column_buffers(0); // device pointers, for kernels
//! let copy = mapped.read_column(0)?;    // or a host copy, as Arrow
//! drop(mapped);                          // unmap first...
//! release(&mut client, &document.lease).await?; // ...then end the lease
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::sync::Arc;

use arrow::array::{ArrayData, ArrayRef, make_array};
use arrow::buffer::Buffer;
use arrow::datatypes::{DataType, Field, SchemaRef};
use arrow_flight::{Action, FlightClient};
use futures::TryStreamExt;

use crate::backend::cuda::{ImportDevice, ImportedAllocation};
use crate::backend::{BackendError, BufferKind};
use crate::flight::ipc_export::{ArrayDocument, ExportDocument, VERSION};

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

/// Calls `ipc-export` for `columns` of `name` (all when `None`) under a lease of
/// `lease_seconds`.
pub async fn export(
    client: &mut FlightClient,
    name: &str,
    columns: Option<&[&str]>,
    lease_seconds: u64,
) -> Result<ExportDocument, ConsumerError> {
    let mut body = serde_json::json!({"name": name, "lease_seconds": lease_seconds});
    if let Some(columns) = columns {
        body["columns"] = serde_json::json!(columns);
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

/// One Arrow buffer of a mapped column, in this process's address space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceBuffer {
    pub kind: BufferKind,
    pub address: u64,
    pub length: u64,
}

/// An export's columns, mapped into this process (each distinct handle opened once) until
/// dropped.
#[derive(Debug)]
pub struct MappedDataset {
    document: ExportDocument,
    schema: SchemaRef,
    device: ImportDevice,
    /// One mapping per column, shared by columns packed into one allocation.
    mappings: Vec<Arc<ImportedAllocation>>,
}

impl MappedDataset {
    /// Finds the export's GPU among the visible ones and maps every column.
    pub fn open(document: &ExportDocument) -> Result<Self, ConsumerError> {
        let schema = Arc::new(document.decode_schema().map_err(ConsumerError::Document)?);
        if schema.fields().len() != document.columns.len() {
            return Err(ConsumerError::Document(format!(
                "the schema has {} fields but {} columns are described",
                schema.fields().len(),
                document.columns.len()
            )));
        }
        let device = &document.device;
        let found = ImportDevice::find(&device.uuid, &device.pci_bus_id)?.ok_or_else(|| {
            ConsumerError::DeviceNotVisible {
                uuid: device.uuid.clone(),
                pci_bus_id: device.pci_bus_id.clone(),
            }
        })?;
        let mut opened: HashMap<&str, Arc<ImportedAllocation>> = HashMap::new();
        let mut mappings = Vec::with_capacity(document.columns.len());
        for column in &document.columns {
            let mapping = match opened.get(column.handle.as_str()) {
                Some(mapping) => Arc::clone(mapping),
                None => {
                    let handle = column.handle_bytes().map_err(ConsumerError::Document)?;
                    let mapping = Arc::new(found.open(&handle, column.allocation_bytes)?);
                    opened.insert(&column.handle, Arc::clone(&mapping));
                    mapping
                }
            };
            mappings.push(mapping);
        }
        Ok(Self {
            document: document.clone(),
            schema,
            device: found,
            mappings,
        })
    }

    pub fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    pub fn num_rows(&self) -> u64 {
        self.document.num_rows
    }

    /// This process's ordinal of the GPU the columns live on.
    pub fn device_ordinal(&self) -> u32 {
        self.device.ordinal()
    }

    /// Distinct allocations mapped.
    pub fn mapped_allocations(&self) -> usize {
        let mut bases: Vec<u64> = self.mappings.iter().map(|m| m.device_address()).collect();
        bases.sort_unstable();
        bases.dedup();
        bases.len()
    }

    /// Column `index`'s own buffers as device pointers (children: see the document).
    pub fn column_buffers(&self, index: usize) -> Vec<DeviceBuffer> {
        let base = self.mappings[index].device_address();
        self.document.columns[index]
            .array
            .buffers
            .iter()
            .map(|b| DeviceBuffer {
                kind: b.kind,
                address: base + b.offset,
                length: b.length,
            })
            .collect()
    }

    /// Copies column `index` (children and dictionary included) to host memory as an Arrow
    /// array, validated like any input.
    pub fn read_column(&self, index: usize) -> Result<ArrayRef, ConsumerError> {
        let field = self.schema.field(index);
        let data = read_array(
            &self.mappings[index],
            field,
            &self.document.columns[index].array,
        )?;
        Ok(make_array(data))
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
