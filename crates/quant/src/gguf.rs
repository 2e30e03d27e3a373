//! GGUF v3 reading and writing under llama.cpp's rules.
//!
//! The reader accepts every tensor type with a known layout (candle's reader rejects the
//! whole file at the first IQ tensor) and checks what llama.cpp checks: magic, version
//! 2 or 3, unique keys and tensor names, names under 64 bytes, at most 4 dimensions, row
//! lengths that are whole blocks, a power-of-two `general.alignment` of type u32, and
//! tensor offsets that are exactly the running padded sizes in tensor order.
//!
//! The writer produces version 3 with those same rules, so anything it writes loads in
//! llama.cpp; it streams tensor data one tensor at a time and writes through a temporary
//! file renamed into place, so a killed run never leaves a partial output.

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::error::{QuantError, Result};
use crate::types::GgmlType;

const MAGIC: u32 = 0x4655_4747; // "GGUF" little-endian
/// The alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// llama.cpp's `GGML_MAX_NAME`: names must be shorter.
const MAX_NAME: usize = 64;
/// Bounds that stop a hostile header from asking for absurd allocations.
const MAX_STRING: u64 = 1 << 30;
const MAX_ARRAY: u64 = 1 << 32;

/// A metadata value, keeping the exact GGUF type (an empty array keeps its element
/// type, integers keep their width), so a file read and written back is identical.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// Type 0.
    U8(u8),
    /// Type 1.
    I8(i8),
    /// Type 2.
    U16(u16),
    /// Type 3.
    I16(i16),
    /// Type 4.
    U32(u32),
    /// Type 5.
    I32(i32),
    /// Type 6.
    F32(f32),
    /// Type 7.
    Bool(bool),
    /// Type 8.
    String(String),
    /// Type 9: element type and elements.
    Array(u32, Vec<Value>),
    /// Type 10.
    U64(u64),
    /// Type 11.
    I64(i64),
    /// Type 12.
    F64(f64),
}

impl Value {
    /// The GGUF value type id.
    pub fn type_id(&self) -> u32 {
        match self {
            Self::U8(_) => 0,
            Self::I8(_) => 1,
            Self::U16(_) => 2,
            Self::I16(_) => 3,
            Self::U32(_) => 4,
            Self::I32(_) => 5,
            Self::F32(_) => 6,
            Self::Bool(_) => 7,
            Self::String(_) => 8,
            Self::Array(..) => 9,
            Self::U64(_) => 10,
            Self::I64(_) => 11,
            Self::F64(_) => 12,
        }
    }

    /// The value as an unsigned integer, whatever its width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U8(v) => Some(v.into()),
            Self::U16(v) => Some(v.into()),
            Self::U32(v) => Some(v.into()),
            Self::U64(v) => Some(v),
            Self::I8(v) => u64::try_from(v).ok(),
            Self::I16(v) => u64::try_from(v).ok(),
            Self::I32(v) => u64::try_from(v).ok(),
            Self::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }
}

/// One tensor's entry in the directory.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// Its name (`blk.0.attn_q.weight`).
    pub name: String,
    /// `ne`: the fastest-varying dimension (row length) first, as GGUF stores it.
    pub dims: Vec<u64>,
    /// Its type.
    pub ty: GgmlType,
    /// Offset of its data from the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// Values in the tensor.
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Row length (`ne[0]`).
    pub fn row_len(&self) -> usize {
        self.dims.first().copied().unwrap_or(1) as usize
    }

    /// Bytes of data.
    pub fn bytes(&self) -> u64 {
        let block = self.ty.block_size() as u64;
        if block == 0 {
            return 0;
        }
        self.elements() / block * self.ty.type_size() as u64
    }
}

/// An open GGUF file: metadata and tensor directory in memory, data read on demand.
#[derive(Debug)]
pub struct Gguf {
    path: PathBuf,
    /// Version in the header (2 or 3).
    pub version: u32,
    /// Metadata in file order.
    pub metadata: Vec<(String, Value)>,
    /// Tensors in file order.
    pub tensors: Vec<TensorInfo>,
    /// Alignment of the data section and of each tensor.
    pub alignment: u64,
    /// Where the data section starts.
    pub data_offset: u64,
    reader: BufReader<File>,
}

