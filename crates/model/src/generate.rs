//! Generation of one sequence as a small state machine the engine drives: feed the
//! prompt (in chunks), then sample a token from each row of logits until a stop.

use serde::{Deserialize, Serialize};

use crate::LanguageModel;
use crate::constraint::Constraint;
use crate::error::{ModelError, Result};
use crate::model::{Logits, SeqCache, SeqInput};
use crate::sampling::{self, Sampler, SamplingParams, TokenLogprob};
use crate::speculate::{self, Acceptance, Speculation};
use crate::tokenizer::TextStream;

/// Loop detection defaults: a block of up to 32 tokens repeated back to back 4 or more
/// times, covering at least 64 tokens, ends the generation with [`FinishReason::Loop`].
pub const LOOP_MAX_PERIOD: usize = 32;
/// See [`LOOP_MAX_PERIOD`].
pub const LOOP_MIN_REPEATS: usize = 4;
/// See [`LOOP_MAX_PERIOD`].
pub const LOOP_MIN_SPAN: usize = 64;

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// How to sample.
    pub sampling: SamplingParams,
    /// Strings that end the generation (not included in the text).
    pub stop: Vec<String>,
    /// Token ids that end the generation (included in the token ids, not the text).
    pub stop_tokens: Vec<u32>,
    /// Keep going past the model's end tokens.
    pub ignore_eos: bool,
    /// Alternatives to report per position (0..=20).
    pub top_logprobs: usize,
    /// End the generation when it starts repeating itself.
    pub detect_loops: bool,
    /// Restrict tokens to a grammar.
    pub constraint: Option<Constraint>,
    /// Prompt-lookup speculative decoding, which only the [`crate::engine::Engine`]
    /// does, where it pays (the output is the same with it on or off); `None`: the
    /// engine's setting ([`crate::engine::EngineConfig::speculation`]).
    pub speculation: Option<Speculation>,
    /// The output the caller expects (OpenAI's predicted outputs), as token ids: with
    /// speculation on, its tokens are drafts too — from its start while the output
    /// follows it, and after wherever the output's last tokens occur in it.
    pub prediction: Vec<u32>,
}

impl GenerateRequest {
    /// Greedy decoding of `max_tokens` tokens, stopping at the model's end tokens.
    pub fn greedy(prompt: Vec<u32>, max_tokens: usize) -> Self {
        Self {
            prompt,
            max_tokens,
            sampling: SamplingParams::greedy(),
            stop: Vec::new(),
            stop_tokens: Vec::new(),
            ignore_eos: false,
            top_logprobs: 0,
            detect_loops: false,
            constraint: None,
            speculation: None,
            prediction: Vec::new(),
        }
    }
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end token or stop string.
    Stop,
    /// `max_tokens` reached, or the context window is full.
    Length,
    /// A repeated block of tokens was detected.
    Loop,
    /// The grammar is complete.
    Grammar,
    /// The client went away or cancelled.
    Cancelled,
}

impl FinishReason {
    /// The OpenAI API's name for it (`loop` is this server's addition).
    pub fn openai_name(self) -> &'static str {
        match self {
            Self::Stop | Self::Grammar | Self::Cancelled => "stop",
            Self::Length => "length",
            Self::Loop => "loop",
        }
    }
}

/// One generated token, as streamed.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenEvent {
    /// The token and its log-probability.
    pub token: TokenLogprob,
    /// Alternatives, best first.
    pub top: Vec<TokenLogprob>,
    /// Text that became final with this token (may be empty; stop strings and
    /// incomplete characters are held back).
    pub text: String,
    /// Set on the last token.
    pub finish: Option<FinishReason>,
    /// The version of the engine's adapter slot whose weights sampled this token
    /// (`None` on the base weights or outside the engine). A slot replaced while a
    /// sequence runs (a weight update during an RL rollout) changes it mid-sequence.
    pub weights_version: Option<u64>,
}

