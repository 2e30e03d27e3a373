//! The registry's metadata: SQLite (embedded, the default) or PostgreSQL, behind one
//! set of queries (sqlx's `Any` driver; `$N` placeholders work on both). Migrations
//! are per dialect; search is FTS5 on SQLite and a weighted `tsvector` on PostgreSQL.

use std::collections::HashSet;
use std::time::{SystemTime, UNIX_EPOCH};

use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::{AnyPool, Row};
use tokio::sync::Mutex;

use crate::api::{SearchSort, ValidationCheck};

/// What can go wrong with the database.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    /// The URL names no database we support (only its scheme is kept: the rest may
    /// hold a password).
    #[error(
        "'{0}:' is not a database we support\nhint: use sqlite:///path/to/hub.db or postgres://user@host/db"
    )]
    Url(String),
    /// Connecting or querying failed.
    #[error("database error")]
    Sqlx(#[from] sqlx::Error),
    /// Migrating the schema failed.
    #[error("migrating the database schema failed")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A unique row exists already.
    #[error("already exists")]
    Conflict,
    /// Stored data is not what this version of the code wrote.
    #[error("stored data is malformed: {0}")]
    Malformed(String),
    /// The package a version was inserted into has the other visibility (it was
    /// created by a concurrent push).
    #[error("the package is {}", if *.private { "private" } else { "public" })]
    Visibility {
        /// Whether the stored package is private.
        private: bool,
    },
    /// Setting the SQLite file's permissions failed.
    #[error("{path}: setting its permissions")]
    Permissions {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

fn conflict_or(e: sqlx::Error) -> DbError {
    match &e {
        sqlx::Error::Database(d) if d.is_unique_violation() => DbError::Conflict,
        _ => DbError::Sqlx(e),
    }
}

/// Which database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// Embedded SQLite.
    Sqlite,
    /// A PostgreSQL server.
    Postgres,
}

/// Now, Unix seconds.
pub fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// The metadata store.
pub struct Db {
    pool: AnyPool,
    dialect: Dialect,
    /// SQLite allows one writer; taking writes in turn here turns would-be
    /// `database is locked` failures into a short wait (one hub process owns a
    /// SQLite file).
    write_lock: Mutex<()>,
}

/// A user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    /// Row id.
    pub id: i64,
    /// Name (also their namespace).
    pub name: String,
}

/// An API token's row (never its secret).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenRow {
    /// Row id: what `hub token revoke` takes.
    pub id: i64,
    /// Its user.
    pub user: User,
    /// What it is for.
    pub label: String,
    /// Unix seconds.
    pub created_at: i64,
    /// When it stops working, Unix seconds; `None`: never.
    pub expires_at: Option<i64>,
    /// When it was revoked, Unix seconds.
    pub revoked_at: Option<i64>,
}

/// A package row.
#[derive(Debug, Clone)]
pub struct PackageRow {
    /// Row id.
    pub id: i64,
    /// Namespace.
    pub owner: String,
    /// Name.
    pub name: String,
    /// The owner's user id.
    pub owner_id: i64,
    /// Description.
    pub description: String,
    /// Space-separated tags.
    pub tags: String,
    /// README.
    pub readme: String,
    /// Hidden from everyone but the owner.
    pub private: bool,
    /// Fork parent `owner/name` and version.
    pub parent: Option<(String, String)>,
    /// Downloads.
    pub downloads: i64,
}

/// A version row.
#[derive(Debug, Clone)]
pub struct VersionRow {
    /// Row id.
    pub id: i64,
    /// Package row id.
    pub package_id: i64,
    /// The version.
    pub version: String,
    /// sha256 of the packed bytes.
    pub sha256: String,
    /// Packed size.
    pub size: i64,
    /// The manifest, JSON.
    pub manifest: String,
    /// `openenv.yaml`.
    pub spec: String,
    /// Pusher's name.
    pub pushed_by: String,
    /// Unix seconds.
    pub created_at: i64,
}

/// A version to insert.
#[derive(Debug, Clone)]
pub struct NewVersion {
    /// Namespace (the pusher's name).
    pub owner: String,
    /// Package name.
    pub name: String,
    /// The pusher.
    pub user_id: i64,
    /// Whether the package is private: it must match the package's visibility when
    /// it exists (a push never changes it).
    pub private: bool,
    /// The version.
    pub version: semver::Version,
    /// sha256 of the packed bytes.
    pub sha256: String,
    /// Packed size.
    pub size: i64,
    /// Manifest JSON.
    pub manifest: String,
    /// `openenv.yaml` text.
    pub spec: String,
    /// Description.
    pub description: String,
    /// Space-separated tags.
    pub tags: String,
    /// README.
    pub readme: String,
}

