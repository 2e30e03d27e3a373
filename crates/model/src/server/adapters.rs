//! `/v1/adapters`: LoRA adapters loaded by name from files inside the server's adapter
//! directory, listed and unloaded.
//!
//! A client names a file; the server opens it only if its canonical path lies inside
//! the adapter directory's, and only a regular file (opened without following a final
//! symlink and without blocking, then checked on the open descriptor). Every refusal
//! about the file itself (missing, a directory, a FIFO or device, unreadable, outside
//! the directory, the wrong size) gives the client one and the same message, so that
//! the route cannot be used to learn which files exist on the server; the cause is
//! logged at debug level.

use std::fs::File;
use std::path::{Path, PathBuf};

use agentstack_static::with_causes;
use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde_json::json;

use super::{ApiError, ApiJson, AppState};
use crate::adapter::{Adapter, AdapterFileError};
use crate::error::ModelError;

/// The one message for every refusal that concerns the adapter file.
pub(super) const NOT_LOADABLE: &str =
    "`path` does not name a loadable adapter file inside the server's adapter directory";

/// The longest adapter name.
const MAX_ADAPTER_NAME: usize = 128;

/// `POST /v1/adapters`: load LoRA adapters from a file under a name, or replace the
/// weights of the adapter of that name.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct LoadAdapter {
    /// The name requests pick it by (`model`).
    name: String,
    /// A safetensors file written by `agentstack train` (`adapter.safetensors`),
    /// relative to the adapter directory or absolute inside it.
    path: PathBuf,
}

/// Why a file was refused (logged, never sent: see [`NOT_LOADABLE`]).
#[derive(Debug, thiserror::Error)]
enum Refusal {
    #[error("the adapter directory {} cannot be resolved", dir.display())]
    Directory {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the path cannot be resolved")]
    Resolve(#[source] std::io::Error),
    #[error("{} lies outside the adapter directory", .0.display())]
    Outside(PathBuf),
    #[error("{} cannot be opened", .0.display())]
    Open(PathBuf, #[source] std::io::Error),
    #[error("{} is not a regular file", .0.display())]
    NotAFile(PathBuf),
    #[error("{} was replaced while it was opened", .0.display())]
    Moved(PathBuf),
    #[error(transparent)]
    File(AdapterFileError),
}

/// Opens `requested` (relative to `dir`, or absolute) if it is a regular file whose
/// canonical path lies inside `dir`'s. Returns the file and its canonical path.
fn open_inside(dir: &Path, requested: &Path) -> Result<(File, PathBuf), Refusal> {
    let dir = dir.canonicalize().map_err(|source| Refusal::Directory {
        dir: dir.to_path_buf(),
        source,
    })?;
    // A relative path is joined to the directory; `..` and symlinks are resolved by
    // canonicalizing, and what escapes is refused by the prefix check.
    let canonical = dir
        .join(requested)
        .canonicalize()
        .map_err(Refusal::Resolve)?;
    if !canonical.starts_with(&dir) {
        return Err(Refusal::Outside(canonical));
    }
    let file = open_regular(&canonical)?;
    // A directory on the way could have been swapped for a symlink between
    // canonicalizing and opening: check what was opened.
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let opened = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))
            .map_err(|e| Refusal::Open(canonical.clone(), e))?;
        if opened != canonical {
            return Err(Refusal::Moved(canonical));
        }
    }
    Ok((file, canonical))
}

/// Opens `path` read-only without following a final symlink and without blocking (a
/// FIFO would otherwise wait for a writer), and checks on the open descriptor (not by
/// a second lookup of the name) that it is a regular file.
fn open_regular(path: &Path) -> Result<File, Refusal> {
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK);
    }
    let file = options
        .open(path)
        .map_err(|e| Refusal::Open(path.to_path_buf(), e))?;
    let metadata = file
        .metadata()
        .map_err(|e| Refusal::Open(path.to_path_buf(), e))?;
    if !metadata.is_file() {
        return Err(Refusal::NotAFile(path.to_path_buf()));
    }
    Ok(file)
}

/// Reads the adapters `requested` names, from inside `dir`, for `model`.
fn read_adapter(dir: &Path, requested: &Path, model: &crate::Model) -> Result<Adapter, Refusal> {
    let (mut file, canonical) = open_inside(dir, requested)?;
    Adapter::read(&mut file, &canonical, model).map_err(Refusal::File)
}

