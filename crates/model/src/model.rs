//! The llama-family transformer: one architecture definition, two weight forms.
//!
//! [`WeightForm::Quantized`] keeps the GGUF blocks and multiplies with quantized dot
//! products (inference); [`WeightForm::Dense`] dequantizes to a float type and uses only
//! operations candle can differentiate (training, scoring with gradients). The forward
//! pass is the same code for both; only the linear layers and the fused-versus-slow
//! choice of norm, rotary and softmax kernels differ.
//!
//! [`Model::forward`] runs a *batch of sequences*, each with its own KV cache and its own
//! number of new tokens: all new tokens of all sequences go through the linear layers as
//! one matrix, attention runs per sequence. A prefill, a decode step of many sequences,
//! or a mix of both is one call.

use std::sync::Arc;

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{D, DType, Device, Module, Tensor};
use candle_nn::kv_cache::KvCache;

use crate::config::{Architecture, ModelConfig, RopeLayout};
use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::kernels::{self, FastLinear, QuantKind};

/// How the weights are held in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightForm {
    /// GGUF blocks as stored (Q4_1 goes through this crate's SIMD kernel; other types
    /// through candle's); fused kernels without gradients.
    Quantized,
    /// Dequantized to this float type; differentiable operations only.
    Dense(DType),
}

/// A linear layer `y = x Wᵀ (+ b)`.
#[derive(Debug, Clone)]
pub enum Linear {
    /// Candle's quantized matmul.
    Quantized {
        /// The weight, `[out, in]`.
        weight: QMatMul,
        /// Optional bias, `[out]`.
        bias: Option<Tensor>,
    },
    /// This crate's kernels (Q4_1, Q8_0): batch-invariant, SIMD.
    Fast {
        /// The weight.
        weight: Arc<FastLinear>,
        /// Optional bias, `[out]`.
        bias: Option<Tensor>,
    },
    /// A float weight, differentiable.
    Dense {
        /// The weight, `[out, in]`.
        weight: Tensor,
        /// Optional bias, `[out]`.
        bias: Option<Tensor>,
    },
    /// A low-rank adapter over any layer (LoRA): `y = base(x) + scale · (x Aᵀ) Bᵀ`.
    /// Gradients reach `a` and `b` (and, through a dense base, the layer's input).
    Adapted {
        /// The layer adapted.
        base: Box<Linear>,
        /// `A`, `[rank, in]`.
        a: Tensor,
        /// `B`, `[out, rank]`.
        b: Tensor,
        /// `alpha / rank`.
        scale: f64,
    },
}

impl Linear {
    /// Applies the layer to `x`, `[n, in]` → `[n, out]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (y, bias) = match self {
            Self::Quantized { weight, bias } => (weight.forward(x)?, bias),
            Self::Fast { weight, bias } => (weight.forward(x)?, bias),
            Self::Dense { weight, bias } => (dense_matmul(x, weight)?, bias),
            Self::Adapted { base, a, b, scale } => {
                if !x.track_op() && !a.track_op() && !b.track_op() {
                    return Ok((base.forward(x)? + low_rank_rows(x, a, b, *scale)?)?);
                }
                let low = x.to_dtype(a.dtype())?.matmul(&a.t()?)?.matmul(&b.t()?)?;
                let low = (low * *scale)?.to_dtype(x.dtype())?;
                return Ok((base.forward(x)? + low)?);
            }
        };
        Ok(match bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }

    /// Several layers applied to the same input; this crate's kernels quantize the input
    /// once for all of them.
    pub fn forward_many<const N: usize>(layers: [&Self; N], x: &Tensor) -> Result<[Tensor; N]> {
        // Adapters at inference ride along: their bases share the quantized input,
        // and each low-rank term is added after.
        let inference = !x.track_op();
        let fast: Option<Vec<&FastLinear>> = layers
            .iter()
            .map(|l| match l {
                Self::Fast { weight, bias: None } => Some(weight.as_ref()),
                Self::Adapted { base, a, b, .. } if inference && !a.track_op() && !b.track_op() => {
                    match base.as_ref() {
                        Self::Fast { weight, bias: None } => Some(weight.as_ref()),
                        _ => None,
                    }
                }
                _ => None,
            })
            .collect();
        let outputs = match fast {
            Some(weights) => {
                let bases = FastLinear::forward_many(&weights, x)?;
                layers
                    .iter()
                    .zip(bases)
                    .map(|(l, y)| match l {
                        Self::Adapted { a, b, scale, .. } => {
                            Ok((y + low_rank_rows(x, a, b, *scale)?)?)
                        }
                        _ => Ok(y),
                    })
                    .collect::<Result<Vec<_>>>()?
            }
            None => layers
                .iter()
                .map(|l| l.forward(x))
                .collect::<Result<Vec<_>>>()?,
        };
        Ok(outputs.try_into().expect("one output per layer"))
    }

    /// The weight as a dense float tensor `[out, in]`.
    pub fn dense_weight(&self) -> Result<Tensor> {
        Ok(match self {
            Self::Quantized { weight, .. } => weight.dequantize_f16()?.to_dtype(DType::F32)?,
            Self::Fast { weight, .. } => weight.dequantize()?,
            Self::Dense { weight, .. } => weight.clone(),
            Self::Adapted { base, a, b, scale } => {
                let delta = (b.matmul(a)? * *scale)?;
                (base.dense_weight()? + delta.to_dtype(DType::F32)?)?
            }
        })
    }

    /// The layer without its adapter (itself when it has none).
    pub fn base(&self) -> &Self {
        match self {
            Self::Adapted { base, .. } => base.base(),
            other => other,
        }
    }

    /// `[out, in]`.
    pub fn shape(&self) -> Result<(usize, usize)> {
        Ok(match self {
            Self::Quantized { weight, .. } => match weight {
                QMatMul::QTensor(q) => q.shape().dims2()?,
                QMatMul::Tensor(t) | QMatMul::TensorF16(t) => t.dims2()?,
            },
            Self::Fast { weight, .. } => weight.shape(),
            Self::Dense { weight, .. } => weight.dims2()?,
            Self::Adapted { b, a, .. } => (b.dim(0)?, a.dim(1)?),
        })
    }
}

