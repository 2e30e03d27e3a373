//! Speculative decoding without a draft model (prompt lookup).
//!
//! Agents re-emit what they have seen: a code edit copies most of the file, a tool call
//! repeats argument values, a turn quotes the history. When the sequence's last tokens
//! occurred earlier in its prompt or output, the tokens that followed them there are a
//! cheap guess (a *draft*) of what comes next. The engine runs the draft through the
//! model in the same forward pass as the sequence's next token and samples each row in
//! order, as plain decoding would, keeping the draft's tokens while they equal what was
//! sampled. Every token is still sampled from the model's own logits (which the kernels
//! make the same bits in a pass of one row or of many), so the output — greedy or
//! sampled with a seed — is the one plain decoding gives, log-probabilities included;
//! only the number of forward passes changes.
//!
//! A draft costs rows in the pass. Whether one pays is decided per sequence and pass,
//! from the sequence's recent acceptance rate and the engine's measured cost of passes
//! of each size: a draft runs only when the tokens it is expected to
//! save are worth more than the rows it adds. A sequence whose drafts stop being
//! accepted backs off, trying a short draft again after 8, 16, … 256 tokens. This is
//! what keeps speculation from slowing plain text down.

use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

/// Most draft tokens a request may ask for.
pub const MAX_DRAFT_LIMIT: usize = 64;

/// Prompt-lookup speculation settings of a request (vLLM's `ngram` method's knobs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Speculation {
    /// Most draft tokens verified in one pass; 0 turns speculation off.
    pub max_draft: usize,
    /// Longest run of last tokens looked up.
    pub ngram_max: usize,
    /// Shortest run of last tokens that makes a draft.
    pub ngram_min: usize,
}

impl Default for Speculation {
    /// On, with up to 16 draft tokens after a match of 2 to 8 tokens.
    fn default() -> Self {
        Self {
            max_draft: 16,
            ngram_max: 8,
            ngram_min: 2,
        }
    }
}

impl Speculation {
    /// No speculation: plain decoding.
    pub fn off() -> Self {
        Self {
            max_draft: 0,
            ..Self::default()
        }
    }

    /// Whether drafts are made at all.
    pub fn is_on(&self) -> bool {
        self.max_draft > 0
    }

    /// Checks every value is in range; the error names the field and the range.
    pub fn validate(&self) -> Result<()> {
        if self.max_draft > MAX_DRAFT_LIMIT {
            return Err(ModelError::InvalidRequest(format!(
                "`num_speculative_tokens` must be at most {MAX_DRAFT_LIMIT}, got {}",
                self.max_draft
            )));
        }
        if self.ngram_min == 0 || self.ngram_min > self.ngram_max || self.ngram_max > 64 {
            return Err(ModelError::InvalidRequest(format!(
                "`prompt_lookup_min` and `prompt_lookup_max` must satisfy 1 <= min <= max <= 64, got {} and {}",
                self.ngram_min, self.ngram_max
            )));
        }
        Ok(())
    }
}

/// A draft found by [`lookup`]: how many last tokens matched, and the tokens that
/// followed the match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Found<'a> {
    pub matched: usize,
    pub draft: &'a [u32],
}

/// The tokens that followed the earlier occurrence of `tokens`' last `ngram_min..=
/// ngram_max` tokens, longest match first and the latest among equals; at most `max`.
pub(crate) fn lookup<'a>(
    tokens: &'a [u32],
    settings: &Speculation,
    max: usize,
) -> Option<Found<'a>> {
    lookup_in(tokens, tokens, settings, max)
}

/// [`lookup`] of `tail`'s last tokens in `corpus` (which may be `tail` itself: a match
/// must leave at least one token after it).
pub(crate) fn lookup_in<'a>(
    corpus: &'a [u32],
    tail: &[u32],
    settings: &Speculation,
    max: usize,
) -> Option<Found<'a>> {
    let n = tail.len();
    let (&last, _) = tail.split_last()?;
    if max == 0 || n < settings.ngram_min || corpus.len() < 2 {
        return None;
    }
    let mut best: Option<(usize, usize)> = None;
    for end in (0..corpus.len() - 1).rev() {
        if corpus[end] != last {
            continue;
        }
        let longest = settings.ngram_max.min(end + 1).min(n);
        let matched = (0..longest)
            .take_while(|&k| corpus[end - k] == tail[n - 1 - k])
            .count();
        if matched >= settings.ngram_min && best.is_none_or(|(_, m)| matched > m) {
            best = Some((end, matched));
            if matched == settings.ngram_max {
                break;
            }
        }
    }
    let (end, matched) = best?;
    let draft = &corpus[end + 1..corpus.len().min(end + 1 + max)];
    Some(Found { matched, draft })
}

