//! The OpenAI-compatible HTTP server: `/v1/chat/completions`, `/v1/completions`,
//! `/v1/models`, `/health`, and token-in-token-out `/generate`, `/tokenize`,
//! `/detokenize`.
//!
//! Errors have OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`), with
//! one table from error kind to HTTP status ([`ApiError::status`]).
//!
//! With API keys in [`ServerConfig::api_keys`] every route but `/health` needs
//! `Authorization: Bearer KEY`, checked before a body is read. `/v1/adapters` loads
//! LoRA adapters only from files inside [`ServerConfig::adapter_dir`].

mod adapters;
mod openai;
mod tokens;

pub use agentstack_serve::auth::{API_KEY_ENV, ApiKey, EmptyApiKey};

use agentstack_serve::auth::{KeyGuard, Refusal};

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, FromRequest, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::de::DeserializeOwned;
use serde_json::json;

use crate::constraint::ConstraintCompiler;
use crate::engine::{Engine, SubmitError};
use crate::error::ModelError;

/// Server limits and access.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The model name reported by `/v1/models` and in responses.
    pub model_name: String,
    /// Largest request body.
    pub max_body_bytes: usize,
    /// Largest `n` (choices per request).
    pub max_n: usize,
    /// How long a request may wait and run in total.
    pub request_timeout: Duration,
    /// Keys a request must bear one of (`Authorization: Bearer KEY`) on every route but
    /// `/health`; none: no key is asked for.
    pub api_keys: Vec<ApiKey>,
    /// The directory `POST /v1/adapters` loads adapter files from (a path inside it,
    /// relative or absolute); none: loading adapters is refused.
    pub adapter_dir: Option<PathBuf>,
    /// Connections open at once and the time to send a request head.
    pub connections: agentstack_serve::Limits,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            model_name: "model".into(),
            max_body_bytes: 4 << 20,
            max_n: 16,
            request_timeout: Duration::from_secs(600),
            api_keys: Vec::new(),
            adapter_dir: None,
            connections: agentstack_serve::Limits::default(),
        }
    }
}

/// Shared state of the handlers.
#[derive(Debug, Clone)]
pub struct AppState {
    engine: Engine,
    constraints: Option<ConstraintCompiler>,
    config: Arc<ServerConfig>,
}

impl AppState {
    /// State for serving `engine`. `constraints` enables `response_format` and
    /// constrained tool calls (build it once per model; it indexes the vocabulary).
    pub fn new(
        engine: Engine,
        constraints: Option<ConstraintCompiler>,
        config: ServerConfig,
    ) -> Self {
        Self {
            engine,
            constraints,
            config: Arc::new(config),
        }
    }
}

/// The whole service. With API keys configured, every route but `/health` checks the
/// key before anything else (the body is not read without one).
pub fn app(state: AppState) -> Router {
    let limit = state.config.max_body_bytes;
    let guard = KeyGuard::new(state.config.api_keys.clone(), refuse);
    let router = Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/generate", post(tokens::generate))
        .route("/tokenize", post(tokens::tokenize))
        .route("/detokenize", post(tokens::detokenize))
        .route(
            "/v1/adapters",
            get(adapters::list_adapters).post(adapters::load_adapter),
        )
        .route(
            "/v1/adapters/{name}",
            axum::routing::delete(adapters::unload_adapter),
        )
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state);
    guard.wrap(router)
}

/// The 401 of a request without a valid API key, in OpenAI's shape.
fn refuse(refusal: Refusal) -> Response {
    ApiError::unauthorized(refusal.message()).into_response()
}

/// Serves on `listener` until `shutdown` resolves, within
/// [`ServerConfig::connections`].
pub async fn serve(
    state: AppState,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let limits = state.config.connections;
    agentstack_serve::serve(listener, app(state), limits, shutdown).await
}

async fn health(
    axum::extract::State(state): axum::extract::State<AppState>,
) -> Json<serde_json::Value> {
    let (waiting, running) = state.engine.load();
    Json(json!({"status": "ok", "waiting": waiting, "running": running}))
}

async fn models(
    axum::extract::State(state): axum::extract::State<AppState>,
) -> Json<serde_json::Value> {
    let info = state.engine.model().info();
    let max_len = state.engine.model().model().max_positions();
    let mut data = vec![json!({
        "id": state.config.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "agentstack",
        "max_model_len": max_len,
        "architecture": info.config.architecture,
        "parameters": info.parameters,
    })];
    for adapter in state.engine.adapters() {
        data.push(json!({
            "id": adapter.name,
            "object": "model",
            "created": 0,
            "owned_by": "agentstack",
            "max_model_len": max_len,
            "parent": state.config.model_name,
            "version": adapter.version,
        }));
    }
    Json(json!({"object": "list", "data": data}))
}

impl AppState {
    /// The adapter a request's `model` names: `None` for the base model (its name, or no
    /// `model` at all), the name of a loaded adapter, or a 404 (`model_not_found`) for any
    /// other name, which would otherwise run on weights the client did not ask for.
    pub(crate) fn adapter_for(&self, model: Option<&str>) -> Result<Option<String>, ApiError> {
        let Some(model) = model else {
            return Ok(None);
        };
        if model == self.config.model_name {
            return Ok(None);
        }
        let adapters = self.engine.adapters();
        if adapters.iter().any(|a| a.name == model) {
            return Ok(Some(model.to_owned()));
        }
        let names: Vec<&str> = std::iter::once(self.config.model_name.as_str())
            .chain(adapters.iter().map(|a| a.name.as_str()))
            .collect();
        Err(ApiError::model_not_found(model, &names))
    }
}

