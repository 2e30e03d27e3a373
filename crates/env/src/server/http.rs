//! HTTP routes and the one table that maps errors to status codes.

use std::sync::Arc;

use agentstack_protocol::http::{ErrorDetail, HealthResponse, ResetRequest, StepRequest};
use agentstack_protocol::mcp::JsonRpcRequest;
use agentstack_protocol::openapi::{self, Routes};
use agentstack_protocol::tasks::{
    NumTasksResponse, SplitRequest, TaskRangeRequest, TaskRangeResponse, TaskRequest, TaskResponse,
    TasksResponse, resolve_index, resolve_range,
};
use agentstack_protocol::validation::ValidationIssue;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State, WebSocketUpgrade};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use serde_json::value::RawValue;

use super::AppState;
use crate::environment::{DynEnvironment, EnvError, StepError};
use crate::tasks::TaskError;

/// What an HTTP route can fail with; [`IntoResponse`] is the one status table.
#[derive(Debug)]
pub(crate) enum ApiError {
    /// 422 with pydantic-shaped issues.
    Validation(Vec<ValidationIssue>),
    /// 400 with a message.
    BadRequest(String),
    /// 401: the request bears no valid API key.
    Unauthorized(&'static str),
    /// 404 with a message.
    NotFound(String),
    /// 501: the environment lacks the feature.
    NotImplemented(String),
    /// 500: the environment failed.
    Execution(String),
    /// 504: the environment took longer than the step timeout.
    Timeout(String),
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, body) = match self {
            ApiError::Validation(issues) => (
                StatusCode::UNPROCESSABLE_ENTITY,
                ErrorDetail::issues(issues),
            ),
            ApiError::BadRequest(m) => (StatusCode::BAD_REQUEST, ErrorDetail::message(m)),
            ApiError::Unauthorized(m) => (StatusCode::UNAUTHORIZED, ErrorDetail::message(m)),
            ApiError::NotFound(m) => (StatusCode::NOT_FOUND, ErrorDetail::message(m)),
            ApiError::NotImplemented(m) => (StatusCode::NOT_IMPLEMENTED, ErrorDetail::message(m)),
            ApiError::Execution(m) => {
                tracing::warn!(error = %m, "environment failed on an HTTP request");
                (StatusCode::INTERNAL_SERVER_ERROR, ErrorDetail::message(m))
            }
            ApiError::Timeout(m) => (StatusCode::GATEWAY_TIMEOUT, ErrorDetail::message(m)),
        };
        (status, axum::Json(body)).into_response()
    }
}

impl From<EnvError> for ApiError {
    fn from(e: EnvError) -> Self {
        ApiError::Execution(e.message)
    }
}

impl From<TaskError> for ApiError {
    fn from(e: TaskError) -> Self {
        match e {
            TaskError::InvalidIndex => ApiError::BadRequest(e.to_string()),
            TaskError::UnknownSplit { .. } => ApiError::BadRequest(e.to_string()),
        }
    }
}

/// A JSON body from raw JSON text already serialized.
pub(crate) fn json_text(text: String) -> Response {
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        text,
    )
        .into_response()
}

fn json<T: Serialize>(value: &T) -> Response {
    json_text(serde_json::to_string(value).expect("responses serialize"))
}

/// Per-environment route state.
#[derive(Clone)]
pub(crate) struct EnvCtx {
    pub state: Arc<AppState>,
    pub index: usize,
}

impl EnvCtx {
    fn spec(&self) -> &crate::spec::EnvSpec {
        &self.state.envs[self.index]
    }

    fn fresh(&self) -> Result<Box<dyn DynEnvironment>, ApiError> {
        self.spec()
            .instantiate()
            .map_err(|m| ApiError::Execution(format!("could not create the environment: {m}")))
    }

    async fn timed<T>(&self, what: &str, fut: impl Future<Output = T>) -> Result<T, ApiError> {
        let limit = self.state.config.step_timeout;
        tokio::time::timeout(limit, fut).await.map_err(|_| {
            ApiError::Timeout(format!(
                "{what} took longer than the step timeout of {limit:?}"
            ))
        })
    }
}

