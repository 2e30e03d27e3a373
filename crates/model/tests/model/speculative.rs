//! Prompt-lookup speculative decoding on the real model: the same tokens and
//! log-probabilities as plain decoding (greedy and sampled), in fewer passes where the
//! output copies its prompt.

use agentstack_model::SamplingParams;
use agentstack_model::engine::{Engine, EngineConfig};
use agentstack_model::generate::{GenerateOutput, GenerateRequest, generate, generate_batch};
use agentstack_model::speculate::Speculation;

use super::{chat, lm};

/// A file to rewrite with a small fix: the output copies most of the prompt.
pub const BUGGY_FILE: &str = r#"def mean(values):
    """Return the arithmetic mean of a list of numbers."""
    total = 0
    for value in values:
        total += value
    return total / (len(values) - 1)


def variance(values):
    """Return the population variance of a list of numbers."""
    m = mean(values)
    return sum((v - m) ** 2 for v in values) / len(values)
"#;

/// A prompt asking for `BUGGY_FILE` rewritten with its bug fixed.
pub fn rewrite_prompt() -> String {
    format!(
        "Here is a Python file:\n\n```python\n{BUGGY_FILE}```\n\nThe mean is wrong: it divides by len(values) - 1. Rewrite the whole file with that fixed. Answer with the file only."
    )
}

/// `out` without the counters that depend on caching and drafting (not on the output).
pub fn output_only(out: GenerateOutput) -> GenerateOutput {
    GenerateOutput {
        cached_tokens: 0,
        draft_tokens: 0,
        accepted_draft_tokens: 0,
        ..out
    }
}

fn engine(speculation: Speculation) -> Engine {
    Engine::start(
        lm(),
        EngineConfig {
            speculation,
            ..Default::default()
        },
    )
}

fn prompts() -> Vec<Vec<u32>> {
    let lm = lm();
    [
        rewrite_prompt().as_str(),
        "Repeat this sentence exactly, twice: The quick brown fox jumps over the lazy dog near the river bank.",
        "Write a short poem about rain.",
    ]
    .iter()
    .map(|p| chat(&lm, p))
    .collect()
}

#[tokio::test]
#[ignore = "needs the SmolLM2 model (scripts/fetch-model)"]
async fn greedy_output_is_bit_identical_with_speculation_and_drafts_are_kept() {
    let lm = lm();
    let on = engine(Speculation::default());
    let mut kept = 0;
    for (i, prompt) in prompts().into_iter().enumerate() {
        let request = GenerateRequest {
            top_logprobs: 3,
            ..GenerateRequest::greedy(prompt, 160)
        };
        let plain = generate(&lm, &request).unwrap();
        let speculated = on.generate(request).await.unwrap();
        assert_eq!(plain.draft_tokens, 0);
        assert!(speculated.accepted_draft_tokens <= speculated.draft_tokens);
        if i == 0 {
            // The rewrite copies lines of the file: some of its tokens come from kept
            // drafts. How many depends on the measured cost of passes on this machine
            // (a draft runs only where it pays), so the share is not asserted here:
            // bench/inference/speculative.py measures it (with the speed).
            assert!(
                speculated.accepted_draft_tokens > 0,
                "{} of {} tokens from drafts ({} drafted): {}",
                speculated.accepted_draft_tokens,
                speculated.tokens.len(),
                speculated.draft_tokens,
                speculated.text
            );
        }
        kept += speculated.accepted_draft_tokens;
        assert_eq!(output_only(speculated), plain, "prompt {i}");
    }
    assert!(kept > 0);
}

#[tokio::test]
#[ignore = "needs the SmolLM2 model (scripts/fetch-model)"]
async fn sampled_output_is_the_same_with_speculation_on_or_off() {
    let lm = lm();
    let on = engine(Speculation::default());
    let off = engine(Speculation::off());
    let mut drafted = 0;
    for (i, prompt) in prompts().into_iter().enumerate() {
        for (seed, penalty, stop) in [(7, 1.0, None), (8, 1.1, Some("return"))] {
            let request = GenerateRequest {
                sampling: SamplingParams {
                    temperature: 0.7,
                    top_p: 0.95,
                    repetition_penalty: penalty,
                    seed: Some(seed),
                    ..SamplingParams::default()
                },
                stop: stop.map(str::to_owned).into_iter().collect(),
                top_logprobs: 2,
                // Ends mid-draft, too.
                ..GenerateRequest::greedy(prompt.clone(), 97)
            };
            let a = on.generate(request.clone()).await.unwrap();
            let b = off.generate(request).await.unwrap();
            assert_eq!(b.draft_tokens, 0);
            drafted += a.draft_tokens;
            assert_eq!(output_only(a), output_only(b), "prompt {i}, seed {seed}");
        }
    }
    assert!(drafted > 0, "no draft was tried");
    // Requests that choose override the engine's setting.
    let prompt = chat(&lm, &rewrite_prompt());
    let forced = GenerateRequest {
        speculation: Some(Speculation::default()),
        ..GenerateRequest::greedy(prompt, 40)
    };
    assert!(off.generate(forced).await.unwrap().draft_tokens > 0);
}

/// Concurrent sequences, each with its own drafts, in one pass: each gets what it
/// gets alone.
#[tokio::test]
#[ignore = "needs the SmolLM2 model (scripts/fetch-model)"]
async fn concurrent_speculating_sequences_get_their_own_outputs() {
    let lm = lm();
    let on = engine(Speculation::default());
    let requests: Vec<GenerateRequest> = prompts()
        .into_iter()
        .chain(prompts())
        .enumerate()
        .map(|(i, prompt)| GenerateRequest {
            sampling: if i < 3 {
                SamplingParams::greedy()
            } else {
                SamplingParams {
                    temperature: 0.8,
                    seed: Some(i as u64),
                    ..SamplingParams::default()
                }
            },
            ..GenerateRequest::greedy(prompt, 80)
        })
        .collect();
    let plain = generate_batch(&lm, &requests).unwrap();
    let handles: Vec<_> = requests
        .into_iter()
        .map(|r| {
            let on = on.clone();
            tokio::spawn(async move { on.generate(r).await.unwrap() })
        })
        .collect();
    for (i, (handle, plain)) in handles.into_iter().zip(plain).enumerate() {
        assert_eq!(output_only(handle.await.unwrap()), plain, "request {i}");
    }
}
