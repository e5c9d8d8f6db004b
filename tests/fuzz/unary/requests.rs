//! What a unary case sends: names, descriptors, tickets (issued, bare and forged) and action
//! bodies.

use arrow::record_batch::RecordBatch;
use arrow_flight::{Action, FlightDescriptor};
use rand::Rng;
use rand::rngs::StdRng;
use rand::seq::IndexedRandom;

use super::UnaryRig;
use crate::campaign::{Checked, Failure};
use crate::checks::timed;
use crate::common::path;
use crate::descriptors::{deep, odd_descriptor};
use crate::mutate::{Log, mutate_bytes};

impl UnaryRig {
    pub(crate) fn fixture_name(&self, rng: &mut StdRng) -> &'static str {
        self.fixtures.choose(rng).expect("fixtures").0
    }

    /// A name a request could carry: a fixture, or one that is not there or not valid.
    fn some_name(&self, rng: &mut StdRng) -> String {
        if rng.random_bool(0.7) {
            return self.fixture_name(rng).to_owned();
        }
        let names = [
            "missing",
            "",
            "a\nb",
            "\u{0}",
            "t ",
            "T",
            "é/ü",
            "\u{202e}t",
        ];
        match rng.random_range(0..=names.len()) {
            i if i < names.len() => names[i].to_owned(),
            _ => "n".repeat(*[256_usize, 257, 70_000].choose(rng).expect("lengths")),
        }
    }

    pub(crate) fn descriptor(&self, rng: &mut StdRng, log: &mut Log) -> FlightDescriptor {
        match rng.random_range(0..8) {
            7 => {
                let (label, command) = self.sql_command(rng);
                log.push(format!("Flight SQL {}", abbreviate(&label)));
                FlightDescriptor::new_cmd(command)
            }
            0..=2 => {
                let name = self.some_name(rng);
                log.push(format!("PATH {:?}", abbreviate(&name)));
                path(&name)
            }
            3 => {
                let name = self.fixture_name(rng);
                log.push(format!("CMD naming {name}"));
                crate::common::cmd(name, "create")
            }
            4 => {
                let (name, codec) = (self.some_name(rng), read_codec(rng));
                let columns = read_columns(rng);
                log.push(format!(
                    "read CMD {:?} compression {codec} columns {}",
                    abbreviate(&name),
                    abbreviate(&columns)
                ));
                let columns = if columns.is_empty() {
                    String::new()
                } else {
                    format!(r#", "columns": {columns}"#)
                };
                // A filtered read: the predicate of a WHERE clause, or text that is not one.
                let wheres = [
                    "",
                    r#", "where": "c0 > 3 AND c1 IS NOT NULL""#,
                    r#", "where": "c0 IN (1, 2, 3) OR NOT c2 BETWEEN 1 AND 9""#,
                    r#", "where": "c0 > ?""#,
                    r#", "where": "1 = 1) UNION (SELECT 1""#,
                    r#", "where": "c0 > 1 LIMIT 2""#,
                    r#", "where": """#,
                    r#", "where": 7"#,
                ];
                let filter = *wheres.choose(rng).expect("wheres");
                log.push(format!("where {filter:?}"));
                FlightDescriptor::new_cmd(format!(
                    r#"{{"name": {}, "compression": {codec}{columns}{filter}}}"#,
                    serde_json::Value::from(name)
                ))
            }
            _ => {
                let (label, descriptor) = odd_descriptor(rng, "create");
                log.push(format!("descriptor: {label}"));
                descriptor.unwrap_or_default()
            }
        }
    }

    /// A server-issued ticket, a bare name or a forged ticket, perhaps mutated.
    /// The ticket, and the rows it must return if it was left intact.
    pub(crate) async fn ticket(
        &mut self,
        rng: &mut StdRng,
        log: &mut Log,
    ) -> Checked<(Vec<u8>, Option<usize>)> {
        let mut expected_rows = None;
        let mut ticket = match rng.random_range(0..12) {
            10 => {
                // A Flight SQL statement's ticket, as the server issued it.
                let (label, command) = self.sql_command(rng);
                let descriptor = FlightDescriptor::new_cmd(command);
                match timed("GetFlightInfo", self.client.get_flight_info(descriptor)).await? {
                    Ok(info) if !info.endpoint.is_empty() => {
                        log.push(format!(
                            "issued Flight SQL ticket of {}",
                            abbreviate(&label)
                        ));
                        let endpoint = info.endpoint.choose(rng).expect("an endpoint");
                        endpoint.ticket.clone().expect("a ticket").ticket.to_vec()
                    }
                    _ => {
                        log.push(format!("refused Flight SQL {}", abbreviate(&label)));
                        forged_statement_ticket(rng)
                    }
                }
            }
            11 => {
                log.push("forged Flight SQL statement ticket");
                forged_statement_ticket(rng)
            }
            0..=4 => {
                let name = self.fixture_name(rng);
                // Tickets for plain replies, LZ4 or ZSTD compressed ones, and projected ones
                // (the fixture's columns reversed; mutations then rewrite their indices).
                let columns: Vec<String> = self
                    .fixtures
                    .iter()
                    .find(|(fixture, _)| *fixture == name)
                    .map(|(_, batches)| {
                        let schema = batches[0].schema();
                        schema
                            .fields()
                            .iter()
                            .rev()
                            .map(|f| f.name().clone())
                            .collect()
                    })
                    .unwrap_or_default();
                let (descriptor, how) = match rng.random_range(0..4) {
                    0 => (path(name), "plain"),
                    1 => (compressed_read(name, "lz4"), "lz4"),
                    2 => (compressed_read(name, "zstd"), "zstd"),
                    _ if columns.is_empty() => (path(name), "plain"),
                    _ => (projected_read(name, &columns), "projected"),
                };
                let info = timed("GetFlightInfo", self.client.get_flight_info(descriptor))
                    .await?
                    .map_err(|e| Failure::new("fixture unreadable", e.to_string()))?;
                let endpoint = info.endpoint.choose(rng).expect("an endpoint");
                log.push(format!("issued {how} ticket of {name}"));
                let ticket = endpoint.ticket.clone().expect("a ticket").ticket.to_vec();
                expected_rows = issued_rows(&ticket);
                ticket
            }
            5 | 6 => {
                let name = self.some_name(rng);
                log.push(format!("bare name {:?}", abbreviate(&name)));
                expected_rows = self
                    .fixtures
                    .iter()
                    .find(|(fixture, _)| *fixture == name)
                    .map(|(_, batches)| batches.iter().map(RecordBatch::num_rows).sum());
                name.into_bytes()
            }
            _ => {
                let name = self.fixture_name(rng);
                let forged = forged_ticket(rng, name);
                log.push(format!(
                    "forged ticket {:?}",
                    abbreviate(&String::from_utf8_lossy(&forged))
                ));
                forged
            }
        };
        if rng.random_bool(0.5) {
            expected_rows = None;
            if rng.random_bool(0.5) {
                rewrite_number(rng, &mut ticket, log);
            } else {
                mutate_bytes(rng, &mut ticket, log, "ticket");
            }
        }
        Ok((ticket, expected_rows))
    }

    /// A Flight SQL command (protobuf `Any`): a statement from a corpus of supported,
    /// unsupported and broken SQL over the fixtures, or a catalog command.
    fn sql_command(&self, rng: &mut StdRng) -> (String, Vec<u8>) {
        use arrow_flight::sql::{
            CommandGetCatalogs, CommandGetDbSchemas, CommandGetSqlInfo, CommandGetTables,
            CommandStatementQuery, ProstMessageExt,
        };
        use prost::Message;
        let name = self.fixture_name(rng);
        let deep_not = format!("SELECT * FROM t WHERE {}c0 > 1", "NOT ".repeat(60));
        let long_in = format!(
            "SELECT * FROM t WHERE c0 IN ({})",
            (0..12_000)
                .map(|i| i.to_string())
                .collect::<Vec<_>>()
                .join(",")
        );
        let statements = [
            format!(r#"SELECT * FROM "{name}""#),
            format!(r#"SELECT * FROM "{name}" LIMIT 3"#),
            "SELECT c0 FROM t WHERE c0 > 10 AND c1 IS NOT NULL".to_owned(),
            "SELECT c2, c0 FROM t WHERE c0 BETWEEN 5 AND 9 OR c1 IN (1, 2, 3)".to_owned(),
            "SELECT * FROM s WHERE c0 = 'x'".to_owned(),
            "SELECT * FROM t WHERE c0 > ?".to_owned(),
            "SELECT * FROM t WHERE c0 > 99999999999999999999999999999".to_owned(),
            "SELECT * FROM types WHERE nope = 1".to_owned(),
            "SELECT COUNT(*) FROM t".to_owned(),
            "DELETE FROM t".to_owned(),
            "SELECT".to_owned(),
            "\u{0}".to_owned(),
            deep_not,
            long_in,
        ];
        let pick = rng.random_range(0..statements.len() + 4);
        match statements.get(pick) {
            Some(sql) => (
                format!("query {sql}"),
                CommandStatementQuery {
                    query: sql.clone(),
                    transaction_id: None,
                }
                .as_any()
                .encode_to_vec(),
            ),
            None => match pick - statements.len() {
                0 => (
                    "GetCatalogs".into(),
                    CommandGetCatalogs {}.as_any().encode_to_vec(),
                ),
                1 => (
                    "GetDbSchemas".into(),
                    CommandGetDbSchemas::default().as_any().encode_to_vec(),
                ),
                2 => (
                    "GetTables".into(),
                    CommandGetTables {
                        include_schema: true,
                        table_name_filter_pattern: Some("%".into()),
                        ..CommandGetTables::default()
                    }
                    .as_any()
                    .encode_to_vec(),
                ),
                _ => (
                    "GetSqlInfo".into(),
                    CommandGetSqlInfo {
                        info: vec![0, 1, 500, u32::MAX],
                    }
                    .as_any()
                    .encode_to_vec(),
                ),
            },
        }
    }

    pub(crate) fn action(&self, rng: &mut StdRng, log: &mut Log) -> Action {
        let kind = *[
            "drop",
            "drop",
            "status",
            "ipc-export",
            "ipc-export",
            "ipc-release",
            "lease-renew",
            "shm-read",
            "shm-read",
            "ipc-import",
            "ipc-import",
            "move",
            "move",
            "copy",
            "",
            "DROP",
            "drop ",
            "list",
            "CreatePreparedStatement",
            "ClosePreparedStatement",
            "BeginTransaction",
            "CancelFlightInfo",
            "RenewFlightEndpoint",
        ]
        .choose(rng)
        .expect("actions");
        let name = self.some_name(rng);
        let column = ["c0", "c1", "s", "nope", ""].choose(rng).expect("columns");
        let lease_seconds = [0_u64, 1, 86_400, 86_401, u64::MAX].choose(rng);
        let move_device = *[1_i64, -1, 1 << 40].choose(rng).expect("devices");
        let long_uuid = "GPU-".repeat(2000);
        let move_uuid = *["GPU-x", "", long_uuid.as_str()]
            .choose(rng)
            .expect("uuids");
        let lease = *["", "x", "0123456789abcdef", name.as_str()]
            .choose(rng)
            .expect("leases");
        let bodies: Vec<(String, Vec<u8>)> = vec![
            (
                "name".into(),
                json_body(serde_json::json!({ "name": name })),
            ),
            (
                "name with extra".into(),
                json_body(serde_json::json!({"name": name, "extra": true})),
            ),
            ("empty object".into(), b"{}".to_vec()),
            ("empty".into(), Vec::new()),
            (
                "JSON array".into(),
                json_body(serde_json::json!([name, "create"])),
            ),
            (
                "name array".into(),
                json_body(serde_json::json!({ "name": [name] })),
            ),
            ("bare name".into(), name.clone().into_bytes()),
            ("null".into(), b"null".to_vec()),
            (
                "deep nesting".into(),
                format!(
                    r#"{{"name": {}}}"#,
                    deep(
                        *[127_usize, 129, 100_000].choose(rng).expect("depths"),
                        "[",
                        "]"
                    )
                )
                .into_bytes(),
            ),
            (
                "deep objects".into(),
                deep(200, r#"{"a":"#, "}")
                    .replace(r#":}"#, ":1}")
                    .into_bytes(),
            ),
            (
                "newlines".into(),
                format!("\n{{\n\"name\"\n:\n{}\n}}\n\n", serde_json::json!(name)).into_bytes(),
            ),
            (
                "non-UTF-8".into(),
                b"{\"name\": \"t\xff\xfe\", \"lease\": \"\xc3\"}".to_vec(),
            ),
            (
                "move to device 0".into(),
                json_body(serde_json::json!({"name": name, "device": 0})),
            ),
            (
                "move to a device out of range".into(),
                json_body(serde_json::json!({"name": name, "device": move_device})),
            ),
            (
                "move to a UUID".into(),
                json_body(serde_json::json!({"name": name, "device": move_uuid})),
            ),
            (
                "export columns".into(),
                json_body(serde_json::json!({"name": name, "columns": [column, column]})),
            ),
            (
                "export lease".into(),
                json_body(serde_json::json!({
                    "name": name,
                    "lease_seconds": lease_seconds,
                    "lease": "0123456789abcdef",
                })),
            ),
            (
                "negative lease".into(),
                br#"{"name": "t", "lease_seconds": -1}"#.to_vec(),
            ),
            (
                "float lease".into(),
                br#"{"name": "t", "lease_seconds": 1e300}"#.to_vec(),
            ),
            (
                "release".into(),
                json_body(serde_json::json!({
                    "lease": lease
                })),
            ),
            ("release number".into(), br#"{"lease": 5}"#.to_vec()),
            (
                "export to a device".into(),
                json_body(serde_json::json!({
                    "name": name,
                    "version": *[1_i64, 2, 3, -1].choose(rng).expect("versions"),
                    "device": move_device,
                    "copy": rng.random_bool(0.5),
                })),
            ),
            (
                "export to a UUID".into(),
                json_body(serde_json::json!({
                    "name": name,
                    "version": 2,
                    "device": move_uuid,
                    "copy": true,
                    "columns": [column],
                })),
            ),
            (
                "copy as".into(),
                json_body(
                    serde_json::json!({"name": name, "as": self.some_name(rng), "device": move_device}),
                ),
            ),
            (
                "shared-memory read".into(),
                json_body(serde_json::json!({
                    "name": name,
                    "columns": [column],
                    "where": *["c0 > 3", "c0 >", "s = 'x' OR c1 IS NULL", "nope = 1", ""]
                        .choose(rng)
                        .expect("predicates"),
                    "compression": *["lz4", "zstd", "gzip"].choose(rng).expect("codecs"),
                    "lease_seconds": lease_seconds,
                })),
            ),
            (
                "shared-memory read of everything".into(),
                json_body(serde_json::json!({"name": name, "lease_seconds": 1})),
            ),
            (
                "export copy without a device".into(),
                json_body(serde_json::json!({"name": name, "version": 2, "copy": true})),
            ),
        ];
        let mut bodies = bodies;
        bodies.push((
            "import document".into(),
            json_body(import_document(rng, &name)),
        ));
        bodies.push((
            "import document".into(),
            json_body(import_document(rng, &name)),
        ));
        // An import mostly gets an import document, forged where it counts.
        let chosen = if kind == "ipc-import" && rng.random_bool(0.7) {
            bodies.len() - 1
        } else {
            rng.random_range(0..bodies.len())
        };
        let (label, mut body) = bodies.into_iter().nth(chosen).expect("a body");
        log.push(format!("action {kind:?} body {label}"));
        if rng.random_bool(0.3) {
            mutate_bytes(rng, &mut body, log, "body");
        }
        Action::new(kind, body)
    }
}

/// An `ipc-import` document, well formed or forged: made-up handles (the host backend refuses
/// every import, a GPU server's driver opens none of these), and numbers from the edges.
fn import_document(rng: &mut StdRng, name: &str) -> serde_json::Value {
    use arrow::datatypes::{DataType, Field, Schema};
    use base64::Engine;
    use base64::engine::general_purpose::STANDARD as BASE64;
    let numbers = [
        0_u64,
        1,
        7,
        8,
        63,
        64,
        100,
        800,
        2 << 20,
        u32::MAX as u64,
        u64::MAX,
        // Where `n * width` fits and `(n + 1) * width` does not.
        u64::MAX / 8,
        u64::MAX / 8 + 1,
        u64::MAX / 4,
        u64::MAX / 4 + 1,
        u64::MAX / 2,
        u64::MAX / 2 + 1,
    ];
    let number = |rng: &mut StdRng| *numbers.choose(rng).expect("numbers");
    let rows = number(rng);
    let (offset, length, allocation) = (number(rng), number(rng), number(rng));
    let null_count = number(rng);
    let types = [
        DataType::Int64,
        DataType::Utf8,
        DataType::Boolean,
        DataType::List(std::sync::Arc::new(Field::new(
            "item",
            DataType::Int32,
            true,
        ))),
        DataType::Dictionary(Box::new(DataType::Int16), Box::new(DataType::Utf8)),
        DataType::Null,
    ];
    let data_type = types.choose(rng).expect("types").clone();
    let schema = Schema::new(vec![Field::new("c", data_type, rng.random_bool(0.5))]);
    let options = arrow::ipc::writer::IpcWriteOptions::default();
    let message =
        arrow_flight::IpcMessage::try_from(arrow_flight::SchemaAsIpc::new(&schema, &options))
            .expect("schema");
    let kinds = ["validity", "offsets", "values", "bits"];
    if rng.random_bool(0.3) {
        // Well formed: only the handle is made up.
        let schema = Schema::new(vec![Field::new("c", DataType::Int64, true)]);
        let message =
            arrow_flight::IpcMessage::try_from(arrow_flight::SchemaAsIpc::new(&schema, &options))
                .expect("schema");
        let rows = *[0_u64, 1, 100].choose(rng).expect("rows");
        return serde_json::json!({
            "name": name,
            "device": {"ordinal": 0, "uuid": "GPU-x", "pci_bus_id": "0000:00:00.0"},
            "num_rows": rows,
            "schema": BASE64.encode(&message.0),
            "columns": [{"handle": BASE64.encode([rng.random::<u8>(); 64]),
                         "allocation_bytes": 2 << 20, "length": rows, "null_count": 0,
                         "buffers": [{"kind": "values", "offset": 64, "length": rows * 8}],
                         "children": []}],
        });
    }
    let buffers: Vec<serde_json::Value> = (0..rng.random_range(0..4))
        .map(|_| {
            let mut buffer = serde_json::json!({
                "kind": kinds.choose(rng).expect("kinds"),
                "offset": if rng.random_bool(0.5) { offset } else { 0 },
                "length": if rng.random_bool(0.5) { length } else { rows.saturating_mul(8) },
            });
            if rng.random_bool(0.2) {
                buffer["handle"] = BASE64.encode([rng.random::<u8>(); 64]).into();
                buffer["allocation_bytes"] = allocation.into();
            }
            buffer
        })
        .collect();
    let child = serde_json::json!({"length": rows, "null_count": 0, "buffers": [], "children": []});
    let mut column = serde_json::json!({
        "handle": BASE64.encode([rng.random::<u8>(); 64]),
        "allocation_bytes": allocation,
        "length": rows,
        "null_count": if rng.random_bool(0.8) { 0 } else { null_count },
        "buffers": buffers,
        "children": if rng.random_bool(0.3) { vec![child.clone()] } else { vec![] },
    });
    if rng.random_bool(0.3) {
        column["dictionary"] = child;
    }
    serde_json::json!({
        "version": *[1_i64, 1, 1, 2].choose(rng).expect("versions"),
        "name": name,
        "mode": *["create", "replace", "append", "upsert"].choose(rng).expect("modes"),
        "device": {"ordinal": 0, "uuid": "GPU-x", "pci_bus_id": "0000:00:00.0"},
        "num_rows": rows,
        "schema": BASE64.encode(&message.0),
        "columns": if rng.random_bool(0.9) { vec![column] } else { vec![] },
    })
}

fn json_body(value: serde_json::Value) -> Vec<u8> {
    value.to_string().into_bytes()
}

fn abbreviate(text: &str) -> String {
    if text.len() <= 40 {
        text.to_owned()
    } else {
        format!(
            "{}... ({} bytes)",
            text.chars().take(20).collect::<String>(),
            text.len()
        )
    }
}

/// A ticket in the server's format with fields a server never issues.
fn forged_ticket(rng: &mut StdRng, name: &str) -> Vec<u8> {
    let numbers = [
        "0",
        "1",
        "63",
        "64",
        "250",
        "251",
        "18446744073709551615",
        "18446744073709551616",
        "-1",
        "1e3",
        "9223372036854775807",
    ];
    let mut number = || *numbers.choose(rng).expect("numbers");
    let (version, tag, start, end) = (number(), number(), number(), number());
    let body = match rng.random_range(0..7) {
        0 => format!(r#"{{"name":"{name}","version":{version},"start":{start},"end":{end}}}"#),
        6 => format!(
            r#"{{"name":"{name}","version":{version},"tag":{tag},"start":{start},"end":{end}}}"#
        ),
        1 => format!(r#"{{"name":"{name}","version":{version},"start":{start}}}"#),
        2 => {
            format!(r#"{{"name":"{name}","version":{version},"start":{start},"end":{end},"x":0}}"#)
        }
        3 => format!(r#"{{"name":"","version":1,"start":{start},"end":{end}}}"#),
        4 => format!(r#"["{name}",{version},{start},{end}]"#),
        _ => String::new(),
    };
    let format_line = *["1", "0", "2", "", "1\r", "01"]
        .choose(rng)
        .expect("versions");
    format!("\0gpu-flight-ticket/{format_line}\n{body}").into_bytes()
}

/// A GetFlightInfo descriptor whose tickets read `name` compressed with `codec`.
fn compressed_read(name: &str, codec: &str) -> FlightDescriptor {
    FlightDescriptor::new_cmd(serde_json::json!({"name": name, "compression": codec}).to_string())
}

/// A GetFlightInfo descriptor whose tickets read `columns` of `name`.
fn projected_read(name: &str, columns: &[String]) -> FlightDescriptor {
    FlightDescriptor::new_cmd(serde_json::json!({"name": name, "columns": columns}).to_string())
}

/// A `columns` value for a read command, as JSON (empty: none given): columns of the
/// fixtures, and lists the server must refuse (empty, repeated, unknown, not names, long).
fn read_columns(rng: &mut StdRng) -> String {
    let long = || serde_json::json!(vec!["x"; 3000]).to_string();
    let lists = [
        "",
        r#"["c0"]"#,
        r#"["c2", "c0"]"#,
        r#"["id", "s"]"#,
        r#"["dictionary", "i32", "struct", "map"]"#,
        r#"["l"]"#,
        "[]",
        r#"["c0", "c0"]"#,
        r#"["nope", "gone"]"#,
        r#""c0""#,
        "[0]",
        "null",
        r#"[""]"#,
        r#"["c0", null]"#,
    ];
    match rng.random_range(0..=lists.len()) {
        i if i < lists.len() => lists[i].to_owned(),
        _ => long(),
    }
}

/// A `compression` value for a read command, as JSON: a codec, or one the server must refuse.
fn read_codec(rng: &mut StdRng) -> &'static str {
    [
        "\"lz4\"", "\"zstd\"", "null", "\"gzip\"", "\"LZ4\"", "1", "[]", "\"\"",
    ]
    .choose(rng)
    .copied()
    .unwrap_or("null")
}

/// The row range of a server-issued ticket (the JSON after the format line), as a count.
fn issued_rows(ticket: &[u8]) -> Option<usize> {
    let newline = ticket.iter().position(|&b| b == b'\n')?;
    let body: serde_json::Value = serde_json::from_slice(&ticket[newline + 1..]).ok()?;
    let (start, end) = (body["start"].as_u64()?, body["end"].as_u64()?);
    usize::try_from(end.checked_sub(start)?).ok()
}

/// Replaces one run of digits with an edge value (row ranges and versions live in those).
fn rewrite_number(rng: &mut StdRng, bytes: &mut Vec<u8>, log: &mut Log) {
    let mut runs = Vec::new();
    let mut start = None;
    for (i, b) in bytes.iter().enumerate() {
        match (b.is_ascii_digit(), start) {
            (true, None) => start = Some(i),
            (false, Some(s)) => {
                runs.push(s..i);
                start = None;
            }
            _ => {}
        }
    }
    if let Some(s) = start {
        runs.push(s..bytes.len());
    }
    let Some(run) = runs.choose(rng).cloned() else {
        return log.push("ticket: no number to rewrite");
    };
    let value = *[
        "0",
        "1",
        "18446744073709551615",
        "18446744073709551616",
        "9223372036854775808",
        "4294967296",
        "100000000000",
        "65",
    ]
    .choose(rng)
    .expect("values");
    let old = String::from_utf8_lossy(&bytes[run.clone()]).into_owned();
    bytes.splice(run, value.bytes());
    log.push(format!("ticket: number {old} -> {value}"));
}

/// A statement ticket whose JSON a client wrote: a plain ticket it never got, filters of the
/// wrong shape, output columns out of range.
fn forged_statement_ticket(rng: &mut StdRng) -> Vec<u8> {
    use arrow_flight::sql::{ProstMessageExt, TicketStatementQuery};
    use base64::Engine;
    use prost::Message;
    let read = base64::engine::general_purpose::STANDARD.encode(b"t");
    let handles = [
        format!(r#"{{"read": "{read}", "filter": null, "output": [0], "limit": null}}"#),
        format!(r#"{{"read": "{read}", "filter": null, "output": [0, 0], "limit": 1}}"#),
        format!(r#"{{"read": "{read}", "filter": null, "output": [9999], "limit": null}}"#),
        format!(
            r#"{{"read": "{read}", "filter": {{"IsNull": {{"column": "nope", "negated": false}}}}, "output": [0], "limit": null}}"#
        ),
        r#"{"read": "!!", "filter": null, "output": [], "limit": null}"#.to_owned(),
        "{}".to_owned(),
        "[]".to_owned(),
    ];
    let handle = handles.choose(rng).expect("handles").clone();
    TicketStatementQuery {
        statement_handle: handle.into(),
    }
    .as_any()
    .encode_to_vec()
}
