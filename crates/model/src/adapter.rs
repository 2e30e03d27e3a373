//! Low-rank adapters (LoRA) beside a model's weights, as plain tensors: loaded from
//! and saved to safetensors, applied to a model without copying its base weights.
//! `model serve` loads them by name (`POST /v1/adapters`) and requests pick one with
//! `model`; the RL trainer pushes its adapters here after every step.
//!
//! The file holds `blk.<i>.<target>.lora_a` (`[rank, in]`), `blk.<i>.<target>.lora_b`
//! (`[out, rank]`) and `lora.alpha`; the update of each weight is
//! `alpha / rank · B A`.

use std::collections::HashMap;
use std::path::Path;

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
    /// shape against `model`.
    pub fn load(path: &Path, model: &Model) -> Result<Self> {
        let tensors = candle_core::safetensors::load(path, &Device::Cpu)
            .map_err(|e| bad(path, format!("not a readable safetensors file ({e})")))?;
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
