//! The stateful WebSocket protocol on `/ws`.
//!
//! One JSON object per text frame, strictly one reply per request, in order, with no
//! request ids; `close` gets no reply (the server closes with code 1000).
//! The envelope is `extra="forbid"` on the reference server, so an unknown top-level
//! key is a [`ErrorCode::ValidationError`].

use std::borrow::Cow;
use std::fmt;

use serde::de::{MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::validation::{LocPart, ValidationIssue, summarize};

/// A message from client to server, borrowing its payload from the frame.
///
/// Payloads stay raw JSON so the server can deserialize an action straight into the
/// environment's typed action without an intermediate tree.
#[derive(Debug, Clone, Copy, Serialize)]
#[serde(tag = "type", content = "data", rename_all = "lowercase")]
pub enum ClientMessage<'a> {
    /// Start a new episode; the payload is the reset parameters object (`{}` when absent).
    Reset(#[serde(borrow)] &'a RawValue),
    /// Apply an action; the payload is the action object.
    Step(#[serde(borrow)] &'a RawValue),
    /// Ask for the environment's state.
    State,
    /// End the session; the server replies with nothing and closes with code 1000.
    Close,
    /// A JSON-RPC request for the session's MCP tools.
    Mcp(#[serde(borrow)] &'a RawValue),
}

const EMPTY_OBJECT: &str = "{}";

impl<'a> ClientMessage<'a> {
    /// Parses one text frame as the reference server does.
    ///
    /// Errors carry the code and message the reference server would send:
    /// `INVALID_JSON` for text that is not JSON, `UNKNOWN_TYPE` for an unknown or missing
    /// `type`, `VALIDATION_ERROR` for a known type with a wrong shape.
    pub fn parse(text: &'a str) -> Result<Self, WsError> {
        let envelope: RawEnvelope<'a> = match serde_json::from_str(text) {
            Ok(envelope) => envelope,
            Err(err) if err.is_syntax() || err.is_eof() => {
                return Err(WsError::new(
                    ErrorCode::InvalidJson,
                    format!("Invalid JSON: {err}"),
                ));
            }
            Err(_) => {
                return Err(WsError::validation(vec![ValidationIssue::new(
                    "model_type",
                    vec![],
                    "Input should be a JSON object with a \"type\" key",
                )]));
            }
        };
        let ty = envelope.ty.as_deref().unwrap_or("");
        let mut issues = Vec::new();
        let (allows_data, requires_data) = match ty {
            "reset" => (true, false),
            "step" | "mcp" => (true, true),
            "state" | "close" => (false, false),
            other => {
                return Err(WsError::new(
                    ErrorCode::UnknownType,
                    format!("Unknown message type: {other}"),
                ));
            }
        };
        for (key, value) in envelope.extra {
            issues.push(ValidationIssue::extra_forbidden(
                vec![LocPart::Key(key)],
                value,
            ));
        }
        let data = match envelope.data {
            Some(raw) if allows_data => {
                if raw.get().starts_with('{') {
                    Some(raw)
                } else {
                    issues.push(
                        ValidationIssue::new(
                            "dict_type",
                            vec!["data".into()],
                            "Input should be a valid dictionary",
                        )
                        .with_input(serde_json::from_str(raw.get()).unwrap_or(Value::Null)),
                    );
                    None
                }
            }
            Some(raw) => {
                issues.push(ValidationIssue::extra_forbidden(
                    vec!["data".into()],
                    serde_json::from_str(raw.get()).unwrap_or(Value::Null),
                ));
                None
            }
            None if requires_data => {
                issues.push(ValidationIssue::missing(vec!["data".into()]));
                None
            }
            None => None,
        };
        if !issues.is_empty() {
            return Err(WsError::validation(issues));
        }
        let empty = || -> &'a RawValue {
            // A literal "{}" is always valid JSON.
            serde_json::from_str(EMPTY_OBJECT).expect("static JSON")
        };
        Ok(match ty {
            "reset" => ClientMessage::Reset(data.unwrap_or_else(empty)),
            "step" => ClientMessage::Step(data.unwrap_or_else(empty)),
            "mcp" => ClientMessage::Mcp(data.unwrap_or_else(empty)),
            "state" => ClientMessage::State,
            _ => ClientMessage::Close,
        })
    }

    /// The message as one text frame.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("client messages always serialize")
    }
}

