//! The learning test that can fail: a tiny random model, adapted with LoRA and trained
//! with GRPO on a task it starts out bad at, must get good at it within a fixed number
//! of steps, for two seeds. Also: LoRA starts out as its base, its gradients reach the
//! adapters, and adapters survive a save and a load.
//!
//! The task: after the prompt `[BOS, x]` (x in 1..=5) answer the token `x + 5`; reward 1
//! for it, 0 otherwise. The score is the expected reward at temperature 1 (the mean over
//! prompts of the probability of the right answer), computed exactly from the logits.

use agentstack_model::config::RopeLayout;
use agentstack_model::model::{Block, Embedding, Linear};
use agentstack_model::{Architecture, Logits, Model, ModelConfig, SeqInput, WeightForm};
use agentstack_rl::advantage::{Normalization, group_advantages};
use agentstack_rl::lora::{Lora, LoraConfig, Target};
use agentstack_rl::loss::{LossConfig, SampleTerms, policy_loss};
use agentstack_rl::optim::{Optim, OptimConfig};
use agentstack_rl::policy::{
    completion_logprobs, completion_logprobs_batch, completion_logprobs_grouped,
};
use candle_core::{D, DType, Device, Tensor};
use rand::SeedableRng;

const VOCAB: usize = 12;
const HIDDEN: usize = 32;
const PROMPTS: [u32; 5] = [1, 2, 3, 4, 5];
const GROUP: usize = 24;
const STEPS: usize = 150;
/// Where the score starts (below) and must end (above).
const START_BELOW: f64 = 0.3;
const END_ABOVE: f64 = 0.8;

