//! API keys for the servers that change state or read files: with keys configured,
//! every route but `/health` needs `Authorization: Bearer KEY`, checked before the
//! request's body is read and before a WebSocket is accepted.
//!
//! One [`KeyGuard`] per server holds its keys and how it words a refusal (the model
//! server answers in OpenAI's error shape, the environment server in OpenEnv's); the
//! check itself is the same everywhere.
//!
//! ```
//! use agentstack_serve::auth::{ApiKey, KeyGuard, Refusal};
//! use axum::response::{IntoResponse, Response};
//! use axum::{Router, routing::get};
//!
//! fn refuse(refusal: Refusal) -> Response {
//!     (refusal.status(), refusal.message()).into_response()
//! }
//!
//! let keys = vec![ApiKey::new("s3cret").unwrap()];
//! let app = Router::new()
//!     .route("/health", get(|| async { "ok" }))
//!     .route("/work", get(|| async { "done" }));
//! let app = KeyGuard::new(keys, refuse).wrap(app);
//! # let _: Router = app;
//! ```

use std::sync::Arc;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::Response;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// The environment variable that holds a server's API keys (several, comma-separated)
/// and that clients send the first of.
pub const API_KEY_ENV: &str = agentstack_static::env_vars::AGENTSTACK_API_KEY;

/// The route that answers without a key: a supervisor's readiness probe has none.
pub const HEALTH_PATH: &str = "/health";

/// A secret API key. Its `Debug` output is redacted, it has no `Display`, and it is
/// compared in constant time (through its SHA-256 digest, so that the time does not
/// depend on the length of the key either).
#[derive(Clone)]
pub struct ApiKey {
    secret: String,
    digest: [u8; 32],
}

/// An API key was empty.
#[derive(Debug, thiserror::Error)]
#[error("an API key must not be empty")]
pub struct EmptyApiKey;

impl ApiKey {
    /// A key; refuses an empty one.
    pub fn new(secret: impl Into<String>) -> Result<Self, EmptyApiKey> {
        let secret = secret.into();
        if secret.is_empty() {
            return Err(EmptyApiKey);
        }
        let digest = Sha256::digest(secret.as_bytes()).into();
        Ok(Self { secret, digest })
    }

    /// The first key of a comma-separated list (the form [`API_KEY_ENV`] takes), for a
    /// client to send; `None` when there is none.
    pub fn first_of_list(list: &str) -> Option<Self> {
        list.split(',')
            .map(str::trim)
            .find(|k| !k.is_empty())
            .and_then(|k| Self::new(k).ok())
    }

    /// The key itself, to put in a request header. Keep it out of logs.
    pub fn expose(&self) -> &str {
        &self.secret
    }

    /// Whether `presented` is this key, in time independent of where they differ.
    fn matches(&self, presented_digest: &[u8; 32]) -> bool {
        self.digest.ct_eq(presented_digest).into()
    }
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

impl std::str::FromStr for ApiKey {
    type Err = EmptyApiKey;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s.trim())
    }
}

/// Whether any of `keys` is `presented`; every key is compared, so the time does not
/// say which one matched.
fn accepts(keys: &[ApiKey], presented: &str) -> bool {
    let digest: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
    keys.iter()
        .fold(false, |found, key| key.matches(&digest) | found)
}

/// The token of an `Authorization: Bearer <token>` header (the scheme in any case).
fn bearer(request: &Request) -> Option<&str> {
    let value = request
        .headers()
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?;
    let (scheme, token) = value.trim().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// It bore no `Authorization: Bearer` key.
    Missing,
    /// It bore a key that is not one of the server's.
    Invalid,
}

impl Refusal {
    /// The status of a refusal: 401.
    pub fn status(self) -> StatusCode {
        StatusCode::UNAUTHORIZED
    }

