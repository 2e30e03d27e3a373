//! The learner's side of a policy: score completions with gradients, and sample from
//! the policy directly (the reference sampler the tests use; training runs sample
//! through the batching engine).

use agentstack_model::{Logits, Model, SeqInput};
use candle_core::{D, Result, Tensor};
use rand::Rng;

use crate::loss::{token_logprobs, token_logprobs_at};

fn model_error(e: agentstack_model::ModelError) -> candle_core::Error {
    candle_core::Error::Msg(agentstack_static::with_causes(&e))
}

/// `log π(completion_t | prompt, completion_<t)` for every completion token, in one
/// forward pass over the whole sequence, with gradients to whatever the model's
/// weights depend on (its adapters). `[T]`.
pub fn completion_logprobs(model: &Model, prompt: &[u32], completion: &[u32]) -> Result<Tensor> {
    assert!(
        !prompt.is_empty() && !completion.is_empty(),
        "a prompt and a completion are needed"
    );
    let tokens: Vec<u32> = prompt.iter().chain(completion).copied().collect();
    let mut cache = model.new_cache();
    let logits = model
        .forward(&mut [SeqInput {
            cache: &mut cache,
            tokens: &tokens,
            logits: Logits::From(prompt.len() - 1),
        }])
        .map_err(model_error)?
        .remove(0);
    // The logits at position i predict token i + 1: the rows from the prompt's last
    // token on, less the last (which predicts past the completion).
    token_logprobs(&logits.narrow(0, 0, completion.len())?, completion)
}

/// [`completion_logprobs`] for several `(prompt, completion)` pairs in one batched
/// forward pass.
pub fn completion_logprobs_batch(model: &Model, pairs: &[(&[u32], &[u32])]) -> Result<Vec<Tensor>> {
    let sequences: Vec<Vec<u32>> = pairs
        .iter()
        .map(|(p, c)| {
            assert!(
                !p.is_empty() && !c.is_empty(),
                "a prompt and a completion are needed"
            );
            p.iter().chain(c.iter()).copied().collect()
        })
        .collect();
    let mut caches: Vec<_> = pairs.iter().map(|_| model.new_cache()).collect();
    let mut inputs: Vec<SeqInput<'_>> = caches
        .iter_mut()
        .zip(&sequences)
        .zip(pairs)
        .map(|((cache, tokens), (p, _))| SeqInput {
            cache,
            tokens,
            logits: Logits::From(p.len() - 1),
        })
        .collect();
    let logits = model.forward(&mut inputs).map_err(model_error)?;
    logits
        .iter()
        .zip(pairs)
        .map(|(l, (_, c))| token_logprobs(&l.narrow(0, 0, c.len())?, c))
        .collect()
}

/// [`completion_logprobs`] for several completions of one prompt (a GRPO group): the
/// prompt runs through the model once and every completion continues from it, with
/// gradients flowing back through the shared prompt from all of them. The same values
/// and gradients as scoring each whole sequence, for a fraction of the work when the
/// prompt is long.
pub fn completion_logprobs_grouped(
    model: &Model,
    prompt: &[u32],
    completions: &[&[u32]],
) -> Result<Vec<Tensor>> {
    assert!(
        !prompt.is_empty() && completions.iter().all(|c| !c.is_empty()),
        "a prompt and completions are needed"
    );
    // Row 0 of the logits predicts every completion's first token; each completion's
    // own rows predict its later tokens. Read in one pass; the log-probabilities are
    // split per completion, not the vocabulary-wide logits.
    let logits = model
        .forward_completions(prompt, completions)
        .map_err(model_error)?;
    let tokens: Vec<u32> = completions.concat();
    let logps = token_logprobs_at(&logits, &Model::completion_rows(completions), &tokens)?;
    let mut at = 0;
    completions
        .iter()
        .map(|c| {
            let lp = logps.narrow(0, at, c.len());
            at += c.len();
            lp
        })
        .collect()
}

/// A sampled completion and the sampler's log-probability of each token.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    /// The tokens.
    pub tokens: Vec<u32>,
    /// `log π(token)` at temperature 1.
    pub logprobs: Vec<f32>,
}

/// Samples up to `max_tokens` at temperature 1, stopping after any of `stop`.
pub fn sample(
    model: &Model,
    prompt: &[u32],
    max_tokens: usize,
    stop: &[u32],
    rng: &mut impl Rng,
) -> Result<Sampled> {
    let mut cache = model.new_cache();
    let mut next: Vec<u32> = prompt.to_vec();
    let mut out = Sampled {
        tokens: Vec::new(),
        logprobs: Vec::new(),
    };
    for _ in 0..max_tokens {
        let logits = model
            .forward(&mut [SeqInput {
                cache: &mut cache,
                tokens: &next,
                logits: Logits::Last,
            }])
            .map_err(model_error)?
            .remove(0)
            .flatten_all()?;
        let logp: Vec<f32> = candle_nn::ops::log_softmax(&logits.detach(), D::Minus1)?
            .to_dtype(candle_core::DType::F32)?
            .to_vec1()?;
        let u: f32 = rng.random();
        let mut acc = 0.0;
        let mut choice = logp.len() - 1;
        for (i, lp) in logp.iter().enumerate() {
            acc += lp.exp();
            if u < acc {
                choice = i;
                break;
            }
        }
        out.tokens.push(choice as u32);
        out.logprobs.push(logp[choice]);
        if stop.contains(&(choice as u32)) {
            break;
        }
        next = vec![choice as u32];
    }
    Ok(out)
}
