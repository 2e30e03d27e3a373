//! JSON-RPC handling shared by `POST /mcp`, `WS /mcp` and `{"type":"mcp"}` frames.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use agentstack_protocol::mcp::{JsonRpcRequest, JsonRpcResponse, code, method};
use serde_json::{Value, json};

use super::http::EnvCtx;
use super::sessions::Session;
use crate::environment::{DynEnvironment, ToolCallError};

/// Answers one request. `bound` is the session of the socket the request came on.
pub(crate) async fn handle(
    ctx: &EnvCtx,
    request: JsonRpcRequest,
    bound: Option<&Arc<Session>>,
) -> JsonRpcResponse {
    let id = request.id.clone();
    let err =
        |code: i64, message: String| JsonRpcResponse::error(id.clone(), code, Some(message), None);
    let sessions = &ctx.state.sessions;
    match request.method.as_str() {
        method::SESSION_CREATE => {
            if let Some(session) = bound {
                return JsonRpcResponse::result(id, json!({"session_id": session.id}));
            }
            match sessions.create(&ctx.state.envs[ctx.index], false) {
                Ok(session) => JsonRpcResponse::result(id, json!({"session_id": session.id})),
                Err(e) => {
                    let data = json!({
                        "active_sessions": e.active_sessions,
                        "max_sessions": e.max_sessions,
                        "factory_name": e.factory_name,
                    });
                    JsonRpcResponse::error(id, code::SERVER_ERROR, Some(e.message), Some(data))
                }
            }
        }
        method::SESSION_CLOSE => {
            let Some(target) = request.params.get("session_id").and_then(Value::as_str) else {
                return err(
                    code::INVALID_PARAMS,
                    "Invalid params - 'session_id' is required".into(),
                );
            };
            if bound.is_some_and(|s| s.id == target) {
                return err(
                    code::INVALID_REQUEST,
                    "Cannot close active WebSocket-managed session via MCP method".into(),
                );
            }
            let Some(session) = sessions.get(target) else {
                return err(
                    code::INVALID_PARAMS,
                    format!("Unknown session_id: {target}"),
                );
            };
            if session.attached.load(Ordering::Acquire) {
                session.close_requested.store(true, Ordering::Release);
                return JsonRpcResponse::result(
                    id,
                    json!({"session_id": target, "closed": false, "closing": true}),
                );
            }
            sessions.remove(target);
            JsonRpcResponse::result(id, json!({"session_id": target, "closed": true}))
        }
        method::TOOLS_LIST | method::TOOLS_CALL => {
            let session = match (bound, request.params.get("session_id")) {
                (Some(s), _) => Some(s.clone()),
                (None, Some(Value::String(sid))) => match sessions.get(sid) {
                    Some(s) => Some(s),
                    None => return err(code::INVALID_PARAMS, format!("Unknown session_id: {sid}")),
                },
                (None, Some(Value::Null) | None) => None,
                (None, Some(other)) => {
                    return err(
                        code::INVALID_PARAMS,
                        format!("session_id must be a string, got {other}"),
                    );
                }
            };
            if let Some(s) = &session {
                sessions.touch(s);
            }
            match session {
                Some(s) => {
                    let mut env = s.env.lock().await;
                    tools(ctx, env.as_mut(), &request).await
                }
                None => match ctx.state.envs[ctx.index].instantiate() {
                    Ok(mut env) => tools(ctx, env.as_mut(), &request).await,
                    Err(m) => err(
                        code::INTERNAL_ERROR,
                        format!("could not create the environment: {m}"),
                    ),
                },
            }
        }
        other => err(code::METHOD_NOT_FOUND, format!("Method not found: {other}")),
    }
}

async fn tools(
    ctx: &EnvCtx,
    env: &mut dyn DynEnvironment,
    request: &JsonRpcRequest,
) -> JsonRpcResponse {
    let id = request.id.clone();
    let err =
        |code: i64, message: String| JsonRpcResponse::error(id.clone(), code, Some(message), None);
    let specs = env.tools();
    if specs.is_empty() {
        return err(
            code::INTERNAL_ERROR,
            "Environment does not support MCP".into(),
        );
    }
    if request.method == method::TOOLS_LIST {
        return JsonRpcResponse::result(id.clone(), json!({ "tools": specs }));
    }
    let Some(name) = request.params.get("name").and_then(Value::as_str) else {
        return err(code::INVALID_PARAMS, "Missing 'name' in params".into());
    };
    let arguments = match request.params.get("arguments") {
        None | Some(Value::Null) => serde_json::Map::new(),
        Some(Value::Object(a)) => a.clone(),
        Some(other) => {
            return err(
                code::INVALID_PARAMS,
                format!("'arguments' must be an object, got {other}"),
            );
        }
    };
    let limit = ctx.state.config.step_timeout;
    match tokio::time::timeout(limit, env.call_tool(name, arguments)).await {
        Err(_) => err(
            code::INTERNAL_ERROR,
            format!("tool '{name}' took longer than the step timeout of {limit:?}"),
        ),
        Ok(Ok(result)) => JsonRpcResponse::result(
            id.clone(),
            serde_json::to_value(result).expect("tool results serialize"),
        ),
        Ok(Err(e @ ToolCallError::InvalidArgs(_))) => err(code::INVALID_PARAMS, e.to_string()),
        Ok(Err(e)) => err(code::INTERNAL_ERROR, e.to_string()),
    }
}
