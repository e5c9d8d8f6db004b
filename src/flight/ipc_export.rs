//! The `ipc-export` document: how a co-located process finds and maps a dataset's columns.
//!
//! Version 2 (described in docs/protocol.md) is one JSON object: the lease, the Arrow IPC schema of
//! the exported columns, and each partition in row order: its rows, the device holding it (by
//! UUID and PCI bus id, since ordinals depend on the consumer's `CUDA_VISIBLE_DEVICES`), how
//! the consumer reaches it, and per column a CUDA IPC handle with the byte offset of every
//! buffer from the base of the allocation the handle maps. Version 1, what a client gets
//! unless it asks for 2, is the same for a dataset of one partition, with that partition's
//! device and columns at the top level. The same types parse it back for Rust consumers.
//!
//! `ipc-import` goes the other way with the same pieces: an [`ImportDocument`] describes a
//! producer's columns on its GPU exactly as an export describes the server's (per column a
//! handle, the allocation's size and every buffer's offset from its base), and the server
//! copies them into memory of its own.

use arrow::datatypes::{DataType, Field, Schema};
use arrow::ipc::writer::IpcWriteOptions;
use arrow_flight::{IpcMessage, SchemaAsIpc};
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde::{Deserialize, Serialize};

use crate::backend::{
    BufferKind, ExportDevice, ExportedArray, ExportedBuffer, ExportedColumn, ForeignAllocation,
};
use crate::error::Error;
use crate::store::{Access, Dataset, Export, ExportedPartition, PutMode};

/// The document version a client gets unless it asks for another.
pub const VERSION_1: u32 = 1;
/// The newest document version this server writes.
pub const VERSION: u32 = 2;

/// The whole `ipc-export` result, version 2.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportDocument {
    pub version: u32,
    /// Pass to `ipc-release` when done, or to `ipc-export` (as `"lease"`) to renew.
    pub lease: String,
    /// RFC 3339, UTC. After this the server may free the memory.
    pub expires_at: String,
    pub num_rows: u64,
    /// Base64 of the Arrow IPC schema message of the exported columns.
    pub schema: String,
    /// The device the consumer named (`"device"`): where it maps partitions whose `access`
    /// is `peer`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consumer_device: Option<DeviceDocument>,
    /// In row order.
    pub partitions: Vec<PartitionDocument>,
}

/// Rows of the dataset held together on one device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionDocument {
    pub num_rows: u64,
    /// The device whose memory holds these columns.
    pub device: DeviceDocument,
    /// `local`: map the handles on `device`. `peer`: map them on the consumer's device, which
    /// reads `device`'s memory directly. `replica`: a copy on the consumer's device, made for
    /// this lease and freed with it.
    pub access: Access,
    pub columns: Vec<ColumnDocument>,
}

/// The whole `ipc-export` result, version 1: one partition's columns.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportDocumentV1 {
    pub version: u32,
    pub lease: String,
    pub expires_at: String,
    pub device: DeviceDocument,
    pub num_rows: u64,
    pub schema: String,
    pub columns: Vec<ColumnDocument>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceDocument {
    /// The server's number for the device, as `status` and endpoints' `app_metadata` give
    /// it (version 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<u32>,
    /// The server's CUDA ordinal; a consumer matches `uuid` or `pci_bus_id` instead.
    pub ordinal: u32,
    pub uuid: String,
    pub pci_bus_id: String,
}

/// A column: the allocation its handle maps, and its arrays.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ColumnDocument {
    /// Base64 of the 64-byte `cudaIpcMemHandle_t`. Columns may share an allocation (small
    /// columns are packed together): equal handles name the same memory; open each once.
    pub handle: String,
    pub allocation_bytes: u64,
    #[serde(flatten)]
    pub array: ArrayDocument,
}

/// One Arrow array; all its buffers, children's and dictionary's lie in its column's
/// allocation. Arrays start at row 0.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArrayDocument {
    /// The field name (`"values"` for a dictionary's values); may be left out of an import.
    #[serde(default)]
    pub name: String,
    /// The Arrow type, for reading; the schema has it exactly. May be left out of an import.
    #[serde(rename = "type", default)]
    pub data_type: String,
    pub length: u64,
    pub null_count: u64,
    pub buffers: Vec<BufferDocument>,
    pub children: Vec<ArrayDocument>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dictionary: Option<Box<ArrayDocument>>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufferDocument {
    /// `validity`, `offsets` or `values`.
    pub kind: BufferKind,
    /// Bytes from the allocation's base.
    pub offset: u64,
    pub length: u64,
    /// In an import, the handle of the allocation this buffer lies in where that is not its
    /// column's (base64, 64 bytes); exports never set it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handle: Option<String>,
    /// With `handle`: that allocation's size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocation_bytes: Option<u64>,
}