/// One search result row.
#[derive(Debug, Clone)]
pub struct SearchRow {
    /// Namespace.
    pub owner: String,
    /// Name.
    pub name: String,
    /// Description.
    pub description: String,
    /// Space-separated tags.
    pub tags: String,
    /// Downloads.
    pub downloads: i64,
    /// The `latest` version.
    pub latest: Option<String>,
    /// Best leaderboard score.
    pub best_score: Option<f64>,
}

/// One leaderboard row.
#[derive(Debug, Clone)]
pub struct LeaderboardRow {
    /// Poster.
    pub user: String,
    /// The version it was posted to.
    pub version: String,
    /// Model.
    pub model: String,
    /// Score.
    pub score: f64,
    /// 95% CI.
    pub ci: [f64; 2],
    /// Episodes.
    pub episodes: i64,
    /// Harness configuration hash.
    pub harness: String,
    /// Details JSON.
    pub details: String,
    /// Unix seconds.
    pub created_at: i64,
}

const PACKAGE_COLUMNS: &str = "p.id, p.owner, p.name, p.owner_id, p.description, p.tags, p.readme, p.private, \
     (SELECT q.owner || '/' || q.name FROM packages q WHERE q.id = p.parent_id) AS parent, p.parent_version, p.downloads";

const VERSION_COLUMNS: &str = "v.id, v.package_id, v.version, v.sha256, v.size, v.manifest, v.spec, \
     (SELECT u.name FROM users u WHERE u.id = v.pushed_by) AS pushed_by, v.created_at";

fn package_row(row: &AnyRow) -> Result<PackageRow, sqlx::Error> {
    let parent: Option<String> = row.try_get("parent")?;
    let parent_version: Option<String> = row.try_get("parent_version")?;
    Ok(PackageRow {
        id: row.try_get("id")?,
        owner: row.try_get("owner")?,
        name: row.try_get("name")?,
        owner_id: row.try_get("owner_id")?,
        description: row.try_get("description")?,
        tags: row.try_get("tags")?,
        readme: row.try_get("readme")?,
        private: row.try_get::<i64, _>("private")? != 0,
        parent: parent.zip(parent_version),
        downloads: row.try_get("downloads")?,
    })
}

const TOKEN_COLUMNS: &str =
    "t.id, t.user_id, u.name AS user_name, t.label, t.created_at, t.expires_at, t.revoked_at";

fn token_row(row: &AnyRow) -> Result<TokenRow, sqlx::Error> {
    Ok(TokenRow {
        id: row.try_get("id")?,
        user: User {
            id: row.try_get("user_id")?,
            name: row.try_get("user_name")?,
        },
        label: row.try_get("label")?,
        created_at: row.try_get("created_at")?,
        expires_at: row.try_get("expires_at")?,
        revoked_at: row.try_get("revoked_at")?,
    })
}

/// The file of a `sqlite:` URL, if it names one (not `:memory:`).
fn sqlite_file(url: &str) -> Option<std::path::PathBuf> {
    let rest = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))?;
    let path = rest.split('?').next().unwrap_or_default();
    (!path.is_empty() && !path.starts_with(':')).then(|| path.into())
}

/// Makes the SQLite database and its `-wal`, `-shm` and `-journal` files readable
/// by this user only, creating the database file (empty: SQLite fills it) when
/// missing. SQLite gives the files it creates later the database file's mode.
///
/// An existing database file is never opened here, only `chmod`ed: closing any
/// descriptor of a SQLite file drops every POSIX lock this process holds on it,
/// and another process would then take itself for the last user of the WAL.
fn private_sqlite_files(db: &std::path::Path) -> Result<(), DbError> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let failed = |path: &std::path::Path| {
        let path = path.to_owned();
        move |source| DbError::Permissions { path, source }
    };
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(PRIVATE_FILE_MODE)
        .open(db)
    {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
            return Err(failed(db)(e));
        }
        _ => {}
    }
    for suffix in ["", "-wal", "-shm", "-journal"] {
        let mut name = db.as_os_str().to_owned();
        name.push(suffix);
        let path = std::path::PathBuf::from(name);
        match std::fs::set_permissions(&path, std::fs::Permissions::from_mode(PRIVATE_FILE_MODE)) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            other => other.map_err(failed(&path))?,
        }
    }
    Ok(())
}

/// Mode of the SQLite files: the hub's user only (they hold token hashes and
/// private packages' metadata).
const PRIVATE_FILE_MODE: u32 = 0o600;

fn user_row(row: &AnyRow) -> Result<User, sqlx::Error> {
    Ok(User {
        id: row.try_get("id")?,
        name: row.try_get("name")?,
    })
}

/// One column of every row.
fn column<T, C>(rows: &[AnyRow], name: &str) -> Result<C, sqlx::Error>
where
    T: for<'r> sqlx::Decode<'r, sqlx::Any> + sqlx::Type<sqlx::Any>,
    C: FromIterator<T>,
{
    rows.iter().map(|r| r.try_get(name)).collect()
}

