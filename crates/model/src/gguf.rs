//! Reading GGUF files: metadata, tensor directory and weights.
//!
//! The header is read here rather than by candle's `Content::read`, which rejects a whole
//! file at the first tensor type it does not know: IQ4_NL and IQ4_XS tensors (what
//! IQ4_XS files hold) are listed with the rest and read as raw blocks
//! ([`Weight::Raw`]) for this crate's kernels, while every type candle knows is still
//! read by candle into a [`QTensor`]. The header checks and their messages are candle's.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use crate::error::{ModelError, Result};
use crate::kernels::FastLinear;

/// The alignment of the data section when `general.alignment` is absent.
const DEFAULT_ALIGNMENT: u64 = 32;
// candle's bounds (those of llama.cpp and ggml), so a crafted header cannot ask for
// absurd allocations or recurse without end.
const MAX_STRING_LENGTH: u64 = 1 << 30;
const MAX_ARRAY_ELEMENTS: u64 = 1 << 30;
const MAX_TENSOR_DIMS: u32 = 4;
const MAX_VALUE_DEPTH: usize = 64;

/// A tensor type candle cannot read, whose blocks this crate reads itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RawType {
    /// ggml type 20: blocks of 32, an f16 scale `d` and 16 bytes of 4-bit indices into a
    /// non-uniform codebook (`x = d·kvalues[i]`).
    Iq4Nl,
    /// ggml type 23: super-blocks of 256, an f16 `d`, eight 6-bit sub-block scales and
    /// IQ4_NL's indices (`x = d·(ls − 32)·kvalues[i]`).
    Iq4Xs,
}

impl RawType {
    /// Values per block.
    pub fn block_size(self) -> usize {
        match self {
            Self::Iq4Nl => 32,
            Self::Iq4Xs => 256,
        }
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        match self {
            Self::Iq4Nl => 18,
            Self::Iq4Xs => 136,
        }
    }
}

/// A tensor's type in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorType {
    /// A type candle reads.
    Ggml(GgmlDType),
    /// A type this crate reads.
    Raw(RawType),
}

impl TensorType {
    /// The type with GGUF id `id`.
    fn from_id(id: u32) -> candle_core::Result<Self> {
        Ok(match id {
            0 => Self::Ggml(GgmlDType::F32),
            1 => Self::Ggml(GgmlDType::F16),
            2 => Self::Ggml(GgmlDType::Q4_0),
            3 => Self::Ggml(GgmlDType::Q4_1),
            6 => Self::Ggml(GgmlDType::Q5_0),
            7 => Self::Ggml(GgmlDType::Q5_1),
            8 => Self::Ggml(GgmlDType::Q8_0),
            9 => Self::Ggml(GgmlDType::Q8_1),
            10 => Self::Ggml(GgmlDType::Q2K),
            11 => Self::Ggml(GgmlDType::Q3K),
            12 => Self::Ggml(GgmlDType::Q4K),
            13 => Self::Ggml(GgmlDType::Q5K),
            14 => Self::Ggml(GgmlDType::Q6K),
            15 => Self::Ggml(GgmlDType::Q8K),
            20 => Self::Raw(RawType::Iq4Nl),
            23 => Self::Raw(RawType::Iq4Xs),
            30 => Self::Ggml(GgmlDType::BF16),
            _ => candle_core::bail!("unknown dtype for tensor {id}"),
        })
    }

    /// Values per block.
    pub fn block_size(self) -> usize {
        match self {
            Self::Ggml(t) => t.block_size(),
            Self::Raw(t) => t.block_size(),
        }
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        match self {
            Self::Ggml(t) => t.type_size(),
            Self::Raw(t) => t.type_size(),
        }
    }
}

/// The names reports use: candle's in capitals for its types (`Q4K`, `Q8_0`), ggml's
/// for the others (`IQ4_XS`).
impl std::fmt::Display for TensorType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Ggml(t) => write!(f, "{}", format!("{t:?}").to_uppercase()),
            Self::Raw(RawType::Iq4Nl) => f.write_str("IQ4_NL"),
            Self::Raw(RawType::Iq4Xs) => f.write_str("IQ4_XS"),
        }
    }
}

/// The blocks of a tensor whose type candle cannot read, as stored in the file.
#[derive(Debug, Clone)]
pub struct RawTensor {
    /// Its type.
    pub ty: RawType,
    /// Its shape, the fastest-varying dimension last.
    pub dims: Vec<usize>,
    /// Its blocks.
    pub data: Vec<u8>,
}

/// A tensor read from the file.
#[derive(Debug)]
pub enum Weight {
    /// Read by candle.
    Ggml(QTensor),
    /// Read as raw blocks (IQ4_NL, IQ4_XS).
    Raw(RawTensor),
}

impl Weight {
    /// Its shape, the fastest-varying dimension last.
    pub fn dims(&self) -> &[usize] {
        match self {
            Self::Ggml(q) => q.shape().dims(),
            Self::Raw(r) => &r.dims,
        }
    }

