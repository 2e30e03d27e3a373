//! An environment package: a directory with an `openenv.yaml`, packed into a gzipped
//! tar whose bytes depend only on the files' paths, contents and executable bits (same
//! tree → same bytes → same sha256), with a manifest of every file and its hash.
//!
//! `openenv.yaml` keeps OpenEnv's keys as they are; ours live under `agentstack:`
//! (how to serve the package, its reward range, the resources it needs).

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Component, Path, PathBuf};

use agentstack_static::packaging;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The manifest's path inside a packed package.
pub const MANIFEST_PATH: &str = ".agentstack/manifest.json";

/// The most bytes a package may hold, unpacked.
pub const MAX_PACKAGE_BYTES: u64 = 512 << 20;
/// The most files a package may hold.
pub const MAX_PACKAGE_FILES: usize = 20_000;

/// What can go wrong with a package.
#[derive(Debug, thiserror::Error)]
pub enum PackageError {
    /// Reading or writing files failed.
    #[error("cannot read or write {path}")]
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
        if packaging::is_skipped(name) {
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

/// Limits on what a packed package holds once inflated. They are checked while the
/// archive is read, against the manifest (its first entry) and each entry's header,
/// before the bytes they describe are inflated: a small archive that inflates to
/// gigabytes is refused after a few hundred bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnpackLimits {
    /// The most bytes of files, unpacked.
    pub max_bytes: u64,
    /// The most files.
    pub max_files: usize,
}

impl Default for UnpackLimits {
    fn default() -> Self {
        Self {
            max_bytes: MAX_PACKAGE_BYTES,
            max_files: MAX_PACKAGE_FILES,
        }
    }
}

/// The largest manifest read: it lists every file (a [`MAX_PACKAGE_FILES`] list is
/// a few MiB).
const MAX_MANIFEST_BYTES: u64 = 16 << 20;

/// A reader that hashes and counts what passes through it.
struct Hashing<'a> {
    inner: &'a mut dyn Read,
    hasher: Sha256,
    count: u64,
}

impl Read for Hashing<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        self.count += n as u64;
        Ok(n)
    }
}

/// Checks a manifest read from an archive before any file is: safe, sorted, unique
/// paths, and sizes and a count within `limits`.
fn check_manifest(manifest: &Manifest, limits: &UnpackLimits) -> Result<(), PackageError> {
    if manifest.files.len() > limits.max_files {
        return Err(PackageError::Corrupt(format!(
            "the manifest lists {} files; a package may hold at most {}",
            manifest.files.len(),
            limits.max_files
        )));
    }
    let mut total = 0u64;
    for (i, file) in manifest.files.iter().enumerate() {
        if safe_path(Path::new(&file.path))? != file.path || file.path == MANIFEST_PATH {
            return Err(PackageError::Corrupt(format!(
                "the manifest lists the path '{}', which is not a plain relative path",
                file.path
            )));
        }
        if i > 0 && manifest.files[i - 1].path >= file.path {
            return Err(PackageError::Corrupt(
                "the manifest's paths are not sorted and unique".into(),
            ));
        }
        total = total.saturating_add(file.size);
        if total > limits.max_bytes {
            return Err(PackageError::Corrupt(format!(
                "the files add up to more than {} bytes unpacked, the most a package may hold",
                limits.max_bytes
            )));
        }
    }
    Ok(())
}

/// The header of an archive entry, checked: a regular file at a safe path.
fn entry_path<R: Read>(entry: &tar::Entry<'_, R>) -> Result<(String, u64, bool), PackageError> {
    let header = entry.header();
    // Raw entries: GNU long names and pax headers arrive as entries of their own
    // (which `tar` would otherwise read whole into memory); packages have none.
    if !matches!(header.entry_type(), tar::EntryType::Regular) {
        return Err(PackageError::Corrupt(
            "only regular files may be in a package".into(),
        ));
    }
    let size = header
        .size()
        .map_err(|e| PackageError::Corrupt(e.to_string()))?;
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
    Ok((path, size, executable))
}

