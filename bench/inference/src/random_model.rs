//! A random-weight ~1B llama-shape GGUF for the speed runs: speed does not depend on
//! the weights' values, so a file with SmolLM2's tokenizer and Llama-3.2-1B-like
//! shapes measures what a real 1B model would, without downloading one.
//!
//! Weights are F16 drawn from N(0, 0.02) with a fixed seed (every chunk of every
//! tensor has its own stream, so the file is the same whatever the thread count),
//! norms are 1, the embedding is tied (no `output.weight`), as in SmolLM2.

use std::path::Path;

use agentstack_quant::gguf::{self, Gguf, TensorSpec, Value};
use agentstack_quant::types::GgmlType;
use anyhow::{Context, Result, ensure};
use indicatif::ProgressBar;
use rayon::prelude::*;

/// The shape of the model.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// `llama.embedding_length`.
    pub hidden: u64,
    /// `llama.block_count`.
    pub layers: u64,
    /// `llama.feed_forward_length`.
    pub ffn: u64,
    /// `llama.attention.head_count`.
    pub heads: u64,
    /// `llama.attention.head_count_kv`.
    pub kv_heads: u64,
    /// `llama.rope.freq_base`.
    pub rope_theta: f32,
    /// `llama.attention.layer_norm_rms_epsilon`.
    pub rms_eps: f32,
    /// `llama.context_length`.
    pub context: u64,
}

/// Llama-3.2-1B's shape with SmolLM2's 49152-token vocabulary: about 1.07 B parameters.
pub const ONE_B: Shape = Shape {
    hidden: 2048,
    layers: 16,
    ffn: 8192,
    heads: 32,
    kv_heads: 8,
    rope_theta: 500_000.0,
    rms_eps: 1e-5,
    context: 8192,
};

/// Standard deviation of the weights.
const WEIGHT_STD: f64 = 0.02;
/// Seed of the weights; any fixed value does.
const WEIGHT_SEED: u64 = 0x1b_5eed_0000_0001;
/// Values per independently seeded chunk (also the unit of parallel work).
const CHUNK: usize = 1 << 20;

impl Shape {
    fn head_dim(&self) -> u64 {
        self.hidden / self.heads
    }

    /// The tensors in llama.cpp's order, `ne` row length first.
    fn tensors(&self, vocab: u64) -> Vec<TensorSpec> {
        let kv = self.kv_heads * self.head_dim();
        let spec = |name: String, dims: Vec<u64>| {
            let ty = if dims.len() == 1 {
                GgmlType::F32
            } else {
                GgmlType::F16
            };
            TensorSpec { name, dims, ty }
        };
        let mut tensors = vec![spec("token_embd.weight".into(), vec![self.hidden, vocab])];
        for i in 0..self.layers {
            let blk = |what: &str| format!("blk.{i}.{what}.weight");
            tensors.extend([
                spec(blk("attn_norm"), vec![self.hidden]),
                spec(blk("attn_q"), vec![self.hidden, self.hidden]),
                spec(blk("attn_k"), vec![self.hidden, kv]),
                spec(blk("attn_v"), vec![self.hidden, kv]),
                spec(blk("attn_output"), vec![self.hidden, self.hidden]),
                spec(blk("ffn_norm"), vec![self.hidden]),
                spec(blk("ffn_gate"), vec![self.hidden, self.ffn]),
                spec(blk("ffn_up"), vec![self.hidden, self.ffn]),
                spec(blk("ffn_down"), vec![self.ffn, self.hidden]),
            ]);
        }
        tensors.push(spec("output_norm.weight".into(), vec![self.hidden]));
        tensors
    }
}

