//! Custom `DoAction` actions: their names, descriptions, request bodies and JSON results.

use arrow_flight::{Action, ActionType};
use serde_json::{Value, json};

use super::descriptor::parse_name;
use crate::error::Error;
use crate::store::StoreStatus;

/// The actions this server understands, as `ListActions` reports them.
pub const ACTIONS: &[(&str, &str)] = &[
    (
        "drop",
        "Remove a dataset. Body: JSON {\"name\": \"...\"}. Result: JSON {\"name\", \"rows\", \"bytes\"}. \
         Streams already reading it finish with their data; its memory returns when they are done.",
    ),
    (
        "status",
        "Describe the server. Body: empty. Result: JSON {\"version\", \"backend\", \"devices\": \
         [{\"ordinal\", \"name\", \"total_bytes\", \"limit_bytes\", \"used_bytes\"}], \"datasets\", \
         \"bytes\" (memory held), \"data_bytes\" (Arrow bytes), \"counters\"}.",
    ),
];

/// A parsed action request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ActionRequest {
    Drop { name: String },
    Status,
}

/// Parses an action's type and body.
pub fn parse(action: &Action) -> Result<ActionRequest, Error> {
    match action.r#type.as_str() {
        "drop" => {
            #[derive(serde::Deserialize)]
            #[serde(deny_unknown_fields)]
            struct DropBody {
                name: String,
            }
            let body: DropBody = serde_json::from_slice(&action.body).map_err(|e| {
                Error::InvalidCommand(format!("drop takes JSON {{\"name\": \"...\"}}: {e}"))
            })?;
            Ok(ActionRequest::Drop {
                name: parse_name(body.name.as_bytes())?,
            })
        }
        "status" => Ok(ActionRequest::Status),
        other => Err(Error::UnknownAction(other.to_owned())),
    }
}

/// `ListActions`' answer.
pub fn action_types() -> Vec<ActionType> {
    ACTIONS
        .iter()
        .map(|(name, description)| ActionType {
            r#type: (*name).to_owned(),
            description: (*description).to_owned(),
        })
        .collect()
}

/// The `status` action's JSON document.
pub fn status_json(status: &StoreStatus) -> Value {
    let devices: Vec<Value> = status
        .devices
        .iter()
        .map(|device| {
            json!({
                "ordinal": device.info.ordinal,
                "name": device.info.name,
                "total_bytes": device.info.total_bytes,
                "limit_bytes": device.limit_bytes,
                "used_bytes": device.used_bytes,
            })
        })
        .collect();
    json!({
        "version": env!("CARGO_PKG_VERSION"),
        "backend": status.backend,
        "devices": devices,
        "datasets": status.datasets,
        "bytes": status.bytes,
        "data_bytes": status.data_bytes,
        "counters": status.counters,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn actions_parse() {
        let drop = Action::new("drop", r#"{"name": "t"}"#);
        assert_eq!(
            parse(&drop).expect("valid"),
            ActionRequest::Drop {
                name: "t".to_owned()
            }
        );
        assert_eq!(
            parse(&Action::new("status", "")).expect("valid"),
            ActionRequest::Status
        );
        assert!(matches!(
            parse(&Action::new("drop", "t")),
            Err(Error::InvalidCommand(_))
        ));
        assert!(matches!(
            parse(&Action::new("explode", "")),
            Err(Error::UnknownAction(_))
        ));
    }
}
