//! The registry's operations, without HTTP: push, pull, info, search, fork, tags,
//! leaderboards, and the garbage collection that keeps blobs and rows consistent
//! after a crash. [`crate::server`] maps them onto routes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::api::{
    self, LeaderboardEntry, LeaderboardPost, PackageInfo, Parent, PushResponse, SearchHit,
    SearchQuery, Validation, VersionInfo,
};
use crate::blobs::{BlobError, Blobs};
use crate::db::{Db, DbError, NewVersion, PackageRow, TokenRow, User, VersionRow};
use crate::package::{self, PackageError, PackageSpec, UnpackLimits};
use crate::validate::Validators;

/// Why an operation failed; [`crate::server`] maps each kind to one HTTP status.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The request is malformed.
    #[error("{0}")]
    BadRequest(String),
    /// No token, or an unknown one.
    #[error("{0}")]
    Unauthorized(String),
    /// The token's user may not do this.
    #[error("{0}")]
    Forbidden(String),
    /// No such package, version or user (private packages of others included).
    #[error("{0}")]
    NotFound(String),
    /// The version (or package) exists already.
    #[error("{0}")]
    Conflict(String),
    /// The body is larger than allowed.
    #[error("{0}")]
    TooLarge(String),
    /// The body stopped arriving.
    #[error("{0}")]
    TimedOut(String),
    /// Too many uploads at once: try again after `retry_after`.
    #[error("{message}")]
    Busy {
        /// What is busy.
        message: String,
        /// When to try again.
        retry_after: Duration,
    },
    /// The user sent too many requests of a kind: try again after `retry_after`.
    #[error("{message}")]
    RateLimited {
        /// What was limited.
        message: String,
        /// When to try again.
        retry_after: Duration,
    },
    /// The package is malformed or unsafe.
    #[error("invalid package")]
    InvalidPackage(#[source] PackageError),
    /// A stored blob does not match its hash.
    #[error("the stored package is corrupt; the registry's operator must restore it")]
    Corrupt(#[source] BlobError),
    /// The database failed.
    #[error("internal error")]
    Db(#[from] DbError),
    /// The blob store failed.
    #[error("internal error")]
    Blob(#[source] BlobError),
}

impl From<BlobError> for RegistryError {
    fn from(e: BlobError) -> Self {
        match e {
            BlobError::Corrupt { .. } => Self::Corrupt(e),
            other => Self::Blob(other),
        }
    }
}

type Result<T> = std::result::Result<T, RegistryError>;

/// Registry limits.
#[derive(Debug, Clone)]
pub struct Limits {
    /// The largest packed package accepted, bytes (refused with 413 as soon as a
    /// body passes it).
    pub max_package_bytes: usize,
    /// What a package may hold unpacked, checked while it inflates.
    pub unpack: UnpackLimits,
    /// Package bodies received at once; more wait up to `upload_wait`, then get 503.
    pub max_concurrent_uploads: usize,
    /// How long an upload over `max_concurrent_uploads` waits for its turn.
    pub upload_wait: Duration,
    /// The longest pause in a package body before the push is dropped (408).
    pub upload_idle: Duration,
    /// Leaderboard posts per user per minute (a burst of this many, then one every
    /// `60 s / posts_per_minute`).
    pub posts_per_minute: u32,
    /// The most search results per page.
    pub max_search_results: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_package_bytes: 256 << 20,
            unpack: UnpackLimits::default(),
            max_concurrent_uploads: 4,
            upload_wait: Duration::from_secs(10),
            upload_idle: Duration::from_secs(60),
            posts_per_minute: 30,
            max_search_results: 100,
        }
    }
}

/// The largest `openenv.yaml` a package may have.
const MAX_SPEC_BYTES: u64 = 1 << 20;
/// How much of `README.md` is kept (characters) and read (bytes: a character is at
/// most four).
const MAX_README_CHARS: usize = 256 << 10;
const MAX_README_BYTES: u64 = 4 * MAX_README_CHARS as u64;

/// A push the request line and headers allow, decided before its body is read.
#[derive(Debug, Clone)]
pub struct PushTarget {
    user: User,
    owner: String,
    name: String,
    version: semver::Version,
    /// The package's visibility: the existing package's, or the one asked for.
    private: bool,
}

/// A package body received into a staging file, hashed and counted on the way; the
/// file goes when this is dropped unless it was stored.
#[derive(Debug)]
pub struct StagedUpload {
    path: tempfile::TempPath,
    sha256: String,
    size: u64,
}

/// Per-user token buckets: `capacity` requests at once, refilled at `per_second`.
#[derive(Debug)]
struct RateLimiter {
    capacity: f64,
    per_second: f64,
    buckets: Mutex<HashMap<i64, (f64, tokio::time::Instant)>>,
}

impl RateLimiter {
    fn per_minute(n: u32) -> Self {
        Self {
            capacity: f64::from(n.max(1)),
            per_second: f64::from(n.max(1)) / 60.0,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Takes a token of `user`'s bucket, or says how long until there is one.
    fn take(&self, user: i64) -> std::result::Result<(), Duration> {
        let now = tokio::time::Instant::now();
        let mut buckets = self.buckets.lock().expect("the rate limiter never panics");
        let (tokens, at) = buckets.entry(user).or_insert((self.capacity, now));
        *tokens =
            (*tokens + now.duration_since(*at).as_secs_f64() * self.per_second).min(self.capacity);
        *at = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - *tokens) / self.per_second))
        }
    }
}