/// Reads a packed package from `reader` as it inflates, never holding more than a
/// buffer of it: the manifest (the first entry) is checked against `limits`, then
/// every entry against the manifest's next file (path, size, executable bit) before
/// its bytes are read, and its bytes against the file's hash as they go by. `each`
/// gets every file's entry and a reader of its bytes; what it leaves unread is read
/// (and hashed) after it returns. Returns the manifest.
pub fn read_packed_from<R: Read>(
    reader: R,
    limits: &UnpackLimits,
    mut each: impl FnMut(&FileEntry, &mut dyn Read) -> Result<(), PackageError>,
) -> Result<Manifest, PackageError> {
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(reader));
    let mut entries = archive
        .entries()
        .map_err(|e| PackageError::Corrupt(format!("not a gzipped tar: {e}")))?
        .raw(true);
    let mut next = |what: &str| -> Result<Option<tar::Entry<'_, _>>, PackageError> {
        entries
            .next()
            .transpose()
            .map_err(|e| PackageError::Corrupt(format!("reading {what}: {e}")))
    };
    let mut first = next("the first entry")?
        .ok_or_else(|| PackageError::Corrupt("the archive is empty".into()))?;
    let (path, size, _) = entry_path(&first)?;
    if path != MANIFEST_PATH {
        return Err(PackageError::Corrupt(format!(
            "the first entry is {path}; a package starts with {MANIFEST_PATH}"
        )));
    }
    if size > MAX_MANIFEST_BYTES {
        return Err(PackageError::Corrupt(format!(
            "{MANIFEST_PATH} is larger than {MAX_MANIFEST_BYTES} bytes"
        )));
    }
    let mut json = Vec::new();
    first
        .read_to_end(&mut json)
        .map_err(|e| PackageError::Corrupt(format!("{MANIFEST_PATH}: {e}")))?;
    drop(first);
    let manifest: Manifest = serde_json::from_slice(&json)
        .map_err(|e| PackageError::Corrupt(format!("{MANIFEST_PATH}: {e}")))?;
    check_manifest(&manifest, limits)?;
    for expected in &manifest.files {
        let mut entry = next(&expected.path)?.ok_or_else(|| {
            PackageError::Corrupt(format!(
                "{} is in the manifest but not in the archive",
                expected.path
            ))
        })?;
        let (path, size, executable) = entry_path(&entry)?;
        if path != expected.path || size != expected.size || executable != expected.executable {
            return Err(PackageError::Corrupt(format!(
                "the entry {path} ({size} bytes) is not the manifest's next file, {} ({} bytes)",
                expected.path, expected.size
            )));
        }
        let mut hashing = Hashing {
            inner: &mut entry,
            hasher: Sha256::new(),
            count: 0,
        };
        each(expected, &mut hashing)?;
        std::io::copy(&mut hashing, &mut std::io::sink())
            .map_err(|e| PackageError::Corrupt(format!("{path}: {e}")))?;
        let actual: String = hashing
            .hasher
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        if hashing.count != expected.size || actual != expected.sha256 {
            return Err(PackageError::Corrupt(format!(
                "{path} does not match its manifest entry"
            )));
        }
    }
    if let Some(extra) = next("the end of the archive")? {
        let path = entry_path(&extra).map(|(p, _, _)| p).unwrap_or_default();
        return Err(PackageError::Corrupt(format!(
            "the archive holds {path}, which the manifest does not list"
        )));
    }
    Ok(manifest)
}

/// Reads a packed package, checking every file against the manifest; returns the
/// manifest and the files (within the default [`UnpackLimits`]).
pub fn read_packed(bytes: &[u8]) -> Result<(Manifest, Files), PackageError> {
    read_packed_within(bytes, &UnpackLimits::default())
}

/// [`read_packed`] within `limits`.
pub fn read_packed_within(
    bytes: &[u8],
    limits: &UnpackLimits,
) -> Result<(Manifest, Files), PackageError> {
    let mut files = Files::new();
    let manifest = read_packed_from(bytes, limits, |file, contents| {
        // The size was checked against the limits; the bytes arrive as they inflate.
        let mut buffer = Vec::with_capacity(file.size.min(1 << 20) as usize);
        contents
            .read_to_end(&mut buffer)
            .map_err(|e| PackageError::Corrupt(format!("{}: {e}", file.path)))?;
        files.insert(file.path.clone(), (buffer, file.executable));
        Ok(())
    })?;
    Ok((manifest, files))
}

