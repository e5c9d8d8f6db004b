//! Dataset names and the descriptors that carry them.
//!
//! A dataset is named by a PATH descriptor of exactly one element. `DoPut` also takes a CMD
//! descriptor holding JSON `{"name": "...", "mode": "create" | "replace" | "append"}` so a client
//! can choose what happens to an existing dataset, and `GetFlightInfo` (and `GetSchema`) one
//! holding a [`ReadCommand`], `{"name": "...", "columns": [...], "compression": "lz4" | "zstd"}`,
//! whose tickets then read only those columns, compressed.

use arrow::datatypes::Schema;
use arrow_flight::FlightDescriptor;
use arrow_flight::flight_descriptor::DescriptorType;

use crate::error::Error;
use crate::store::{PutMode, column_indices};

/// Longest dataset name, in bytes of UTF-8.
pub const MAX_NAME_BYTES: usize = 256;

/// Longest JSON document in a CMD descriptor or an action body.
pub const MAX_JSON_BYTES: usize = 16 << 10;

/// Parses a JSON request document: an object (serde would also fill a struct from an array, so
/// `["t", "create"]` would pass for `{"name": "t", "mode": "create"}`), of bounded size.
/// `usage` says what the document should look like.
pub fn parse_json_object<T: serde::de::DeserializeOwned>(
    raw: &[u8],
    usage: &str,
) -> Result<T, Error> {
    if raw.len() > MAX_JSON_BYTES {
        return Err(Error::InvalidCommand(format!(
            "{usage}; this document has {} bytes, over the limit of {MAX_JSON_BYTES}",
            raw.len()
        )));
    }
    let object: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(raw).map_err(|e| Error::InvalidCommand(format!("{usage}: {e}")))?;
    T::deserialize(serde_json::Value::Object(object))
        .map_err(|e| Error::InvalidCommand(format!("{usage}: {e}")))
}

/// Checks that `raw` is a valid dataset name: non-empty UTF-8 of at most [`MAX_NAME_BYTES`]
/// bytes without control characters.
pub fn parse_name(raw: &[u8]) -> Result<String, Error> {
    let name = std::str::from_utf8(raw)
        .map_err(|_| Error::InvalidDescriptor("dataset names must be UTF-8".to_owned()))?;
    if name.is_empty() {
        return Err(Error::InvalidDescriptor(
            "dataset names must not be empty".to_owned(),
        ));
    }
    if name.len() > MAX_NAME_BYTES {
        return Err(Error::InvalidDescriptor(format!(
            "dataset names are at most {MAX_NAME_BYTES} bytes; this one has {}",
            name.len()
        )));
    }
    if name.chars().any(char::is_control) {
        return Err(Error::InvalidDescriptor(
            "dataset names must not contain control characters".to_owned(),
        ));
    }
    Ok(name.to_owned())
}

/// How a reader wants a dataset's record batches encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReadOptions {
    /// Compress each body buffer (Arrow IPC buffer compression), for slow networks: pyarrow
    /// and arrow-rs readers decompress by themselves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compression: Option<Compression>,
}

/// An Arrow IPC compression codec.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    Lz4,
    Zstd,
}

impl From<Compression> for arrow::ipc::CompressionType {
    fn from(codec: Compression) -> Self {
        match codec {
            Compression::Lz4 => Self::LZ4_FRAME,
            Compression::Zstd => Self::ZSTD,
        }
    }
}

/// A GetFlightInfo or GetSchema CMD descriptor: the dataset, how to encode its batches, and
/// which of its columns to read, in which order (all, in the schema's order, when absent).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReadCommand {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compression: Option<Compression>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub columns: Option<Vec<String>>,
    /// A row predicate in SQL, as a Flight SQL statement's `WHERE` takes it.
    #[serde(default, rename = "where", skip_serializing_if = "Option::is_none")]
    pub filter: Option<String>,
}

/// What a GetFlightInfo or GetSchema descriptor asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadTarget {
    pub name: String,
    pub options: ReadOptions,
    /// Column names to read, in order; `None` reads them all. Checked against the dataset's
    /// schema by [`projection`].
    pub columns: Option<Vec<String>>,
    /// The rows to read, as the SQL of a `WHERE` clause; `None` reads them all.
    pub filter: Option<String>,
}

/// The dataset a GetFlightInfo or GetSchema descriptor names, and how to read it: a PATH
/// descriptor, or a CMD descriptor holding a [`ReadCommand`].
pub fn read_target(descriptor: &FlightDescriptor) -> Result<ReadTarget, Error> {
    if DescriptorType::try_from(descriptor.r#type) != Ok(DescriptorType::Cmd) {
        return Ok(ReadTarget {
            name: dataset_name(descriptor)?,
            options: ReadOptions::default(),
            columns: None,
            filter: None,
        });
    }
    let command: ReadCommand = parse_json_object(
        &descriptor.cmd,
        "a GetFlightInfo CMD must be a JSON object {\"name\": \"...\", \"columns\": [\"...\"] \
         (optional), \"compression\": \"lz4\" | \"zstd\" (optional), \"where\": \"SQL \
         predicate\" (optional)}",
    )?;
    Ok(ReadTarget {
        name: parse_name(command.name.as_bytes())?,
        options: ReadOptions {
            compression: command.compression,
        },
        columns: command.columns,
        filter: command.filter,
    })
}