/// The registry.
pub struct Registry {
    /// Metadata.
    pub db: Db,
    /// Package bytes.
    pub blobs: Blobs,
    /// Limits.
    pub limits: Limits,
    /// What runs on each pushed version.
    pub validators: Validators,
    /// Orders "register an upload" against "delete an unreferenced blob", so a push
    /// that lost a race never deletes a blob another push is about to use.
    blob_lock: tokio::sync::Mutex<()>,
    /// Turns of package bodies being received ([`Limits::max_concurrent_uploads`]).
    uploads: Arc<Semaphore>,
    /// Leaderboard posts per user ([`Limits::posts_per_minute`]).
    posts: RateLimiter,
}

/// What [`Registry::check`] found.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct CheckReport {
    /// Rows per table.
    pub rows: Vec<(String, i64)>,
    /// Blobs in the store that no version refers to.
    pub orphan_blobs: Vec<String>,
    /// Blobs versions refer to that the store lacks.
    pub missing_blobs: Vec<String>,
    /// Blobs whose bytes do not hash to their name.
    pub corrupt_blobs: Vec<String>,
}

impl CheckReport {
    /// Whether everything is consistent.
    pub fn ok(&self) -> bool {
        self.orphan_blobs.is_empty()
            && self.missing_blobs.is_empty()
            && self.corrupt_blobs.is_empty()
    }
}

fn not_found(owner: &str, name: &str) -> RegistryError {
    RegistryError::NotFound(format!(
        "no package {owner}/{name} (or it is private and the token is not its owner's)"
    ))
}

fn no_token(what: &str) -> RegistryError {
    RegistryError::Unauthorized(format!(
        "{what} needs a token: run `agentstack hub login` (or set AGENTSTACK_HUB_TOKEN) and send it as `Authorization: Bearer <token>`"
    ))
}

fn split_tags(tags: &str) -> Vec<String> {
    tags.split_whitespace().map(str::to_owned).collect()
}

/// `tags:` of `openenv.yaml` (a list of words), space-joined.
fn spec_tags(spec: &PackageSpec) -> String {
    let Some(seq) = spec.document.get("tags").and_then(|t| t.as_sequence()) else {
        return String::new();
    };
    seq.iter()
        .filter_map(|t| t.as_str())
        .filter_map(api::normalize_name)
        .take(32)
        .collect::<Vec<_>>()
        .join(" ")
}

impl Registry {
    /// A registry over a database and a blob store, with no validators but the
    /// built-in static checks.
    pub fn new(db: Db, blobs: Blobs) -> Self {
        Self::with(db, blobs, Limits::default(), Validators::default())
    }

    /// A registry with limits and validators.
    pub fn with(db: Db, blobs: Blobs, limits: Limits, validators: Validators) -> Self {
        Self {
            db,
            blobs,
            uploads: Arc::new(Semaphore::new(limits.max_concurrent_uploads.max(1))),
            posts: RateLimiter::per_minute(limits.posts_per_minute),
            limits,
            validators,
            blob_lock: tokio::sync::Mutex::new(()),
        }
    }