/// The document of `version` for `export` of `dataset`.
pub fn document(
    dataset: &Dataset,
    export: &Export,
    version: u32,
    consumer: Option<&ExportDevice>,
) -> Result<serde_json::Value, Error> {
    let schema = dataset.schema();
    let fields: Vec<&Field> = export
        .columns
        .iter()
        .map(|&index| schema.field(index))
        .collect();
    let exported_schema = Schema::new_with_metadata(
        fields.iter().map(|f| (*f).clone()).collect::<Vec<_>>(),
        schema.metadata().clone(),
    );
    let options = IpcWriteOptions::default();
    let message = IpcMessage::try_from(SchemaAsIpc::new(&exported_schema, &options))
        .map_err(|e| Error::Internal(format!("encoding the exported schema: {e}")))?;
    let columns = |exported: &[ExportedColumn]| -> Vec<ColumnDocument> {
        fields
            .iter()
            .zip(exported)
            .map(|(field, column)| ColumnDocument {
                handle: BASE64.encode(column.handle),
                allocation_bytes: column.allocation_bytes,
                array: array_document(field.name(), field.data_type(), &column.array),
            })
            .collect()
    };
    let lease = export.lease.id.clone();
    let expires_at = rfc3339(export.lease.expires_at);
    let schema = BASE64.encode(&message.0);
    let encoded = if version == VERSION_1 {
        let [partition] = export.partitions.as_slice() else {
            return Err(Error::Internal(format!(
                "a version 1 document describes one partition, not {}",
                export.partitions.len()
            )));
        };
        serde_json::to_value(ExportDocumentV1 {
            version,
            lease,
            expires_at,
            device: device_document(None, &partition.gpu),
            num_rows: dataset.num_rows(),
            schema,
            columns: columns(&partition.columns),
        })
    } else {
        let partition_document = |partition: &ExportedPartition| PartitionDocument {
            num_rows: partition.rows,
            device: device_document(Some(partition.device), &partition.gpu),
            access: partition.access,
            columns: columns(&partition.columns),
        };
        serde_json::to_value(ExportDocument {
            version: VERSION,
            lease,
            expires_at,
            num_rows: dataset.num_rows(),
            schema,
            consumer_device: export
                .lease
                .terms
                .consumer
                .zip(consumer)
                .map(|(index, device)| device_document(Some(index), device)),
            partitions: export.partitions.iter().map(partition_document).collect(),
        })
    };
    encoded.map_err(|e| Error::Internal(format!("encoding the export document: {e}")))
}

fn device_document(index: Option<u32>, device: &ExportDevice) -> DeviceDocument {
    DeviceDocument {
        device: index,
        ordinal: device.ordinal,
        uuid: device.uuid.clone(),
        pci_bus_id: device.pci_bus_id.clone(),
    }
}

/// `array` named as the schema names it: children after their fields.
fn array_document(name: &str, data_type: &DataType, array: &ExportedArray) -> ArrayDocument {
    let child_fields = child_types(data_type);
    let children = array
        .children
        .iter()
        .enumerate()
        .map(|(index, child)| {
            let (name, data_type) = child_fields
                .get(index)
                .cloned()
                .unwrap_or_else(|| (format!("child{index}"), child.data_type.clone()));
            array_document(&name, &data_type, child)
        })
        .collect();
    let dictionary = array.dictionary.as_ref().map(|values| {
        let value_type = match data_type {
            DataType::Dictionary(_, value) => value.as_ref().clone(),
            _ => values.data_type.clone(),
        };
        Box::new(array_document("values", &value_type, values))
    });
    ArrayDocument {
        name: name.to_owned(),
        data_type: data_type.to_string(),
        length: array.length,
        null_count: array.null_count,
        buffers: array
            .buffers
            .iter()
            .map(|b| BufferDocument {
                kind: b.kind,
                offset: b.offset,
                length: b.length,
                handle: None,
                allocation_bytes: None,
            })
            .collect(),
        children,
        dictionary,
    }
}

impl ExportDocument {
    /// The exported columns' schema, decoded.
    pub fn decode_schema(&self) -> Result<Schema, String> {
        decode_schema(&self.schema)
    }
}

fn decode_schema(base64: &str) -> Result<Schema, String> {
    let bytes = BASE64
        .decode(base64)
        .map_err(|e| format!("schema is not base64: {e}"))?;
    arrow::ipc::convert::try_schema_from_ipc_buffer(&bytes)
        .map_err(|e| format!("schema is not an Arrow IPC schema message: {e}"))
}

/// The import document version this server reads.
pub const IMPORT_VERSION: u32 = 1;

