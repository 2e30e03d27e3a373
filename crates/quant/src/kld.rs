//! KL divergence and perplexity of a model against a base model on the same text, with
//! the statistics and scored positions of `llama-perplexity --kl-divergence`: the text is
//! cut into chunks of `ctx` tokens (BOS first when the model adds one), and in each chunk
//! only the second half is scored (`ctx − 1 − ctx/2` tokens); the first half is context.

use std::path::{Path, PathBuf};

use agentstack_model::{LanguageModel, Logits, Model, SeqInput, WeightForm};
use serde::Serialize;

use crate::error::{QuantError, Result};
use crate::gguf::{self, Gguf, TensorSpec};
use crate::types::GgmlType;

/// Loads a GGUF file with the model runtime. Tensors of types candle cannot read (IQ4_NL,
/// IQ4_XS) are dequantized to f32 into a temporary copy first, so their values are
/// exactly the file's.
pub fn load_model(path: &Path) -> Result<LanguageModel> {
    let mut file = Gguf::open(path)?;
    if file.tensors.iter().all(|t| t.ty.candle_reads()) {
        return Ok(LanguageModel::load(path, WeightForm::Quantized)?);
    }
    let tmp = TempPath(std::env::temp_dir().join(format!(
        "agentstack-eval-{}-{}.gguf",
        std::process::id(),
        path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default()
    )));
    let specs: Vec<TensorSpec> = file
        .tensors
        .iter()
        .map(|t| TensorSpec {
            name: t.name.clone(),
            dims: t.dims.clone(),
            ty: if t.ty.candle_reads() {
                t.ty
            } else {
                GgmlType::F32
            },
        })
        .collect();
    let metadata = file.metadata.clone();
    gguf::write(&tmp.0, &metadata, &specs, |i| {
        if specs[i].ty == file.tensors[i].ty {
            file.read(i)
        } else {
            Ok(file
                .read_f32(i)?
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect())
        }
    })?;
    Ok(LanguageModel::load(&tmp.0, WeightForm::Quantized)?)
}

struct TempPath(PathBuf);

impl Drop for TempPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The chunks of `tokens` scored with context `ctx`, as llama-perplexity cuts them.
pub fn chunks(tokens: &[u32], ctx: usize, bos: Option<u32>) -> Result<Vec<Vec<u32>>> {
    if ctx < 4 {
        return Err(QuantError::Invalid(
            "the context must be at least 4 tokens".into(),
        ));
    }
    let n = tokens.len() / ctx;
    if n == 0 {
        return Err(QuantError::Invalid(format!(
            "the text has {} tokens, fewer than one chunk of {ctx}; give a longer text or a smaller --ctx",
            tokens.len()
        )));
    }
    Ok((0..n)
        .map(|c| {
            let mut chunk = tokens[c * ctx..(c + 1) * ctx].to_vec();
            if let Some(b) = bos {
                chunk[0] = b;
            }
            chunk
        })
        .collect())
}

/// Log-softmax rows for the scored positions of one chunk: row `i` is the distribution of
/// the token at `ctx/2 + i + 1`.
pub fn scored_log_probs(model: &Model, chunk: &[u32]) -> Result<Vec<Vec<f32>>> {
    let first = chunk.len() / 2;
    let mut cache = model.new_cache();
    model.forward(&mut [SeqInput {
        cache: &mut cache,
        tokens: &chunk[..first],
        logits: Logits::Last,
    }])?;
    let logits = model.forward(&mut [SeqInput {
        cache: &mut cache,
        tokens: &chunk[first..chunk.len() - 1],
        logits: Logits::All,
    }])?;
    let rows: Vec<Vec<f32>> = logits[0].to_vec2()?;
    Ok(rows
        .iter()
        .map(|r| agentstack_model::sampling::log_softmax(r))
        .collect())
}

/// KL(base ‖ other) of one position from the two log-probability rows, summed as
/// llama-perplexity sums it: over the tokens the base gives more than e^-16.
pub fn kld(base: &[f32], other: &[f32]) -> f64 {
    base.iter()
        .zip(other)
        .filter(|(pb, _)| **pb > -16.0)
        .map(|(&pb, &q)| f64::from(pb.exp()) * f64::from(pb - q))
        .sum()
}