    /// Its values as f32, computed as ggml dequantizes them.
    pub fn dequantize(&self) -> Result<Tensor> {
        match self {
            Self::Ggml(q) => Ok(q.dequantize(&Device::Cpu)?),
            Self::Raw(r) => Ok(FastLinear::from_raw(r)?
                .dequantize()?
                .reshape(r.dims.as_slice())?),
        }
    }
}

/// A tensor's blocks as the file holds them, mapped from the file rather than read:
/// the pages are the page cache's (no allocation, no copy), and they leave this
/// process's memory when it is dropped. Weights for this crate's kernels are repacked
/// from these bytes, so loading holds one copy of a weight, plus the one being packed.
pub struct MappedTensor {
    ty: TensorType,
    dims: Vec<usize>,
    /// None for a tensor of no bytes (the OS maps none).
    map: Option<memmap2::Mmap>,
}

impl std::fmt::Debug for MappedTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedTensor")
            .field("ty", &self.ty)
            .field("dims", &self.dims)
            .field("bytes", &self.bytes().len())
            .finish()
    }
}

impl MappedTensor {
    /// Its type.
    pub fn ty(&self) -> TensorType {
        self.ty
    }

    /// Its shape, the fastest-varying dimension last.
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    /// Its blocks.
    pub fn bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or_default()
    }
}

/// One tensor's directory entry.
#[derive(Debug)]
struct TensorInfo {
    ty: TensorType,
    /// The fastest-varying dimension last.
    dims: Vec<usize>,
    /// From the start of the data section.
    offset: u64,
}

/// An open GGUF file: its metadata and tensor directory, read once; weights are read on
/// demand.
pub struct GgufFile {
    path: PathBuf,
    metadata: HashMap<String, Value>,
    tensor_infos: HashMap<String, TensorInfo>,
    data_offset: u64,
    reader: BufReader<File>,
    size: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("tensors", &self.tensor_infos.len())
            .finish_non_exhaustive()
    }
}

