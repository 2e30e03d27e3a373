//! `train export` on the SmolLM2 test model: adapters merged into the GGUF file give
//! the adapted model's predictions when our runtime loads the file, and llama.cpp
//! loads and runs it. Needs the model and llama.cpp's tools from
//! `scripts/install-peers` (`#[ignore]`d; CI runs ignored tests).

use std::process::Command;

use agentstack_model::adapter::{Adapter, AdapterWeights, Target};
use agentstack_model::{LanguageModel, Logits, Model, SeqInput, WeightForm};

use agentstack_quant::types::GgmlType;
use agentstack_test_support::peers::{llama_bin, test_model};
use candle_core::{D, Device, Tensor};
use rand::{Rng, SeedableRng};

/// Log-probabilities of every next token of `tokens`.
fn logprobs(model: &Model, tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache();
    let logits = model
        .forward(&mut [SeqInput {
            cache: &mut cache,
            tokens,
            logits: Logits::All,
        }])
        .unwrap()
        .remove(0);
    candle_nn::ops::log_softmax(&logits, D::Minus1)
        .unwrap()
        .to_vec2()
        .unwrap()
}

#[test]
#[ignore = "needs the SmolLM2 model and llama.cpp from scripts/install-peers"]
fn merged_adapters_predict_like_the_adapted_model_and_llama_cpp_runs_them() {
    let base_path = test_model();
    // Compared in f32 (the learner's form), so only the merge and Q8_0's rounding of
    // the merged weights separate the two; the quantized kernels' activation
    // rounding would blur the comparison.
    let dense = WeightForm::Dense(candle_core::DType::F32);
    let base = LanguageModel::load(&base_path, dense).unwrap();
    // Adapters large enough to change the model's answers.
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    let mut weights = Vec::new();
    for (i, block) in base.model().blocks().iter().enumerate() {
        for target in [Target::Q, Target::V, Target::Down] {
            let (out, inp) = target.of(block).shape().unwrap();
            let mut values = |n: usize, s: f32| -> Vec<f32> {
                (0..n).map(|_| rng.random_range(-s..s)).collect()
            };
            weights.push(AdapterWeights {
                block: i,
                target,
                a: Tensor::from_vec(values(8 * inp, 0.05), (8, inp), &Device::Cpu).unwrap(),
                b: Tensor::from_vec(values(out * 8, 0.05), (out, 8), &Device::Cpu).unwrap(),
            });
        }
    }
    let adapter = Adapter {
        alpha: 16.0,
        rank: 8,
        weights,
    };
    let dir = tempfile::tempdir().unwrap();
    let adapter_path = dir.path().join("adapter.safetensors");
    adapter.save(&adapter_path).unwrap();
    let merged_path = dir.path().join("merged.gguf");
    let exported =
        agentstack_rl::export::export(&base_path, &adapter_path, &merged_path, GgmlType::F16)
            .unwrap();
    assert_eq!(exported.merged, 90, "{exported:?}");

    let tokens = base
        .tokenizer()
        .encode(
            "The quick brown fox jumps over the lazy dog. What is 12 + 7? The answer is 19.",
            true,
        )
        .unwrap();
    let adapted = adapter.apply(base.model()).unwrap();
    let merged = LanguageModel::load(&merged_path, dense).unwrap();
    let (want, got, plain) = (
        logprobs(&adapted, &tokens),
        logprobs(merged.model(), &tokens),
        logprobs(base.model(), &tokens),
    );
    // Next-token log-probabilities of the text: the merged file (its adapted weights
    // rounded to Q8_0) tracks the adapted model far closer than the base does.
    let gap = |a: &[Vec<f32>], b: &[Vec<f32>]| -> f32 {
        tokens[1..]
            .iter()
            .enumerate()
            .map(|(i, &t)| (a[i][t as usize] - b[i][t as usize]).abs())
            .sum::<f32>()
            / (tokens.len() - 1) as f32
    };
    let (merged_gap, base_gap) = (gap(&want, &got), gap(&want, &plain));
    eprintln!("mean |Δ log p(next)|: merged {merged_gap:.4}, base {base_gap:.4}");
    assert!(merged_gap < 0.005, "merged differs by {merged_gap}");
    assert!(
        base_gap > 10.0 * merged_gap,
        "the adapter changes too little: base {base_gap}"
    );

    // llama.cpp loads the merged file and runs it.
    let out = Command::new(llama_bin("llama-completion"))
        .arg("-m")
        .arg(&merged_path)
        .args([
            "-p",
            "What is 12 + 7?",
            "-n",
            "8",
            "--temp",
            "0",
            "-no-cnv",
            "-t",
            "2",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "llama.cpp could not run the merged file:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
