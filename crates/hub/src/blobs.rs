//! Package bytes, content-addressed by sha256 through `object_store` (a local directory
//! by default; any store `object_store` speaks at scale). A blob is written once under
//! its hash and never changed; reads check the hash.

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
    /// Creating the store's directory failed.
    #[error("{path}: {source}")]
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
    /// A store in a local directory (created when missing).
    pub fn local(dir: &Path) -> Result<Self, BlobError> {
        std::fs::create_dir_all(dir).map_err(|source| BlobError::Io {
            path: dir.to_owned(),
            source,
        })?;
        let store = LocalFileSystem::new_with_prefix(dir)?;
        Ok(Self {
            store: Arc::new(store),
            local_root: Some(dir.to_owned()),
        })
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
        let key = key(sha256);
        if self.store.head(&key).await.is_ok() {
            return Ok(());
        }
        self.store.put(&key, PutPayload::from(bytes)).await?;
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
        }
        Ok(removed)
    }
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