/// Tokens without a draft, after a failed probe, before the next probe: doubled by
/// each failure up to [`BACKOFF_MAX`], reset by a probe all accepted.
const BACKOFF_MIN: usize = 8;
/// See [`BACKOFF_MIN`].
const BACKOFF_MAX: usize = 256;
/// Draft tokens a probe verifies.
pub(crate) const PROBE_LEN: usize = 2;
/// Weight of the older verifications in the acceptance rate (recent ones count more).
const DECAY: f64 = 0.8;

/// A sequence's recent record of drafts.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Acceptance {
    /// Draft tokens kept, recent verifications weighted more.
    accepted: f64,
    /// Draft tokens that were checked (those before the first miss, and the miss).
    checked: f64,
    /// Decoding steps since the last draft.
    idle: usize,
    backoff: usize,
}

impl Default for Acceptance {
    fn default() -> Self {
        Self {
            accepted: 0.0,
            checked: 0.0,
            idle: 0,
            backoff: BACKOFF_MIN,
        }
    }
}

impl Acceptance {
    /// The chance that a draft token is kept given the ones before it were: one kept
    /// and one missed as a prior, then the recent record.
    pub(crate) fn rate(&self) -> f64 {
        (self.accepted + 1.0) / (self.checked + 2.0)
    }

    /// Whether a short draft should be tried even though the rate says it does not pay.
    pub(crate) fn probe_due(&self) -> bool {
        self.idle >= self.backoff
    }

    /// A decoding step without a draft.
    pub(crate) fn idle(&mut self) {
        self.idle += 1;
    }

    /// A draft of `proposed` tokens of which the first `accepted` were kept.
    pub(crate) fn record(&mut self, proposed: usize, accepted: usize) {
        let checked = proposed.min(accepted + 1);
        self.accepted = self.accepted * DECAY + accepted as f64;
        self.checked = self.checked * DECAY + checked as f64;
        if accepted == proposed {
            self.backoff = BACKOFF_MIN;
        } else if self.idle >= self.backoff {
            self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
        }
        self.idle = 0;
    }
}

/// Largest pass (in rows) whose cost is tracked.
const MAX_TRACKED_ROWS: usize = 256;
/// Weight of a new measurement in a pass size's cost.
const COST_ALPHA: f64 = 0.2;
/// Assumed cost of each row after the first, relative to a one-row pass, until passes
/// of that size have been measured (about what a 135M model costs on a CPU; larger
/// models, more bound by reading weights, cost less per row).
const PRIOR_ROW_COST: f64 = 0.4;

/// The measured time of decoding passes by their number of rows (tokens), an
/// exponential moving average per size. Sizes not measured yet are estimated from
/// the nearest measured size.
#[derive(Debug, Clone)]
pub(crate) struct PassCosts {
    seconds: Vec<Option<f64>>,
}

impl Default for PassCosts {
    fn default() -> Self {
        Self {
            seconds: vec![None; MAX_TRACKED_ROWS + 1],
        }
    }
}

fn prior(rows: usize) -> f64 {
    1.0 + PRIOR_ROW_COST * (rows.max(1) - 1) as f64
}

impl PassCosts {
    /// A decoding pass of `rows` rows took `seconds`.
    pub(crate) fn record(&mut self, rows: usize, seconds: f64) {
        if let Some(slot) = self.seconds.get_mut(rows).filter(|_| rows > 0) {
            *slot = Some(match *slot {
                Some(old) => old + COST_ALPHA * (seconds - old),
                None => seconds,
            });
        }
    }

    /// The expected time of a pass of `rows` rows (in seconds once any size has been
    /// measured; in units of a one-row pass before).
    pub(crate) fn cost(&self, rows: usize) -> f64 {
        let rows = rows.max(1);
        if let Some(Some(measured)) = self.seconds.get(rows) {
            return *measured;
        }
        let top = rows.min(MAX_TRACKED_ROWS);
        let below = (1..top).rev().find_map(|r| self.seconds[r].map(|s| (r, s)));
        let above = (top..=MAX_TRACKED_ROWS).find_map(|r| self.seconds[r].map(|s| (r, s)));
        match below.or(above) {
            Some((r, s)) => s * prior(rows) / prior(r),
            None => prior(rows),
        }
    }