/// The result of a whole generation.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOutput {
    /// Generated token ids (including a final end token, if one was produced).
    pub tokens: Vec<u32>,
    /// Log-probability of each generated token.
    pub logprobs: Vec<f32>,
    /// Alternatives per position.
    pub top_logprobs: Vec<Vec<TokenLogprob>>,
    /// The generated text, without end tokens and cut before a stop string.
    pub text: String,
    /// Why it ended.
    pub finish: FinishReason,
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Of those, the tokens whose keys and values came from a cache (an earlier turn
    /// of the conversation, or a sequence of the same prompt) rather than the model;
    /// OpenAI's `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: usize,
    /// Draft tokens verified by speculative decoding.
    pub draft_tokens: usize,
    /// Of those, the tokens kept (each saved a forward pass); OpenAI's
    /// `usage.completion_tokens_details.accepted_prediction_tokens`.
    pub accepted_draft_tokens: usize,
}

/// A sequence being generated.
#[derive(Debug)]
pub struct Sequence {
    cache: SeqCache,
    /// Prompt tokens (or the last sampled token) not yet run through the model.
    pending: Vec<u32>,
    prompt_len: usize,
    max_tokens: usize,
    context: usize,
    sampler: Sampler,
    stop: Vec<String>,
    stop_tokens: Vec<u32>,
    top_n: usize,
    detect_loops: bool,
    constraint: Option<Constraint>,
    stream: TextStream,
    /// Final text so far (stop strings cut off).
    text: String,
    /// Bytes of `text` already handed out.
    released: usize,
    out: GenerateOutput,
    all_tokens: Vec<u32>,
    finished: bool,
    speculation: Speculation,
    acceptance: Acceptance,
    /// The draft tokens at the end of `pending`, being verified.
    draft: Vec<u32>,
    /// The caller's predicted output.
    prediction: Vec<u32>,
}

/// A draft a decoding sequence could verify in its next pass (see
/// [`Sequence::draft_candidate`]).
#[derive(Debug, Clone, PartialEq)]
pub struct DraftCandidate {
    /// The draft's tokens, at most as many as the pass has room for.
    pub tokens: Vec<u32>,
    /// The sequence's recent rate of kept draft tokens.
    pub rate: f64,
    /// Whether a short draft is due anyway, to see whether the rate has changed.
    pub probe: bool,
}

impl Sequence {
    /// Checks a request against the model and prepares its state.
    pub fn new(lm: &LanguageModel, request: GenerateRequest) -> Result<Self> {
        request.sampling.validate()?;
        if let Some(speculation) = &request.speculation {
            speculation.validate()?;
        }
        let vocab = lm
            .tokenizer()
            .vocab_size()
            .max(lm.model().config().vocab_size);
        if request.prompt.is_empty() {
            return Err(ModelError::InvalidRequest(
                "the prompt is empty; give at least one token".into(),
            ));
        }
        if let Some(bad) = request
            .prompt
            .iter()
            .chain(&request.prediction)
            .find(|&&t| t as usize >= vocab)
        {
            return Err(ModelError::InvalidRequest(format!(
                "token id {bad} is out of range; the vocabulary has {vocab} tokens (0..{vocab})"
            )));
        }
        if request.top_logprobs > sampling::MAX_TOP_LOGPROBS {
            return Err(ModelError::InvalidRequest(format!(
                "top_logprobs must be at most {}, got {}",
                sampling::MAX_TOP_LOGPROBS,
                request.top_logprobs
            )));
        }
        let context = lm.model().max_positions();
        if request.prompt.len() >= context {
            return Err(ModelError::ContextOverflow {
                tokens: request.prompt.len() + 1,
                context,
            });
        }
        let mut stop_tokens = request.stop_tokens.clone();
        if !request.ignore_eos {
            stop_tokens.extend(lm.tokenizer().end_tokens());
        }
        Ok(Self {
            cache: lm.model().new_cache(),
            pending: request.prompt.clone(),
            prompt_len: request.prompt.len(),
            max_tokens: request.max_tokens,
            context,
            sampler: Sampler::new(request.sampling, &request.prompt),
            stop: request.stop.into_iter().filter(|s| !s.is_empty()).collect(),
            stop_tokens,
            top_n: request.top_logprobs,
            detect_loops: request.detect_loops,
            constraint: request.constraint,
            stream: TextStream::default(),
            text: String::new(),
            released: 0,
            out: GenerateOutput {
                tokens: Vec::new(),
                logprobs: Vec::new(),
                top_logprobs: Vec::new(),
                text: String::new(),
                finish: FinishReason::Length,
                prompt_tokens: request.prompt.len(),
                cached_tokens: 0,
                draft_tokens: 0,
                accepted_draft_tokens: 0,
            },
            all_tokens: request.prompt,
            finished: request.max_tokens == 0,
            // Drafts are verified in passes of several rows: exact only on kernels
            // whose rows do not depend on the pass.
            speculation: request
                .speculation
                .filter(|_| lm.model().splits_exactly())
                .unwrap_or_else(Speculation::off),
            acceptance: Acceptance::default(),
            draft: Vec::new(),
            prediction: request.prediction,
        })
    }