/// Running sums over scored tokens, as llama-perplexity keeps them.
#[derive(Debug, Clone, Default)]
pub struct Accumulator {
    kld: Vec<f32>,
    p_diff: Vec<f32>,
    sum_nll: f64,
    sum_nll2: f64,
    sum_nll_base: f64,
    sum_nll_base2: f64,
    sum_nll_nll_base: f64,
    sum_kld: f64,
    sum_kld2: f64,
    sum_p_diff: f64,
    sum_p_diff2: f64,
    sum_p_diff4: f64,
    same_top: usize,
}

impl Accumulator {
    /// Adds one scored token: the base's and the other model's log-probabilities and the
    /// true next token.
    pub fn add(&mut self, base: &[f32], other: &[f32], token: u32) {
        let argmax = |v: &[f32]| {
            v.iter()
                .enumerate()
                .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &x)| {
                    if x > bv { (i, x) } else { (bi, bv) }
                })
                .0
        };
        let nll = -f64::from(other[token as usize]);
        let nll_base = -f64::from(base[token as usize]);
        let kld = kld(base, other);
        self.sum_nll += nll;
        self.sum_nll2 += nll * nll;
        self.sum_nll_base += nll_base;
        self.sum_nll_base2 += nll_base * nll_base;
        self.sum_nll_nll_base += nll * nll_base;
        self.sum_kld += kld;
        self.sum_kld2 += kld * kld;
        let p_diff = (-nll).exp() - (-nll_base).exp();
        self.sum_p_diff += p_diff;
        self.sum_p_diff2 += p_diff * p_diff;
        self.sum_p_diff4 += p_diff.powi(4);
        self.same_top += usize::from(argmax(base) == argmax(other));
        self.kld.push(kld as f32);
        self.p_diff.push(p_diff as f32);
    }

    /// Scored tokens so far.
    pub fn count(&self) -> usize {
        self.kld.len()
    }

    /// The statistics.
    pub fn stats(&self) -> KldStats {
        let n = self.count();
        let mean_unc = |sum: f64, sum2: f64| {
            if n == 0 {
                return (0.0, 0.0);
            }
            let f = sum / n as f64;
            let df = sum2 / n as f64 - f * f;
            (
                f,
                if df > 0.0 && n > 10 {
                    (df / (n as f64 - 1.0)).sqrt()
                } else {
                    0.0
                },
            )
        };
        let mut k = self.kld.clone();
        k.sort_by(f32::total_cmp);
        let mut p = self.p_diff.clone();
        p.sort_by(f32::total_cmp);
        let (log_ppl, log_ppl_unc) = mean_unc(self.sum_nll, self.sum_nll2);
        let (log_base, log_base_unc) = mean_unc(self.sum_nll_base, self.sum_nll_base2);
        let cov = if n >= 10 {
            (self.sum_nll_nll_base / n as f64
                - (self.sum_nll / n as f64) * (self.sum_nll_base / n as f64))
                / (n as f64 - 1.0)
        } else {
            0.0
        };
        let ln_ratio = log_ppl - log_base;
        let ln_ratio_unc = (log_ppl_unc.powi(2) + log_base_unc.powi(2) - 2.0 * cov)
            .max(0.0)
            .sqrt();
        let (kld_mean, kld_unc) = mean_unc(self.sum_kld, self.sum_kld2);
        let (mse, mse_unc) = mean_unc(self.sum_p_diff2, self.sum_p_diff4);
        let rms = mse.sqrt();
        let same = self.same_top as f64 / n.max(1) as f64;
        KldStats {
            tokens: n,
            ppl: log_ppl.exp(),
            ppl_unc: log_ppl.exp() * log_ppl_unc,
            ppl_base: log_base.exp(),
            ppl_base_unc: log_base.exp() * log_base_unc,
            ln_ppl_ratio: ln_ratio,
            ln_ppl_ratio_unc: ln_ratio_unc,
            ppl_ratio: ln_ratio.exp(),
            kld_mean,
            kld_unc,
            kld_max: k.last().copied().unwrap_or(0.0),
            kld_p999: percentile(&k, 0.999),
            kld_p99: percentile(&k, 0.99),
            kld_p95: percentile(&k, 0.95),
            kld_p90: percentile(&k, 0.90),
            kld_median: median(&k),
            delta_p_mean: mean_unc(self.sum_p_diff, self.sum_p_diff2).0,
            delta_p_rms: rms,
            delta_p_rms_unc: if rms > 0.0 { 0.5 / rms * mse_unc } else { 0.0 },
            same_top: same,
            same_top_unc: if n > 1 {
                (same * (1.0 - same) / (n as f64 - 1.0)).sqrt()
            } else {
                0.0
            },
            median_delta_p: median(&p),
        }
    }
}