struct Cursor<'a, R> {
    r: &'a mut R,
    path: &'a Path,
    at: u64,
}

impl<R: Read> Cursor<'_, R> {
    fn bad(&self, reason: impl Into<String>) -> QuantError {
        QuantError::BadGguf {
            path: self.path.to_path_buf(),
            reason: format!("{} (at byte {})", reason.into(), self.at),
        }
    }

    fn bytes<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut buf = [0u8; N];
        self.r.read_exact(&mut buf).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                self.bad("the file ends inside its header")
            } else {
                QuantError::Io {
                    path: self.path.to_path_buf(),
                    source: e,
                }
            }
        })?;
        self.at += N as u64;
        Ok(buf)
    }

    fn u32(&mut self) -> Result<u32> {
        self.bytes().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64> {
        self.bytes().map(u64::from_le_bytes)
    }

    fn string(&mut self) -> Result<String> {
        let len = self.u64()?;
        if len > MAX_STRING {
            return Err(self.bad(format!("a string claims {len} bytes")));
        }
        let mut buf = vec![0u8; len as usize];
        self.r
            .read_exact(&mut buf)
            .map_err(|_| self.bad("the file ends inside a string"))?;
        self.at += len;
        String::from_utf8(buf).map_err(|_| self.bad("a string is not UTF-8"))
    }

    fn value(&mut self, ty: u32, depth: usize) -> Result<Value> {
        Ok(match ty {
            0 => Value::U8(self.bytes::<1>()?[0]),
            1 => Value::I8(self.bytes::<1>()?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.bytes()?)),
            3 => Value::I16(i16::from_le_bytes(self.bytes()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.bytes()?)),
            6 => Value::F32(f32::from_le_bytes(self.bytes()?)),
            7 => match self.bytes::<1>()?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(self.bad(format!("a bool has the byte {b}"))),
            },
            8 => Value::String(self.string()?),
            9 => {
                if depth > 4 {
                    return Err(self.bad("arrays nest more than 4 deep"));
                }
                let elem = self.u32()?;
                let n = self.u64()?;
                if n > MAX_ARRAY {
                    return Err(self.bad(format!("an array claims {n} elements")));
                }
                let mut items = Vec::with_capacity((n as usize).min(1 << 20));
                for _ in 0..n {
                    items.push(self.value(elem, depth + 1)?);
                }
                Value::Array(elem, items)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.bytes()?)),
            12 => Value::F64(f64::from_le_bytes(self.bytes()?)),
            other => return Err(self.bad(format!("unknown value type {other}"))),
        })
    }
}

fn pad(n: u64, alignment: u64) -> u64 {
    n.div_ceil(alignment) * alignment
}

