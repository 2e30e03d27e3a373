//! The repack cache: weights repacked for the kernels, kept on disk and mapped by later
//! loads of the same file.
//!
//! The kernels run on weights repacked at load (`kernels/`), so a load writes a copy of
//! every weight into fresh memory. That costs the repacking, and the OS's zeroing of
//! fresh pages, which some virtual machines hand out at under 1 GB/s: a 1B model loaded
//! in 1–2 s where llama.cpp, which runs most types from its mapping of the file, took
//! 0.4–1.2. So the first load of a file writes the repacked arrays to one cache file,
//! and later loads map them: the page cache's pages, no repacking, no fresh memory (on
//! a kernel whose file system keeps large folios, as ext4 and XFS do from Linux 6.x,
//! mapped as 2 MiB pages, as the repacked weights in memory are).
//!
//! An entry belongs to one GGUF file as it is (path, device, inode, size, modification
//! time) and one packing (`kernels::layout_fingerprint`, which changes with the crate's
//! version and with any change to how a weight is packed); anything else misses and
//! repacks. Each weight's entry is checked against the file's tensor (type, shape) and
//! each array's length against what the kernels index before it is used; a weight that
//! fails is repacked from the file and the entry rewritten. Entries are written to a
//! temporary file, synced, then renamed, so a crash leaves either the old entry or the
//! new, never half of one. The folder is kept under a size (least recently used first
//! out), and entries whose GGUF file is gone or changed are removed.
//!
//! `AGENTSTACK_REPACK_CACHE` turns it off or moves it; `AGENTSTACK_REPACK_CACHE_MAX_GIB`
//! bounds it.

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;

use agentstack_static::env_vars;

use crate::error::Result;
use crate::gguf::{GgufFile, TensorType};
use crate::kernels::{Arena, FastLinear, StoredForm, on_off_setting};

/// The first bytes of an entry; the last two digits are the format's version.
const MAGIC: &[u8; 8] = b"AGSRPK01";
/// Magic, then the index's offset and length (u64, little-endian).
const PREFIX: usize = 24;
/// An entry's file name ends so.
const SUFFIX: &str = "repack";
/// Arrays of this many bytes or more start on a 2 MiB boundary and are mapped; smaller
/// ones are read (the kernels' memory gives them the heap too).
const MAPPED: usize = 2 << 20;
/// Where the first array may start: the prefix's page is its own.
const FIRST_ARRAY: u64 = 4096;
/// An index larger than this is refused unread (a 70B model's is under 1 MiB).
const MAX_INDEX: u64 = 64 << 20;
/// Temporary files older than this are left by a process that died while writing.
const STALE_TMP: std::time::Duration = std::time::Duration::from_secs(3600);

/// Where repacked weights are cached, and how much.
#[derive(Debug, Clone)]
pub struct RepackCache {
    /// None: off.
    dir: Option<PathBuf>,
    /// Models whose repacked weights are smaller than this are not cached (they load in
    /// milliseconds anyway).
    min_bytes: u64,
    /// The folder's bound.
    max_bytes: u64,
}

impl RepackCache {
    /// Default bound of the folder.
    pub const DEFAULT_MAX_GIB: u64 = 32;
    /// Default smallest model cached.
    pub const DEFAULT_MIN_BYTES: u64 = 64 << 20;

    /// As the environment says: `AGENTSTACK_REPACK_CACHE` `off` (or `0`, `false`, `no`)
    /// turns it off, a path puts it there; unset, empty or `on` use
    /// `$XDG_CACHE_HOME/agentstack/repacked` (default `~/.cache/agentstack/repacked`).
    /// `AGENTSTACK_REPACK_CACHE_MAX_GIB` bounds it (default 32).
    pub fn from_env() -> Self {
        let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
        Self::from_settings(
            var(env_vars::AGENTSTACK_REPACK_CACHE).as_deref(),
            var(env_vars::AGENTSTACK_REPACK_CACHE_MAX_GIB).as_deref(),
            default_dir(var(env_vars::XDG_CACHE_HOME), var(env_vars::HOME)),
        )
    }

    /// [`Self::from_env`]'s rule on the variables' values.
    fn from_settings(
        cache: Option<&OsStr>,
        max_gib: Option<&OsStr>,
        default: Option<PathBuf>,
    ) -> Self {
        // The on/off words of the other switches (`AGENTSTACK_HUGE_PAGES`); anything else
        // is a folder.
        let dir = match cache.map(|v| (v, v.to_str().and_then(|s| on_off_setting(Some(s))))) {
            Some((_, Some(false))) => None,
            None | Some((_, Some(true))) => default,
            Some((v, None)) => Some(PathBuf::from(v)),
        };
        let max_gib = match max_gib {
            None => Self::DEFAULT_MAX_GIB,
            Some(v) => v
                .to_str()
                .and_then(|s| s.trim().parse().ok())
                .unwrap_or_else(|| {
                    tracing::warn!(
                        value = %v.to_string_lossy(),
                        "{} is not a whole number of GiB: using {}",
                        env_vars::AGENTSTACK_REPACK_CACHE_MAX_GIB,
                        Self::DEFAULT_MAX_GIB
                    );
                    Self::DEFAULT_MAX_GIB
                }),
        };
        Self {
            dir,
            min_bytes: Self::DEFAULT_MIN_BYTES,
            max_bytes: max_gib.saturating_mul(1 << 30),
        }
    }

