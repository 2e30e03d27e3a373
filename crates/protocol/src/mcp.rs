//! MCP tool calling as OpenEnv speaks it.
//!
//! Two paths reach the same tools:
//! - JSON-RPC 2.0 on `POST /mcp`, `WS /mcp` and WebSocket `{"type":"mcp"}` frames, with
//!   OpenEnv's session methods `openenv/session/create|close`. This is not spec MCP
//!   Streamable-HTTP: there is no `initialize`, no SSE, no `Mcp-Session-Id` header.
//! - Step actions `{"type":"list_tools"}` and `{"type":"call_tool",...}`, which 0.3.0
//!   clients send through `/ws` `step`.
//!
//! Note the spelling: JSON-RPC `tools/list` says `inputSchema`, the step path says
//! `input_schema`.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// JSON-RPC error codes used by the reference server.
pub mod code {
    /// Invalid JSON was received.
    pub const PARSE_ERROR: i64 = -32700;
    /// The JSON is not a valid request object (including a missing `jsonrpc`).
    pub const INVALID_REQUEST: i64 = -32600;
    /// The method does not exist.
    pub const METHOD_NOT_FOUND: i64 = -32601;
    /// Bad parameters: unknown session, missing tool name.
    pub const INVALID_PARAMS: i64 = -32602;
    /// The environment failed, has no MCP, or has no such tool.
    pub const INTERNAL_ERROR: i64 = -32603;
    /// Capacity or factory errors when creating a session.
    pub const SERVER_ERROR: i64 = -32000;

    /// The reference's default message for `code`.
    pub fn default_message(code: i64) -> &'static str {
        match code {
            PARSE_ERROR => "Parse error",
            INVALID_REQUEST => "Invalid Request",
            METHOD_NOT_FOUND => "Method not found",
            INVALID_PARAMS => "Invalid params",
            INTERNAL_ERROR => "Internal error",
            SERVER_ERROR => "Server error",
            _ => "Unknown error",
        }
    }
}

/// The methods OpenEnv servers answer.
pub mod method {
    /// List the session's tools.
    pub const TOOLS_LIST: &str = "tools/list";
    /// Call one tool.
    pub const TOOLS_CALL: &str = "tools/call";
    /// Create a session for later `tools/*` calls and `/ws?session_id=` attachment.
    pub const SESSION_CREATE: &str = "openenv/session/create";
    /// Close a session made by `openenv/session/create`.
    pub const SESSION_CLOSE: &str = "openenv/session/close";
}

/// Tool names an MCP environment may not use.
pub const RESERVED_TOOL_NAMES: [&str; 4] = ["reset", "step", "state", "close"];

/// A JSON-RPC request id: a string or an integer.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(untagged)]
pub enum RequestId {
    /// A numeric id.
    Number(i64),
    /// A string id.
    String(String),
}

/// A JSON-RPC 2.0 request (`extra="forbid"` on the reference).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JsonRpcRequest {
    /// Always `"2.0"`.
    pub jsonrpc: JsonRpcVersion,
    /// The method name.
    pub method: String,
    /// Named parameters; `{}` when absent.
    #[serde(default)]
    pub params: Map<String, Value>,
    /// The request id; `null` when absent.
    #[serde(default)]
    pub id: Option<RequestId>,
}

/// The literal `"2.0"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct JsonRpcVersion;

impl Serialize for JsonRpcVersion {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str("2.0")
    }
}

impl<'de> Deserialize<'de> for JsonRpcVersion {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = String::deserialize(d)?;
        if v == "2.0" {
            Ok(JsonRpcVersion)
        } else {
            Err(serde::de::Error::custom(format!(
                "jsonrpc must be \"2.0\", got {v:?}"
            )))
        }
    }
}

impl JsonRpcRequest {
    /// A request for `method` with `params` and `id`.
    pub fn new(method: &str, params: Map<String, Value>, id: Option<RequestId>) -> Self {
        Self {
            jsonrpc: JsonRpcVersion,
            method: method.to_owned(),
            params,
            id,
        }
    }