    /// The user a bearer token belongs to; `None` when no token was sent. Unknown,
    /// revoked and expired tokens are refused, each saying which.
    pub async fn authenticate(&self, token: Option<&str>) -> Result<Option<User>> {
        let Some(token) = token else {
            return Ok(None);
        };
        Ok(Some(self.token(token).await?.user))
    }

    /// The live token row of a bearer token.
    async fn token(&self, token: &str) -> Result<TokenRow> {
        let make_one = "create one with `agentstack hub token create --user NAME` on the hub's machine and `agentstack hub login`";
        let Some(row) = self.db.token(&crate::auth::hash_token(token)).await? else {
            return Err(RegistryError::Unauthorized(format!(
                "the token is not valid; {make_one}"
            )));
        };
        if row.revoked_at.is_some() {
            return Err(RegistryError::Unauthorized(format!(
                "the token was revoked; {make_one}"
            )));
        }
        if row.expires_at.is_some_and(|at| at <= crate::db::now()) {
            return Err(RegistryError::Unauthorized(format!(
                "token expired; {make_one}"
            )));
        }
        Ok(row)
    }

    /// The tokens of the bearer token's user.
    pub async fn tokens(&self, token: Option<&str>) -> Result<api::TokenList> {
        let token = token.ok_or_else(|| no_token("listing tokens"))?;
        let current = self.token(token).await?;
        let tokens = self.db.tokens(current.user.id).await?;
        Ok(api::TokenList {
            user: current.user.name.clone(),
            tokens: tokens
                .into_iter()
                .map(|t| api::TokenInfo {
                    current: t.id == current.id,
                    id: t.id,
                    label: t.label,
                    created_at: t.created_at,
                    expires_at: t.expires_at,
                    revoked_at: t.revoked_at,
                })
                .collect(),
        })
    }

    /// Revokes one of the bearer token's user's tokens: `id`, or the bearer token
    /// itself when `None`. Returns the revoked token's id.
    pub async fn revoke_token(&self, token: Option<&str>, id: Option<i64>) -> Result<i64> {
        let token = token.ok_or_else(|| no_token("revoking a token"))?;
        let row = self.token(token).await?;
        let id = id.unwrap_or(row.id);
        match self.db.revoke_tokens(row.user.id, Some(id)).await? {
            0 => Err(RegistryError::NotFound(format!(
                "{} has no live token {id}; `agentstack hub token list` shows them",
                row.user.name
            ))),
            _ => Ok(id),
        }
    }