/// At most this many characters of a name a client sent are repeated in an error.
const ECHOED_NAME: usize = 80;
/// At most this many served names are listed in an error.
const LISTED_NAMES: usize = 8;

async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found_error",
        format!(
            "no route {}; see /v1/chat/completions, /v1/completions, /v1/models, /v1/adapters, /generate, /tokenize, /detokenize, /health",
            uri.path()
        ),
    )
}

/// An error response in OpenAI's shape.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
    param: Option<String>,
    code: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// A 404 (`model_not_found`, as OpenAI says it): `model` is neither the base
    /// model's name nor a loaded adapter's; `served` lists the names that are.
    fn model_not_found(model: &str, served: &[&str]) -> Self {
        let shown: String = model.chars().take(ECHOED_NAME).collect();
        let ellipsis = if shown.len() < model.len() { "…" } else { "" };
        let mut listed = served
            .iter()
            .take(LISTED_NAMES)
            .map(|name| format!("`{name}`"))
            .collect::<Vec<_>>()
            .join(", ");
        if served.len() > LISTED_NAMES {
            listed.push_str(&format!(" and {} more", served.len() - LISTED_NAMES));
        }
        Self {
            param: Some("model".to_owned()),
            code: Some("model_not_found"),
            ..Self::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!(
                    "the model `{shown}{ellipsis}` is not served here; this server serves {listed} (GET /v1/models lists them; leave `model` out for the base model)"
                ),
            )
        }
    }

    /// A 400 about one request field; the message names the field.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        let message = message.into();
        let message = if message.contains(param) {
            message
        } else {
            format!("`{param}`: {message}")
        };
        Self {
            param: Some(param.to_owned()),
            ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    /// A 401: the request bears no valid API key.
    fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "invalid_request_error", message)
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.status
    }
}

impl From<ModelError> for ApiError {
    fn from(error: ModelError) -> Self {
        match &error {
            ModelError::InvalidRequest(_)
            | ModelError::ContextOverflow { .. }
            | ModelError::Template(_)
            | ModelError::Tokenizer(_) => Self::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                error.to_string(),
            ),
            _ => {
                tracing::error!(error = %error, "internal error");
                Self::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "server_error",
                    "internal error; see the server log",
                )
            }
        }
    }
}

impl From<SubmitError> for ApiError {
    fn from(error: SubmitError) -> Self {
        match error {
            SubmitError::Invalid(e) | SubmitError::Failed(e) => e.into(),
            SubmitError::Overloaded { .. } => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_overloaded",
                error.to_string(),
            ),
            SubmitError::UnknownAdapter(_) => {
                Self::new(StatusCode::NOT_FOUND, "not_found_error", error.to_string())
            }
            SubmitError::Stopped => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "the engine has stopped",
            ),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        });
        (self.status, Json(body)).into_response()
    }
}

/// A JSON body whose errors are OpenAI-shaped and name the field that was wrong.
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = match axum::body::Bytes::from_request(req, state).await {
            Ok(bytes) => bytes,
            Err(rejection) => {
                return Err(ApiError::new(
                    rejection.status(),
                    "invalid_request_error",
                    rejection.body_text(),
                ));
            }
        };
        let deserializer = &mut serde_json::Deserializer::from_slice(&bytes);
        match serde_path_to_error::deserialize(deserializer) {
            Ok(value) => Ok(Self(value)),
            Err(error) => {
                let mut path = error.path().to_string();
                let inner = error.into_inner();
                if path == "." && inner.is_data() {
                    // Fields inside a flattened struct lose their path; find the key
                    // whose value the error points at.
                    if let Some(key) = key_before(&bytes, inner.line(), inner.column()) {
                        path = key;
                    }
                }
                let syntax = inner.is_syntax() || inner.is_eof();
                let message = if syntax {
                    format!("the body is not valid JSON: {inner}")
                } else if path == "." {
                    format!("invalid request body: {inner}")
                } else {
                    format!("invalid `{path}`: {inner}")
                };
                Err(ApiError {
                    param: (!syntax && path != ".").then_some(path),
                    ..ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
                })
            }
        }
    }
}

/// The object key whose value ends at (`line`, `column`) of `body`, if one can be seen.
fn key_before(body: &[u8], line: usize, column: usize) -> Option<String> {
    let mut offset = 0;
    for (i, l) in body.split(|&b| b == b'\n').enumerate() {
        if i + 1 == line {
            offset += column.min(l.len());
            break;
        }
        offset += l.len() + 1;
    }
    let text = std::str::from_utf8(body.get(..offset)?).ok()?;
    let colon = text.rfind(':')?;
    let before = text[..colon].trim_end();
    let key_end = before.strip_suffix('"')?;
    let key_start = key_end.rfind('"')?;
    let key = &key_end[key_start + 1..];
    (!key.is_empty() && key.len() < 64).then(|| key.to_owned())
}
