//! LoRA adapters: a trainable low-rank update `scale · B A` beside chosen weights of a
//! model, with the base weights frozen. `A` starts small and random, `B` at zero, so
//! an adapted model starts out exactly as its base.

use std::collections::HashMap;
use std::path::Path;

use agentstack_model::model::{Linear, Model};
use candle_core::{DType, Device, Result, Tensor, Var};
use rand::{Rng, SeedableRng};

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

    fn of(self, block: &mut agentstack_model::model::Block) -> &mut Linear {
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

/// Rank, alpha and where.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// The rank `r`.
    pub rank: usize,
    /// `alpha`; the update is scaled by `alpha / r`.
    pub alpha: f64,
    /// The weights adapted, in every block.
    pub targets: Vec<Target>,
}

impl Default for LoraConfig {
    fn default() -> Self {
        Self {
            rank: 8,
            alpha: 16.0,
            targets: vec![Target::Q, Target::V],
        }
    }
}

/// One adapted weight's `A` and `B`.
#[derive(Debug, Clone)]
pub struct AdapterPair {
    /// `blk.<i>.<target>`.
    pub name: String,
    /// Block index.
    pub block: usize,
    /// Which weight.
    pub target: Target,
    /// `[rank, in]`.
    pub a: Var,
    /// `[out, rank]`.
    pub b: Var,
}

/// A set of adapters for one model.
#[derive(Debug, Clone)]
pub struct Lora {
    /// Rank, alpha, targets.
    pub config: LoraConfig,
    /// One pair per adapted weight, in block order.
    pub pairs: Vec<AdapterPair>,
}

impl Lora {
    /// New adapters for `model`: `A` uniform in ±1/√in (Kaiming-uniform with a = √5,
    /// as PEFT initialises it), `B` zero. Deterministic in `seed`.
    pub fn new(model: &Model, config: LoraConfig, seed: u64) -> Result<Self> {
        assert!(config.rank > 0, "LoRA rank must be at least 1");
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut pairs = Vec::new();
        for (i, block) in model.blocks().iter().enumerate() {
            let mut block = block.clone();
            for &target in &config.targets {
                let (out, inp) = target.of(&mut block).shape().map_err(to_candle)?;
                let bound = 1.0 / (inp as f32).sqrt();
                let values: Vec<f32> = (0..config.rank * inp)
                    .map(|_| rng.random_range(-bound..bound))
                    .collect();
                pairs.push(AdapterPair {
                    name: format!("blk.{i}.{}", target.name()),
                    block: i,
                    target,
                    a: Var::from_tensor(&Tensor::from_vec(
                        values,
                        (config.rank, inp),
                        &Device::Cpu,
                    )?)?,
                    b: Var::zeros((out, config.rank), DType::F32, &Device::Cpu)?,
                });
            }
        }
        Ok(Self { config, pairs })
    }

    /// `alpha / rank`.
    pub fn scale(&self) -> f64 {
        self.config.alpha / self.config.rank as f64
    }

    /// The trainable variables, `A` then `B` of each pair.
    pub fn vars(&self) -> Vec<Var> {
        self.pairs
            .iter()
            .flat_map(|p| [p.a.clone(), p.b.clone()])
            .collect()
    }

    /// Trainable parameters.
    pub fn parameters(&self) -> usize {
        self.pairs
            .iter()
            .map(|p| p.a.elem_count() + p.b.elem_count())
            .sum()
    }

    /// `base` with these adapters beside its weights (the base's tensors are shared,
    /// not copied). Gradients of the adapted model's outputs reach the adapters.
    pub fn apply(&self, base: &Model) -> Result<Model> {
        let mut model = base.clone();
        let scale = self.scale();
        for pair in &self.pairs {
            let block = &mut model.blocks_mut()[pair.block];
            let linear = pair.target.of(block);
            let inner = linear.base().clone();
            *linear = Linear::Adapted {
                base: Box::new(inner),
                a: pair.a.as_tensor().clone(),
                b: pair.b.as_tensor().clone(),
                scale,
            };
        }
        Ok(model)
    }

    /// Saves the adapters as safetensors: `blk.<i>.<target>.lora_a` / `.lora_b`, and
    /// `lora.alpha` (the rank and targets follow from the shapes and names).
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut tensors: HashMap<String, Tensor> = HashMap::new();
        for p in &self.pairs {
            tensors.insert(format!("{}.lora_a", p.name), p.a.as_tensor().clone());
            tensors.insert(format!("{}.lora_b", p.name), p.b.as_tensor().clone());
        }
        tensors.insert(
            "lora.alpha".into(),
            Tensor::new(&[self.config.alpha as f32], &Device::Cpu)?,
        );
        // Write next to the target and rename, so a kill never leaves half a file.
        let tmp = path.with_extension("safetensors.partial");
        candle_core::safetensors::save(&tensors, &tmp)?;
        std::fs::rename(&tmp, path)?;
        Ok(())
    }

    /// Loads adapters saved by [`Lora::save`] for `model`; the targets and rank come
    /// from the file, and every shape is checked against the model.
    pub fn load(path: &Path, model: &Model) -> Result<Self> {
        let tensors = candle_core::safetensors::load(path, &Device::Cpu)?;
        let alpha = tensors
            .get("lora.alpha")
            .ok_or_else(|| candle_core::Error::Msg(format!("{}: no lora.alpha", path.display())))?
            .to_vec1::<f32>()?[0] as f64;
        let mut pairs = Vec::new();
        let mut targets = Vec::new();
        let mut rank = 0;
        for (i, block) in model.blocks().iter().enumerate() {
            let mut block = block.clone();
            for target in Target::ALL {
                let name = format!("blk.{i}.{}", target.name());
                let (Some(a), Some(b)) = (
                    tensors.get(&format!("{name}.lora_a")),
                    tensors.get(&format!("{name}.lora_b")),
                ) else {
                    continue;
                };
                let (out, inp) = target.of(&mut block).shape().map_err(to_candle)?;
                let r = a.dim(0)?;
                if a.dims() != [r, inp] || b.dims() != [out, r] || (rank != 0 && r != rank) {
                    return Err(candle_core::Error::Msg(format!(
                        "{}: {name} has shapes {:?} and {:?}, the model needs [r, {inp}] and [{out}, r]",
                        path.display(),
                        a.dims(),
                        b.dims()
                    )));
                }
                rank = r;
                if !targets.contains(&target) {
                    targets.push(target);
                }
                pairs.push(AdapterPair {
                    name,
                    block: i,
                    target,
                    a: Var::from_tensor(&a.to_dtype(DType::F32)?)?,
                    b: Var::from_tensor(&b.to_dtype(DType::F32)?)?,
                });
            }
        }
        if pairs.is_empty() {
            return Err(candle_core::Error::Msg(format!(
                "{}: no adapters for this model",
                path.display()
            )));
        }
        Ok(Self {
            config: LoraConfig {
                rank,
                alpha,
                targets,
            },
            pairs,
        })
    }
}

fn to_candle(e: agentstack_model::ModelError) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}