    fn require<'a>(user: Option<&'a User>, what: &str) -> Result<&'a User> {
        user.ok_or_else(|| no_token(what))
    }

    /// A package the viewer may see.
    async fn visible(&self, viewer: Option<&User>, owner: &str, name: &str) -> Result<PackageRow> {
        match self.db.package(owner, name).await? {
            Some(p) if !p.private || viewer.is_some_and(|u| u.id == p.owner_id) => Ok(p),
            _ => Err(not_found(owner, name)),
        }
    }

    async fn resolve(&self, package: &PackageRow, reference: &str) -> Result<VersionRow> {
        self.db
            .resolve(package.id, reference)
            .await?
            .ok_or_else(|| {
                RegistryError::NotFound(format!(
                    "{}/{} has no version or tag '{reference}'",
                    package.owner, package.name
                ))
            })
    }

    /// Decides whether `user` may push `owner/name@version` from the request alone,
    /// before any of its body is read: a token, the owner's namespace, valid names, a
    /// version that does not exist, and a visibility that matches the package's.
    ///
    /// `private`: `Some(true)` asks for a private package, `Some(false)` a public
    /// one, `None` takes the package's (public for a new one). A push never changes
    /// an existing package's visibility: asking for the other one is a conflict.
    pub async fn authorize_push(
        &self,
        user: Option<&User>,
        owner: &str,
        name: &str,
        version: &str,
        private: Option<bool>,
    ) -> Result<PushTarget> {
        let user = Self::require(user, "pushing")?;
        api::check_name("owner", owner).map_err(RegistryError::BadRequest)?;
        api::check_name("package", name).map_err(RegistryError::BadRequest)?;
        let semver = api::parse_version(version).map_err(RegistryError::BadRequest)?;
        if user.name != owner {
            return Err(RegistryError::Forbidden(format!(
                "only {owner} may push to {owner}/...; you are {}: push to {}/{name} or fork it",
                user.name, user.name
            )));
        }
        let existing = self.db.package(owner, name).await?;
        let private = match (&existing, private) {
            (None, asked) => asked.unwrap_or(false),
            (Some(p), None) => p.private,
            (Some(p), Some(asked)) if asked == p.private => asked,
            (Some(p), Some(_)) => return Err(visibility_conflict(owner, name, p.private)),
        };
        if let Some(existing) = &existing
            && self.db.resolve(existing.id, version).await?.is_some()
        {
            return Err(conflict(owner, name, version));
        }
        Ok(PushTarget {
            user: user.clone(),
            owner: owner.to_owned(),
            name: name.to_owned(),
            version: semver,
            private,
        })
    }

    /// A turn to receive a package body: waits up to [`Limits::upload_wait`] while
    /// [`Limits::max_concurrent_uploads`] are being received, then gives up (503).
    pub async fn upload_permit(&self) -> Result<OwnedSemaphorePermit> {
        let wait = self.limits.upload_wait;
        match tokio::time::timeout(wait, self.uploads.clone().acquire_owned()).await {
            Ok(permit) => Ok(permit.expect("the upload semaphore is never closed")),
            Err(_) => Err(RegistryError::Busy {
                message: format!(
                    "the hub is receiving {} packages already; try again shortly",
                    self.limits.max_concurrent_uploads
                ),
                retry_after: wait,
            }),
        }
    }

    /// Refuses (413) a body whose declared length (Content-Length) is more than
    /// [`Limits::max_package_bytes`], before any of it is read.
    pub fn check_length(&self, declared: Option<u64>) -> Result<()> {
        match declared {
            Some(n) if n > self.limits.max_package_bytes as u64 => Err(self.too_large()),
            _ => Ok(()),
        }
    }

    fn too_large(&self) -> RegistryError {
        RegistryError::TooLarge(format!(
            "the package is larger than this registry takes ({} bytes)\nhint: `agentstack hub serve --max-package-mib` sets the limit",
            self.limits.max_package_bytes
        ))
    }

    /// Receives a package body into a staging file, hashing and counting it as it
    /// arrives: refused (413) as soon as it passes [`Limits::max_package_bytes`],
    /// and dropped (408) when it pauses longer than [`Limits::upload_idle`].
    pub async fn receive<S, E>(&self, body: S) -> Result<StagedUpload>
    where
        S: Stream<Item = std::result::Result<bytes::Bytes, E>>,
        E: std::fmt::Display,
    {
        let max = self.limits.max_package_bytes as u64;
        let staging = self.blobs.staging_dir();
        let staging_error = |source| {
            RegistryError::Blob(BlobError::Io {
                path: staging.clone(),
                source,
            })
        };
        let staged = tempfile::NamedTempFile::new_in(&staging).map_err(staging_error)?;
        let mut file =
            tokio::fs::File::from_std(staged.as_file().try_clone().map_err(staging_error)?);
        let path = staged.into_temp_path();
        let mut hasher = Sha256::new();
        let mut size = 0u64;
        let mut body = std::pin::pin!(body);
        loop {
            let chunk = match tokio::time::timeout(self.limits.upload_idle, body.next()).await {
                Err(_) => {
                    return Err(RegistryError::TimedOut(format!(
                        "no bytes of the package for {} s; the push was dropped",
                        self.limits.upload_idle.as_secs()
                    )));
                }
                Ok(None) => break,
                Ok(Some(Err(e))) => {
                    return Err(RegistryError::BadRequest(format!("reading the body: {e}")));
                }
                Ok(Some(Ok(chunk))) => chunk,
            };
            size += chunk.len() as u64;
            if size > max {
                return Err(self.too_large());
            }
            hasher.update(&chunk);
            file.write_all(&chunk).await.map_err(staging_error)?;
        }
        file.flush().await.map_err(staging_error)?;
        let sha256 = hasher
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        Ok(StagedUpload { path, sha256, size })
    }

    /// Pushes a packed package as `owner/name@version` from bytes in memory (the
    /// HTTP route streams instead: [`Registry::authorize_push`], then
    /// [`Registry::receive`], then [`Registry::push_staged`]).
    pub async fn push(
        &self,
        user: Option<&User>,
        owner: &str,
        name: &str,
        version: &str,
        private: Option<bool>,
        bytes: bytes::Bytes,
    ) -> Result<(PushResponse, i64)> {
        let target = self
            .authorize_push(user, owner, name, version, private)
            .await?;
        self.check_length(Some(bytes.len() as u64))?;
        let _permit = self.upload_permit().await?;
        let body = futures_util::stream::iter([Ok::<_, std::convert::Infallible>(bytes)]);
        let staged = self.receive(body).await?;
        self.push_staged(&target, staged).await
    }

    /// Stores a received package: checks it fully while it inflates (paths, links,
    /// sizes and count within [`Limits::unpack`], hashes) before anything is stored;
    /// stores the blob, then the rows in one transaction. A kill between the two
    /// leaves a blob that [`Registry::collect_garbage`] removes.
    pub async fn push_staged(
        &self,
        target: &PushTarget,
        staged: StagedUpload,
    ) -> Result<(PushResponse, i64)> {
        let PushTarget {
            owner, name, user, ..
        } = target;
        let version = target.version.to_string();
        let checked = {
            let path = staged.path.to_path_buf();
            let limits = self.limits.unpack;
            tokio::task::spawn_blocking(move || read_pushed(&path, &limits))
                .await
                .expect("package reader does not panic")
        };
        let (manifest, spec_text, readme) = checked.map_err(RegistryError::InvalidPackage)?;
        let spec_text = spec_text.ok_or_else(|| {
            RegistryError::InvalidPackage(PackageError::Corrupt(
                "no openenv.yaml at the package's root".into(),
            ))
        })?;
        let spec = PackageSpec::parse(&spec_text, std::path::Path::new("openenv.yaml"))
            .map_err(RegistryError::InvalidPackage)?;
        if let Some(declared) = &spec.version
            && *declared != version
        {
            return Err(RegistryError::BadRequest(format!(
                "openenv.yaml says version {declared} but the push is for {version}; make them agree"
            )));
        }
        let StagedUpload { path, sha256, size } = staged;
        let new = NewVersion {
            owner: owner.clone(),
            name: name.clone(),
            user_id: user.id,
            private: target.private,
            version: target.version.clone(),
            sha256: sha256.clone(),
            size: size as i64,
            manifest: serde_json::to_string(&manifest).expect("manifest serializes"),
            spec: spec_text,
            description: spec.description.clone().unwrap_or_default(),
            tags: spec_tags(&spec),
            readme,
        };
        let upload = {
            let _lock = self.blob_lock.lock().await;
            self.db.begin_upload(&sha256).await?
        };
        let stored = async {
            self.blobs.put_file(&sha256, path).await?;
            match self.db.insert_version(&new, upload).await {
                Ok(id) => Ok(id),
                Err(DbError::Conflict) => Err(conflict(owner, name, &version)),
                Err(DbError::Visibility { private }) => {
                    Err(visibility_conflict(owner, name, private))
                }
                Err(e) => Err(e.into()),
            }
        }
        .await;
        let version_id = match stored {
            Ok(id) => id,
            Err(e) => {
                self.abandon_upload(upload, &sha256).await;
                return Err(e);
            }
        };
        let response = PushResponse {
            package: format!("{owner}/{name}"),
            version,
            sha256,
            size,
            private: target.private,
            validation: "pending".into(),
        };
        Ok((response, version_id))
    }

    /// The bytes of `owner/name@reference`, checked against their hash.
    pub async fn pull(
        &self,
        viewer: Option<&User>,
        owner: &str,
        name: &str,
        reference: &str,
    ) -> Result<(VersionRow, bytes::Bytes)> {
        let package = self.visible(viewer, owner, name).await?;
        let version = self.resolve(&package, reference).await?;
        let bytes = self.blobs.get(&version.sha256).await.map_err(|e| {
            tracing::error!(package = %format!("{owner}/{name}@{}", version.version), error = %e, "corrupt blob");
            RegistryError::from(e)
        })?;
        self.db.count_download(package.id).await?;
        Ok((version, bytes))
    }

    async fn version_info(
        &self,
        version: &VersionRow,
        tags: &[(String, String)],
    ) -> Result<VersionInfo> {
        let (status, checks) = self.db.validation(version.id).await?;
        let files = serde_json::from_str::<package::Manifest>(&version.manifest)
            .map_or(0, |m| m.files.len() as u64);
        Ok(VersionInfo {
            version: version.version.clone(),
            sha256: version.sha256.clone(),
            size: version.size as u64,
            files,
            pushed_by: version.pushed_by.clone(),
            created_at: version.created_at,
            tags: tags
                .iter()
                .filter(|(_, v)| *v == version.version)
                .map(|(t, _)| t.clone())
                .collect(),
            validation: Validation { status, checks },
        })
    }

    /// Everything about a package.
    pub async fn info(
        &self,
        viewer: Option<&User>,
        owner: &str,
        name: &str,
    ) -> Result<PackageInfo> {
        let package = self.visible(viewer, owner, name).await?;
        let tags = self.db.tags(package.id).await?;
        let mut versions = Vec::new();
        for v in self.db.versions(package.id).await? {
            versions.push(self.version_info(&v, &tags).await?);
        }
        Ok(PackageInfo {
            owner: package.owner.clone(),
            name: package.name.clone(),
            description: package.description.clone(),
            tags: split_tags(&package.tags),
            readme: package.readme.clone(),
            private: package.private,
            downloads: package.downloads as u64,
            parent: package
                .parent
                .clone()
                .map(|(package, version)| Parent { package, version }),
            forks: self.db.forks(package.id).await?,
            versions,
            dist_tags: tags.into_iter().collect(),
        })
    }

    /// One version.
    pub async fn version(
        &self,
        viewer: Option<&User>,
        owner: &str,
        name: &str,
        reference: &str,
    ) -> Result<VersionInfo> {
        let package = self.visible(viewer, owner, name).await?;
        let version = self.resolve(&package, reference).await?;
        let tags = self.db.tags(package.id).await?;
        self.version_info(&version, &tags).await
    }

    /// Searches.
    pub async fn search(
        &self,
        viewer: Option<&User>,
        query: &SearchQuery,
    ) -> Result<Vec<SearchHit>> {
        if query.q.len() > 512 {
            return Err(RegistryError::BadRequest(
                "the query is longer than 512 bytes".into(),
            ));
        }
        let limit = query
            .limit
            .unwrap_or(20)
            .clamp(1, self.limits.max_search_results);
        let rows = self
            .db
            .search(
                &query.q,
                query.sort,
                limit,
                query.offset.unwrap_or(0),
                viewer.map(|u| u.id),
            )
            .await?;
        Ok(rows
            .into_iter()
            .map(|r| SearchHit {
                owner: r.owner,
                name: r.name,
                description: r.description,
                tags: split_tags(&r.tags),
                latest: r.latest,
                downloads: r.downloads as u64,
                best_score: r.best_score,
            })
            .collect())
    }

    /// Points a tag at a version (the owner only; `latest` is moved by pushes).
    pub async fn set_tag(
        &self,
        user: Option<&User>,
        owner: &str,
        name: &str,
        tag: &str,
        version: &str,
    ) -> Result<()> {
        let user = Self::require(user, "tagging")?;
        api::check_reference(tag).map_err(RegistryError::BadRequest)?;
        if semver::Version::parse(tag).is_ok() {
            return Err(RegistryError::BadRequest(format!(
                "'{tag}' looks like a version; tags must not, or they would hide it"
            )));
        }
        let package = self.visible(Some(user), owner, name).await?;
        if package.owner_id != user.id {
            return Err(RegistryError::Forbidden(format!(
                "only {owner} may tag {owner}/{name}"
            )));
        }
        let version = self.db.resolve(package.id, version).await?.ok_or_else(|| {
            RegistryError::NotFound(format!("{owner}/{name} has no version {version}"))
        })?;
        self.db.set_tag(package.id, tag, version.id).await?;
        Ok(())
    }

    /// Forks `owner/name@version` into the caller's namespace.
    pub async fn fork(
        &self,
        user: Option<&User>,
        owner: &str,
        name: &str,
        request: &api::ForkRequest,
    ) -> Result<PackageInfo> {
        let user = Self::require(user, "forking")?;
        let new_name = request.name.clone().unwrap_or_else(|| name.to_owned());
        api::check_name("package", &new_name).map_err(RegistryError::BadRequest)?;
        let package = self.visible(Some(user), owner, name).await?;
        let version = self
            .resolve(&package, request.version.as_deref().unwrap_or(api::LATEST))
            .await?;
        match self.db.fork(&package, &version, user, &new_name).await {
            Ok(()) => {}
            Err(DbError::Conflict) => {
                return Err(RegistryError::Conflict(format!(
                    "{}/{new_name} exists already; choose another name with `--name`",
                    user.name
                )));
            }
            Err(e) => return Err(e.into()),
        }
        self.info(Some(user), &user.name, &new_name).await
    }

    /// Posts an evaluation result to a version's leaderboard.
    pub async fn post_result(
        &self,
        user: Option<&User>,
        owner: &str,
        name: &str,
        reference: &str,
        post: &LeaderboardPost,
    ) -> Result<()> {
        let user = Self::require(user, "posting to a leaderboard")?;
        self.posts
            .take(user.id)
            .map_err(|retry_after| RegistryError::RateLimited {
                message: format!(
                    "{} posted more than {} results in a minute; try again in {} s",
                    user.name,
                    self.limits.posts_per_minute,
                    retry_after.as_secs().max(1)
                ),
                retry_after,
            })?;
        post.check().map_err(RegistryError::BadRequest)?;
        let details = serde_json::to_string(&post.details).expect("JSON value serializes");
        if details.len() > 64 << 10 {
            return Err(RegistryError::TooLarge(
                "details must be at most 64 KiB of JSON".into(),
            ));
        }
        let package = self.visible(Some(user), owner, name).await?;
        let version = self.resolve(&package, reference).await?;
        // The version's own reward range bounds what its results can be.
        let spec = PackageSpec::parse(&version.spec, std::path::Path::new("openenv.yaml"))
            .map_err(|e| {
                RegistryError::Db(DbError::Malformed(format!(
                    "the stored openenv.yaml of {owner}/{name}@{}: {e}",
                    version.version
                )))
            })?;
        if let Some(range) = spec.agentstack.reward_range {
            post.check_range(range).map_err(RegistryError::BadRequest)?;
        }
        self.db
            .post_result(
                version.id,
                user.id,
                &post.model,
                post.score,
                post.ci95,
                post.episodes as i64,
                &post.harness,
                &details,
            )
            .await?;
        Ok(())
    }

    /// A version's leaderboard.
    pub async fn leaderboard(
        &self,
        viewer: Option<&User>,
        owner: &str,
        name: &str,
        reference: &str,
    ) -> Result<api::Leaderboard> {
        let package = self.visible(viewer, owner, name).await?;
        let version = self.resolve(&package, reference).await?;
        let rows = self.db.leaderboard(version.id, 100).await?;
        Ok(api::Leaderboard {
            package: format!("{owner}/{name}"),
            version: version.version.clone(),
            entries: rows
                .into_iter()
                .enumerate()
                .map(|(i, r)| LeaderboardEntry {
                    rank: i as u32 + 1,
                    user: r.user,
                    version: r.version,
                    post: LeaderboardPost {
                        model: r.model,
                        score: r.score,
                        ci95: r.ci,
                        episodes: r.episodes as u64,
                        harness: r.harness,
                        details: serde_json::from_str(&r.details).unwrap_or_default(),
                    },
                    created_at: r.created_at,
                })
                .collect(),
        })
    }

    /// Forgets a failed upload and deletes its blob unless something refers to it.
    async fn abandon_upload(&self, upload: i64, sha256: &str) {
        let _lock = self.blob_lock.lock().await;
        let result = async {
            self.db.end_upload(upload).await?;
            if !self.db.referenced_blobs().await?.contains(sha256) {
                self.blobs.delete(sha256).await?;
            }
            Ok::<(), RegistryError>(())
        }
        .await;
        if let Err(e) = result {
            tracing::warn!(error = %e, sha256, "could not clean up after a failed push; the next start will");
        }
    }

    /// Checks that rows and blobs agree and every blob matches its hash (`hub check`).
    pub async fn check(&self) -> Result<CheckReport> {
        let referenced: std::collections::HashSet<String> = self.db.referenced_blobs().await?;
        let stored: std::collections::HashSet<String> =
            self.blobs.list().await?.into_iter().collect();
        let mut report = CheckReport {
            rows: self.db.counts().await?,
            ..CheckReport::default()
        };
        report.orphan_blobs = stored.difference(&referenced).cloned().collect();
        report.missing_blobs = referenced.difference(&stored).cloned().collect();
        for sha in stored.intersection(&referenced) {
            if let Err(BlobError::Corrupt { .. }) = self.blobs.get(sha).await {
                report.corrupt_blobs.push(sha.clone());
            }
        }
        report.orphan_blobs.sort();
        report.missing_blobs.sort();
        report.corrupt_blobs.sort();
        Ok(report)
    }

    /// Removes what a crash left: upload rows (none can be in flight when this runs at
    /// start) and blobs no version refers to. Returns how many blobs went.
    pub async fn collect_garbage(&self) -> Result<usize> {
        let _lock = self.blob_lock.lock().await;
        let uploads = self.db.clear_uploads().await?;
        let keep = self.db.referenced_blobs().await?;
        let removed = self.blobs.collect_garbage(&keep).await?;
        if uploads > 0 || removed > 0 {
            tracing::info!(uploads, removed, "removed what an interrupted push left");
        }
        Ok(removed)
    }
}

