//! Aggregate generation throughput of the engine for a batch of sampled requests, as a
//! GRPO step sends them (one prompt per group, `group` samples each), for work on
//! batched decoding:
//! `cargo run --release -p agentstack-model --example batch_probe -- MODEL [GROUPS] [GROUP] [MAX_TOKENS] [ROUNDS]`.
//! Every request runs to `MAX_TOKENS` (end tokens ignored), so rounds are comparable;
//! `PROBE_TAIL=1` instead gives one request in each group `MAX_TOKENS` and the others an
//! eighth of it, the long tail of a real step.

use std::sync::Arc;
use std::time::Instant;

use agentstack_model::engine::{Engine, EngineConfig};
use agentstack_model::generate::GenerateRequest;
use agentstack_model::sampling::SamplingParams;
use agentstack_model::{LanguageModel, WeightForm};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .ok_or("usage: batch_probe MODEL [GROUPS] [GROUP] [MAX_TOKENS] [ROUNDS]")?;
    let groups: usize = args.next().map_or(Ok(2), |a| a.parse())?;
    let group: usize = args.next().map_or(Ok(8), |a| a.parse())?;
    let max_tokens: usize = args.next().map_or(Ok(128), |a| a.parse())?;
    let rounds: usize = args.next().map_or(Ok(3), |a| a.parse())?;
    let tail = std::env::var("PROBE_TAIL").is_ok_and(|v| v == "1");
    let lm = Arc::new(LanguageModel::load(&path, WeightForm::Quantized)?);
    let engine = Engine::start(
        lm.clone(),
        EngineConfig {
            max_running: groups * group,
            ..EngineConfig::default()
        },
    );
    for round in 0..rounds {
        let started = Instant::now();
        let mut pending = Vec::new();
        for g in 0..groups {
            let prompt: Vec<u32> = (0..46u32)
                .map(|i| 100 + (i * 7 + g as u32 * 13) % 1000)
                .collect();
            for s in 0..group {
                let tokens = if tail && s > 0 {
                    max_tokens / 8
                } else {
                    max_tokens
                };
                let request = GenerateRequest {
                    sampling: SamplingParams {
                        temperature: 1.0,
                        seed: Some((round * 1000 + g * group + s) as u64),
                        ..SamplingParams::default()
                    },
                    ignore_eos: true,
                    ..GenerateRequest::greedy(prompt.clone(), tokens)
                };
                pending.push(engine.submit_with(request, None)?);
            }
        }
        let mut generated = 0;
        for mut events in pending {
            while let Some(event) = events.recv().await {
                if let agentstack_model::engine::Event::Done(out) = event {
                    generated += out.tokens.len();
                    break;
                }
            }
        }
        let seconds = started.elapsed().as_secs_f64();
        println!(
            "round {round}: {generated} tokens from {} requests in {seconds:.2} s: {:.0} tok/s",
            groups * group,
            generated as f64 / seconds
        );
    }
    Ok(())
}
