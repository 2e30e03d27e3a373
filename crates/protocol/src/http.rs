//! Bodies of the HTTP routes: `/reset`, `/step`, `/state`, `/health`, `/metadata`,
//! `/schema`, and FastAPI's error bodies.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::validation::{LocPart, ValidationIssue};

/// The longest `episode_id` or `request_id` the reference accepts.
pub const MAX_ID_LEN: usize = 255;

/// Reset parameters: the body of `POST /reset` and the `data` of a WebSocket `reset`.
///
/// Keys other than `seed` and `episode_id` are kept in `options` and handed to the
/// environment (the reference filters them to the `reset()` signature).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ResetRequest {
    /// Seed for a reproducible episode; must be `>= 0`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Caller-chosen episode id, at most 255 characters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub episode_id: Option<String>,
    /// Every other key, for the environment.
    #[serde(flatten)]
    pub options: Map<String, Value>,
}

impl ResetRequest {
    /// Validates an already-parsed object as the reference server does (`seed >= 0`,
    /// `episode_id` a string of at most 255 characters; other keys allowed).
    pub fn from_object(mut object: Map<String, Value>) -> Result<Self, Vec<ValidationIssue>> {
        let mut issues = Vec::new();
        let seed = match object.remove("seed") {
            None | Some(Value::Null) => None,
            Some(Value::Number(n)) if n.as_u64().is_some() => n.as_u64(),
            Some(Value::Number(n)) if n.as_i64().is_some() => {
                issues.push(
                    ValidationIssue::new(
                        "greater_than_equal",
                        vec!["seed".into()],
                        "Input should be greater than or equal to 0",
                    )
                    .with_input(Value::Number(n)),
                );
                None
            }
            Some(other) => {
                issues.push(
                    ValidationIssue::new(
                        "int_type",
                        vec!["seed".into()],
                        "Input should be a valid integer",
                    )
                    .with_input(other),
                );
                None
            }
        };
        let episode_id = optional_id(&mut object, "episode_id", &mut issues);
        if issues.is_empty() {
            Ok(Self {
                seed,
                episode_id,
                options: object,
            })
        } else {
            Err(issues)
        }
    }

    /// Parses and validates raw JSON (an object).
    pub fn parse(json: &str) -> Result<Self, Vec<ValidationIssue>> {
        Self::from_object(parse_object(json)?)
    }
}

fn optional_id(
    object: &mut Map<String, Value>,
    key: &str,
    issues: &mut Vec<ValidationIssue>,
) -> Option<String> {
    match object.remove(key) {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s.chars().count() <= MAX_ID_LEN => Some(s),
        Some(Value::String(s)) => {
            issues.push(
                ValidationIssue::new(
                    "string_too_long",
                    vec![key.into()],
                    format!("String should have at most {MAX_ID_LEN} characters"),
                )
                .with_input(Value::String(s)),
            );
            None
        }
        Some(other) => {
            issues.push(
                ValidationIssue::new(
                    "string_type",
                    vec![key.into()],
                    "Input should be a valid string",
                )
                .with_input(other),
            );
            None
        }
    }
}

/// Parses `json` as an object, or says why it is not one.
pub fn parse_object(json: &str) -> Result<Map<String, Value>, Vec<ValidationIssue>> {
    match serde_json::from_str::<Value>(json) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(other) => Err(vec![
            ValidationIssue::new("dict_type", vec![], "Input should be a valid dictionary")
                .with_input(other),
        ]),
        Err(err) => Err(vec![ValidationIssue::new(
            "json_invalid",
            vec![],
            format!("JSON decode error: {err}"),
        )]),
    }
}

/// The body of `POST /step`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRequest {
    /// The action, in the environment's action schema.
    pub action: Map<String, Value>,
    /// Optional time limit for the step, seconds, `> 0`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<f64>,
    /// Optional id for tracing, at most 255 characters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    /// Every other key (allowed by the reference and ignored).
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl StepRequest {
    /// Validates a parsed body as the reference does; locations start with `body`.
    pub fn from_object(mut object: Map<String, Value>) -> Result<Self, Vec<ValidationIssue>> {
        let mut issues = Vec::new();
        let action = match object.remove("action") {
            Some(Value::Object(action)) => Some(action),
            None => {
                issues.push(ValidationIssue::missing(vec![
                    "body".into(),
                    "action".into(),
                ]));
                None
            }
            Some(other) => {
                issues.push(
                    ValidationIssue::new(
                        "dict_type",
                        vec!["body".into(), "action".into()],
                        "Input should be a valid dictionary",
                    )
                    .with_input(other),
                );
                None
            }
        };
        let timeout_s = match object.remove("timeout_s") {
            None | Some(Value::Null) => None,
            Some(Value::Number(n)) if n.as_f64().is_some_and(|t| t > 0.0 && t.is_finite()) => {
                n.as_f64()
            }
            Some(other) => {
                issues.push(
                    ValidationIssue::new(
                        "greater_than",
                        vec!["body".into(), "timeout_s".into()],
                        "Input should be a finite number greater than 0",
                    )
                    .with_input(other),
                );
                None
            }
        };
        let mut id_issues = Vec::new();
        let request_id = optional_id(&mut object, "request_id", &mut id_issues);
        issues.extend(
            id_issues
                .into_iter()
                .map(|i| i.under(&[LocPart::from("body")])),
        );
        match action {
            Some(action) if issues.is_empty() => Ok(Self {
                action,
                timeout_s,
                request_id,
                extra: object,
            }),
            _ => Err(issues),
        }
    }
}

