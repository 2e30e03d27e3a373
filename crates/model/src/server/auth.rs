//! API keys: with any configured, every route but `/health` needs
//! `Authorization: Bearer KEY`, checked before the request's body is read.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::ApiError;

/// The environment variable that holds the server's API keys (several,
/// comma-separated) and that clients (the trainer's adapter pushes, `eval --model URL`)
/// send the first of.
pub const API_KEY_ENV: &str = "AGENTSTACK_API_KEY";

/// Routes that answer without a key: a supervisor's readiness probe has none.
const OPEN_PATHS: [&str; 1] = ["/health"];

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

/// The middleware: with keys configured, a request to anything but [`OPEN_PATHS`]
/// without one of them gets 401 before its body is read.
pub(super) async fn require_api_key(
    State(keys): State<Arc<[ApiKey]>>,
    request: Request,
    next: Next,
) -> Response {
    if keys.is_empty() || OPEN_PATHS.contains(&request.uri().path()) {
        return next.run(request).await;
    }
    let message = match bearer(&request) {
        Some(token) if accepts(&keys, token) => return next.run(request).await,
        Some(_) => "the API key is not valid for this server",
        None => "this server needs an API key; send `Authorization: Bearer <key>`",
    };
    tracing::debug!(
        path = request.uri().path(),
        "refused a request without a valid API key"
    );
    let mut response = ApiError::unauthorized(message).into_response();
    response
        .headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    debug_assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    response
}

#[cfg(test)]
mod tests {
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
    }

    #[test]
    fn a_client_sends_the_first_key_of_a_list() {
        let first = |s: &str| ApiKey::first_of_list(s).map(|k| k.expose().to_owned());
        assert_eq!(first("a,b").as_deref(), Some("a"));
        assert_eq!(first(" , b ,c").as_deref(), Some("b"));
        assert_eq!(first(""), None);
        assert_eq!(first(" , "), None);
    }
}