impl Gguf {
    /// Opens `path` and reads and checks its header.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let io = |source| QuantError::Io {
            path: path.clone(),
            source,
        };
        let file = File::open(&path).map_err(io)?;
        let size = file.metadata().map_err(io)?.len();
        let mut reader = BufReader::with_capacity(1 << 20, file);
        let mut c = Cursor {
            r: &mut reader,
            path: &path,
            at: 0,
        };
        if c.u32()? != MAGIC {
            return Err(c.bad("no GGUF magic; is this a GGUF model file?"));
        }
        let version = c.u32()?;
        if version != 2 && version != 3 {
            return Err(c.bad(format!(
                "version {version}; llama.cpp reads versions 2 and 3"
            )));
        }
        let n_tensors = c.u64()?;
        let n_kv = c.u64()?;
        if n_tensors > 1 << 24 || n_kv > 1 << 24 {
            return Err(c.bad(format!(
                "{n_tensors} tensors and {n_kv} keys is not plausible"
            )));
        }
        let mut metadata = Vec::with_capacity(n_kv as usize);
        let mut keys = HashSet::new();
        for _ in 0..n_kv {
            let key = c.string()?;
            let ty = c.u32()?;
            let value = c.value(ty, 0)?;
            if !keys.insert(key.clone()) {
                return Err(c.bad(format!("duplicate metadata key `{key}`")));
            }
            metadata.push((key, value));
        }
        let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some((_, Value::U32(a))) if a.is_power_of_two() => u64::from(*a),
            Some((_, v)) => {
                return Err(c.bad(format!(
                    "general.alignment must be a u32 power of two, found {v:?}"
                )));
            }
        };
        let mut tensors = Vec::with_capacity(n_tensors as usize);
        let mut names = HashSet::new();
        let mut expected = 0u64;
        for _ in 0..n_tensors {
            let name = c.string()?;
            if name.len() >= MAX_NAME {
                return Err(c.bad(format!(
                    "tensor name `{name}` is {} bytes; llama.cpp allows at most {}",
                    name.len(),
                    MAX_NAME - 1
                )));
            }
            let n_dims = c.u32()?;
            if n_dims > 4 {
                return Err(c.bad(format!("tensor `{name}` has {n_dims} dimensions (max 4)")));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(c.u64()?);
            }
            let ty = GgmlType(c.u32()?);
            let offset = c.u64()?;
            if !ty.is_known() {
                return Err(c.bad(format!(
                    "tensor `{name}` has type id {}, which this reader does not know",
                    ty.0
                )));
            }
            // A tensor of no dimensions is one value: a row of 1.
            let row = dims.first().copied().unwrap_or(1);
            if !row.is_multiple_of(ty.block_size() as u64) {
                return Err(c.bad(format!(
                    "tensor `{name}`: row length {row} is not a multiple of {ty}'s block of {}",
                    ty.block_size()
                )));
            }
            // No tensor is larger than the file that holds it (which also keeps every
            // offset sum below in range).
            let fits = dims
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .and_then(|n| n.checked_div(ty.block_size() as u64))
                .and_then(|blocks| blocks.checked_mul(ty.type_size() as u64))
                .is_some_and(|bytes| bytes <= size);
            if !fits {
                return Err(c.bad(format!(
                    "tensor `{name}` has shape {dims:?}, larger than the file ({size} bytes)"
                )));
            }
            if offset != expected {
                return Err(c.bad(format!(
                    "tensor `{name}` is at offset {offset}, but llama.cpp requires {expected} \
                     (tensors contiguous, in directory order, each padded to {alignment})"
                )));
            }
            if !names.insert(name.clone()) {
                return Err(c.bad(format!("duplicate tensor name `{name}`")));
            }
            let info = TensorInfo {
                name,
                dims,
                ty,
                offset,
            };
            expected = pad(offset + info.bytes(), alignment);
            tensors.push(info);
        }
        let data_offset = pad(c.at, alignment);
        let data_end = tensors
            .last()
            .map_or(data_offset, |t| data_offset + t.offset + t.bytes());
        if data_end > size {
            return Err(QuantError::BadGguf {
                path,
                reason: format!(
                    "the tensors need {data_end} bytes but the file has {size}; it is truncated"
                ),
            });
        }
        Ok(Self {
            path,
            version,
            metadata,
            tensors,
            alignment,
            data_offset,
            reader,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A metadata value.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// A tensor's directory entry.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Bytes of all tensors (no padding).
    pub fn tensor_bytes(&self) -> u64 {
        self.tensors.iter().map(TensorInfo::bytes).sum()
    }

    /// Parameters in all tensors.
    pub fn parameters(&self) -> u64 {
        self.tensors.iter().map(TensorInfo::elements).sum()
    }

    /// Reads the raw bytes of tensor `index`.
    pub fn read(&mut self, index: usize) -> Result<Vec<u8>> {
        let info = &self.tensors[index];
        let mut buf = vec![0u8; info.bytes() as usize];
        let io = |source| QuantError::Io {
            path: self.path.clone(),
            source,
        };
        self.reader
            .seek(SeekFrom::Start(self.data_offset + info.offset))
            .map_err(io)?;
        self.reader.read_exact(&mut buf).map_err(io)?;
        Ok(buf)
    }

    /// Reads tensor `index` as f32 values (dequantized).
    pub fn read_f32(&mut self, index: usize) -> Result<Vec<f32>> {
        let bytes = self.read(index)?;
        let info = &self.tensors[index];
        crate::quantize::dequantize(info.ty, &bytes, info.elements() as usize).map_err(|reason| {
            QuantError::Unquantizable {
                name: info.name.clone(),
                reason,
            }
        })
    }
}

/// One tensor to write: its directory entry without the offset.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    /// Name.
    pub name: String,
    /// `ne`, row length first.
    pub dims: Vec<u64>,
    /// Type.
    pub ty: GgmlType,
}

