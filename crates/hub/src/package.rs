//! An environment package: a directory with an `openenv.yaml`, packed into a gzipped
//! tar whose bytes depend only on the files' paths, contents and executable bits (same
//! tree → same bytes → same sha256), with a manifest of every file and its hash.
//!
//! `openenv.yaml` keeps OpenEnv's keys as they are; ours live under `agentstack:`
//! (how to serve the package, its reward range, the resources it needs).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The manifest's path inside a packed package.
pub const MANIFEST_PATH: &str = ".agentstack/manifest.json";

/// The most bytes a package may hold, unpacked.
pub const MAX_PACKAGE_BYTES: u64 = 512 << 20;
/// The most files a package may hold.
pub const MAX_PACKAGE_FILES: usize = 20_000;

/// Directories and files never packed: version control, caches, build output,
/// virtual environments.
const IGNORED: &[&str] = &[
    ".git",
    ".hg",
    ".svn",
    "__pycache__",
    ".pytest_cache",
    ".mypy_cache",
    ".ruff_cache",
    ".venv",
    "venv",
    "target",
    "node_modules",
    ".DS_Store",
];

/// What can go wrong with a package.
#[derive(Debug, thiserror::Error)]
pub enum PackageError {
    /// Reading or writing files failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// `openenv.yaml` is missing or malformed.
    #[error("{path}: {message}")]
    Manifest {
        /// The file.
        path: PathBuf,
        /// What is wrong and how to fix it.
        message: String,
    },
    /// The directory holds something a package cannot.
    #[error("{0}")]
    Content(String),
    /// A packed package is malformed or does not match its manifest.
    #[error("corrupt package: {0}")]
    Corrupt(String),
}

/// Our part of `openenv.yaml`, under the key `agentstack`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentstackSection {
    /// The command that serves the environment (`{port}` is replaced), when it is not
    /// a Python OpenEnv package served through `app`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serve: Option<String>,
    /// The lowest and highest reward a step can give.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reward_range: Option<[f64; 2]>,
    /// What one session needs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<Resources>,
}

/// Resources one session of the environment needs.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Resources {
    /// CPU cores.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<f64>,
    /// Memory in MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mb: Option<u64>,
    /// GPUs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpus: Option<u32>,
}

/// A package's `openenv.yaml`: the keys we read, and every other key kept as it is.
#[derive(Debug, Clone, PartialEq)]
pub struct PackageSpec {
    /// `name`.
    pub name: String,
    /// `version`, when given.
    pub version: Option<String>,
    /// `description`, when given.
    pub description: Option<String>,
    /// `agentstack:`.
    pub agentstack: AgentstackSection,
    /// The whole document.
    pub document: serde_norway::Value,
}

impl PackageSpec {
    /// Parses `openenv.yaml` text; `path` names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self, PackageError> {
        let bad = |message: String| PackageError::Manifest {
            path: path.to_owned(),
            message,
        };
        let document: serde_norway::Value =
            serde_norway::from_str(text).map_err(|e| bad(format!("not valid YAML: {e}")))?;
        let map = document
            .as_mapping()
            .ok_or_else(|| bad("expected a mapping of keys (name: ..., version: ...)".into()))?;
        let text_key = |key: &str| -> Result<Option<String>, PackageError> {
            match map.get(key) {
                None | Some(serde_norway::Value::Null) => Ok(None),
                Some(serde_norway::Value::String(s)) => Ok(Some(s.clone())),
                Some(serde_norway::Value::Number(n)) => Ok(Some(n.to_string())),
                Some(_) => Err(bad(format!("`{key}` must be a string"))),
            }
        };
        let name = text_key("name")?
            .filter(|n| !n.trim().is_empty())
            .ok_or_else(|| bad("`name` is required".into()))?;
        let agentstack = match map.get("agentstack") {
            None | Some(serde_norway::Value::Null) => AgentstackSection::default(),
            Some(value) => serde_norway::from_value(value.clone()).map_err(|e| {
                bad(format!(
                    "`agentstack`: {e} (allowed keys: serve, reward_range, resources)"
                ))
            })?,
        };
        if let Some([low, high]) = agentstack.reward_range
            && !(low.is_finite() && high.is_finite() && low < high)
        {
            return Err(bad(format!(
                "`agentstack.reward_range` [{low}, {high}] must be two finite numbers, low < high"
            )));
        }
        Ok(Self {
            version: text_key("version")?,
            description: text_key("description")?,
            name,
            agentstack,
            document,
        })
    }

    /// Reads `dir/openenv.yaml`.
    pub fn read(dir: &Path) -> Result<Self, PackageError> {
        let path = dir.join("openenv.yaml");
        let text = std::fs::read_to_string(&path).map_err(|source| match source.kind() {
            std::io::ErrorKind::NotFound => PackageError::Manifest {
                path: path.clone(),
                message: "missing: a package is a directory with an openenv.yaml (`agentstack env init` makes one)".into(),
            },
            _ => PackageError::Io {
                path: path.clone(),
                source,
            },
        })?;
        Self::parse(&text, &path)
    }
}