impl GgufFile {
    /// Opens `path` and reads its header.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let io = |source| ModelError::Io {
            path: path.clone(),
            source,
        };
        let file = File::open(&path).map_err(io)?;
        let size = file.metadata().map_err(io)?.len();
        let mut reader = BufReader::new(file);
        let header = Header::read(&mut reader, size).map_err(|source| ModelError::Gguf {
            path: path.clone(),
            source,
        })?;
        Ok(Self {
            path,
            metadata: header.metadata,
            tensor_infos: header.tensor_infos,
            data_offset: header.data_offset,
            reader,
            size,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// All metadata, by key.
    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.metadata
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// A required string value.
    pub fn string(&self, key: &str) -> Result<&str> {
        let value = self.required(key)?;
        value
            .to_string()
            .map(String::as_str)
            .map_err(|_| bad(key, "expected a string"))
    }

    /// An optional string value.
    pub fn string_opt(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(_) => self.string(key).map(Some),
        }
    }

    /// A required unsigned integer value of any width.
    pub fn usize(&self, key: &str) -> Result<usize> {
        let value = self.required(key)?;
        integer(value)
            .and_then(|v| usize::try_from(v).ok())
            .ok_or_else(|| bad(key, "expected a non-negative integer"))
    }

    /// An optional unsigned integer value.
    pub fn usize_opt(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(_) => self.usize(key).map(Some),
        }
    }

    /// An optional floating-point value.
    pub fn f64_opt(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::F32(v)) => Ok(Some(f64::from(*v))),
            Some(Value::F64(v)) => Ok(Some(*v)),
            Some(other) => integer(other)
                .map(|v| Some(v as f64))
                .ok_or_else(|| bad(key, "expected a number")),
        }
    }

    /// An optional boolean value.
    pub fn bool_opt(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(v)) => Ok(Some(*v)),
            Some(_) => Err(bad(key, "expected a boolean")),
        }
    }

    /// A required array value.
    pub fn array(&self, key: &str) -> Result<&[Value]> {
        let value = self.required(key)?;
        value
            .to_vec()
            .map(Vec::as_slice)
            .map_err(|_| bad(key, "expected an array"))
    }

    fn required(&self, key: &str) -> Result<&Value> {
        self.get(key).ok_or_else(|| ModelError::MissingMetadata {
            key: key.to_owned(),
        })
    }

    /// Whether the file has a tensor called `name`.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.tensor_infos.contains_key(name)
    }

    /// The tensor directory: name → (type, shape with the fastest-varying dimension last).
    pub fn tensors(&self) -> BTreeMap<&str, (TensorType, Vec<usize>)> {
        self.tensor_infos
            .iter()
            .map(|(name, info)| (name.as_str(), (info.ty, info.dims.clone())))
            .collect()
    }

    /// The type of tensor `name`, if the file has it.
    pub fn tensor_type(&self, name: &str) -> Option<TensorType> {
        self.tensor_infos.get(name).map(|info| info.ty)
    }

    /// Tensor `name`'s shape, the fastest-varying dimension last.
    pub(crate) fn tensor_dims(&self, name: &str) -> Result<&[usize]> {
        Ok(entry(&self.tensor_infos, name)?.dims.as_slice())
    }

    /// The open file (its identity keys the repack cache).
    pub(crate) fn handle(&self) -> &File {
        self.reader.get_ref()
    }

    /// Maps tensor `name`'s blocks from the file, with the checks of [`Self::weight`].
    pub fn map(&self, name: &str) -> Result<MappedTensor> {
        let info = entry(&self.tensor_infos, name)?;
        let gguf = |source| ModelError::Gguf {
            path: self.path.clone(),
            source,
        };
        let (start, len) =
            tensor_range(self.size, self.data_offset, info, info.ty).map_err(gguf)?;
        let io = |source| ModelError::Io {
            path: self.path.clone(),
            source,
        };
        if len == 0 {
            // The OS refuses a mapping of no bytes.
            return Ok(MappedTensor {
                ty: info.ty,
                dims: info.dims.clone(),
                map: None,
            });
        }
        // SAFETY: the map is read-only and private. Its contents change only if another
        // process rewrites the file while it is mapped (then the weights read are the
        // new bytes, still within bounds): the contract every mmap-ing model loader
        // (llama.cpp, safetensors) has with its files.
        #[expect(unsafe_code, reason = "mapping a model file, as llama.cpp does")]
        let map = unsafe {
            memmap2::MmapOptions::new()
                .offset(start)
                .len(len)
                .populate()
                .map(self.reader.get_ref())
        }
        .map_err(io)?;
        Ok(MappedTensor {
            ty: info.ty,
            dims: info.dims.clone(),
            map: Some(map),
        })
    }

    /// Reads tensor `name`, of a type candle reads, into memory (see [`Self::weight`]
    /// for any type).
    pub fn tensor(&mut self, name: &str) -> Result<QTensor> {
        match self.weight(name)? {
            Weight::Ggml(q) => Ok(q),
            Weight::Raw(r) => Err(ModelError::BadTensor {
                name: name.to_owned(),
                reason: format!(
                    "type {} has no candle tensor; it is read as raw blocks",
                    TensorType::Raw(r.ty)
                ),
            }),
        }
    }

    /// Reads tensor `name` into memory: candle's tensor for the types candle reads, the
    /// raw blocks for the others.
    pub fn weight(&mut self, name: &str) -> Result<Weight> {
        let info = entry(&self.tensor_infos, name)?;
        let gguf = |source| ModelError::Gguf {
            path: self.path.clone(),
            source,
        };
        match info.ty {
            // Candle's reader multiplies the element count by the type size without a
            // check (a damaged shape then reads a few bytes as a huge tensor, whose
            // dequantization aborts on its allocation): the range is checked first.
            TensorType::Ggml(ggml_dtype) => {
                tensor_range(self.size, self.data_offset, info, info.ty)
                    .and_then(|_| {
                        gguf_file::TensorInfo {
                            ggml_dtype,
                            shape: info.dims.clone().into(),
                            offset: info.offset,
                        }
                        .read(
                            &mut self.reader,
                            self.data_offset,
                            &Device::Cpu,
                        )
                    })
                    .map(Weight::Ggml)
                    .map_err(gguf)
            }
            TensorType::Raw(ty) => {
                read_raw(&mut self.reader, self.size, self.data_offset, info, ty)
                    .map(|data| {
                        Weight::Raw(RawTensor {
                            ty,
                            dims: info.dims.clone(),
                            data,
                        })
                    })
                    .map_err(gguf)
            }
        }
    }
}

/// Tensor `name`'s directory entry.
fn entry<'a>(infos: &'a HashMap<String, TensorInfo>, name: &str) -> Result<&'a TensorInfo> {
    infos.get(name).ok_or_else(|| ModelError::BadTensor {
        name: name.to_owned(),
        reason: "missing from the file".into(),
    })
}

/// Values in a tensor of shape `dims`, refused when they overflow (candle's reader
/// would overflow computing them).
fn elements(dims: &[usize]) -> candle_core::Result<usize> {
    match dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d)) {
        Some(n) => Ok(n),
        None => candle_core::bail!("tensor shape {dims:?} has too many elements"),
    }
}

