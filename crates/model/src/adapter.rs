//! Low-rank adapters (LoRA) beside a model's weights, as plain tensors: loaded from
//! and saved to safetensors, applied to a model without copying its base weights.
//! `model serve` loads them by name (`POST /v1/adapters`) and requests pick one with
//! `model`; the RL trainer pushes its adapters here after every step.
//!
//! The file holds `blk.<i>.<target>.lora_a` (`[rank, in]`), `blk.<i>.<target>.lora_b`
//! (`[out, rank]`) and `lora.alpha`; the update of each weight is
//! `alpha / rank · B A`.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use crate::error::{ModelError, Result};
use crate::model::{Block, Linear, Model};

/// A weight an adapter can sit beside.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    /// Attention query projection.
    Q,
    /// Attention key projection.
    K,
    /// Attention value projection.
    V,
    /// Attention output projection.
    O,
    /// Feed-forward gate.
    Gate,
    /// Feed-forward up projection.
    Up,
    /// Feed-forward down projection.
    Down,
}

impl Target {
    /// Every target.
    pub const ALL: [Self; 7] = [
        Self::Q,
        Self::K,
        Self::V,
        Self::O,
        Self::Gate,
        Self::Up,
        Self::Down,
    ];

    /// The name used in configuration and in saved adapters (Hugging Face's module
    /// names: `q_proj`, ..., `down_proj`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Q => "q_proj",
            Self::K => "k_proj",
            Self::V => "v_proj",
            Self::O => "o_proj",
            Self::Gate => "gate_proj",
            Self::Up => "up_proj",
            Self::Down => "down_proj",
        }
    }

    /// Parses a name (`q_proj` or `q`).
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|t| t.name() == name || t.name().trim_end_matches("_proj") == name)
    }

    /// The layer of `block` this target names.
    pub fn of(self, block: &Block) -> &Linear {
        match self {
            Self::Q => &block.q,
            Self::K => &block.k,
            Self::V => &block.v,
            Self::O => &block.o,
            Self::Gate => &block.gate,
            Self::Up => &block.up,
            Self::Down => &block.down,
        }
    }

    /// The layer of `block` this target names, to replace.
    pub fn of_mut(self, block: &mut Block) -> &mut Linear {
        match self {
            Self::Q => &mut block.q,
            Self::K => &mut block.k,
            Self::V => &mut block.v,
            Self::O => &mut block.o,
            Self::Gate => &mut block.gate,
            Self::Up => &mut block.up,
            Self::Down => &mut block.down,
        }
    }
}

/// One adapted weight.
#[derive(Debug, Clone)]
pub struct AdapterWeights {
    /// Block index.
    pub block: usize,
    /// Which weight of the block.
    pub target: Target,
    /// `A`, `[rank, in]`, f32.
    pub a: Tensor,
    /// `B`, `[out, rank]`, f32.
    pub b: Tensor,
}

impl AdapterWeights {
    /// `blk.<i>.<target>`.
    pub fn name(&self) -> String {
        format!("blk.{}.{}", self.block, self.target.name())
    }
}

/// A set of adapters for one model.
#[derive(Debug, Clone)]
pub struct Adapter {
    /// `alpha`: the update is scaled by `alpha / rank`.
    pub alpha: f64,
    /// The rank shared by every pair.
    pub rank: usize,
    /// One entry per adapted weight, in block order.
    pub weights: Vec<AdapterWeights>,
}

/// The largest safetensors header an adapter file may have (a LoRA of every weight of
/// a 100-block model names 1,401 tensors: about 150 KiB of header).
pub const MAX_HEADER_BYTES: u64 = 1 << 20;

/// The highest LoRA rank accepted for any weight (see [`max_rank`]).
pub const MAX_RANK: usize = 1024;

/// The highest rank an adapter of a `[out, in]` weight may have: [`MAX_RANK`], and no
/// more than the smaller dimension (a higher rank adds nothing).
pub fn max_rank(out: usize, inp: usize) -> usize {
    MAX_RANK.min(out).min(inp)
}

