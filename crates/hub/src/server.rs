//! The registry over HTTP: the JSON API (`/api/v1/...`, see [`crate::api`]) and the
//! read-only web pages ([`crate::web`]). [`app`] builds the whole service; errors map
//! to statuses in one table ([`RegistryError::status`]) and internals are logged, not
//! sent.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use serde::Deserialize;

use crate::api::{
    self, ErrorBody, ErrorDetail, ForkRequest, LeaderboardPost, SearchQuery, TagRequest,
};
use crate::db::User;
use crate::registry::{Registry, RegistryError};
use crate::validate;

/// The largest JSON body (forks, tags, leaderboard posts).
const MAX_JSON_BYTES: usize = 256 << 10;

impl RegistryError {
    /// The HTTP status and error code of each kind.
    pub fn status(&self) -> (StatusCode, &'static str) {
        match self {
            Self::BadRequest(_) => (StatusCode::BAD_REQUEST, "bad_request"),
            Self::Unauthorized(_) => (StatusCode::UNAUTHORIZED, "unauthorized"),
            Self::Forbidden(_) => (StatusCode::FORBIDDEN, "forbidden"),
            Self::NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            Self::Conflict(_) => (StatusCode::CONFLICT, "conflict"),
            Self::TooLarge(_) => (StatusCode::PAYLOAD_TOO_LARGE, "too_large"),
            Self::InvalidPackage(_) => (StatusCode::UNPROCESSABLE_ENTITY, "invalid_package"),
            Self::Corrupt(_) => (StatusCode::INTERNAL_SERVER_ERROR, "corrupt"),
            Self::Db(_) | Self::Blob(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        }
    }
}

impl IntoResponse for RegistryError {
    fn into_response(self) -> Response {
        let (status, code) = self.status();
        let message = match &self {
            Self::InvalidPackage(e) => format!("invalid package: {e}"),
            other => other.to_string(),
        };
        if status.is_server_error() {
            let mut cause = String::new();
            let mut source = std::error::Error::source(&self);
            while let Some(s) = source {
                cause.push_str(&format!(": {s}"));
                source = s.source();
            }
            tracing::error!(code, "{message}{cause}");
        }
        let body = ErrorBody {
            error: ErrorDetail {
                code: code.to_owned(),
                message,
            },
        };
        (status, Json(body)).into_response()
    }
}

type Shared = Arc<Registry>;
type Result<T> = std::result::Result<T, RegistryError>;

/// The bearer token of a request, if any.
fn bearer(headers: &HeaderMap) -> Result<Option<&str>> {
    let Some(value) = headers.get(header::AUTHORIZATION) else {
        return Ok(None);
    };
    value
        .to_str()
        .ok()
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|t| Some(t.trim()))
        .ok_or_else(|| {
            RegistryError::Unauthorized("the Authorization header must be `Bearer <token>`".into())
        })
}

async fn viewer(registry: &Registry, headers: &HeaderMap) -> Result<Option<User>> {
    registry.authenticate(bearer(headers)?).await
}

/// The whole service: API and web pages.
pub fn app(registry: Shared) -> Router {
    let max_package = registry.limits.max_package_bytes;
    let api = Router::new()
        .route(
            "/health",
            get(|| async { Json(serde_json::json!({"status": "ok"})) }),
        )
        .route("/whoami", get(whoami))
        .route("/envs", get(search))
        .route("/envs/{owner}/{name}", get(info))
        .route(
            "/envs/{owner}/{name}/versions/{version}",
            put(push)
                .layer(DefaultBodyLimit::max(max_package))
                .get(version),
        )
        .route("/envs/{owner}/{name}/versions/{version}/package", get(pull))
        .route("/envs/{owner}/{name}/tags/{tag}", put(set_tag))
        .route("/envs/{owner}/{name}/fork", post(fork))
        .route(
            "/envs/{owner}/{name}/versions/{version}/leaderboard",
            get(leaderboard).post(post_result),
        )
        .fallback(|| async {
            RegistryError::NotFound(
                "no such API route; see the route table in the hub's documentation".into(),
            )
        })
        .layer(DefaultBodyLimit::max(MAX_JSON_BYTES));
    Router::new()
        .nest("/api/v1", api)
        .merge(crate::web::routes())
        .with_state(registry)
}

async fn whoami(State(r): State<Shared>, headers: HeaderMap) -> Result<Json<api::WhoAmI>> {
    match viewer(&r, &headers).await? {
        Some(user) => Ok(Json(api::WhoAmI { user: user.name })),
        None => Err(RegistryError::Unauthorized("no token sent".into())),
    }
}