/// `scale · (x Aᵀ) Bᵀ` one row at a time, each element a sum in one fixed order
/// ([`dot_fixed`]): the same bits whatever the batch (candle's matmul may block the
/// sum differently for another number of rows), so a sequence decodes identically
/// alone or among others, as the base kernels do. Ranks are small, so this costs
/// little next to the base layer.
fn low_rank_rows(x: &Tensor, a: &Tensor, b: &Tensor, scale: f64) -> Result<Tensor> {
    let (rank, inp) = a.dims2()?;
    let out = b.dim(0)?;
    let rows = x.dims2()?.0;
    let xs: Vec<f32> = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let scale = scale as f32;
    let mut y = vec![0f32; rows * out];
    let mut u = vec![0f32; rank];
    with_f32(a, |av| {
        with_f32(b, |bv| {
            for (row, yr) in xs.chunks_exact(inp).zip(y.chunks_exact_mut(out)) {
                for (uj, aj) in u.iter_mut().zip(av.chunks_exact(inp)) {
                    *uj = dot_fixed(row, aj) * scale;
                }
                for (yo, bo) in yr.iter_mut().zip(bv.chunks_exact(rank)) {
                    *yo = dot_fixed(bo, &u);
                }
            }
        })
    })??;
    Ok(Tensor::from_vec(y, (rows, out), x.device())?.to_dtype(x.dtype())?)
}

/// Runs `f` on the tensor's values as one f32 slice: borrowed when the tensor already is
/// a contiguous f32 tensor in memory (adapter weights are), copied otherwise.
pub fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> candle_core::Result<R> {
    {
        let (storage, layout) = t.storage_and_layout();
        if let (candle_core::Storage::Cpu(candle_core::CpuStorage::F32(data)), Some((lo, hi))) =
            (&*storage, layout.contiguous_offsets())
        {
            return Ok(f(&data[lo..hi]));
        }
    }
    let copy: Vec<f32> = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    Ok(f(&copy))
}

/// `Σ pᵢ qᵢ` summed in eight lanes (lane `k` takes `i ≡ k mod 8`), then the lanes in a
/// fixed tree: one order for a given length, so the same bits every call, and the
/// lanes vectorise (a single running sum cannot, since float addition does not
/// reassociate).
fn dot_fixed(p: &[f32], q: &[f32]) -> f32 {
    const LANES: usize = 8;
    let mut acc = [0f32; LANES];
    let (pc, pr) = p.as_chunks::<LANES>();
    let (qc, qr) = q.as_chunks::<LANES>();
    for (pv, qv) in pc.iter().zip(qc) {
        for ((s, x), y) in acc.iter_mut().zip(pv).zip(qv) {
            *s += x * y;
        }
    }
    for ((s, x), y) in acc.iter_mut().zip(pr).zip(qr) {
        *s += x * y;
    }
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// `x Wᵀ` for a float weight. When `x` carries gradients and `W` is frozen (not a
/// variable), as in LoRA training, this goes through [`FrozenMatmul`]: candle's matmul
/// would also compute `W`'s gradient, a second matmul as large as the first and a
/// weight-sized buffer per layer, only to throw them away.
fn dense_matmul(x: &Tensor, weight: &Tensor) -> Result<Tensor> {
    if x.track_op() && !weight.track_op() && x.dtype() == DType::F32 && weight.dtype() == DType::F32
    {
        Ok(x.apply_op1_arc(Arc::new(Box::new(FrozenMatmul(weight.clone()))))?)
    } else {
        Ok(x.matmul(&weight.t()?)?)
    }
}

/// `x ↦ x Wᵀ` with `W` a constant: its backward pass is `∂x = ∂y W` only.
struct FrozenMatmul(Tensor);

impl candle_core::CustomOp1 for FrozenMatmul {
    fn name(&self) -> &'static str {
        "frozen-matmul"
    }

    fn cpu_fwd(
        &self,
        storage: &candle_core::CpuStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let candle_core::CpuStorage::F32(data) = storage else {
            candle_core::bail!("frozen-matmul takes f32 inputs");
        };
        let x = match layout.contiguous_offsets() {
            Some((start, end)) => {
                Tensor::from_slice(&data[start..end], layout.shape(), &Device::Cpu)?
            }
            None => candle_core::bail!("frozen-matmul takes contiguous inputs"),
        };
        let y = x.matmul(&self.0.t()?)?;
        let shape = y.shape().clone();
        let values = y.flatten_all()?.to_vec1::<f32>()?;
        Ok((candle_core::CpuStorage::F32(values), shape))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(grad_res.matmul(&self.0)?))
    }
}

/// The weights of one transformer block.
#[derive(Debug, Clone)]
pub struct Block {
    /// RMS norm before attention.
    pub attn_norm: Tensor,
    /// Query projection.
    pub q: Linear,
    /// Key projection.
    pub k: Linear,
    /// Value projection.
    pub v: Linear,
    /// Attention output projection.
    pub o: Linear,
    /// Per-head RMS norm of queries (Qwen3).
    pub q_norm: Option<Tensor>,
    /// Per-head RMS norm of keys (Qwen3).
    pub k_norm: Option<Tensor>,
    /// RMS norm before the feed-forward layer.
    pub ffn_norm: Tensor,
    /// SwiGLU gate.
    pub gate: Linear,
    /// SwiGLU up projection.
    pub up: Linear,
    /// SwiGLU down projection.
    pub down: Linear,
}

