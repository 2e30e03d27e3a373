//! The `/openapi.json` document.
//!
//! `openenv validate --url` reads `info.version` (a `1.x` version selects the
//! `openenv-http/1.x` profile) and checks that `/reset`, `/step` and `/state` are all
//! present or all absent. We describe every route we serve.

use serde_json::{Value, json};

/// The `info.version` we report; the reference reports `"1.0.0"`.
pub const API_VERSION: &str = "1.0.0";

/// Which routes a server exposes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Routes {
    /// Whether the stateless `/reset`, `/step`, `/state` routes are served
    /// (simulation mode).
    pub simulation: bool,
}

/// Builds the OpenAPI 3.1 document for an environment server.
pub fn document(title: &str, description: &str, routes: Routes, schemas: Option<&Value>) -> Value {
    let json_body = |schema: Value| json!({"content": {"application/json": {"schema": schema}}});
    let ok = |desc: &str, schema: Value| json!({"200": {"description": desc, "content": {"application/json": {"schema": schema}}}});
    let action_schema = schemas
        .and_then(|s| s.get("action"))
        .cloned()
        .unwrap_or_else(|| json!({"type": "object"}));
    let mut paths = serde_json::Map::new();
    paths.insert("/health".into(), json!({"get": {"summary": "Health check", "responses": ok("Server is healthy", json!({"type":"object","properties":{"status":{"type":"string"}}}))}}));
    paths.insert("/metadata".into(), json!({"get": {"summary": "Environment metadata", "responses": ok("Metadata", json!({"type":"object"}))}}));
    paths.insert("/schema".into(), json!({"get": {"summary": "Action, observation and state JSON Schemas", "responses": ok("Schemas", json!({"type":"object"}))}}));
    paths.insert("/mcp".into(), json!({"post": {"summary": "MCP JSON-RPC 2.0 (tools/list, tools/call, openenv/session/create|close)", "requestBody": json_body(json!({"type":"object"})), "responses": ok("JSON-RPC response (always HTTP 200)", json!({"type":"object"}))}}));
    if routes.simulation {
        paths.insert("/reset".into(), json!({"post": {"summary": "Reset a fresh environment (stateless)", "requestBody": json_body(json!({"type":"object","properties":{"seed":{"type":"integer","minimum":0},"episode_id":{"type":"string","maxLength":255}},"additionalProperties":true})), "responses": ok("Observation", json!({"type":"object"}))}}));
        paths.insert("/step".into(), json!({"post": {"summary": "Step a fresh environment (stateless)", "requestBody": json_body(json!({"type":"object","required":["action"],"properties":{"action": action_schema, "timeout_s":{"type":"number","exclusiveMinimum":0},"request_id":{"type":"string","maxLength":255}},"additionalProperties":true})), "responses": ok("Observation", json!({"type":"object"}))}}));
        paths.insert("/state".into(), json!({"get": {"summary": "State of a freshly constructed environment", "responses": ok("State", json!({"type":"object"}))}}));
    }
    paths.insert("/list_environments".into(), json!({"get": {"tags":["Task API"], "summary": "Environments served", "responses": ok("Names", json!({"type":"array","items":{"type":"string"}}))}}));
    for (route, summary) in [
        ("tasks", "List tasks of a split"),
        ("num_tasks", "Count tasks of a split"),
        ("task", "One task by index"),
        ("task_range", "Tasks in a slice"),
    ] {
        paths.insert(
            format!("/{{env_name}}/{route}"),
            json!({"post": {"tags":["Task API"], "summary": summary, "parameters":[{"name":"env_name","in":"path","required":true,"schema":{"type":"string"}}], "requestBody": json_body(json!({"type":"object"})), "responses": ok("Tasks", json!({"type":"object"}))}}),
        );
    }
    paths.insert("/{env_name}/splits".into(), json!({"get": {"tags":["Task API"], "summary": "Splits", "parameters":[{"name":"env_name","in":"path","required":true,"schema":{"type":"string"}}], "responses": ok("Splits", json!({"type":"array"}))}}));
    json!({
        "openapi": "3.1.0",
        "info": {"title": title, "description": description, "version": API_VERSION},
        "paths": paths,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simulation_routes_are_all_or_nothing() {
        for simulation in [true, false] {
            let doc = document("echo", "d", Routes { simulation }, None);
            assert_eq!(doc["info"]["version"], API_VERSION);
            let paths = doc["paths"].as_object().unwrap();
            let present = ["/reset", "/step", "/state"].map(|p| paths.contains_key(p));
            assert!(present.iter().all(|&p| p == simulation));
            assert!(paths.contains_key("/mcp"));
        }
    }
}