/// Where a tensor's blocks lie in the file (start, bytes), with the checks candle makes
/// for its own.
fn tensor_range(
    file_size: u64,
    data_offset: u64,
    info: &TensorInfo,
    ty: TensorType,
) -> candle_core::Result<(u64, usize)> {
    let elems = elements(&info.dims)?;
    let block_size = ty.block_size();
    if !elems.is_multiple_of(block_size) {
        candle_core::bail!(
            "the number of elements {elems} is not divisible by the block size {block_size}"
        )
    }
    let Some(size_in_bytes) = (elems / block_size).checked_mul(ty.type_size()) else {
        candle_core::bail!("tensor shape {:?} has too many bytes", info.dims)
    };
    let start = data_offset.saturating_add(info.offset);
    let remaining = file_size.saturating_sub(start);
    if size_in_bytes as u64 > remaining {
        candle_core::bail!(
            "tensor needs {size_in_bytes} bytes at offset {start}, only {remaining} remaining in file"
        )
    }
    Ok((start, size_in_bytes))
}

/// Reads the blocks of a raw tensor, with the checks candle makes for its own.
fn read_raw(
    reader: &mut BufReader<File>,
    file_size: u64,
    data_offset: u64,
    info: &TensorInfo,
    ty: RawType,
) -> candle_core::Result<Vec<u8>> {
    let (start, size_in_bytes) = tensor_range(file_size, data_offset, info, TensorType::Raw(ty))?;
    let mut data = vec![0u8; size_in_bytes];
    reader.seek(SeekFrom::Start(start))?;
    reader.read_exact(&mut data)?;
    Ok(data)
}

/// A GGUF header as candle's `Content::read` reads it, with the IQ4 types in the
/// directory.
struct Header {
    metadata: HashMap<String, Value>,
    tensor_infos: HashMap<String, TensorInfo>,
    data_offset: u64,
}

/// Reads a header from the start of a file of `size` bytes.
struct HeaderReader<'a> {
    r: &'a mut BufReader<File>,
    /// Bytes read so far.
    at: u64,
    size: u64,
    /// Version 1 has 32-bit lengths, later versions 64-bit.
    v1: bool,
}

impl HeaderReader<'_> {
    fn bytes<const N: usize>(&mut self) -> candle_core::Result<[u8; N]> {
        let mut buf = [0u8; N];
        self.r.read_exact(&mut buf)?;
        self.at += N as u64;
        Ok(buf)
    }

    fn u32(&mut self) -> candle_core::Result<u32> {
        self.bytes().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> candle_core::Result<u64> {
        self.bytes().map(u64::from_le_bytes)
    }

    fn length(&mut self) -> candle_core::Result<u64> {
        if self.v1 {
            self.u32().map(u64::from)
        } else {
            self.u64()
        }
    }

    fn remaining(&self) -> u64 {
        self.size.saturating_sub(self.at)
    }

    fn string(&mut self) -> candle_core::Result<String> {
        let len = self.length()?;
        if len > MAX_STRING_LENGTH {
            candle_core::bail!("gguf: string length {len} exceeds max {MAX_STRING_LENGTH}")
        }
        let remaining = self.remaining();
        if len > remaining {
            candle_core::bail!("gguf: string length {len} exceeds remaining file bytes {remaining}")
        }
        let mut v = vec![0u8; len as usize];
        self.r.read_exact(&mut v)?;
        self.at += len;
        // As candle: strings should not be null-terminated but some are, and some are not
        // valid UTF-8.
        while let Some(0) = v.last() {
            v.pop();
        }
        Ok(String::from_utf8_lossy(&v).into_owned())
    }

    /// Bytes a value of type `ty` takes at least.
    fn min_size(&self, ty: u32) -> u64 {
        let prefix = if self.v1 { 4 } else { 8 };
        match ty {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            10..=12 => 8,
            8 => prefix,
            _ => 4 + prefix,
        }
    }

    fn value(&mut self, ty: u32, depth: usize) -> candle_core::Result<Value> {
        if depth > MAX_VALUE_DEPTH {
            candle_core::bail!("gguf: value nesting depth exceeds max {MAX_VALUE_DEPTH}")
        }
        Ok(match ty {
            0 => Value::U8(self.bytes::<1>()?[0]),
            1 => Value::I8(i8::from_le_bytes(self.bytes()?)),
            2 => Value::U16(u16::from_le_bytes(self.bytes()?)),
            3 => Value::I16(i16::from_le_bytes(self.bytes()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.bytes()?)),
            6 => Value::F32(f32::from_le_bytes(self.bytes()?)),
            7 => match self.bytes::<1>()?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => candle_core::bail!("unexpected bool value {b}"),
            },
            8 => Value::String(self.string()?),
            9 => {
                let elem = self.u32()?;
                check_value_type(elem)?;
                let len = self.length()?;
                if len > MAX_ARRAY_ELEMENTS {
                    candle_core::bail!("gguf: array length {len} exceeds max {MAX_ARRAY_ELEMENTS}")
                }
                let needed = len.saturating_mul(self.min_size(elem));
                let remaining = self.remaining();
                if needed > remaining {
                    candle_core::bail!(
                        "gguf: array of {len} elements needs at least {needed} bytes, only {remaining} remaining"
                    )
                }
                let mut values = Vec::new();
                for _ in 0..len {
                    values.push(self.value(elem, depth + 1)?);
                }
                Value::Array(values)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.bytes()?)),
            12 => Value::F64(f64::from_le_bytes(self.bytes()?)),
            _ => unreachable!("value types are checked when read"),
        })
    }
}