/// A pushed package's contents as the registry keeps them: the manifest,
/// `openenv.yaml` and the start of `README.md`; every file is checked against the
/// manifest as it inflates and then dropped.
fn read_pushed(
    path: &std::path::Path,
    limits: &UnpackLimits,
) -> std::result::Result<(package::Manifest, Option<String>, String), PackageError> {
    use std::io::Read;
    let file = std::fs::File::open(path).map_err(|source| PackageError::Io {
        path: path.to_owned(),
        source,
    })?;
    let (mut spec, mut readme) = (None, String::new());
    let read = |contents: &mut dyn Read, max: u64, what: &str| {
        let mut buffer = Vec::new();
        contents
            .take(max)
            .read_to_end(&mut buffer)
            .map_err(|e| PackageError::Corrupt(format!("{what}: {e}")))?;
        Ok::<_, PackageError>(buffer)
    };
    let manifest =
        package::read_packed_from(std::io::BufReader::new(file), limits, |file, contents| {
            match file.path.as_str() {
                "openenv.yaml" if file.size > MAX_SPEC_BYTES => {
                    return Err(PackageError::Corrupt(format!(
                        "openenv.yaml is larger than {MAX_SPEC_BYTES} bytes"
                    )));
                }
                "openenv.yaml" => {
                    let bytes = read(contents, MAX_SPEC_BYTES, "openenv.yaml")?;
                    spec = Some(String::from_utf8_lossy(&bytes).into_owned());
                }
                "README.md" => {
                    let bytes = read(contents, MAX_README_BYTES, "README.md")?;
                    readme = String::from_utf8_lossy(&bytes)
                        .chars()
                        .take(MAX_README_CHARS)
                        .collect();
                }
                _ => {}
            }
            Ok(())
        })?;
    Ok((manifest, spec, readme))
}