    /// How many of a draft's `available` tokens to verify for a sequence whose draft
    /// tokens are kept at `rate`, in a pass that already has `rows` rows of which
    /// `decoding` are decoding sequences' next tokens: the length whose expected saved
    /// tokens are worth the most more than the rows it adds (0: none pays). A token is
    /// worth a decoding pass's time per sequence.
    pub(crate) fn draft_len(
        &self,
        rate: f64,
        available: usize,
        rows: usize,
        decoding: usize,
    ) -> usize {
        let worth = self.cost(decoding) / decoding.max(1) as f64;
        let base = self.cost(rows);
        let (mut best, mut best_gain) = (0, 0.0);
        // Expected tokens a draft of k yields beyond the one sampled anyway:
        // rate + rate² + … + rateᵏ.
        let (mut kept, mut p) = (0.0, 1.0);
        for k in 1..=available {
            p *= rate;
            kept += p;
            let gain = kept * worth - (self.cost(rows + k) - base);
            if gain > best_gain {
                (best, best_gain) = (k, gain);
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(min: usize, max: usize) -> Speculation {
        Speculation {
            max_draft: 16,
            ngram_min: min,
            ngram_max: max,
        }
    }

    #[test]
    fn lookup_takes_the_longest_latest_match() {
        // "1 2 3 9 …" and later "2 3 7 …": the tail "1 2 3" matches the first by 3.
        let tokens = [1, 2, 3, 9, 8, 2, 3, 7, 6, 1, 2, 3];
        let found = lookup(&tokens, &settings(2, 8), 3).unwrap();
        assert_eq!(found.matched, 3);
        assert_eq!(found.draft, &[9, 8, 2]);
        // With a 2-token cap, both match by 2 and the latest wins.
        let found = lookup(&tokens, &settings(2, 2), 16).unwrap();
        assert_eq!(found.matched, 2);
        assert_eq!(found.draft, &[7, 6, 1, 2, 3]);
    }

    #[test]
    fn lookup_needs_the_shortest_match_and_room() {
        let tokens = [5, 1, 9, 2, 1];
        assert_eq!(lookup(&tokens, &settings(2, 4), 8), None);
        assert_eq!(
            lookup(&tokens, &settings(1, 4), 8).unwrap().draft,
            &[9, 2, 1]
        );
        assert_eq!(lookup(&tokens, &settings(1, 4), 0), None);
        assert_eq!(lookup(&[], &settings(1, 4), 8), None);
        assert_eq!(lookup(&[3], &settings(1, 4), 8), None);
        // A repeating tail drafts its own continuation.
        let found = lookup(&[4, 4, 4], &settings(1, 4), 8).unwrap();
        assert_eq!((found.matched, found.draft), (2, &[4][..]));
    }

    #[test]
    fn settings_are_checked() {
        assert!(Speculation::default().validate().is_ok());
        assert!(Speculation::off().validate().is_ok());
        assert!(!Speculation::off().is_on());
        let too_many = Speculation {
            max_draft: 65,
            ..Speculation::default()
        };
        assert!(too_many.validate().is_err());
        assert!(settings(0, 3).validate().is_err());
        assert!(settings(4, 3).validate().is_err());
    }

    #[test]
    fn acceptance_backs_off_and_recovers() {
        let mut a = Acceptance::default();
        assert!((a.rate() - 0.5).abs() < 1e-9);
        for _ in 0..5 {
            a.record(4, 4);
        }
        assert!(a.rate() > 0.8, "{}", a.rate());
        // A miss at the first token checks one token: the record turns in ~20 drafts.
        for _ in 0..20 {
            a.record(2, 0);
        }
        assert!(a.rate() < 0.2, "{}", a.rate());
        // Probes come after 8 idle steps, then 16, then 32 while they fail.
        for backoff in [8, 16, 32] {
            for _ in 0..backoff {
                assert!(!a.probe_due());
                a.idle();
            }
            assert!(a.probe_due());
            a.record(PROBE_LEN, 0);
        }
        // A kept probe resets the wait.
        for _ in 0..64 {
            a.idle();
        }
        a.record(PROBE_LEN, PROBE_LEN);
        for _ in 0..8 {
            a.idle();
        }
        assert!(a.probe_due());
    }

    #[test]
    fn drafts_run_only_where_they_pay() {
        let mut costs = PassCosts::default();
        // Before any measurement, the prior: a row costs 0.4 of a pass.
        assert!((costs.cost(3) - 1.8).abs() < 1e-9);
        assert_eq!(costs.draft_len(0.5, 8, 1, 1), 1);
        assert_eq!(costs.draft_len(0.2, 8, 1, 1), 0);
        assert!(costs.draft_len(0.9, 16, 1, 1) >= 6);
        // Measured: rows cheap (a large model reading weights) → longer drafts, and
        // drafts even at a low rate.
        for rows in 1..=17 {
            costs.record(rows, 0.010 + 0.0005 * rows as f64);
        }
        assert_eq!(costs.draft_len(0.95, 16, 1, 1), 16);
        assert!(costs.draft_len(0.2, 16, 1, 1) >= 1);
        // Rows as dear as a pass (a large batch, compute-bound): nothing pays.
        let mut dear = PassCosts::default();
        for rows in 1..=40 {
            dear.record(rows, 0.001 * rows as f64);
        }
        assert_eq!(dear.draft_len(0.9, 16, 16, 16), 0);
        // Unmeasured sizes scale from the nearest measured one.
        let mut one = PassCosts::default();
        one.record(1, 0.01);
        assert!((one.cost(3) - 0.018).abs() < 1e-9);
    }
}
