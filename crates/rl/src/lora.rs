//! LoRA adapters: a trainable low-rank update `scale · B A` beside chosen weights of a
//! model, with the base weights frozen. `A` starts small and random, `B` at zero, so
//! an adapted model starts out exactly as its base.

use std::path::Path;

use agentstack_model::adapter::{Adapter, AdapterWeights};
use agentstack_model::model::{Linear, Model};
use candle_core::{DType, Device, Result, Tensor, Var};
use rand::{Rng, SeedableRng};

pub use agentstack_model::adapter::Target;

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
            for &target in &config.targets {
                let (out, inp) = target.of(block).shape().map_err(to_candle)?;
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
            let linear = pair.target.of_mut(block);
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

    /// A copy of the adapters' current values, detached from training: what the
    /// rollout engine and `model serve` run, unchanged by later optimizer steps.
    pub fn snapshot(&self) -> Result<Adapter> {
        let copy = |v: &Var| -> Result<Tensor> {
            let t = v.as_tensor();
            Tensor::from_vec(t.flatten_all()?.to_vec1::<f32>()?, t.shape(), t.device())
        };
        Ok(Adapter {
            alpha: self.config.alpha,
            rank: self.config.rank,
            weights: self
                .pairs
                .iter()
                .map(|p| {
                    Ok(AdapterWeights {
                        block: p.block,
                        target: p.target,
                        a: copy(&p.a)?,
                        b: copy(&p.b)?,
                    })
                })
                .collect::<Result<_>>()?,
        })
    }

    /// Trainable adapters from saved or snapshot values.
    pub fn from_adapter(adapter: &Adapter) -> Result<Self> {
        let mut targets = Vec::new();
        let mut pairs = Vec::new();
        for w in &adapter.weights {
            if !targets.contains(&w.target) {
                targets.push(w.target);
            }
            pairs.push(AdapterPair {
                name: w.name(),
                block: w.block,
                target: w.target,
                a: Var::from_tensor(&w.a.to_dtype(DType::F32)?)?,
                b: Var::from_tensor(&w.b.to_dtype(DType::F32)?)?,
            });
        }
        Ok(Self {
            config: LoraConfig {
                rank: adapter.rank,
                alpha: adapter.alpha,
                targets,
            },
            pairs,
        })
    }

    /// Saves the adapters as safetensors (see [`agentstack_model::adapter`]),
    /// atomically.
    pub fn save(&self, path: &Path) -> Result<()> {
        self.snapshot()?.save(path).map_err(to_candle)
    }

    /// Loads adapters saved by [`Lora::save`] for `model`; the targets and rank come
    /// from the file, and every shape is checked against the model.
    pub fn load(path: &Path, model: &Model) -> Result<Self> {
        Self::from_adapter(&Adapter::load(path, model).map_err(to_candle)?)
    }
}

fn to_candle(e: agentstack_model::ModelError) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}