/// One file of a package.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    /// `/`-separated path relative to the package root.
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// sha256 of the contents, hex.
    pub sha256: String,
    /// Whether it is executable.
    pub executable: bool,
}

/// The list of a package's files, stored in the package and beside it in the registry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Format version.
    pub format: u32,
    /// The package's name (from `openenv.yaml`).
    pub name: String,
    /// Every file, sorted by path (the manifest itself excluded).
    pub files: Vec<FileEntry>,
}

/// A package's files: path → (contents, executable).
pub type Files = BTreeMap<String, (Vec<u8>, bool)>;

/// A packed package.
#[derive(Debug, Clone)]
pub struct Packed {
    /// The `.tar.gz` bytes.
    pub bytes: Vec<u8>,
    /// Their sha256, hex: the package's identity.
    pub sha256: String,
    /// What is inside.
    pub manifest: Manifest,
    /// `openenv.yaml`.
    pub spec: PackageSpec,
}

fn hex_sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> PackageError + '_ {
    move |source| PackageError::Io {
        path: path.to_owned(),
        source,
    }
}

/// The files of `dir` to pack: relative path → (contents, executable).
fn collect(
    root: &Path,
    dir: &Path,
    out: &mut BTreeMap<String, (Vec<u8>, bool)>,
    total: &mut u64,
) -> Result<(), PackageError> {
    use std::os::unix::fs::PermissionsExt;
    let entries = std::fs::read_dir(dir).map_err(io_error(dir))?;
    for entry in entries {
        let entry = entry.map_err(io_error(dir))?;
        let name = entry.file_name();
        let name = name.to_str().ok_or_else(|| {
            PackageError::Content(format!(
                "{}: file names must be UTF-8",
                entry.path().display()
            ))
        })?;
        if IGNORED.contains(&name) || name.ends_with(".pyc") {
            continue;
        }
        let path = entry.path();
        let meta = std::fs::symlink_metadata(&path).map_err(io_error(&path))?;
        if meta.file_type().is_symlink() {
            return Err(PackageError::Content(format!(
                "{}: symbolic links cannot be packed; copy the file in instead",
                path.display()
            )));
        }
        if meta.is_dir() {
            collect(root, &path, out, total)?;
        } else if meta.is_file() {
            let relative = path
                .strip_prefix(root)
                .expect("walked from root")
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join("/");
            if relative == MANIFEST_PATH {
                continue;
            }
            *total += meta.len();
            if *total > MAX_PACKAGE_BYTES || out.len() >= MAX_PACKAGE_FILES {
                return Err(PackageError::Content(format!(
                    "{} is larger than a package may be ({MAX_PACKAGE_BYTES} bytes, {MAX_PACKAGE_FILES} files)",
                    root.display()
                )));
            }
            let contents = std::fs::read(&path).map_err(io_error(&path))?;
            out.insert(relative, (contents, meta.permissions().mode() & 0o111 != 0));
        } else {
            return Err(PackageError::Content(format!(
                "{}: only regular files and directories can be packed",
                path.display()
            )));
        }
    }
    Ok(())
}

