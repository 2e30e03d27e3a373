//! The GRPO family of policy losses, over per-token log-probabilities that carry
//! gradients. One function, [`policy_loss`], with the options users of TRL, verl and
//! Miles ask for: token or sequence importance ratios (GSPO), asymmetric clipping
//! (clip-higher), token-mean / sequence-mean / constant-length aggregation (DAPO,
//! GRPO, Dr. GRPO), a KL penalty to a reference policy with the k1/k2/k3 estimators,
//! and truncated importance sampling (TIS) for rollouts sampled from other weights.
//!
//! Notation: `π_θ` is the policy being trained (`logp`), `π_old` the same policy when
//! the batch was collected (`old_logp`; equal to a detached `logp` on the first pass
//! over a batch), `μ` the rollout engine's policy (`rollout_logp`: quantized weights,
//! another process), `π_ref` the reference policy of the KL term.

use candle_core::{D, DType, Result, Tensor};

/// How importance ratios are formed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Ratio {
    /// Per token: `r_t = π_θ(t) / π_old(t)` (PPO, GRPO, DAPO).
    #[default]
    Token,
    /// Per sequence, the geometric mean over its tokens:
    /// `s = exp(mean_t log r_t)` (GSPO).
    Sequence,
}

/// How per-token terms become one number.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Aggregation {
    /// Sum over every unmasked token of the batch / their count (DAPO, "token-level").
    #[default]
    TokenMean,
    /// Mean over each sequence's tokens, then over sequences (the original GRPO).
    SequenceMean,
    /// Sum over tokens / (sequences × this length) (Dr. GRPO: no length bias).
    Constant(usize),
}

/// The KL estimator (Schulman's k1, k2, k3), with `log ρ = log π_ref − log π_θ`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KlEstimator {
    /// `−log ρ`.
    K1,
    /// `½ (log ρ)²`.
    K2,
    /// `e^{log ρ} − 1 − log ρ` (low variance, never negative; `log ρ` clamped to ±10).
    K3,
}

impl KlEstimator {
    /// The estimator at each token, from `log ρ`.
    pub fn apply(self, log_rho: &Tensor) -> Result<Tensor> {
        match self {
            Self::K1 => log_rho.neg(),
            Self::K2 => log_rho.sqr()? * 0.5,
            Self::K3 => {
                let l = log_rho.clamp(-10.0, 10.0)?;
                (l.exp()? - 1.0)? - l
            }
        }
    }
}

/// The loss's options.
#[derive(Debug, Clone, PartialEq)]
pub struct LossConfig {
    /// Token or sequence ratios.
    pub ratio: Ratio,
    /// `ε_low`: ratios below `1 − ε_low` are clipped (0.2; GSPO uses ~3e-4).
    pub eps_low: f64,
    /// `ε_high`: ratios above `1 + ε_high` are clipped (0.2; clip-higher uses 0.28).
    pub eps_high: f64,
    /// Aggregation.
    pub aggregation: Aggregation,
    /// A KL penalty in the loss: estimator and coefficient `β`.
    pub kl: Option<(KlEstimator, f64)>,
    /// Truncated importance sampling: each token is weighted by
    /// `min(π_old / μ, cap)` when rollout log-probabilities are given.
    pub tis_cap: Option<f64>,
    /// Masked importance sampling: tokens whose `π_old / μ` falls outside
    /// `[low, high]` are weighted 0 (they still count in the token-mean's
    /// denominator, as a rejected token does), when rollout log-probabilities are given.
    pub is_mask: Option<(f64, f64)>,
}

impl Default for LossConfig {
    fn default() -> Self {
        Self {
            ratio: Ratio::Token,
            eps_low: 0.2,
            eps_high: 0.2,
            aggregation: Aggregation::TokenMean,
            kl: None,
            tis_cap: None,
            is_mask: None,
        }
    }
}