fn random(rng: &mut rand_chacha::ChaCha8Rng, shape: (usize, usize), scale: f32) -> Tensor {
    use rand::Rng;
    let v: Vec<f32> = (0..shape.0 * shape.1)
        .map(|_| rng.random_range(-scale..scale))
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn tiny_model(seed: u64) -> Model {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let config = ModelConfig {
        architecture: Architecture::Llama,
        vocab_size: VOCAB,
        hidden_size: HIDDEN,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 8,
        ffn_size: 64,
        rms_eps: 1e-5,
        rope_theta: 10000.0,
        rope_layout: RopeLayout::Halves,
        context_length: 64,
    };
    let dense = |rng: &mut _, out, inp| Linear::Dense {
        weight: random(rng, (out, inp), 1.0 / (inp as f32).sqrt()),
        bias: None,
    };
    let blocks = (0..config.layers)
        .map(|_| Block {
            attn_norm: Tensor::ones(HIDDEN, DType::F32, &Device::Cpu).unwrap(),
            q: dense(&mut rng, 32, HIDDEN),
            k: dense(&mut rng, 16, HIDDEN),
            v: dense(&mut rng, 16, HIDDEN),
            o: dense(&mut rng, HIDDEN, 32),
            q_norm: None,
            k_norm: None,
            ffn_norm: Tensor::ones(HIDDEN, DType::F32, &Device::Cpu).unwrap(),
            gate: dense(&mut rng, 64, HIDDEN),
            up: dense(&mut rng, 64, HIDDEN),
            down: dense(&mut rng, HIDDEN, 64),
        })
        .collect();
    let embedding = Embedding::Dense(random(&mut rng, (VOCAB, HIDDEN), 1.0));
    // The final RMS norm fixes the hidden state's length, so the output rows' length
    // bounds how peaked the answer can get: long enough that p → 1 is reachable.
    let output = Linear::Dense {
        weight: random(&mut rng, (VOCAB, HIDDEN), 0.3),
        bias: None,
    };
    Model::assemble(
        config,
        WeightForm::Dense(DType::F32),
        embedding,
        blocks,
        Tensor::ones(HIDDEN, DType::F32, &Device::Cpu).unwrap(),
        output,
    )
    .unwrap()
}

fn last_logits(model: &Model, prompt: &[u32]) -> Vec<f32> {
    let mut cache = model.new_cache();
    model
        .forward(&mut [SeqInput {
            cache: &mut cache,
            tokens: prompt,
            logits: Logits::Last,
        }])
        .unwrap()
        .remove(0)
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// `log p(answer | [BOS, x])` for every answer token.
fn answer_logp(model: &Model, x: u32) -> Vec<f32> {
    let logits = Tensor::new(last_logits(model, &[0, x]).as_slice(), &Device::Cpu).unwrap();
    candle_nn::ops::log_softmax(&logits, D::Minus1)
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// Rank-4 adapters on every weight of `base`, and the optimizer both learning tests use.
fn adapters_and_optim(base: &Model, seed: u64) -> (Lora, Optim) {
    let lora = Lora::new(
        base,
        LoraConfig {
            rank: 4,
            alpha: 8.0,
            targets: Target::ALL.to_vec(),
        },
        seed,
    )
    .unwrap();
    let optim = Optim::new(
        lora.vars(),
        OptimConfig {
            lr: 0.012,
            max_grad_norm: Some(1.0),
            betas: (0.9, 0.99),
            ..OptimConfig::default()
        },
    )
    .unwrap();
    (lora, optim)
}

/// The expected reward at temperature 1.
fn score(model: &Model) -> f64 {
    PROMPTS
        .iter()
        .map(|&x| {
            let logits = Tensor::new(last_logits(model, &[0, x]).as_slice(), &Device::Cpu).unwrap();
            let p: Vec<f32> = candle_nn::ops::softmax(&logits, D::Minus1)
                .unwrap()
                .to_vec1()
                .unwrap();
            f64::from(p[(x + 5) as usize])
        })
        .sum::<f64>()
        / PROMPTS.len() as f64
}

/// Trains for `STEPS` and returns the score before and after, and the trained policy.
fn train(seed: u64) -> (f64, f64, Model) {
    let base = tiny_model(seed);
    let (lora, mut optim) = adapters_and_optim(&base, seed);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0x5eed);
    let before = score(&lora.apply(&base).unwrap());
    for _ in 0..STEPS {
        let policy = lora.apply(&base).unwrap();
        // Sample GROUP answers to every prompt from one batched forward pass.
        let prompts: Vec<[u32; 2]> = PROMPTS
            .iter()
            .flat_map(|&x| std::iter::repeat_n([0, x], GROUP))
            .collect();
        let mut caches: Vec<_> = prompts.iter().map(|_| policy.new_cache()).collect();
        let mut inputs: Vec<SeqInput<'_>> = caches
            .iter_mut()
            .zip(&prompts)
            .map(|(cache, p)| SeqInput {
                cache,
                tokens: p,
                logits: Logits::Last,
            })
            .collect();
        let logits = policy.forward(&mut inputs).unwrap();
        let sampled: Vec<(u32, f32)> = logits
            .iter()
            .map(|l| {
                let logp: Vec<f32> =
                    candle_nn::ops::log_softmax(&l.flatten_all().unwrap().detach(), D::Minus1)
                        .unwrap()
                        .to_vec1()
                        .unwrap();
                let u: f32 = rand::Rng::random(&mut rng);
                let mut acc = 0.0;
                let choice = logp
                    .iter()
                    .position(|lp| {
                        acc += lp.exp();
                        u < acc
                    })
                    .unwrap_or(VOCAB - 1);
                (choice as u32, logp[choice])
            })
            .collect();
        let pairs: Vec<(&[u32], [u32; 1])> = prompts
            .iter()
            .zip(&sampled)
            .map(|(p, (t, _))| (&p[..], [*t]))
            .collect();
        let pairs_ref: Vec<(&[u32], &[u32])> = pairs.iter().map(|(p, c)| (*p, &c[..])).collect();
        let logps = completion_logprobs_batch(&policy, &pairs_ref).unwrap();
        let mut terms = Vec::new();
        for (g, &x) in PROMPTS.iter().enumerate() {
            let group = g * GROUP..(g + 1) * GROUP;
            let rewards: Vec<f64> = sampled[group.clone()]
                .iter()
                .map(|(t, _)| f64::from(u8::from(*t == x + 5)))
                .collect();
            let advantages = group_advantages(&rewards, Normalization::Std);
            for (i, a) in group.zip(advantages) {
                terms.push(SampleTerms {
                    logp: logps[i].clone(),
                    old_logp: None,
                    rollout_logp: Some(vec![sampled[i].1]),
                    ref_logp: None,
                    advantages: vec![a as f32],
                    mask: vec![1.0],
                });
            }
        }
        let (loss, metrics) = policy_loss(&terms, &LossConfig::default()).unwrap();
        // The sampler and the learner run the same f32 weights: no mismatch.
        assert!(metrics.rollout_mismatch < 1e-4, "{metrics:?}");
        let mut grads = loss.backward().unwrap();
        optim.step(&mut grads).unwrap();
    }
    let policy = lora.apply(&base).unwrap();
    (before, score(&policy), policy)
}

#[test]
fn grpo_with_lora_learns_the_task_for_two_seeds() {
    for seed in [1, 2] {
        let (before, after, _) = train(seed);
        eprintln!("seed {seed}: expected reward {before:.3} -> {after:.3} in {STEPS} steps");
        assert!(
            before < START_BELOW,
            "seed {seed}: starts at {before:.3}, the task is too easy"
        );
        assert!(
            after > END_ABOVE,
            "seed {seed}: reached only {after:.3} after {STEPS} steps"
        );
    }
}

#[test]
fn adapters_start_as_the_base_and_their_gradients_reach_them() {
    let base = tiny_model(7);
    let lora = Lora::new(
        &base,
        LoraConfig {
            targets: Target::ALL.to_vec(),
            ..LoraConfig::default()
        },
        7,
    )
    .unwrap();
    let adapted = lora.apply(&base).unwrap();
    assert_eq!(
        last_logits(&base, &[0, 3, 4]),
        last_logits(&adapted, &[0, 3, 4])
    );
    // Rank 8, two blocks: q 32←32, k and v 16←32, o 32←32, gate and up 64←32,
    // down 32←64.
    let per_block = 8 * ((32 + 32) + 2 * (32 + 16) + (32 + 32) + 2 * (32 + 64) + (64 + 32));
    assert_eq!(lora.parameters(), 2 * per_block);
    let logp = completion_logprobs(&adapted, &[0, 3], &[8, 9]).unwrap();
    let grads = logp.sum_all().unwrap().backward().unwrap();
    for pair in &lora.pairs {
        // B starts at zero, so A's gradient is zero at first; B's is not.
        let gb = grads.get(pair.b.as_tensor()).expect("B gets a gradient");
        let norm: f32 = gb.sqr().unwrap().sum_all().unwrap().to_scalar().unwrap();
        assert!(norm > 0.0, "{}", pair.name);
        assert!(grads.get(pair.a.as_tensor()).is_some(), "{}", pair.name);
    }
}

#[test]
fn adapters_survive_save_and_load() {
    let base = tiny_model(3);
    let mut lora = Lora::new(
        &base,
        LoraConfig {
            rank: 2,
            alpha: 4.0,
            targets: vec![Target::O, Target::Down],
        },
        3,
    )
    .unwrap();
    // Move B off zero so the adapters change the model.
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
    for pair in &mut lora.pairs {
        let (out, r) = pair.b.as_tensor().dims2().unwrap();
        pair.b.set(&random(&mut rng, (out, r), 0.5)).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("adapter.safetensors");
    lora.save(&path).unwrap();
    let loaded = Lora::load(&path, &base).unwrap();
    assert_eq!(loaded.config, lora.config);
    let a = last_logits(&lora.apply(&base).unwrap(), &[0, 1, 2]);
    let b = last_logits(&loaded.apply(&base).unwrap(), &[0, 1, 2]);
    assert_eq!(a, b);
    assert_ne!(a, last_logits(&base, &[0, 1, 2]));
    // The merged weight is the base plus scale · B A.
    let merged = lora.apply(&base).unwrap().blocks()[0]
        .o
        .dense_weight()
        .unwrap();
    let pair = &lora.pairs[0];
    let delta = (pair.b.as_tensor().matmul(pair.a.as_tensor()).unwrap() * lora.scale()).unwrap();
    let expected = (base.blocks()[0].o.dense_weight().unwrap() + delta).unwrap();
    let diff: f32 = (merged - expected)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar()
        .unwrap();
    assert!(diff < 1e-6);
    // A file for another model is refused with the shapes it has.
    let other = tiny_model(3);
    assert!(Lora::load(&dir.path().join("missing.safetensors"), &other).is_err());
}

/// The exact reverse KL `KL(student ‖ teacher)` of the answer distributions, averaged
/// over the prompts.
fn reverse_kl(student: &Model, teacher: &Model) -> f64 {
    PROMPTS
        .iter()
        .map(|&x| {
            let (s, t) = (answer_logp(student, x), answer_logp(teacher, x));
            s.iter()
                .zip(&t)
                .map(|(ls, lt)| f64::from(ls.exp()) * f64::from(ls - lt))
                .sum::<f64>()
        })
        .sum::<f64>()
        / PROMPTS.len() as f64
}

/// On-policy distillation: a fresh student samples its own answers, and each token's
/// advantage is minus its reverse KL to the teacher (a GRPO-trained policy); no
/// reward is used. The student's reverse KL to the teacher must fall, and its score
/// move most of the way toward the teacher's.
#[test]
fn on_policy_distillation_pulls_the_student_to_the_teacher() {
    // The teacher: the model of seed 3, trained with GRPO.
    let (_, teacher_score, teacher) = train(3);
    assert!(
        teacher_score > END_ABOVE,
        "the teacher reached {teacher_score}"
    );
    // The student: another random model, so it starts far from the teacher.
    let student_base = tiny_model(5);
    let (lora, mut optim) = adapters_and_optim(&student_base, 5);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(55);
    let start = lora.apply(&student_base).unwrap();
    let (kl_before, score_before) = (reverse_kl(&start, &teacher), score(&start));
    for _ in 0..60 {
        let policy = lora.apply(&student_base).unwrap();
        let mut terms = Vec::new();
        for &x in &PROMPTS {
            let (student_logp, teacher_logp) = (answer_logp(&policy, x), answer_logp(&teacher, x));
            for _ in 0..8 {
                let u: f32 = rand::Rng::random(&mut rng);
                let mut acc = 0.0;
                let t = student_logp
                    .iter()
                    .position(|lp| {
                        acc += lp.exp();
                        u < acc
                    })
                    .unwrap_or(VOCAB - 1);
                let mut advantages = vec![0.0f32];
                agentstack_rl::advantage::add_reverse_kl(
                    &mut advantages,
                    &[student_logp[t]],
                    &[teacher_logp[t]],
                    1.0,
                );
                terms.push(SampleTerms {
                    logp: completion_logprobs(&policy, &[0, x], &[t as u32]).unwrap(),
                    old_logp: None,
                    rollout_logp: Some(vec![student_logp[t]]),
                    ref_logp: None,
                    advantages,
                    mask: vec![1.0],
                });
            }
        }
        let (loss, _) = policy_loss(&terms, &LossConfig::default()).unwrap();
        let mut grads = loss.backward().unwrap();
        optim.step(&mut grads).unwrap();
    }
    let end = lora.apply(&student_base).unwrap();
    let (kl_after, score_after) = (reverse_kl(&end, &teacher), score(&end));
    eprintln!(
        "reverse KL {kl_before:.3} -> {kl_after:.3}; score {score_before:.3} -> {score_after:.3} (teacher {teacher_score:.3})"
    );
    assert!(
        kl_after < 0.25 * kl_before,
        "reverse KL {kl_before} -> {kl_after}"
    );
    assert!(
        (teacher_score - score_after).abs() < 0.5 * (teacher_score - score_before).abs(),
        "score {score_before} -> {score_after}, teacher {teacher_score}"
    );
}

/// Scoring a group's completions after one shared pass over their prompt gives the
/// values and the adapter gradients of scoring each whole sequence.
#[test]
fn a_shared_prompt_scores_and_differentiates_like_whole_sequences() {
    let base = tiny_model(4);
    let mut lora = Lora::new(
        &base,
        LoraConfig {
            rank: 2,
            alpha: 4.0,
            targets: Target::ALL.to_vec(),
        },
        4,
    )
    .unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(8);
    for pair in &mut lora.pairs {
        let (out, r) = pair.b.as_tensor().dims2().unwrap();
        pair.b.set(&random(&mut rng, (out, r), 0.3)).unwrap();
    }
    let policy = lora.apply(&base).unwrap();
    let prompt = [0u32, 3, 7, 2];
    let completions: [&[u32]; 4] = [&[5, 6, 1], &[8], &[4, 4, 4, 4, 9], &[10, 2]];
    let pairs: Vec<(&[u32], &[u32])> = completions.iter().map(|c| (&prompt[..], *c)).collect();
    let whole = completion_logprobs_batch(&policy, &pairs).unwrap();
    let grouped = completion_logprobs_grouped(&policy, &prompt, &completions)
        .map_err(|e| format!("{e:?}"))
        .unwrap();
    let weights = [1.0f64, -2.0, 0.5, 3.0];
    let objective = |lps: &[Tensor]| {
        lps.iter()
            .zip(weights)
            .map(|(t, w)| (t.sum_all().unwrap() * w).unwrap())
            .reduce(|a, b| (a + b).unwrap())
            .unwrap()
    };
    for (a, b) in whole.iter().zip(&grouped) {
        let (a, b): (Vec<f32>, Vec<f32>) = (a.to_vec1().unwrap(), b.to_vec1().unwrap());
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() < 1e-5, "{a:?} vs {b:?}");
        }
    }
    let g_whole = objective(&whole).backward().unwrap();
    let g_grouped = objective(&grouped).backward().unwrap();
    for var in lora.vars() {
        let a = g_whole.get(var.as_tensor()).unwrap();
        let b = g_grouped.get(var.as_tensor()).unwrap();
        let diff: f32 = (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar()
            .unwrap();
        let scale: f32 = a.abs().unwrap().max_all().unwrap().to_scalar().unwrap();
        assert!(
            diff <= 1e-4 * scale.max(1.0),
            "gradient differs by {diff} (scale {scale})"
        );
    }
}