    /// Parses a request body. On failure returns the error response to send:
    /// `-32700` for text that is not JSON, `-32600` for JSON that is not a request.
    #[expect(
        clippy::result_large_err,
        reason = "the error is the response to send, built once on a cold path"
    )]
    pub fn parse(body: &str) -> Result<Self, JsonRpcResponse> {
        let value: Value = serde_json::from_str(body)
            .map_err(|_| JsonRpcResponse::error(None, code::PARSE_ERROR, None, None))?;
        Self::from_value(value)
    }

    /// Validates an already-parsed value as a request.
    #[expect(
        clippy::result_large_err,
        reason = "the error is the response to send, built once on a cold path"
    )]
    pub fn from_value(value: Value) -> Result<Self, JsonRpcResponse> {
        let id = value
            .get("id")
            .and_then(|id| serde_json::from_value::<RequestId>(id.clone()).ok());
        serde_json::from_value(value).map_err(|err| {
            JsonRpcResponse::error(
                id,
                code::INVALID_REQUEST,
                Some(format!("Invalid request: {err}")),
                None,
            )
        })
    }
}

/// A JSON-RPC 2.0 error object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JsonRpcError {
    /// One of [`code`].
    pub code: i64,
    /// What went wrong.
    pub message: String,
    /// Extra details, e.g. `active_sessions`/`max_sessions`.
    #[serde(default)]
    pub data: Option<Value>,
}

/// A JSON-RPC 2.0 response: exactly one of `result` and `error`, and always an `id`
/// (`null` when the request had none).
#[derive(Debug, Clone, PartialEq)]
pub struct JsonRpcResponse {
    /// The id of the request answered.
    pub id: Option<RequestId>,
    /// The outcome.
    pub outcome: Result<Value, JsonRpcError>,
}

impl JsonRpcResponse {
    /// A success.
    pub fn result(id: Option<RequestId>, result: Value) -> Self {
        Self {
            id,
            outcome: Ok(result),
        }
    }

    /// An error; `message` defaults to the reference's message for `code`.
    pub fn error(
        id: Option<RequestId>,
        code: i64,
        message: Option<String>,
        data: Option<Value>,
    ) -> Self {
        Self {
            id,
            outcome: Err(JsonRpcError {
                code,
                message: message.unwrap_or_else(|| code::default_message(code).to_owned()),
                data,
            }),
        }
    }
}

impl Serialize for JsonRpcResponse {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(3))?;
        map.serialize_entry("jsonrpc", "2.0")?;
        map.serialize_entry("id", &self.id)?;
        match &self.outcome {
            Ok(result) => map.serialize_entry("result", result)?,
            Err(error) => map.serialize_entry("error", error)?,
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for JsonRpcResponse {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        struct Wire {
            #[serde(default)]
            id: Option<RequestId>,
            #[serde(default)]
            result: Option<Value>,
            #[serde(default)]
            error: Option<JsonRpcError>,
        }
        let wire = Wire::deserialize(d)?;
        Ok(Self {
            id: wire.id,
            outcome: match wire.error {
                Some(error) => Err(error),
                None => Ok(wire.result.unwrap_or(Value::Null)),
            },
        })
    }
}

/// A tool as `tools/list` describes it (camelCase `inputSchema`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    /// The tool's name, unique in the environment.
    pub name: String,
    /// What it does, for the model.
    #[serde(default)]
    pub description: String,
    /// JSON Schema of its arguments.
    #[serde(rename = "inputSchema", alias = "input_schema")]
    pub input_schema: Value,
}

/// A tool as the step path's `ListToolsObservation` describes it (snake_case).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepTool {
    /// The tool's name.
    pub name: String,
    /// What it does.
    pub description: String,
    /// JSON Schema of its arguments.
    #[serde(alias = "inputSchema")]
    pub input_schema: Value,
}

impl From<ToolSpec> for StepTool {
    fn from(t: ToolSpec) -> Self {
        Self {
            name: t.name,
            description: t.description,
            input_schema: t.input_schema,
        }
    }
}