/// Why an adapter file was not loaded.
#[derive(Debug, thiserror::Error)]
pub enum AdapterFileError {
    /// The file could not be read.
    #[error("cannot read adapter file {}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file's size is not the size its header describes (cut short, or more after
    /// the data).
    #[error("adapter file {} is {actual} bytes; its header describes {expected}", path.display())]
    Size {
        /// The file.
        path: PathBuf,
        /// Its size.
        actual: u64,
        /// The size its header describes.
        expected: u64,
    },
    /// The file is readable but does not hold adapters for this model (an
    /// [`ModelError::InvalidRequest`] says why), or the tensors could not be converted.
    #[error(transparent)]
    Invalid(#[from] ModelError),
}

impl From<AdapterFileError> for ModelError {
    fn from(error: AdapterFileError) -> Self {
        match error {
            AdapterFileError::Io { path, source } => Self::Io { path, source },
            AdapterFileError::Size { .. } => Self::InvalidRequest(error.to_string()),
            AdapterFileError::Invalid(e) => e,
        }
    }
}

/// Bytes per element of the dtypes an adapter's tensors may have.
fn dtype_bytes(dtype: &str) -> Option<u64> {
    match dtype {
        "F64" => Some(8),
        "F32" => Some(4),
        "F16" | "BF16" => Some(2),
        _ => None,
    }
}

/// The `[out, in]` of the weight a tensor called `name` adapts and whether it is `A`
/// (`lora_a`), if `model` has that weight.
fn adapted_weight(name: &str, model: &Model) -> Result<Option<((usize, usize), bool)>> {
    let Some(rest) = name.strip_prefix("blk.") else {
        return Ok(None);
    };
    let mut parts = rest.splitn(3, '.');
    let (Some(block), Some(target), Some(side)) = (parts.next(), parts.next(), parts.next()) else {
        return Ok(None);
    };
    let is_a = match side {
        "lora_a" => true,
        "lora_b" => false,
        _ => return Ok(None),
    };
    let Some(target) = Target::ALL.into_iter().find(|t| t.name() == target) else {
        return Ok(None);
    };
    let Some(block) = block
        .parse::<usize>()
        .ok()
        .filter(|b| block == b.to_string())
        .and_then(|b| model.blocks().get(b))
    else {
        return Ok(None);
    };
    Ok(Some((target.of(block).shape()?, is_a)))
}

/// Checks a safetensors header (the JSON after the length) against `model`: every
/// tensor must be `lora.alpha` (one value) or the `A` or `B` of a weight of `model`
/// with that weight's dimensions and a rank from 1 to [`max_rank`], of a float dtype,
/// its data the bytes its shape needs, the tensors' data back to back. Returns the
/// length of the data.
fn check_header(header: &[u8], path: &Path, model: &Model) -> Result<u64> {
    let entries: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(header)
        .map_err(|e| {
            bad(
                path,
                format!("not a safetensors file: its header is not a JSON object ({e})"),
            )
        })?;
    let mut unknown = Vec::new();
    let mut total: u64 = 0;
    let mut end_max: u64 = 0;
    for (name, entry) in &entries {
        if name == "__metadata__" {
            continue;
        }
        let malformed = || {
            bad(
                path,
                format!(
                    "the header's entry for `{name}` is not a safetensors tensor (dtype, shape, data_offsets)"
                ),
            )
        };
        let dtype = entry
            .get("dtype")
            .and_then(serde_json::Value::as_str)
            .ok_or_else(malformed)?;
        let shape: Vec<usize> = entry
            .get("shape")
            .and_then(serde_json::Value::as_array)
            .ok_or_else(malformed)?
            .iter()
            .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
            .collect::<Option<_>>()
            .ok_or_else(malformed)?;
        let offsets = entry
            .get("data_offsets")
            .and_then(serde_json::Value::as_array)
            .filter(|o| o.len() == 2)
            .and_then(|o| Some((o[0].as_u64()?, o[1].as_u64()?)))
            .filter(|(start, end)| start <= end)
            .ok_or_else(malformed)?;
        let width = dtype_bytes(dtype).ok_or_else(|| {
            bad(
                path,
                format!("`{name}` is {dtype}; adapters are F32, F16, BF16 or F64"),
            )
        })?;
        if name == "lora.alpha" {
            if shape.len() > 1 || shape.iter().product::<usize>() != 1 {
                return Err(bad(
                    path,
                    format!("`lora.alpha` has shape {shape:?}; it is one value"),
                ));
            }
        } else if let Some(((out, inp), is_a)) = adapted_weight(name, model)? {
            let limit = max_rank(out, inp);
            let fits = match (is_a, shape.as_slice()) {
                (true, &[r, i]) => i == inp && (1..=limit).contains(&r),
                (false, &[o, r]) => o == out && (1..=limit).contains(&r),
                _ => false,
            };
            if !fits {
                return Err(bad(
                    path,
                    format!(
                        "`{name}` has shape {shape:?}; this model needs [r, {inp}] for lora_a and [{out}, r] for lora_b, with a rank r from 1 to {limit}"
                    ),
                ));
            }
        } else {
            unknown.push(name.as_str());
            continue;
        }
        // Bounded: the dimensions are the model's and the rank is capped.
        let bytes = shape.iter().product::<usize>() as u64 * width;
        if offsets.1 - offsets.0 != bytes {
            return Err(bad(
                path,
                format!(
                    "`{name}` has {} bytes of data; its shape {shape:?} of {dtype} takes {bytes}",
                    offsets.1 - offsets.0
                ),
            ));
        }
        total += bytes;
        end_max = end_max.max(offsets.1);
    }
    if !unknown.is_empty() {
        unknown.sort_unstable();
        return Err(bad(
            path,
            format!(
                "tensors {unknown:?} match no weight of this model ({} blocks); was it trained for another model?",
                model.blocks().len()
            ),
        ));
    }
    if end_max != total {
        return Err(bad(path, "the tensors' data overlap or leave gaps"));
    }
    Ok(total)
}

fn bad(path: &Path, reason: impl std::fmt::Display) -> ModelError {
    ModelError::InvalidRequest(format!("adapter file {}: {reason}", path.display()))
}

impl Adapter {
    /// `alpha / rank`.
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    /// Trainable parameters.
    pub fn parameters(&self) -> usize {
        self.weights
            .iter()
            .map(|w| w.a.elem_count() + w.b.elem_count())
            .sum()
    }