/// Token embeddings, quantized or dense.
#[derive(Debug, Clone)]
pub enum Embedding {
    /// Rows dequantized on lookup by this crate's kernels (shared with a tied output).
    Fast(Arc<FastLinear>),
    /// Rows dequantized on lookup by candle.
    Quantized(Arc<QTensor>),
    /// A float table `[vocab, hidden]`.
    Dense(Tensor),
}

/// A loaded model.
#[derive(Debug, Clone)]
pub struct Model {
    config: ModelConfig,
    form: WeightForm,
    embedding: Embedding,
    blocks: Vec<Block>,
    norm: Tensor,
    output: Linear,
    /// Whether the output projection is the token embedding table (no `output.weight`).
    tied_output: bool,
    cos: Tensor,
    sin: Tensor,
    /// The same tables as flat f32 `[positions, hd/2]`, for the fast path.
    rope_cos: Vec<f32>,
    rope_sin: Vec<f32>,
    device: Device,
}

/// The KV cache of one sequence.
#[derive(Debug, Clone)]
pub struct SeqCache {
    /// Dense form: candle caches `[kv_heads, positions, hd]` per layer.
    layers: Vec<KvCache>,
    /// Quantized form: `(keys, values)` per layer, each `[positions, kv_heads·hd]`.
    raw: Vec<(Vec<f32>, Vec<f32>)>,
    /// Dense form while training: every cached position's keys and values as
    /// tensors of the autograd graph, so a prefix run once (a GRPO group's shared
    /// prompt) passes gradients back from every continuation.
    graph: Vec<(Tensor, Tensor)>,
    len: usize,
}

impl SeqCache {
    /// Tokens already in the cache.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the cache is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A deep copy, to continue one prefix in several ways (`n` > 1).
    pub fn fork(&self) -> Result<Self> {
        if self.layers.is_empty() {
            return Ok(self.clone());
        }
        let mut layers = Vec::with_capacity(self.layers.len());
        for layer in &self.layers {
            let mut copy = KvCache::new(1, self.len.max(64));
            if let (Some(k), Some(v)) = (layer.k()?, layer.v()?) {
                copy.append(&k.contiguous()?, &v.contiguous()?)?;
            }
            layers.push(copy);
        }
        Ok(Self {
            layers,
            raw: Vec::new(),
            graph: self.graph.clone(),
            len: self.len,
        })
    }

    /// Whether [`SeqCache::truncate`] can cut this cache: the quantized form's can, the
    /// dense form's cannot.
    pub fn can_truncate(&self) -> bool {
        self.layers.is_empty()
    }

    /// Keeps the first `len` positions and forgets the rest, so that a cached prefix
    /// can be continued differently. Only the quantized form's cache can be cut; false
    /// (and unchanged) for the dense form's.
    pub fn truncate(&mut self, len: usize) -> bool {
        if !self.can_truncate() || len > self.len {
            return false;
        }
        if let Some((k, _)) = self.raw.first() {
            let width = k.len().checked_div(self.len).unwrap_or(0);
            for (k, v) in &mut self.raw {
                k.truncate(len * width);
                v.truncate(len * width);
            }
        }
        self.len = len;
        true
    }

    /// Bytes held by the cache.
    pub fn bytes(&self) -> usize {
        let raw: usize = self
            .raw
            .iter()
            .map(|(k, v)| (k.capacity() + v.capacity()) * 4)
            .sum();
        raw + self
            .layers
            .iter()
            .filter_map(|l| l.k_cache().all_data().as_ref())
            .map(|t| t.elem_count() * t.dtype().size_in_bytes() * 2)
            .sum::<usize>()
    }
}

/// Sees the inputs of a forward pass's matrix multiplications: the names of the weights
/// and the input rows (see [`Model::forward_observed`]).
pub type MatmulObserver<'a> = dyn FnMut(&[String], &Tensor) -> Result<()> + Send + 'a;

/// Which logits a sequence wants back from [`Model::forward`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only the last new position (generation).
    Last,
    /// Every new position (scoring a whole sequence in one pass).
    All,
    /// The new positions from this index on (scoring a completion after its prompt:
    /// the prompt's rows never reach the large output layer).
    From(usize),
}

/// One sequence in a batched forward pass.
#[derive(Debug)]
pub struct SeqInput<'a> {
    /// Its cache; the new tokens are appended.
    pub cache: &'a mut SeqCache,
    /// The new tokens.
    pub tokens: &'a [u32],
    /// Which logits to return.
    pub logits: Logits,
}

fn linear_from(
    file: &mut GgufFile,
    name: &str,
    form: WeightForm,
    shape: (usize, usize),
    bias: bool,
) -> Result<Linear> {
    let q = file.tensor(&format!("{name}.weight"))?;
    check_shape(name, q.shape().dims(), &[shape.0, shape.1])?;
    let bias = if bias {
        let b = file
            .tensor(&format!("{name}.bias"))?
            .dequantize(&Device::Cpu)?;
        Some(match form {
            WeightForm::Dense(dtype) => b.to_dtype(dtype)?,
            WeightForm::Quantized => b,
        })
    } else {
        None
    };
    Ok(match form {
        WeightForm::Dense(dtype) => Linear::Dense {
            weight: q.dequantize(&Device::Cpu)?.to_dtype(dtype)?,
            bias,
        },
        WeightForm::Quantized if QuantKind::of(q.dtype()).is_some() => Linear::Fast {
            weight: Arc::new(FastLinear::from_qtensor(&q)?),
            bias,
        },
        WeightForm::Quantized => Linear::Quantized {
            weight: QMatMul::from_qtensor(q)?,
            bias,
        },
    })
}