fn tar_header(path: &str, size: u64, executable: bool) -> Result<tar::Header, PackageError> {
    let mut header = tar::Header::new_ustar();
    header
        .set_path(path)
        .map_err(|e| PackageError::Content(format!("{path}: {e}")))?;
    header.set_size(size);
    header.set_mode(if executable { 0o755 } else { 0o644 });
    header.set_mtime(0);
    header.set_uid(0);
    header.set_gid(0);
    header.set_entry_type(tar::EntryType::Regular);
    header.set_cksum();
    Ok(header)
}

/// Packs the package in `dir`.
pub fn pack(dir: &Path) -> Result<Packed, PackageError> {
    let spec = PackageSpec::read(dir)?;
    let mut files = BTreeMap::new();
    collect(dir, dir, &mut files, &mut 0)?;
    let manifest = Manifest {
        format: 1,
        name: spec.name.clone(),
        files: files
            .iter()
            .map(|(path, (contents, executable))| FileEntry {
                path: path.clone(),
                size: contents.len() as u64,
                sha256: hex_sha256(contents),
                executable: *executable,
            })
            .collect(),
    };
    let manifest_json = serde_json::to_vec_pretty(&manifest).expect("manifests serialize");
    // gzip without a name or a time stamp, so only the contents decide the bytes.
    let gz = flate2::GzBuilder::new()
        .mtime(0)
        .write(Vec::new(), flate2::Compression::new(6));
    let mut archive = tar::Builder::new(gz);
    archive.mode(tar::HeaderMode::Deterministic);
    let mut append = |path: &str, contents: &[u8], executable: bool| -> Result<(), PackageError> {
        let header = tar_header(path, contents.len() as u64, executable)?;
        archive
            .append(&header, contents)
            .map_err(|e| PackageError::Content(format!("packing {path}: {e}")))
    };
    append(MANIFEST_PATH, &manifest_json, false)?;
    for (path, (contents, executable)) in &files {
        append(path, contents, *executable)?;
    }
    let gz = archive
        .into_inner()
        .map_err(|e| PackageError::Content(format!("finishing the archive: {e}")))?;
    let bytes = gz
        .finish()
        .map_err(|e| PackageError::Content(format!("finishing the archive: {e}")))?;
    Ok(Packed {
        sha256: hex_sha256(&bytes),
        bytes,
        manifest,
        spec,
    })
}

/// Checks a path from an archive: relative, `/`-separated, no `..`.
fn safe_path(path: &Path) -> Result<String, PackageError> {
    let mut parts = Vec::new();
    for component in path.components() {
        match component {
            Component::Normal(part) => parts.push(
                part.to_str()
                    .ok_or_else(|| {
                        PackageError::Corrupt(format!("{} is not UTF-8", path.display()))
                    })?
                    .to_owned(),
            ),
            Component::CurDir => {}
            _ => {
                return Err(PackageError::Corrupt(format!(
                    "{} escapes the package",
                    path.display()
                )));
            }
        }
    }
    if parts.is_empty() {
        return Err(PackageError::Corrupt("an entry has an empty path".into()));
    }
    Ok(parts.join("/"))
}