fn visibility_conflict(owner: &str, name: &str, private: bool) -> RegistryError {
    RegistryError::Conflict(if private {
        format!(
            "{owner}/{name} is private, and a push does not make a package public\nhint: push without `private=false` (`agentstack hub push` without --private) to add a private version"
        )
    } else {
        format!(
            "{owner}/{name} is public: a version pushed to it would be public too, so --private is refused\nhint: push without --private to publish this version, or push it to a new private package (--name {name}_private --private)"
        )
    })
}

fn conflict(owner: &str, name: &str, version: &str) -> RegistryError {
    RegistryError::Conflict(format!(
        "{owner}/{name}@{version} exists; versions are immutable: bump the version in openenv.yaml (or pass --version) and push again"
    ))
}

/// Shared handle.
pub type SharedRegistry = Arc<Registry>;

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_post_rate_limit_refills_over_a_minute() {
        let limiter = RateLimiter::per_minute(30);
        for _ in 0..30 {
            limiter.take(1).unwrap();
        }
        let wait = limiter.take(1).unwrap_err();
        assert!((1.9..=2.1).contains(&wait.as_secs_f64()), "{wait:?}");
        limiter.take(2).unwrap();
        tokio::time::advance(Duration::from_secs(2)).await;
        limiter.take(1).unwrap();
        assert!(limiter.take(1).is_err());
        // A long pause refills the burst, no more.
        tokio::time::advance(Duration::from_secs(3600)).await;
        for _ in 0..30 {
            limiter.take(1).unwrap();
        }
        assert!(limiter.take(1).is_err());
    }
}
