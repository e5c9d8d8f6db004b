//! The descriptors a put case sends: plain ones, and those a careless or hostile client could
//! send.

use arrow_flight::FlightDescriptor;
use arrow_flight::flight_descriptor::DescriptorType;
use bytes::Bytes;
use rand::Rng;
use rand::rngs::StdRng;
use rand::seq::IndexedRandom;

use crate::common::path;
use crate::corpus::NAME;
use crate::mutate::Log;

/// The descriptor a put case sends, and the mode it asks for (`None` when it asks for nothing
/// the server should accept, or when a mutation may have changed the name).
pub(crate) fn put_descriptor(
    rng: &mut StdRng,
    log: &mut Log,
) -> (Option<FlightDescriptor>, Option<&'static str>) {
    let mode = *["create", "replace", "append"].choose(rng).expect("modes");
    match rng.random_range(0..10) {
        0 | 1 => {
            log.push("descriptor: PATH");
            (Some(path(NAME)), Some("create"))
        }
        2..=6 => {
            log.push(format!("descriptor: CMD {mode}"));
            (Some(crate::common::cmd(NAME, mode)), Some(mode))
        }
        _ => {
            let (label, descriptor) = odd_descriptor(rng, mode);
            log.push(format!("descriptor: {label}"));
            (descriptor, None)
        }
    }
}

pub(crate) fn deep(depth: usize, open: &str, close: &str) -> String {
    format!("{}{}", open.repeat(depth), close.repeat(depth))
}

/// Descriptors a careless or hostile client could send.
pub(crate) fn odd_descriptor(rng: &mut StdRng, mode: &str) -> (String, Option<FlightDescriptor>) {
    let cmd = |body: Vec<u8>| Some(FlightDescriptor::new_cmd(body));
    let json = |v: serde_json::Value| v.to_string().into_bytes();
    let long = "x".repeat(*[256_usize, 257, 4096].choose(rng).expect("lengths"));
    let choices: Vec<(String, Option<FlightDescriptor>)> = vec![
        ("none".into(), None),
        (
            "JSON array command".into(),
            cmd(json(serde_json::json!([NAME, mode]))),
        ),
        (
            "unknown mode".into(),
            cmd(json(serde_json::json!({"name": NAME, "mode": "upsert"}))),
        ),
        (
            "no mode".into(),
            cmd(json(serde_json::json!({ "name": NAME }))),
        ),
        (
            "extra field".into(),
            cmd(json(
                serde_json::json!({"name": NAME, "mode": mode, "x": 1}),
            )),
        ),
        (
            "name with newline".into(),
            cmd(json(serde_json::json!({"name": "fu\nzz", "mode": mode}))),
        ),
        (
            "name NUL".into(),
            cmd(json(serde_json::json!({"name": "\u{0}", "mode": mode}))),
        ),
        (
            "empty name".into(),
            cmd(json(serde_json::json!({"name": "", "mode": mode}))),
        ),
        (
            format!("name of {} bytes", long.len()),
            cmd(json(serde_json::json!({"name": long, "mode": mode}))),
        ),
        (
            "name not a string".into(),
            cmd(json(serde_json::json!({"name": 7, "mode": mode}))),
        ),
        (
            "device 0".into(),
            cmd(json(
                serde_json::json!({"name": NAME, "mode": mode, "device": 0}),
            )),
        ),
        (
            "no such device".into(),
            cmd(json(
                serde_json::json!({"name": NAME, "mode": mode, "device": 7}),
            )),
        ),
        (
            "device beyond u32".into(),
            cmd(json(
                serde_json::json!({"name": NAME, "mode": mode, "device": 1_u64 << 40}),
            )),
        ),
        (
            "negative device".into(),
            cmd(json(
                serde_json::json!({"name": NAME, "mode": mode, "device": -1}),
            )),
        ),
        (
            "unknown device UUID".into(),
            cmd(json(
                serde_json::json!({"name": NAME, "mode": mode, "device": "GPU-00000000-0000-0000-0000-000000000000"}),
            )),
        ),
        (
            format!("device UUID of {} bytes", long.len()),
            cmd(json(
                serde_json::json!({"name": NAME, "mode": mode, "device": long}),
            )),
        ),
        (
            "device list".into(),
            cmd(json(
                serde_json::json!({"name": NAME, "mode": mode, "device": [0]}),
            )),
        ),
        (
            "deeply nested name".into(),
            cmd(format!(r#"{{"name": {}, "mode": "{mode}"}}"#, deep(5000, "[", "]")).into_bytes()),
        ),
        (
            "nested just under the limit".into(),
            cmd(format!(r#"{{"name": {}}}"#, deep(126, "[", "]")).into_bytes()),
        ),
        (
            "non-UTF-8 name".into(),
            cmd(b"{\"name\": \"fu\xffzz\", \"mode\": \"create\"}".to_vec()),
        ),
        (
            "lone surrogate escape".into(),
            cmd(br#"{"name": "\ud800", "mode": "create"}"#.to_vec()),
        ),
        (
            "trailing data".into(),
            cmd(format!("{{\"name\": \"{NAME}\", \"mode\": \"{mode}\"}}\n{{}}").into_bytes()),
        ),
        (
            "newlines around JSON".into(),
            cmd(format!("\n\n{{\n\"name\"\n:\n\"{NAME}\"\n}}\n\n").into_bytes()),
        ),
        ("empty command".into(), cmd(Vec::new())),
        ("null".into(), cmd(b"null".to_vec())),
        (
            "PATH of two".into(),
            Some(FlightDescriptor::new_path(vec![NAME.into(), "x".into()])),
        ),
        (
            "PATH of none".into(),
            Some(FlightDescriptor::new_path(vec![])),
        ),
        (
            "PATH with control char".into(),
            Some(FlightDescriptor::new_path(vec!["fu\u{7f}zz".into()])),
        ),
        (
            "UNKNOWN type".into(),
            Some(FlightDescriptor {
                r#type: DescriptorType::Unknown as i32,
                cmd: Bytes::new(),
                path: vec![NAME.into()],
            }),
        ),
        (
            "type 99".into(),
            Some(FlightDescriptor {
                r#type: 99,
                cmd: json(serde_json::json!({ "name": NAME })).into(),
                path: vec![NAME.into()],
            }),
        ),
    ];
    let chosen = rng.random_range(0..choices.len());
    choices
        .into_iter()
        .nth(chosen)
        .expect("a descriptor choice")
}