fn version_row(row: &AnyRow) -> Result<VersionRow, sqlx::Error> {
    Ok(VersionRow {
        id: row.try_get("id")?,
        package_id: row.try_get("package_id")?,
        version: row.try_get("version")?,
        sha256: row.try_get("sha256")?,
        size: row.try_get("size")?,
        manifest: row.try_get("manifest")?,
        spec: row.try_get("spec")?,
        pushed_by: row
            .try_get::<Option<String>, _>("pushed_by")?
            .unwrap_or_default(),
        created_at: row.try_get("created_at")?,
    })
}

/// The words of a search query as the dialect's full-text query: every word must
/// match as a prefix. Only letters and digits pass, so no query syntax reaches the
/// database.
fn full_text_query(dialect: Dialect, q: &str) -> Option<String> {
    let words: Vec<String> = q
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .take(16)
        .map(str::to_lowercase)
        .collect();
    if words.is_empty() {
        return None;
    }
    Some(match dialect {
        Dialect::Sqlite => words
            .iter()
            .map(|w| format!("\"{w}\"*"))
            .collect::<Vec<_>>()
            .join(" "),
        Dialect::Postgres => words
            .iter()
            .map(|w| format!("{w}:*"))
            .collect::<Vec<_>>()
            .join(" & "),
    })
}