impl PartialEq for ClientMessage<'_> {
    fn eq(&self, other: &Self) -> bool {
        use ClientMessage::*;
        match (self, other) {
            (Reset(a), Reset(b)) | (Step(a), Step(b)) | (Mcp(a), Mcp(b)) => a.get() == b.get(),
            (State, State) | (Close, Close) => true,
            _ => false,
        }
    }
}

/// The envelope as written, before its type is checked.
struct RawEnvelope<'a> {
    ty: Option<Cow<'a, str>>,
    data: Option<&'a RawValue>,
    extra: Vec<(String, Value)>,
}

impl<'de: 'a, 'a> Deserialize<'de> for RawEnvelope<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct EnvelopeVisitor<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for EnvelopeVisitor<'a> {
            type Value = RawEnvelope<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Self::Value, M::Error> {
                let mut envelope = RawEnvelope {
                    ty: None,
                    data: None,
                    extra: Vec::new(),
                };
                while let Some(key) = map.next_key::<Cow<'de, str>>()? {
                    match key.as_ref() {
                        "type" => {
                            // A non-string type is an unknown type, as in the reference.
                            let value: &'de RawValue = map.next_value()?;
                            envelope.ty = Some(
                                serde_json::from_str::<Cow<'de, str>>(value.get())
                                    .unwrap_or(Cow::Borrowed("<not a string>")),
                            );
                        }
                        "data" => envelope.data = Some(map.next_value()?),
                        _ => {
                            let value: Value = map.next_value()?;
                            envelope.extra.push((key.into_owned(), value));
                        }
                    }
                }
                Ok(envelope)
            }
        }
        deserializer.deserialize_map(EnvelopeVisitor(std::marker::PhantomData))
    }
}

/// The error codes of OpenEnv's `WSErrorCode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ErrorCode {
    /// The frame is not JSON. Recoverable.
    InvalidJson,
    /// The `type` is not one the server knows. Recoverable.
    UnknownType,
    /// The message or the action has the wrong shape. Recoverable.
    ValidationError,
    /// The environment raised while handling the message. Recoverable.
    ExecutionError,
    /// The server holds its maximum number of sessions. Fatal.
    CapacityReached,
    /// The environment could not be constructed. Fatal.
    FactoryError,
    /// The session cannot go on (unknown session id, binary frame, ...). Fatal.
    SessionError,
}

impl ErrorCode {
    /// Every code, in declaration order.
    pub const ALL: [ErrorCode; 7] = [
        ErrorCode::InvalidJson,
        ErrorCode::UnknownType,
        ErrorCode::ValidationError,
        ErrorCode::ExecutionError,
        ErrorCode::CapacityReached,
        ErrorCode::FactoryError,
        ErrorCode::SessionError,
    ];

    /// Whether the server closes the socket (code 1000) after sending this error.
    pub fn is_fatal(self) -> bool {
        matches!(
            self,
            ErrorCode::CapacityReached | ErrorCode::FactoryError | ErrorCode::SessionError
        )
    }

