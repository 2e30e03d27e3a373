//! The llama-family transformer: one architecture definition, two weight forms.
//!
//! [`WeightForm::Quantized`] keeps the GGUF blocks and multiplies with quantized dot
//! products (inference); [`WeightForm::Dense`] dequantizes to a float type, which
//! candle can differentiate (training, scoring with gradients). The forward pass is the
//! same code for both. Without gradients, attention, norms and rotary run as plain loops
//! over each sequence's own cache; when the input carries gradients (an adapter being
//! trained), they run as the fused differentiable operations of [`crate::grad`].
//!
//! [`Model::forward`] runs a *batch of sequences*, each with its own KV cache and its own
//! number of new tokens: all new tokens of all sequences go through the linear layers as
//! one matrix, attention runs per sequence. A prefill, a decode step of many sequences,
//! or a mix of both is one call.

use std::sync::Arc;

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};

use crate::config::{Architecture, ModelConfig};
use crate::error::{ModelError, Result};
use crate::gguf::{GgufFile, TensorType, Weight};
use crate::grad::{self, RopeTables};
use crate::kernels::{self, FastLinear, QuantKind};
use crate::repack_cache::{Loading, RepackCache};

/// How the weights are held in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightForm {
    /// GGUF blocks as stored, run by this crate's SIMD kernels (candle's quantized
    /// matmul for a type they do not read); fused kernels without gradients.
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
    /// This crate's kernels (every GGUF type the runtime ships): batch-invariant, SIMD.
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
    /// Whether each output row is the same bits whatever the other rows of the input
    /// (this crate's kernels, and adapters over them at inference); candle's matmuls
    /// may sum in another order for another number of rows.
    pub fn is_batch_invariant(&self) -> bool {
        match self {
            Self::Fast { .. } => true,
            Self::Adapted { base, .. } => base.is_batch_invariant(),
            Self::Quantized { .. } | Self::Dense { .. } => false,
        }
    }

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
                // Training on a float base: one fused operation (`grad::adapted_matmul`).
                if let Self::Dense { weight, bias } = base.as_ref()
                    && frozen_f32(x, weight)
                    && a.dtype() == DType::F32
                    && b.dtype() == DType::F32
                {
                    (grad::adapted_matmul(x, weight, a, b, *scale as f32)?, bias)
                } else {
                    let low = x.to_dtype(a.dtype())?.matmul(&a.t()?)?.matmul(&b.t()?)?;
                    let low = (low * *scale)?.to_dtype(x.dtype())?;
                    return Ok((base.forward(x)? + low)?);
                }
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
pub(crate) fn dot_fixed(p: &[f32], q: &[f32]) -> f32 {
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

/// `x Wᵀ` for a float weight. An f32 `W` that is frozen (not a variable) goes through
/// [`grad::frozen_matmul`], with gradients or without (the same product either way):
/// in LoRA training candle's matmul would also compute `W`'s gradient, a second
/// matmul as large as the first and a weight-sized buffer per layer, only to throw
/// them away.
fn dense_matmul(x: &Tensor, weight: &Tensor) -> Result<Tensor> {
    if frozen_f32(x, weight) {
        Ok(grad::frozen_matmul(x, weight)?)
    } else {
        Ok(x.matmul(&weight.t()?)?)
    }
}

/// Whether `x Wᵀ` can go through this crate's f32 products of a frozen weight
/// ([`grad::frozen_matmul`], [`grad::adapted_matmul`]): both f32, `W` not a variable.
fn frozen_f32(x: &Tensor, weight: &Tensor) -> bool {
    !weight.track_op() && x.dtype() == DType::F32 && weight.dtype() == DType::F32
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
    /// Rotary cosines and sines per position.
    rope: RopeTables,
    device: Device,
}

/// The KV cache of one sequence.
#[derive(Debug, Clone)]
pub struct SeqCache {
    /// `(keys, values)` per layer, each `[positions, kv_heads·hd]` (keys after their
    /// norm and rotary embedding).
    raw: Vec<RawKv>,
    /// While training: per layer, the keys and values of every cached position as
    /// tensors of the autograd graph (one segment per forward call), so a prefix run
    /// once (a GRPO group's shared prompt) passes gradients back from every
    /// continuation.
    graph: Vec<Segments>,
    len: usize,
}

/// One layer's cached keys and values, `[positions, kv_heads·hd]` each.
type RawKv = (Vec<f32>, Vec<f32>);

/// One layer's keys and values in the autograd graph, one `(keys, values)` pair per
/// forward call.
type Segments = Vec<(Tensor, Tensor)>;

impl SeqCache {
    /// Tokens already in the cache.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the cache is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A copy, to continue one prefix in several ways (`n` > 1). The copies share the
    /// prefix's autograd segments, so each passes its gradients to the same prefix.
    pub fn fork(&self) -> Result<Self> {
        Ok(self.clone())
    }

    /// Whether [`SeqCache::truncate`] can cut this cache: not while it holds autograd
    /// segments (a training pass's).
    pub fn can_truncate(&self) -> bool {
        self.graph.is_empty()
    }

    /// Keeps the first `len` positions and forgets the rest, so that a cached prefix
    /// can be continued differently. False (and unchanged) when it cannot
    /// ([`SeqCache::can_truncate`]).
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
        let graph: usize = self
            .graph
            .iter()
            .flatten()
            .map(|(k, v)| (k.elem_count() + v.elem_count()) * k.dtype().size_in_bytes())
            .sum();
        raw + graph
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
    repacked: &mut Loading<'_>,
    name: &str,
    form: WeightForm,
    shape: (usize, usize),
    bias: bool,
) -> Result<Linear> {
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
    let weight_name = format!("{name}.weight");
    if matches!(form, WeightForm::Quantized) && has_kernel(file, &weight_name) {
        let dims = file.tensor_dims(&weight_name)?;
        check_shape(name, dims, &[shape.0, shape.1])?;
        return Ok(Linear::Fast {
            weight: repacked.weight(file, &weight_name)?,
            bias,
        });
    }
    let w = file.weight(&weight_name)?;
    check_shape(name, w.dims(), &[shape.0, shape.1])?;
    Ok(match (form, w) {
        (WeightForm::Dense(dtype), w) => Linear::Dense {
            weight: w.dequantize()?.to_dtype(dtype)?,
            bias,
        },
        (WeightForm::Quantized, Weight::Ggml(q)) => Linear::Quantized {
            weight: QMatMul::from_qtensor(q)?,
            bias,
        },
        (WeightForm::Quantized, Weight::Raw(_)) => {
            unreachable!("raw weights have kernels and were mapped above")
        }
    })
}

/// Whether tensor `name` runs on this crate's kernels at inference: every type with a
/// kernel (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) and the types
/// candle cannot read (IQ4_NL, IQ4_XS). Such weights are mapped from the file and
/// repacked ([`FastLinear::from_mapped`]), never read into memory whole. The others
/// (float weights, and Q8_1 and Q8_K: ggml's activation formats, not found as weights
/// in practice) stay on candle's quantized matmul.
fn has_kernel(file: &GgufFile, name: &str) -> bool {
    match file.tensor_type(name) {
        Some(TensorType::Ggml(dtype)) => QuantKind::of(dtype).is_some(),
        Some(TensorType::Raw(_)) => true,
        None => false,
    }
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
    /// Loads the weights of a GGUF file in the given form, the repacked ones through
    /// the repack cache the environment names ([`RepackCache::from_env`]).
    pub fn from_gguf(file: &mut GgufFile, form: WeightForm) -> Result<Self> {
        Self::from_gguf_cached(file, form, &RepackCache::from_env())
    }

    /// Loads the weights of a GGUF file in the given form; weights for this crate's
    /// kernels come from `cache` when it holds them for this file, and are written to it
    /// when it does not.
    pub fn from_gguf_cached(
        file: &mut GgufFile,
        form: WeightForm,
        cache: &RepackCache,
    ) -> Result<Self> {
        let off = RepackCache::off();
        let mut repacked = match form {
            WeightForm::Quantized => cache.start(file),
            WeightForm::Dense(_) => off.start(file),
        };
        let r = &mut repacked;
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
                q: linear_from(file, r, &format!("{p}.attn_q"), form, (q_dim, h), bias)?,
                k: linear_from(file, r, &format!("{p}.attn_k"), form, (kv_dim, h), bias)?,
                v: linear_from(file, r, &format!("{p}.attn_v"), form, (kv_dim, h), bias)?,
                o: linear_from(
                    file,
                    r,
                    &format!("{p}.attn_output"),
                    form,
                    (h, q_dim),
                    false,
                )?,
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
                    r,
                    &format!("{p}.ffn_gate"),
                    form,
                    (config.ffn_size, h),
                    false,
                )?,
                up: linear_from(
                    file,
                    r,
                    &format!("{p}.ffn_up"),
                    form,
                    (config.ffn_size, h),
                    false,
                )?,
                down: linear_from(
                    file,
                    r,
                    &format!("{p}.ffn_down"),
                    form,
                    (h, config.ffn_size),
                    false,
                )?,
            });
        }
        let norm = norm_from(file, "output_norm.weight", h, dtype)?;
        let tied = !file.has_tensor("output.weight");
        let (embedding, output) =
            if matches!(form, WeightForm::Quantized) && has_kernel(file, "token_embd.weight") {
                let dims = file.tensor_dims("token_embd.weight")?;
                check_shape("token_embd", dims, &[config.vocab_size, h])?;
                let embd = r.weight(file, "token_embd.weight")?;
                let output = if tied {
                    // Tied embeddings: the output projection is the embedding table, and
                    // one copy serves both.
                    Linear::Fast {
                        weight: embd.clone(),
                        bias: None,
                    }
                } else {
                    linear_from(file, r, "output", form, (config.vocab_size, h), false)?
                };
                (Embedding::Fast(embd), output)
            } else {
                let embd = file.weight("token_embd.weight")?;
                check_shape("token_embd", embd.dims(), &[config.vocab_size, h])?;
                let output = if tied {
                    match form {
                        WeightForm::Dense(dtype) => Linear::Dense {
                            weight: embd.dequantize()?.to_dtype(dtype)?,
                            bias: None,
                        },
                        WeightForm::Quantized => Linear::Quantized {
                            weight: QMatMul::from_qtensor(file.tensor("token_embd.weight")?)?,
                            bias: None,
                        },
                    }
                } else {
                    linear_from(file, r, "output", form, (config.vocab_size, h), false)?
                };
                let embedding = match (form, embd) {
                    (WeightForm::Dense(dtype), embd) => {
                        Embedding::Dense(embd.dequantize()?.to_dtype(dtype)?)
                    }
                    (WeightForm::Quantized, Weight::Ggml(q)) => Embedding::Quantized(Arc::new(q)),
                    (WeightForm::Quantized, Weight::Raw(_)) => {
                        unreachable!("raw weights have kernels")
                    }
                };
                (embedding, output)
            };
        repacked.finish();
        Ok(Self::assemble(config, form, embedding, blocks, norm, output)?.with_tied_output(tied))
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
        let rope = RopeTables {
            cos: freqs.cos()?.flatten_all()?.to_vec1::<f32>()?.into(),
            sin: freqs.sin()?.flatten_all()?.to_vec1::<f32>()?.into(),
            layout: config.rope_layout,
        };
        Ok(Self {
            rope,
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

    /// Whether a position's logits are the same bits however its sequence is split into
    /// passes and whatever else is in the batch: the quantized form with every layer
    /// on this crate's kernels (every quantized GGUF type). Float weights run on
    /// candle's matmuls and the dense form on the training path's operations, which
    /// differ in the last bits between a pass of one row and of several. Speculative
    /// decoding is exact only where this holds, and is used only there.
    pub fn splits_exactly(&self) -> bool {
        matches!(self.form, WeightForm::Quantized)
            && self.output.is_batch_invariant()
            && self.blocks.iter().all(|b| {
                [&b.q, &b.k, &b.v, &b.o, &b.gate, &b.up, &b.down]
                    .iter()
                    .all(|l| l.is_batch_invariant())
            })
    }

    /// The longest sequence the rotary tables cover.
    pub fn max_positions(&self) -> usize {
        self.rope.cos.len() / (self.config.head_dim / 2).max(1)
    }

    /// An empty cache for a new sequence.
    pub fn new_cache(&self) -> SeqCache {
        SeqCache {
            raw: vec![(Vec::new(), Vec::new()); self.config.layers],
            graph: Vec::new(),
            len: 0,
        }
    }

    /// Whether a pass runs the training path's operations ([`grad`]): always for the
    /// dense form, so that its values are the same bits with gradients or without
    /// (an adapter whose `B` is zero is exactly the base; f32 rollouts score as the
    /// learner does), and for any input that carries gradients.
    fn graph_ops(&self, tracking: bool) -> bool {
        tracking || matches!(self.form, WeightForm::Dense(_))
    }

    /// RMS norm: the training path's fused operation ([`Model::graph_ops`]), candle's
    /// fused kernel's arithmetic split across the team otherwise.
    fn rms_norm(&self, x: &Tensor, weight: &Tensor) -> Result<Tensor> {
        let eps = self.config.rms_eps as f32;
        Ok(if self.graph_ops(x.track_op() || weight.track_op()) {
            grad::rms_norm(x, weight, eps)?
        } else {
            kernels::rms_norm(x, weight, eps)?
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

    /// Several completions of one prompt in one pass: the prompt once, and every
    /// completion after it, each seeing the prompt's keys and values (while training,
    /// gradients reach the shared prompt from each). Returns the logits that predict
    /// every completion token, `[1 + Σ (len − 1), vocab]`: row 0 is the prompt's last
    /// position, which predicts every completion's first token, then the rows of each
    /// completion's tokens but its last, completion after completion. The rows stay
    /// one tensor so that a loss reads them once (a slice per completion would each
    /// pass back a vocabulary-wide gradient of all the rows).
    pub fn forward_completions(&self, prompt: &[u32], completions: &[&[u32]]) -> Result<Tensor> {
        let mut prompt_cache = self.new_cache();
        let longer: Vec<&[u32]> = completions
            .iter()
            .copied()
            .filter(|c| c.len() > 1)
            .collect();
        // Continuations of the prompt's cache, which the pass fills layer by layer
        // from the prompt's as it goes.
        let mut caches: Vec<SeqCache> = longer
            .iter()
            .map(|_| SeqCache {
                len: prompt.len(),
                ..self.new_cache()
            })
            .collect();
        let mut batch = Vec::with_capacity(1 + longer.len());
        batch.push(SeqInput {
            cache: &mut prompt_cache,
            tokens: prompt,
            logits: Logits::Last,
        });
        for (cache, c) in caches.iter_mut().zip(&longer) {
            batch.push(SeqInput {
                cache,
                tokens: &c[..c.len() - 1],
                logits: Logits::All,
            });
        }
        Ok(self.forward_joined(&mut batch, None, true)?.0)
    }

    /// For each token of each completion, in order, the row of
    /// [`Model::forward_completions`]'s logits that predicts it: 0 for every first
    /// token, then each completion's own rows.
    pub fn completion_rows(completions: &[&[u32]]) -> Vec<usize> {
        let mut rows = Vec::with_capacity(completions.iter().map(|c| c.len()).sum());
        let mut next = 1;
        for c in completions {
            if c.is_empty() {
                continue;
            }
            rows.push(0);
            rows.extend(next..next + c.len() - 1);
            next += c.len() - 1;
        }
        rows
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
        let (logits, counts) = self.forward_joined(batch, observer, false)?;
        let mut out = Vec::with_capacity(counts.len());
        let mut at = 0;
        for count in counts {
            out.push(logits.narrow(0, at, count)?);
            at += count;
        }
        Ok(out)
    }

    /// [`Model::forward_observed`] with the logits of all sequences in one tensor,
    /// sequence after sequence, and the number of rows of each. With `shared_prefix`,
    /// the first sequence is a prefix of all the others: their caches hold nothing
    /// yet but count its positions, and each layer gives them its keys and values.
    fn forward_joined(
        &self,
        batch: &mut [SeqInput<'_>],
        observer: Option<&mut MatmulObserver<'_>>,
        shared_prefix: bool,
    ) -> Result<(Tensor, Vec<usize>)> {
        // The kernels split work with rayon. Called from outside rayon's pool, every
        // kernel call would hand its work to the pool and sleep until it is done
        // (hundreds of context switches per token); running the whole pass on a pool
        // thread lets the kernels run inline there and fan out only when they can.
        // Inside, a team of spinning threads runs the kernels' parallel regions
        // (`kernels::team`): the pass's hundreds of short regions would otherwise each
        // wake a sleeping rayon worker. Not for float weights: their products (gemm)
        // and the training operations split their work with rayon, so a team's helper
        // would only spin beside rayon's workers, taking a core from them (the
        // learner's forward pass ran 1.6× longer with it on two cores).
        let pass = || match self.form {
            WeightForm::Quantized => {
                kernels::team::with_team(|| self.forward_in_pool(batch, observer, shared_prefix))
            }
            WeightForm::Dense(_) => self.forward_in_pool(batch, observer, shared_prefix),
        };
        if rayon::current_thread_index().is_some() {
            pass()
        } else {
            rayon::scope(|_| pass())
        }
    }

    fn forward_in_pool(
        &self,
        batch: &mut [SeqInput<'_>],
        mut observer: Option<&mut MatmulObserver<'_>>,
        shared_prefix: bool,
    ) -> Result<(Tensor, Vec<usize>)> {
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
            let attn = if self.graph_ops(q.track_op() || k.track_op() || v.track_op()) {
                self.attention_graph(layer, block, batch, shared_prefix, &q, &k, &v, scale as f32)?
            } else {
                self.attention_fast(layer, block, batch, shared_prefix, &q, &k, &v, scale as f32)?
            };

            observe(layer, &["attn_output"], &attn)?;
            x = residual(&x, &block.o.forward(&attn)?)?;
            let h = self.rms_norm(&x, &block.ffn_norm)?;
            observe(layer, &["ffn_gate", "ffn_up"], &h)?;
            let [gate, up] = Linear::forward_many([&block.gate, &block.up], &h)?;
            let act = if self.graph_ops(gate.track_op() || up.track_op()) {
                grad::silu_mul(&gate, &up)?
            } else {
                kernels::silu_mul(&gate, &up)?
            };
            observe(layer, &["ffn_down"], &act)?;
            x = residual(&x, &block.down.forward(&act)?)?;
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
        Ok((logits, counts))
    }

    /// Attention while training: per-head norms, rotary embedding and the attention of
    /// the whole batch as fused differentiable operations ([`grad`]). Each sequence sees
    /// its cached positions (the autograd segments of earlier calls, shared between
    /// forks of one prefix, or constants when an earlier call kept no graph) and its
    /// new ones causally.
    #[expect(clippy::too_many_arguments, reason = "one layer's attention inputs")]
    fn attention_graph(
        &self,
        layer: usize,
        block: &Block,
        batch: &mut [SeqInput<'_>],
        shared_prefix: bool,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        scale: f32,
    ) -> Result<Tensor> {
        let cfg = &self.config;
        let (heads, kv_heads, hd) = (cfg.heads, cfg.kv_heads, cfg.head_dim);
        let eps = cfg.rms_eps as f32;
        let dtype = q.dtype();
        let rows = q.dim(0)?;
        // Without gradients the cache keeps values only, and the past is read from them.
        let keep_graph = q.track_op() || k.track_op() || v.track_op();
        let (mut q, mut k) = (q.to_dtype(DType::F32)?, k.to_dtype(DType::F32)?);
        let v = v.to_dtype(DType::F32)?;
        if let Some(w) = &block.q_norm {
            q = grad::rms_norm(&q.reshape((rows * heads, hd))?, w, eps)?
                .reshape((rows, heads * hd))?;
        }
        if let Some(w) = &block.k_norm {
            k = grad::rms_norm(&k.reshape((rows * kv_heads, hd))?, w, eps)?
                .reshape((rows, kv_heads * hd))?;
        }
        let positions: Vec<usize> = batch
            .iter()
            .flat_map(|item| item.cache.len..item.cache.len + item.tokens.len())
            .collect();
        let q = grad::rope(&q, &positions, hd, &self.rope)?;
        let k = grad::rope(&k, &positions, hd, &self.rope)?;

        // Key rows: every distinct past segment once, then this call's rows.
        let mut keys: Vec<Tensor> = Vec::new();
        let mut vals: Vec<Tensor> = Vec::new();
        let mut placed: Vec<(candle_core::TensorId, usize)> = Vec::new();
        let mut key_rows = 0;
        let mut items = Vec::with_capacity(batch.len());
        let mut pasts = Vec::with_capacity(batch.len());
        let mut offset = 0;
        for (i, item) in batch.iter().enumerate() {
            let n = item.tokens.len();
            let start = item.cache.len;
            let segments: Vec<(Tensor, Tensor)> = match item.cache.graph.get(layer) {
                // A continuation of the first sequence: its past is set below.
                _ if shared_prefix && i > 0 => Vec::new(),
                // Segments that cover the whole past (a pass without gradients
                // since then added values only).
                Some(segments) if segment_rows(segments)? == start => segments.clone(),
                _ if start > 0 => {
                    let (pk, pv) = &item.cache.raw[layer];
                    let width = kv_heads * hd;
                    vec![(
                        Tensor::from_slice(&pk[..start * width], (start, width), &self.device)?,
                        Tensor::from_slice(&pv[..start * width], (start, width), &self.device)?,
                    )]
                }
                _ => Vec::new(),
            };
            let mut past = Vec::with_capacity(segments.len());
            for (sk, sv) in &segments {
                let len = sk.dim(0)?;
                let at = match placed.iter().find(|(id, _)| *id == sk.id()) {
                    Some(&(_, at)) => at,
                    None => {
                        placed.push((sk.id(), key_rows));
                        keys.push(sk.to_dtype(DType::F32)?);
                        vals.push(sv.to_dtype(DType::F32)?);
                        key_rows += len;
                        key_rows - len
                    }
                };
                past.push((at, len));
            }
            pasts.push(segments);
            items.push(grad::AttentionItem {
                q_start: offset,
                n,
                past,
                own: offset,
            });
            offset += n;
        }
        for item in &mut items {
            item.own += key_rows;
        }
        if shared_prefix && let Some((prefix, rest)) = items.split_first_mut() {
            let mut past = prefix.past.clone();
            past.push((prefix.own, prefix.n));
            for item in rest {
                item.past = past.clone();
            }
        }
        let (k_all, v_all) = if keys.is_empty() {
            (k.clone(), v.clone())
        } else {
            keys.push(k.clone());
            vals.push(v.clone());
            (Tensor::cat(&keys, 0)?, Tensor::cat(&vals, 0)?)
        };
        let shape = grad::AttentionShape {
            heads,
            kv_heads,
            head_dim: hd,
            scale,
        };
        let out = grad::attention(&q, &k_all, &v_all, items, shape)?;

        // The caches: this call's keys and values as a segment of the graph, and
        // their values for a continuation without gradients.
        let (kr, vr): (Vec<f32>, Vec<f32>) =
            (k.flatten_all()?.to_vec1()?, v.flatten_all()?.to_vec1()?);
        let width = kv_heads * hd;
        let mut offset = 0;
        let mut prefix: Option<(Segments, RawKv)> = None;
        for (i, (item, mut segments)) in batch.iter_mut().zip(pasts).enumerate() {
            let n = item.tokens.len();
            let cache = &mut *item.cache;
            if let (true, Some((graph, raw))) = (i > 0, &prefix) {
                segments = graph.clone();
                cache.raw[layer] = raw.clone();
            }
            if keep_graph {
                // A cache that kept no graph so far starts its segments with its
                // constant past, as the keys above saw it.
                segments.push((k.narrow(0, offset, n)?, v.narrow(0, offset, n)?));
                if cache.graph.len() <= layer {
                    cache.graph.resize(layer + 1, Vec::new());
                }
                cache.graph[layer] = segments;
            }
            let (rk, rv) = &mut cache.raw[layer];
            rk.extend_from_slice(&kr[offset * width..(offset + n) * width]);
            rv.extend_from_slice(&vr[offset * width..(offset + n) * width]);
            offset += n;
            if shared_prefix && i == 0 {
                let graph = cache.graph.get(layer).cloned().unwrap_or_default();
                prefix = Some((graph, cache.raw[layer].clone()));
            }
        }
        Ok(out.to_dtype(dtype)?)
    }

    /// Attention with this crate's kernel: rotary, norms and attention in plain loops
    /// over the sequence's own f32 cache, identical whatever the batch.
    #[expect(clippy::too_many_arguments, reason = "one layer's attention inputs")]
    fn attention_fast(
        &self,
        layer: usize,
        block: &Block,
        batch: &mut [SeqInput<'_>],
        shared_prefix: bool,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        scale: f32,
    ) -> Result<Tensor> {
        let cfg = &self.config;
        let (heads, kv_heads, hd) = (cfg.heads, cfg.kv_heads, cfg.head_dim);
        let (q_dim, kv_dim) = (heads * hd, kv_heads * hd);
        let dtype = q.dtype();
        let mut q = q.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let k = k.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let v = v.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let q_norm = block
            .q_norm
            .as_ref()
            .map(|w| w.to_dtype(DType::F32)?.to_vec1::<f32>())
            .transpose()?;
        let k_norm = block
            .k_norm
            .as_ref()
            .map(|w| w.to_dtype(DType::F32)?.to_vec1::<f32>())
            .transpose()?;
        let eps = cfg.rms_eps as f32;
        let mut offset = 0;
        for i in 0..batch.len() {
            if shared_prefix && i > 0 {
                // A continuation of the first sequence: its keys and values so far.
                let prefix = batch[0].cache.raw[layer].clone();
                batch[i].cache.raw[layer] = prefix;
            }
            let item = &mut batch[i];
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
        }
        // Every sequence's queries against its cache, in one parallel region.
        let mut offset = 0;
        let items: Vec<kernels::Queries<'_>> = batch
            .iter()
            .map(|item| {
                let n = item.tokens.len();
                let (keys, values) = &item.cache.raw[layer];
                let queries = kernels::Queries {
                    q: &q[offset * q_dim..(offset + n) * q_dim],
                    k: keys,
                    v: values,
                    n,
                };
                offset += n;
                queries
            })
            .collect();
        let out = kernels::attention_batch(&items, heads, kv_heads, hd, scale);
        let rows = out.len() / q_dim;
        Ok(Tensor::from_vec(out, (rows, q_dim), &self.device)?.to_dtype(dtype)?)
    }

    /// Rotary embedding of one head at position `pos`, from the same tables as the
    /// training path.
    fn rope_in_place(&self, head: &mut [f32], pos: usize) {
        let half = head.len() / 2;
        grad::rotate(
            head,
            &self.rope.cos[pos * half..(pos + 1) * half],
            &self.rope.sin[pos * half..(pos + 1) * half],
            self.rope.layout,
            false,
        );
    }
}

/// `x + y` between layers: candle's, differentiable, when either carries gradients;
/// the same values split across the team otherwise.
fn residual(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    Ok(if x.track_op() || y.track_op() {
        (x + y)?
    } else {
        kernels::add(x, y)?
    })
}

/// Positions covered by a cache's autograd segments.
fn segment_rows(segments: &[(Tensor, Tensor)]) -> Result<usize> {
    let mut rows = 0;
    for (k, _) in segments {
        rows += k.dim(0)?;
    }
    Ok(rows)
}

/// RMS norm of one vector with weight `w`, as candle's fused kernel computes it.
fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let sum: f32 = x.iter().map(|v| v * v).sum();
    let scale = 1.0 / (sum / x.len() as f32 + eps).sqrt();
    for (v, w) in x.iter_mut().zip(w) {
        *v = *v * scale * w;
    }
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

    /// K-quant weights (Q4_K and Q6_K: what Q4_K_M files hold; Q2_K and Q3_K: what
    /// Q2_K and Q3_K_M files add) load on this crate's kernels (see [`has_kernel`]),
    /// hold the file's values, and layers of different types side by side (as q/k and
    /// v in a Q4_K_M layer) share one quantized input and give each layer's own bits.
    /// 12 rows: one group of 16 with 4 padding rows.
    #[test]
    fn k_quant_weights_as_fast_layers() {
        let device = Device::Cpu;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k.gguf");
        let (out, inp) = (12, 512);
        let w = Tensor::randn(0f32, 1.0, (out, inp), &device).unwrap();
        let tensors = [
            ("q4k.weight", QTensor::quantize(&w, GgmlDType::Q4K).unwrap()),
            ("q6k.weight", QTensor::quantize(&w, GgmlDType::Q6K).unwrap()),
            ("q2k.weight", QTensor::quantize(&w, GgmlDType::Q2K).unwrap()),
            ("q3k.weight", QTensor::quantize(&w, GgmlDType::Q3K).unwrap()),
        ];
        let refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (*n, t)).collect();
        let mut f = std::fs::File::create(&path).unwrap();
        candle_core::quantized::gguf_file::write(&mut f, &[], &refs).unwrap();
        drop(f);
        let mut file = GgufFile::open(&path).unwrap();
        let layers = ["q4k", "q6k", "q2k", "q3k"].map(|name| {
            let loaded = uncached(&mut file, name, WeightForm::Quantized, (out, inp));
            assert!(matches!(loaded, Linear::Fast { .. }), "{name}");
            loaded
        });
        for (layer, (name, q)) in layers.iter().zip(&tensors) {
            let want = q.dequantize(&device).unwrap();
            assert_eq!(rows(&layer.dense_weight().unwrap()), rows(&want), "{name}");
        }
        let x = Tensor::randn(0f32, 1.0, (3, inp), &device).unwrap();
        let all = [&layers[0], &layers[1], &layers[2], &layers[3]];
        for (many, layer) in Linear::forward_many(all, &x).unwrap().iter().zip(all) {
            assert_eq!(rows(many), rows(&layer.forward(&x).unwrap()));
        }
    }

    /// Linear `name` of `file` (no bias), repacked without the repack cache.
    fn uncached(
        file: &mut GgufFile,
        name: &str,
        form: WeightForm,
        shape: (usize, usize),
    ) -> Linear {
        let off = RepackCache::off();
        let mut repacked = off.start(file);
        linear_from(file, &mut repacked, name, form, shape, false).unwrap()
    }

    /// IQ4_NL and IQ4_XS weights (which candle cannot read) load on this crate's
    /// kernels holding ggml's dequantized values, and in the dense form as those values.
    #[test]
    fn iq4_weights_load_fast_and_dense() {
        use crate::gguf::RawType;
        use crate::gguf::tests::{ggml_dequantize, sample, write_gguf};

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("iq4.gguf");
        let (out, inp) = (12, 512);
        let nl = sample(RawType::Iq4Nl, out, inp, 1);
        let xs = sample(RawType::Iq4Xs, out, inp, 2);
        write_gguf(
            &path,
            &[],
            &[
                ("nl.weight", 20, nl.dims.clone(), nl.data.clone()),
                ("xs.weight", 23, xs.dims.clone(), xs.data.clone()),
            ],
        );
        let mut file = GgufFile::open(&path).unwrap();
        for (name, raw) in [("nl", &nl), ("xs", &xs)] {
            let want = ggml_dequantize(raw);
            let fast = uncached(&mut file, name, WeightForm::Quantized, (out, inp));
            assert!(matches!(fast, Linear::Fast { .. }), "{name}");
            let dense = uncached(&mut file, name, WeightForm::Dense(DType::F32), (out, inp));
            assert!(matches!(dense, Linear::Dense { .. }), "{name}");
            for layer in [&fast, &dense] {
                let got: Vec<f32> = layer
                    .dense_weight()
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                assert_eq!(got, want, "{name}");
            }
        }
    }
}