/// Reads a packed package, checking every file against the manifest; returns the
/// manifest and the files.
pub fn read_packed(bytes: &[u8]) -> Result<(Manifest, Files), PackageError> {
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(bytes));
    let mut files = BTreeMap::new();
    let mut manifest: Option<Manifest> = None;
    let mut total = 0u64;
    let entries = archive
        .entries()
        .map_err(|e| PackageError::Corrupt(format!("not a gzipped tar: {e}")))?;
    for entry in entries {
        let mut entry =
            entry.map_err(|e| PackageError::Corrupt(format!("reading an entry: {e}")))?;
        let header = entry.header();
        if header.entry_type() != tar::EntryType::Regular {
            return Err(PackageError::Corrupt(
                "only regular files may be in a package".into(),
            ));
        }
        let size = header
            .size()
            .map_err(|e| PackageError::Corrupt(e.to_string()))?;
        total += size;
        if total > MAX_PACKAGE_BYTES || files.len() >= MAX_PACKAGE_FILES {
            return Err(PackageError::Corrupt(format!(
                "larger than {MAX_PACKAGE_BYTES} bytes or {MAX_PACKAGE_FILES} files"
            )));
        }
        let executable = header
            .mode()
            .map_err(|e| PackageError::Corrupt(e.to_string()))?
            & 0o111
            != 0;
        let path = safe_path(
            &entry
                .path()
                .map_err(|e| PackageError::Corrupt(e.to_string()))?,
        )?;
        // The header's size is untrusted: grow as bytes actually arrive.
        let mut contents = Vec::with_capacity(size.min(1 << 20) as usize);
        entry
            .read_to_end(&mut contents)
            .map_err(|e| PackageError::Corrupt(format!("{path}: {e}")))?;
        if path == MANIFEST_PATH {
            manifest = Some(
                serde_json::from_slice(&contents)
                    .map_err(|e| PackageError::Corrupt(format!("{MANIFEST_PATH}: {e}")))?,
            );
        } else if files.insert(path.clone(), (contents, executable)).is_some() {
            return Err(PackageError::Corrupt(format!("{path} appears twice")));
        }
    }
    let manifest =
        manifest.ok_or_else(|| PackageError::Corrupt(format!("{MANIFEST_PATH} is missing")))?;
    let listed: BTreeMap<&str, &FileEntry> = manifest
        .files
        .iter()
        .map(|f| (f.path.as_str(), f))
        .collect();
    if listed.len() != files.len()
        || listed
            .keys()
            .zip(files.keys())
            .any(|(a, b)| *a != b.as_str())
    {
        return Err(PackageError::Corrupt(
            "the files do not match the manifest's list".into(),
        ));
    }
    for (path, (contents, executable)) in &files {
        let entry = listed[path.as_str()];
        if entry.size != contents.len() as u64
            || entry.sha256 != hex_sha256(contents)
            || entry.executable != *executable
        {
            return Err(PackageError::Corrupt(format!(
                "{path} does not match its manifest entry"
            )));
        }
    }
    Ok((manifest, files))
}