    /// The code as it appears on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidJson => "INVALID_JSON",
            ErrorCode::UnknownType => "UNKNOWN_TYPE",
            ErrorCode::ValidationError => "VALIDATION_ERROR",
            ErrorCode::ExecutionError => "EXECUTION_ERROR",
            ErrorCode::CapacityReached => "CAPACITY_REACHED",
            ErrorCode::FactoryError => "FACTORY_ERROR",
            ErrorCode::SessionError => "SESSION_ERROR",
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The payload of a `{"type":"error"}` frame.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WsError {
    /// What was wrong, for people.
    pub message: String,
    /// The machine-readable code.
    pub code: ErrorCode,
    /// Pydantic-shaped details for `VALIDATION_ERROR`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<ValidationIssue>,
    /// For `CAPACITY_REACHED`: sessions now active.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_sessions: Option<usize>,
    /// For `CAPACITY_REACHED`: the server's limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_sessions: Option<usize>,
    /// For `FACTORY_ERROR`: the environment that failed to start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub factory_name: Option<String>,
}

impl WsError {
    /// An error with a code and message and no details.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            code,
            errors: Vec::new(),
            active_sessions: None,
            max_sessions: None,
            factory_name: None,
        }
    }

    /// A `VALIDATION_ERROR` listing `issues`. The message is the reference server's
    /// "Invalid message" followed by a summary, so a person reading only the message
    /// still learns what to fix.
    pub fn validation(issues: Vec<ValidationIssue>) -> Self {
        let mut err = Self::new(
            ErrorCode::ValidationError,
            format!("Invalid message: {}", summarize(&issues)),
        );
        err.errors = issues;
        err
    }

    /// `CAPACITY_REACHED`, worded as the reference server words it.
    pub fn capacity(active: usize, max: usize) -> Self {
        let mut err = Self::new(
            ErrorCode::CapacityReached,
            format!(
                "Server at capacity: {active}/{max} sessions active. Cannot accept new connections."
            ),
        );
        err.active_sessions = Some(active);
        err.max_sessions = Some(max);
        err
    }

    /// `FACTORY_ERROR` for environment `name`.
    pub fn factory(name: &str, message: impl Into<String>) -> Self {
        let mut err = Self::new(ErrorCode::FactoryError, message);
        err.factory_name = Some(name.to_owned());
        err
    }
}

impl fmt::Display for WsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (code: {})", self.message, self.code)
    }
}

impl std::error::Error for WsError {}

/// The result of `reset` or `step`: the payload of an `observation` frame and the body
/// of HTTP `/reset` and `/step` responses.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepResult<O = Map<String, Value>> {
    /// The observation's own fields (the reference puts its `metadata` here too).
    pub observation: O,
    /// The reward of the last action; `null` when there is none.
    #[serde(default)]
    pub reward: Option<f64>,
    /// Whether the episode has ended.
    #[serde(default)]
    pub done: bool,
    /// Extra information; omitted on the wire when empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Map<String, Value>>,
}

/// A message from server to client.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", content = "data", rename_all = "lowercase")]
pub enum ServerMessage<O = Map<String, Value>> {
    /// The reply to `reset` and `step`.
    Observation(StepResult<O>),
    /// The reply to `state`: at least `episode_id` and `step_count`.
    State(Map<String, Value>),
    /// The reply to `mcp`: a JSON-RPC response.
    Mcp(Value),
    /// Something went wrong; fatal codes are followed by a close.
    Error(WsError),
}

impl<O: Serialize> ServerMessage<O> {
    /// The message as one text frame.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("server messages always serialize")
    }
}

