//! The registry over HTTP: the JSON API (`/api/v1/...`, see [`crate::api`]) and the
//! read-only web pages ([`crate::web`]). [`app`] builds the whole service; errors map
//! to statuses in one table ([`RegistryError::status`]) and internals are logged, not
//! sent. Every response carries the security headers of [`crate::web`] (a
//! Content-Security-Policy and `nosniff`).
//!
//! A push is decided from its request line and headers (token, namespace, version,
//! visibility, Content-Length) before a byte of its body is read, so a refused push
//! costs the hub nothing; an accepted one streams to a staging file, at most
//! [`crate::registry::Limits::max_concurrent_uploads`] at once.

use std::sync::Arc;

use agentstack_static::with_causes;
use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
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
            Self::TimedOut(_) => (StatusCode::REQUEST_TIMEOUT, "timed_out"),
            Self::RateLimited { .. } => (StatusCode::TOO_MANY_REQUESTS, "rate_limited"),
            Self::Busy { .. } => (StatusCode::SERVICE_UNAVAILABLE, "busy"),
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
            // The client is told why (the message does not repeat its cause).
            Self::InvalidPackage(e) => format!("invalid package: {}", with_causes(e)),
            other => other.to_string(),
        };
        if status.is_server_error() {
            tracing::error!(code, "{}", with_causes(&self));
        }
        let retry_after = match &self {
            Self::Busy { retry_after, .. } | Self::RateLimited { retry_after, .. } => {
                Some(retry_after.as_secs_f64().ceil().max(1.0) as u64)
            }
            _ => None,
        };
        let body = ErrorBody {
            error: ErrorDetail {
                code: code.to_owned(),
                message,
            },
        };
        let mut response = (status, Json(body)).into_response();
        if let Some(seconds) = retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
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
            put(push).get(version),
        )
        .route("/envs/{owner}/{name}/versions/{version}/package", get(pull))
        .route("/envs/{owner}/{name}/tags/{tag}", put(set_tag))
        .route("/envs/{owner}/{name}/fork", post(fork))
        .route(
            "/envs/{owner}/{name}/versions/{version}/leaderboard",
            get(leaderboard).post(post_result),
        )
        .route("/tokens", get(tokens))
        .route("/tokens/{id}", delete(revoke_token))
        .fallback(|| async {
            RegistryError::NotFound(
                "no such API route; see the route table in the hub's documentation".into(),
            )
        })
        .layer(DefaultBodyLimit::max(MAX_JSON_BYTES));
    Router::new()
        .nest("/api/v1", api)
        .merge(crate::web::routes())
        .layer(axum::middleware::map_response(crate::web::security_headers))
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
    /// `None`: the package's visibility (public for a new one).
    #[serde(default)]
    private: Option<bool>,
}