fn check_value_type(ty: u32) -> candle_core::Result<u32> {
    if ty > 12 {
        candle_core::bail!("unrecognized value-type {ty:#08x}")
    }
    Ok(ty)
}

impl Header {
    fn read(reader: &mut BufReader<File>, size: u64) -> candle_core::Result<Self> {
        reader.seek(SeekFrom::Start(0))?;
        let mut h = HeaderReader {
            r: reader,
            at: 0,
            size,
            v1: false,
        };
        let magic = h.u32()?;
        if magic != 0x4655_4747 && magic != 0x4747_5546 {
            candle_core::bail!("unknown magic 0x{magic:08x}")
        }
        match h.u32()? {
            1 => h.v1 = true,
            2 | 3 => {}
            version => candle_core::bail!("gguf: unsupported magic/version Gguf/{version}"),
        }
        let tensor_count = h.length()?;
        let kv_count = h.length()?;
        if tensor_count > MAX_ARRAY_ELEMENTS {
            candle_core::bail!("gguf: tensor_count {tensor_count} exceeds max {MAX_ARRAY_ELEMENTS}")
        }
        if kv_count > MAX_ARRAY_ELEMENTS {
            candle_core::bail!(
                "gguf: metadata_kv_count {kv_count} exceeds max {MAX_ARRAY_ELEMENTS}"
            )
        }
        // A key-value pair takes at least a length, a type and a byte; a tensor entry a
        // length, a dimension count, a type and an offset.
        let prefix = if h.v1 { 4 } else { 8 };
        let needed = kv_count
            .saturating_mul(prefix + 4 + 1)
            .saturating_add(tensor_count.saturating_mul(prefix + 4 + 4 + 8));
        let remaining = h.remaining();
        if needed > remaining {
            candle_core::bail!(
                "gguf: header declares {tensor_count} tensors and {kv_count} metadata entries, needs at least {needed} bytes, only {remaining} remaining"
            )
        }
        let mut metadata = HashMap::new();
        for _ in 0..kv_count {
            let key = h.string()?;
            let ty = h.u32()?;
            let value = h.value(check_value_type(ty)?, 0)?;
            metadata.insert(key, value);
        }
        let mut tensor_infos = HashMap::new();
        for _ in 0..tensor_count {
            let name = h.string()?;
            let n_dims = h.u32()?;
            if n_dims > MAX_TENSOR_DIMS {
                candle_core::bail!(
                    "gguf: tensor '{name}' has {n_dims} dimensions, max is {MAX_TENSOR_DIMS}"
                )
            }
            let mut dims = (0..n_dims)
                .map(|_| h.length().map(|d| d as usize))
                .collect::<candle_core::Result<Vec<_>>>()?;
            dims.reverse();
            let ty = TensorType::from_id(h.u32()?)?;
            let offset = h.u64()?;
            tensor_infos.insert(name, TensorInfo { ty, dims, offset });
        }
        let alignment = match metadata.get("general.alignment") {
            Some(Value::U8(v)) => u64::from(*v),
            Some(Value::U16(v)) => u64::from(*v),
            Some(Value::U32(v)) => u64::from(*v),
            Some(Value::I8(v)) if *v >= 0 => *v as u64,
            Some(Value::I16(v)) if *v >= 0 => *v as u64,
            Some(Value::I32(v)) if *v >= 0 => *v as u64,
            _ => DEFAULT_ALIGNMENT,
        };
        // candle divides by a zero alignment; such a file gets the default instead.
        let alignment = if alignment == 0 {
            DEFAULT_ALIGNMENT
        } else {
            alignment
        };
        Ok(Self {
            metadata,
            tensor_infos,
            data_offset: h.at.div_ceil(alignment) * alignment,
        })
    }
}

fn bad(key: &str, reason: &str) -> ModelError {
    ModelError::BadMetadata {
        key: key.to_owned(),
        reason: reason.to_owned(),
    }
}

fn integer(value: &Value) -> Option<i128> {
    Some(match value {
        Value::U8(v) => i128::from(*v),
        Value::I8(v) => i128::from(*v),
        Value::U16(v) => i128::from(*v),
        Value::I16(v) => i128::from(*v),
        Value::U32(v) => i128::from(*v),
        Value::I32(v) => i128::from(*v),
        Value::U64(v) => i128::from(*v),
        Value::I64(v) => i128::from(*v),
        _ => return None,
    })
}

/// The bytes per element of a GGML type, for size reports.
pub fn bits_per_weight(dtype: GgmlDType) -> f64 {
    (dtype.type_size() as f64 * 8.0) / dtype.block_size() as f64
}

#[cfg(test)]
pub(crate) mod tests {
    use candle_core::quantized::gguf_file::Content;