    /// Whether generation has ended.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// Tokens waiting to go through the model (the prompt, then one per step).
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Whether the prompt has been fully read.
    pub fn is_decoding(&self) -> bool {
        self.cache.len() >= self.prompt_len
    }

    /// The cache, for forking.
    pub fn cache(&self) -> &SeqCache {
        &self.cache
    }

    /// The prompt's token ids.
    pub fn prompt(&self) -> &[u32] {
        &self.all_tokens[..self.prompt_len]
    }

    /// Starts from a cache that already holds `tokens` (an earlier sequence's), reusing
    /// the part that is a prefix of this prompt: only the rest is run through the
    /// model. The kernels give every position the same values however the sequence is
    /// split into passes, so the result is bit-identical to a fresh start. Returns the
    /// positions reused (0 when nothing could be, and the cache is left unused).
    pub fn reuse_prefix(&mut self, mut cache: SeqCache, tokens: &[u32]) -> usize {
        if !self.cache.is_empty() || self.pending.len() != self.prompt_len {
            return 0;
        }
        let usable = tokens.len().min(cache.len());
        // At least one prompt token must go through the model, for its logits.
        let common =
            common_prefix(&tokens[..usable], &self.pending).min(self.prompt_len.saturating_sub(1));
        if common == 0 || !cache.truncate(common) {
            return 0;
        }
        self.cache = cache;
        self.pending.drain(..common);
        self.out.cached_tokens = common;
        common
    }

    /// The cache and the tokens it holds, once the sequence is over (for reuse by a
    /// later request that continues the same conversation).
    pub fn into_cache(self) -> (SeqCache, Vec<u32>) {
        let mut tokens = self.all_tokens;
        tokens.truncate(self.cache.len());
        (self.cache, tokens)
    }

    /// A draft for the next pass of this decoding sequence, with room for at most
    /// `room` draft tokens: the tokens that followed the latest earlier occurrence of
    /// its last tokens (see [`crate::speculate`]). `None` when speculation is off, the
    /// sequence is not decoding, nothing matches, or no draft token could be kept
    /// (`max_tokens` or the context is reached after the next token).
    pub fn draft_candidate(&self, room: usize) -> Option<DraftCandidate> {
        if !self.speculation.is_on()
            || self.finished
            || !self.is_decoding()
            || self.pending.len() != 1
            || !self.cache.can_truncate()
        {
            return None;
        }
        let left = self.max_tokens.saturating_sub(self.out.tokens.len() + 1);
        let room = room
            .min(self.speculation.max_draft)
            .min(left)
            .min(self.context.saturating_sub(self.all_tokens.len()));
        let output = &self.out.tokens;
        // The output so far follows the prediction: its next tokens, however short
        // the output is yet.
        if self.prediction.len() > output.len() && self.prediction.starts_with(output) {
            let rest = &self.prediction[output.len()..];
            return Some(DraftCandidate {
                tokens: rest[..rest.len().min(room)].to_vec(),
                rate: self.acceptance.rate(),
                probe: true,
            })
            .filter(|c| !c.tokens.is_empty());
        }
        let own = speculate::lookup(&self.all_tokens, &self.speculation, room);
        let predicted =
            speculate::lookup_in(&self.prediction, &self.all_tokens, &self.speculation, room);
        let found = match (own, predicted) {
            (Some(a), Some(b)) => Some(if b.matched > a.matched { b } else { a }),
            (a, b) => a.or(b),
        }?;
        Some(DraftCandidate {
            tokens: found.draft.to_vec(),
            rate: self.acceptance.rate(),
            probe: self.acceptance.probe_due() || found.matched >= self.speculation.ngram_max,
        })
    }