    /// What to tell the client.
    pub fn message(self) -> &'static str {
        match self {
            Refusal::Missing => "this server needs an API key; send `Authorization: Bearer <key>`",
            Refusal::Invalid => "the API key is not valid for this server",
        }
    }
}

/// A server's keys and how it answers a request without one of them.
#[derive(Clone)]
pub struct KeyGuard {
    keys: Arc<[ApiKey]>,
    open: Arc<[String]>,
    refuse: fn(Refusal) -> Response,
}

impl std::fmt::Debug for KeyGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyGuard")
            .field("keys", &self.keys.len())
            .field("open", &self.open)
            .finish_non_exhaustive()
    }
}

impl KeyGuard {
    /// A guard asking for one of `keys` on every route but [`HEALTH_PATH`]; `refuse`
    /// writes the 401 answer (the guard adds `WWW-Authenticate: Bearer`). No keys: no
    /// key is asked for.
    pub fn new(keys: impl Into<Arc<[ApiKey]>>, refuse: fn(Refusal) -> Response) -> Self {
        Self {
            keys: keys.into(),
            open: Arc::new([HEALTH_PATH.to_owned()]),
            refuse,
        }
    }

    /// Also answers `path` (exactly) without a key, e.g. the `/health` of an
    /// environment served under a prefix.
    pub fn open_path(mut self, path: impl Into<String>) -> Self {
        let mut open = self.open.to_vec();
        open.push(path.into());
        self.open = open.into();
        self
    }

    /// Whether any key is asked for.
    pub fn is_active(&self) -> bool {
        !self.keys.is_empty()
    }

    /// `router` behind the guard: every route and the fallback, as the outermost layer,
    /// so nothing (a body extractor, a WebSocket upgrade, a proxy) runs before the key
    /// is checked. Without keys, `router` unchanged.
    pub fn wrap<S: Clone + Send + Sync + 'static>(self, router: Router<S>) -> Router<S> {
        if !self.is_active() {
            return router;
        }
        router.layer(axum::middleware::from_fn_with_state(self, require_api_key))
    }

    /// The key check of one request: `Ok` to serve it, or the refusal.
    fn check(&self, request: &Request) -> Result<(), Refusal> {
        if !self.is_active() || self.open.iter().any(|p| p == request.uri().path()) {
            return Ok(());
        }
        match bearer(request) {
            Some(token) if accepts(&self.keys, token) => Ok(()),
            Some(_) => Err(Refusal::Invalid),
            None => Err(Refusal::Missing),
        }
    }
}