    use super::*;

    /// Writes a GGUF v3 file byte by byte, as the format's spec lays it out: metadata
    /// (`(key, GGUF value type, value bytes)`), then tensors as `(name, type id, shape
    /// with the fastest-varying dimension last, data)`, the data section and every
    /// tensor aligned to 32 bytes.
    pub(crate) fn write_gguf(
        path: &Path,
        metadata: &[(&str, u32, Vec<u8>)],
        tensors: &[(&str, u32, Vec<usize>, Vec<u8>)],
    ) {
        fn string(out: &mut Vec<u8>, s: &str) {
            out.extend((s.len() as u64).to_le_bytes());
            out.extend(s.as_bytes());
        }
        let pad = |n: usize| n.div_ceil(32) * 32;
        let mut out = Vec::new();
        out.extend(0x4655_4747u32.to_le_bytes());
        out.extend(3u32.to_le_bytes());
        out.extend((tensors.len() as u64).to_le_bytes());
        out.extend((metadata.len() as u64).to_le_bytes());
        for (key, ty, value) in metadata {
            string(&mut out, key);
            out.extend(ty.to_le_bytes());
            out.extend(value);
        }
        let mut offset = 0;
        for (name, ty, dims, data) in tensors {
            string(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            for &d in dims.iter().rev() {
                out.extend((d as u64).to_le_bytes());
            }
            out.extend(ty.to_le_bytes());
            out.extend((offset as u64).to_le_bytes());
            offset = pad(offset + data.len());
        }
        for (_, _, _, data) in tensors {
            out.resize(pad(out.len()), 0);
            out.extend(data);
        }
        std::fs::write(path, out).unwrap();
    }

    /// `out × in` values of `ty` in blocks with every index and sub-block scale
    /// present, and scales `d` of both signs over several binades.
    pub(crate) fn sample(ty: RawType, out: usize, inp: usize, seed: usize) -> RawTensor {
        let blocks = out * inp / ty.block_size();
        let mut data = Vec::with_capacity(blocks * ty.type_size());
        for b in 0..blocks {
            let d = f16::from_f32(((b * 7 + seed) % 23) as f32 / 16.0 - 0.7).to_bits();
            data.extend(d.to_le_bytes());
            data.extend((2..ty.type_size()).map(|i| ((i * 113 + b * 29 + seed * 7) % 256) as u8));
        }
        RawTensor {
            ty,
            dims: vec![out, inp],
            data,
        }
    }

    /// ggml's `kvalues_iq4nl`.
    const KVALUES: [f32; 16] = [
        -127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0, 1.0, 13.0, 25.0, 38.0, 53.0,
        69.0, 89.0, 113.0,
    ];

    use half::f16;

    /// ggml's `dequantize_row_iq4_nl` and `dequantize_row_iq4_xs`, transcribed.
    pub(crate) fn ggml_dequantize(t: &RawTensor) -> Vec<f32> {
        let mut y = Vec::new();
        for x in t.data.chunks_exact(t.ty.type_size()) {
            let d = f16::from_bits(u16::from_le_bytes([x[0], x[1]])).to_f32();
            match t.ty {
                RawType::Iq4Nl => {
                    let qs = &x[2..18];
                    let mut block = [0f32; 32];
                    for j in 0..16 {
                        block[j] = d * KVALUES[(qs[j] & 0xf) as usize];
                        block[j + 16] = d * KVALUES[(qs[j] >> 4) as usize];
                    }
                    y.extend(block);
                }
                RawType::Iq4Xs => {
                    let scales_h = u16::from_le_bytes([x[2], x[3]]) as i32;
                    let scales_l = &x[4..8];
                    for ib in 0..8 {
                        let ls = ((scales_l[ib / 2] as i32 >> (4 * (ib % 2))) & 0xf)
                            | (((scales_h >> (2 * ib)) & 3) << 4);
                        let dl = d * (ls - 32) as f32;
                        let qs = &x[8 + 16 * ib..];
                        let mut block = [0f32; 32];
                        for j in 0..16 {
                            block[j] = dl * KVALUES[(qs[j] & 0xf) as usize];
                            block[j + 16] = dl * KVALUES[(qs[j] >> 4) as usize];
                        }
                        y.extend(block);
                    }
                }
            }
        }
        y
    }

    /// A file with IQ4_NL and IQ4_XS tensors (which candle's reader rejects whole) opens:
    /// every tensor is listed with its type, the IQ4 ones read as their raw blocks and
    /// dequantize to ggml's values, and the others read as candle reads them.
    #[test]
    fn iq4_tensors_are_listed_and_read_raw() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("iq4.gguf");
        let nl = sample(RawType::Iq4Nl, 3, 64, 1);
        let xs = sample(RawType::Iq4Xs, 2, 512, 2);
        let norm: Vec<f32> = (0..64).map(|i| i as f32 / 8.0).collect();
        let norm_bytes: Vec<u8> = norm.iter().flat_map(|v| v.to_le_bytes()).collect();
        write_gguf(
            &path,
            &[("general.name", 8, {
                let mut v = 4u64.to_le_bytes().to_vec();
                v.extend(b"tiny");
                v
            })],
            &[
                ("nl.weight", 20, nl.dims.clone(), nl.data.clone()),
                ("norm.weight", 0, vec![64], norm_bytes),
                ("xs.weight", 23, xs.dims.clone(), xs.data.clone()),
            ],
        );
        let candle = Content::read(&mut File::open(&path).unwrap()).unwrap_err();
        assert!(
            candle.to_string().contains("unknown dtype for tensor 20"),
            "{candle}"
        );

        let mut file = GgufFile::open(&path).unwrap();
        assert_eq!(file.string("general.name").unwrap(), "tiny");
        let listed: Vec<(String, String, Vec<usize>)> = file
            .tensors()
            .into_iter()
            .map(|(name, (ty, dims))| (name.to_owned(), ty.to_string(), dims))
            .collect();
        assert_eq!(
            listed,
            [
                ("nl.weight".to_owned(), "IQ4_NL".to_owned(), vec![3, 64]),
                ("norm.weight".to_owned(), "F32".to_owned(), vec![64]),
                ("xs.weight".to_owned(), "IQ4_XS".to_owned(), vec![2, 512]),
            ]
        );
        let got: Vec<f32> = file
            .tensor("norm.weight")
            .unwrap()
            .dequantize(&Device::Cpu)
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(got, norm);
        for (name, want) in [("nl.weight", &nl), ("xs.weight", &xs)] {
            let Weight::Raw(raw) = file.weight(name).unwrap() else {
                panic!("{name} is not raw");
            };
            assert_eq!(
                (raw.ty, &raw.dims, &raw.data),
                (want.ty, &want.dims, &want.data)
            );
            let values: Vec<f32> = Weight::Raw(raw)
                .dequantize()
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            assert_eq!(values, ggml_dequantize(want), "{name}");
            let err = file.tensor(name).unwrap_err().to_string();
            assert!(err.contains("no candle tensor"), "{err}");
            // Mapped: the same blocks, shape and type, without reading them.
            let mapped = file.map(name).unwrap();
            assert_eq!(
                (mapped.ty(), mapped.dims(), mapped.bytes()),
                (TensorType::Raw(want.ty), &want.dims[..], &want.data[..])
            );
        }
        assert!(file.map("missing.weight").is_err());
    }