/// Unpacks a package into `dest`, which must not exist, writing each file as it
/// inflates. The files go to a temporary sibling first and are renamed into place,
/// so an interrupted or refused unpack leaves nothing at `dest`.
pub fn unpack(bytes: &[u8], dest: &Path) -> Result<Manifest, PackageError> {
    use std::os::unix::fs::PermissionsExt;
    if dest.exists() {
        return Err(PackageError::Content(format!(
            "{} already exists",
            dest.display()
        )));
    }
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
        std::fs::create_dir_all(&stage).map_err(io_error(&stage))?;
        let manifest = read_packed_from(bytes, &UnpackLimits::default(), |file, contents| {
            let target = stage.join(&file.path);
            if let Some(dir) = target.parent() {
                std::fs::create_dir_all(dir).map_err(io_error(dir))?;
            }
            let mut out = std::fs::File::create(&target).map_err(io_error(&target))?;
            std::io::copy(contents, &mut out).map_err(io_error(&target))?;
            let mode = if file.executable { 0o755 } else { 0o644 };
            std::fs::set_permissions(&target, std::fs::Permissions::from_mode(mode))
                .map_err(io_error(&target))
        })?;
        std::fs::rename(&stage, dest).map_err(io_error(dest))?;
        Ok(manifest)
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&stage);
    }
    result
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
    fn packing_leaves_out_every_name_packaging_skips() {
        let dir = tempfile::tempdir().unwrap();
        sample(dir.path());
        for name in packaging::SKIPPED_NAMES {
            write(dir.path(), &format!("{name}/inside.py"), "x = 1\n");
            write(dir.path(), &format!("server/{name}/inside.py"), "x = 1\n");
        }
        write(dir.path(), "server/old.pyc", "junk");
        let packed = pack(dir.path()).unwrap();
        let paths: Vec<&str> = packed
            .manifest
            .files
            .iter()
            .map(|f| f.path.as_str())
            .collect();
        assert_eq!(paths, ["README.md", "openenv.yaml", "server/app.py"]);
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

    /// A reader that counts what is read from it.
    struct Counting<'a>(&'a [u8], std::rc::Rc<std::cell::Cell<usize>>);

    impl Read for Counting<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = self.0.read(buf)?;
            self.1.set(self.1.get() + n);
            Ok(n)
        }
    }

    /// A gzipped tar of `entries` (path, size, bytes: zeros when `None`), the way
    /// an attacker builds one: any sizes, any manifest. Stored without compression,
    /// so the bytes read from it are the bytes inflated.
    fn bomb(entries: &[(&str, u64, Option<Vec<u8>>)]) -> Vec<u8> {
        let mut raw = Vec::new();
        let gz = flate2::write::GzEncoder::new(&mut raw, flate2::Compression::none());
        let mut archive = tar::Builder::new(gz);
        for (path, size, contents) in entries {
            let header = tar_header(path, *size, false).unwrap();
            match contents {
                Some(c) => archive.append(&header, &c[..]).unwrap(),
                None => archive
                    .append(&header, std::io::repeat(0).take(*size))
                    .unwrap(),
            }
        }
        archive.into_inner().unwrap().finish().unwrap();
        raw
    }

    fn manifest_of(files: &[(&str, u64)]) -> Vec<u8> {
        serde_json::to_vec(&Manifest {
            format: 1,
            name: "bomb".into(),
            files: files
                .iter()
                .map(|(path, size)| FileEntry {
                    path: (*path).into(),
                    size: *size,
                    sha256: "0".repeat(64),
                    executable: false,
                })
                .collect(),
        })
        .unwrap()
    }

    #[test]
    fn a_gzip_bomb_is_refused_before_it_inflates() {
        let limits = UnpackLimits {
            max_bytes: 1 << 20,
            max_files: 4,
        };
        // What reading may take before a refusal: a few of the gzip decoder's
        // buffers (32 KiB), against archives of 4 MiB and more.
        const READ_AHEAD: usize = 128 << 10;
        let read = |bytes: &[u8]| {
            let consumed = std::rc::Rc::new(std::cell::Cell::new(0));
            let result =
                read_packed_from(Counting(bytes, consumed.clone()), &limits, |_, _| Ok(()));
            (result.map(|_| ()), consumed.get())
        };
        // The manifest owns up to 8 MiB of files: refused on reading it.
        let sizes = [("a.bin", 4u64 << 20), ("b.bin", 4 << 20)];
        let manifest = manifest_of(&sizes);
        let mut entries = vec![(MANIFEST_PATH, manifest.len() as u64, Some(manifest))];
        entries.extend(sizes.iter().map(|(p, s)| (*p, *s, None)));
        let archive = bomb(&entries);
        let (result, consumed) = read(&archive);
        let err = result.unwrap_err().to_string();
        assert!(err.contains("more than 1048576 bytes"), "{err}");
        assert!(
            consumed < READ_AHEAD,
            "read {consumed} of {} bytes",
            archive.len()
        );
        // The manifest says 1 KiB but the entry 4 MiB: refused at the entry's header.
        let manifest = manifest_of(&[("a.bin", 1024)]);
        let archive = bomb(&[
            (MANIFEST_PATH, manifest.len() as u64, Some(manifest)),
            ("a.bin", 4 << 20, None),
        ]);
        let (result, consumed) = read(&archive);
        assert!(
            result
                .unwrap_err()
                .to_string()
                .contains("not the manifest's next file")
        );
        assert!(
            consumed < READ_AHEAD,
            "read {consumed} of {} bytes",
            archive.len()
        );
        // No manifest first, or too many files: refused before any file is read.
        let archive = bomb(&[("a.bin", 4 << 20, None)]);
        let (result, consumed) = read(&archive);
        assert!(result.unwrap_err().to_string().contains("starts with"));
        assert!(consumed < READ_AHEAD);
        let many: Vec<(String, u64)> = (0..5).map(|i| (format!("f{i}"), 1)).collect();
        let many: Vec<(&str, u64)> = many.iter().map(|(p, s)| (p.as_str(), *s)).collect();
        let manifest = manifest_of(&many);
        let archive = bomb(&[(MANIFEST_PATH, manifest.len() as u64, Some(manifest))]);
        assert!(
            read(&archive)
                .0
                .unwrap_err()
                .to_string()
                .contains("at most 4")
        );
        // A file is hashed as it inflates, and a lie is caught at its end.
        let manifest = manifest_of(&[("a.bin", 1 << 19)]);
        let archive = bomb(&[
            (MANIFEST_PATH, manifest.len() as u64, Some(manifest)),
            ("a.bin", 1 << 19, None),
        ]);
        let err = read(&archive).0.unwrap_err().to_string();
        assert!(err.contains("does not match its manifest entry"), "{err}");
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