    /// No cache: every load repacks.
    pub fn off() -> Self {
        Self {
            dir: None,
            min_bytes: 0,
            max_bytes: 0,
        }
    }

    /// A cache in `dir`, for models of at least `min_bytes` of repacked weights, the
    /// folder bounded by `max_bytes`.
    pub fn in_dir(dir: impl Into<PathBuf>, min_bytes: u64, max_bytes: u64) -> Self {
        Self {
            dir: Some(dir.into()),
            min_bytes,
            max_bytes,
        }
    }

    /// Its folder, when on.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// Starts loading `file`'s weights: finds its entry if there is a good one.
    pub(crate) fn start(&self, file: &GgufFile) -> Loading<'_> {
        // The file's size stands for its repacked size (within ~20%): a model too small
        // to be worth an entry, or too large for the folder, is not looked up.
        let worth = |s: &Source| (self.min_bytes..=self.max_bytes).contains(&s.size);
        let source = self
            .dir
            .as_ref()
            .and_then(|dir| Some((dir, Source::of(file).filter(worth)?)));
        let state = match source {
            Some((dir, source)) => {
                let path = dir.join(format!("{}.{SUFFIX}", source.key()));
                match Entry::open(&path, &source) {
                    Ok(entry) => {
                        tracing::debug!(path = %path.display(), "mapping repacked weights");
                        // Used now: the last to go when the folder is trimmed.
                        let _ = entry.file.set_modified(std::time::SystemTime::now());
                        State::Hit {
                            entry,
                            path,
                            source,
                        }
                    }
                    Err(why) => {
                        if path.exists() {
                            tracing::info!(path = %path.display(), %why, "repacking: the cached entry is not usable");
                        }
                        State::miss(path, source)
                    }
                }
            }
            None => State::Off,
        };
        Loading {
            cache: self,
            state,
            weights: Vec::new(),
            repacked: 0,
        }
    }
}

/// `$XDG_CACHE_HOME/agentstack/repacked`, else `$HOME/.cache/agentstack/repacked`.
fn default_dir(xdg_cache: Option<OsString>, home: Option<OsString>) -> Option<PathBuf> {
    match (xdg_cache, home) {
        (Some(xdg), _) => Some(PathBuf::from(xdg).join("agentstack/repacked")),
        (None, Some(home)) => Some(PathBuf::from(home).join(".cache/agentstack/repacked")),
        (None, None) => None,
    }
}

/// The GGUF file an entry was made from, as it was.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Source {
    path: PathBuf,
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
}

impl Source {
    /// `file` as it is now (its path made canonical).
    fn of(file: &GgufFile) -> Option<Self> {
        let meta = file.handle().metadata().ok()?;
        Self::from_metadata(std::fs::canonicalize(file.path()).ok()?, &meta)
    }

    /// The file as it is now at this path, if any.
    fn now_at(path: &Path) -> Option<Self> {
        Self::from_metadata(path.to_path_buf(), &std::fs::metadata(path).ok()?)
    }

    #[cfg(unix)]
    fn from_metadata(path: PathBuf, meta: &std::fs::Metadata) -> Option<Self> {
        use std::os::unix::fs::MetadataExt;
        Some(Self {
            path,
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
        })
    }

    /// Off where there is no way to map an array from a file.
    #[cfg(not(unix))]
    fn from_metadata(_: PathBuf, _: &std::fs::Metadata) -> Option<Self> {
        None
    }

    /// The entry's file name: the source and the packing, hashed.
    fn key(&self) -> String {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(crate::kernels::layout_fingerprint());
        h.update(serde_json::to_vec(self).unwrap_or_default());
        h.finalize()[..16]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

/// An entry's table of contents, at its end.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Index {
    /// `kernels::layout_fingerprint` of the build that wrote it.
    layout: String,
    source: Source,
    /// The entry's length in bytes.
    len: u64,
    weights: BTreeMap<String, Stored>,
}

/// One weight in an entry.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Stored {
    /// The file's tensor type (its `Debug` form) and shape.
    tensor: String,
    dims: Vec<usize>,
    form: StoredForm,
    /// Offset and length in bytes of each array.
    arrays: [(u64, u64); 5],
}

/// An open entry whose index matched.
struct Entry {
    file: File,
    index: Index,
}