/// One sampled completion, as the loss sees it. Every vector has one entry per
/// completion token.
#[derive(Debug, Clone)]
pub struct SampleTerms {
    /// `log π_θ` of each token, with gradient, `[T]`.
    pub logp: Tensor,
    /// `log π_old` (no gradient); `None` means `logp` itself, detached (the first
    /// and usually only pass over a batch).
    pub old_logp: Option<Vec<f32>>,
    /// `log μ` from the rollout engine, for TIS.
    pub rollout_logp: Option<Vec<f32>>,
    /// `log π_ref`, for the KL term.
    pub ref_logp: Option<Vec<f32>>,
    /// The advantage of each token (the sequence's advantage repeated, plus any
    /// per-token shaping such as on-policy distillation's reverse KL).
    pub advantages: Vec<f32>,
    /// 1 for tokens that are trained, 0 for the rest (tool output, truncated samples).
    pub mask: Vec<f32>,
}

/// Metrics of one loss evaluation.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LossMetrics {
    /// Fraction of trained tokens (or sequences, for GSPO) whose ratio was clipped.
    pub clip_fraction: f64,
    /// Mean KL estimate over trained tokens (0 without a KL term).
    pub kl: f64,
    /// Mean `|log π_old − log μ|` over trained tokens: the train/rollout mismatch.
    pub rollout_mismatch: f64,
    /// Fraction of trained tokens that masked importance sampling weighted 0.
    pub is_masked: f64,
    /// Trained tokens.
    pub tokens: usize,
}

fn vector(values: &[f32], like: &Tensor) -> Result<Tensor> {
    Tensor::from_slice(values, values.len(), like.device())?.to_dtype(like.dtype())
}

/// `min(r·A, clip(r, 1−ε_low, 1+ε_high)·A)` elementwise, and how many were clipped.
fn clipped_objective(
    ratio: &Tensor,
    advantages: &Tensor,
    config: &LossConfig,
) -> Result<(Tensor, Tensor)> {
    let clipped = ratio.clamp(1.0 - config.eps_low, 1.0 + config.eps_high)?;
    let unclipped_term = (ratio * advantages)?;
    let clipped_term = (&clipped * advantages)?;
    let objective = unclipped_term.minimum(&clipped_term)?;
    // A token counts as clipped when the clipped term is the smaller one and differs.
    let was_clipped = clipped_term.lt(&unclipped_term)?.to_dtype(ratio.dtype())?;
    Ok((objective, was_clipped))
}