/// The body of `GET /health`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthResponse {
    /// `healthy`, `unhealthy` or `degraded`.
    pub status: HealthStatus,
}

/// Health states of the reference's `HealthStatus`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HealthStatus {
    /// Serving normally.
    Healthy,
    /// Not serving.
    Unhealthy,
    /// Serving with problems.
    Degraded,
}

impl HealthResponse {
    /// `{"status":"healthy"}`.
    pub const HEALTHY: HealthResponse = HealthResponse {
        status: HealthStatus::Healthy,
    };
}

/// The body of `GET /metadata`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnvironmentMetadata {
    /// The environment's name.
    pub name: String,
    /// What the environment does.
    pub description: String,
    /// The README, as Markdown.
    #[serde(default)]
    pub readme_content: Option<String>,
    /// The environment's version.
    #[serde(default)]
    pub version: Option<String>,
    /// Who wrote it.
    #[serde(default)]
    pub author: Option<String>,
    /// Where its documentation lives.
    #[serde(default)]
    pub documentation_url: Option<String>,
}

/// The body of `GET /schema`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SchemaResponse {
    /// JSON Schema of actions.
    pub action: Value,
    /// JSON Schema of observations.
    pub observation: Value,
    /// JSON Schema of the state.
    pub state: Value,
    /// JSON Schema of the observation returned by `reset`, when it differs (0.10.0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reset_observation: Option<Value>,
}

/// FastAPI's error body: `{"detail": ...}`, either a message or a list of issues.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// A message (404, 400, 501, ...) or pydantic issues (422).
    pub detail: Detail,
}

/// The two shapes of `detail`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Detail {
    /// A plain message.
    Message(String),
    /// Validation issues, as in a 422.
    Issues(Vec<ValidationIssue>),
}

impl ErrorDetail {
    /// `{"detail":"message"}`.
    pub fn message(message: impl Into<String>) -> Self {
        Self {
            detail: Detail::Message(message.into()),
        }
    }

    /// `{"detail":[issues]}`.
    pub fn issues(issues: Vec<ValidationIssue>) -> Self {
        Self {
            detail: Detail::Issues(issues),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reset_request_validates_like_the_reference() {
        let ok = ResetRequest::parse(r#"{"seed":7,"episode_id":"ep-A","difficulty":2}"#).unwrap();
        assert_eq!(ok.seed, Some(7));
        assert_eq!(ok.episode_id.as_deref(), Some("ep-A"));
        assert_eq!(ok.options.get("difficulty"), Some(&json!(2)));
        let round: ResetRequest =
            serde_json::from_str(&serde_json::to_string(&ok).unwrap()).unwrap();
        assert_eq!(round, ok);

        let err = ResetRequest::parse(r#"{"seed":-1}"#).unwrap_err();
        assert_eq!(err[0].kind, "greater_than_equal");
        let err = ResetRequest::parse(r#"{"seed":"x","episode_id":5}"#).unwrap_err();
        assert_eq!(err.len(), 2);
        let long = "e".repeat(256);
        let err = ResetRequest::parse(&format!(r#"{{"episode_id":"{long}"}}"#)).unwrap_err();
        assert_eq!(err[0].kind, "string_too_long");
        assert!(ResetRequest::parse("[]").is_err());
        assert!(ResetRequest::parse("{").is_err());
    }

    #[test]
    fn step_request_reports_body_locations() {
        let err = StepRequest::from_object(Map::new()).unwrap_err();
        assert_eq!(
            serde_json::to_value(&err).unwrap(),
            json!([{"type":"missing","loc":["body","action"],"msg":"Field required"}])
        );
        let obj = json!({"action":{"message":"hi"},"timeout_s":0,"render":true});
        let err = StepRequest::from_object(obj.as_object().unwrap().clone()).unwrap_err();
        assert_eq!(
            err[0].loc,
            vec![LocPart::from("body"), LocPart::from("timeout_s")]
        );
        let obj = json!({"action":{"message":"hi"},"timeout_s":2.5,"render":true});
        let ok = StepRequest::from_object(obj.as_object().unwrap().clone()).unwrap();
        assert_eq!(ok.timeout_s, Some(2.5));
        assert_eq!(ok.extra.get("render"), Some(&json!(true)));
    }

    #[test]
    fn schema_omits_absent_reset_observation() {
        let s = SchemaResponse {
            action: json!({}),
            observation: json!({}),
            state: json!({}),
            reset_observation: None,
        };
        assert_eq!(
            serde_json::to_value(&s).unwrap(),
            json!({"action":{},"observation":{},"state":{}})
        );
        assert_eq!(
            serde_json::to_string(&HealthResponse::HEALTHY).unwrap(),
            r#"{"status":"healthy"}"#
        );
    }
}