/// Writes the model to `out` (atomically), its tokenizer copied from `tokenizer_from`
/// (every `tokenizer.*` key). Returns the file's size.
pub fn write(shape: &Shape, tokenizer_from: &Path, out: &Path, bar: &ProgressBar) -> Result<u64> {
    let source = Gguf::open(tokenizer_from)
        .with_context(|| format!("reading the tokenizer of {}", tokenizer_from.display()))?;
    let tokenizer: Vec<(String, Value)> = source
        .metadata
        .iter()
        .filter(|(key, _)| key.starts_with("tokenizer."))
        .cloned()
        .collect();
    let vocab = match source.get("tokenizer.ggml.tokens") {
        Some(Value::Array(_, tokens)) => tokens.len() as u64,
        _ => anyhow::bail!("{} has no tokenizer.ggml.tokens", tokenizer_from.display()),
    };
    ensure!(vocab > 0, "the tokenizer has no tokens");
    let u32_of = |x: u64| Value::U32(u32::try_from(x).unwrap_or(u32::MAX));
    let mut metadata: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String("llama".into())),
        (
            "general.name".into(),
            Value::String("random-llama-1B (random weights, speed runs only)".into()),
        ),
        ("general.file_type".into(), Value::U32(1)),
        ("llama.vocab_size".into(), u32_of(vocab)),
        ("llama.context_length".into(), u32_of(shape.context)),
        ("llama.embedding_length".into(), u32_of(shape.hidden)),
        ("llama.block_count".into(), u32_of(shape.layers)),
        ("llama.feed_forward_length".into(), u32_of(shape.ffn)),
        ("llama.attention.head_count".into(), u32_of(shape.heads)),
        (
            "llama.attention.head_count_kv".into(),
            u32_of(shape.kv_heads),
        ),
        ("llama.rope.freq_base".into(), Value::F32(shape.rope_theta)),
        (
            "llama.attention.layer_norm_rms_epsilon".into(),
            Value::F32(shape.rms_eps),
        ),
        (
            "llama.rope.dimension_count".into(),
            u32_of(shape.head_dim()),
        ),
    ];
    metadata.extend(tokenizer);

    let tensors = shape.tensors(vocab);
    let total: u64 = tensors.iter().map(|t| t.dims.iter().product::<u64>()).sum();
    bar.set_length(total);
    let size = gguf::write(out, &metadata, &tensors, |index| {
        let t = &tensors[index];
        let n = t.dims.iter().product::<u64>() as usize;
        let bytes = if t.ty == GgmlType::F32 {
            // Norms: 1.
            std::iter::repeat_n(1f32.to_le_bytes(), n)
                .flatten()
                .collect()
        } else {
            f16_normal(index as u64, n)
        };
        bar.inc(n as u64);
        Ok(bytes)
    })
    .with_context(|| format!("writing {}", out.display()))?;
    Ok(size)
}

/// `n` F16 values from N(0, [`WEIGHT_STD`]), little-endian, the same for the same
/// `stream` whatever the thread count.
fn f16_normal(stream: u64, n: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; n * 2];
    bytes
        .par_chunks_mut(CHUNK * 2)
        .enumerate()
        .for_each(|(chunk, out)| {
            let mut rng = SplitMix64(
                WEIGHT_SEED ^ stream.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (chunk as u64) << 32,
            );
            for pair in out.chunks_mut(4) {
                let (a, b) = rng.normal_pair();
                let a = half::f16::from_f64(a * WEIGHT_STD).to_le_bytes();
                let b = half::f16::from_f64(b * WEIGHT_STD).to_le_bytes();
                pair[..2].copy_from_slice(&a);
                if pair.len() == 4 {
                    pair[2..].copy_from_slice(&b);
                }
            }
        });
    bytes
}

/// SplitMix64, with Box-Muller for normal values.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A uniform value in (0, 1].
    fn uniform(&mut self) -> f64 {
        ((self.next() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    /// Two independent N(0, 1) values.
    fn normal_pair(&mut self) -> (f64, f64) {
        let r = (-2.0 * self.uniform().ln()).sqrt();
        let theta = std::f64::consts::TAU * self.uniform();
        (r * theta.cos(), r * theta.sin())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How far the sample mean and standard deviation of 2^20 values may be from the
    /// asked ones (a few standard errors).
    const MOMENT_TOLERANCE: f64 = 5e-4;

    #[test]
    fn one_b_has_about_a_billion_parameters() {
        let params: u64 = ONE_B
            .tensors(49_152)
            .iter()
            .map(|t| t.dims.iter().product::<u64>())
            .sum();
        assert!((1_000_000_000..1_100_000_000).contains(&params), "{params}");
        assert_eq!(ONE_B.head_dim(), 64);
    }

    #[test]
    fn weights_are_normal_with_the_asked_spread_and_reproducible() {
        let n = 1 << 20;
        let bytes = f16_normal(3, n);
        assert_eq!(bytes, f16_normal(3, n));
        assert_ne!(bytes[..64], f16_normal(4, n)[..64]);
        let values: Vec<f64> = bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f64())
            .collect();
        let mean = values.iter().sum::<f64>() / n as f64;
        let sd = (values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n as f64).sqrt();
        assert!(mean.abs() < MOMENT_TOLERANCE, "mean {mean}");
        assert!((sd - WEIGHT_STD).abs() < MOMENT_TOLERANCE, "sd {sd}");
    }
}