/// The routes of one environment.
pub(crate) fn env_routes(state: Arc<AppState>, index: usize) -> Router {
    let simulation = state.config.simulation;
    let mut router = Router::new()
        .route("/health", get(health))
        .route("/metadata", get(metadata))
        .route("/schema", get(schema))
        .route("/openapi.json", get(openapi_doc))
        .route("/mcp", post(mcp_post).get(mcp_ws))
        .route("/ws", get(ws));
    if simulation {
        router = router
            .route("/reset", post(reset))
            .route("/step", post(step))
            .route("/state", get(state_route));
    }
    router.with_state(EnvCtx { state, index })
}

async fn health() -> Response {
    json(&HealthResponse::HEALTHY)
}

async fn metadata(State(ctx): State<EnvCtx>) -> Response {
    json(&ctx.spec().info().metadata())
}

async fn schema(State(ctx): State<EnvCtx>) -> Response {
    json(ctx.spec().schema())
}

async fn openapi_doc(State(ctx): State<EnvCtx>) -> Response {
    let spec = ctx.spec();
    let schemas = serde_json::to_value(spec.schema()).ok();
    json(&openapi::document(
        &spec.info().name,
        &spec.info().description,
        Routes {
            simulation: ctx.state.config.simulation,
        },
        schemas.as_ref(),
    ))
}

async fn ws(
    State(ctx): State<EnvCtx>,
    upgrade: WebSocketUpgrade,
    query: axum::extract::Query<SessionQuery>,
) -> Response {
    super::ws::upgrade(ctx, upgrade, query.0.session_id, super::ws::Mode::Env)
}

async fn mcp_ws(State(ctx): State<EnvCtx>, upgrade: WebSocketUpgrade) -> Response {
    super::ws::upgrade(ctx, upgrade, None, super::ws::Mode::Mcp)
}

#[derive(serde::Deserialize)]
pub(crate) struct SessionQuery {
    session_id: Option<String>,
}

async fn mcp_post(State(ctx): State<EnvCtx>, body: Bytes) -> Response {
    let text = String::from_utf8_lossy(&body);
    let response = match JsonRpcRequest::parse(&text) {
        Ok(request) => super::mcp::handle(&ctx, request, None).await,
        Err(response) => response,
    };
    json(&response)
}

fn body_object(body: &Bytes) -> Result<serde_json::Map<String, Value>, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(serde_json::Map::new());
    }
    let text = std::str::from_utf8(body).map_err(|_| {
        ApiError::Validation(vec![ValidationIssue::new(
            "json_invalid",
            vec!["body".into()],
            "request body is not UTF-8",
        )])
    })?;
    agentstack_protocol::http::parse_object(text).map_err(|issues| {
        ApiError::Validation(
            issues
                .into_iter()
                .map(|i| i.under(&["body".into()]))
                .collect(),
        )
    })
}

async fn reset(State(ctx): State<EnvCtx>, body: Bytes) -> Result<Response, ApiError> {
    let request = ResetRequest::from_object(body_object(&body)?).map_err(|issues| {
        ApiError::Validation(
            issues
                .into_iter()
                .map(|i| i.under(&["body".into()]))
                .collect(),
        )
    })?;
    let mut env = ctx.fresh()?;
    let result = ctx.timed("reset", env.reset(request)).await??;
    Ok(json(&result))
}

async fn step(State(ctx): State<EnvCtx>, body: Bytes) -> Result<Response, ApiError> {
    let request = StepRequest::from_object(body_object(&body)?).map_err(ApiError::Validation)?;
    let action = serde_json::value::to_raw_value(&request.action)
        .map_err(|e| ApiError::Execution(e.to_string()))?;
    let mut env = ctx.fresh()?;
    let limit = request
        .timeout_s
        .map(std::time::Duration::from_secs_f64)
        .map_or(ctx.state.config.step_timeout, |t| {
            t.min(ctx.state.config.step_timeout)
        });
    let result = tokio::time::timeout(limit, step_raw(env.as_mut(), &action))
        .await
        .map_err(|_| ApiError::Timeout(format!("step took longer than {limit:?}")))?;
    match result {
        Ok(result) => Ok(json(&result)),
        Err(StepError::Invalid(issues)) => Err(ApiError::Validation(issues)),
        Err(StepError::Env(e)) => Err(e.into()),
    }
}

async fn step_raw(
    env: &mut dyn DynEnvironment,
    action: &RawValue,
) -> Result<crate::environment::StepJson, StepError> {
    env.step(action).await
}