impl Entry {
    fn open(path: &Path, source: &Source) -> std::result::Result<Self, String> {
        let mut file = File::open(path).map_err(|e| e.to_string())?;
        let len = file.metadata().map_err(|e| e.to_string())?.len();
        let index = read_index(&mut file, Some(len))?;
        if index.layout != crate::kernels::layout_fingerprint() {
            return Err("written by a build that packs differently".into());
        }
        if &index.source != source {
            return Err("made from another file, or from this one before it changed".into());
        }
        if index.len != len {
            return Err(format!("{len} bytes, its index says {}", index.len));
        }
        Ok(Self { file, index })
    }

    /// Weight `name` of `gguf`, if the entry holds it as `gguf` has it and its arrays
    /// are what the kernels index.
    fn weight(&self, gguf: &GgufFile, name: &str) -> std::result::Result<FastLinear, String> {
        let stored = self
            .index
            .weights
            .get(name)
            .ok_or_else(|| format!("no entry for {name}"))?;
        let (ty, dims) = tensor_of(gguf, name).ok_or_else(|| format!("no tensor {name}"))?;
        if stored.tensor != format!("{ty:?}") || stored.dims != dims {
            return Err(format!("{name} is stored as another tensor"));
        }
        let mut arrays: [crate::kernels::StoredArray; 5] = Default::default();
        for (slot, &(at, len)) in arrays.iter_mut().zip(&stored.arrays) {
            if at.checked_add(len).is_none_or(|end| end > self.index.len) {
                return Err(format!("{name}: an array past the end"));
            }
            let len = usize::try_from(len).map_err(|e| e.to_string())?;
            *slot = crate::kernels::StoredArray::from_file(&self.file, at, len)
                .map_err(|e| format!("{name}: {e}"))?;
        }
        FastLinear::from_stored(&stored.form, arrays)
            .ok_or_else(|| format!("{name}: arrays not of the lengths its form needs"))
    }
}

fn tensor_of<'a>(gguf: &'a GgufFile, name: &str) -> Option<(TensorType, &'a [usize])> {
    Some((gguf.tensor_type(name)?, gguf.tensor_dims(name).ok()?))
}

#[cfg(unix)]
fn read_at(file: &File, buf: &mut [u8], at: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(file, buf, at)
}

#[cfg(not(unix))]
fn read_at(_: &File, _: &mut [u8], _: u64) -> std::io::Result<()> {
    Err(std::io::Error::other("no positioned reads here"))
}

enum State {
    Off,
    Hit {
        entry: Entry,
        path: PathBuf,
        source: Source,
    },
    /// Repacking, into a new entry at `path`: a temporary file beside it that the
    /// weights are packed into (`writing`; None if it could not be made, and the weights
    /// go to memory and are copied to a file at the end).
    Miss {
        path: PathBuf,
        source: Source,
        writing: Option<(tempfile::NamedTempFile, Rc<Arena>)>,
    },
}

impl State {
    fn miss(path: PathBuf, source: Source) -> Self {
        let writing = temporary(&path).and_then(|tmp| {
            let file = tmp.as_file().try_clone()?;
            Ok((tmp, Rc::new(Arena::new(file, FIRST_ARRAY))))
        });
        let writing = writing
            .inspect_err(|e| {
                tracing::debug!(path = %path.display(), error = %e, "repacking into memory");
            })
            .ok();
        Self::Miss {
            path,
            source,
            writing,
        }
    }
}

/// A new temporary file beside `path`, its folder made if need be.
fn temporary(path: &Path) -> std::io::Result<tempfile::NamedTempFile> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    tempfile::Builder::new()
        .prefix(".repack-")
        .suffix(".tmp")
        .tempfile_in(dir)
}

/// A weight loaded, as the entry records it.
struct Loaded {
    name: String,
    /// The file's tensor type (its `Debug` form) and shape.
    tensor: String,
    dims: Vec<usize>,
    weight: Arc<FastLinear>,
}

/// One model's load: its weights come from the entry, or are repacked and then
/// written to a new one ([`Self::finish`]).
pub(crate) struct Loading<'a> {
    cache: &'a RepackCache,
    state: State,
    /// Every weight loaded, to write.
    weights: Vec<Loaded>,
    /// How many of them were repacked (not read from the entry).
    repacked: usize,
}