fn percentile(v: &[f32], fraction: f32) -> f32 {
    if v.is_empty() {
        return 0.0;
    }
    let p = fraction * (v.len() - 1) as f32;
    let ip = p as usize;
    let f = p - ip as f32;
    (1.0 - f) * v[ip] + f * v[(ip + 1).min(v.len() - 1)]
}

fn median(v: &[f32]) -> f32 {
    match v.len() {
        0 => 0.0,
        n if n % 2 == 0 => 0.5 * (v[n / 2] + v[n / 2 - 1]),
        n => v[n / 2],
    }
}

/// What `llama-perplexity --kl-divergence` reports.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KldStats {
    /// Scored tokens.
    pub tokens: usize,
    /// Perplexity of the model compared.
    pub ppl: f64,
    /// Its uncertainty.
    pub ppl_unc: f64,
    /// Perplexity of the base.
    pub ppl_base: f64,
    /// Its uncertainty.
    pub ppl_base_unc: f64,
    /// Mean ln(PPL(Q)/PPL(base)).
    pub ln_ppl_ratio: f64,
    /// Its uncertainty.
    pub ln_ppl_ratio_unc: f64,
    /// PPL(Q)/PPL(base).
    pub ppl_ratio: f64,
    /// Mean KLD.
    pub kld_mean: f64,
    /// Its standard error.
    pub kld_unc: f64,
    /// Maximum KLD.
    pub kld_max: f32,
    /// 99.9th percentile.
    pub kld_p999: f32,
    /// 99th percentile.
    pub kld_p99: f32,
    /// 95th percentile.
    pub kld_p95: f32,
    /// 90th percentile.
    pub kld_p90: f32,
    /// Median KLD.
    pub kld_median: f32,
    /// Mean Δp (probability of the true token, other − base).
    pub delta_p_mean: f64,
    /// RMS of Δp.
    pub delta_p_rms: f64,
    /// Its uncertainty.
    pub delta_p_rms_unc: f64,
    /// Share of tokens whose most likely next token is the same.
    pub same_top: f64,
    /// Its binomial standard error.
    pub same_top_unc: f64,
    /// Median Δp.
    pub median_delta_p: f32,
}