    /// Adds `draft` to the next pass: its tokens run through the model after the
    /// pending one, and [`Sequence::sample_rows`] keeps those that equal what is
    /// sampled. An empty draft is a pass without one although a candidate was found
    /// (it counts towards the next probe).
    pub fn propose(&mut self, draft: &[u32]) {
        if draft.is_empty() || self.pending.len() != 1 {
            if self.speculation.is_on() && self.is_decoding() {
                self.acceptance.idle();
            }
            return;
        }
        self.pending.extend_from_slice(draft);
        self.draft = draft.to_vec();
    }

    /// Takes up to `budget` pending tokens as this sequence's part of a forward pass.
    /// The returned input wants logits only when the last pending token is included,
    /// and for every token of a draft being verified (which is taken whole).
    pub fn input(&mut self, budget: usize) -> (SeqInput<'_>, usize) {
        let n = if self.draft.is_empty() {
            budget.min(self.pending.len()).max(1)
        } else {
            self.pending.len()
        };
        let logits = if self.draft.is_empty() {
            Logits::Last
        } else {
            Logits::All
        };
        (
            SeqInput {
                cache: &mut self.cache,
                tokens: &self.pending[..n],
                logits,
            },
            n,
        )
    }

    /// Records that the first `n` pending tokens went through the model; returns
    /// whether the logits of that pass should be sampled from (the prompt is done).
    pub fn consumed(&mut self, n: usize) -> bool {
        self.pending.drain(..n);
        self.pending.is_empty()
    }

    /// Ends the sequence early.
    pub fn cancel(&mut self) -> TokenEvent {
        self.finished = true;
        self.out.finish = FinishReason::Cancelled;
        TokenEvent {
            token: TokenLogprob {
                id: 0,
                logprob: 0.0,
            },
            top: Vec::new(),
            text: String::new(),
            finish: Some(FinishReason::Cancelled),
            weights_version: None,
        }
    }

    /// Samples from the rows of logits of a pass: the one row of a plain decoding
    /// step, or the `1 + draft` rows of a verified draft, in order, while each sampled
    /// token equals the draft's next token. Returns a token per row sampled (the first
    /// that differs from the draft is the last). The draft tokens that were not kept
    /// leave the cache. Each token is sampled exactly as [`Sequence::sample`] samples
    /// it from the same logits, so the output does not depend on the drafts.
    pub fn sample_rows(&mut self, lm: &LanguageModel, rows: &[f32]) -> Result<Vec<TokenEvent>> {
        let draft = std::mem::take(&mut self.draft);
        if draft.is_empty() {
            return Ok(vec![self.sample(lm, rows)?]);
        }
        let width = rows.len() / (draft.len() + 1);
        let mut events = Vec::with_capacity(draft.len() + 1);
        let mut kept = 0;
        for (i, row) in rows.chunks_exact(width).enumerate() {
            let event = self.sample(lm, row)?;
            let go_on = event.finish.is_none() && draft.get(i) == Some(&event.token.id);
            events.push(event);
            if !go_on {
                break;
            }
            kept += 1;
        }
        // The cache holds the pending token and the whole draft; keep the positions of
        // the pending token and the draft tokens that were sampled.
        let keep = self.cache.len() - (draft.len() - kept);
        self.cache.truncate(keep);
        // Each kept token was also queued as pending; only the last sampled token has
        // not been through the model.
        let unread = self.pending.len().min(usize::from(!self.finished));
        self.pending.drain(..self.pending.len() - unread);
        self.out.draft_tokens += draft.len();
        self.out.accepted_draft_tokens += kept;
        self.acceptance.record(draft.len(), kept);
        Ok(events)
    }

