//! Reading GGUF files: metadata, tensor directory and weights.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use candle_core::Device;
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{GgmlDType, QTensor};

use crate::error::{ModelError, Result};

/// An open GGUF file: its metadata and tensor directory, read once; weights are read on
/// demand.
pub struct GgufFile {
    path: PathBuf,
    content: Content,
    reader: BufReader<File>,
    size: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("tensors", &self.content.tensor_infos.len())
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
        let content = Content::read(&mut reader).map_err(|source| ModelError::Gguf {
            path: path.clone(),
            source,
        })?;
        Ok(Self {
            path,
            content,
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
    pub fn metadata(&self) -> &std::collections::HashMap<String, Value> {
        &self.content.metadata
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
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
        self.content.tensor_infos.contains_key(name)
    }

    /// The tensor directory: name → (type, shape with the fastest-varying dimension last).
    pub fn tensors(&self) -> BTreeMap<&str, (GgmlDType, Vec<usize>)> {
        self.content
            .tensor_infos
            .iter()
            .map(|(name, info)| (name.as_str(), (info.ggml_dtype, info.shape.dims().to_vec())))
            .collect()
    }

    /// Reads tensor `name` into memory.
    pub fn tensor(&mut self, name: &str) -> Result<QTensor> {
        if !self.has_tensor(name) {
            return Err(ModelError::BadTensor {
                name: name.to_owned(),
                reason: "missing from the file".into(),
            });
        }
        self.content
            .tensor(&mut self.reader, name, &Device::Cpu)
            .map_err(|source| ModelError::Gguf {
                path: self.path.clone(),
                source,
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