impl Db {
    /// Connects (creating a SQLite file when needed) and migrates the schema.
    pub async fn connect(url: &str) -> Result<Self, DbError> {
        sqlx::any::install_default_drivers();
        let dialect = if url.starts_with("sqlite:") {
            Dialect::Sqlite
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Dialect::Postgres
        } else {
            let scheme = url.split(':').next().unwrap_or_default();
            return Err(DbError::Url(scheme.chars().take(32).collect()));
        };
        let file = match dialect {
            Dialect::Sqlite => sqlite_file(url),
            Dialect::Postgres => None,
        };
        if let Some(file) = &file {
            private_sqlite_files(file)?;
        }
        let url = match dialect {
            Dialect::Sqlite if !url.contains("mode=") => {
                let sep = if url.contains('?') { '&' } else { '?' };
                format!("{url}{sep}mode=rwc")
            }
            _ => url.to_owned(),
        };
        let pool = AnyPoolOptions::new()
            .max_connections(match dialect {
                Dialect::Sqlite => 4,
                Dialect::Postgres => 16,
            })
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    if dialect == Dialect::Postgres {
                        // Search queries are short; JIT compilation took longer than
                        // the queries themselves (bench/hub).
                        sqlx::query("SET jit = off").execute(&mut *conn).await?;
                    }
                    if dialect == Dialect::Sqlite {
                        sqlx::query("PRAGMA foreign_keys = ON")
                            .execute(&mut *conn)
                            .await?;
                        sqlx::query("PRAGMA busy_timeout = 10000")
                            .execute(&mut *conn)
                            .await?;
                        sqlx::query("PRAGMA synchronous = NORMAL")
                            .execute(&mut *conn)
                            .await?;
                    }
                    Ok(())
                })
            })
            .connect(&url)
            .await?;
        if dialect == Dialect::Sqlite {
            // WAL: readers never wait for the writer; a kill mid-transaction rolls back.
            sqlx::query("PRAGMA journal_mode = WAL")
                .execute(&pool)
                .await?;
            sqlx::migrate!("./migrations/sqlite").run(&pool).await?;
            // The WAL files exist now: an older hub may have left them open to all.
            if let Some(file) = &file {
                private_sqlite_files(file)?;
            }
        } else {
            sqlx::migrate!("./migrations/postgres").run(&pool).await?;
        }
        Ok(Self {
            pool,
            dialect,
            write_lock: Mutex::new(()),
        })
    }

    /// Which database this is.
    pub fn dialect(&self) -> Dialect {
        self.dialect
    }

    /// Holds the write turn on SQLite (nothing on PostgreSQL).
    async fn write_turn(&self) -> Option<tokio::sync::MutexGuard<'_, ()>> {
        match self.dialect {
            Dialect::Sqlite => Some(self.write_lock.lock().await),
            Dialect::Postgres => None,
        }
    }

    // ---- users and tokens ----

    /// Creates a user.
    pub async fn create_user(&self, name: &str) -> Result<User, DbError> {
        let _turn = self.write_turn().await;
        let id: i64 =
            sqlx::query("INSERT INTO users (name, created_at) VALUES ($1, $2) RETURNING id")
                .bind(name)
                .bind(now())
                .fetch_one(&self.pool)
                .await
                .map_err(conflict_or)?
                .try_get("id")?;
        Ok(User {
            id,
            name: name.to_owned(),
        })
    }

    /// The user called `name`.
    pub async fn user(&self, name: &str) -> Result<Option<User>, DbError> {
        let row = sqlx::query("SELECT id, name FROM users WHERE name = $1")
            .bind(name)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.as_ref().map(user_row).transpose()?)
    }

    /// Stores a token's hash for a user; returns the token's id.
    pub async fn add_token(
        &self,
        user_id: i64,
        hash: &str,
        label: &str,
        expires_at: Option<i64>,
    ) -> Result<i64, DbError> {
        let _turn = self.write_turn().await;
        Ok(sqlx::query(
            "INSERT INTO tokens (user_id, hash, label, created_at, expires_at) VALUES ($1, $2, $3, $4, $5) RETURNING id",
        )
        .bind(user_id)
        .bind(hash)
        .bind(label)
        .bind(now())
        .bind(expires_at)
        .fetch_one(&self.pool)
        .await
        .map_err(conflict_or)?
        .try_get("id")?)
    }

    /// The token with this hash, revoked or expired ones included.
    pub async fn token(&self, hash: &str) -> Result<Option<TokenRow>, DbError> {
        let row = sqlx::query(&format!(
            "SELECT {TOKEN_COLUMNS} FROM tokens t JOIN users u ON u.id = t.user_id WHERE t.hash = $1"
        ))
        .bind(hash)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.as_ref().map(token_row).transpose()?)
    }

    /// A user's tokens, oldest first.
    pub async fn tokens(&self, user_id: i64) -> Result<Vec<TokenRow>, DbError> {
        let rows = sqlx::query(&format!(
            "SELECT {TOKEN_COLUMNS} FROM tokens t JOIN users u ON u.id = t.user_id WHERE t.user_id = $1 ORDER BY t.id"
        ))
        .bind(user_id)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.iter().map(token_row).collect::<Result<_, _>>()?)
    }

    /// Revokes a user's token `token_id`, or all of the user's tokens when `None`;
    /// returns how many were revoked (tokens revoked before are not counted again).
    pub async fn revoke_tokens(&self, user_id: i64, token_id: Option<i64>) -> Result<u64, DbError> {
        let _turn = self.write_turn().await;
        let query = match token_id {
            Some(id) => sqlx::query(
                "UPDATE tokens SET revoked_at = $1 WHERE user_id = $2 AND id = $3 AND revoked_at IS NULL",
            )
            .bind(now())
            .bind(user_id)
            .bind(id),
            None => sqlx::query(
                "UPDATE tokens SET revoked_at = $1 WHERE user_id = $2 AND revoked_at IS NULL",
            )
            .bind(now())
            .bind(user_id),
        };
        Ok(query.execute(&self.pool).await?.rows_affected())
    }

    // ---- packages and versions ----

    /// The package `owner/name`.
    pub async fn package(&self, owner: &str, name: &str) -> Result<Option<PackageRow>, DbError> {
        let row = sqlx::query(&format!(
            "SELECT {PACKAGE_COLUMNS} FROM packages p WHERE p.owner = $1 AND p.name = $2"
        ))
        .bind(owner)
        .bind(name)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.as_ref().map(package_row).transpose()?)
    }

    /// `owner/name` of a package row.
    pub async fn package_name(&self, package_id: i64) -> Result<String, DbError> {
        Ok(
            sqlx::query("SELECT owner || '/' || name AS full FROM packages WHERE id = $1")
                .bind(package_id)
                .fetch_one(&self.pool)
                .await?
                .try_get("full")?,
        )
    }

    /// Forks of a package (`owner/name`).
    pub async fn forks(&self, package_id: i64) -> Result<Vec<String>, DbError> {
        let rows = sqlx::query(
            "SELECT owner || '/' || name AS full FROM packages WHERE parent_id = $1 AND private = 0 ORDER BY id",
        )
        .bind(package_id)
        .fetch_all(&self.pool)
        .await?;
        Ok(column(&rows, "full")?)
    }

    /// Every version of a package, newest (highest) first.
    pub async fn versions(&self, package_id: i64) -> Result<Vec<VersionRow>, DbError> {
        let rows = sqlx::query(&format!(
            "SELECT {VERSION_COLUMNS} FROM versions v WHERE v.package_id = $1"
        ))
        .bind(package_id)
        .fetch_all(&self.pool)
        .await?;
        let mut versions = rows
            .iter()
            .map(version_row)
            .collect::<Result<Vec<_>, _>>()?;
        versions.sort_by_cached_key(|v| std::cmp::Reverse(semver::Version::parse(&v.version).ok()));
        Ok(versions)
    }

    /// Tag → version of a package.
    pub async fn tags(&self, package_id: i64) -> Result<Vec<(String, String)>, DbError> {
        let rows = sqlx::query(
            "SELECT t.tag, v.version FROM tags t JOIN versions v ON v.id = t.version_id WHERE t.package_id = $1 ORDER BY t.tag",
        )
        .bind(package_id)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .iter()
            .map(|r| Ok((r.try_get("tag")?, r.try_get("version")?)))
            .collect::<Result<_, sqlx::Error>>()?)
    }

    /// A version of a package by version or tag.
    pub async fn resolve(
        &self,
        package_id: i64,
        reference: &str,
    ) -> Result<Option<VersionRow>, DbError> {
        let by_version = sqlx::query(&format!(
            "SELECT {VERSION_COLUMNS} FROM versions v WHERE v.package_id = $1 AND v.version = $2"
        ))
        .bind(package_id)
        .bind(reference)
        .fetch_optional(&self.pool)
        .await?;
        let row = match by_version {
            Some(row) => Some(row),
            None => {
                sqlx::query(&format!(
                    "SELECT {VERSION_COLUMNS} FROM tags t JOIN versions v ON v.id = t.version_id WHERE t.package_id = $1 AND t.tag = $2"
                ))
                .bind(package_id)
                .bind(reference)
                .fetch_optional(&self.pool)
                .await?
            }
        };
        Ok(row.as_ref().map(version_row).transpose()?)
    }

    /// Records that a blob is being written, so garbage collection leaves it alone.
    pub async fn begin_upload(&self, sha256: &str) -> Result<i64, DbError> {
        let _turn = self.write_turn().await;
        Ok(
            sqlx::query("INSERT INTO uploads (sha256, created_at) VALUES ($1, $2) RETURNING id")
                .bind(sha256)
                .bind(now())
                .fetch_one(&self.pool)
                .await?
                .try_get("id")?,
        )
    }

    /// Forgets an upload (after it failed, or once its version is stored).
    pub async fn end_upload(&self, upload_id: i64) -> Result<(), DbError> {
        let _turn = self.write_turn().await;
        sqlx::query("DELETE FROM uploads WHERE id = $1")
            .bind(upload_id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Inserts a version in one transaction: the package (created on its first push),
    /// the version, `latest`, a pending validation, the search index, and the end of
    /// its upload. [`DbError::Conflict`] when the version exists.
    pub async fn insert_version(&self, new: &NewVersion, upload_id: i64) -> Result<i64, DbError> {
        let _turn = self.write_turn().await;
        let mut tx = self.pool.begin().await?;
        let now = now();
        sqlx::query(
            "INSERT INTO packages (owner, name, owner_id, private, created_at, updated_at) VALUES ($1, $2, $3, $4, $5, $5) \
             ON CONFLICT (owner, name) DO NOTHING",
        )
        .bind(&new.owner)
        .bind(&new.name)
        .bind(new.user_id)
        .bind(i64::from(new.private))
        .bind(now)
        .execute(&mut *tx)
        .await?;
        let package =
            sqlx::query("SELECT id, private FROM packages WHERE owner = $1 AND name = $2")
                .bind(&new.owner)
                .bind(&new.name)
                .fetch_one(&mut *tx)
                .await?;
        let package_id: i64 = package.try_get("id")?;
        // A push never changes a package's visibility; one that raced the package's
        // creation with the other visibility is refused.
        let private = package.try_get::<i64, _>("private")? != 0;
        if private != new.private {
            return Err(DbError::Visibility { private });
        }
        let v = &new.version;
        let version_id: i64 = sqlx::query(
            "INSERT INTO versions (package_id, version, major, minor, patch, prerelease, sha256, size, manifest, spec, pushed_by, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12) RETURNING id",
        )
        .bind(package_id)
        .bind(v.to_string())
        .bind(v.major as i64)
        .bind(v.minor as i64)
        .bind(v.patch as i64)
        .bind(v.pre.as_str())
        .bind(&new.sha256)
        .bind(new.size)
        .bind(&new.manifest)
        .bind(&new.spec)
        .bind(new.user_id)
        .bind(now)
        .fetch_one(&mut *tx)
        .await
        .map_err(conflict_or)?
        .try_get("id")?;
        sqlx::query("INSERT INTO validations (version_id, status, checks, updated_at) VALUES ($1, 'pending', '[]', $2)")
            .bind(version_id)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        sqlx::query("DELETE FROM uploads WHERE id = $1")
            .bind(upload_id)
            .execute(&mut *tx)
            .await?;
        // `latest` follows the highest release (the highest pre-release until there is one).
        let rows = sqlx::query("SELECT id, version FROM versions WHERE package_id = $1")
            .bind(package_id)
            .fetch_all(&mut *tx)
            .await?;
        let mut best: Option<(bool, semver::Version, i64)> = None;
        for row in &rows {
            let text: String = row.try_get("version")?;
            let version = semver::Version::parse(&text)
                .map_err(|e| DbError::Malformed(format!("version {text}: {e}")))?;
            let key = (
                version.pre.is_empty(),
                version,
                row.try_get::<i64, _>("id")?,
            );
            if best.as_ref().is_none_or(|b| (key.0, &key.1) > (b.0, &b.1)) {
                best = Some(key);
            }
        }
        if let Some((_, _, latest_id)) = best
            && latest_id == version_id
        {
            sqlx::query(
                "INSERT INTO tags (package_id, tag, version_id) VALUES ($1, 'latest', $2) \
                 ON CONFLICT (package_id, tag) DO UPDATE SET version_id = excluded.version_id",
            )
            .bind(package_id)
            .bind(version_id)
            .execute(&mut *tx)
            .await?;
            sqlx::query("UPDATE packages SET description = $1, tags = $2, readme = $3, updated_at = $4 WHERE id = $5")
                .bind(&new.description)
                .bind(&new.tags)
                .bind(&new.readme)
                .bind(now)
                .bind(package_id)
                .execute(&mut *tx)
                .await?;
            self.index(&mut tx, package_id).await?;
        }
        tx.commit().await?;
        Ok(version_id)
    }

    /// Rewrites a package's row in the SQLite search index (PostgreSQL's column is
    /// generated).
    async fn index(
        &self,
        tx: &mut sqlx::Transaction<'_, sqlx::Any>,
        package_id: i64,
    ) -> Result<(), DbError> {
        if self.dialect != Dialect::Sqlite {
            return Ok(());
        }
        sqlx::query("DELETE FROM package_search WHERE rowid = $1")
            .bind(package_id)
            .execute(&mut **tx)
            .await?;
        sqlx::query(
            "INSERT INTO package_search (rowid, owner, name, description, tags, readme) \
             SELECT id, owner, name, description, tags, readme FROM packages WHERE id = $1",
        )
        .bind(package_id)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }

    /// Points `tag` at a version.
    pub async fn set_tag(
        &self,
        package_id: i64,
        tag: &str,
        version_id: i64,
    ) -> Result<(), DbError> {
        let _turn = self.write_turn().await;
        sqlx::query(
            "INSERT INTO tags (package_id, tag, version_id) VALUES ($1, $2, $3) \
             ON CONFLICT (package_id, tag) DO UPDATE SET version_id = excluded.version_id",
        )
        .bind(package_id)
        .bind(tag)
        .bind(version_id)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Makes `owner/name` a fork of `source` at `version` (the same blob), with the
    /// source's validation. [`DbError::Conflict`] when `owner/name` exists.
    pub async fn fork(
        &self,
        source: &PackageRow,
        version: &VersionRow,
        user: &User,
        name: &str,
    ) -> Result<(), DbError> {
        let _turn = self.write_turn().await;
        let mut tx = self.pool.begin().await?;
        let now = now();
        let package_id: i64 = sqlx::query(
            "INSERT INTO packages (owner, name, owner_id, description, tags, readme, private, parent_id, parent_version, created_at, updated_at) \
             SELECT $1, $2, $3, description, tags, readme, private, id, $4, $5, $5 FROM packages WHERE id = $6 RETURNING id",
        )
        .bind(&user.name)
        .bind(name)
        .bind(user.id)
        .bind(&version.version)
        .bind(now)
        .bind(source.id)
        .fetch_one(&mut *tx)
        .await
        .map_err(conflict_or)?
        .try_get("id")?;
        let version_id: i64 = sqlx::query(
            "INSERT INTO versions (package_id, version, major, minor, patch, prerelease, sha256, size, manifest, spec, pushed_by, created_at) \
             SELECT $1, version, major, minor, patch, prerelease, sha256, size, manifest, spec, $2, $3 FROM versions WHERE id = $4 RETURNING id",
        )
        .bind(package_id)
        .bind(user.id)
        .bind(now)
        .bind(version.id)
        .fetch_one(&mut *tx)
        .await?
        .try_get("id")?;
        sqlx::query(
            "INSERT INTO validations (version_id, status, checks, updated_at) \
             SELECT $1, status, checks, $2 FROM validations WHERE version_id = $3",
        )
        .bind(version_id)
        .bind(now)
        .bind(version.id)
        .execute(&mut *tx)
        .await?;
        sqlx::query("INSERT INTO tags (package_id, tag, version_id) VALUES ($1, 'latest', $2)")
            .bind(package_id)
            .bind(version_id)
            .execute(&mut *tx)
            .await?;
        self.index(&mut tx, package_id).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Counts a download. On PostgreSQL the commit does not wait for the disk (a
    /// crash may lose the last few counts, never anything else): waiting made every
    /// pull pay for a WAL flush (bench/hub).
    pub async fn count_download(&self, package_id: i64) -> Result<(), DbError> {
        let _turn = self.write_turn().await;
        let mut tx = self.pool.begin().await?;
        if self.dialect == Dialect::Postgres {
            sqlx::query("SET LOCAL synchronous_commit TO OFF")
                .execute(&mut *tx)
                .await?;
        }
        sqlx::query("UPDATE packages SET downloads = downloads + 1 WHERE id = $1")
            .bind(package_id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    // ---- validation ----

    /// A version's validation: status and checks.
    pub async fn validation(
        &self,
        version_id: i64,
    ) -> Result<(String, Vec<ValidationCheck>), DbError> {
        let row = sqlx::query("SELECT status, checks FROM validations WHERE version_id = $1")
            .bind(version_id)
            .fetch_optional(&self.pool)
            .await?;
        let Some(row) = row else {
            return Ok(("pending".into(), Vec::new()));
        };
        let checks: String = row.try_get("checks")?;
        let checks = serde_json::from_str(&checks)
            .map_err(|e| DbError::Malformed(format!("validation checks: {e}")))?;
        Ok((row.try_get("status")?, checks))
    }

    /// Stores a version's validation.
    pub async fn set_validation(
        &self,
        version_id: i64,
        status: &str,
        checks: &[ValidationCheck],
    ) -> Result<(), DbError> {
        let _turn = self.write_turn().await;
        let checks = serde_json::to_string(checks).expect("checks serialize");
        sqlx::query("UPDATE validations SET status = $1, checks = $2, updated_at = $3 WHERE version_id = $4")
            .bind(status)
            .bind(checks)
            .bind(now())
            .bind(version_id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Versions whose validation never finished (the hub stopped while it ran).
    pub async fn pending_validations(&self) -> Result<Vec<i64>, DbError> {
        let rows = sqlx::query(
            "SELECT version_id FROM validations WHERE status = 'pending' ORDER BY version_id",
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(column(&rows, "version_id")?)
    }

    /// A version by row id, with its package's `owner/name`.
    pub async fn version_by_id(&self, version_id: i64) -> Result<Option<VersionRow>, DbError> {
        let row = sqlx::query(&format!(
            "SELECT {VERSION_COLUMNS} FROM versions v WHERE v.id = $1"
        ))
        .bind(version_id)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.as_ref().map(version_row).transpose()?)
    }

    // ---- search ----

    /// Searches public packages (and the viewer's private ones).
    pub async fn search(
        &self,
        q: &str,
        sort: SearchSort,
        limit: u32,
        offset: u32,
        viewer: Option<i64>,
    ) -> Result<Vec<SearchRow>, DbError> {
        let text = full_text_query(self.dialect, q);
        let columns = "p.owner, p.name, p.description, p.tags, p.downloads, \
             (SELECT v.version FROM tags t JOIN versions v ON v.id = t.version_id WHERE t.package_id = p.id AND t.tag = 'latest') AS latest, \
             p.best_score";
        // With a query its words are $1; the other parameters follow.
        let n = usize::from(text.is_some());
        let (viewer_p, limit_p, offset_p) = (n + 1, n + 2, n + 3);
        let visible = format!("(p.private = 0 OR p.owner_id = ${viewer_p})");
        let relevance = match (self.dialect, text.is_some()) {
            (Dialect::Sqlite, true) => "bm25(package_search, 5.0, 10.0, 3.0, 4.0, 1.0)",
            (Dialect::Postgres, true) => "ts_rank(p.search, query) DESC",
            (_, false) => "p.updated_at DESC",
        };
        let order = match sort {
            SearchSort::Relevance => relevance.to_owned(),
            SearchSort::Downloads => format!("p.downloads DESC, {relevance}"),
            SearchSort::Score => format!("best_score DESC NULLS LAST, {relevance}"),
        };
        let from = match (self.dialect, text.is_some()) {
            (Dialect::Sqlite, true) => {
                "package_search JOIN packages p ON p.id = package_search.rowid WHERE package_search MATCH $1 AND"
            }
            (Dialect::Postgres, true) => {
                "packages p, to_tsquery('simple', $1) query WHERE p.search @@ query AND"
            }
            (_, false) => "packages p WHERE",
        };
        let sql = format!(
            "SELECT {columns} FROM {from} {visible} ORDER BY {order}, p.id LIMIT ${limit_p} OFFSET ${offset_p}"
        );
        let mut query = sqlx::query(&sql);
        if let Some(text) = text {
            query = query.bind(text);
        }
        let rows = query
            .bind(viewer.unwrap_or(-1))
            .bind(i64::from(limit))
            .bind(i64::from(offset))
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| {
                Ok(SearchRow {
                    owner: r.try_get("owner")?,
                    name: r.try_get("name")?,
                    description: r.try_get("description")?,
                    tags: r.try_get("tags")?,
                    downloads: r.try_get("downloads")?,
                    latest: r.try_get("latest")?,
                    best_score: r.try_get("best_score")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(DbError::from)
    }

    // ---- leaderboards ----

    /// Adds a leaderboard entry.
    #[expect(clippy::too_many_arguments, reason = "one row's columns")]
    pub async fn post_result(
        &self,
        version_id: i64,
        user_id: i64,
        model: &str,
        score: f64,
        ci: [f64; 2],
        episodes: i64,
        harness: &str,
        details: &str,
    ) -> Result<(), DbError> {
        let _turn = self.write_turn().await;
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO leaderboard (version_id, user_id, model, score, ci_low, ci_high, episodes, harness, details, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
        )
        .bind(version_id)
        .bind(user_id)
        .bind(model)
        .bind(score)
        .bind(ci[0])
        .bind(ci[1])
        .bind(episodes)
        .bind(harness)
        .bind(details)
        .bind(now())
        .execute(&mut *tx)
        .await?;
        // The package's best score, kept for sorting search results by it.
        sqlx::query(
            "UPDATE packages SET best_score = $1 \
             WHERE id = (SELECT package_id FROM versions WHERE id = $2) AND (best_score IS NULL OR best_score < $1)",
        )
        .bind(score)
        .bind(version_id)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// A version's leaderboard, best score first.
    pub async fn leaderboard(
        &self,
        version_id: i64,
        limit: u32,
    ) -> Result<Vec<LeaderboardRow>, DbError> {
        let rows = sqlx::query(
            "SELECT u.name AS user_name, v.version, l.model, l.score, l.ci_low, l.ci_high, l.episodes, l.harness, l.details, l.created_at \
             FROM leaderboard l JOIN users u ON u.id = l.user_id JOIN versions v ON v.id = l.version_id \
             WHERE l.version_id = $1 ORDER BY l.score DESC, l.id LIMIT $2",
        )
        .bind(version_id)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(LeaderboardRow {
                    user: r.try_get("user_name")?,
                    version: r.try_get("version")?,
                    model: r.try_get("model")?,
                    score: r.try_get("score")?,
                    ci: [r.try_get("ci_low")?, r.try_get("ci_high")?],
                    episodes: r.try_get("episodes")?,
                    harness: r.try_get("harness")?,
                    details: r.try_get("details")?,
                    created_at: r.try_get("created_at")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(DbError::from)
    }

    // ---- garbage collection ----

    /// Forgets every upload in progress (at start, when none can be).
    pub async fn clear_uploads(&self) -> Result<u64, DbError> {
        let _turn = self.write_turn().await;
        Ok(sqlx::query("DELETE FROM uploads")
            .execute(&self.pool)
            .await?
            .rows_affected())
    }

    /// Every blob a version or an upload in progress refers to.
    pub async fn referenced_blobs(&self) -> Result<HashSet<String>, DbError> {
        let rows = sqlx::query("SELECT sha256 FROM versions UNION SELECT sha256 FROM uploads")
            .fetch_all(&self.pool)
            .await?;
        Ok(column(&rows, "sha256")?)
    }

    /// Row counts of every table (for tests and `hub info`).
    pub async fn counts(&self) -> Result<Vec<(String, i64)>, DbError> {
        let mut out = Vec::new();
        for table in [
            "users",
            "packages",
            "versions",
            "tags",
            "validations",
            "leaderboard",
            "uploads",
        ] {
            let n: i64 = sqlx::query(&format!("SELECT COUNT(*) AS n FROM {table}"))
                .fetch_one(&self.pool)
                .await?
                .try_get("n")?;
            out.push((table.to_owned(), n));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(path: &std::path::Path) -> u32 {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    #[tokio::test]
    async fn the_sqlite_files_are_private_to_the_hub_user() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("hub.db");
        let url = format!("sqlite://{}", file.display());
        let db = Db::connect(&url).await.unwrap();
        db.create_user("alice").await.unwrap();
        for suffix in ["", "-wal", "-shm"] {
            let path = dir.path().join(format!("hub.db{suffix}"));
            assert_eq!(mode(&path), 0o600, "{}", path.display());
        }
        drop(db);
        // Files an older hub left open to all are tightened at start.
        for suffix in ["", "-wal", "-shm"] {
            let path = dir.path().join(format!("hub.db{suffix}"));
            if path.exists() {
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
            }
        }
        let db = Db::connect(&url).await.unwrap();
        assert!(db.user("alice").await.unwrap().is_some());
        for suffix in ["", "-wal", "-shm"] {
            let path = dir.path().join(format!("hub.db{suffix}"));
            if path.exists() {
                assert_eq!(mode(&path), 0o600, "{}", path.display());
            }
        }
    }

    #[test]
    fn search_words_never_carry_query_syntax() {
        assert_eq!(
            full_text_query(Dialect::Sqlite, "Coding* OR \"x\" NEAR(a)").as_deref(),
            Some("\"coding\"* \"or\"* \"x\"* \"near\"* \"a\"*")
        );
        assert_eq!(
            full_text_query(Dialect::Postgres, "board game!").as_deref(),
            Some("board:* & game:*")
        );
        assert_eq!(full_text_query(Dialect::Sqlite, " ;- "), None);
    }
}