    /// Reads a file written by [`Adapter::save`] (or by the trainer), checking every
    /// shape against `model`; see [`Adapter::read`].
    pub fn load(path: &Path, model: &Model) -> Result<Self> {
        let mut file = std::fs::File::open(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(Self::read(&mut file, path, model)?)
    }

    /// Reads adapters for `model` from `file` (called `path` in errors), bounded by the
    /// model: first the safetensors header only (its length capped at
    /// [`MAX_HEADER_BYTES`]), whose every tensor must be one a LoRA of `model` can have
    /// (a known name, its layer's dimensions, a rank from 1 to [`max_rank`]), and the
    /// file's size must be exactly the header plus the data those shapes take; only then
    /// is the data read. So a huge or endless file costs at most a header's read.
    pub fn read(
        file: &mut std::fs::File,
        path: &Path,
        model: &Model,
    ) -> std::result::Result<Self, AdapterFileError> {
        let io = |source| AdapterFileError::Io {
            path: path.to_path_buf(),
            source,
        };
        let actual = file.metadata().map_err(io)?.len();
        let mut prefix = [0u8; 8];
        if actual < prefix.len() as u64 {
            return Err(AdapterFileError::Size {
                path: path.to_path_buf(),
                actual,
                expected: prefix.len() as u64,
            });
        }
        file.read_exact(&mut prefix).map_err(io)?;
        let header_len = u64::from_le_bytes(prefix);
        if header_len > MAX_HEADER_BYTES {
            return Err(bad(
                path,
                format!(
                    "not a safetensors adapter file: its header would be {header_len} bytes, more than the {MAX_HEADER_BYTES} adapters need"
                ),
            )
            .into());
        }
        let data_start = prefix.len() as u64 + header_len;
        if data_start > actual {
            return Err(AdapterFileError::Size {
                path: path.to_path_buf(),
                actual,
                expected: data_start,
            });
        }
        let mut bytes = Vec::with_capacity(data_start as usize);
        bytes.extend_from_slice(&prefix);
        (&mut *file)
            .take(header_len)
            .read_to_end(&mut bytes)
            .map_err(io)?;
        if bytes.len() as u64 != data_start {
            return Err(io(std::io::ErrorKind::UnexpectedEof.into()));
        }
        let data_len = check_header(&bytes[prefix.len()..], path, model)?;
        let expected = data_start + data_len;
        if actual != expected {
            return Err(AdapterFileError::Size {
                path: path.to_path_buf(),
                actual,
                expected,
            });
        }
        // The size is now bounded by the model; a file that shrank since fails the read.
        bytes.reserve_exact(data_len as usize);
        bytes.resize(expected as usize, 0);
        file.read_exact(&mut bytes[data_start as usize..])
            .map_err(io)?;
        let tensors = candle_core::safetensors::load_buffer(&bytes, &Device::Cpu)
            .map_err(|e| bad(path, format!("not a readable safetensors file ({e})")))?;
        Ok(Self::from_tensors(&tensors, path, model)?)
    }

    /// The adapters in `tensors` (read from `path`), checked against `model`.
    fn from_tensors(tensors: &HashMap<String, Tensor>, path: &Path, model: &Model) -> Result<Self> {
        let alpha = tensors
            .get("lora.alpha")
            .ok_or_else(|| bad(path, "no `lora.alpha` tensor; is this a LoRA adapter?"))?
            .flatten_all()?
            .to_dtype(DType::F64)?
            .to_vec1::<f64>()?
            .first()
            .copied()
            .ok_or_else(|| bad(path, "`lora.alpha` is empty"))?;
        let mut known = 1;
        let mut weights = Vec::new();
        let mut rank = 0;
        for (i, block) in model.blocks().iter().enumerate() {
            for target in Target::ALL {
                let name = format!("blk.{i}.{}", target.name());
                let (Some(a), Some(b)) = (
                    tensors.get(&format!("{name}.lora_a")),
                    tensors.get(&format!("{name}.lora_b")),
                ) else {
                    continue;
                };
                known += 2;
                let (out, inp) = target.of(block).shape()?;
                let r = a.dims().first().copied().unwrap_or(0);
                if r == 0
                    || a.dims() != [r, inp]
                    || b.dims() != [out, r]
                    || (rank != 0 && r != rank)
                {
                    return Err(bad(
                        path,
                        format!(
                            "{name} has shapes {:?} and {:?}; this model needs [r, {inp}] and [{out}, r] with one rank r throughout",
                            a.dims(),
                            b.dims()
                        ),
                    ));
                }
                rank = r;
                weights.push(AdapterWeights {
                    block: i,
                    target,
                    a: a.to_dtype(DType::F32)?,
                    b: b.to_dtype(DType::F32)?,
                });
            }
        }
        if weights.is_empty() {
            return Err(bad(
                path,
                "no `blk.<i>.<target>.lora_a`/`lora_b` pairs that fit this model",
            ));
        }
        if known != tensors.len() {
            let mut extra: Vec<&String> = tensors
                .keys()
                .filter(|k| {
                    *k != "lora.alpha"
                        && !weights.iter().any(|w| {
                            **k == format!("{}.lora_a", w.name())
                                || **k == format!("{}.lora_b", w.name())
                        })
                })
                .collect();
            extra.sort();
            return Err(bad(
                path,
                format!(
                    "tensors {extra:?} match no weight of this model ({} blocks); was it trained for another model?",
                    model.blocks().len()
                ),
            ));
        }
        Ok(Self {
            alpha,
            rank,
            weights,
        })
    }

    /// Writes the adapters as safetensors, atomically (a temporary file renamed into
    /// place, so a kill never leaves half a file).
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut tensors: HashMap<String, Tensor> = HashMap::new();
        for w in &self.weights {
            tensors.insert(format!("{}.lora_a", w.name()), w.a.clone());
            tensors.insert(format!("{}.lora_b", w.name()), w.b.clone());
        }
        tensors.insert(
            "lora.alpha".into(),
            Tensor::new(&[self.alpha as f32], &Device::Cpu)?,
        );
        let tmp = path.with_extension("safetensors.partial");
        candle_core::safetensors::save(&tensors, &tmp)?;
        let io = |source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        };
        std::fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)?;
        Ok(())
    }

    /// `base` with these adapters beside its weights (base tensors shared, not
    /// copied; an adapter already on a weight is replaced).
    pub fn apply(&self, base: &Model) -> Result<Model> {
        let mut model = base.clone();
        let scale = self.scale();
        for w in &self.weights {
            let block = model.blocks_mut().get_mut(w.block).ok_or_else(|| {
                ModelError::InvalidRequest(format!(
                    "the adapter has weights for block {}; the model has fewer blocks",
                    w.block
                ))
            })?;
            let linear = w.target.of_mut(block);
            let inner = linear.base().clone();
            *linear = Linear::Adapted {
                base: Box::new(inner),
                a: w.a.clone(),
                b: w.b.clone(),
                scale,
            };
        }
        Ok(model)
    }
}