/// Compares `other` against `base` on `tokens` (both models in memory; one chunk's
/// logits at a time). `progress(done, total)` after each chunk.
pub fn compare(
    base: &LanguageModel,
    other: &LanguageModel,
    tokens: &[u32],
    ctx: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<KldStats> {
    // The tokenizer adds BOS exactly when the model asks for it (then every chunk starts
    // with it, as in llama-perplexity).
    let adds_bos = !base.tokenizer().encode("", false)?.is_empty();
    let bos = base.tokenizer().bos().filter(|_| adds_bos);
    let chunks = chunks(tokens, ctx, bos)?;
    let mut acc = Accumulator::default();
    for (i, chunk) in chunks.iter().enumerate() {
        let b = scored_log_probs(base.model(), chunk)?;
        let o = scored_log_probs(other.model(), chunk)?;
        let first = ctx / 2;
        for (j, (rb, ro)) in b.iter().zip(&o).enumerate() {
            acc.add(rb, ro, chunk[first + j + 1]);
        }
        progress(i + 1, chunks.len());
    }
    Ok(acc.stats())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_models_have_zero_kld_and_full_agreement() {
        let mut acc = Accumulator::default();
        let lp = agentstack_model::sampling::log_softmax(&[1.0, 2.0, 0.5, -1.0]);
        for t in 0..20 {
            acc.add(&lp, &lp, t % 4);
        }
        let s = acc.stats();
        assert_eq!((s.kld_mean, s.same_top, s.delta_p_rms), (0.0, 1.0, 0.0));
        assert!((s.ppl - s.ppl_base).abs() < 1e-9);
    }

    #[test]
    fn kld_matches_the_formula_and_percentiles_interpolate() {
        let p = agentstack_model::sampling::log_softmax(&[0.0, 1.0]);
        let q = agentstack_model::sampling::log_softmax(&[1.0, 0.0]);
        let mut acc = Accumulator::default();
        acc.add(&p, &q, 1);
        let want: f64 = p
            .iter()
            .zip(&q)
            .map(|(a, b)| f64::from(a.exp()) * f64::from(a - b))
            .sum();
        assert!((acc.stats().kld_mean - want).abs() < 1e-6);
        assert_eq!(acc.stats().same_top, 0.0);
        assert_eq!(percentile(&[0.0, 1.0, 2.0, 3.0], 0.5), 1.5);
        assert_eq!(median(&[0.0, 1.0, 2.0, 3.0]), 1.5);
    }

    #[test]
    fn chunks_are_cut_like_llama_perplexity() {
        let t: Vec<u32> = (0..1100).collect();
        let c = chunks(&t, 512, Some(1)).unwrap();
        assert_eq!(c.len(), 2);
        assert_eq!((c[0][0], c[0][1], c[1][0], c[1][1]), (1, 1, 1, 513));
        assert!(
            chunks(&t[..100], 512, None)
                .unwrap_err()
                .to_string()
                .contains("--ctx")
        );
    }
}

/// The log-probabilities `llama-perplexity --kl-divergence-base` stored: context, the
/// tokens, and per chunk the scored rows (each a scale and minimum, then one u16 per
/// token of the vocabulary: `log p = scale·u + min`).
#[derive(Debug, Clone)]
pub struct LlamaBase {
    /// Tokens per chunk.
    pub ctx: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// All chunks' tokens.
    pub tokens: Vec<u32>,
    /// Per chunk, per scored position, the log-probabilities.
    pub rows: Vec<Vec<Vec<f32>>>,
}

impl LlamaBase {
    /// Reads a `--kl-divergence-base` file.
    pub fn read(path: &Path) -> Result<Self> {
        let b = std::fs::read(path).map_err(|source| QuantError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let bad = |r: &str| QuantError::Invalid(format!("{}: {r}", path.display()));
        if !b.starts_with(b"_logits_") || b.len() < 20 {
            return Err(bad("not a llama-perplexity --kl-divergence-base file"));
        }
        let u32_at =
            |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes")) as usize;
        let (ctx, vocab, n_chunk) = (u32_at(8), u32_at(12), u32_at(16));
        let mut at = 20;
        let need = at + 4 * ctx * n_chunk;
        if b.len() < need {
            return Err(bad("truncated token list"));
        }
        let tokens = (0..ctx * n_chunk)
            .map(|i| u32_at(at + 4 * i) as u32)
            .collect();
        at = need;
        let nv = 2 * vocab.div_ceil(2) + 4;
        let scored = ctx - 1 - ctx / 2;
        let mut rows = Vec::with_capacity(n_chunk);
        for _ in 0..n_chunk {
            let mut chunk = Vec::with_capacity(scored);
            for _ in 0..scored {
                let row = b
                    .get(at..at + 2 * nv)
                    .ok_or_else(|| bad("truncated log-probabilities"))?;
                let scale = f32::from_le_bytes(row[0..4].try_into().expect("4 bytes"));
                let min = f32::from_le_bytes(row[4..8].try_into().expect("4 bytes"));
                chunk.push(
                    row[8..8 + 2 * vocab]
                        .chunks_exact(2)
                        .map(|u| scale * f32::from(u16::from_le_bytes([u[0], u[1]])) + min)
                        .collect(),
                );
                at += 2 * nv;
            }
            rows.push(chunk);
        }
        Ok(Self {
            ctx,
            vocab,
            tokens,
            rows,
        })
    }
}