async fn state_route(State(ctx): State<EnvCtx>) -> Result<Response, ApiError> {
    let env = ctx.fresh()?;
    Ok(json(&env.state()?))
}

/// The 401 of a request without a valid API key, as `{"detail": "..."}` like the
/// server's other errors (and FastAPI's, which OpenEnv clients know).
pub(crate) fn unauthorized(refusal: agentstack_serve::auth::Refusal) -> Response {
    ApiError::Unauthorized(refusal.message()).into_response()
}

pub(crate) async fn not_found() -> Response {
    ApiError::NotFound("Not Found".into()).into_response()
}

/// The Task API routes, at the root only.
pub(crate) fn task_routes(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/list_environments", get(list_environments))
        .route("/{env_name}/splits", get(splits))
        .route("/{env_name}/tasks", post(tasks))
        .route("/{env_name}/num_tasks", post(num_tasks))
        .route("/{env_name}/task", post(task))
        .route("/{env_name}/task_range", post(task_range))
        .with_state(state)
}

async fn list_environments(State(state): State<Arc<AppState>>) -> Response {
    let names: Vec<&str> = state.envs.iter().map(|e| e.name()).collect();
    json(&names)
}

fn task_source(
    state: &AppState,
    env_name: &str,
) -> Result<(String, Arc<dyn crate::tasks::TaskSource>), ApiError> {
    let index = state
        .env_index(env_name)
        .ok_or_else(|| ApiError::NotFound(format!("unknown environment '{env_name}'")))?;
    let spec = &state.envs[index];
    let tasks = spec.tasks().cloned().ok_or_else(|| {
        ApiError::NotImplemented(format!("environment '{}' has no task list", spec.name()))
    })?;
    Ok((spec.name().to_owned(), tasks))
}

fn parse_body<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    let text = std::str::from_utf8(body).unwrap_or("");
    crate::environment::deserialize_with_issues::<T>(text).map_err(|issues| {
        ApiError::Validation(
            issues
                .into_iter()
                .map(|i| i.under(&["body".into()]))
                .collect(),
        )
    })
}

async fn splits(
    State(state): State<Arc<AppState>>,
    Path(env_name): Path<String>,
) -> Result<Response, ApiError> {
    let (_, tasks) = task_source(&state, &env_name)?;
    Ok(json(&tasks.splits()))
}

fn all_tasks(
    tasks: &dyn crate::tasks::TaskSource,
    split: &str,
    range: std::ops::Range<usize>,
) -> Result<Vec<Value>, ApiError> {
    range
        .map(|i| tasks.task(split, i).map_err(ApiError::from))
        .collect()
}

async fn tasks(
    State(state): State<Arc<AppState>>,
    Path(env_name): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let (name, tasks) = task_source(&state, &env_name)?;
    let req: SplitRequest = parse_body(&body)?;
    let n = tasks.num_tasks(&req.split)?;
    Ok(json(&TasksResponse {
        tasks: all_tasks(tasks.as_ref(), &req.split, 0..n)?,
        env_name: name,
    }))
}

async fn num_tasks(
    State(state): State<Arc<AppState>>,
    Path(env_name): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let (_, tasks) = task_source(&state, &env_name)?;
    let req: SplitRequest = parse_body(&body)?;
    Ok(json(&NumTasksResponse {
        num_tasks: tasks.num_tasks(&req.split)?,
    }))
}

async fn task(
    State(state): State<Arc<AppState>>,
    Path(env_name): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let (_, tasks) = task_source(&state, &env_name)?;
    let req: TaskRequest = parse_body(&body)?;
    let n = tasks.num_tasks(&req.split)?;
    let index = resolve_index(req.index, n).ok_or(TaskError::InvalidIndex)?;
    Ok(json(&TaskResponse {
        task: tasks.task(&req.split, index)?,
    }))
}

async fn task_range(
    State(state): State<Arc<AppState>>,
    Path(env_name): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let (_, tasks) = task_source(&state, &env_name)?;
    let req: TaskRangeRequest = parse_body(&body)?;
    let n = tasks.num_tasks(&req.split)?;
    let range = resolve_range(req.start, req.stop, n);
    Ok(json(&TaskRangeResponse {
        tasks: all_tasks(tasks.as_ref(), &req.split, range)?,
    }))
}