impl From<StepTool> for ToolSpec {
    fn from(t: StepTool) -> Self {
        Self {
            name: t.name,
            description: t.description,
            input_schema: t.input_schema,
        }
    }
}

/// One content block of a tool result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContentBlock {
    /// Always `"text"` for the blocks we produce.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text.
    #[serde(default)]
    pub text: String,
    /// MCP annotations; `null` here.
    #[serde(default)]
    pub annotations: Option<Value>,
    /// MCP `_meta`; `null` here.
    #[serde(default)]
    pub meta: Option<Value>,
}

/// The result of a tool call, shaped like FastMCP's `CallToolResult` as OpenEnv dumps
/// it (snake_case). Python's `MCPToolClient.call_tool` returns `data`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CallToolResult {
    /// Human-readable content blocks.
    pub content: Vec<ContentBlock>,
    /// The structured result, as `{"result": data}` for non-object data.
    #[serde(default)]
    pub structured_content: Option<Value>,
    /// MCP `_meta`.
    #[serde(default)]
    pub meta: Option<Value>,
    /// The tool's return value.
    #[serde(default)]
    pub data: Value,
    /// Whether the tool itself reported an error.
    #[serde(default)]
    pub is_error: bool,
}

impl CallToolResult {
    /// A successful result carrying `data`, with a text block and structured content
    /// as FastMCP makes them.
    pub fn ok(data: Value) -> Self {
        let text = match &data {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        let structured = match &data {
            Value::Object(_) => data.clone(),
            other => serde_json::json!({ "result": other }),
        };
        Self {
            content: vec![ContentBlock {
                kind: "text".to_owned(),
                text,
                annotations: None,
                meta: None,
            }],
            structured_content: Some(structured),
            meta: None,
            data,
            is_error: false,
        }
    }

    /// A result in which the tool reports an error in its own words.
    pub fn tool_error(message: impl Into<String>) -> Self {
        let message = message.into();
        Self {
            content: vec![ContentBlock {
                kind: "text".to_owned(),
                text: message,
                annotations: None,
                meta: None,
            }],
            structured_content: None,
            meta: None,
            data: Value::Null,
            is_error: true,
        }
    }
}

/// Kinds of framework errors on the step path (`CallToolObservation.error`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolErrorType {
    /// The tool ran and failed.
    ExecutionError,
    /// The arguments do not fit the tool's schema.
    InvalidArgs,
    /// Communication failed.
    TransportError,
    /// No tool has that name.
    ToolNotFound,
    /// The call took too long.
    Timeout,
}

/// A framework error on the step path.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolError {
    /// Its kind.
    pub error_type: ToolErrorType,
    /// What went wrong.
    pub message: String,
}

/// The step-path MCP actions (`ListToolsAction`, `CallToolAction`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum McpStepAction {
    /// `{"type":"list_tools"}`.
    ListTools {
        /// The reference's `Action.metadata`, ignored.
        #[serde(default, skip_serializing_if = "Map::is_empty")]
        metadata: Map<String, Value>,
    },
    /// `{"type":"call_tool","tool_name":...,"arguments":{...}}`.
    CallTool {
        /// Which tool.
        tool_name: String,
        /// Its arguments.
        #[serde(default)]
        arguments: Map<String, Value>,
        /// The reference's `Action.metadata`, ignored.
        #[serde(default, skip_serializing_if = "Map::is_empty")]
        metadata: Map<String, Value>,
    },
}

impl McpStepAction {
    /// Whether a step payload is an MCP action (has `"type":"list_tools"|"call_tool"`);
    /// the reference recognizes these regardless of the environment's action type.
    pub fn is_mcp_action(action: &Map<String, Value>) -> bool {
        matches!(
            action.get("type").and_then(Value::as_str),
            Some("list_tools" | "call_tool")
        )
    }
}

/// The observation a `list_tools` step returns.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ListToolsObservation {
    /// The tools.
    pub tools: Vec<StepTool>,
    /// Observation metadata (always present on the reference).
    #[serde(default)]
    pub metadata: Map<String, Value>,
}