    /// A file of the types candle knows reads as candle's reader reads it: the same
    /// metadata, directory and tensor data.
    #[test]
    fn candle_types_read_as_candle_reads_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("candle.gguf");
        let device = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (4, 256), &device).unwrap();
        let tensors = [
            ("a", QTensor::quantize(&w, GgmlDType::Q4K).unwrap()),
            ("b", QTensor::quantize(&w, GgmlDType::Q8_0).unwrap()),
        ];
        let refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (*n, t)).collect();
        let metadata = [
            ("x.count", Value::U32(64)),
            (
                "x.list",
                Value::Array(vec![Value::String("a".into()), Value::String("b".into())]),
            ),
            ("x.float", Value::F32(0.5)),
        ];
        let meta: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
        let mut f = File::create(&path).unwrap();
        gguf_file::write(&mut f, &meta, &refs).unwrap();
        drop(f);
        let mut reader = File::open(&path).unwrap();
        let content = Content::read(&mut reader).unwrap();
        let mut file = GgufFile::open(&path).unwrap();
        assert_eq!(
            format!("{:?}", file.metadata().get("x.list")),
            format!("{:?}", content.metadata.get("x.list"))
        );
        assert_eq!(file.metadata().len(), content.metadata.len());
        assert_eq!(file.data_offset, content.tensor_data_offset);
        for (name, q) in &tensors {
            assert_eq!(
                file.tensors()[name],
                (TensorType::Ggml(q.dtype()), vec![4, 256])
            );
            let theirs = content.tensor(&mut reader, name, &device).unwrap();
            let ours = file.tensor(name).unwrap();
            assert_eq!(ours.data().unwrap(), theirs.data().unwrap(), "{name}");
            let mapped = file.map(name).unwrap();
            assert_eq!(mapped.bytes(), &theirs.data().unwrap()[..], "{name}");
            assert_eq!(mapped.ty(), TensorType::Ggml(q.dtype()));
        }
    }

    /// Files candle rejects are rejected with candle's message.
    #[test]
    fn bad_headers_fail_with_candle_s_messages() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.gguf");
        std::fs::write(&path, b"this is not a model").unwrap();
        let err = GgufFile::open(&path).unwrap_err();
        assert!(
            err.to_string().contains("is not a readable GGUF file"),
            "{err}"
        );
        let source = std::error::Error::source(&err).unwrap().to_string();
        assert!(source.contains("unknown magic 0x73696874"), "{source}");
        write_gguf(&path, &[], &[("t", 21, vec![256], vec![0; 110])]);
        let source = std::error::Error::source(&GgufFile::open(&path).unwrap_err())
            .unwrap()
            .to_string();
        assert!(source.contains("unknown dtype for tensor 21"), "{source}");
        // Dimensions whose product overflows are refused, for every type.
        for ty in [0, 20, 23] {
            write_gguf(
                &path,
                &[],
                &[("t", ty, vec![1 << 40, 1 << 40, 1 << 40], vec![0; 32])],
            );
            let err = GgufFile::open(&path).unwrap().weight("t").unwrap_err();
            let source = std::error::Error::source(&err).unwrap().to_string();
            assert!(source.contains("too many elements"), "{source}");
            let err = GgufFile::open(&path).unwrap().map("t").unwrap_err();
            let source = std::error::Error::source(&err).unwrap().to_string();
            assert!(source.contains("too many elements"), "{source}");
        }
        // A tensor that runs past the end of the file is refused, not mapped short.
        write_gguf(&path, &[], &[("t", 8, vec![2, 32], vec![0; 68])]);
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 10]).unwrap();
        let file = GgufFile::open(&path).unwrap();
        let err = file.map("t").unwrap_err();
        let source = std::error::Error::source(&err).unwrap().to_string();
        assert!(source.contains("remaining in file"), "{source}");
    }

    /// `model info` counts IQ4_NL and IQ4_XS tensors by their ggml names, and the others
    /// by candle's as before.
    #[test]
    fn model_info_counts_iq4_tensors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("info.gguf");
        let string = |s: &str| {
            let mut v = (s.len() as u64).to_le_bytes().to_vec();
            v.extend(s.as_bytes());
            (8, v)
        };
        let u32 = |n: u32| (4, n.to_le_bytes().to_vec());
        let metadata: Vec<(&str, (u32, Vec<u8>))> = vec![
            ("general.architecture", string("llama")),
            ("llama.embedding_length", u32(256)),
            ("llama.attention.head_count", u32(4)),
            ("llama.block_count", u32(1)),
            ("llama.feed_forward_length", u32(512)),
            ("llama.vocab_size", u32(8)),
        ];
        let metadata: Vec<(&str, u32, Vec<u8>)> =
            metadata.into_iter().map(|(k, (t, v))| (k, t, v)).collect();
        let nl = sample(RawType::Iq4Nl, 2, 256, 1);
        let xs = sample(RawType::Iq4Xs, 3, 256, 2);
        write_gguf(
            &path,
            &metadata,
            &[
                ("a.weight", 20, nl.dims.clone(), nl.data.clone()),
                ("b.weight", 23, xs.dims.clone(), xs.data.clone()),
                ("c.weight", 0, vec![256], vec![0; 1024]),
                ("d.weight", 12, vec![1, 256], vec![0; 144]),
            ],
        );
        let info = crate::ModelInfo::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
        let types: Vec<(&str, usize, u64)> = info
            .tensor_types
            .iter()
            .map(|(k, &n)| (k.as_str(), n, info.parameters_by_type[k]))
            .collect();
        assert_eq!(
            types,
            [
                ("F32", 1, 256),
                ("IQ4_NL", 1, 512),
                ("IQ4_XS", 1, 768),
                ("Q4K", 1, 256)
            ]
        );
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(200))]
        /// A damaged file (bytes changed or cut off anywhere, header included) never
        /// panics the reader: it opens or fails, and every tensor reads or fails.
        #[test]
        fn damaged_files_never_panic_the_reader(
            edits in proptest::collection::vec((0usize..4096, proptest::prelude::any::<u8>()), 1..6),
            cut in 0usize..4096,
        ) {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("damaged.gguf");
            let nl = sample(RawType::Iq4Nl, 2, 64, 1);
            let xs = sample(RawType::Iq4Xs, 1, 256, 2);
            write_gguf(
                &path,
                &[("general.alignment", 4, 32u32.to_le_bytes().to_vec())],
                &[
                    ("nl.weight", 20, nl.dims.clone(), nl.data.clone()),
                    ("norm.weight", 0, vec![8], vec![0; 32]),
                    ("xs.weight", 23, xs.dims.clone(), xs.data.clone()),
                ],
            );
            let mut bytes = std::fs::read(&path).unwrap();
            for (at, byte) in edits {
                let at = at % bytes.len();
                bytes[at] = byte;
            }
            bytes.truncate(cut.max(1));
            std::fs::write(&path, &bytes).unwrap();
            if let Ok(mut file) = GgufFile::open(&path) {
                let names: Vec<String> = file.tensors().keys().map(|n| (*n).to_owned()).collect();
                for name in names {
                    if let Ok(w) = file.weight(&name) {
                        let _ = w.dequantize();
                    }
                }
            }
        }
    }
}