/// Checks a request's list of columns: at least one, each at most once. What a request costs
/// to answer then follows the dataset's columns, not the length of the list a client sends
/// (an `ipc-export` describes every column it names in every partition).
pub fn distinct_columns(columns: &[String]) -> Result<(), Error> {
    if columns.is_empty() {
        return Err(Error::InvalidCommand(
            "\"columns\" must name at least one column; leave it out for them all".to_owned(),
        ));
    }
    let mut seen = std::collections::HashSet::with_capacity(columns.len());
    let repeated: Vec<&str> = columns
        .iter()
        .filter(|column| !seen.insert(column.as_str()))
        .map(String::as_str)
        .collect();
    if !repeated.is_empty() {
        return Err(Error::InvalidCommand(format!(
            "\"columns\" names each column at most once; repeated: {repeated:?}"
        )));
    }
    Ok(())
}

/// The schema positions of the columns a [`ReadCommand`] names, checked against `schema` (of
/// dataset `name`): at least one, every one known (an error names all that are not), each at
/// most once, so never more than the schema has. The document's size bounds the list.
pub fn projection(name: &str, schema: &Schema, columns: &[String]) -> Result<Vec<usize>, Error> {
    let fields = schema.fields().len();
    distinct_columns(columns)?;
    let indices = column_indices(name, schema, columns)?;
    if columns.len() > fields {
        return Err(Error::InvalidCommand(format!(
            "\"columns\" names {} columns, but dataset '{name}' has {fields}",
            columns.len()
        )));
    }
    Ok(indices)
}

/// The dataset a PATH descriptor names.
pub fn dataset_name(descriptor: &FlightDescriptor) -> Result<String, Error> {
    match DescriptorType::try_from(descriptor.r#type) {
        Ok(DescriptorType::Path) => match descriptor.path.as_slice() {
            [name] => parse_name(name.as_bytes()),
            path => Err(Error::InvalidDescriptor(format!(
                "a dataset is named by a PATH descriptor of exactly one element; this one has {}",
                path.len()
            ))),
        },
        _ => Err(Error::InvalidDescriptor(
            "name the dataset with a PATH descriptor, e.g. FlightDescriptor.for_path(\"name\")"
                .to_owned(),
        )),
    }
}

/// What a `DoPut` descriptor asks for: the dataset, the mode, and optionally the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutTarget {
    pub name: String,
    pub mode: PutMode,
    /// The device to place the put on; `None` lets the server place it.
    pub device: Option<DeviceRef>,
}

/// A device as a client names it: its number in `status`, or a GPU's UUID.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(untagged)]
pub enum DeviceRef {
    Number(u32),
    Uuid(String),
}