/// The middleware: a request to a guarded route without one of the keys gets 401
/// before its body is read. An accepted key is taken off the request, so that no
/// handler, nor an upstream a proxy forwards to, sees it.
async fn require_api_key(
    State(guard): State<KeyGuard>,
    mut request: Request,
    next: Next,
) -> Response {
    match guard.check(&request) {
        Ok(()) => {
            if guard.is_active() {
                request.headers_mut().remove(header::AUTHORIZATION);
            }
            next.run(request).await
        }
        Err(refusal) => {
            tracing::debug!(
                path = request.uri().path(),
                ?refusal,
                "refused a request without a valid API key"
            );
            let mut response = (guard.refuse)(refusal);
            *response.status_mut() = refusal.status();
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            response
        }
    }
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use axum::http::HeaderMap;
    use axum::response::IntoResponse;
    use axum::routing::any;
    use tower::ServiceExt;

    use super::*;

    #[test]
    fn keys_are_redacted_and_compared_whole() {
        let key = ApiKey::new("s3cret-value").unwrap();
        assert_eq!(format!("{key:?}"), "ApiKey(<redacted>)");
        assert!(!format!("{:?}", vec![key.clone()]).contains("s3cret"));
        let keys = [ApiKey::new("other").unwrap(), key];
        assert!(accepts(&keys, "s3cret-value"));
        assert!(accepts(&keys, "other"));
        assert!(!accepts(&keys, "s3cret-valu"));
        assert!(!accepts(&keys, "s3cret-value "));
        assert!(!accepts(&keys, ""));
        assert!(ApiKey::new("").is_err());
        assert!("  ".parse::<ApiKey>().is_err());
        let guard = KeyGuard::new(keys.to_vec(), |r| r.message().into_response());
        assert!(!format!("{guard:?}").contains("s3cret"), "{guard:?}");
    }

    #[test]
    fn a_client_sends_the_first_key_of_a_list() {
        let first = |s: &str| ApiKey::first_of_list(s).map(|k| k.expose().to_owned());
        assert_eq!(first("a,b").as_deref(), Some("a"));
        assert_eq!(first(" , b ,c").as_deref(), Some("b"));
        assert_eq!(first(""), None);
        assert_eq!(first(" , "), None);
    }

    /// A refusal in a made-up style, to see that the server's own words are used.
    fn refuse(refusal: Refusal) -> Response {
        (StatusCode::IM_A_TEAPOT, format!("refused: {refusal:?}")).into_response()
    }

    /// A router that answers what `Authorization` header its handlers saw.
    fn app(keys: &[&str]) -> Router {
        let seen = |headers: HeaderMap| async move {
            format!("authorization={:?}", headers.get(header::AUTHORIZATION))
        };
        let router = Router::new()
            .route("/health", any(|| async { "ok" }))
            .route("/named/health", any(|| async { "ok" }))
            .route("/work", any(seen));
        let keys: Vec<ApiKey> = keys.iter().map(|k| ApiKey::new(*k).unwrap()).collect();
        KeyGuard::new(keys, refuse)
            .open_path("/named/health")
            .wrap(router)
    }

    async fn send(app: &Router, path: &str, key: Option<&str>) -> (StatusCode, HeaderMap, String) {
        let mut request = axum::http::Request::post(path);
        if let Some(key) = key {
            request = request.header(header::AUTHORIZATION, key);
        }
        let response = app
            .clone()
            .oneshot(request.body(Body::empty()).unwrap())
            .await
            .unwrap();
        let (parts, body) = response.into_parts();
        let body = axum::body::to_bytes(body, 1 << 20).await.unwrap();
        (
            parts.status,
            parts.headers,
            String::from_utf8_lossy(&body).into_owned(),
        )
    }

    #[tokio::test]
    async fn the_guard_refuses_in_the_servers_words_and_hides_the_key() {
        let app = app(&["k1", "k2"]);
        for (key, refusal) in [
            (None, "Missing"),
            (Some("Bearer nope"), "Invalid"),
            (Some("Basic k1"), "Missing"),
            (Some("Bearer "), "Missing"),
        ] {
            let (status, headers, body) = send(&app, "/work", key).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{key:?}: {body}");
            assert_eq!(headers[header::WWW_AUTHENTICATE], "Bearer");
            assert_eq!(body, format!("refused: {refusal}"));
        }
        let (status, _, body) = send(&app, "/no/such/route", None).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
        for open in ["/health", "/named/health"] {
            let (status, _, body) = send(&app, open, None).await;
            assert_eq!((status, body.as_str()), (StatusCode::OK, "ok"), "{open}");
        }
        for key in ["Bearer k1", "bearer k2", "BEARER  k1 "] {
            let (status, _, body) = send(&app, "/work", Some(key)).await;
            assert_eq!(status, StatusCode::OK, "{key}: {body}");
            assert_eq!(body, "authorization=None", "the handler saw the key");
        }
    }

    #[tokio::test]
    async fn without_keys_nothing_is_asked_or_taken() {
        let app = app(&[]);
        let (status, _, body) = send(&app, "/work", None).await;
        assert_eq!(
            (status, body.as_str()),
            (StatusCode::OK, "authorization=None")
        );
        let (_, _, body) = send(&app, "/work", Some("Bearer theirs")).await;
        assert_eq!(body, "authorization=Some(\"Bearer theirs\")");
    }
}
