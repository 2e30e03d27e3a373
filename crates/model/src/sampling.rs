//! Turning logits into the next token: penalties, temperature, top-k, top-p, min-p,
//! seeded sampling, and log-probabilities.

use rand::Rng;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

/// Largest number of alternatives returned per position (OpenAI allows 20).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// How to pick tokens. Defaults: temperature 1, everything else off.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingParams {
    /// 0 picks the most likely token (greedy); higher flattens the distribution.
    pub temperature: f32,
    /// Keep only the `k` most likely tokens (0: off).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `p` (1: off).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` × the top token's probability (0: off).
    pub min_p: f32,
    /// Divide positive logits (multiply negative ones) of tokens already seen (1: off).
    pub repetition_penalty: f32,
    /// Subtract `penalty × count` from the logits of generated tokens (0: off).
    pub frequency_penalty: f32,
    /// Subtract `penalty` from the logits of tokens generated at least once (0: off).
    pub presence_penalty: f32,
    /// Seed of the random generator; the same seed and inputs give the same tokens.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: None,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Checks every value is in range; the error names the field and the range.
    pub fn validate(&self) -> Result<()> {
        let fail = |field: &str, range: &str, value: String| {
            Err(ModelError::InvalidRequest(format!(
                "`{field}` must be {range}, got {value}"
            )))
        };
        if !(self.temperature.is_finite() && (0.0..=100.0).contains(&self.temperature)) {
            return fail(
                "temperature",
                "between 0 and 100",
                self.temperature.to_string(),
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return fail("top_p", "in (0, 1]", self.top_p.to_string());
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return fail("min_p", "in [0, 1]", self.min_p.to_string());
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty <= 10.0) {
            return fail(
                "repetition_penalty",
                "in (0, 10]",
                self.repetition_penalty.to_string(),
            );
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return fail(
                "frequency_penalty",
                "between -2 and 2",
                self.frequency_penalty.to_string(),
            );
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return fail(
                "presence_penalty",
                "between -2 and 2",
                self.presence_penalty.to_string(),
            );
        }
        Ok(())
    }
}

/// One token with its log-probability under the model.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    /// The token.
    pub id: u32,
    /// Natural-log probability from the model's raw logits (before penalties and
    /// temperature), so re-scoring the sequence reproduces it.
    pub logprob: f32,
}

/// What the sampler chose at one position.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    /// The chosen token and its log-probability.
    pub token: TokenLogprob,
    /// The most likely alternatives, best first (empty unless asked for).
    pub top: Vec<TokenLogprob>,
}

/// Samples the tokens of one sequence; holds its random state and token counts.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    counts: std::collections::HashMap<u32, u32>,
    seen: std::collections::HashSet<u32>,
}