impl TensorSpec {
    fn bytes(&self) -> u64 {
        TensorInfo {
            name: String::new(),
            dims: self.dims.clone(),
            ty: self.ty,
            offset: 0,
        }
        .bytes()
    }
}

fn write_string(w: &mut impl Write, s: &str) -> std::io::Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

fn write_value(w: &mut impl Write, v: &Value) -> std::io::Result<()> {
    match v {
        Value::U8(x) => w.write_all(&[*x]),
        Value::I8(x) => w.write_all(&x.to_le_bytes()),
        Value::U16(x) => w.write_all(&x.to_le_bytes()),
        Value::I16(x) => w.write_all(&x.to_le_bytes()),
        Value::U32(x) => w.write_all(&x.to_le_bytes()),
        Value::I32(x) => w.write_all(&x.to_le_bytes()),
        Value::F32(x) => w.write_all(&x.to_le_bytes()),
        Value::Bool(x) => w.write_all(&[u8::from(*x)]),
        Value::String(s) => write_string(w, s),
        Value::Array(elem, items) => {
            w.write_all(&elem.to_le_bytes())?;
            w.write_all(&(items.len() as u64).to_le_bytes())?;
            items.iter().try_for_each(|i| write_value(w, i))
        }
        Value::U64(x) => w.write_all(&x.to_le_bytes()),
        Value::I64(x) => w.write_all(&x.to_le_bytes()),
        Value::F64(x) => w.write_all(&x.to_le_bytes()),
    }
}

/// Checks what the writer is given against the rules the reader enforces, so a mistake is
/// reported before anything is written.
fn check(metadata: &[(String, Value)], tensors: &[TensorSpec]) -> Result<u64> {
    let invalid = |m: String| Err(QuantError::Invalid(m));
    let mut keys = HashSet::new();
    for (k, v) in metadata {
        if !keys.insert(k.as_str()) {
            return invalid(format!("metadata key `{k}` is given twice"));
        }
        if let Value::Array(elem, items) = v
            && let Some(bad) = items.iter().find(|i| i.type_id() != *elem)
        {
            return invalid(format!(
                "metadata `{k}`: array of type {elem} holds a value of type {}",
                bad.type_id()
            ));
        }
    }
    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((_, Value::U32(a))) if a.is_power_of_two() => u64::from(*a),
        Some((_, v)) => {
            return invalid(format!(
                "general.alignment must be a u32 power of two, not {v:?}"
            ));
        }
    };
    let mut names = HashSet::new();
    for t in tensors {
        if t.name.len() >= MAX_NAME {
            return invalid(format!("tensor name `{}` is 64 bytes or longer", t.name));
        }
        if !names.insert(t.name.as_str()) {
            return invalid(format!("tensor `{}` is given twice", t.name));
        }
        if t.dims.is_empty() || t.dims.len() > 4 {
            return invalid(format!(
                "tensor `{}` has {} dimensions (1 to 4)",
                t.name,
                t.dims.len()
            ));
        }
        if !t.ty.is_known() || !t.dims[0].is_multiple_of(t.ty.block_size() as u64) {
            return invalid(format!(
                "tensor `{}`: row length {} is not a whole number of {} blocks",
                t.name, t.dims[0], t.ty
            ));
        }
    }
    Ok(alignment)
}