/// The policy loss (to minimise) over a batch, and its metrics.
///
/// Token ratios: `−min(r_t·A_t, clip(r_t)·A_t)` per token (times the TIS weight),
/// aggregated as configured. Sequence ratios (GSPO): `−min(s·A, clip(s)·A)` per
/// sequence, averaged over sequences, with `A` the mean of its tokens' advantages and
/// TIS weighting by the mean of its tokens' weights. The KL term is per token and
/// follows the aggregation.
pub fn policy_loss(samples: &[SampleTerms], config: &LossConfig) -> Result<(Tensor, LossMetrics)> {
    assert!(!samples.is_empty(), "a loss needs at least one sample");
    let n = samples.len() as f64;
    let mut token_sums: Vec<(Tensor, f64)> = Vec::with_capacity(samples.len());
    let mut sequence_terms: Vec<Tensor> = Vec::new();
    let (mut clipped, mut kl_sum, mut mismatch_sum, mut total_tokens) = (0.0, 0.0, 0.0, 0.0);
    let mut masked_sum = 0.0;
    let scalar =
        |t: &Tensor| -> Result<f64> { t.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>() };
    for s in samples {
        let t = s.logp.dim(0)?;
        assert!(
            s.advantages.len() == t && s.mask.len() == t,
            "advantages and mask need one entry per token"
        );
        let mask = vector(&s.mask, &s.logp)?;
        let n_tokens: f64 = s.mask.iter().map(|&m| f64::from(m)).sum();
        total_tokens += n_tokens;
        let old = match &s.old_logp {
            Some(old) => vector(old, &s.logp)?,
            None => s.logp.detach(),
        };
        let log_ratio = (&s.logp - &old)?;
        let advantages = vector(&s.advantages, &s.logp)?;
        // TIS weights min(π_old / μ, cap), times 0 outside the MIS interval: constants.
        let tis = match &s.rollout_logp {
            Some(mu) => {
                let diff = (&old - vector(mu, &s.logp)?)?;
                mismatch_sum += scalar(&(diff.abs()? * &mask)?)?;
                let ratio = diff.exp()?.detach();
                let mut weight = match config.tis_cap {
                    Some(cap) => Some(ratio.clamp(0.0, cap)?),
                    None => None,
                };
                if let Some((low, high)) = config.is_mask {
                    let keep = (ratio.ge(low)?.to_dtype(ratio.dtype())?
                        * ratio.le(high)?.to_dtype(ratio.dtype())?)?;
                    masked_sum += n_tokens - scalar(&(&keep * &mask)?)?;
                    weight = Some(match weight {
                        Some(w) => (w * keep)?,
                        None => keep,
                    });
                }
                weight
            }
            None => None,
        };
        let mut per_token: Option<Tensor> = None;
        match config.ratio {
            Ratio::Token => {
                let (objective, was_clipped) =
                    clipped_objective(&log_ratio.exp()?, &advantages, config)?;
                clipped += scalar(&(was_clipped * &mask)?)?;
                let mut loss = objective.neg()?;
                if let Some(tis) = &tis {
                    loss = (loss * tis)?;
                }
                per_token = Some(loss);
            }
            Ratio::Sequence => {
                let count = n_tokens.max(1.0);
                let mean = |x: &Tensor| -> Result<Tensor> {
                    ((x * &mask)?.sum_all()? / count)?.reshape(1)
                };
                let (objective, was_clipped) =
                    clipped_objective(&mean(&log_ratio)?.exp()?, &mean(&advantages)?, config)?;
                clipped += scalar(&was_clipped)?;
                let mut loss = objective.neg()?;
                if let Some(tis) = &tis {
                    loss = (loss * mean(tis)?)?;
                }
                sequence_terms.push(loss.sum_all()?);
            }
        }
        if let (Some((estimator, beta)), Some(reference)) = (config.kl, &s.ref_logp) {
            let kl = estimator.apply(&(vector(reference, &s.logp)? - &s.logp)?)?;
            kl_sum += scalar(&(kl.detach() * &mask)?)?;
            let kl = (kl * beta)?;
            per_token = Some(match per_token {
                Some(p) => (p + kl)?,
                None => kl,
            });
        }
        if let Some(p) = per_token {
            token_sums.push(((p * &mask)?.sum_all()?, n_tokens));
        }
    }
    let mut parts: Vec<Tensor> = Vec::new();
    if !token_sums.is_empty() {
        let terms: Vec<Tensor> = match config.aggregation {
            Aggregation::TokenMean => token_sums
                .iter()
                .map(|(sum, _)| sum / total_tokens.max(1.0))
                .collect::<Result<_>>()?,
            Aggregation::SequenceMean => token_sums
                .iter()
                .map(|(sum, count)| sum / (count.max(1.0) * n))
                .collect::<Result<_>>()?,
            Aggregation::Constant(length) => token_sums
                .iter()
                .map(|(sum, _)| sum / (n * length.max(1) as f64))
                .collect::<Result<_>>()?,
        };
        parts.push(Tensor::stack(&terms, 0)?.sum_all()?);
    }
    if !sequence_terms.is_empty() {
        parts.push((Tensor::stack(&sequence_terms, 0)?.sum_all()? / n)?);
    }
    let loss = match parts.len() {
        1 => parts.remove(0),
        _ => (&parts[0] + &parts[1])?,
    };
    let denominator = total_tokens.max(1.0);
    let metrics = LossMetrics {
        clip_fraction: match config.ratio {
            Ratio::Token => clipped / denominator,
            Ratio::Sequence => clipped / n,
        },
        kl: kl_sum / denominator,
        rollout_mismatch: mismatch_sum / denominator,
        is_masked: masked_sum / denominator,
        tokens: total_tokens as usize,
    };
    Ok((loss, metrics))
}

/// `log softmax(logits)[token]` for each row: `[T, vocab]`, `[T]` → `[T]`.
///
/// For f32 logits on the CPU (the learner's) this is one fused operation: a pass per
/// row for its log-normalizer, and in the backward pass one more writing
/// `g·(onehot − softmax)`. Built from candle's operations instead, it made and read a
/// handful of `[T, vocab]` tensors each way (`vocab` is 49,152 for SmolLM2).
pub fn token_logprobs(logits: &Tensor, tokens: &[u32]) -> Result<Tensor> {
    let rows: Vec<usize> = (0..tokens.len()).collect();
    let (n, _) = logits.dims2()?;
    if tokens.len() != n {
        candle_core::bail!("{} tokens for {n} rows of logits", tokens.len());
    }
    token_logprobs_at(logits, &rows, tokens)
}