impl Sampler {
    /// A sampler for one sequence. `prompt` tokens count as seen for the repetition
    /// penalty (as in llama.cpp and transformers), but not for frequency/presence
    /// penalties (as in OpenAI).
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Self {
        let rng = match params.seed {
            Some(seed) => ChaCha8Rng::seed_from_u64(seed),
            None => ChaCha8Rng::from_rng(&mut rand::rng()),
        };
        Self {
            params,
            rng,
            counts: Default::default(),
            seen: prompt.iter().copied().collect(),
        }
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Records a generated token (for the penalties).
    pub fn accept(&mut self, token: u32) {
        *self.counts.entry(token).or_default() += 1;
        self.seen.insert(token);
    }

    /// Picks the next token from one row of logits. `allowed`, when given, masks out
    /// every token it returns false for (grammar constraints). `top_n` alternatives
    /// are returned with log-probabilities.
    pub fn sample(
        &mut self,
        logits: &[f32],
        allowed: Option<&dyn Fn(u32) -> bool>,
        top_n: usize,
    ) -> Result<Sampled> {
        let normalizer = log_normalizer(logits);
        let mut work: Vec<f32> = logits.to_vec();
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            for &t in &self.seen {
                if let Some(l) = work.get_mut(t as usize) {
                    *l = if *l > 0.0 {
                        *l / p.repetition_penalty
                    } else {
                        *l * p.repetition_penalty
                    };
                }
            }
        }
        if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
            for (&t, &c) in &self.counts {
                if let Some(l) = work.get_mut(t as usize) {
                    *l -= p.frequency_penalty * c as f32 + p.presence_penalty;
                }
            }
        }
        if let Some(allowed) = allowed {
            for (i, l) in work.iter_mut().enumerate() {
                if !allowed(i as u32) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        let id = if p.temperature == 0.0 {
            argmax(&work)
        } else {
            self.draw(&mut work)
        }
        .ok_or_else(|| ModelError::InvalidRequest("no token is allowed at this position".into()))?;
        let top = if top_n > 0 {
            top_logprobs(&normalized(logits, normalizer), top_n)
        } else {
            Vec::new()
        };
        Ok(Sampled {
            token: TokenLogprob {
                id,
                logprob: logprob(logits[id as usize], normalizer),
            },
            top,
        })
    }

    fn draw(&mut self, work: &mut [f32]) -> Option<u32> {
        let p = &self.params;
        let t = p.temperature;
        if (p.top_k == 0 || p.top_k >= work.len()) && p.top_p >= 1.0 && p.min_p <= 0.0 {
            return self.draw_full(work);
        }
        let mut candidates: Vec<(u32, f32)> = work
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(i, &l)| (i as u32, l / t))
            .collect();
        if candidates.is_empty() {
            return None;
        }
        candidates.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 && candidates.len() > p.top_k {
            candidates.truncate(p.top_k);
        }
        let max = candidates[0].1;
        let mut probs: Vec<f32> = candidates.iter().map(|&(_, l)| (l - max).exp()).collect();
        let total: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|v| *v /= total);
        let mut keep = probs.len();
        if p.min_p > 0.0 {
            let floor = p.min_p * probs[0];
            keep = probs.iter().take_while(|&&v| v >= floor).count().max(1);
        }
        if p.top_p < 1.0 {
            let mut cumulative = 0.0;
            let mut n = 0;
            for &v in &probs[..keep] {
                cumulative += v;
                n += 1;
                if cumulative >= p.top_p {
                    break;
                }
            }
            keep = n.max(1);
        }
        let total: f32 = probs[..keep].iter().sum();
        let mut r = self.rng.random::<f32>() * total;
        for (i, &v) in probs[..keep].iter().enumerate() {
            if r < v {
                return Some(candidates[i].0);
            }
            r -= v;
        }
        Some(candidates[keep - 1].0)
    }

    /// A draw from the whole softmax (no top-k, top-p or min-p), in id order: without a
    /// cut there is nothing to sort, and sorting the vocabulary (49,152 ids for SmolLM2)
    /// for every token was the largest part of sampling.
    fn draw_full(&mut self, work: &mut [f32]) -> Option<u32> {
        let t = self.params.temperature;
        let max = work
            .iter()
            .copied()
            .filter(|l| l.is_finite())
            .fold(f32::NEG_INFINITY, f32::max);
        if !max.is_finite() {
            return None;
        }
        let mut total = 0f32;
        for l in work.iter_mut() {
            *l = if l.is_finite() {
                ((*l - max) / t).exp()
            } else {
                0.0
            };
            total += *l;
        }
        let mut r = self.rng.random::<f32>() * total;
        let mut last = None;
        for (i, &v) in work.iter().enumerate() {
            if v > 0.0 {
                if r < v {
                    return Some(i as u32);
                }
                r -= v;
                last = Some(i as u32);
            }
        }
        last
    }
}

/// Index of the largest finite value (the first one on ties), if any.
pub fn argmax(values: &[f32]) -> Option<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in values.iter().enumerate() {
        if v.is_finite() && best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map(|(i, _)| i as u32)
}

/// Natural-log softmax, computed in f64 for accuracy.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    normalized(logits, log_normalizer(logits))
}

/// Each logit's [`logprob`].
fn normalized(logits: &[f32], normalizer: (f32, f32)) -> Vec<f32> {
    logits.iter().map(|&l| logprob(l, normalizer)).collect()
}

/// A logit's log-probability `l − m − ln Σ`, from [`log_normalizer`]'s `(m, ln Σ)`.
fn logprob(l: f32, (max, log_sum): (f32, f32)) -> f32 {
    l - max - log_sum
}

/// The largest finite logit `m` and `ln Σ exp(l − m)` (summed in f64): a logit's
/// log-probability is `l − m − ln Σ`, bit for bit [`log_softmax`]'s, without the
/// vocabulary-sized vector when one or a few are wanted.
fn log_normalizer(logits: &[f32]) -> (f32, f32) {
    let max = logits
        .iter()
        .copied()
        .filter(|v| v.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    (max, sum.ln() as f32)
}

/// The `n` most likely tokens, best first (ties: lower id first).
pub fn top_logprobs(logprobs: &[f32], n: usize) -> Vec<TokenLogprob> {
    let mut indexed: Vec<(u32, f32)> = logprobs
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, l))
        .collect();
    let n = n.min(indexed.len());
    if n == 0 {
        return Vec::new();
    }
    indexed.select_nth_unstable_by(n - 1, |a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    indexed.truncate(n);
    indexed.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    indexed
        .into_iter()
        .map(|(id, logprob)| TokenLogprob { id, logprob })
        .collect()
}

