//! The OpenEnv 0.10.0 wire protocol as typed Rust values, with no I/O.
//!
//! Everything an OpenEnv client or server puts on the wire has a type here:
//!
//! - [`ws`]: the stateful WebSocket protocol on `/ws` (client envelopes `reset`, `step`,
//!   `state`, `close`, `mcp`; server envelopes `observation`, `state`, `mcp`, `error` and
//!   the [`ws::ErrorCode`]s with their recoverable/fatal behaviour);
//! - [`http`]: the bodies of `/reset`, `/step`, `/state`, `/health`, `/metadata`,
//!   `/schema`, and FastAPI-shaped `422` validation errors;
//! - [`mcp`]: JSON-RPC 2.0 on `/mcp` (`tools/list`, `tools/call`,
//!   `openenv/session/create|close`) and the step-path MCP actions (`list_tools`,
//!   `call_tool`) that 0.3.0 clients send;
//! - [`tasks`]: the Task API routes (`/list_environments`, `/{env}/splits`, ...);
//! - [`openapi`]: the `/openapi.json` document that `openenv validate` reads.
//!
//! Parsers never panic on untrusted input; each returns an error that says what was
//! wrong in the same words the reference server uses.
//!
//! ```
//! use agentstack_protocol::ws::{ClientMessage, ErrorCode};
//!
//! let msg = ClientMessage::parse(r#"{"type":"step","data":{"message":"hi"}}"#).unwrap();
//! assert!(matches!(msg, ClientMessage::Step(data) if data.get() == r#"{"message":"hi"}"#));
//!
//! let err = ClientMessage::parse(r#"{"type":"step","data":{},"extra":1}"#).unwrap_err();
//! assert_eq!(err.code, ErrorCode::ValidationError);
//! assert!(!err.code.is_fatal());
//! ```

pub mod http;
pub mod mcp;
pub mod openapi;
pub mod tasks;
pub mod validation;
pub mod ws;

/// The OpenEnv release whose wire format this crate implements.
pub const OPENENV_VERSION: &str = "0.10.0";