/// Writes a GGUF v3 file at `path`: `metadata` in order, then `tensors` in order, whose
/// data `data(i)` produces one at a time (checked against the tensor's size). The file
/// appears at `path` only when complete (temporary file in the same folder, synced, then
/// renamed).
pub fn write(
    path: &Path,
    metadata: &[(String, Value)],
    tensors: &[TensorSpec],
    mut data: impl FnMut(usize) -> Result<Vec<u8>>,
) -> Result<u64> {
    let alignment = check(metadata, tensors)?;
    let io = |source| QuantError::Io {
        path: path.to_path_buf(),
        source,
    };
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let tmp = tempfile_in(dir, path).map_err(io)?;
    let mut w = BufWriter::with_capacity(1 << 20, tmp.as_file());
    let header = (|| -> std::io::Result<u64> {
        let mut n = CountingWriter {
            inner: &mut w,
            n: 0,
        };
        n.write_all(&MAGIC.to_le_bytes())?;
        n.write_all(&3u32.to_le_bytes())?;
        n.write_all(&(tensors.len() as u64).to_le_bytes())?;
        n.write_all(&(metadata.len() as u64).to_le_bytes())?;
        for (k, v) in metadata {
            write_string(&mut n, k)?;
            n.write_all(&v.type_id().to_le_bytes())?;
            write_value(&mut n, v)?;
        }
        let mut offset = 0u64;
        for t in tensors {
            write_string(&mut n, &t.name)?;
            n.write_all(&(t.dims.len() as u32).to_le_bytes())?;
            for d in &t.dims {
                n.write_all(&d.to_le_bytes())?;
            }
            n.write_all(&t.ty.0.to_le_bytes())?;
            n.write_all(&offset.to_le_bytes())?;
            offset = pad(offset + t.bytes(), alignment);
        }
        let at = n.n;
        n.write_all(&vec![0u8; (pad(at, alignment) - at) as usize])?;
        Ok(n.n)
    })()
    .map_err(io)?;
    let mut total = header;
    for (i, t) in tensors.iter().enumerate() {
        let bytes = data(i)?;
        if bytes.len() as u64 != t.bytes() {
            return Err(QuantError::Invalid(format!(
                "tensor `{}`: {} bytes of data for a {} tensor of {:?} ({} bytes expected)",
                t.name,
                bytes.len(),
                t.ty,
                t.dims,
                t.bytes()
            )));
        }
        w.write_all(&bytes).map_err(io)?;
        let padding = pad(bytes.len() as u64, alignment) - bytes.len() as u64;
        w.write_all(&vec![0u8; padding as usize]).map_err(io)?;
        total += bytes.len() as u64 + padding;
    }
    w.flush().map_err(io)?;
    drop(w);
    tmp.as_file().sync_all().map_err(io)?;
    tmp.persist(path).map_err(|e| io(e.error))?;
    Ok(total)
}