impl Loading<'_> {
    /// The weight of tensor `name`, from the entry or repacked from the file.
    pub(crate) fn weight(&mut self, gguf: &GgufFile, name: &str) -> Result<Arc<FastLinear>> {
        if let State::Hit { entry, .. } = &self.state {
            match entry.weight(gguf, name) {
                Ok(w) => return Ok(self.keep(gguf, name, Arc::new(w))),
                Err(why) => {
                    tracing::warn!(%why, "the repack cache's entry is damaged: repacking, then rewriting it");
                    if let State::Hit { path, source, .. } =
                        std::mem::replace(&mut self.state, State::Off)
                    {
                        self.state = State::miss(path, source);
                    }
                }
            }
        }
        let mapped = gguf.map(name)?;
        let w = match &self.state {
            State::Miss {
                writing: Some((_, arena)),
                ..
            } => Arena::packing(arena, || FastLinear::from_mapped(&mapped))?,
            _ => FastLinear::from_mapped(&mapped)?,
        };
        let w = Arc::new(w);
        self.repacked += 1;
        Ok(self.keep(gguf, name, w))
    }

    /// The arena the weights are packed into, if any.
    #[cfg(test)]
    fn arena(&self) -> Option<u64> {
        match &self.state {
            State::Miss {
                writing: Some((_, arena)),
                ..
            } => Some(arena.id()),
            _ => None,
        }
    }

    /// Keeps `w` to write, unless the cache is off.
    fn keep(&mut self, gguf: &GgufFile, name: &str, w: Arc<FastLinear>) -> Arc<FastLinear> {
        if let (false, Some((ty, dims))) = (matches!(self.state, State::Off), tensor_of(gguf, name))
        {
            self.weights.push(Loaded {
                name: name.to_owned(),
                tensor: format!("{ty:?}"),
                dims: dims.to_vec(),
                weight: w.clone(),
            });
        }
        w
    }

    /// Ends the load: after a miss, writes the entry (unless the model is too small or
    /// too large for the folder) and trims the folder. Failures are logged, not
    /// returned: the model is loaded either way.
    pub(crate) fn finish(self) {
        let State::Miss {
            path,
            source,
            writing,
        } = self.state
        else {
            return;
        };
        if self.repacked == 0 {
            return;
        }
        let bytes: u64 = self
            .weights
            .iter()
            .flat_map(|l| l.weight.stored(0).1)
            .map(|(a, _)| a.len() as u64)
            .sum();
        if bytes < self.cache.min_bytes || bytes > self.cache.max_bytes {
            return;
        }
        let started = std::time::Instant::now();
        let written = match writing {
            Some((tmp, arena)) => write(
                &path,
                &source,
                &self.weights,
                tmp,
                (arena.id(), arena.end()),
            ),
            None => temporary(&path)
                .and_then(|tmp| write(&path, &source, &self.weights, tmp, (0, FIRST_ARRAY))),
        };
        match written {
            Ok(len) => tracing::info!(
                path = %path.display(),
                mib = len >> 20,
                seconds = started.elapsed().as_secs_f32(),
                "cached the repacked weights: later loads of this file map them \
                 (AGENTSTACK_REPACK_CACHE=off turns this off)"
            ),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "could not cache the repacked weights: the next load repacks again \
                     (hint: point AGENTSTACK_REPACK_CACHE at a writable folder, or set it to off)");
                return;
            }
        }
        if let Some(dir) = path.parent() {
            trim(dir, &path, self.cache.max_bytes);
        }
    }
}

/// Finishes the entry in `tmp` and renames it to `path`: the arrays packed into it
/// stay where they are (arena `id`), the others are written after `end` (the large
/// ones on 2 MiB boundaries, the gaps left as holes), then the index, then the
/// prefix that says where the index is; synced before the rename. Returns its length.
fn write(
    path: &Path,
    source: &Source,
    weights: &[Loaded],
    tmp: tempfile::NamedTempFile,
    (id, end): (u64, u64),
) -> std::io::Result<u64> {
    let file = tmp.as_file();
    let mut at = end;
    let mut stored = BTreeMap::new();
    for l in weights {
        if stored.contains_key(&l.name) {
            // A tied output head is the embedding's weight.
            continue;
        }
        let (form, arrays) = l.weight.stored(id);
        let mut placed = [(0u64, 0u64); 5];
        for (slot, (a, offset)) in placed.iter_mut().zip(arrays) {
            if a.is_empty() {
                continue;
            }
            let offset = match offset {
                Some(offset) => offset,
                None => {
                    let align = if a.len() >= MAPPED { MAPPED as u64 } else { 64 };
                    let offset = at.next_multiple_of(align);
                    write_at(file, a, offset)?;
                    at = offset + a.len() as u64;
                    offset
                }
            };
            *slot = (offset, a.len() as u64);
        }
        stored.insert(
            l.name.clone(),
            Stored {
                tensor: l.tensor.clone(),
                dims: l.dims.clone(),
                form,
                arrays: placed,
            },
        );
    }
    let mut index = Index {
        layout: crate::kernels::layout_fingerprint().to_owned(),
        source: source.clone(),
        len: 0,
        weights: stored,
    };
    // The index holds the entry's length, which counts the index: grow the length
    // until it holds (its digits change at most a few times).
    let mut json = serde_json::to_vec(&index).map_err(std::io::Error::other)?;
    loop {
        let len = at + json.len() as u64;
        if index.len == len {
            break;
        }
        index.len = len;
        json = serde_json::to_vec(&index).map_err(std::io::Error::other)?;
    }
    write_at(file, &json, at)?;
    let mut prefix = [0u8; PREFIX];
    prefix[..8].copy_from_slice(MAGIC);
    prefix[8..16].copy_from_slice(&at.to_le_bytes());
    prefix[16..].copy_from_slice(&(json.len() as u64).to_le_bytes());
    write_at(file, &prefix, 0)?;
    file.sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    Ok(index.len)
}