fn check_shape(name: &str, got: &[usize], want: &[usize]) -> Result<()> {
    if got != want {
        return Err(ModelError::BadTensor {
            name: name.to_owned(),
            reason: format!("shape {got:?}, expected {want:?}"),
        });
    }
    Ok(())
}

fn norm_from(file: &mut GgufFile, name: &str, size: usize, dtype: DType) -> Result<Tensor> {
    let t = file.tensor(name)?.dequantize(&Device::Cpu)?;
    check_shape(name, t.dims(), &[size])?;
    Ok(t.to_dtype(dtype)?)
}

impl Model {
    /// Loads the weights of a GGUF file in the given form.
    pub fn from_gguf(file: &mut GgufFile, form: WeightForm) -> Result<Self> {
        let config = ModelConfig::from_gguf(file)?;
        let dtype = match form {
            WeightForm::Quantized => DType::F32,
            WeightForm::Dense(dtype) => dtype,
        };
        let (h, hd) = (config.hidden_size, config.head_dim);
        let q_dim = config.heads * hd;
        let kv_dim = config.kv_heads * hd;
        let bias = config.architecture == Architecture::Qwen2;
        let qk_norm = config.architecture == Architecture::Qwen3;
        let mut blocks = Vec::with_capacity(config.layers);
        for i in 0..config.layers {
            let p = format!("blk.{i}");
            blocks.push(Block {
                attn_norm: norm_from(file, &format!("{p}.attn_norm.weight"), h, dtype)?,
                q: linear_from(file, &format!("{p}.attn_q"), form, (q_dim, h), bias)?,
                k: linear_from(file, &format!("{p}.attn_k"), form, (kv_dim, h), bias)?,
                v: linear_from(file, &format!("{p}.attn_v"), form, (kv_dim, h), bias)?,
                o: linear_from(file, &format!("{p}.attn_output"), form, (h, q_dim), false)?,
                q_norm: if qk_norm {
                    Some(norm_from(
                        file,
                        &format!("{p}.attn_q_norm.weight"),
                        hd,
                        dtype,
                    )?)
                } else {
                    None
                },
                k_norm: if qk_norm {
                    Some(norm_from(
                        file,
                        &format!("{p}.attn_k_norm.weight"),
                        hd,
                        dtype,
                    )?)
                } else {
                    None
                },
                ffn_norm: norm_from(file, &format!("{p}.ffn_norm.weight"), h, dtype)?,
                gate: linear_from(
                    file,
                    &format!("{p}.ffn_gate"),
                    form,
                    (config.ffn_size, h),
                    false,
                )?,
                up: linear_from(
                    file,
                    &format!("{p}.ffn_up"),
                    form,
                    (config.ffn_size, h),
                    false,
                )?,
                down: linear_from(
                    file,
                    &format!("{p}.ffn_down"),
                    form,
                    (h, config.ffn_size),
                    false,
                )?,
            });
        }
        let norm = norm_from(file, "output_norm.weight", h, dtype)?;
        let embd = file.tensor("token_embd.weight")?;
        check_shape("token_embd", embd.shape().dims(), &[config.vocab_size, h])?;
        let output = if file.has_tensor("output.weight") {
            linear_from(file, "output", form, (config.vocab_size, h), false)?
        } else {
            // Tied embeddings: the output projection is the embedding table.
            match form {
                WeightForm::Dense(dtype) => Linear::Dense {
                    weight: embd.dequantize(&Device::Cpu)?.to_dtype(dtype)?,
                    bias: None,
                },
                WeightForm::Quantized if QuantKind::of(embd.dtype()).is_some() => Linear::Fast {
                    weight: Arc::new(FastLinear::from_qtensor(&embd)?),
                    bias: None,
                },
                WeightForm::Quantized => Linear::Quantized {
                    weight: QMatMul::from_qtensor(file.tensor("token_embd.weight")?)?,
                    bias: None,
                },
            }
        };
        let embedding = match (form, &output) {
            (WeightForm::Dense(dtype), _) => {
                Embedding::Dense(embd.dequantize(&Device::Cpu)?.to_dtype(dtype)?)
            }
            // Tied: the output layer's copy serves lookups too.
            (WeightForm::Quantized, Linear::Fast { weight, .. })
                if !file.has_tensor("output.weight") =>
            {
                Embedding::Fast(weight.clone())
            }
            (WeightForm::Quantized, _) if QuantKind::of(embd.dtype()).is_some() => {
                Embedding::Fast(Arc::new(FastLinear::from_qtensor(&embd)?))
            }
            (WeightForm::Quantized, _) => Embedding::Quantized(Arc::new(embd)),
        };
        Ok(
            Self::assemble(config, form, embedding, blocks, norm, output)?
                .with_tied_output(!file.has_tensor("output.weight")),
        )
    }