/// `log softmax(logits[rows[i]])[tokens[i]]` for each `i`: `[R, vocab]` → `[T]`. A row
/// may be read for several tokens (the row that predicts every completion's first
/// token); its gradient is then the sum of theirs.
pub fn token_logprobs_at(logits: &Tensor, rows: &[usize], tokens: &[u32]) -> Result<Tensor> {
    let (n, vocab) = logits.dims2()?;
    if tokens.len() != rows.len() {
        candle_core::bail!("{} tokens for {} rows", tokens.len(), rows.len());
    }
    if let Some(&bad) = rows.iter().find(|&&r| r >= n) {
        candle_core::bail!("row {bad} is outside the {n} rows of logits");
    }
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
        candle_core::bail!("token id {bad} is outside the vocabulary of {vocab}");
    }
    if logits.dtype() == DType::F32 && logits.device().is_cpu() {
        return logits
            .contiguous()?
            .apply_op1_arc(std::sync::Arc::new(Box::new(TokenLogprobs {
                rows: rows.to_vec(),
                tokens: tokens.to_vec(),
            })));
    }
    let rows: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
    let picked =
        logits.index_select(&Tensor::from_slice(&rows, rows.len(), logits.device())?, 0)?;
    let log_probs = candle_nn::ops::log_softmax(&picked, D::Minus1)?;
    let index = Tensor::from_slice(tokens, (tokens.len(), 1), logits.device())?;
    log_probs.gather(&index, D::Minus1)?.squeeze(D::Minus1)
}

/// `log Σ exp(row)`, summed in f64 after subtracting the row's maximum.
fn log_normalizer(row: &[f32]) -> f32 {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let sum: f64 = row.iter().map(|&x| f64::from((x - max).exp())).sum();
    max + sum.ln() as f32
}

/// [`token_logprobs_at`] as one operation with its own backward pass.
struct TokenLogprobs {
    rows: Vec<usize>,
    tokens: Vec<u32>,
}