/// The target a `DoPut` descriptor names. PATH means `create`, placed by the server.
pub fn put_target(descriptor: Option<&FlightDescriptor>) -> Result<PutTarget, Error> {
    let Some(descriptor) = descriptor else {
        return Err(Error::InvalidDescriptor(
            "the first DoPut message must carry a flight descriptor naming the dataset".to_owned(),
        ));
    };
    match DescriptorType::try_from(descriptor.r#type) {
        Ok(DescriptorType::Cmd) => {
            #[derive(serde::Deserialize)]
            #[serde(deny_unknown_fields)]
            struct PutCommand {
                name: String,
                #[serde(default = "create")]
                mode: PutMode,
                #[serde(default)]
                device: Option<DeviceRef>,
            }
            fn create() -> PutMode {
                PutMode::Create
            }
            let command: PutCommand = parse_json_object(
                &descriptor.cmd,
                "DoPut CMD must be a JSON object {\"name\": \"...\", \"mode\": \"create\" | \"replace\" | \"append\", \"device\": number or GPU UUID (optional)}",
            )?;
            Ok(PutTarget {
                name: parse_name(command.name.as_bytes())?,
                mode: command.mode,
                device: command.device,
            })
        }
        _ => Ok(PutTarget {
            name: dataset_name(descriptor)?,
            mode: PutMode::Create,
            device: None,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        assert_eq!(parse_name(b"trips").expect("valid"), "trips");
        assert_eq!(
            parse_name("données/2024".as_bytes()).expect("valid"),
            "données/2024"
        );
        for bad in [&b""[..], b"a\nb", b"\xff", &[b'x'; 257][..]] {
            assert!(matches!(parse_name(bad), Err(Error::InvalidDescriptor(_))));
        }
        assert!(parse_name(&[b'x'; 256]).is_ok());
    }

    #[test]
    fn read_commands_choose_a_compression() {
        let cmd = FlightDescriptor::new_cmd(r#"{"name": "t", "compression": "zstd"}"#);
        let target = read_target(&cmd).expect("valid");
        assert_eq!(
            (target.name.as_str(), target.options.compression),
            ("t", Some(Compression::Zstd))
        );
        let cmd = FlightDescriptor::new_cmd(r#"{"name": "t"}"#);
        let all = ReadTarget {
            name: "t".to_owned(),
            options: ReadOptions::default(),
            columns: None,
            filter: None,
        };
        assert_eq!(read_target(&cmd).expect("valid"), all);
        let path = FlightDescriptor::new_path(vec!["t".to_owned()]);
        assert_eq!(read_target(&path).expect("valid"), all);
        let cmd = FlightDescriptor::new_cmd(r#"{"name": "t", "columns": ["b", "a"]}"#);
        assert_eq!(
            read_target(&cmd).expect("valid").columns,
            Some(vec!["b".to_owned(), "a".to_owned()])
        );
        let cmd = FlightDescriptor::new_cmd(r#"{"name": "t", "where": "a > 1"}"#);
        assert_eq!(
            read_target(&cmd).expect("valid").filter.as_deref(),
            Some("a > 1")
        );
        for bad in [
            r#"{"name": "t", "compression": "gzip"}"#,
            r#"{"name": "t", "compresion": "lz4"}"#,
            r#"{"compression": "lz4"}"#,
            r#"{"name": "t", "columns": "a"}"#,
            r#"{"name": "t", "columns": [1]}"#,
        ] {
            let cmd = FlightDescriptor::new_cmd(bad.to_owned());
            assert!(
                matches!(read_target(&cmd), Err(Error::InvalidCommand(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn projections_name_known_columns_once() {
        use arrow::datatypes::{DataType, Field};
        let schema = Schema::new(vec![
            Field::new("a", DataType::Int32, false),
            Field::new("b", DataType::Utf8, true),
        ]);
        let names = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            projection("t", &schema, &names(&["b", "a"])).expect("valid"),
            [1, 0]
        );
        let message = |list: &[&str]| match projection("t", &schema, &names(list)) {
            Err(error) => tonic::Status::from(error),
            Ok(columns) => panic!("{list:?} gave {columns:?}"),
        };
        for (list, expected) in [
            (&[][..], "at least one"),
            (&["a", "a"], "repeated: [\"a\"]"),
            (
                &["x", "a"],
                "has no column 'x'; its columns are [\"a\", \"b\"]",
            ),
            (&["x", "y"], "has no columns 'x', 'y'"),
        ] {
            let status = message(list);
            assert_eq!(status.code(), tonic::Code::InvalidArgument, "{list:?}");
            assert!(status.message().contains(expected), "{}", status.message());
        }
    }

    #[test]
    fn put_commands_choose_a_mode() {
        let target = |name: &str, mode, device| PutTarget {
            name: name.to_owned(),
            mode,
            device,
        };
        let cmd = FlightDescriptor::new_cmd(r#"{"name": "t", "mode": "append"}"#);
        assert_eq!(
            put_target(Some(&cmd)).expect("valid"),
            target("t", PutMode::Append, None)
        );
        let cmd = FlightDescriptor::new_cmd(r#"{"name": "t", "device": 1}"#);
        assert_eq!(
            put_target(Some(&cmd)).expect("valid"),
            target("t", PutMode::Create, Some(DeviceRef::Number(1)))
        );
        let cmd = FlightDescriptor::new_cmd(r#"{"name": "t", "device": "GPU-12"}"#);
        assert_eq!(
            put_target(Some(&cmd)).expect("valid"),
            target(
                "t",
                PutMode::Create,
                Some(DeviceRef::Uuid("GPU-12".to_owned()))
            )
        );
        let path = FlightDescriptor::new_path(vec!["t".to_owned()]);
        assert_eq!(
            put_target(Some(&path)).expect("valid"),
            target("t", PutMode::Create, None)
        );
        for bad in [
            r#"{"name": "t", "mode": "upsert"}"#,
            r#"{"name": "t", "device": -1}"#,
            r#"{"name": "t", "device": [0]}"#,
            "not json",
            r#"{"mode": "create"}"#,
            r#"["t", "create"]"#,
            r#"["t"]"#,
        ] {
            let cmd = FlightDescriptor::new_cmd(bad.to_owned());
            assert!(matches!(
                put_target(Some(&cmd)),
                Err(Error::InvalidCommand(_))
            ));
        }
        let two = FlightDescriptor::new_path(vec!["a".to_owned(), "b".to_owned()]);
        assert!(matches!(
            put_target(Some(&two)),
            Err(Error::InvalidDescriptor(_))
        ));
        assert!(matches!(put_target(None), Err(Error::InvalidDescriptor(_))));
    }
}