/// The `ipc-import` request: columns a producer on this node holds on one of the server's
/// GPUs, for the server to copy into a dataset as a put of them would (see docs/protocol.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImportDocument {
    /// [`IMPORT_VERSION`] where given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<u32>,
    /// The dataset to create, replace or append to.
    pub name: String,
    /// As a put's; `create` where left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<PutMode>,
    /// The GPU whose memory holds the columns, by UUID (or PCI bus id): the server's device
    /// with that identity receives the dataset. `ordinal` is the producer's own, for logs.
    pub device: DeviceDocument,
    pub num_rows: u64,
    /// Base64 of the Arrow IPC schema message of the columns.
    pub schema: String,
    /// In schema order; each column's buffers lie in the allocation its handle maps.
    pub columns: Vec<ColumnDocument>,
}

impl ImportDocument {
    /// The columns' schema, decoded.
    pub fn decode_schema(&self) -> Result<Schema, String> {
        decode_schema(&self.schema)
    }

    /// The columns as the backend takes them, typed by `schema` (the document's own `type`
    /// strings are for people). Only the document's shape is checked here; its numbers are
    /// checked by the store (`Store::check_import`).
    pub fn columns(&self, schema: &Schema) -> Result<Vec<ExportedColumn>, String> {
        if schema.fields().len() != self.columns.len() {
            return Err(format!(
                "the schema has {} fields but the document describes {} columns",
                schema.fields().len(),
                self.columns.len()
            ));
        }
        schema
            .fields()
            .iter()
            .zip(&self.columns)
            .map(|(field, column)| {
                Ok(ExportedColumn {
                    handle: column
                        .handle_bytes()
                        .map_err(|e| format!("column {}: {e}", field.name()))?,
                    allocation_bytes: column.allocation_bytes,
                    array: exported_array(field.name(), field.data_type(), &column.array)?,
                })
            })
            .collect()
    }
}

/// The types of `data_type`'s children, in order.
fn child_types(data_type: &DataType) -> Vec<(String, DataType)> {
    match data_type {
        DataType::List(f)
        | DataType::LargeList(f)
        | DataType::FixedSizeList(f, _)
        | DataType::Map(f, _) => vec![(f.name().clone(), f.data_type().clone())],
        DataType::Struct(fields) => fields
            .iter()
            .map(|f| (f.name().clone(), f.data_type().clone()))
            .collect(),
        _ => Vec::new(),
    }
}

/// `array`, described in a document, as an array of `data_type` named `path`.
fn exported_array(
    path: &str,
    data_type: &DataType,
    array: &ArrayDocument,
) -> Result<ExportedArray, String> {
    let types = child_types(data_type);
    if types.len() != array.children.len() {
        return Err(format!(
            "{path}: an array of type {data_type} has {} children, not {}",
            types.len(),
            array.children.len()
        ));
    }
    let children = types
        .iter()
        .zip(&array.children)
        .map(|((name, child_type), child)| {
            exported_array(&format!("{path}.{name}"), child_type, child)
        })
        .collect::<Result<_, _>>()?;
    let dictionary = match (data_type, &array.dictionary) {
        (DataType::Dictionary(_, value_type), Some(values)) => Some(Box::new(exported_array(
            &format!("{path}.values"),
            value_type,
            values,
        )?)),
        (DataType::Dictionary(..), None) => {
            return Err(format!(
                "{path}: a dictionary array needs its \"dictionary\""
            ));
        }
        (_, Some(_)) => {
            return Err(format!(
                "{path}: only dictionary arrays have a \"dictionary\""
            ));
        }
        (_, None) => None,
    };
    Ok(ExportedArray {
        data_type: data_type.clone(),
        length: array.length,
        null_count: array.null_count,
        buffers: array
            .buffers
            .iter()
            .map(|b| {
                let allocation = match (&b.handle, b.allocation_bytes) {
                    (None, None) => None,
                    (Some(handle), Some(bytes)) => Some(ForeignAllocation {
                        handle: handle_bytes(handle).map_err(|e| format!("{path}: {e}"))?,
                        bytes,
                    }),
                    _ => {
                        return Err(format!(
                            "{path}: a buffer's \"handle\" and \"allocation_bytes\" go together"
                        ));
                    }
                };
                Ok(ExportedBuffer {
                    kind: b.kind,
                    offset: b.offset,
                    length: b.length,
                    allocation,
                })
            })
            .collect::<Result<_, String>>()?,
        children,
        dictionary,
    })
}

impl ColumnDocument {
    /// The 64 handle bytes.
    pub fn handle_bytes(&self) -> Result<[u8; 64], String> {
        handle_bytes(&self.handle)
    }
}

fn handle_bytes(base64: &str) -> Result<[u8; 64], String> {
    let bytes = BASE64
        .decode(base64)
        .map_err(|e| format!("handle is not base64: {e}"))?;
    bytes
        .try_into()
        .map_err(|b: Vec<u8>| format!("a handle has 64 bytes, not {}", b.len()))
}

/// RFC 3339 in UTC with milliseconds, as every timestamp the server reports.
pub fn rfc3339(time: std::time::SystemTime) -> String {
    chrono::DateTime::<chrono::Utc>::from(time).to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}
