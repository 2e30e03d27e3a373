//! The hub's client and its local cache: push a directory, pull (checked against the
//! registry's sha256 and the package's manifest) into a cache that is checked again
//! before every reuse.

use std::path::{Path, PathBuf};
use std::time::Duration;

use reqwest::StatusCode;
use serde::de::DeserializeOwned;

use crate::api::{self, ErrorBody, PackageRef};
use crate::auth::Token;
use crate::blobs::sha256_hex;
use crate::package::{self, PackageError};

/// What can go wrong talking to a hub.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The hub could not be reached.
    #[error(
        "could not reach the hub at {url}\nhint: is `agentstack hub serve` running there? (set the URL with --hub or AGENTSTACK_HUB_URL)"
    )]
    Unreachable {
        /// The URL.
        url: String,
        /// Why.
        #[source]
        source: reqwest::Error,
    },
    /// The hub answered with an error.
    #[error("the hub refused ({status}): {message}")]
    Api {
        /// HTTP status.
        status: u16,
        /// The error code.
        code: String,
        /// Its message.
        message: String,
    },
    /// The downloaded bytes are not what the hub said.
    #[error("the download of {package} is corrupt: sha256 {actual}, the hub says {expected}")]
    Integrity {
        /// The package.
        package: String,
        /// The hub's hash.
        expected: String,
        /// The bytes' hash.
        actual: String,
    },
    /// A package could not be packed or unpacked.
    #[error(transparent)]
    Package(#[from] PackageError),
    /// Reading or writing the cache failed.
    #[error("cannot read or write {path}")]
    Io {
        /// The path.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Bad input.
    #[error("{0}")]
    Invalid(String),
}

impl ClientError {
    /// The HTTP status, when the hub answered with an error.
    pub fn status(&self) -> Option<u16> {
        match self {
            Self::Api { status, .. } => Some(*status),
            _ => None,
        }
    }
}

type Result<T> = std::result::Result<T, ClientError>;

/// A hub client.
#[derive(Clone)]
pub struct HubClient {
    base: String,
    token: Option<Token>,
    http: reqwest::Client,
}

/// A pulled package in the cache.
#[derive(Debug, Clone)]
pub struct Pulled {
    /// `owner/name`.
    pub package: String,
    /// The resolved version.
    pub version: String,
    /// sha256 of the packed bytes.
    pub sha256: String,
    /// The unpacked directory.
    pub dir: PathBuf,
    /// Whether it came from the cache without a download.
    pub cached: bool,
}

impl HubClient {
    /// A client for the hub at `base_url`, sending `token` when given.
    pub fn new(base_url: &str, token: Option<Token>) -> Result<Self> {
        let base = base_url.trim_end_matches('/').to_owned();
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(ClientError::Invalid(format!(
                "'{base_url}' is not an http:// or https:// URL"
            )));
        }
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .timeout(Duration::from_secs(600))
            .build()
            .map_err(|source| ClientError::Unreachable {
                url: base.clone(),
                source,
            })?;
        Ok(Self { base, token, http })
    }

    /// The hub's URL.
    pub fn url(&self) -> &str {
        &self.base
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let mut request = self
            .http
            .request(method, format!("{}/api/v1{path}", self.base));
        if let Some(token) = &self.token {
            request = request.bearer_auth(token.expose());
        }
        request
    }

    async fn send(&self, request: reqwest::RequestBuilder) -> Result<reqwest::Response> {
        let response = request
            .send()
            .await
            .map_err(|source| ClientError::Unreachable {
                url: self.base.clone(),
                source,
            })?;
        if response.status().is_success() {
            return Ok(response);
        }
        let status = response.status();
        let text = response.text().await.unwrap_or_default();
        let (code, message) = match serde_json::from_str::<ErrorBody>(&text) {
            Ok(body) => (body.error.code, body.error.message),
            Err(_) => ("http".into(), text.chars().take(500).collect()),
        };
        Err(ClientError::Api {
            status: status.as_u16(),
            code,
            message,
        })
    }

    async fn json<T: DeserializeOwned>(&self, request: reqwest::RequestBuilder) -> Result<T> {
        let response = self.send(request).await?;
        response
            .json()
            .await
            .map_err(|source| ClientError::Unreachable {
                url: self.base.clone(),
                source,
            })
    }

    /// Who the token belongs to.
    pub async fn whoami(&self) -> Result<String> {
        let me: api::WhoAmI = self
            .json(self.request(reqwest::Method::GET, "/whoami"))
            .await?;
        Ok(me.user)
    }

    /// The token's user's tokens.
    pub async fn tokens(&self) -> Result<api::TokenList> {
        self.json(self.request(reqwest::Method::GET, "/tokens"))
            .await
    }

    /// Revokes one of the token's user's tokens: `id`, or this client's own token
    /// when `None`. Returns the revoked token's id.
    pub async fn revoke_token(&self, id: Option<i64>) -> Result<i64> {
        let path = match id {
            Some(id) => format!("/tokens/{id}"),
            None => "/tokens/current".to_owned(),
        };
        let revoked: api::RevokedToken = self
            .json(self.request(reqwest::Method::DELETE, &path))
            .await?;
        Ok(revoked.id)
    }

    /// Pushes packed bytes as `owner/name@version` (`private`: create it private;
    /// an existing package keeps its visibility, and `private` on a public one is
    /// refused).
    pub async fn push_bytes(
        &self,
        owner: &str,
        name: &str,
        version: &str,
        private: bool,
        bytes: Vec<u8>,
    ) -> Result<api::PushResponse> {
        let path = format!("/envs/{owner}/{name}/versions/{version}");
        let mut request = self
            .request(reqwest::Method::PUT, &path)
            .header(reqwest::header::CONTENT_TYPE, "application/gzip")
            .body(bytes);
        // Without `private` the hub keeps an existing package's visibility.
        if private {
            request = request.query(&[("private", true)]);
        }
        self.json(request).await
    }

    /// Packs `dir` and pushes it as `owner/name@version` (name and version default to
    /// `openenv.yaml`'s).
    pub async fn push_dir(
        &self,
        dir: &Path,
        owner: &str,
        name: Option<&str>,
        version: Option<&str>,
        private: bool,
    ) -> Result<api::PushResponse> {
        let dir = dir.to_owned();
        let packed = tokio::task::spawn_blocking(move || package::pack(&dir))
            .await
            .map_err(|e| ClientError::Invalid(e.to_string()))??;
        let name = match name {
            Some(n) => n.to_owned(),
            None => api::normalize_name(&packed.spec.name).ok_or_else(|| {
                ClientError::Invalid(format!(
                    "openenv.yaml's name '{}' cannot be a package name; pass --name",
                    packed.spec.name
                ))
            })?,
        };
        let version = version
            .map(str::to_owned)
            .or_else(|| packed.spec.version.clone())
            .ok_or_else(|| {
                ClientError::Invalid(
                    "no version: add `version: 1.0.0` to openenv.yaml or pass --version".into(),
                )
            })?;
        self.push_bytes(owner, &name, &version, private, packed.bytes)
            .await
    }

    /// A package's page data.
    pub async fn info(&self, owner: &str, name: &str) -> Result<api::PackageInfo> {
        self.json(self.request(reqwest::Method::GET, &format!("/envs/{owner}/{name}")))
            .await
    }

    /// Searches.
    pub async fn search(&self, query: &api::SearchQuery) -> Result<Vec<api::SearchHit>> {
        let response: api::SearchResponse = self
            .json(self.request(reqwest::Method::GET, "/envs").query(query))
            .await?;
        Ok(response.results)
    }

    /// Forks into the token's namespace.
    pub async fn fork(&self, source: &PackageRef, name: Option<&str>) -> Result<api::PackageInfo> {
        let body = api::ForkRequest {
            name: name.map(str::to_owned),
            version: source.reference.clone(),
        };
        let path = format!("/envs/{}/{}/fork", source.owner, source.name);
        self.json(self.request(reqwest::Method::POST, &path).json(&body))
            .await
    }

    /// Points a tag at a version.
    pub async fn set_tag(&self, owner: &str, name: &str, tag: &str, version: &str) -> Result<()> {
        let path = format!("/envs/{owner}/{name}/tags/{tag}");
        let body = api::TagRequest {
            version: version.to_owned(),
        };
        self.send(self.request(reqwest::Method::PUT, &path).json(&body))
            .await?;
        Ok(())
    }

    /// A version's leaderboard.
    pub async fn leaderboard(&self, package: &PackageRef) -> Result<api::Leaderboard> {
        let path = format!(
            "/envs/{}/{}/versions/{}/leaderboard",
            package.owner,
            package.name,
            package.reference()
        );
        self.json(self.request(reqwest::Method::GET, &path)).await
    }

    /// Posts a result to a version's leaderboard.
    pub async fn post_result(
        &self,
        package: &PackageRef,
        post: &api::LeaderboardPost,
    ) -> Result<()> {
        post.check().map_err(ClientError::Invalid)?;
        let path = format!(
            "/envs/{}/{}/versions/{}/leaderboard",
            package.owner,
            package.name,
            package.reference()
        );
        self.send(self.request(reqwest::Method::POST, &path).json(post))
            .await?;
        Ok(())
    }

    /// Downloads a version's bytes and checks them against the hub's sha256.
    pub async fn download(&self, package: &PackageRef) -> Result<(String, String, Vec<u8>)> {
        let path = format!(
            "/envs/{}/{}/versions/{}/package",
            package.owner,
            package.name,
            package.reference()
        );
        let response = self.send(self.request(reqwest::Method::GET, &path)).await?;
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let expected = header(api::SHA256_HEADER).unwrap_or_default();
        let version = header(api::VERSION_HEADER).unwrap_or_else(|| package.reference().to_owned());
        let bytes = response
            .bytes()
            .await
            .map_err(|source| ClientError::Unreachable {
                url: self.base.clone(),
                source,
            })?;
        let actual = sha256_hex(&bytes);
        if actual != expected {
            return Err(ClientError::Integrity {
                package: package.to_string(),
                expected,
                actual,
            });
        }
        Ok((version, actual, bytes.to_vec()))
    }

    /// Pulls `package` into `cache` (`cache/<owner>/<name>/<version>`), reusing a
    /// cached copy of a fixed version when every file still matches its manifest.
    /// Tags (`latest`) are always resolved by the hub.
    pub async fn pull(&self, package: &PackageRef, cache: &Path) -> Result<Pulled> {
        let full = format!("{}/{}", package.owner, package.name);
        let reference = package.reference();
        let base = cache.join(&package.owner).join(&package.name);
        if semver::Version::parse(reference).is_ok() {
            let dir = base.join(reference);
            if let Some(sha256) = cached(&dir) {
                return Ok(Pulled {
                    package: full,
                    version: reference.to_owned(),
                    sha256,
                    dir,
                    cached: true,
                });
            }
        }
        let (version, sha256, bytes) = self.download(package).await?;
        api::check_reference(&version).map_err(ClientError::Invalid)?;
        let dir = base.join(&version);
        let io = |path: &Path| {
            let path = path.to_owned();
            move |source| ClientError::Io { path, source }
        };
        std::fs::create_dir_all(&base).map_err(io(&base))?;
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(io(&dir))?;
        }
        let target = dir.clone();
        let unpacked = tokio::task::spawn_blocking(move || package::unpack(&bytes, &target))
            .await
            .map_err(|e| ClientError::Invalid(e.to_string()))?;
        let manifest = unpacked?;
        // The manifest and the hash, written last, mark the copy complete.
        let meta = dir.join(".agentstack");
        std::fs::create_dir_all(&meta).map_err(io(&meta))?;
        let manifest_path = dir.join(package::MANIFEST_PATH);
        let json = serde_json::to_vec_pretty(&manifest).expect("manifest serializes");
        std::fs::write(&manifest_path, json).map_err(io(&manifest_path))?;
        let marker = meta.join("sha256");
        std::fs::write(&marker, &sha256).map_err(io(&marker))?;
        Ok(Pulled {
            package: full,
            version,
            sha256,
            dir,
            cached: false,
        })
    }
}

/// The sha256 of a cached package whose files all match its manifest; `None` when it
/// is missing or was changed (then it is pulled again).
fn cached(dir: &Path) -> Option<String> {
    let sha256 = std::fs::read_to_string(dir.join(".agentstack").join("sha256")).ok()?;
    let manifest: package::Manifest =
        serde_json::from_slice(&std::fs::read(dir.join(package::MANIFEST_PATH)).ok()?).ok()?;
    for file in &manifest.files {
        let bytes = std::fs::read(dir.join(&file.path)).ok()?;
        if bytes.len() as u64 != file.size || sha256_hex(&bytes) != file.sha256 {
            tracing::warn!(dir = %dir.display(), file = %file.path, "cached package was modified; pulling again");
            return None;
        }
    }
    Some(sha256.trim().to_owned())
}

/// Whether an error is the hub saying "not found".
pub fn is_not_found(e: &ClientError) -> bool {
    e.status() == Some(StatusCode::NOT_FOUND.as_u16())
}