impl candle_core::CustomOp1 for TokenLogprobs {
    fn name(&self) -> &'static str {
        "token-logprobs"
    }

    fn cpu_fwd(
        &self,
        storage: &candle_core::CpuStorage,
        layout: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        use rayon::prelude::*;
        let candle_core::CpuStorage::F32(data) = storage else {
            candle_core::bail!("token-logprobs takes f32 logits");
        };
        let Some((a, b)) = layout.contiguous_offsets() else {
            candle_core::bail!("token-logprobs takes contiguous logits");
        };
        let (_, vocab) = layout.shape().dims2()?;
        let data = &data[a..b];
        let out: Vec<f32> = self
            .rows
            .par_iter()
            .zip(&self.tokens)
            .map(|(&r, &t)| {
                let row = &data[r * vocab..(r + 1) * vocab];
                row[t as usize] - log_normalizer(row)
            })
            .collect();
        Ok((candle_core::CpuStorage::F32(out), self.rows.len().into()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        use rayon::prelude::*;
        let (rows, vocab) = arg.dims2()?;
        let g = grad_res.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        // Per row: Σ g over the tokens read from it (−Σg · softmax), plus g at each
        // token.
        let mut weight = vec![0f32; rows];
        for (&r, &g) in self.rows.iter().zip(&g) {
            weight[r] += g;
        }
        let mut out = vec![0f32; rows * vocab];
        agentstack_model::with_f32(arg, |data| {
            out.par_chunks_mut(vocab).enumerate().for_each(|(r, dst)| {
                if weight[r] == 0.0 {
                    return;
                }
                let row = &data[r * vocab..(r + 1) * vocab];
                let lse = log_normalizer(row);
                for (d, &x) in dst.iter_mut().zip(row) {
                    *d = -weight[r] * (x - lse).exp();
                }
            });
        })?;
        for ((&r, &t), &g) in self.rows.iter().zip(&self.tokens).zip(&g) {
            out[r * vocab + t as usize] += g;
        }
        Ok(Some(Tensor::from_vec(out, (rows, vocab), arg.device())?))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;

    /// Central differences agree with autodiff to this relative error (f64).
    const FD_TOLERANCE: f64 = 1e-6;
    const H: f64 = 1e-6;

    fn samples(values: &[Vec<f64>], config_has_ref: bool) -> (Vec<Var>, Vec<SampleTerms>) {
        let vars: Vec<Var> = values
            .iter()
            .map(|v| Var::from_slice(v, v.len(), &Device::Cpu).unwrap())
            .collect();
        let terms = vars
            .iter()
            .enumerate()
            .map(|(i, var)| {
                let t = values[i].len();
                let shift = |k: usize, s: f32| -> Vec<f32> {
                    (0..t)
                        .map(|j| values[i][j] as f32 + s * ((j + k) % 3) as f32 - 0.1)
                        .collect()
                };
                SampleTerms {
                    logp: var.as_tensor().clone(),
                    // Ratios spread around 1, some clipped at either end, none on a
                    // clip boundary (kinks have no derivative).
                    old_logp: Some(shift(i, 0.13)),
                    rollout_logp: Some(shift(i + 1, 0.05)),
                    ref_logp: config_has_ref.then(|| shift(i + 2, 0.21)),
                    advantages: (0..t)
                        .map(|j| if (i + j) % 2 == 0 { 0.7 } else { -1.3 })
                        .collect(),
                    mask: (0..t).map(|j| if j == 1 { 0.0 } else { 1.0 }).collect(),
                }
            })
            .collect();
        (vars, terms)
    }

    /// The loss written out with plain numbers, term by term, from the formulas.
    fn reference(values: &[Vec<f64>], terms: &[SampleTerms], config: &LossConfig) -> f64 {
        let n = values.len() as f64;
        let clip = |r: f64| r.clamp(1.0 - config.eps_low, 1.0 + config.eps_high);
        let objective = |r: f64, a: f64| (r * a).min(clip(r) * a);
        let total: f64 = terms
            .iter()
            .map(|t| t.mask.iter().map(|&m| f64::from(m)).sum::<f64>())
            .sum();
        let (mut token_part, mut sequence_part) = (0.0, 0.0);
        for (lp, t) in values.iter().zip(terms) {
            let f = |v: &Option<Vec<f32>>, j: usize| f64::from(v.as_ref().unwrap()[j]);
            let count: f64 = t.mask.iter().map(|&m| f64::from(m)).sum();
            let tis = |j: usize| {
                let w = (f(&t.old_logp, j) - f(&t.rollout_logp, j)).exp();
                let kept = match config.is_mask {
                    Some((low, high)) if w < low || w > high => 0.0,
                    _ => 1.0,
                };
                kept * config.tis_cap.map_or(1.0, |cap| w.min(cap))
            };
            let mut sum = 0.0;
            for (j, &lp_j) in lp.iter().enumerate() {
                let m = f64::from(t.mask[j]);
                let mut term = 0.0;
                if config.ratio == Ratio::Token {
                    let r = (lp_j - f(&t.old_logp, j)).exp();
                    term -= objective(r, f64::from(t.advantages[j])) * tis(j);
                }
                if let Some((estimator, beta)) = config.kl {
                    let l = f(&t.ref_logp, j) - lp_j;
                    term += beta
                        * match estimator {
                            KlEstimator::K1 => -l,
                            KlEstimator::K2 => 0.5 * l * l,
                            KlEstimator::K3 => l.exp() - 1.0 - l,
                        };
                }
                sum += m * term;
            }
            token_part += match config.aggregation {
                Aggregation::TokenMean => sum / total,
                Aggregation::SequenceMean => sum / (count * n),
                Aggregation::Constant(len) => sum / (n * len as f64),
            };
            if config.ratio == Ratio::Sequence {
                let mean = |g: &dyn Fn(usize) -> f64| {
                    (0..lp.len())
                        .map(|j| f64::from(t.mask[j]) * g(j))
                        .sum::<f64>()
                        / count
                };
                let s = mean(&|j| lp[j] - f(&t.old_logp, j)).exp();
                let a = mean(&|j| f64::from(t.advantages[j]));
                sequence_part -= objective(s, a) * mean(&tis) / n;
            }
        }
        token_part + sequence_part
    }

    fn check_gradients(config: &LossConfig) {
        let values = vec![
            vec![-1.2, -0.4, -2.3, -0.9, -1.7],
            vec![-0.3, -2.2, -1.1],
            vec![-0.8, -1.5, -0.2, -3.0],
        ];
        let has_ref = config.kl.is_some();
        let (vars, terms) = samples(&values, has_ref);
        let (loss, _) = policy_loss(&terms, config).unwrap();
        let expected = reference(&values, &terms, config);
        let got = loss.to_scalar::<f64>().unwrap();
        assert!(
            (got - expected).abs() < 1e-12,
            "{config:?}: loss {got}, formulas give {expected}"
        );
        let grads = loss.backward().unwrap();
        for (i, var) in vars.iter().enumerate() {
            let analytic: Vec<f64> = grads.get(var.as_tensor()).unwrap().to_vec1().unwrap();
            for j in 0..values[i].len() {
                let at = |delta: f64| -> f64 {
                    let mut shifted = values.clone();
                    shifted[i][j] += delta;
                    let (_, mut terms) = samples(&shifted, has_ref);
                    // The constants (old, rollout, reference) stay where they were.
                    let (_, base) = samples(&values, has_ref);
                    for (t, b) in terms.iter_mut().zip(base) {
                        t.old_logp = b.old_logp;
                        t.rollout_logp = b.rollout_logp;
                        t.ref_logp = b.ref_logp;
                    }
                    policy_loss(&terms, config)
                        .unwrap()
                        .0
                        .to_scalar::<f64>()
                        .unwrap()
                };
                let numeric = (at(H) - at(-H)) / (2.0 * H);
                let scale = numeric.abs().max(analytic[j].abs()).max(1e-3);
                assert!(
                    (numeric - analytic[j]).abs() / scale < FD_TOLERANCE,
                    "{config:?}: d loss / d logp[{i}][{j}]: autodiff {} vs finite differences {numeric}",
                    analytic[j]
                );
            }
        }
    }

    #[test]
    fn every_loss_matches_its_formulas_and_finite_differences() {
        let aggregations = [
            Aggregation::TokenMean,
            Aggregation::SequenceMean,
            Aggregation::Constant(8),
        ];
        for ratio in [Ratio::Token, Ratio::Sequence] {
            for aggregation in aggregations {
                for kl in [
                    None,
                    Some((KlEstimator::K1, 0.1)),
                    Some((KlEstimator::K2, 0.1)),
                    Some((KlEstimator::K3, 0.1)),
                ] {
                    for (tis_cap, is_mask) in [
                        (None, None),
                        (Some(2.0), None),
                        // The test's ratios π_old / μ span about 0.90–1.30: some
                        // tokens fall outside.
                        (None, Some((0.95, 1.2))),
                        (Some(1.1), Some((0.95, 1.2))),
                    ] {
                        check_gradients(&LossConfig {
                            ratio,
                            eps_low: 0.2,
                            eps_high: 0.28,
                            aggregation,
                            kl,
                            tis_cap,
                            is_mask,
                        });
                    }
                }
            }
        }
    }

    /// Masked importance sampling reports the share of trained tokens it zeroed: some
    /// of the test batch's, not all, and none without the interval.
    #[test]
    fn masked_importance_sampling_counts_the_tokens_it_masks() {
        let values = vec![vec![-1.2, -0.4, -2.3, -0.9, -1.7], vec![-0.3, -2.2, -1.1]];
        let (_, terms) = samples(&values, false);
        let masked = |is_mask| {
            let config = LossConfig {
                is_mask,
                ..LossConfig::default()
            };
            policy_loss(&terms, &config).unwrap().1.is_masked
        };
        let share = masked(Some((0.95, 1.2)));
        assert!(share > 0.0 && share < 1.0, "{share}");
        assert_eq!(masked(None), 0.0);
        assert_eq!(masked(Some((0.0, 100.0))), 0.0);
    }

    #[test]
    fn on_the_first_pass_the_gradient_is_the_advantage_weighted_score() {
        // With π_old = π_θ the ratio is 1 and d loss / d logp_t = −A_t / N.
        let var = Var::from_slice(&[-1.0f64, -2.0, -0.5], 3, &Device::Cpu).unwrap();
        let terms = [SampleTerms {
            logp: var.as_tensor().clone(),
            old_logp: None,
            rollout_logp: None,
            ref_logp: None,
            advantages: vec![1.0, -2.0, 0.5],
            mask: vec![1.0, 1.0, 1.0],
        }];
        let (loss, metrics) = policy_loss(&terms, &LossConfig::default()).unwrap();
        assert!(loss.to_scalar::<f64>().unwrap().abs() < 1e-12 + 0.5_f64.abs());
        let grad: Vec<f64> = loss
            .backward()
            .unwrap()
            .get(var.as_tensor())
            .unwrap()
            .to_vec1()
            .unwrap();
        for (g, a) in grad.iter().zip([1.0, -2.0, 0.5]) {
            assert!((g + a / 3.0).abs() < 1e-12, "{grad:?}");
        }
        assert_eq!(metrics.clip_fraction, 0.0);
    }

    #[test]
    fn kl_estimators_agree_with_their_formulas() {
        let log_rho = Tensor::new(&[-0.5f64, 0.0, 0.3], &Device::Cpu).unwrap();
        let k: Vec<Vec<f64>> = [KlEstimator::K1, KlEstimator::K2, KlEstimator::K3]
            .iter()
            .map(|e| e.apply(&log_rho).unwrap().to_vec1().unwrap())
            .collect();
        for (j, l) in [-0.5f64, 0.0, 0.3].into_iter().enumerate() {
            assert!((k[0][j] + l).abs() < 1e-12);
            assert!((k[1][j] - 0.5 * l * l).abs() < 1e-12);
            assert!((k[2][j] - (l.exp() - 1.0 - l)).abs() < 1e-12);
            assert!(k[2][j] >= 0.0);
        }
    }

    #[test]
    fn token_logprobs_fused_matches_log_softmax_in_value_and_gradient() {
        use candle_core::Var;
        let (rows, vocab) = (5, 300);
        let values: Vec<f32> = (0..rows * vocab)
            .map(|i| ((i * 7919) % 1013) as f32 / 97.0 - 5.0)
            .collect();
        let tokens: Vec<u32> = (0..rows as u32).map(|r| r * 61 % vocab as u32).collect();
        let weights = Tensor::new(&[1.0f32, -2.0, 0.5, 3.0, -1.5], &Device::Cpu).unwrap();
        let x = Var::from_vec(values, (rows, vocab), &Device::Cpu).unwrap();
        let fused = token_logprobs(x.as_tensor(), &tokens).unwrap();
        let g_fused = (&fused * &weights)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let log_probs = candle_nn::ops::log_softmax(x.as_tensor(), D::Minus1).unwrap();
        let index = Tensor::from_slice(&tokens, (rows, 1), &Device::Cpu).unwrap();
        let plain = log_probs
            .gather(&index, D::Minus1)
            .unwrap()
            .squeeze(D::Minus1)
            .unwrap();
        let g_plain = (&plain * &weights)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let (a, b): (Vec<f32>, Vec<f32>) = (fused.to_vec1().unwrap(), plain.to_vec1().unwrap());
        for (a, b) in a.iter().zip(&b) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
        let grad = |g: &candle_core::backprop::GradStore| -> Vec<f32> {
            g.get(&x).unwrap().flatten_all().unwrap().to_vec1().unwrap()
        };
        let (ga, gb) = (grad(&g_fused), grad(&g_plain));
        for (a, b) in ga.iter().zip(&gb) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
        // A view into a larger tensor (a narrowed row range) reads the right rows.
        let narrowed =
            token_logprobs(&x.as_tensor().narrow(0, 2, 3).unwrap(), &tokens[2..]).unwrap();
        let n: Vec<f32> = narrowed.to_vec1().unwrap();
        assert_eq!(n, a[2..].to_vec());
        // Bad input is refused with a message.
        assert!(token_logprobs(x.as_tensor(), &tokens[1..]).is_err());
        assert!(token_logprobs(x.as_tensor(), &[0, 0, 0, 0, vocab as u32]).is_err());
    }

    #[test]
    fn token_logprobs_pick_each_rows_token() {
        let logits = Tensor::new(&[[0.0f32, 1.0, 2.0], [3.0, 0.0, 0.0]], &Device::Cpu).unwrap();
        let lp: Vec<f32> = token_logprobs(&logits, &[2, 0]).unwrap().to_vec1().unwrap();
        let z0 = (1f32 + 1f32.exp() + 2f32.exp()).ln();
        let z1 = (3f32.exp() + 2.0).ln();
        assert!((lp[0] - (2.0 - z0)).abs() < 1e-6 && (lp[1] - (3.0 - z1)).abs() < 1e-6);
    }
}
