//! Times the learner's work on one GRPO group, as bench/rl's step does it: a 46-token
//! prompt and 8 completions of 22 tokens scored with `completion_logprobs_grouped` on
//! the f32 weights with LoRA (r 8, q and v), then the backward pass. `PROBE_ITERS`
//! iterations (6), with their medians; for profiling the learner alone (`perf record`
//! on it), without rollouts. `PROBE_SHAPE=NxL` scores N completions of L tokens
//! instead (bench/rl/async.toml's long answers: `8x256`); `PROBE_TARGETS=all` adapts
//! every linear weight, as that config does.
//!
//!     cargo build --release -p agentstack-rl --example learn_probe
//!     RAYON_NUM_THREADS=2 CANDLE_NUM_THREADS=2 target/release/examples/learn_probe MODEL.gguf
use std::time::Instant;

use agentstack_model::adapter::Target;
use agentstack_model::{LanguageModel, WeightForm};
use agentstack_rl::lora::{Lora, LoraConfig};
use agentstack_rl::policy::completion_logprobs_grouped;
use candle_core::DType;

/// The allocator of the `agentstack` binary, whose learner this times.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let path = std::env::args().nth(1).expect("model path");
    let lm = LanguageModel::load(&path, WeightForm::Dense(DType::F32)).unwrap();
    let base = lm.model().clone();
    let mut config = LoraConfig::default();
    if std::env::var("PROBE_TARGETS").as_deref() == Ok("all") {
        config.targets = Target::ALL.to_vec();
    }
    let lora = Lora::new(&base, config, 1).unwrap();
    let prompt: Vec<u32> = (0..46).map(|i| 100 + i * 37).collect();
    // PROBE_SHAPE=1x176: one completion of the same 176 tokens, to see what the
    // per-sequence attention of 8 completions costs (nothing measurable, 2026-12-02).
    let (completions, len): (u32, u32) = match std::env::var("PROBE_SHAPE") {
        Ok(shape) => {
            let (n, l) = shape
                .split_once('x')
                .expect("PROBE_SHAPE is NxL, e.g. 8x256");
            (n.parse().expect("N of NxL"), l.parse().expect("L of NxL"))
        }
        Err(_) => (8, 22),
    };
    let comps: Vec<Vec<u32>> = (0..completions)
        .map(|j| (0..len).map(|i| 200 + i * 53 + j * 7).collect())
        .collect();
    let refs: Vec<&[u32]> = comps.iter().map(|c| c.as_slice()).collect();
    let iters: usize = std::env::var("PROBE_ITERS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(6);
    let (mut forwards, mut totals) = (Vec::new(), Vec::new());
    for it in 0..iters {
        let t = Instant::now();
        let policy = lora.apply(&base).unwrap();
        let lps = completion_logprobs_grouped(&policy, &prompt, &refs).unwrap();
        let mut total = lps[0].sum_all().unwrap();
        for lp in &lps[1..] {
            total = (total + lp.sum_all().unwrap()).unwrap();
        }
        let f = t.elapsed().as_secs_f64();
        let _g = total.backward().unwrap();
        let total = t.elapsed().as_secs_f64();
        eprintln!("iter {it}: forward {f:.2}s total {total:.2}s");
        forwards.push(f);
        totals.push(total);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    eprintln!(
        "median: forward {:.2}s total {:.2}s",
        median(&mut forwards),
        median(&mut totals)
    );
}