async fn push(
    State(r): State<Shared>,
    headers: HeaderMap,
    Path((owner, name, version)): Path<(String, String, String)>,
    Query(params): Query<PushParams>,
    body: Body,
) -> Result<(StatusCode, Json<api::PushResponse>)> {
    // Everything the headers decide is decided before the body is read: an
    // unauthorized or oversized push is answered at once (and hyper closes the
    // connection rather than read a body nobody will use).
    let user = viewer(&r, &headers).await?;
    let target = r
        .authorize_push(user.as_ref(), &owner, &name, &version, params.private)
        .await?;
    let declared = match headers.get(header::CONTENT_LENGTH) {
        Some(v) => Some(
            v.to_str()
                .ok()
                .and_then(|v| v.parse::<u64>().ok())
                .ok_or_else(|| {
                    RegistryError::BadRequest("Content-Length is not a number".into())
                })?,
        ),
        None => None,
    };
    r.check_length(declared)?;
    let permit = r.upload_permit().await?;
    let staged = r.receive(body.into_data_stream()).await?;
    drop(permit);
    let (response, version_id) = r.push_staged(&target, staged).await?;
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

async fn tokens(State(r): State<Shared>, headers: HeaderMap) -> Result<Json<api::TokenList>> {
    Ok(Json(r.tokens(bearer(&headers)?).await?))
}

/// `DELETE /tokens/current` revokes the request's own token; `/tokens/{id}` one of
/// its user's.
async fn revoke_token(
    State(r): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<api::RevokedToken>> {
    let id = match id.as_str() {
        "current" => None,
        other => Some(other.parse::<i64>().map_err(|_| {
            RegistryError::BadRequest(format!(
                "'{other}' is not a token id; `agentstack hub token list` shows them (or use `current`)"
            ))
        })?),
    };
    let id = r.revoke_token(bearer(&headers)?, id).await?;
    tracing::info!(token = id, "token revoked");
    Ok(Json(api::RevokedToken { id }))
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

/// Serves `registry` on `listener` within `connections` until `shutdown` resolves:
/// collects what an interrupted push left, resumes pending validations, then answers
/// requests.
pub async fn serve(
    listener: tokio::net::TcpListener,
    registry: Shared,
    connections: agentstack_serve::Limits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    if let Err(e) = registry.collect_garbage().await {
        tracing::error!(error = %e, "garbage collection at start failed");
    }
    resume_validations(registry.clone()).await;
    agentstack_serve::serve(listener, app(registry), connections, shutdown).await
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use axum::body::Body;
    use axum::http::{Method, Request, StatusCode, header};
    use serde_json::{Value, json};
    use tower::ServiceExt;

    use super::app;
    use crate::auth::Token;
    use crate::blobs::Blobs;
    use crate::db::Db;
    use crate::registry::{Limits, Registry};
    use crate::validate::Validators;

    /// How long a request that must not wait for its body may take.
    const PROMPTLY: Duration = Duration::from_secs(5);

    struct Hub {
        registry: super::Shared,
        _dir: tempfile::TempDir,
    }

    impl Hub {
        async fn new(limits: Limits) -> Self {
            let dir = tempfile::tempdir().unwrap();
            let db = Db::connect(&format!("sqlite://{}", dir.path().join("hub.db").display()))
                .await
                .unwrap();
            let blobs = Blobs::local(&dir.path().join("blobs")).unwrap();
            let registry = Registry::with(db, blobs, limits, Validators::default());
            Self {
                registry: std::sync::Arc::new(registry),
                _dir: dir,
            }
        }

        /// Creates a user; returns their token.
        async fn user(&self, name: &str) -> String {
            let user = self.registry.db.create_user(name).await.unwrap();
            let token = Token::generate();
            self.registry
                .db
                .add_token(user.id, &token.hash(), "test", None)
                .await
                .unwrap();
            token.expose().to_owned()
        }

        async fn send(&self, request: Request<Body>) -> (StatusCode, axum::http::HeaderMap, Value) {
            let response =
                tokio::time::timeout(PROMPTLY, app(self.registry.clone()).oneshot(request))
                    .await
                    .expect("the hub answers promptly")
                    .unwrap();
            let (parts, body) = response.into_parts();
            let bytes = axum::body::to_bytes(body, 1 << 20).await.unwrap();
            let json = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            (parts.status, parts.headers, json)
        }
    }

    fn request(method: Method, uri: &str, token: Option<&str>, body: Body) -> Request<Body> {
        let mut builder = Request::builder().method(method).uri(uri);
        if let Some(token) = token {
            builder = builder.header(header::AUTHORIZATION, format!("Bearer {token}"));
        }
        builder.body(body).unwrap()
    }

    /// A packed package `name@version` with a reward range of [0, 1].
    fn packed(name: &str, version: &str) -> Vec<u8> {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("openenv.yaml"),
            format!("name: {name}\nversion: {version}\nagentstack:\n  reward_range: [0, 1]\n"),
        )
        .unwrap();
        std::fs::write(dir.path().join("README.md"), "# hi\n").unwrap();
        crate::package::pack(dir.path()).unwrap().bytes
    }

    /// A body that never ends, and records whether anything polled it.
    fn watched_body() -> (Body, std::sync::Arc<AtomicBool>) {
        let polled = std::sync::Arc::new(AtomicBool::new(false));
        let flag = polled.clone();
        let stream = futures_util::stream::poll_fn(move |_| {
            flag.store(true, Ordering::SeqCst);
            std::task::Poll::<Option<Result<bytes::Bytes, std::io::Error>>>::Pending
        });
        (Body::from_stream(stream), polled)
    }

    async fn push(
        hub: &Hub,
        token: Option<&str>,
        path: &str,
        body: Vec<u8>,
    ) -> (StatusCode, Value) {
        let uri = format!("/api/v1/envs/{path}");
        let (status, _, json) = hub
            .send(request(Method::PUT, &uri, token, Body::from(body)))
            .await;
        (status, json)
    }

    #[tokio::test]
    async fn a_refused_push_is_answered_before_its_body_is_read() {
        let hub = Hub::new(Limits {
            max_package_bytes: 1 << 20,
            ..Limits::default()
        })
        .await;
        let alice = hub.user("alice").await;
        let bob = hub.user("bob").await;
        let (status, _) = push(
            &hub,
            Some(&alice),
            "alice/pub/versions/1.0.0",
            packed("pub", "1.0.0"),
        )
        .await;
        assert_eq!(status, StatusCode::CREATED);
        let cases = [
            (
                None,
                "alice/x/versions/1.0.0",
                None,
                StatusCode::UNAUTHORIZED,
                "needs a token",
            ),
            (
                Some("ash_00"),
                "alice/x/versions/1.0.0",
                None,
                StatusCode::UNAUTHORIZED,
                "not valid",
            ),
            (
                Some(bob.as_str()),
                "alice/x/versions/1.0.0",
                None,
                StatusCode::FORBIDDEN,
                "only alice",
            ),
            (
                Some(alice.as_str()),
                "alice/x/versions/one",
                None,
                StatusCode::BAD_REQUEST,
                "semantic",
            ),
            (
                Some(alice.as_str()),
                "alice/pub/versions/1.0.0",
                None,
                StatusCode::CONFLICT,
                "immutable",
            ),
            (
                Some(alice.as_str()),
                "alice/pub/versions/2.0.0?private=true",
                None,
                StatusCode::CONFLICT,
                "is public",
            ),
            (
                Some(alice.as_str()),
                "alice/x/versions/1.0.0",
                Some("209715200"),
                StatusCode::PAYLOAD_TOO_LARGE,
                "1048576 bytes",
            ),
        ];
        for (token, path, length, expected, says) in cases {
            let (body, polled) = watched_body();
            let mut request = request(Method::PUT, &format!("/api/v1/envs/{path}"), token, body);
            if let Some(length) = length {
                request
                    .headers_mut()
                    .insert(header::CONTENT_LENGTH, length.parse().unwrap());
            }
            let (status, _, json) = hub.send(request).await;
            assert_eq!(status, expected, "{path}: {json}");
            let message = json["error"]["message"].as_str().unwrap();
            assert!(message.contains(says), "{path}: {message}");
            assert!(!polled.load(Ordering::SeqCst), "{path}: the body was read");
        }
    }

    #[tokio::test]
    async fn a_body_over_the_size_cap_is_refused_while_it_streams() {
        let hub = Hub::new(Limits {
            max_package_bytes: 64 << 10,
            ..Limits::default()
        })
        .await;
        let alice = hub.user("alice").await;
        // 16 KiB chunks, then a body that never ends: the 413 comes once the cap is
        // passed, without waiting for the rest.
        let chunks = futures_util::stream::iter(
            (0..5).map(|_| Ok::<_, std::io::Error>(bytes::Bytes::from(vec![0u8; 16 << 10]))),
        );
        let body = Body::from_stream(futures_util::StreamExt::chain(
            chunks,
            futures_util::stream::pending(),
        ));
        let (status, _, json) = hub
            .send(request(
                Method::PUT,
                "/api/v1/envs/alice/big/versions/1.0.0",
                Some(&alice),
                body,
            ))
            .await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{json}");
        assert!(
            std::fs::read_dir(hub.registry.blobs.staging_dir())
                .unwrap()
                .next()
                .is_none()
        );
    }

    #[tokio::test]
    async fn uploads_over_the_cap_wait_briefly_then_get_503_with_retry_after() {
        let hub = Hub::new(Limits {
            max_concurrent_uploads: 1,
            upload_wait: Duration::from_millis(200),
            ..Limits::default()
        })
        .await;
        let alice = hub.user("alice").await;
        // The first upload holds the only turn until its body ends.
        let (tx, mut rx) =
            tokio::sync::mpsc::unbounded_channel::<Result<bytes::Bytes, std::io::Error>>();
        let first = {
            let app = app(hub.registry.clone());
            let request = request(
                Method::PUT,
                "/api/v1/envs/alice/one/versions/1.0.0",
                Some(&alice),
                Body::from_stream(futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))),
            );
            tokio::spawn(app.oneshot(request))
        };
        tx.send(Ok(packed("one", "1.0.0").into())).unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (status, headers, json) = hub
            .send(request(
                Method::PUT,
                "/api/v1/envs/alice/two/versions/1.0.0",
                Some(&alice),
                Body::from(packed("two", "1.0.0")),
            ))
            .await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{json}");
        assert_eq!(json["error"]["code"], "busy");
        assert_eq!(headers[header::RETRY_AFTER], "1");
        drop(tx);
        assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::CREATED);
        let (status, json) = push(
            &hub,
            Some(&alice),
            "alice/two/versions/1.0.0",
            packed("two", "1.0.0"),
        )
        .await;
        assert_eq!(status, StatusCode::CREATED, "{json}");
    }

    #[tokio::test]
    async fn pushes_never_change_a_packages_visibility() {
        let hub = Hub::new(Limits::default()).await;
        let alice = hub.user("alice").await;
        let (status, json) = push(
            &hub,
            Some(&alice),
            "alice/open/versions/1.0.0",
            packed("open", "1.0.0"),
        )
        .await;
        assert_eq!(
            (status, json["private"].clone()),
            (StatusCode::CREATED, json!(false))
        );
        // --private on a public package: refused, saying how to proceed.
        let (status, json) = push(
            &hub,
            Some(&alice),
            "alice/open/versions/1.1.0?private=true",
            packed("open", "1.1.0"),
        )
        .await;
        assert_eq!(status, StatusCode::CONFLICT);
        let message = json["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("alice/open is public") && message.contains("hint:"),
            "{message}"
        );
        // A private package stays private when pushed to without `private`, and an
        // explicit `private=false` is refused.
        let (status, _) = push(
            &hub,
            Some(&alice),
            "alice/closed/versions/1.0.0?private=true",
            packed("closed", "1.0.0"),
        )
        .await;
        assert_eq!(status, StatusCode::CREATED);
        let (status, json) = push(
            &hub,
            Some(&alice),
            "alice/closed/versions/1.1.0",
            packed("closed", "1.1.0"),
        )
        .await;
        assert_eq!(
            (status, json["private"].clone()),
            (StatusCode::CREATED, json!(true))
        );
        let (status, json) = push(
            &hub,
            Some(&alice),
            "alice/closed/versions/1.2.0?private=false",
            packed("closed", "1.2.0"),
        )
        .await;
        assert_eq!(status, StatusCode::CONFLICT);
        assert!(
            json["error"]["message"]
                .as_str()
                .unwrap()
                .contains("is private")
        );
        for version in ["1.0.0", "1.1.0"] {
            let uri = format!("/api/v1/envs/alice/closed/versions/{version}");
            let (status, _, _) = hub
                .send(request(Method::GET, &uri, None, Body::empty()))
                .await;
            assert_eq!(status, StatusCode::NOT_FOUND, "{version} is visible");
        }
    }

    async fn post(
        hub: &Hub,
        token: &str,
        body: Value,
    ) -> (StatusCode, axum::http::HeaderMap, Value) {
        let mut request = request(
            Method::POST,
            "/api/v1/envs/alice/board/versions/1.0.0/leaderboard",
            Some(token),
            Body::from(body.to_string()),
        );
        request
            .headers_mut()
            .insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
        hub.send(request).await
    }

    #[tokio::test]
    async fn leaderboard_posts_are_checked_against_the_reward_range_and_for_control_characters() {
        let hub = Hub::new(Limits::default()).await;
        let alice = hub.user("alice").await;
        push(
            &hub,
            Some(&alice),
            "alice/board/versions/1.0.0",
            packed("board", "1.0.0"),
        )
        .await;
        let ok =
            json!({"model": "m", "score": 0.5, "ci95": [0.4, 0.6], "episodes": 3, "harness": "h"});
        assert_eq!(post(&hub, &alice, ok.clone()).await.0, StatusCode::CREATED);
        let mut cases = Vec::new();
        for (key, value, says) in [
            ("score", json!(7.5), "reward_range [0, 1]"),
            ("ci95", json!([-2.0, 0.6]), "reward_range [0, 1]"),
            ("model", json!("x\u{1b}]0;owned\u{7}"), "U+001B"),
            ("harness", json!("h\u{202e}"), "U+202E"),
            ("details", json!({"note": "a\u{85}b"}), "details.note"),
        ] {
            let mut body = ok.clone();
            if key == "score" {
                body["ci95"] = json!([0.0, 10.0]);
            }
            body[key] = value;
            cases.push((body, says));
        }
        for (body, says) in cases {
            let (status, _, json) = post(&hub, &alice, body.clone()).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {json}");
            let message = json["error"]["message"].as_str().unwrap();
            assert!(message.contains(says), "{message}");
        }
    }

    #[tokio::test]
    async fn leaderboard_posts_are_rate_limited_per_user() {
        let hub = Hub::new(Limits {
            posts_per_minute: 2,
            ..Limits::default()
        })
        .await;
        let alice = hub.user("alice").await;
        let bob = hub.user("bob").await;
        push(
            &hub,
            Some(&alice),
            "alice/board/versions/1.0.0",
            packed("board", "1.0.0"),
        )
        .await;
        let body =
            json!({"model": "m", "score": 0.5, "ci95": [0.4, 0.6], "episodes": 3, "harness": "h"});
        for _ in 0..2 {
            assert_eq!(
                post(&hub, &alice, body.clone()).await.0,
                StatusCode::CREATED
            );
        }
        let (status, headers, json) = post(&hub, &alice, body.clone()).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{json}");
        let retry: u64 = headers[header::RETRY_AFTER]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!((1..=30).contains(&retry), "{retry}");
        // Another user has a bucket of their own.
        assert_eq!(post(&hub, &bob, body).await.0, StatusCode::CREATED);
    }

    #[tokio::test]
    async fn expired_and_revoked_tokens_are_refused_saying_which() {
        let hub = Hub::new(Limits::default()).await;
        let alice = hub.user("alice").await;
        let bob = hub.user("bob").await;
        let db = &hub.registry.db;
        let user = db.user("alice").await.unwrap().unwrap();
        let old = Token::generate();
        db.add_token(user.id, &old.hash(), "old", Some(crate::db::now() - 1))
            .await
            .unwrap();
        let whoami =
            |token: String| request(Method::GET, "/api/v1/whoami", Some(&token), Body::empty());
        let (status, _, json) = hub.send(whoami(old.expose().to_owned())).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        assert!(
            json["error"]["message"]
                .as_str()
                .unwrap()
                .starts_with("token expired"),
            "{json}"
        );
        // A second token of alice's, listed and then revoked by the first.
        let spare = Token::generate();
        let spare_id = db
            .add_token(user.id, &spare.hash(), "spare", None)
            .await
            .unwrap();
        let (_, _, list) = hub
            .send(request(
                Method::GET,
                "/api/v1/tokens",
                Some(&alice),
                Body::empty(),
            ))
            .await;
        let labels: Vec<&str> = list["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["label"].as_str().unwrap())
            .collect();
        assert_eq!(labels, ["test", "old", "spare"]);
        assert_eq!(list["tokens"][0]["current"], true);
        // Bob cannot revoke alice's tokens.
        let uri = format!("/api/v1/tokens/{spare_id}");
        let (status, _, _) = hub
            .send(request(Method::DELETE, &uri, Some(&bob), Body::empty()))
            .await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        let (status, _, json) = hub
            .send(request(Method::DELETE, &uri, Some(&alice), Body::empty()))
            .await;
        assert_eq!(
            (status, json["id"].as_i64()),
            (StatusCode::OK, Some(spare_id))
        );
        let (status, _, json) = hub.send(whoami(spare.expose().to_owned())).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        assert!(
            json["error"]["message"]
                .as_str()
                .unwrap()
                .contains("revoked"),
            "{json}"
        );
        // A token revokes itself.
        let (status, _, _) = hub
            .send(request(
                Method::DELETE,
                "/api/v1/tokens/current",
                Some(&alice),
                Body::empty(),
            ))
            .await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(hub.send(whoami(alice)).await.0, StatusCode::UNAUTHORIZED);
        assert_eq!(hub.send(whoami(bob)).await.0, StatusCode::OK);
    }

    #[tokio::test]
    async fn every_response_carries_the_security_headers() {
        let hub = Hub::new(Limits::default()).await;
        for uri in ["/", "/alice/nothing", "/api/v1/health", "/api/v1/nowhere"] {
            let (_, headers, _) = hub
                .send(request(Method::GET, uri, None, Body::empty()))
                .await;
            let csp = headers[header::CONTENT_SECURITY_POLICY].to_str().unwrap();
            assert!(
                csp.contains("default-src 'none'") && !csp.contains("script-src"),
                "{uri}: {csp}"
            );
            assert_eq!(headers[header::X_CONTENT_TYPE_OPTIONS], "nosniff", "{uri}");
        }
    }
}