/// Keeps the folder under `max_bytes` (disk blocks, so the holes count nothing):
/// removes entries whose GGUF file is gone or changed, temporary files of dead
/// writers, then the least recently used entries but `keep`.
fn trim(dir: &Path, keep: &Path, max_bytes: u64) {
    let Ok(read) = std::fs::read_dir(dir) else {
        return;
    };
    let now = std::time::SystemTime::now();
    let mut entries = Vec::new();
    for e in read.flatten() {
        let path = e.path();
        let Ok(meta) = e.metadata() else { continue };
        let modified = meta.modified().unwrap_or(now);
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(".repack-") && name.ends_with(".tmp") {
            if now
                .duration_since(modified)
                .is_ok_and(|age| age > STALE_TMP)
            {
                remove(&path, "a temporary file left by a writer that died");
            }
            continue;
        }
        if path.extension().is_none_or(|x| x != SUFFIX) || path == keep {
            continue;
        }
        match source_of(&path) {
            Some(source) if Source::now_at(&source.path).as_ref() == Some(&source) => {
                entries.push((modified, disk_bytes(&meta), path));
            }
            _ => remove(
                &path,
                "its GGUF file is gone or changed, or it is not an entry",
            ),
        }
    }
    let mut total = std::fs::metadata(keep).map(|m| disk_bytes(&m)).unwrap_or(0);
    // Newest first: what no longer fits goes.
    entries.sort_by_key(|e| std::cmp::Reverse(e.0));
    for (_, bytes, path) in entries {
        total += bytes;
        if total > max_bytes {
            remove(&path, "least recently used, over the cache's bound");
        }
    }
}

/// The source recorded in the entry at `path`, if it is one.
fn source_of(path: &Path) -> Option<Source> {
    let mut file = File::open(path).ok()?;
    read_index(&mut file, None).ok().map(|i| i.source)
}

/// The index of the entry open as `file`: its prefix checked, the index read where the
/// prefix says; with `len` (the file's length), the index must end the file.
fn read_index(file: &mut File, len: Option<u64>) -> std::result::Result<Index, String> {
    let mut prefix = [0u8; PREFIX];
    file.read_exact(&mut prefix)
        .map_err(|e| format!("reading its first bytes: {e}"))?;
    if &prefix[..8] != MAGIC {
        return Err("not an entry of this format".into());
    }
    let word = |i: usize| u64::from_le_bytes(prefix[i..i + 8].try_into().expect("8 bytes"));
    let (at, index_len) = (word(8), word(16));
    if index_len > MAX_INDEX || len.is_some_and(|len| at.checked_add(index_len) != Some(len)) {
        return Err(format!(
            "an index of {index_len} bytes at {at} in {} bytes (cut short?)",
            len.unwrap_or_default()
        ));
    }
    let mut raw = vec![0u8; index_len as usize];
    read_at(file, &mut raw, at).map_err(|e| format!("reading its index: {e}"))?;
    serde_json::from_slice(&raw).map_err(|e| format!("its index: {e}"))
}

fn disk_bytes(meta: &std::fs::Metadata) -> u64 {
    #[cfg(unix)]
    {
        std::os::unix::fs::MetadataExt::blocks(meta) * 512
    }
    #[cfg(not(unix))]
    {
        meta.len()
    }
}

fn remove(path: &Path, why: &str) {
    match std::fs::remove_file(path) {
        Ok(()) => tracing::debug!(path = %path.display(), why, "removed from the repack cache"),
        Err(e) => {
            tracing::debug!(path = %path.display(), error = %e, "could not remove from the repack cache")
        }
    }
}

#[cfg(unix)]
fn write_at(file: &File, buf: &[u8], at: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::write_all_at(file, buf, at)
}