/// Unpacks a package into `dest`, which must not exist. The files go to a temporary
/// sibling first and are renamed into place, so an interrupted unpack leaves nothing
/// at `dest`.
pub fn unpack(bytes: &[u8], dest: &Path) -> Result<Manifest, PackageError> {
    use std::os::unix::fs::PermissionsExt;
    if dest.exists() {
        return Err(PackageError::Content(format!(
            "{} already exists",
            dest.display()
        )));
    }
    let (manifest, files) = read_packed(bytes)?;
    let parent = dest.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(io_error(parent))?;
    let stage = parent.join(format!(
        ".{}.partial-{}",
        dest.file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("package"),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&stage);
    let result = (|| {
        for (path, (contents, executable)) in &files {
            let target = stage.join(path);
            if let Some(dir) = target.parent() {
                std::fs::create_dir_all(dir).map_err(io_error(dir))?;
            }
            let mut file = std::fs::File::create(&target).map_err(io_error(&target))?;
            file.write_all(contents).map_err(io_error(&target))?;
            let mode = if *executable { 0o755 } else { 0o644 };
            std::fs::set_permissions(&target, std::fs::Permissions::from_mode(mode))
                .map_err(io_error(&target))?;
        }
        std::fs::rename(&stage, dest).map_err(io_error(dest))
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&stage);
    }
    result.map(|()| manifest)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, path: &str, contents: &str) {
        let target = dir.join(path);
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        std::fs::write(target, contents).unwrap();
    }

    fn sample(dir: &Path) {
        write(
            dir,
            "openenv.yaml",
            "spec_version: 1\nname: demo\nversion: 0.1.0\nruntime: fastapi\napp: server.app:app\nagentstack:\n  reward_range: [0, 1]\n",
        );
        write(dir, "README.md", "# demo\n");
        write(dir, "server/app.py", "app = None\n");
        write(dir, "server/__pycache__/app.cpython-311.pyc", "junk");
        write(dir, ".git/HEAD", "ref: refs/heads/main\n");
    }

    #[test]
    fn the_same_tree_packs_to_the_same_bytes() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        sample(a.path());
        // The same files written in another order, at another time.
        write(b.path(), "server/app.py", "app = None\n");
        std::thread::sleep(std::time::Duration::from_millis(20));
        write(b.path(), "README.md", "# demo\n");
        write(
            b.path(),
            "openenv.yaml",
            "spec_version: 1\nname: demo\nversion: 0.1.0\nruntime: fastapi\napp: server.app:app\nagentstack:\n  reward_range: [0, 1]\n",
        );
        let (pa, pb) = (pack(a.path()).unwrap(), pack(b.path()).unwrap());
        assert_eq!(pa.sha256, pb.sha256);
        assert_eq!(pa.bytes, pb.bytes);
        let paths: Vec<&str> = pa.manifest.files.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(paths, ["README.md", "openenv.yaml", "server/app.py"]);
        assert_eq!(pa.spec.name, "demo");
        assert_eq!(pa.spec.agentstack.reward_range, Some([0.0, 1.0]));
        // A changed byte is a different package.
        write(b.path(), "README.md", "# demo!\n");
        assert_ne!(pack(b.path()).unwrap().sha256, pa.sha256);
    }

    #[test]
    fn unpacking_restores_the_tree_and_checks_it() {
        let src = tempfile::tempdir().unwrap();
        sample(src.path());
        let packed = pack(src.path()).unwrap();
        let out = tempfile::tempdir().unwrap();
        let dest = out.path().join("demo");
        let manifest = unpack(&packed.bytes, &dest).unwrap();
        assert_eq!(manifest, packed.manifest);
        assert_eq!(
            std::fs::read_to_string(dest.join("server/app.py")).unwrap(),
            "app = None\n"
        );
        assert!(!dest.join(".git").exists());
        // Repacking what was unpacked gives the same package.
        assert_eq!(pack(&dest).unwrap().sha256, packed.sha256);
        assert!(
            unpack(&packed.bytes, &dest).is_err(),
            "refuses to overwrite"
        );
        // Truncated or altered bytes are refused and leave nothing behind.
        let broken = out.path().join("broken");
        assert!(unpack(&packed.bytes[..packed.bytes.len() / 2], &broken).is_err());
        assert!(!broken.exists());
        assert!(
            std::fs::read_dir(out.path()).unwrap().all(|e| !e
                .unwrap()
                .file_name()
                .to_string_lossy()
                .contains("partial"))
        );
    }

    #[test]
    fn archives_that_escape_or_lie_are_refused() {
        let mut raw = Vec::new();
        {
            let gz = flate2::write::GzEncoder::new(&mut raw, flate2::Compression::fast());
            let mut archive = tar::Builder::new(gz);
            let contents = b"x";
            let mut header = tar::Header::new_gnu();
            header.as_gnu_mut().unwrap().name[..9].copy_from_slice(b"../escape");
            header.set_size(1);
            header.set_mode(0o644);
            header.set_entry_type(tar::EntryType::Regular);
            header.set_cksum();
            archive.append(&header, &contents[..]).unwrap();
            archive.into_inner().unwrap().finish().unwrap();
        }
        let err = read_packed(&raw).unwrap_err().to_string();
        assert!(err.contains("escapes"), "{err}");
        assert!(read_packed(b"not a package").is_err());
    }

    #[test]
    fn bad_manifests_say_what_is_wrong() {
        let path = Path::new("openenv.yaml");
        let err = PackageSpec::parse("version: 1\n", path)
            .unwrap_err()
            .to_string();
        assert!(err.contains("`name` is required"), "{err}");
        let err = PackageSpec::parse("name: x\nagentstack:\n  sevre: x\n", path)
            .unwrap_err()
            .to_string();
        assert!(err.contains("allowed keys"), "{err}");
        let err = PackageSpec::parse("name: x\nagentstack:\n  reward_range: [1, 0]\n", path)
            .unwrap_err()
            .to_string();
        assert!(err.contains("low < high"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let err = pack(dir.path()).unwrap_err().to_string();
        assert!(err.contains("missing"), "{err}");
        // OpenEnv's own keys pass through untouched.
        let spec =
            PackageSpec::parse("name: x\nvalidation:\n  reward: {range: [0, 1]}\n", path).unwrap();
        assert!(spec.document.get("validation").is_some());
    }
}