    /// Samples the next token from the last row of logits and checks the stops.
    pub fn sample(&mut self, lm: &LanguageModel, logits: &[f32]) -> Result<TokenEvent> {
        let sampled = match &mut self.constraint {
            Some(constraint) => {
                let mask = constraint.mask()?;
                self.sampler
                    .sample(logits, Some(&|t| mask.allows(t)), self.top_n)?
            }
            None => self.sampler.sample(logits, None, self.top_n)?,
        };
        let id = sampled.token.id;
        self.sampler.accept(id);
        self.all_tokens.push(id);
        self.out.tokens.push(id);
        self.out.logprobs.push(sampled.token.logprob);
        if self.top_n > 0 {
            self.out.top_logprobs.push(sampled.top.clone());
        }
        let mut finish = None;
        if let Some(constraint) = &mut self.constraint {
            constraint.commit(id)?;
        }
        if self.stop_tokens.contains(&id) {
            finish = Some(FinishReason::Stop);
        } else {
            let bytes = lm.tokenizer().token_bytes(id).unwrap_or_default();
            let before = self.text.len();
            self.text.push_str(&self.stream.push(bytes));
            if let Some(cut) = self.find_stop(before) {
                self.text.truncate(cut);
                finish = Some(FinishReason::Stop);
            }
        }
        if finish.is_none()
            && self
                .constraint
                .as_ref()
                .is_some_and(Constraint::is_finished)
        {
            finish = Some(FinishReason::Grammar);
        }
        if finish.is_none()
            && self.detect_loops
            && sampling::detect_loop(
                &self.out.tokens,
                LOOP_MAX_PERIOD,
                LOOP_MIN_REPEATS,
                LOOP_MIN_SPAN,
            )
            .is_some()
        {
            finish = Some(FinishReason::Loop);
        }
        if finish.is_none()
            && (self.out.tokens.len() >= self.max_tokens || self.all_tokens.len() >= self.context)
        {
            finish = Some(FinishReason::Length);
        }
        if let Some(reason) = finish {
            self.finished = true;
            self.out.finish = reason;
            if reason != FinishReason::Stop {
                self.text.push_str(&self.stream.finish());
            }
        } else {
            self.pending.push(id);
        }
        Ok(TokenEvent {
            token: sampled.token,
            top: sampled.top,
            text: self.release(),
            finish,
            weights_version: None,
        })
    }

    /// Position of the first stop string in the text, looking only where the newest
    /// bytes could complete one.
    fn find_stop(&self, new_from: usize) -> Option<usize> {
        self.stop
            .iter()
            .filter_map(|s| {
                let from = floor_char_boundary(&self.text, new_from.saturating_sub(s.len()));
                self.text[from..].find(s.as_str()).map(|i| from + i)
            })
            .min()
    }

    /// Text that can be handed out: everything except a tail that might still become a
    /// stop string.
    fn release(&mut self) -> String {
        let mut end = self.text.len();
        if !self.finished {
            for stop in &self.stop {
                for k in (1..stop.len()).rev() {
                    if self.text.len() >= k
                        && self.text.is_char_boundary(self.text.len() - k)
                        && stop
                            .as_bytes()
                            .starts_with(&self.text.as_bytes()[self.text.len() - k..])
                    {
                        end = end.min(self.text.len() - k);
                        break;
                    }
                }
            }
        }
        let end = end.max(self.released);
        let out = self.text[self.released..end].to_owned();
        self.released = end;
        out
    }

    /// The whole result (call once finished).
    pub fn output(&self) -> GenerateOutput {
        let mut out = self.out.clone();
        out.text = self.text.clone();
        out
    }
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// Generates for one request alone (no engine).
pub fn generate(lm: &LanguageModel, request: &GenerateRequest) -> Result<GenerateOutput> {
    Ok(generate_batch(lm, std::slice::from_ref(request))?.remove(0))
}

/// Generates for several requests in lockstep, one batched forward pass per step.
pub fn generate_batch(
    lm: &LanguageModel,
    requests: &[GenerateRequest],
) -> Result<Vec<GenerateOutput>> {
    let mut seqs = requests
        .iter()
        .map(|r| Sequence::new(lm, r.clone()))
        .collect::<Result<Vec<_>>>()?;
    loop {
        let active: Vec<usize> = (0..seqs.len())
            .filter(|&i| !seqs[i].is_finished())
            .collect();
        if active.is_empty() {
            break;
        }
        let mut inputs = Vec::with_capacity(active.len());
        let mut taken = Vec::with_capacity(active.len());
        for seq in seqs.iter_mut().filter(|s| !s.is_finished()) {
            let (input, n) = seq.input(usize::MAX);
            inputs.push(input);
            taken.push(n);
        }
        let logits = lm.model().forward(&mut inputs)?;
        drop(inputs);
        for ((&i, n), row) in active.iter().zip(taken).zip(logits) {
            if seqs[i].consumed(n) {
                let row: Vec<f32> = row.squeeze(0)?.to_vec1()?;
                seqs[i].sample(lm, &row)?;
            }
        }
    }
    Ok(seqs.iter().map(Sequence::output).collect())
}

/// How many first tokens `a` and `b` have in common.
pub(crate) fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