/// A temporary file beside `dest`, removed on drop unless persisted.
fn tempfile_in(dir: &Path, dest: &Path) -> std::io::Result<TempFile> {
    let stem = dest
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    for attempt in 0..100u32 {
        let candidate = dir.join(format!(".{stem}.{}.{attempt}.partial", std::process::id()));
        match File::options()
            .write(true)
            .create_new(true)
            .open(&candidate)
        {
            Ok(file) => {
                return Ok(TempFile {
                    path: candidate,
                    file: Some(file),
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
    Err(std::io::Error::other("no free temporary file name"))
}

/// A file written under a temporary name and renamed into place when complete.
pub(crate) struct TempFile {
    path: PathBuf,
    file: Option<File>,
}

/// Why a rename failed.
pub(crate) struct PersistError {
    pub(crate) error: std::io::Error,
}

impl TempFile {
    fn as_file(&self) -> &File {
        self.file.as_ref().expect("open until persisted")
    }

    fn persist(mut self, dest: &Path) -> Result<(), PersistError> {
        self.file.take();
        std::fs::rename(&self.path, dest).map_err(|error| PersistError { error })
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if self.file.is_some() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Writes `bytes` to `path` atomically (temporary file, sync, rename).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let io = |source| QuantError::Io {
        path: path.to_path_buf(),
        source,
    };
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let tmp = tempfile_in(dir, path).map_err(io)?;
    let mut f = tmp.as_file();
    f.write_all(bytes).map_err(io)?;
    f.sync_all().map_err(io)?;
    tmp.persist(path).map_err(|e| io(e.error))
}

struct CountingWriter<'a, W> {
    inner: &'a mut W,
    n: u64,
}

impl<W: Write> Write for CountingWriter<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.n += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Sets (or adds at the end) a metadata key.
pub fn set(metadata: &mut Vec<(String, Value)>, key: &str, value: Value) {
    match metadata.iter_mut().find(|(k, _)| k == key) {
        Some((_, v)) => *v = value,
        None => metadata.push((key.to_owned(), value)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_metadata() -> Vec<(String, Value)> {
        vec![
            ("general.architecture".into(), Value::String("llama".into())),
            ("general.alignment".into(), Value::U32(64)),
            ("x.u8".into(), Value::U8(7)),
            ("x.i16".into(), Value::I16(-3)),
            ("x.f64".into(), Value::F64(1.5)),
            ("x.bool".into(), Value::Bool(true)),
            ("x.empty".into(), Value::Array(8, vec![])),
            (
                "x.nested".into(),
                Value::Array(
                    9,
                    vec![Value::Array(5, vec![Value::I32(-1), Value::I32(2)])],
                ),
            ),
            (
                "tokenizer.chat_template".into(),
                Value::String("{% for m in messages %}{{ m.content }}{% endfor %}".into()),
            ),
        ]
    }

    fn specs() -> Vec<TensorSpec> {
        vec![
            TensorSpec {
                name: "a".into(),
                dims: vec![32, 3],
                ty: GgmlType::Q8_0,
            },
            TensorSpec {
                name: "b".into(),
                dims: vec![5],
                ty: GgmlType::F32,
            },
            TensorSpec {
                name: "c".into(),
                dims: vec![256, 2],
                ty: GgmlType::Q4_K,
            },
        ]
    }

    fn data_for(t: &TensorSpec, seed: u8) -> Vec<u8> {
        (0..t.bytes())
            .map(|i| (i as u8).wrapping_mul(31) ^ seed)
            .collect()
    }

    #[test]
    fn round_trip_keeps_metadata_tensors_and_alignment() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        let (meta, specs) = (sample_metadata(), specs());
        write(&path, &meta, &specs, |i| Ok(data_for(&specs[i], i as u8))).unwrap();
        let mut g = Gguf::open(&path).unwrap();
        assert_eq!(g.version, 3);
        assert_eq!(g.metadata, meta);
        assert_eq!(g.alignment, 64);
        assert_eq!(g.data_offset % 64, 0);
        for (i, t) in specs.iter().enumerate() {
            assert_eq!(g.tensors[i].offset % 64, 0);
            assert_eq!(
                (&g.tensors[i].name, &g.tensors[i].dims, g.tensors[i].ty),
                (&t.name, &t.dims, t.ty)
            );
            assert_eq!(g.read(i).unwrap(), data_for(t, i as u8));
        }
        // Written again from what was read: byte-identical.
        let again = dir.path().join("again.gguf");
        let tensors: Vec<TensorSpec> = g
            .tensors
            .iter()
            .map(|t| TensorSpec {
                name: t.name.clone(),
                dims: t.dims.clone(),
                ty: t.ty,
            })
            .collect();
        let meta = g.metadata.clone();
        write(&again, &meta, &tensors, |i| g.read(i)).unwrap();
        assert_eq!(
            std::fs::read(&path).unwrap(),
            std::fs::read(&again).unwrap()
        );
        // Nothing temporary left behind.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
    }

    #[test]
    fn reader_rejects_what_llama_cpp_rejects() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        let specs = specs();
        write(&path, &sample_metadata(), &specs, |i| {
            Ok(data_for(&specs[i], 0))
        })
        .unwrap();
        let good = std::fs::read(&path).unwrap();
        let expect_err = |bytes: &[u8], needle: &str| {
            let p = dir.path().join("bad.gguf");
            std::fs::write(&p, bytes).unwrap();
            let err = Gguf::open(&p).unwrap_err().to_string();
            assert!(err.contains(needle), "{err} should mention {needle}");
        };
        // Truncated data.
        expect_err(&good[..good.len() - 100], "truncated");
        // Version 1.
        let mut v1 = good.clone();
        v1[4] = 1;
        expect_err(&v1, "version 1");
        // Not GGUF.
        expect_err(b"PK\x03\x04 not a model", "magic");
        // An offset moved by one alignment unit: not contiguous.
        let second_offset = find_offset_field(&good, "b");
        let mut moved = good.clone();
        let off = u64::from_le_bytes(moved[second_offset..second_offset + 8].try_into().unwrap());
        moved[second_offset..second_offset + 8].copy_from_slice(&(off + 64).to_le_bytes());
        expect_err(&moved, "llama.cpp requires");
        // A shape whose byte count overflows, and one merely larger than the file.
        let dims_at = find_offset_field(&good, "a") - 4 - 8;
        for rows in [1u64 << 58, 1 << 20] {
            let mut huge = good.clone();
            huge[dims_at..dims_at + 8].copy_from_slice(&rows.to_le_bytes());
            expect_err(&huge, "larger than the file");
        }
        // A quantized tensor of no dimensions (one value, not a whole block): refused,
        // not a panic (found by `imatrix`'s damaged-files property test).
        let mut scalar = b"GGUF".to_vec();
        scalar.extend(3u32.to_le_bytes());
        scalar.extend(1u64.to_le_bytes()); // tensors
        scalar.extend(0u64.to_le_bytes()); // metadata
        scalar.extend(1u64.to_le_bytes());
        scalar.push(b'a');
        scalar.extend(0u32.to_le_bytes()); // dimensions
        scalar.extend(GgmlType::Q8_0.0.to_le_bytes());
        scalar.extend(0u64.to_le_bytes()); // offset
        scalar.resize(128, 0);
        expect_err(&scalar, "row length 1 is not a multiple");
    }

    /// Position of the offset field of tensor `name` in a file written by `write`.
    fn find_offset_field(bytes: &[u8], name: &str) -> usize {
        let mut pat = (name.len() as u64).to_le_bytes().to_vec();
        pat.extend_from_slice(name.as_bytes());
        let at = bytes
            .windows(pat.len())
            .position(|w| w == pat.as_slice())
            .unwrap();
        let n_dims = u32::from_le_bytes(
            bytes[at + pat.len()..at + pat.len() + 4]
                .try_into()
                .unwrap(),
        );
        at + pat.len() + 4 + 8 * n_dims as usize + 4
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(256))]

        /// Damaged files (bytes overwritten anywhere, or cut short) are refused with an
        /// error or read consistently; the reader never panics or over-allocates.
        #[test]
        fn damaged_files_never_panic_the_reader(
            edits in proptest::collection::vec((0usize..4096, proptest::num::u8::ANY), 1..8),
            cut in proptest::option::of(0usize..4096),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("m.gguf");
            let specs = specs();
            write(&path, &sample_metadata(), &specs, |i| Ok(data_for(&specs[i], 0))).unwrap();
            let bytes = crate::testing::damage(std::fs::read(&path).unwrap(), &edits, cut);
            std::fs::write(&path, &bytes).unwrap();
            if let Ok(mut g) = Gguf::open(&path) {
                for i in 0..g.tensors.len() {
                    let want = g.tensors[i].bytes();
                    proptest::prop_assert!(want <= bytes.len() as u64);
                    let data = g.read(i).unwrap();
                    proptest::prop_assert_eq!(data.len() as u64, want);
                }
            }
        }
    }

    #[test]
    fn writer_refuses_bad_input_and_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        let mut specs = specs();
        specs[2].dims = vec![576, 2]; // not whole Q4_K blocks
        let err = write(&path, &sample_metadata(), &specs, |_| Ok(vec![])).unwrap_err();
        assert!(err.to_string().contains("576"), "{err}");
        let specs = self::specs();
        let err = write(&path, &sample_metadata(), &specs, |i| {
            Ok(vec![0; specs[i].bytes() as usize + usize::from(i == 1)])
        })
        .unwrap_err();
        assert!(err.to_string().contains("bytes expected"), "{err}");
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "no partial file left"
        );
        let mut meta = sample_metadata();
        meta[1].1 = Value::U32(48);
        assert!(write(&path, &meta, &specs, |_| Ok(vec![])).is_err());
    }
}
