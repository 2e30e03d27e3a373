//! The registry's operations, without HTTP: push, pull, info, search, fork, tags,
//! leaderboards, and the garbage collection that keeps blobs and rows consistent
//! after a crash. [`crate::server`] maps them onto routes.

use std::sync::Arc;

use crate::api::{
    self, LeaderboardEntry, LeaderboardPost, PackageInfo, Parent, PushResponse, SearchHit,
    SearchQuery, Validation, VersionInfo,
};
use crate::blobs::{BlobError, Blobs, sha256_hex};
use crate::db::{Db, DbError, NewVersion, PackageRow, User, VersionRow};
use crate::package::{self, PackageError, PackageSpec};
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
    /// The package is malformed or unsafe.
    #[error("invalid package: {0}")]
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
    /// The largest packed package accepted, bytes.
    pub max_package_bytes: usize,
    /// The most search results per page.
    pub max_search_results: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_package_bytes: 256 << 20,
            max_search_results: 100,
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
            limits,
            validators,
            blob_lock: tokio::sync::Mutex::new(()),
        }
    }

    /// The user a bearer token belongs to; `None` when no token was sent.
    pub async fn authenticate(&self, token: Option<&str>) -> Result<Option<User>> {
        let Some(token) = token else {
            return Ok(None);
        };
        match self.db.user_for_token(&crate::auth::hash_token(token)).await? {
            Some(user) => Ok(Some(user)),
            None => Err(RegistryError::Unauthorized(
                "the token is not valid; create one with `agentstack hub token create --user NAME` on the hub's machine and `agentstack hub login`".into(),
            )),
        }
    }

    fn require<'a>(user: Option<&'a User>, what: &str) -> Result<&'a User> {
        user.ok_or_else(|| {
            RegistryError::Unauthorized(format!(
                "{what} needs a token: run `agentstack hub login` (or set AGENTSTACK_HUB_TOKEN) and send it as `Authorization: Bearer <token>`"
            ))
        })
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

    /// Pushes a packed package as `owner/name@version`. Checks the bytes fully before
    /// anything is stored; stores the blob, then the rows in one transaction. A kill
    /// between the two leaves a blob that [`Registry::collect_garbage`] removes.
    pub async fn push(
        &self,
        user: Option<&User>,
        owner: &str,
        name: &str,
        version: &str,
        private: bool,
        bytes: bytes::Bytes,
    ) -> Result<(PushResponse, i64)> {
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
        if bytes.len() > self.limits.max_package_bytes {
            return Err(RegistryError::TooLarge(format!(
                "the package is {} bytes; this registry takes at most {}",
                bytes.len(),
                self.limits.max_package_bytes
            )));
        }
        // Unpack in memory with every check (paths, links, sizes, hashes).
        let checked = {
            let bytes = bytes.clone();
            tokio::task::spawn_blocking(move || package::read_packed(&bytes))
                .await
                .expect("package reader does not panic")
        };
        let (manifest, files) = checked.map_err(RegistryError::InvalidPackage)?;
        let spec_text = files
            .get("openenv.yaml")
            .map(|(c, _)| String::from_utf8_lossy(c).into_owned())
            .ok_or_else(|| {
                RegistryError::InvalidPackage(PackageError::Corrupt(
                    "no openenv.yaml at the package's root".into(),
                ))
            })?;
        let spec = PackageSpec::parse(&spec_text, std::path::Path::new("openenv.yaml"))
            .map_err(RegistryError::InvalidPackage)?;
        if let Some(declared) = &spec.version
            && declared != version
        {
            return Err(RegistryError::BadRequest(format!(
                "openenv.yaml says version {declared} but the push is for {version}; make them agree"
            )));
        }
        let readme = files
            .get("README.md")
            .map(|(c, _)| String::from_utf8_lossy(c).chars().take(256 << 10).collect())
            .unwrap_or_default();
        let sha256 = sha256_hex(&bytes);
        let new = NewVersion {
            owner: owner.to_owned(),
            name: name.to_owned(),
            user_id: user.id,
            private,
            version: semver,
            sha256: sha256.clone(),
            size: bytes.len() as i64,
            manifest: serde_json::to_string(&manifest).expect("manifest serializes"),
            spec: spec_text,
            description: spec.description.clone().unwrap_or_default(),
            tags: spec_tags(&spec),
            readme,
        };
        if let Some(existing) = self.db.package(owner, name).await?
            && self.db.resolve(existing.id, version).await?.is_some()
        {
            return Err(conflict(owner, name, version));
        }
        let upload = {
            let _lock = self.blob_lock.lock().await;
            self.db.begin_upload(&sha256).await?
        };
        let stored = async {
            self.blobs.put(&sha256, bytes.clone()).await?;
            match self.db.insert_version(&new, upload).await {
                Ok(id) => Ok(id),
                Err(DbError::Conflict) => Err(conflict(owner, name, version)),
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
            version: new.version.to_string(),
            sha256,
            size: bytes.len() as u64,
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
        post.check().map_err(RegistryError::BadRequest)?;
        let details = serde_json::to_string(&post.details).expect("JSON value serializes");
        if details.len() > 64 << 10 {
            return Err(RegistryError::TooLarge(
                "details must be at most 64 KiB of JSON".into(),
            ));
        }
        let package = self.visible(Some(user), owner, name).await?;
        let version = self.resolve(&package, reference).await?;
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

fn conflict(owner: &str, name: &str, version: &str) -> RegistryError {
    RegistryError::Conflict(format!(
        "{owner}/{name}@{version} exists; versions are immutable: bump the version in openenv.yaml (or pass --version) and push again"
    ))
}

/// Shared handle.
pub type SharedRegistry = Arc<Registry>;