pub(super) async fn load_adapter(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<LoadAdapter>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let Some(dir) = state.config.adapter_dir.clone() else {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "permission_error",
            "loading adapters is turned off on this server\nhint: start it with --adapter-dir DIR (the trainer's runs directory) to load adapter files from inside DIR",
        ));
    };
    let name = body.name.trim();
    if name.is_empty()
        || name.len() > MAX_ADAPTER_NAME
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.:/".contains(c))
    {
        return Err(ApiError::invalid(
            "name",
            format!(
                "`{name}` is not a usable adapter name; use 1 to {MAX_ADAPTER_NAME} letters, digits, `-`, `_`, `.`, `:` or `/`"
            ),
        ));
    }
    if name == state.config.model_name {
        return Err(ApiError::invalid(
            "name",
            format!("`{name}` is the base model's name; pick another name for the adapter"),
        ));
    }
    let started = std::time::Instant::now();
    let engine = state.engine.clone();
    let requested = body.path;
    let model = tokio::task::spawn_blocking(move || {
        let base = engine.model().model();
        match read_adapter(&dir, &requested, base) {
            Ok(adapter) => adapter.apply(base).map_err(told),
            // What is wrong with a readable file's tensors is told.
            Err(Refusal::File(AdapterFileError::Invalid(e))) => Err(told(e)),
            Err(refusal) => {
                tracing::debug!(
                    path = %requested.display(),
                    cause = %with_causes(&refusal),
                    "adapter file refused"
                );
                Err(ApiError::invalid("path", NOT_LOADABLE))
            }
        }
    })
    .await
    .map_err(|e| ApiError::from(ModelError::InvalidRequest(format!("loading failed: {e}"))))??;
    let version = state.engine.set_adapter(name, model);
    let load_ms = started.elapsed().as_secs_f64() * 1e3;
    tracing::info!(name, version, load_ms, "adapter loaded");
    Ok(Json(
        json!({"name": name, "version": version, "load_ms": load_ms}),
    ))
}

/// A model error about the adapters, as a 400 under `path` when it is the request's.
fn told(error: ModelError) -> ApiError {
    match error {
        ModelError::InvalidRequest(message) => ApiError::invalid("path", message),
        other => other.into(),
    }
}

pub(super) async fn list_adapters(State(state): State<AppState>) -> Json<serde_json::Value> {
    let data: Vec<_> = state
        .engine
        .adapters()
        .into_iter()
        .map(|a| json!({"name": a.name, "version": a.version}))
        .collect();
    Json(json!({"object": "list", "data": data}))
}

pub(super) async fn unload_adapter(
    State(state): State<AppState>,
    axum::extract::Path(name): axum::extract::Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    if state.engine.remove_adapter(&name) {
        Ok(Json(json!({"name": name, "deleted": true})))
    } else {
        Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found_error",
            format!("no adapter named `{name}` is loaded; GET /v1/adapters lists them"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The checks that need no model: what is outside, not a file, or missing is
    /// refused before anything is read.
    #[test]
    fn only_regular_files_inside_the_directory_open() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("runs");
        std::fs::create_dir_all(dir.join("run/sub")).unwrap();
        std::fs::write(dir.join("run/adapter.safetensors"), b"x").unwrap();
        std::fs::write(root.path().join("secret"), b"x").unwrap();
        std::os::unix::fs::symlink(root.path().join("secret"), dir.join("escape")).unwrap();
        std::os::unix::fs::symlink(dir.join("run/adapter.safetensors"), dir.join("inside"))
            .unwrap();
        let made = std::process::Command::new("mkfifo")
            .arg(dir.join("fifo"))
            .status()
            .unwrap();
        assert!(made.success());

        let opens = |p: &Path| open_inside(&dir, p).map(|(_, c)| c);
        let inside = dir.canonicalize().unwrap().join("run/adapter.safetensors");
        assert_eq!(opens(Path::new("run/adapter.safetensors")).unwrap(), inside);
        assert_eq!(opens(&dir.join("run/adapter.safetensors")).unwrap(), inside);
        assert_eq!(
            opens(Path::new("run/sub/../adapter.safetensors")).unwrap(),
            inside
        );
        assert_eq!(opens(Path::new("inside")).unwrap(), inside);
        for (path, what) in [
            (Path::new("../secret"), "outside"),
            (&root.path().join("secret"), "outside"),
            (Path::new("escape"), "outside"),
            (Path::new("/dev/zero"), "outside"),
            (Path::new("run"), "not a regular file"),
            (Path::new("fifo"), "not a regular file"),
            (Path::new("missing"), "cannot be resolved"),
        ] {
            let refusal = opens(path).unwrap_err().to_string();
            assert!(refusal.contains(what), "{}: {refusal}", path.display());
        }
    }
}