    /// Puts loaded parts together and precomputes the rotary tables.
    pub fn assemble(
        config: ModelConfig,
        form: WeightForm,
        embedding: Embedding,
        blocks: Vec<Block>,
        norm: Tensor,
        output: Linear,
    ) -> Result<Self> {
        let device = Device::Cpu;
        let positions = config.context_length.clamp(1, 1 << 17);
        let half = config.head_dim / 2;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| {
                1.0 / config
                    .rope_theta
                    .powf(2.0 * i as f64 / config.head_dim as f64) as f32
            })
            .collect();
        let inv_freq = Tensor::from_vec(inv_freq, (1, half), &device)?;
        let t = Tensor::arange(0u32, positions as u32, &device)?
            .to_dtype(DType::F32)?
            .reshape((positions, 1))?;
        let freqs = t.broadcast_mul(&inv_freq)?;
        let dtype = match form {
            WeightForm::Quantized => DType::F32,
            WeightForm::Dense(dtype) => dtype,
        };
        let (cos, sin) = (freqs.cos()?, freqs.sin()?);
        Ok(Self {
            rope_cos: cos.flatten_all()?.to_vec1()?,
            rope_sin: sin.flatten_all()?.to_vec1()?,
            cos: cos.to_dtype(dtype)?,
            sin: sin.to_dtype(dtype)?,
            config,
            form,
            embedding,
            blocks,
            norm,
            output,
            tied_output: false,
            device,
        })
    }

    /// Marks the output projection as the token embedding table (tied embeddings), so
    /// observers see it under `token_embd.weight` as llama.cpp names it.
    pub fn with_tied_output(mut self, tied: bool) -> Self {
        self.tied_output = tied;
        self
    }

    /// Whether the output projection is the token embedding table.
    pub fn tied_output(&self) -> bool {
        self.tied_output
    }

    /// The GGUF name of the output projection's weight: `token_embd.weight` when tied.
    pub fn output_weight_name(&self) -> &'static str {
        if self.tied_output {
            "token_embd.weight"
        } else {
            "output.weight"
        }
    }

    /// The hyperparameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The weight form.
    pub fn form(&self) -> WeightForm {
        self.form
    }

    /// The transformer blocks (for adapters and inspection).
    pub fn blocks(&self) -> &[Block] {
        &self.blocks
    }

    /// Mutable access to the blocks (adapters replace linear layers).
    pub fn blocks_mut(&mut self) -> &mut [Block] {
        &mut self.blocks
    }

    /// Mutable access to the token embeddings (quantizers measuring a changed table).
    pub fn embedding_mut(&mut self) -> &mut Embedding {
        &mut self.embedding
    }

    /// Mutable access to the output projection (the embedding table when tied).
    pub fn output_mut(&mut self) -> &mut Linear {
        &mut self.output
    }

    /// The longest sequence the rotary tables cover.
    pub fn max_positions(&self) -> usize {
        self.cos.dim(0).unwrap_or(0)
    }

    /// An empty cache for a new sequence.
    pub fn new_cache(&self) -> SeqCache {
        if self.differentiable() {
            SeqCache {
                layers: (0..self.config.layers)
                    .map(|_| KvCache::new(1, 256))
                    .collect(),
                raw: Vec::new(),
                graph: Vec::new(),
                len: 0,
            }
        } else {
            SeqCache {
                layers: Vec::new(),
                raw: vec![(Vec::new(), Vec::new()); self.config.layers],
                graph: Vec::new(),
                len: 0,
            }
        }
    }

    fn differentiable(&self) -> bool {
        matches!(self.form, WeightForm::Dense(_))
    }

    fn rms_norm(&self, x: &Tensor, weight: &Tensor) -> Result<Tensor> {
        let eps = self.config.rms_eps as f32;
        Ok(if self.differentiable() {
            candle_nn::ops::rms_norm_slow(x, weight, eps)?
        } else {
            candle_nn::ops::rms_norm(x, weight, eps)?
        })
    }

    fn rope(&self, x: &Tensor, start: usize) -> Result<Tensor> {
        let n = x.dim(2)?;
        let cos = self.cos.narrow(0, start, n)?;
        let sin = self.sin.narrow(0, start, n)?;
        let slow = self.differentiable();
        Ok(match (self.config.rope_layout, slow) {
            (RopeLayout::Interleaved, false) => candle_nn::rotary_emb::rope_i(x, &cos, &sin)?,
            (RopeLayout::Interleaved, true) => candle_nn::rotary_emb::rope_i_slow(x, &cos, &sin)?,
            (RopeLayout::Halves, false) => candle_nn::rotary_emb::rope(x, &cos, &sin)?,
            (RopeLayout::Halves, true) => candle_nn::rotary_emb::rope_slow(x, &cos, &sin)?,
        })
    }

    fn softmax(&self, x: &Tensor) -> Result<Tensor> {
        Ok(if self.differentiable() {
            candle_nn::ops::softmax(x, D::Minus1)?
        } else {
            candle_nn::ops::softmax_last_dim(x)?
        })
    }

    fn embed(&self, ids: &[u32]) -> Result<Tensor> {
        let n = ids.len();
        Ok(match &self.embedding {
            Embedding::Fast(w) => Tensor::from_vec(w.rows(ids), (n, w.shape().1), &self.device)?,
            Embedding::Quantized(q) => q.embedding(&Tensor::from_slice(ids, n, &self.device)?)?,
            Embedding::Dense(t) => t.embedding(&Tensor::from_slice(ids, n, &self.device)?)?,
        })
    }

    /// Runs new tokens of several sequences through the model, appending to their
    /// caches. Returns, per sequence, logits `[rows, vocab]` (one row for
    /// [`Logits::Last`], one per new token for [`Logits::All`]).
    pub fn forward(&self, batch: &mut [SeqInput<'_>]) -> Result<Vec<Tensor>> {
        self.forward_observed(batch, None)
    }

    /// Several completions of one prompt: the prompt runs once, then every completion
    /// continues from a copy of its cache, all in one batch (while training, gradients
    /// reach the shared prompt from each). Returns the prompt's last logits row
    /// `[1, vocab]`, which predicts every completion's first token, and per completion
    /// the logits of its tokens but the last, `[len − 1, vocab]` (`None` when it has
    /// at most one token): together, the logits that predict each completion token.
    pub fn forward_completions(
        &self,
        prompt: &[u32],
        completions: &[&[u32]],
    ) -> Result<(Tensor, Vec<Option<Tensor>>)> {
        let mut cache = self.new_cache();
        let first = self
            .forward(&mut [SeqInput {
                cache: &mut cache,
                tokens: prompt,
                logits: Logits::Last,
            }])?
            .remove(0);
        let longer: Vec<&[u32]> = completions
            .iter()
            .copied()
            .filter(|c| c.len() > 1)
            .collect();
        let mut caches = longer
            .iter()
            .map(|_| cache.fork())
            .collect::<Result<Vec<_>>>()?;
        let mut inputs: Vec<SeqInput<'_>> = caches
            .iter_mut()
            .zip(&longer)
            .map(|(cache, c)| SeqInput {
                cache,
                tokens: &c[..c.len() - 1],
                logits: Logits::All,
            })
            .collect();
        let mut rest = if inputs.is_empty() {
            Vec::new()
        } else {
            self.forward(&mut inputs)?
        }
        .into_iter();
        let rest = completions
            .iter()
            .map(|c| if c.len() > 1 { rest.next() } else { None })
            .collect();
        Ok((first, rest))
    }

    /// [`Model::forward`], showing `observer` the input of every matrix multiplication
    /// with a weight: the GGUF names of the weights that multiply it (q, k and v share
    /// one input, as do gate and up) and the input rows `[tokens, in]`. The output
    /// projection is shown last, with only the rows whose logits are wanted. An
    /// importance matrix (Σx² per input column) is collected this way.
    pub fn forward_observed(
        &self,
        batch: &mut [SeqInput<'_>],
        observer: Option<&mut MatmulObserver<'_>>,
    ) -> Result<Vec<Tensor>> {
        // The kernels split work with rayon. Called from outside rayon's pool, every
        // kernel call would hand its work to the pool and sleep until it is done
        // (hundreds of context switches per token); running the whole pass on a pool
        // thread lets the kernels run inline there and fan out only when they can.
        if rayon::current_thread_index().is_some() {
            self.forward_in_pool(batch, observer)
        } else {
            rayon::scope(|_| self.forward_in_pool(batch, observer))
        }
    }

    fn forward_in_pool(
        &self,
        batch: &mut [SeqInput<'_>],
        mut observer: Option<&mut MatmulObserver<'_>>,
    ) -> Result<Vec<Tensor>> {
        let mut observe = |layer: usize, weights: &[&str], input: &Tensor| -> Result<()> {
            match observer.as_deref_mut() {
                Some(f) => {
                    let names: Vec<String> = weights
                        .iter()
                        .map(|w| format!("blk.{layer}.{w}.weight"))
                        .collect();
                    f(&names, input)
                }
                None => Ok(()),
            }
        };
        let cfg = &self.config;
        let vocab = cfg.vocab_size as u32;
        let limit = self.max_positions();
        let mut ids = Vec::new();
        for item in batch.iter() {
            if item.tokens.is_empty() {
                return Err(ModelError::InvalidRequest(
                    "a sequence in the batch has no new tokens".into(),
                ));
            }
            if let Some(bad) = item.tokens.iter().find(|&&t| t >= vocab) {
                return Err(ModelError::InvalidRequest(format!(
                    "token id {bad} is out of range; the vocabulary has {vocab} tokens (0..{vocab})"
                )));
            }
            let total = item.cache.len + item.tokens.len();
            if total > limit {
                return Err(ModelError::ContextOverflow {
                    tokens: total,
                    context: limit,
                });
            }
            ids.extend_from_slice(item.tokens);
        }
        let n_total = ids.len();
        let mut x = self.embed(&ids)?;
        let scale = 1.0 / (cfg.head_dim as f64).sqrt();

        for (layer, block) in self.blocks.iter().enumerate() {
            let h = self.rms_norm(&x, &block.attn_norm)?;
            observe(layer, &["attn_q", "attn_k", "attn_v"], &h)?;
            let [q, k, v] = Linear::forward_many([&block.q, &block.k, &block.v], &h)?;
            let attn = if self.differentiable() {
                self.attention_dense(layer, block, batch, &q, &k, &v, scale)?
            } else {
                self.attention_fast(layer, block, batch, &q, &k, &v, scale as f32)?
            };

            observe(layer, &["attn_output"], &attn)?;
            x = (x + block.o.forward(&attn)?)?;
            let h = self.rms_norm(&x, &block.ffn_norm)?;
            observe(layer, &["ffn_gate", "ffn_up"], &h)?;
            let [gate, up] = Linear::forward_many([&block.gate, &block.up], &h)?;
            let gate = candle_nn::ops::silu(&gate)?;
            let act = (gate * up)?;
            observe(layer, &["ffn_down"], &act)?;
            x = (x + block.down.forward(&act)?)?;
        }
        for item in batch.iter_mut() {
            item.cache.len += item.tokens.len();
        }

        // Only the rows whose logits are wanted go through the (large) output layer.
        let mut rows = Vec::new();
        let mut counts = Vec::with_capacity(batch.len());
        let mut offset = 0u32;
        for item in batch.iter() {
            let n = item.tokens.len() as u32;
            match item.logits {
                Logits::Last => {
                    rows.push(offset + n - 1);
                    counts.push(1);
                }
                Logits::All => {
                    rows.extend(offset..offset + n);
                    counts.push(n as usize);
                }
                Logits::From(from) => {
                    let from = (from as u32).min(n - 1);
                    rows.extend(offset + from..offset + n);
                    counts.push((n - from) as usize);
                }
            }
            offset += n;
        }
        let x = if rows.len() == n_total {
            x
        } else {
            let len = rows.len();
            x.index_select(&Tensor::from_vec(rows, len, &self.device)?, 0)?
        };
        let x = self.rms_norm(&x, &self.norm)?;
        if let Some(f) = observer {
            f(&[self.output_weight_name().to_owned()], &x)?;
        }
        let logits = self.output.forward(&x)?.to_dtype(DType::F32)?;
        let mut out = Vec::with_capacity(counts.len());
        let mut at = 0;
        for count in counts {
            out.push(logits.narrow(0, at, count)?);
            at += count;
        }
        Ok(out)
    }

    /// Attention with candle operations (differentiable).
    #[expect(clippy::too_many_arguments, reason = "one layer's attention inputs")]
    fn attention_dense(
        &self,
        layer: usize,
        block: &Block,
        batch: &mut [SeqInput<'_>],
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        scale: f64,
    ) -> Result<Tensor> {
        let cfg = &self.config;
        let (heads, kv_heads, hd) = (cfg.heads, cfg.kv_heads, cfg.head_dim);
        let groups = heads / kv_heads;
        let mut outputs = Vec::with_capacity(batch.len());
        let mut offset = 0;
        for item in batch.iter_mut() {
            let n = item.tokens.len();
            let start = item.cache.len;
            let q = q.narrow(0, offset, n)?;
            let k = k.narrow(0, offset, n)?;
            let v = v.narrow(0, offset, n)?;
            offset += n;
            // [n, heads·hd] → [1, heads, n, hd]
            let mut q = q.reshape((n, heads, hd))?.transpose(0, 1)?.contiguous()?;
            let mut k = k
                .reshape((n, kv_heads, hd))?
                .transpose(0, 1)?
                .contiguous()?;
            let v = v
                .reshape((n, kv_heads, hd))?
                .transpose(0, 1)?
                .contiguous()?;
            if let Some(w) = &block.q_norm {
                q = self.rms_norm(&q, w)?;
            }
            if let Some(w) = &block.k_norm {
                k = self.rms_norm(&k, w)?;
            }
            let q = self.rope(&q.unsqueeze(0)?, start)?.squeeze(0)?;
            let k = self.rope(&k.unsqueeze(0)?, start)?.squeeze(0)?;
            let (k_all, v_all) = item.cache.layers[layer].append(&k, &v)?;
            // The cache copies into its buffer in place, which has no gradient: a
            // sequence scored from an empty cache (the trainer's one pass over a whole
            // sequence) attends to this call's keys and values themselves, so
            // gradients reach the k and v projections. While training, the graph's
            // own keys and values of earlier calls are kept too (a shared prompt run
            // once for a group); otherwise cached positions are constants.
            let (k, v) = if k.track_op() || v.track_op() {
                let graph = &mut item.cache.graph;
                let (k, v) = match graph.get(layer) {
                    Some((pk, pv)) if start > 0 => {
                        (Tensor::cat(&[pk, &k], 1)?, Tensor::cat(&[pv, &v], 1)?)
                    }
                    _ => (k, v),
                };
                if graph.len() <= layer {
                    graph.resize(layer + 1, (k.clone(), v.clone()));
                }
                graph[layer] = (k.clone(), v.clone());
                (k, v)
            } else if start == 0 {
                (k, v)
            } else {
                (k_all, v_all)
            };
            let s = k.dim(1)?;
            // Grouped-query attention without copying K/V: the query heads that
            // share a KV head are stacked as extra rows.
            let q = q.reshape((kv_heads, groups * n, hd))?;
            let scores = (q.matmul(&k.t()?)? * scale)?;
            let scores = if n > 1 {
                let mask = causal_mask(n, start, s, &self.device, scores.dtype())?;
                scores
                    .reshape((kv_heads, groups, n, s))?
                    .broadcast_add(&mask)?
                    .reshape((kv_heads, groups * n, s))?
            } else {
                scores
            };
            let probs = self.softmax(&scores)?;
            let out = probs.matmul(&v.contiguous()?)?; // [kv, groups·n, hd]
            let out = out
                .reshape((heads, n, hd))?
                .transpose(0, 1)?
                .reshape((n, heads * hd))?;
            outputs.push(out);
        }
        Ok(Tensor::cat(&outputs, 0)?)
    }

    /// Attention with this crate's kernel: rotary, norms and attention in plain loops
    /// over the sequence's own f32 cache, identical whatever the batch.
    #[expect(clippy::too_many_arguments, reason = "one layer's attention inputs")]
    fn attention_fast(
        &self,
        layer: usize,
        block: &Block,
        batch: &mut [SeqInput<'_>],
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        scale: f32,
    ) -> Result<Tensor> {
        let cfg = &self.config;
        let (heads, kv_heads, hd) = (cfg.heads, cfg.kv_heads, cfg.head_dim);
        let (q_dim, kv_dim) = (heads * hd, kv_heads * hd);
        let mut q = q.flatten_all()?.to_vec1::<f32>()?;
        let k = k.flatten_all()?.to_vec1::<f32>()?;
        let v = v.flatten_all()?.to_vec1::<f32>()?;
        let q_norm = block
            .q_norm
            .as_ref()
            .map(|w| w.to_vec1::<f32>())
            .transpose()?;
        let k_norm = block
            .k_norm
            .as_ref()
            .map(|w| w.to_vec1::<f32>())
            .transpose()?;
        let eps = cfg.rms_eps as f32;
        let mut out = Vec::with_capacity(q.len());
        let mut offset = 0;
        for item in batch.iter_mut() {
            let n = item.tokens.len();
            let start = item.cache.len;
            let qs = &mut q[offset * q_dim..(offset + n) * q_dim];
            let (keys, values) = &mut item.cache.raw[layer];
            let first = keys.len();
            keys.extend_from_slice(&k[offset * kv_dim..(offset + n) * kv_dim]);
            values.extend_from_slice(&v[offset * kv_dim..(offset + n) * kv_dim]);
            offset += n;
            for t in 0..n {
                let pos = start + t;
                for head in qs[t * q_dim..(t + 1) * q_dim].chunks_exact_mut(hd) {
                    if let Some(w) = &q_norm {
                        rms_norm_in_place(head, w, eps);
                    }
                    self.rope_in_place(head, pos);
                }
                for head in keys[first + t * kv_dim..first + (t + 1) * kv_dim].chunks_exact_mut(hd)
                {
                    if let Some(w) = &k_norm {
                        rms_norm_in_place(head, w, eps);
                    }
                    self.rope_in_place(head, pos);
                }
            }
            out.extend(kernels::attention(
                qs, keys, values, n, heads, kv_heads, hd, scale,
            ));
        }
        let rows = out.len() / q_dim;
        Ok(Tensor::from_vec(out, (rows, q_dim), &self.device)?)
    }

    /// Rotary embedding of one head at position `pos`, from the same tables as the
    /// dense path.
    fn rope_in_place(&self, head: &mut [f32], pos: usize) {
        let half = head.len() / 2;
        let (cos, sin) = (
            &self.rope_cos[pos * half..(pos + 1) * half],
            &self.rope_sin[pos * half..(pos + 1) * half],
        );
        match self.config.rope_layout {
            RopeLayout::Interleaved => {
                for i in 0..half {
                    let (a, b) = (head[2 * i], head[2 * i + 1]);
                    head[2 * i] = a * cos[i] - b * sin[i];
                    head[2 * i + 1] = a * sin[i] + b * cos[i];
                }
            }
            RopeLayout::Halves => {
                for i in 0..half {
                    let (a, b) = (head[i], head[i + half]);
                    head[i] = a * cos[i] - b * sin[i];
                    head[i + half] = a * sin[i] + b * cos[i];
                }
            }
        }
    }
}

/// RMS norm of one vector with weight `w`, as candle's fused kernel computes it.
fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let sum: f32 = x.iter().map(|v| v * v).sum();
    let scale = 1.0 / (sum / x.len() as f32 + eps).sqrt();
    for (v, w) in x.iter_mut().zip(w) {
        *v = *v * scale * w;
    }
}

/// `[n, s]` additive mask: query `i` (at position `start + i`) sees keys `0..=start + i`.
fn causal_mask(n: usize, start: usize, s: usize, device: &Device, dtype: DType) -> Result<Tensor> {
    let mask: Vec<f32> = (0..n)
        .flat_map(|i| {
            (0..s).map(move |j| {
                if j > start + i {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
        })
        .collect();
    Ok(Tensor::from_vec(mask, (n, s), device)?.to_dtype(dtype)?)
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::GgmlDType;

    use super::*;

    fn adapted(device: &Device, out: usize, inp: usize, rank: usize) -> Linear {
        let w = Tensor::randn(0f32, 1.0, (out, inp), device).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q4_1).unwrap();
        Linear::Adapted {
            base: Box::new(Linear::Fast {
                weight: Arc::new(FastLinear::from_qtensor(&q).unwrap()),
                bias: None,
            }),
            a: Tensor::randn(0f32, 1.0, (rank, inp), device).unwrap(),
            b: Tensor::randn(0f32, 1.0, (out, rank), device).unwrap(),
            scale: 0.5,
        }
    }

    fn rows(t: &Tensor) -> Vec<Vec<f32>> {
        t.to_vec2().unwrap()
    }

    /// Adapters over this crate's kernels, alone or several sharing one quantized
    /// input: the low-rank term matches candle's matmul, every row is the same bits
    /// whatever rows come with it, and `forward_many` gives `forward`'s bits.
    #[test]
    fn adapted_fast_layers_are_exact_and_batch_invariant() {
        let device = Device::Cpu;
        // Rank 5: the sums over the rank are not a whole number of lanes.
        let (q, v) = (adapted(&device, 24, 96, 5), adapted(&device, 9, 96, 5));
        let x = Tensor::randn(0f32, 1.0, (6, 96), &device).unwrap();
        let Linear::Adapted { base, a, b, scale } = &q else {
            unreachable!()
        };
        let low = (x
            .matmul(&a.t().unwrap())
            .unwrap()
            .matmul(&b.t().unwrap())
            .unwrap()
            * *scale)
            .unwrap();
        let want = rows(&(base.forward(&x).unwrap() + low).unwrap());
        let got = rows(&q.forward(&x).unwrap());
        for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
            assert!((g - w).abs() <= 1e-4 * w.abs().max(1.0), "{g} vs {w}");
        }
        for n in [1, 2, 5] {
            let part = rows(&q.forward(&x.narrow(0, 0, n).unwrap()).unwrap());
            assert_eq!(part[..], got[..n], "{n} rows");
        }
        let [qm, vm] = Linear::forward_many([&q, &v], &x).unwrap();
        assert_eq!(rows(&qm), got);
        assert_eq!(rows(&vm), rows(&v.forward(&x).unwrap()));
    }
}