/// Finds a loop at the end of `tokens`: a block of at most `max_period` tokens repeated
/// back to back at least `min_repeats` times, covering at least `min_span` tokens.
/// Returns the period.
pub fn detect_loop(
    tokens: &[u32],
    max_period: usize,
    min_repeats: usize,
    min_span: usize,
) -> Option<usize> {
    (1..=max_period).find(|&period| {
        let span = (period * min_repeats).max(min_span.div_ceil(period) * period);
        if span > tokens.len() {
            return false;
        }
        let tail = &tokens[tokens.len() - span..];
        tail.chunks_exact(period).all(|c| c == &tail[..period])
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut s = Sampler::new(SamplingParams::greedy(), &[]);
        let out = s.sample(&[0.0, 3.0, 3.0, 1.0], None, 2).unwrap();
        assert_eq!(out.token.id, 1);
        assert_eq!(out.top.iter().map(|t| t.id).collect::<Vec<_>>(), [1, 2]);
    }

    #[test]
    fn same_seed_same_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let params = SamplingParams {
            seed: Some(7),
            top_k: 20,
            top_p: 0.9,
            ..Default::default()
        };
        let run = || {
            let mut s = Sampler::new(params.clone(), &[]);
            (0..20)
                .map(|_| s.sample(&logits, None, 0).unwrap().token.id)
                .collect::<Vec<_>>()
        };
        assert_eq!(run(), run());
    }

    #[test]
    fn top_k_one_is_greedy() {
        let logits = [0.1, 0.5, 2.0, 0.3];
        let params = SamplingParams {
            top_k: 1,
            seed: Some(1),
            ..Default::default()
        };
        let mut s = Sampler::new(params, &[]);
        for _ in 0..10 {
            assert_eq!(s.sample(&logits, None, 0).unwrap().token.id, 2);
        }
    }

    #[test]
    fn mask_excludes_tokens() {
        let mut s = Sampler::new(SamplingParams::greedy(), &[]);
        let out = s.sample(&[5.0, 1.0, 0.0], Some(&|t| t != 0), 0).unwrap();
        assert_eq!(out.token.id, 1);
        // The logprob is the model's, not the masked distribution's.
        assert!((out.token.logprob - log_softmax(&[5.0, 1.0, 0.0])[1]).abs() < 1e-6);
    }

    #[test]
    fn invalid_values_are_named() {
        let bad = SamplingParams {
            top_p: 0.0,
            ..Default::default()
        };
        assert!(bad.validate().unwrap_err().to_string().contains("top_p"));
        let bad = SamplingParams {
            temperature: -1.0,
            ..Default::default()
        };
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("temperature")
        );
    }

    #[test]
    fn loops_are_found() {
        let mut t: Vec<u32> = vec![9, 8, 7];
        for _ in 0..10 {
            t.extend([1, 2, 3]);
        }
        assert_eq!(detect_loop(&t, 8, 4, 24), Some(3));
        assert_eq!(detect_loop(&[1, 2, 3, 4, 5, 6], 3, 2, 4), None);
    }

    /// Both ways of drawing (the whole softmax, and the sorted cut, here with a top-k of
    /// the four unmasked ids, which cuts nothing) follow the tempered softmax, and never
    /// give a masked token.
    #[test]
    fn draws_follow_the_tempered_softmax() {
        let logits = [1.0f32, 0.0, 2.0, -1.0, 0.5];
        let t = 0.7f32;
        let masked = 3u32;
        let exp: Vec<f64> = logits
            .iter()
            .enumerate()
            .map(|(i, l)| {
                if i as u32 == masked {
                    0.0
                } else {
                    f64::from((l / t).exp())
                }
            })
            .collect();
        let total: f64 = exp.iter().sum();
        for top_k in [0, 4] {
            let params = SamplingParams {
                temperature: t,
                top_k,
                seed: Some(3),
                ..Default::default()
            };
            let mut s = Sampler::new(params, &[]);
            let n = 40_000;
            let mut counts = [0usize; 5];
            for _ in 0..n {
                counts[s
                    .sample(&logits, Some(&|id| id != masked), 0)
                    .unwrap()
                    .token
                    .id as usize] += 1;
            }
            assert_eq!(counts[masked as usize], 0);
            for (i, &c) in counts.iter().enumerate() {
                let p = exp[i] / total;
                // Five standard errors of a binomial proportion.
                let tolerance = 5.0 * (p * (1.0 - p) / n as f64).sqrt();
                let seen = c as f64 / n as f64;
                assert!(
                    (seen - p).abs() <= tolerance,
                    "top_k {top_k}, id {i}: {seen} vs {p}"
                );
            }
        }
    }

    /// A sampled token's log-probability is its entry of the full log-softmax, bit for
    /// bit, with and without alternatives asked for.
    #[test]
    fn a_sampled_logprob_is_the_log_softmax_entry() {
        let logits: Vec<f32> = (0..1000)
            .map(|i| ((i * 7919 % 1009) as f32 - 500.0) / 61.0)
            .chain([f32::NEG_INFINITY])
            .collect();
        let full = log_softmax(&logits);
        for top_n in [0, 3] {
            let params = SamplingParams {
                temperature: 1.0,
                seed: Some(top_n as u64),
                ..SamplingParams::default()
            };
            let mut s = Sampler::new(params, &[]);
            for _ in 0..20 {
                let got = s.sample(&logits, None, top_n).unwrap();
                let id = got.token.id as usize;
                assert_eq!(got.token.logprob.to_bits(), full[id].to_bits());
                for t in &got.top {
                    assert_eq!(t.logprob.to_bits(), full[t.id as usize].to_bits());
                }
            }
        }
    }

    #[test]
    fn log_softmax_sums_to_one() {
        let lp = log_softmax(&[1.0, 2.0, 3.0]);
        let total: f32 = lp.iter().map(|l| l.exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
    }
}