#[cfg(not(unix))]
fn write_at(_: &File, _: &[u8], _: u64) -> std::io::Result<()> {
    Err(std::io::Error::other("no positioned writes here"))
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};

    use super::*;
    use crate::gguf::RawType;
    use crate::gguf::tests::{sample, write_gguf};

    /// The weights of the test file: every kind with a kernel, one large enough that
    /// its quants are mapped from the entry, not read.
    const WEIGHTS: [(&str, u32, usize, usize); 7] = [
        ("q8_0.weight", 8, 512, 4608),
        ("q4_0.weight", 2, 40, 256),
        ("q5_1.weight", 7, 17, 512),
        ("q4_k.weight", 12, 33, 512),
        ("q6_k.weight", 14, 16, 256),
        ("iq4_nl.weight", 20, 20, 64),
        ("iq4_xs.weight", 23, 18, 256),
    ];

    /// Writes the test file at `path`, its values from `seed`.
    fn write_model(path: &Path, seed: u64) {
        let tensors: Vec<(&str, u32, Vec<usize>, Vec<u8>)> = WEIGHTS
            .iter()
            .map(|&(name, id, out, inp)| {
                let data = match id {
                    20 | 23 => {
                        let ty = if id == 20 {
                            RawType::Iq4Nl
                        } else {
                            RawType::Iq4Xs
                        };
                        sample(ty, out, inp, seed as usize).data
                    }
                    _ => {
                        let dtype = match id {
                            8 => GgmlDType::Q8_0,
                            2 => GgmlDType::Q4_0,
                            7 => GgmlDType::Q5_1,
                            12 => GgmlDType::Q4K,
                            _ => GgmlDType::Q6K,
                        };
                        let t = Tensor::randn(0f32, 1.0, (out, inp), &Device::Cpu).unwrap();
                        let t = (t + seed as f64).unwrap();
                        QTensor::quantize(&t, dtype)
                            .unwrap()
                            .data()
                            .unwrap()
                            .to_vec()
                    }
                };
                (name, id, vec![out, inp], data)
            })
            .collect();
        write_gguf(path, &[], &tensors);
    }

    /// Loads every weight of `path` through `cache`: the weights, and how many were
    /// repacked rather than read from an entry.
    fn load(cache: &RepackCache, path: &Path) -> (Vec<Arc<FastLinear>>, usize) {
        let gguf = GgufFile::open(path).unwrap();
        let mut loading = cache.start(&gguf);
        let weights = WEIGHTS
            .iter()
            .map(|(name, ..)| loading.weight(&gguf, name).unwrap())
            .collect();
        let repacked = loading.repacked;
        loading.finish();
        (weights, repacked)
    }

    /// Each weight's output on a fixed input, as bits.
    fn outputs(weights: &[Arc<FastLinear>]) -> Vec<Vec<u32>> {
        weights
            .iter()
            .map(|w| {
                let (_, inp) = w.shape();
                let x: Vec<f32> = (0..3 * inp)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
                    .collect();
                let x = Tensor::from_vec(x, (3, inp), &Device::Cpu).unwrap();
                let y = w
                    .forward(&x)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                y.iter().map(|v| v.to_bits()).collect()
            })
            .collect()
    }

    fn entries(dir: &Path) -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
            .map(|r| r.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        v.sort();
        v
    }

    struct Setup {
        _tmp: tempfile::TempDir,
        model: PathBuf,
        dir: PathBuf,
        cache: RepackCache,
    }

    fn setup() -> Setup {
        let tmp = tempfile::tempdir().unwrap();
        let model = tmp.path().join("m.gguf");
        write_model(&model, 1);
        let dir = tmp.path().join("repacked");
        let cache = RepackCache::in_dir(&dir, 0, 1 << 30);
        Setup {
            _tmp: tmp,
            model,
            dir,
            cache,
        }
    }

    #[test]
    fn a_second_load_maps_what_the_first_repacked() {
        let s = setup();
        let (first, repacked) = load(&s.cache, &s.model);
        assert_eq!(repacked, WEIGHTS.len());
        let written = entries(&s.dir);
        assert_eq!(written.len(), 1, "{written:?}");
        let (second, repacked) = load(&s.cache, &s.model);
        assert_eq!(repacked, 0, "every weight from the entry");
        assert_eq!(entries(&s.dir), written);
        let (fresh, _) = load(&RepackCache::off(), &s.model);
        for ((a, b), c) in first.iter().zip(&second).zip(&fresh) {
            let bytes = |w: &FastLinear| w.stored(0).1.map(|(bytes, _)| bytes.to_vec());
            assert_eq!(a.stored(0).0, b.stored(0).0);
            assert_eq!(bytes(a), bytes(b), "{:?}", a.kind());
            assert_eq!(bytes(b), bytes(c));
        }
        assert_eq!(outputs(&second), outputs(&fresh));
        // The large weight's arrays start on 2 MiB boundaries in the entry.
        let entry = Entry::open(
            &written[0],
            &Source::of(&GgufFile::open(&s.model).unwrap()).unwrap(),
        )
        .unwrap();
        let big = &entry.index.weights["q8_0.weight"];
        assert!(big.arrays[0].1 >= MAPPED as u64);
        assert_eq!(big.arrays[0].0 % MAPPED as u64, 0);
    }

    #[test]
    fn large_arrays_are_packed_straight_into_the_entry() {
        let s = setup();
        let gguf = GgufFile::open(&s.model).unwrap();
        let mut loading = s.cache.start(&gguf);
        let big = loading.weight(&gguf, WEIGHTS[0].0).unwrap();
        let small = loading.weight(&gguf, WEIGHTS[1].0).unwrap();
        let arena = loading.arena().expect("a miss packs into a new entry");
        let (_, arrays) = big.stored(arena);
        assert!(arrays[0].0.len() >= MAPPED);
        let at = arrays[0].1.expect("the quants are in the entry's file");
        assert_eq!(at % MAPPED as u64, 0);
        assert!(
            small.stored(arena).1.iter().all(|(_, at)| at.is_none()),
            "on the heap"
        );
        for (name, ..) in &WEIGHTS[2..] {
            loading.weight(&gguf, name).unwrap();
        }
        loading.finish();
        // The entry holds them where they were packed.
        let path = entries(&s.dir).pop().unwrap();
        let index = Entry::open(&path, &Source::of(&gguf).unwrap())
            .unwrap()
            .index;
        assert_eq!(index.weights[WEIGHTS[0].0].arrays[0].0, at);
        let bytes = std::fs::read(&path).unwrap();
        let quants = arrays[0].0;
        assert_eq!(&bytes[at as usize..at as usize + quants.len()], quants);
    }

    #[test]
    fn a_folder_that_cannot_be_made_still_loads_every_weight() {
        let s = setup();
        // Under a plain file: no folder can be made there, whoever runs the test.
        let file = s.dir.with_file_name("plain");
        std::fs::write(&file, b"").unwrap();
        let cache = RepackCache::in_dir(file.join("repacked"), 0, 1 << 30);
        let (got, repacked) = load(&cache, &s.model);
        assert_eq!(repacked, WEIGHTS.len());
        let (fresh, _) = load(&RepackCache::off(), &s.model);
        assert_eq!(outputs(&got), outputs(&fresh));
    }

    #[test]
    fn a_cache_that_is_off_or_a_model_too_small_writes_nothing() {
        let s = setup();
        load(&RepackCache::off(), &s.model);
        let small = RepackCache::in_dir(&s.dir, 1 << 40, 1 << 50);
        let (_, repacked) = load(&small, &s.model);
        assert_eq!(repacked, WEIGHTS.len());
        assert!(entries(&s.dir).is_empty());
        let too_big_for_the_folder = RepackCache::in_dir(&s.dir, 0, 1 << 10);
        load(&too_big_for_the_folder, &s.model);
        assert!(entries(&s.dir).is_empty());
    }

    /// Damages the only entry with `damage(bytes)`, then loads twice: the first load
    /// repacks what it cannot use and gives the fresh weights' outputs, and rewrites
    /// the entry, which the second load uses whole.
    fn survives(damage: impl Fn(&mut Vec<u8>, &Index)) {
        let s = setup();
        load(&s.cache, &s.model);
        let path = entries(&s.dir).pop().unwrap();
        let source = Source::of(&GgufFile::open(&s.model).unwrap()).unwrap();
        let index = Entry::open(&path, &source).unwrap().index;
        let mut bytes = std::fs::read(&path).unwrap();
        damage(&mut bytes, &index);
        std::fs::write(&path, &bytes).unwrap();
        let (fresh, _) = load(&RepackCache::off(), &s.model);
        let (got, repacked) = load(&s.cache, &s.model);
        assert!(repacked > 0);
        assert_eq!(outputs(&got), outputs(&fresh));
        let (again, repacked) = load(&s.cache, &s.model);
        assert_eq!(repacked, 0, "rewritten whole");
        assert_eq!(outputs(&again), outputs(&fresh));
    }

    /// Replaces the index (same length or not) and the prefix that locates it.
    fn reindex(bytes: &mut Vec<u8>, index: &Index, edit: impl Fn(&mut Index)) {
        let at = u64::from_le_bytes(bytes[8..16].try_into().unwrap());
        let mut index: Index = serde_json::from_slice(&serde_json::to_vec(index).unwrap()).unwrap();
        edit(&mut index);
        bytes.truncate(at as usize);
        let mut json = serde_json::to_vec(&index).unwrap();
        index.len = at + json.len() as u64;
        json = serde_json::to_vec(&index).unwrap();
        index.len = at + json.len() as u64;
        json = serde_json::to_vec(&index).unwrap();
        bytes.extend(&json);
        bytes[16..24].copy_from_slice(&(json.len() as u64).to_le_bytes());
    }

    #[test]
    fn a_truncated_entry_is_repacked_and_rewritten() {
        survives(|bytes, _| bytes.truncate(bytes.len() / 2));
    }

    #[test]
    fn an_entry_with_a_garbled_index_is_repacked_and_rewritten() {
        survives(|bytes, _| {
            let n = bytes.len();
            bytes[n - 10..].fill(b'#');
        });
        survives(|bytes, _| bytes[..8].copy_from_slice(b"NOTANENT"));
    }

    #[test]
    fn an_array_of_the_wrong_length_is_never_handed_to_the_kernels() {
        // One weight's quants cut short by 64 bytes: that weight is repacked.
        survives(|bytes, index| {
            reindex(bytes, index, |i| {
                i.weights.get_mut("q4_k.weight").unwrap().arrays[0].1 -= 64;
            })
        });
        // A weight whose recorded shape no longer matches the file's tensor.
        survives(|bytes, index| {
            reindex(bytes, index, |i| {
                i.weights.get_mut("q6_k.weight").unwrap().dims[0] += 16;
            })
        });
        // A form claiming more rows than the arrays hold.
        survives(|bytes, index| {
            reindex(bytes, index, |i| {
                i.weights.get_mut("q8_0.weight").unwrap().form.out_features += 16;
            })
        });
        // An array said to lie past the end.
        survives(|bytes, index| {
            reindex(bytes, index, |i| {
                i.weights.get_mut("iq4_xs.weight").unwrap().arrays[0].0 = 1 << 40;
            })
        });
    }

    #[test]
    fn an_entry_of_another_packing_is_not_read() {
        survives(|bytes, index| reindex(bytes, index, |i| i.layout = "0".repeat(64)));
    }

    #[test]
    fn a_changed_model_file_misses_and_its_old_entry_goes() {
        let s = setup();
        load(&s.cache, &s.model);
        let old = entries(&s.dir);
        // Another file at the same path (a new inode, size or time).
        std::fs::remove_file(&s.model).unwrap();
        write_model(&s.model, 2);
        let (got, repacked) = load(&s.cache, &s.model);
        assert_eq!(repacked, WEIGHTS.len());
        let (fresh, _) = load(&RepackCache::off(), &s.model);
        assert_eq!(outputs(&got), outputs(&fresh));
        let now = entries(&s.dir);
        assert_eq!(now.len(), 1);
        assert_ne!(now, old, "the old file's entry was removed");
    }

    #[test]
    fn the_folder_keeps_the_most_recently_used_entries_within_its_bound() {
        let s = setup();
        let models: Vec<PathBuf> = (0..3)
            .map(|i| {
                let p = s.model.with_file_name(format!("m{i}.gguf"));
                write_model(&p, i + 3);
                p
            })
            .collect();
        load(&s.cache, &models[0]);
        let one = std::fs::metadata(&entries(&s.dir)[0])
            .map(|m| disk_bytes(&m))
            .unwrap();
        // Room for two entries.
        let cache = RepackCache::in_dir(&s.dir, 0, 2 * one + one / 2);
        load(&cache, &models[1]);
        // models[0] is used again: models[1]'s entry is now the least recent.
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(load(&cache, &models[0]).1, 0);
        std::thread::sleep(std::time::Duration::from_millis(20));
        load(&cache, &models[2]);
        assert_eq!(entries(&s.dir).len(), 2);
        assert_eq!(load(&cache, &models[0]).1, 0, "kept");
        assert_eq!(load(&cache, &models[2]).1, 0, "kept");
        assert_eq!(
            load(&RepackCache::in_dir(&s.dir, 0, 1 << 40), &models[1]).1,
            WEIGHTS.len(),
            "evicted"
        );
    }

    #[test]
    fn temporary_files_of_dead_writers_are_removed_once_old() {
        let s = setup();
        std::fs::create_dir_all(&s.dir).unwrap();
        let (old, young) = (s.dir.join(".repack-a.tmp"), s.dir.join(".repack-b.tmp"));
        for p in [&old, &young] {
            std::fs::write(p, b"half an entry").unwrap();
        }
        let f = File::options().write(true).open(&old).unwrap();
        f.set_modified(std::time::SystemTime::now() - 2 * STALE_TMP)
            .unwrap();
        load(&s.cache, &s.model);
        assert!(!old.exists());
        assert!(young.exists(), "may be another process's write in progress");
    }

    #[test]
    fn the_environment_turns_it_off_or_moves_it() {
        let default = default_dir(None, Some("/home/u".into()));
        assert_eq!(
            default,
            Some(PathBuf::from("/home/u/.cache/agentstack/repacked"))
        );
        assert_eq!(
            default_dir(Some("/c".into()), Some("/home/u".into())),
            Some(PathBuf::from("/c/agentstack/repacked"))
        );
        let of = |cache: Option<&str>, max: Option<&str>| {
            RepackCache::from_settings(cache.map(OsStr::new), max.map(OsStr::new), default.clone())
        };
        for off in ["off", "0", "FALSE", " no "] {
            assert_eq!(of(Some(off), None).dir(), None, "{off}");
        }
        for on in [None, Some(""), Some("on"), Some("1"), Some("true")] {
            assert_eq!(of(on, None).dir(), default.as_deref(), "{on:?}");
        }
        assert_eq!(
            of(Some("/fast/disk"), None).dir(),
            Some(Path::new("/fast/disk"))
        );
        assert_eq!(of(None, None).max_bytes, RepackCache::DEFAULT_MAX_GIB << 30);
        assert_eq!(of(None, Some(" 5 ")).max_bytes, 5 << 30);
        assert_eq!(
            of(None, Some("lots")).max_bytes,
            RepackCache::DEFAULT_MAX_GIB << 30
        );
        assert_eq!(RepackCache::off().dir(), None);
    }
}