/// The observation a `call_tool` step returns.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CallToolObservation {
    /// Which tool was called.
    pub tool_name: String,
    /// The tool's result, `null` on a framework error.
    #[serde(default)]
    pub result: Option<CallToolResult>,
    /// A framework error, `null` on success.
    #[serde(default)]
    pub error: Option<ToolError>,
    /// Observation metadata.
    #[serde(default)]
    pub metadata: Map<String, Value>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn parses_requests_and_reports_reference_codes() {
        let req = JsonRpcRequest::parse(
            r#"{"jsonrpc":"2.0","method":"tools/call","params":{"name":"echo_message","arguments":{"message":"hi"}},"id":3}"#,
        )
        .unwrap();
        assert_eq!(req.method, method::TOOLS_CALL);
        assert_eq!(req.id, Some(RequestId::Number(3)));
        let again = JsonRpcRequest::parse(&serde_json::to_string(&req).unwrap()).unwrap();
        assert_eq!(again, req);

        let bad = [
            ("{", code::PARSE_ERROR),
            ("{}", code::INVALID_REQUEST),
            (r#"{"method":"tools/list","id":1}"#, code::INVALID_REQUEST),
            (r#"{"jsonrpc":"1.0","method":"x"}"#, code::INVALID_REQUEST),
            (
                r#"{"jsonrpc":"2.0","method":"x","extra":1}"#,
                code::INVALID_REQUEST,
            ),
            (
                r#"{"jsonrpc":"2.0","method":"x","params":[1]}"#,
                code::INVALID_REQUEST,
            ),
        ];
        for (body, want) in bad {
            let resp = JsonRpcRequest::parse(body).unwrap_err();
            assert_eq!(resp.outcome.unwrap_err().code, want, "{body}");
        }
        let resp = JsonRpcRequest::parse(r#"{"method":"tools/list","id":9}"#).unwrap_err();
        assert_eq!(
            resp.id,
            Some(RequestId::Number(9)),
            "keeps the id when it can"
        );
    }

    #[test]
    fn responses_have_the_reference_shape() {
        let ok = JsonRpcResponse::result(Some(RequestId::Number(1)), json!({"session_id":"s"}));
        assert_eq!(
            serde_json::to_value(&ok).unwrap(),
            json!({"jsonrpc":"2.0","id":1,"result":{"session_id":"s"}})
        );
        let err = JsonRpcResponse::error(None, code::PARSE_ERROR, None, None);
        assert_eq!(
            serde_json::to_value(&err).unwrap(),
            json!({"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"Parse error","data":null}})
        );
        for resp in [ok, err] {
            let text = serde_json::to_string(&resp).unwrap();
            assert_eq!(
                serde_json::from_str::<JsonRpcResponse>(&text).unwrap(),
                resp
            );
        }
    }

    #[test]
    fn step_actions_and_tool_spellings() {
        let a: McpStepAction = serde_json::from_value(json!({"type":"list_tools"})).unwrap();
        assert_eq!(
            a,
            McpStepAction::ListTools {
                metadata: Map::new()
            }
        );
        let a: McpStepAction = serde_json::from_value(
            json!({"type":"call_tool","tool_name":"echo_message","arguments":{"message":"x"}}),
        )
        .unwrap();
        assert!(
            matches!(a, McpStepAction::CallTool { ref tool_name, .. } if tool_name == "echo_message")
        );
        assert!(serde_json::from_value::<McpStepAction>(json!({"type":"call_tool"})).is_err());

        let spec = ToolSpec {
            name: "t".into(),
            description: "d".into(),
            input_schema: json!({"type":"object"}),
        };
        let v = serde_json::to_value(&spec).unwrap();
        assert!(v.get("inputSchema").is_some());
        let step: StepTool = spec.into();
        assert!(
            serde_json::to_value(&step)
                .unwrap()
                .get("input_schema")
                .is_some()
        );
        let r = CallToolResult::ok(json!("hi"));
        assert_eq!(r.structured_content, Some(json!({"result":"hi"})));
    }
}