/// Parses a server frame; for clients.
pub fn parse_server_message(text: &str) -> Result<ServerMessage, serde_json::Error> {
    serde_json::from_str(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_each_client_message() {
        let cases = [
            (r#"{"type":"reset"}"#, ClientMessage::Reset(raw("{}"))),
            (
                r#"{"type":"reset","data":{"seed":7,"episode_id":"ep-A"}}"#,
                ClientMessage::Reset(raw(r#"{"seed":7,"episode_id":"ep-A"}"#)),
            ),
            (
                r#"{"type":"step","data":{"message":"hi"}}"#,
                ClientMessage::Step(raw(r#"{"message":"hi"}"#)),
            ),
            (r#"{"type":"state"}"#, ClientMessage::State),
            (r#"{"type":"close"}"#, ClientMessage::Close),
            (
                r#"{"type":"mcp","data":{"jsonrpc":"2.0","method":"tools/list","id":1}}"#,
                ClientMessage::Mcp(raw(r#"{"jsonrpc":"2.0","method":"tools/list","id":1}"#)),
            ),
        ];
        for (text, want) in cases {
            let got = ClientMessage::parse(text).unwrap();
            assert_eq!(got, want, "{text}");
            let again = got.to_json();
            assert_eq!(
                ClientMessage::parse(&again).unwrap(),
                want,
                "round trip {again}"
            );
        }
    }

    fn raw(s: &'static str) -> &'static RawValue {
        serde_json::from_str(s).unwrap()
    }

    #[test]
    fn rejects_bad_frames_with_reference_codes() {
        let cases = [
            ("not json", ErrorCode::InvalidJson, "Invalid JSON"),
            ("{\"type\":", ErrorCode::InvalidJson, "Invalid JSON"),
            (
                r#"{"type":"jump"}"#,
                ErrorCode::UnknownType,
                "Unknown message type: jump",
            ),
            (
                r#"{"data":{}}"#,
                ErrorCode::UnknownType,
                "Unknown message type: ",
            ),
            (
                r#"{"type":5}"#,
                ErrorCode::UnknownType,
                "Unknown message type: <not a string>",
            ),
            (
                r#"{"type":"step"}"#,
                ErrorCode::ValidationError,
                "data: Field required",
            ),
            (
                r#"{"type":"step","data":[1]}"#,
                ErrorCode::ValidationError,
                "valid dictionary",
            ),
            (
                r#"{"type":"state","data":{}}"#,
                ErrorCode::ValidationError,
                "data: Extra inputs",
            ),
            (
                r#"{"type":"reset","x":1}"#,
                ErrorCode::ValidationError,
                "x: Extra inputs",
            ),
            ("[1,2]", ErrorCode::ValidationError, "JSON object"),
            ("42", ErrorCode::ValidationError, "JSON object"),
        ];
        for (text, code, needle) in cases {
            let err = ClientMessage::parse(text).unwrap_err();
            assert_eq!(err.code, code, "{text}: {err}");
            assert!(err.message.contains(needle), "{text}: {err}");
            assert!(!err.code.is_fatal());
        }
        let err = ClientMessage::parse(r#"{"type":"state","extra":[1]}"#).unwrap_err();
        assert_eq!(
            err.errors[0].input,
            Some(serde_json::json!([1])),
            "the offending input is reported"
        );
    }

    #[test]
    fn error_frames_match_reference_shape() {
        let frame: ServerMessage = ServerMessage::Error(WsError::capacity(4, 4));
        let json: Value = serde_json::from_str(&frame.to_json()).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"type":"error","data":{
                "message":"Server at capacity: 4/4 sessions active. Cannot accept new connections.",
                "code":"CAPACITY_REACHED","active_sessions":4,"max_sessions":4}})
        );
        for code in ErrorCode::ALL {
            let text = serde_json::to_string(&code).unwrap();
            assert_eq!(text, format!("\"{}\"", code.as_str()));
            assert_eq!(serde_json::from_str::<ErrorCode>(&text).unwrap(), code);
        }
    }

    #[test]
    fn observation_frame_omits_empty_metadata() {
        let mut obs = Map::new();
        obs.insert("echoed_message".into(), "hi".into());
        let msg: ServerMessage = ServerMessage::Observation(StepResult {
            observation: obs,
            reward: Some(0.2),
            done: false,
            metadata: None,
        });
        let text = msg.to_json();
        assert_eq!(
            text,
            r#"{"type":"observation","data":{"observation":{"echoed_message":"hi"},"reward":0.2,"done":false}}"#
        );
        assert_eq!(parse_server_message(&text).unwrap(), msg);
    }
}

#[cfg(test)]
mod properties {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The parser never panics; whatever parses survives a round trip.
        #[test]
        fn arbitrary_text_never_panics(text in ".{0,200}") {
            if let Ok(message) = ClientMessage::parse(&text) {
                let again = message.to_json();
                prop_assert_eq!(ClientMessage::parse(&again).unwrap(), message);
            }
        }

        /// Envelopes built from arbitrary JSON objects round-trip.
        #[test]
        fn step_payloads_round_trip(key in "[a-z_]{1,12}", value in any::<i64>(), text in "\\PC{0,40}") {
            let data = serde_json::json!({ key.clone(): value, "text": text });
            let frame = serde_json::json!({"type": "step", "data": data}).to_string();
            let message = ClientMessage::parse(&frame).unwrap();
            let ClientMessage::Step(raw) = message else { panic!("not a step") };
            let back: Value = serde_json::from_str(raw.get()).unwrap();
            prop_assert_eq!(back, data);
        }
    }
}
