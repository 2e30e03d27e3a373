//! Package bytes, content-addressed by sha256 through `object_store` (a local directory
//! by default; any store `object_store` speaks at scale). A blob is written once under
//! its hash and never changed; reads check the hash.
//!
//! A local store is private to the hub's user: its directories are 0700 and its blobs
//! 0600 (tightened at start on a directory an older hub left open). Uploads are
//! staged in `staging/` beside the blobs and renamed into place.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures_util::TryStreamExt;
use object_store::local::LocalFileSystem;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use sha2::{Digest, Sha256};

/// What can go wrong with blobs.
#[derive(Debug, thiserror::Error)]
pub enum BlobError {
    /// The store failed.
    #[error("blob store error")]
    Store(#[from] object_store::Error),
    /// A blob's bytes do not hash to its name.
    #[error("blob {expected} is corrupt: its bytes hash to {actual}")]
    Corrupt {
        /// Its name.
        expected: String,
        /// What its bytes hash to.
        actual: String,
    },
    /// Reading or writing the store failed.
    #[error("cannot read or write {path}")]
    Io {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// sha256 of `bytes`, hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Mode of the local store's directories: the hub's user only.
const PRIVATE_DIR_MODE: u32 = 0o700;
/// Mode of the local store's files.
const PRIVATE_FILE_MODE: u32 = 0o600;
/// Where uploads are staged inside a local store (never listed as blobs).
const STAGING_DIR: &str = "staging";
/// How much of a staged file goes to a remote store at once.
const UPLOAD_PART_BYTES: usize = 8 << 20;

/// The blob store.
#[derive(Clone)]
pub struct Blobs {
    store: Arc<dyn ObjectStore>,
    /// The directory of a local store (staged writes that a kill left behind are
    /// cleaned from it).
    local_root: Option<PathBuf>,
}

fn key(sha256: &str) -> ObjectPath {
    ObjectPath::from(format!(
        "sha256/{}/{sha256}",
        &sha256[..2.min(sha256.len())]
    ))
}

impl Blobs {
    /// A store in a local directory (created when missing), made private to this
    /// user: directories 0700, files 0600, whatever modes they had.
    pub fn local(dir: &Path) -> Result<Self, BlobError> {
        let io = |path: &Path| {
            let path = path.to_owned();
            move |source| BlobError::Io { path, source }
        };
        private_dir(dir).map_err(io(dir))?;
        tighten(dir).map_err(io(dir))?;
        let staging = dir.join(STAGING_DIR);
        private_dir(&staging).map_err(io(&staging))?;
        let store = LocalFileSystem::new_with_prefix(dir)?;
        Ok(Self {
            store: Arc::new(store),
            local_root: Some(dir.to_owned()),
        })
    }

    /// Where an upload is staged before [`Blobs::put_file`]: inside a local store
    /// (the same file system, so the blob is a rename), else the system's temporary
    /// directory.
    pub fn staging_dir(&self) -> PathBuf {
        match &self.local_root {
            Some(root) => root.join(STAGING_DIR),
            None => std::env::temp_dir(),
        }
    }

    /// Any `object_store` store.
    pub fn new(store: Arc<dyn ObjectStore>) -> Self {
        Self {
            store,
            local_root: None,
        }
    }

    /// Stores `bytes` under their sha256 (a no-op when present). The local store
    /// writes a staging file and renames it, so a kill never leaves a partial blob.
    pub async fn put(&self, sha256: &str, bytes: bytes::Bytes) -> Result<(), BlobError> {
        if self.local_root.is_none() {
            let key = key(sha256);
            if self.store.head(&key).await.is_err() {
                self.store.put(&key, PutPayload::from(bytes)).await?;
            }
            return Ok(());
        }
        let staging = self.staging_dir();
        let staged = tokio::task::spawn_blocking(move || {
            let mut file =
                tempfile::NamedTempFile::new_in(&staging).map_err(|source| BlobError::Io {
                    path: staging.clone(),
                    source,
                })?;
            std::io::Write::write_all(&mut file, &bytes).map_err(|source| BlobError::Io {
                path: file.path().to_owned(),
                source,
            })?;
            Ok::<_, BlobError>(file.into_temp_path())
        })
        .await
        .expect("writing a staging file does not panic")?;
        self.put_file(sha256, staged).await
    }

    /// Stores the staged file `staged` (whose bytes hash to `sha256`) under its
    /// hash: a rename in a local store, an upload in parts otherwise. The staging
    /// file is gone afterwards either way.
    pub async fn put_file(
        &self,
        sha256: &str,
        staged: tempfile::TempPath,
    ) -> Result<(), BlobError> {
        let key = key(sha256);
        if self.store.head(&key).await.is_ok() {
            return Ok(());
        }
        if let Some(target) = self.local_path(sha256) {
            let io = |path: &Path| {
                let path = path.to_owned();
                move |source| BlobError::Io { path, source }
            };
            let dir = target.parent().expect("a blob path has a folder");
            private_dir(dir).map_err(io(dir))?;
            set_mode(&staged, PRIVATE_FILE_MODE).map_err(io(&staged))?;
            staged.persist(&target).map_err(|e| BlobError::Io {
                path: target.clone(),
                source: e.error,
            })?;
            return Ok(());
        }
        let mut upload = object_store::WriteMultipart::new_with_chunk_size(
            self.store.put_multipart(&key).await?,
            UPLOAD_PART_BYTES,
        );
        let mut file = std::fs::File::open(&staged).map_err(|source| BlobError::Io {
            path: staged.to_path_buf(),
            source,
        })?;
        let mut buffer = vec![0; UPLOAD_PART_BYTES];
        loop {
            let n =
                std::io::Read::read(&mut file, &mut buffer).map_err(|source| BlobError::Io {
                    path: staged.to_path_buf(),
                    source,
                })?;
            if n == 0 {
                break;
            }
            upload.wait_for_capacity(2).await?;
            upload.write(&buffer[..n]);
        }
        upload.finish().await?;
        Ok(())
    }

    /// Reads a blob and checks its hash.
    pub async fn get(&self, sha256: &str) -> Result<bytes::Bytes, BlobError> {
        let bytes = self.store.get(&key(sha256)).await?.bytes().await?;
        let actual = sha256_hex(&bytes);
        if actual != sha256 {
            return Err(BlobError::Corrupt {
                expected: sha256.to_owned(),
                actual,
            });
        }
        Ok(bytes)
    }

    /// The local path of a blob, for a local store (tests corrupt blobs through it).
    pub fn local_path(&self, sha256: &str) -> Option<PathBuf> {
        self.local_root
            .as_ref()
            .map(|root| root.join(key(sha256).as_ref()))
    }

    /// Every blob's hash.
    pub async fn list(&self) -> Result<Vec<String>, BlobError> {
        let prefix = ObjectPath::from("sha256");
        let metas: Vec<_> = self.store.list(Some(&prefix)).try_collect().await?;
        Ok(metas
            .into_iter()
            .filter_map(|m| m.location.filename().map(str::to_owned))
            .filter(|name| name.len() == 64 && name.bytes().all(|b| b.is_ascii_hexdigit()))
            .collect())
    }

    /// Deletes a blob.
    pub async fn delete(&self, sha256: &str) -> Result<(), BlobError> {
        match self.store.delete(&key(sha256)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Deletes every blob not in `keep`, and the staging files of writes a kill cut
    /// short. Returns how many blobs and staging files went.
    pub async fn collect_garbage(
        &self,
        keep: &std::collections::HashSet<String>,
    ) -> Result<usize, BlobError> {
        let mut removed = 0;
        for sha in self.list().await? {
            if !keep.contains(&sha) {
                self.delete(&sha).await?;
                removed += 1;
            }
        }
        if let Some(root) = &self.local_root {
            removed += remove_staging_files(&root.join("sha256"));
            // Uploads a kill cut short (none is in flight when this runs at start).
            if let Ok(entries) = std::fs::read_dir(root.join(STAGING_DIR)) {
                for entry in entries.flatten() {
                    if std::fs::remove_file(entry.path()).is_ok() {
                        removed += 1;
                    }
                }
            }
        }
        Ok(removed)
    }
}

fn set_mode(path: &Path, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}

/// Creates `dir` (and missing parents inside the store) with mode 0700, and makes an
/// existing one 0700.
fn private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(PRIVATE_DIR_MODE)
        .create(dir)?;
    set_mode(dir, PRIVATE_DIR_MODE)
}

/// Makes everything under `dir` private: folders 0700, files 0600 (a store an
/// older hub wrote with the default modes).
fn tighten(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        let path = entry.path();
        if meta.is_dir() {
            if meta.permissions().mode() & 0o7777 != PRIVATE_DIR_MODE {
                set_mode(&path, PRIVATE_DIR_MODE)?;
            }
            tighten(&path)?;
        } else if meta.is_file() && meta.permissions().mode() & 0o077 != 0 {
            set_mode(&path, PRIVATE_FILE_MODE)?;
        }
    }
    Ok(())
}

/// object_store's local store stages a write as `<name>#<n>` before renaming it.
fn remove_staging_files(dir: &Path) -> usize {
    let mut removed = 0;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            removed += remove_staging_files(&path);
        } else if entry.file_name().to_string_lossy().contains('#')
            && std::fs::remove_file(&path).is_ok()
        {
            removed += 1;
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(path: &Path) -> u32 {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    #[tokio::test]
    async fn a_local_store_is_private_to_the_hub_user() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("blobs");
        // A store an older hub left with the default modes.
        let old = root.join("sha256/ab");
        std::fs::create_dir_all(&old).unwrap();
        set_mode(&root, 0o755).unwrap();
        set_mode(&old, 0o755).unwrap();
        std::fs::write(old.join("ab00"), b"old").unwrap();
        set_mode(&old.join("ab00"), 0o644).unwrap();
        let blobs = Blobs::local(&root).unwrap();
        assert_eq!(mode(&root), 0o700);
        assert_eq!(mode(&old), 0o700);
        assert_eq!(mode(&old.join("ab00")), 0o600);
        let bytes = bytes::Bytes::from_static(b"new package");
        let sha = sha256_hex(&bytes);
        blobs.put(&sha, bytes).await.unwrap();
        let path = blobs.local_path(&sha).unwrap();
        assert_eq!(mode(&path), 0o600);
        assert_eq!(mode(path.parent().unwrap()), 0o700);
        assert_eq!(mode(&blobs.staging_dir()), 0o700);
    }

    #[tokio::test]
    async fn blobs_round_trip_and_corruption_is_caught() {
        let dir = tempfile::tempdir().unwrap();
        let blobs = Blobs::local(dir.path()).unwrap();
        let bytes = bytes::Bytes::from_static(b"package bytes");
        let sha = sha256_hex(&bytes);
        blobs.put(&sha, bytes.clone()).await.unwrap();
        assert_eq!(blobs.get(&sha).await.unwrap(), bytes);
        assert_eq!(blobs.list().await.unwrap(), vec![sha.clone()]);
        std::fs::write(blobs.local_path(&sha).unwrap(), b"package bytez").unwrap();
        assert!(matches!(
            blobs.get(&sha).await,
            Err(BlobError::Corrupt { .. })
        ));
        let staged = blobs
            .local_path(&sha)
            .unwrap()
            .with_file_name(format!("{sha}#1"));
        std::fs::write(&staged, b"half").unwrap();
        assert_eq!(blobs.collect_garbage(&Default::default()).await.unwrap(), 2);
        assert!(blobs.list().await.unwrap().is_empty() && !staged.exists());
    }
}