async fn search(
    State(r): State<Shared>,
    headers: HeaderMap,
    query: std::result::Result<Query<SearchQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<api::SearchResponse>> {
    let Query(query) = query.map_err(|e| {
        RegistryError::BadRequest(format!(
            "{e} (expected q=..., sort=relevance|downloads|score, limit, offset)"
        ))
    })?;
    let viewer = viewer(&r, &headers).await?;
    let results = r.search(viewer.as_ref(), &query).await?;
    Ok(Json(api::SearchResponse { results }))
}

async fn info(
    State(r): State<Shared>,
    headers: HeaderMap,
    Path((owner, name)): Path<(String, String)>,
) -> Result<Json<api::PackageInfo>> {
    let viewer = viewer(&r, &headers).await?;
    Ok(Json(r.info(viewer.as_ref(), &owner, &name).await?))
}

async fn version(
    State(r): State<Shared>,
    headers: HeaderMap,
    Path((owner, name, reference)): Path<(String, String, String)>,
) -> Result<Json<api::VersionInfo>> {
    let viewer = viewer(&r, &headers).await?;
    Ok(Json(
        r.version(viewer.as_ref(), &owner, &name, &reference)
            .await?,
    ))
}

#[derive(Deserialize)]
struct PushParams {
    #[serde(default)]
    private: bool,
}

async fn push(
    State(r): State<Shared>,
    headers: HeaderMap,
    Path((owner, name, version)): Path<(String, String, String)>,
    Query(params): Query<PushParams>,
    body: std::result::Result<bytes::Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<(StatusCode, Json<api::PushResponse>)> {
    let user = viewer(&r, &headers).await?;
    let body = body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            RegistryError::TooLarge(format!(
                "the package is larger than this registry takes ({} bytes)",
                r.limits.max_package_bytes
            ))
        } else {
            RegistryError::BadRequest(format!("reading the body: {e}"))
        }
    })?;
    let (response, version_id) = r
        .push(user.as_ref(), &owner, &name, &version, params.private, body)
        .await?;
    tracing::info!(package = %response.package, version = %response.version, sha256 = %response.sha256, "pushed");
    tokio::spawn(validate::validate_version(r.clone(), version_id));
    Ok((StatusCode::CREATED, Json(response)))
}

async fn pull(
    State(r): State<Shared>,
    headers: HeaderMap,
    Path((owner, name, reference)): Path<(String, String, String)>,
) -> Result<Response> {
    let viewer = viewer(&r, &headers).await?;
    let (version, bytes) = r.pull(viewer.as_ref(), &owner, &name, &reference).await?;
    let mut response = Response::new(Body::from(bytes));
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/gzip"),
    );
    if let Ok(v) = HeaderValue::from_str(&version.sha256) {
        h.insert(api::SHA256_HEADER, v);
    }
    if let Ok(v) = HeaderValue::from_str(&version.version) {
        h.insert(api::VERSION_HEADER, v);
    }
    Ok(response)
}

fn json_body<T>(
    body: std::result::Result<Json<T>, axum::extract::rejection::JsonRejection>,
    shape: &str,
) -> Result<T> {
    body.map(|Json(t)| t)
        .map_err(|e| RegistryError::BadRequest(format!("{} (expected {shape})", e.body_text())))
}

async fn set_tag(
    State(r): State<Shared>,
    headers: HeaderMap,
    Path((owner, name, tag)): Path<(String, String, String)>,
    body: std::result::Result<Json<TagRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<StatusCode> {
    let request = json_body(body, r#"{"version": "1.0.0"}"#)?;
    let user = viewer(&r, &headers).await?;
    r.set_tag(user.as_ref(), &owner, &name, &tag, &request.version)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn fork(
    State(r): State<Shared>,
    headers: HeaderMap,
    Path((owner, name)): Path<(String, String)>,
    body: std::result::Result<Json<ForkRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<(StatusCode, Json<api::PackageInfo>)> {
    let request = json_body(
        body,
        r#"{"name": "new_name", "version": "1.0.0"} (both optional)"#,
    )?;
    let user = viewer(&r, &headers).await?;
    let info = r.fork(user.as_ref(), &owner, &name, &request).await?;
    Ok((StatusCode::CREATED, Json(info)))
}

async fn leaderboard(
    State(r): State<Shared>,
    headers: HeaderMap,
    Path((owner, name, reference)): Path<(String, String, String)>,
) -> Result<Json<api::Leaderboard>> {
    let viewer = viewer(&r, &headers).await?;
    Ok(Json(
        r.leaderboard(viewer.as_ref(), &owner, &name, &reference)
            .await?,
    ))
}

async fn post_result(
    State(r): State<Shared>,
    headers: HeaderMap,
    Path((owner, name, reference)): Path<(String, String, String)>,
    body: std::result::Result<Json<LeaderboardPost>, axum::extract::rejection::JsonRejection>,
) -> Result<StatusCode> {
    let post = json_body(
        body,
        r#"{"model", "score", "ci95": [low, high], "episodes", "harness", "details"}"#,
    )?;
    let user = viewer(&r, &headers).await?;
    r.post_result(user.as_ref(), &owner, &name, &reference, &post)
        .await?;
    Ok(StatusCode::CREATED)
}

/// Re-runs validations a stopped hub left pending; call once at start.
pub async fn resume_validations(registry: Shared) {
    match registry.db.pending_validations().await {
        Ok(ids) => {
            for id in ids {
                tokio::spawn(validate::validate_version(registry.clone(), id));
            }
        }
        Err(e) => tracing::error!(error = %e, "could not list pending validations"),
    }
}

/// Serves `registry` on `listener` until `shutdown` resolves: collects what an
/// interrupted push left, resumes pending validations, then answers requests.
pub async fn serve(
    listener: tokio::net::TcpListener,
    registry: Shared,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    if let Err(e) = registry.collect_garbage().await {
        tracing::error!(error = %e, "garbage collection at start failed");
    }
    resume_validations(registry.clone()).await;
    axum::serve(listener, app(registry))
        .with_graceful_shutdown(shutdown)
        .await
}