#[cfg(test)]
mod connection_tests {
    use std::time::Duration;

    use crate::blobs::Blobs;
    use crate::db::Db;
    use crate::registry::{Limits, Registry};
    use crate::validate::Validators;

    /// Regression (issue 19): a connection that never finished its request head was held
    /// open forever; now [`super::serve`] closes it after the header-read timeout.
    #[tokio::test]
    async fn a_slow_request_head_is_closed_after_the_header_timeout() {
        const HEADER_TIMEOUT: Duration = Duration::from_millis(300);
        const GIVE_UP: Duration = Duration::from_secs(5);
        let dir = tempfile::tempdir().unwrap();
        let db = Db::connect(&format!("sqlite://{}", dir.path().join("hub.db").display()))
            .await
            .unwrap();
        let blobs = Blobs::local(&dir.path().join("blobs")).unwrap();
        let registry = Registry::with(db, blobs, Limits::default(), Validators::default());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let connections = agentstack_serve::Limits {
            header_read_timeout: HEADER_TIMEOUT,
            ..agentstack_serve::Limits::default()
        };
        let server = tokio::spawn(super::serve(
            listener,
            std::sync::Arc::new(registry),
            connections,
            std::future::pending(),
        ));
        for partial in [
            &b"PUT /api/v1/envs/a/b/versions/1.0.0 HTTP/1.1\r\nhost: sl"[..],
            b"",
        ] {
            let closed = agentstack_serve::probe::time_to_close(address, partial, GIVE_UP)
                .await
                .unwrap();
            assert!(closed.is_some(), "held open after {partial:?}");
        }
        server.abort();
    }
}
