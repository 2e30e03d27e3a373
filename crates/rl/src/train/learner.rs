//! One optimizer step of the adapters on a batch of samples.

use agentstack_model::Model;
use candle_core::{DType, Tensor};

use super::Sample;
use crate::lora::Lora;
use crate::loss::{Aggregation, LossConfig, SampleTerms, policy_loss};
use crate::optim::{Optim, accumulate};
use crate::policy::completion_logprobs_grouped;

/// The side that learns: the f32 base, the adapters on it, the optimizer.
pub(super) struct Learner {
    pub(super) base: Model,
    pub(super) reference: Option<Model>,
    pub(super) lora: Lora,
    pub(super) optim: Optim,
    pub(super) loss: LossConfig,
    pub(super) micro_batch: usize,
}

/// What one learning step produced.
#[derive(Debug, Default)]
pub(super) struct Learned {
    pub(super) loss: f64,
    pub(super) clip_fraction: f64,
    pub(super) kl: f64,
    pub(super) mismatch: f64,
    /// Fraction of trained tokens masked by MIS.
    pub(super) is_masked: f64,
    pub(super) tokens: usize,
    pub(super) grad_norm: f64,
    pub(super) lr: f64,
}

impl Learner {
    /// One optimizer step on `samples` with per-token `advantages` and `masks`;
    /// `sft` trains the plain log-likelihood instead of the policy loss.
    pub(super) fn step(
        &mut self,
        samples: &[Sample],
        advantages: &[Vec<f32>],
        masks: &[Vec<f32>],
        sft: bool,
    ) -> candle_core::Result<Learned> {
        let policy = self.lora.apply(&self.base)?;
        let vars = self.lora.vars();
        let mut sum: Vec<Option<Tensor>> = vec![None; vars.len()];
        let total_tokens: f64 = masks
            .iter()
            .flatten()
            .map(|&m| f64::from(m))
            .sum::<f64>()
            .max(1.0);
        let n = samples.len() as f64;
        let mut out = Learned::default();
        let (mut clipped, mut kl, mut mismatch, mut masked) = (0.0, 0.0, 0.0, 0.0);
        // Tokens of the chunks run through the model (the rollout mismatch's).
        let mut scored_tokens = 0.0;
        // Backward passes over runs of samples that share a prompt (a GRPO group): the
        // prompt runs once for all of them.
        let mut chunks: Vec<std::ops::Range<usize>> = Vec::new();
        for i in 0..samples.len() {
            match chunks.last_mut() {
                Some(c)
                    if c.len() < self.micro_batch
                        && samples[c.start].prompt == samples[i].prompt =>
                {
                    c.end = i + 1;
                }
                _ => chunks.push(i..i + 1),
            }
        }
        for range in chunks {
            // A chunk whose every advantage is 0 and that has no KL term adds exactly
            // nothing to the loss or its gradient (a GRPO group whose rewards are all
            // equal): it is not run.
            if !sft
                && self.reference.is_none()
                && advantages[range.clone()]
                    .iter()
                    .flatten()
                    .all(|&a| a == 0.0)
            {
                continue;
            }
            let offset = range.start;
            let chunk = &samples[range];
            let prompt = chunk[0].prompt.as_slice();
            let completions: Vec<&[u32]> = chunk.iter().map(|s| s.completion.as_slice()).collect();
            let logps = completion_logprobs_grouped(&policy, prompt, &completions)?;
            let chunk_masks = &masks[offset..offset + chunk.len()];
            let chunk_tokens: f64 = chunk_masks.iter().flatten().map(|&m| f64::from(m)).sum();
            let (loss, weight) = if sft {
                let mut total: Option<Tensor> = None;
                for (lp, mask) in logps.iter().zip(chunk_masks) {
                    let m = Tensor::from_slice(mask, mask.len(), lp.device())?;
                    let term = (lp * m)?.sum_all()?.neg()?;
                    total = Some(match total {
                        Some(t) => (t + term)?,
                        None => term,
                    });
                }
                let loss = (total.expect("a chunk has samples") / chunk_tokens.max(1.0))?;
                (loss, chunk_tokens / total_tokens)
            } else {
                let references: Option<Vec<Vec<f32>>> = match &self.reference {
                    Some(reference) => Some(
                        completion_logprobs_grouped(reference, prompt, &completions)?
                            .iter()
                            .map(|t| t.to_vec1::<f32>())
                            .collect::<candle_core::Result<_>>()?,
                    ),
                    None => None,
                };
                let terms: Vec<SampleTerms> = chunk
                    .iter()
                    .enumerate()
                    .map(|(i, s)| SampleTerms {
                        logp: logps[i].clone(),
                        old_logp: None,
                        rollout_logp: Some(s.logprobs.clone()),
                        ref_logp: references.as_ref().map(|r| r[i].clone()),
                        advantages: advantages[offset + i].clone(),
                        mask: chunk_masks[i].clone(),
                    })
                    .collect();
                let (loss, metrics) = policy_loss(&terms, &self.loss)?;
                let share = match self.loss.aggregation {
                    Aggregation::TokenMean => chunk_tokens / total_tokens,
                    _ => chunk.len() as f64 / n,
                };
                clipped += metrics.clip_fraction * share;
                kl += metrics.kl * share;
                mismatch += metrics.rollout_mismatch * chunk_tokens;
                masked += metrics.is_masked * chunk_tokens;
                scored_tokens += chunk_tokens;
                (loss, share)
            };
            let loss = (loss * weight)?;
            out.loss += loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            let grads = loss.backward()?;
            accumulate(&mut sum, &vars, &grads)?;
        }
        let report = self.optim.apply(&sum)?;
        out.clip_fraction = clipped;
        out.kl = kl;
        out.mismatch = mismatch / scored_tokens.max(1.0);
        out.is_masked = masked / scored_tokens.max(1.0);
        out.tokens = total_tokens as usize;
        out.grad_norm = report.grad_norm;
        out.lr = report.lr;
        Ok(out)
    }
}
