//! The WebSocket session loops of `/ws` (OpenEnv envelopes) and `/mcp` (JSON-RPC).
//!
//! The loop is written over any `Stream + Sink` of messages so tests can drive it
//! without a socket.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use agentstack_protocol::http::ResetRequest;
use agentstack_protocol::mcp::{JsonRpcRequest, JsonRpcResponse};
use agentstack_protocol::ws::{ClientMessage, ErrorCode, ServerMessage, StepResult, WsError};
use axum::extract::WebSocketUpgrade;
use axum::extract::ws::{CloseFrame, Message};
use axum::response::Response;
use futures_util::{Sink, SinkExt, Stream, StreamExt};
use serde_json::value::RawValue;

use super::http::EnvCtx;
use super::sessions::Session;
use crate::environment::StepError;

/// Which protocol a socket speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// `/ws`: OpenEnv envelopes.
    Env,
    /// `/mcp`: bare JSON-RPC, one session per socket.
    Mcp,
}

/// Bytes read from a socket at a time.
const READ_CHUNK_BYTES: usize = 4096;
/// WebSocket close code for a normal close.
const CLOSE_NORMAL: u16 = 1000;
/// WebSocket close code for a message larger than allowed.
const CLOSE_TOO_BIG: u16 = 1009;

pub(crate) fn upgrade(
    ctx: EnvCtx,
    upgrade: WebSocketUpgrade,
    session_id: Option<String>,
    mode: Mode,
) -> Response {
    let max = ctx.state.config.max_frame_bytes;
    // tungstenite's defaults (128 KiB read and write buffers per socket) would cost
    // 2.5 GB at 10,000 idle sessions; frames here are small, so read in 4 KiB chunks
    // and write each frame out as soon as it is sent.
    upgrade
        .read_buffer_size(READ_CHUNK_BYTES)
        .write_buffer_size(0)
        .max_message_size(max)
        .max_frame_size(max)
        .on_upgrade(move |socket| run(ctx, socket, session_id, mode))
}

/// Releases the session when the socket ends, however it ends.
struct Attachment {
    ctx: EnvCtx,
    session: Arc<Session>,
    owned: bool,
}

impl Drop for Attachment {
    fn drop(&mut self) {
        let sessions = &self.ctx.state.sessions;
        if self.owned || self.session.close_requested.load(Ordering::Acquire) {
            sessions.remove(&self.session.id);
        } else {
            sessions.touch(&self.session);
            self.session.attached.store(false, Ordering::Release);
        }
    }
}

fn open(ctx: &EnvCtx, session_id: Option<String>) -> Result<Attachment, WsError> {
    let sessions = &ctx.state.sessions;
    match session_id {
        Some(id) => {
            let session = sessions.get(&id).ok_or_else(|| {
                WsError::new(ErrorCode::SessionError, format!("Unknown session_id: {id}"))
            })?;
            if session
                .attached
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                return Err(WsError::new(
                    ErrorCode::SessionError,
                    format!("Session {id} already has an attached WebSocket"),
                ));
            }
            sessions.touch(&session);
            Ok(Attachment {
                ctx: ctx.clone(),
                session,
                owned: false,
            })
        }
        None => {
            let session = sessions.create(&ctx.state.envs[ctx.index], true)?;
            Ok(Attachment {
                ctx: ctx.clone(),
                session,
                owned: true,
            })
        }
    }
}

fn text(s: String) -> Message {
    Message::Text(s.into())
}

fn error_frame(err: &WsError) -> Message {
    text(ServerMessage::<()>::Error(err.clone()).to_json())
}

fn close_frame(code: u16, reason: &str) -> Message {
    Message::Close(Some(CloseFrame {
        code,
        reason: reason.into(),
    }))
}

/// Runs one socket to its end.
pub(crate) async fn run<S, E>(ctx: EnvCtx, mut socket: S, session_id: Option<String>, mode: Mode)
where
    S: Stream<Item = Result<Message, E>> + Sink<Message> + Unpin,
    E: std::fmt::Display,
{
    let attachment = match open(&ctx, session_id) {
        Ok(a) => a,
        Err(err) => {
            tracing::debug!(code = %err.code, "refusing WebSocket session: {}", err.message);
            let _ = socket.send(error_frame(&err)).await;
            let _ = socket.send(close_frame(CLOSE_NORMAL, "")).await;
            return;
        }
    };
    let session = attachment.session.clone();
    let span = tracing::debug_span!("session", id = %session.id);
    let _enter = span.enter();
    let idle = ctx.state.config.idle_timeout;
    let mut shutdown = ctx.state.shutdown.clone();
    loop {
        let next = tokio::select! {
            biased;
            stop = shutdown.wait_for(|stop| *stop) => {
                drop(stop);
                None
            }
            next = tokio::time::timeout(idle, socket.next()) => Some(next),
        };
        let Some(next) = next else {
            let _ = socket
                .send(close_frame(CLOSE_NORMAL, "server shutting down"))
                .await;
            break;
        };
        let message = match next {
            Err(_) => {
                if ctx.state.sessions.idle_for(&session) < idle {
                    continue; // used over HTTP /mcp meanwhile
                }
                let err = WsError::new(
                    ErrorCode::SessionError,
                    format!(
                        "session closed after {} s without messages (the server's idle timeout)",
                        idle.as_secs()
                    ),
                );
                let _ = socket.send(error_frame(&err)).await;
                let _ = socket.send(close_frame(CLOSE_NORMAL, "idle timeout")).await;
                break;
            }
            Ok(None) => break,
            Ok(Some(Err(e))) => {
                let message = e.to_string();
                if message.contains("too long") || message.contains("too big") {
                    let err = WsError::new(
                        ErrorCode::SessionError,
                        format!(
                            "message larger than the server's limit of {} bytes: {message}",
                            ctx.state.config.max_frame_bytes
                        ),
                    );
                    let _ = socket.send(error_frame(&err)).await;
                    let _ = socket
                        .send(close_frame(CLOSE_TOO_BIG, "message too big"))
                        .await;
                }
                tracing::debug!(error = %message, "WebSocket read failed");
                break;
            }
            Ok(Some(Ok(m))) => m,
        };
        ctx.state.sessions.touch(&session);
        let reply = match message {
            Message::Text(frame) => match mode {
                Mode::Env => match handle_envelope(&ctx, &session, frame.as_str()).await {
                    Reply::Frame(frame) => frame,
                    Reply::Close => {
                        let _ = socket.send(close_frame(CLOSE_NORMAL, "")).await;
                        break;
                    }
                },
                Mode::Mcp => {
                    let response = match JsonRpcRequest::parse(frame.as_str()) {
                        Ok(request) => super::mcp::handle(&ctx, request, Some(&session)).await,
                        Err(response) => response,
                    };
                    serde_json::to_string(&response).expect("responses serialize")
                }
            },
            Message::Binary(_) => {
                let err = WsError::new(
                    ErrorCode::SessionError,
                    "binary frames are not part of the protocol; send each message as a JSON text frame",
                );
                let _ = socket.send(error_frame(&err)).await;
                let _ = socket.send(close_frame(CLOSE_NORMAL, "")).await;
                break;
            }
            Message::Close(_) => break,
            Message::Ping(_) | Message::Pong(_) => continue,
        };
        if socket.send(text(reply)).await.is_err() {
            break;
        }
    }
    drop(attachment);
}

enum Reply {
    Frame(String),
    Close,
}

fn error_json(err: WsError) -> String {
    ServerMessage::<()>::Error(err).to_json()
}

fn step_error(err: StepError) -> WsError {
    match err {
        StepError::Invalid(issues) => WsError::validation(issues),
        StepError::Env(e) => WsError::new(ErrorCode::ExecutionError, e.message),
    }
}

async fn handle_envelope(ctx: &EnvCtx, session: &Arc<Session>, frame: &str) -> Reply {
    let message = match ClientMessage::parse(frame) {
        Ok(m) => m,
        Err(err) => return Reply::Frame(error_json(err)),
    };
    let limit = ctx.state.config.step_timeout;
    let timed_out = |what: &str| {
        WsError::new(
            ErrorCode::ExecutionError,
            format!(
                "{what} took longer than the server's step timeout of {limit:?}; reset before stepping again"
            ),
        )
    };
    let observation = |result: crate::environment::StepJson| {
        ServerMessage::Observation(StepResult::<Box<RawValue>> {
            observation: result.observation,
            reward: result.reward,
            done: result.done,
            metadata: result.metadata,
        })
        .to_json()
    };
    Reply::Frame(match message {
        ClientMessage::Reset(data) => match ResetRequest::parse(data.get()) {
            Err(issues) => error_json(WsError::validation(
                issues
                    .into_iter()
                    .map(|i| i.under(&["data".into()]))
                    .collect(),
            )),
            Ok(request) => {
                let mut env = session.env.lock().await;
                match tokio::time::timeout(limit, env.reset(request)).await {
                    Err(_) => error_json(timed_out("reset")),
                    Ok(Err(e)) => error_json(WsError::new(ErrorCode::ExecutionError, e.message)),
                    Ok(Ok(result)) => observation(result),
                }
            }
        },
        ClientMessage::Step(action) => {
            let mut env = session.env.lock().await;
            match tokio::time::timeout(limit, env.step(action)).await {
                Err(_) => error_json(timed_out("step")),
                Ok(Err(e)) => error_json(step_error(e)),
                Ok(Ok(result)) => observation(result),
            }
        }
        ClientMessage::State => match session.env.lock().await.state() {
            Ok(state) => ServerMessage::<()>::State(state).to_json(),
            Err(e) => error_json(WsError::new(ErrorCode::ExecutionError, e.message)),
        },
        ClientMessage::Close => return Reply::Close,
        ClientMessage::Mcp(data) => {
            let response = match serde_json::from_str(data.get()) {
                Ok(value) => match JsonRpcRequest::from_value(value) {
                    Ok(request) => super::mcp::handle(ctx, request, Some(session)).await,
                    Err(response) => response,
                },
                Err(_) => JsonRpcResponse::error(
                    None,
                    agentstack_protocol::mcp::code::PARSE_ERROR,
                    None,
                    None,
                ),
            };
            ServerMessage::<()>::Mcp(serde_json::to_value(response).expect("responses serialize"))
                .to_json()
        }
    })
}
