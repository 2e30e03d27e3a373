//! The training loop behind `agentstack train grpo|distill|sft`.
//!
//! Each step: pick the step's tasks (a seeded permutation of the environment's train
//! split, so the data position is just the step number), play `group_size` episodes
//! of each through the harness on the in-process engine (quantized weights plus the
//! current adapters), turn rewards into group advantages, and learn on the very
//! token ids the engine sampled (never re-tokenized) with the adapters on the f32
//! weights; then push the new adapters to the engine (and to any `model serve`),
//! timing the sync. Metrics go to `metrics.jsonl`, a held-out evaluation runs every
//! `eval.every` steps, the reward curve is drawn to `reward.png`, and checkpoints
//! (adapters, optimizer moments, the step) let a killed run resume exactly: every
//! random choice derives from the run's seed and the step, and the rollout engine's
//! kernels give the same bits whatever the batch.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use agentstack_harness::episode::{LoopConfig, play};
use agentstack_harness::prompt::Presenter;
use agentstack_harness::{
    ContextPolicy, EnvHandle, EvalConfig, ModelClient, Profile, Run, Sampling,
};
use agentstack_model::engine::{Engine, EngineConfig};
use agentstack_model::server::{API_KEY_ENV, ApiKey};
use agentstack_model::{LanguageModel, Model, WeightForm};
use agentstack_protocol::http::ResetRequest;
use candle_core::{DType, Tensor};
use futures_util::StreamExt as _;
use rand::SeedableRng;
use rand::seq::SliceRandom;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::advantage::{
    add_reverse_kl, group_advantages, is_informative, overlong_mask, overlong_penalty,
};
use crate::config::{Algorithm, RolloutWeights, TrainConfig};
use crate::lora::Lora;
use crate::loss::{Aggregation, LossConfig, SampleTerms, policy_loss};
use crate::optim::{Optim, accumulate};
use crate::policy::completion_logprobs_grouped;

/// The engine's adapter slot the rollouts run on.
pub const POLICY_ADAPTER: &str = "policy";

/// The slot held-out evaluations run on (apart, so an evaluation never changes the
/// weights under rollouts running one step ahead).
pub const EVAL_ADAPTER: &str = "eval";

/// Why training stopped.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The configuration cannot run (the message says what to change).
    #[error("{0}")]
    Config(String),
    /// A configuration value is invalid.
    #[error(transparent)]
    InvalidConfig(#[from] crate::config::ConfigError),
    /// The prompt profile does not compile.
    #[error(transparent)]
    Profile(#[from] agentstack_harness::prompt::ProfileError),
    /// The environment's task list could not be read.
    #[error("{env}: cannot read the tasks of split `{split}`")]
    Tasks {
        /// The environment.
        env: String,
        /// The split.
        split: String,
        /// What the task list said.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Reading or writing the run directory.
    #[error("cannot read or write {}", path.display())]
    Io {
        /// Which file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A JSON file of the run (a checkpoint's state, an eval run's records) is unreadable.
    #[error("{}{}", path.display(), line.map(|n| format!(":{n}")).unwrap_or_default())]
    Json {
        /// Which file.
        path: PathBuf,
        /// The line, in a JSON-lines file.
        line: Option<usize>,
        /// What the parser said.
        #[source]
        source: serde_json::Error,
    },
    /// A model file could not be loaded.
    #[error("cannot load the {role} {}", path.display())]
    LoadModel {
        /// Which model: `model` or `teacher`.
        role: &'static str,
        /// Its file.
        path: PathBuf,
        /// Why.
        #[source]
        source: Box<agentstack_model::ModelError>,
    },
    /// The model runtime failed.
    #[error("model: {what}")]
    Model {
        /// What it was doing.
        what: &'static str,
        /// Why it failed.
        #[source]
        source: Box<agentstack_model::ModelError>,
    },
    /// A tensor operation of the learner (adapters, optimizer, loss) failed.
    #[error("model: {what}")]
    Tensor {
        /// What it was doing.
        what: &'static str,
        /// Why it failed.
        #[source]
        source: candle_core::Error,
    },
    /// Adapters or optimizer moments could not be read or written.
    #[error("model: cannot {action} {}", path.display())]
    Tensors {
        /// `read` or `write`.
        action: &'static str,
        /// Which file.
        path: PathBuf,
        /// Why.
        #[source]
        source: candle_core::Error,
    },
    /// A task of the trainer panicked or was cancelled.
    #[error("{what} stopped before it finished")]
    Join {
        /// Which task.
        what: &'static str,
        /// Why.
        #[source]
        source: tokio::task::JoinError,
    },
    /// An episode could not be played (the environment or the engine failed).
    #[error("rollout: an episode could not be played")]
    Episode(#[source] Box<agentstack_harness::episode::EpisodeError>),
    /// A held-out evaluation failed.
    #[error("held-out evaluation in {}", dir.display())]
    Eval {
        /// The evaluation's run directory.
        dir: PathBuf,
        /// Why.
        #[source]
        source: Box<agentstack_harness::run::RunError>,
    },
    /// A model server refused the adapters, or kept failing until the wait ran out
    /// (the message holds the server's answer).
    #[error("rollout: {0}")]
    Sync(String),
    /// A model server could not be reached until the wait ran out.
    #[error(
        "rollout: {url}: still failing after {waited_s} s; sync.wait_seconds sets how long to retry"
    )]
    SyncUnreachable {
        /// The adapters endpoint.
        url: String,
        /// Seconds retried.
        waited_s: u64,
        /// The last failure.
        #[source]
        source: reqwest::Error,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::Io {
        path: path.to_owned(),
        source,
    }
}

/// A learner's tensor error, with what it was doing.
fn tensor(what: &'static str) -> impl FnOnce(candle_core::Error) -> TrainError {
    move |source| TrainError::Tensor { what, source }
}

/// Reading (`action` = `read`) or writing adapters or optimizer moments at `path`.
fn tensors<'a>(
    action: &'static str,
    path: &'a Path,
) -> impl FnOnce(candle_core::Error) -> TrainError + 'a {
    move |source| TrainError::Tensors {
        action,
        path: path.to_owned(),
        source,
    }
}

/// A task of the trainer that did not finish.
fn join(what: &'static str) -> impl FnOnce(tokio::task::JoinError) -> TrainError {
    move |source| TrainError::Join { what, source }
}

/// A step's episodes (with their task index) and the seconds they took.
type Rollout = (Vec<(usize, agentstack_harness::Episode)>, f64);

/// Samples with their per-token advantages and loss masks.
type Shaped = (Vec<Sample>, Vec<Vec<f32>>, Vec<Vec<f32>>);

/// One sampled completion, as the learner takes it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// The group (the step's task index).
    pub group: usize,
    /// Prompt token ids, as the engine saw them.
    pub prompt: Vec<u32>,
    /// Completion token ids, as sampled.
    pub completion: Vec<u32>,
    /// The rollout engine's log-probability of each completion token.
    pub logprobs: Vec<f32>,
    /// The episode's reward.
    pub reward: f64,
    /// Whether the completion hit the token limit.
    pub truncated: bool,
}

/// One line of `metrics.jsonl`. Fields ending in `_s` or `_ms` are wall times; the
/// rest is determined by the configuration (a resumed run writes the same values).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// The step (from 1).
    pub step: usize,
    /// Mean episode reward of the step's rollouts.
    pub reward_mean: f64,
    /// Its standard deviation.
    pub reward_std: f64,
    /// Samples learned from.
    pub samples: usize,
    /// Groups kept (dynamic sampling drops the uninformative ones).
    pub groups_kept: usize,
    /// Completion tokens learned from.
    pub tokens: usize,
    /// Mean completion length.
    pub completion_len: f64,
    /// The loss.
    pub loss: f64,
    /// Fraction of clipped ratios.
    pub clip_fraction: f64,
    /// Mean KL estimate to the reference (with a KL term).
    pub kl: f64,
    /// Mean |log π_learner − log π_rollout| over trained tokens.
    pub rollout_mismatch: f64,
    /// Seconds the teacher took to score the step's samples (distillation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub teacher_s: Option<f64>,
    /// Mean reverse KL to the teacher (distillation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reverse_kl: Option<f64>,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Learning rate of the step.
    pub lr: f64,
    /// Held-out mean reward after this step, when evaluated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_reward: Option<f64>,
    /// Its 95% confidence interval.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_ci95: Option<(f64, f64)>,
    /// Seconds generating the step's rollouts.
    pub generate_s: f64,
    /// Seconds learning.
    pub learn_s: f64,
    /// Milliseconds pushing the adapters to the rollout engine.
    pub sync_ms: f64,
    /// Milliseconds pushing them to `model serve` processes (when configured).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_sync_ms: Option<f64>,
}

/// What a finished run reports.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The run directory.
    pub dir: PathBuf,
    /// Steps in the run.
    pub steps: usize,
    /// The step it resumed from (0: a fresh start).
    pub resumed_from: usize,
    /// Whether it stopped early (asked to), with a checkpoint of the last step.
    pub stopped_at: Option<usize>,
    /// Held-out reward before training, and after.
    pub eval_before: Option<(f64, (f64, f64))>,
    /// After the last step.
    pub eval_after: Option<(f64, (f64, f64))>,
}

/// What a run needs besides its configuration.
pub struct Setup {
    /// The configuration.
    pub config: TrainConfig,
    /// Which algorithm.
    pub algorithm: Algorithm,
    /// The run directory (`runs/<id>`).
    pub dir: PathBuf,
    /// The environment, opened (unused by SFT).
    pub env: Option<EnvHandle>,
    /// Discard an existing run in `dir` instead of resuming it.
    pub fresh: bool,
    /// Set (e.g. on SIGTERM) to stop after the current step with a checkpoint.
    pub stop: Arc<std::sync::atomic::AtomicBool>,
}

/// SplitMix64 of several words: the seed of one episode or one shuffle.
fn mix(words: &[u64]) -> u64 {
    let mut z = 0x9E37_79B9_7F4A_7C15u64;
    for &w in words {
        z ^= w;
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
    }
    z
}

/// The item at `position` of an endless sequence of passes over `0..n`, each pass a
/// new permutation seeded from `salt` and the pass number: where a run's data
/// position is, from the step alone.
fn shuffled(salt: &[u64], n: usize, position: u64) -> usize {
    let pass = position / n as u64;
    let mut order: Vec<usize> = (0..n).collect();
    let seed = mix(&[salt, &[pass]].concat());
    order.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(seed));
    order[(position % n as u64) as usize]
}

struct Learner {
    base: Model,
    reference: Option<Model>,
    lora: Lora,
    optim: Optim,
    loss: LossConfig,
    micro_batch: usize,
}

/// What one learning step produced.
#[derive(Debug, Default)]
struct Learned {
    loss: f64,
    clip_fraction: f64,
    kl: f64,
    mismatch: f64,
    tokens: usize,
    grad_norm: f64,
    lr: f64,
}

impl Learner {
    /// One optimizer step on `samples` with per-token `advantages` and `masks`;
    /// `sft` trains the plain log-likelihood instead of the policy loss.
    fn step(
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
        let (mut clipped, mut kl, mut mismatch) = (0.0, 0.0, 0.0);
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
                mismatch += metrics.rollout_mismatch * chunk_tokens / total_tokens;
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
        out.mismatch = mismatch;
        out.tokens = total_tokens as usize;
        out.grad_norm = report.grad_norm;
        out.lr = report.lr;
        Ok(out)
    }
}

/// `POST {server}/v1/adapters` with `body`, bearing `key` when there is one. A server
/// that cannot be reached or answers 5xx (still starting, or being replaced by its
/// supervisor) is retried, backing off from 0.25 s to 4 s, for up to `wait`; any other
/// failure, or the last one, ends the run with the server's answer.
async fn push_adapter(
    http: &reqwest::Client,
    server: &str,
    key: Option<&ApiKey>,
    body: &Value,
    wait: std::time::Duration,
) -> Result<(), TrainError> {
    let url = format!("{}/v1/adapters", server.trim_end_matches('/'));
    let deadline = Instant::now() + wait;
    let mut pause = std::time::Duration::from_millis(250);
    loop {
        let mut request = http.post(&url).json(body);
        if let Some(key) = key {
            request = request.bearer_auth(key.expose());
        }
        let failure = match request.send().await {
            Ok(response) if response.status().is_success() => return Ok(()),
            Ok(response) => {
                let status = response.status();
                let text = response.text().await.unwrap_or_default();
                let mut message = format!("{url}: {status}: {text}");
                if status == reqwest::StatusCode::UNAUTHORIZED {
                    message.push_str(&format!(
                        "\nhint: set {API_KEY_ENV} (or the variable [sync] api_key_env names) in the trainer's environment to the server's API key"
                    ));
                } else if status == reqwest::StatusCode::FORBIDDEN
                    || text.contains("adapter directory")
                {
                    message.push_str("\nhint: start the model server with --adapter-dir set to this trainer's runs directory");
                }
                if !status.is_server_error() {
                    return Err(TrainError::Sync(message));
                }
                if Instant::now() + pause > deadline {
                    return Err(TrainError::Sync(format!(
                        "{message} (still failing after {} s; sync.wait_seconds sets how long to retry)",
                        wait.as_secs()
                    )));
                }
                message
            }
            Err(source) => {
                if Instant::now() + pause > deadline {
                    return Err(TrainError::SyncUnreachable {
                        url,
                        waited_s: wait.as_secs(),
                        source,
                    });
                }
                format!("{url}: {source}")
            }
        };
        tracing::warn!(server = %url, error = %failure, "adapter push failed; retrying");
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(std::time::Duration::from_secs(4));
    }
}

/// A checkpoint's `state.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct CheckpointState {
    /// Steps done.
    step: usize,
    /// Lines of `metrics.jsonl` that belong to those steps.
    metrics_lines: usize,
}

fn checkpoint_dir(dir: &Path, step: usize) -> PathBuf {
    dir.join("checkpoints").join(format!("step-{step:06}"))
}

/// The newest complete checkpoint (written to `.partial` and renamed).
fn latest_checkpoint(dir: &Path) -> Option<(usize, PathBuf)> {
    let entries = fs::read_dir(dir.join("checkpoints")).ok()?;
    entries
        .filter_map(|e| {
            let e = e.ok()?;
            let name = e.file_name().into_string().ok()?;
            let step = name.strip_prefix("step-")?.parse::<usize>().ok()?;
            e.path()
                .join("state.json")
                .is_file()
                .then(|| (step, e.path()))
        })
        .max_by_key(|(s, _)| *s)
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    let tmp = path.with_extension("partial");
    let mut f = fs::File::create(&tmp).map_err(io(&tmp))?;
    f.write_all(bytes).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    fs::rename(&tmp, path).map_err(io(path))
}

/// Keeps the first `lines` lines of a JSON-lines file (and drops a torn last line).
fn truncate_lines(path: &Path, lines: usize) -> Result<(), TrainError> {
    let text = match fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io(path)(e)),
    };
    let kept: String = text
        .split_inclusive('\n')
        .filter(|l| l.ends_with('\n'))
        .take(lines)
        .collect();
    write_atomic(path, kept.as_bytes())
}

/// A failure of `env`'s task list for `split` (its error type lives in the environment
/// crate, which the trainer reaches only through the harness).
fn task_list<E: std::error::Error + Send + Sync + 'static>(
    env: &EnvHandle,
    split: &str,
) -> impl FnOnce(E) -> TrainError {
    let (env, split) = (env.name().to_owned(), split.to_owned());
    move |source| TrainError::Tasks {
        env,
        split,
        source: Box::new(source),
    }
}

/// The run's task resets for one step: `prompts` tasks from a seeded permutation of
/// the split (a new one each pass over it), or seeded problems without a split.
fn step_resets(
    config: &TrainConfig,
    env: &EnvHandle,
    step: usize,
) -> Result<Vec<ResetRequest>, TrainError> {
    let per_step = config.rollout.prompts_per_step;
    let mut resets = Vec::with_capacity(per_step);
    for j in 0..per_step {
        let position = (step * per_step + j) as u64;
        let mut options = config.env_options.clone();
        let mut seed = Some(mix(&[config.seed, 0x7a5c, position]) >> 1);
        if let Some(split) = config.rollout.split.as_deref().filter(|s| !s.is_empty()) {
            let tasks = env.tasks().ok_or_else(|| {
                TrainError::Config(format!(
                    "{} publishes no task list; set rollout.split = \"\" to train on seeded resets",
                    env.name()
                ))
            })?;
            let n = tasks.num_tasks(split).map_err(task_list(env, split))? as u64;
            if n == 0 {
                return Err(TrainError::Config(format!("split `{split}` has no tasks")));
            }
            let index = shuffled(&[config.seed], n as usize, position);
            let args = tasks.task(split, index).map_err(task_list(env, split))?;
            agentstack_harness::run::apply_task(args, &mut options, &mut seed);
        }
        resets.push(ResetRequest {
            seed,
            episode_id: Some(format!("train-{step}-{j}")),
            options,
        });
    }
    Ok(resets)
}

/// Plays the step's episodes: `group_size` per reset, each seeded from the run's seed,
/// the step and its place, so the same step always samples the same way.
async fn rollouts(
    config: &TrainConfig,
    model: &ModelClient,
    env: &EnvHandle,
    presenter: &Presenter,
    step: usize,
    resets: Vec<ResetRequest>,
) -> Result<Vec<(usize, agentstack_harness::Episode)>, TrainError> {
    let play_config = LoopConfig {
        max_turns: config.rollout.max_turns,
        sampling: Sampling {
            temperature: config.rollout.temperature,
            top_p: config.rollout.top_p,
            max_tokens: config.rollout.max_tokens,
        },
        context: ContextPolicy::default(),
        constrain: false,
    };
    let group = config.rollout.group_size;
    let jobs: Vec<(usize, usize, ResetRequest)> = resets
        .into_iter()
        .enumerate()
        .flat_map(|(j, r)| (0..group).map(move |i| (j, i, r.clone())))
        .collect();
    let mut results: Vec<Option<(usize, agentstack_harness::Episode)>> = vec![None; jobs.len()];
    let play_config = &play_config;
    let mut stream = futures_util::stream::iter(jobs.into_iter().enumerate().map(
        |(index, (j, i, reset))| async move {
            let seed = mix(&[config.seed, step as u64, j as u64, i as u64]);
            let played = play(model, env, presenter, reset, seed, play_config).await;
            (index, j, played)
        },
    ))
    .buffer_unordered(config.rollout.concurrency);
    while let Some((index, j, played)) = stream.next().await {
        let (episode, _) = played.map_err(|e| TrainError::Episode(Box::new(e)))?;
        results[index] = Some((j, episode));
    }
    Ok(results.into_iter().flatten().collect())
}

fn samples_of(episodes: &[(usize, agentstack_harness::Episode)]) -> Vec<Sample> {
    let mut samples = Vec::new();
    for (group, episode) in episodes {
        for turn in &episode.turns {
            let (Some(prompt), Some(completion), Some(logprobs)) =
                (&turn.prompt_ids, &turn.completion_ids, &turn.logprobs)
            else {
                continue;
            };
            if completion.is_empty() {
                continue;
            }
            samples.push(Sample {
                group: *group,
                prompt: prompt.clone(),
                completion: completion.clone(),
                logprobs: logprobs.clone(),
                reward: episode.reward,
                truncated: turn.finish_reason == "length",
            });
        }
    }
    samples
}

fn mean_std(xs: &[f64]) -> (f64, f64) {
    if xs.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
    (mean, var.sqrt())
}

/// Trains as `setup` says, resuming from the newest checkpoint in its directory;
/// `on_step` sees every step's metrics (and `on_eval` every evaluation) as they are
/// written.
pub async fn train(
    setup: Setup,
    mut on_step: impl FnMut(&StepMetrics),
) -> Result<Report, TrainError> {
    let Setup {
        config,
        algorithm,
        dir,
        env,
        fresh,
        stop,
    } = setup;
    config.check()?;
    // The adapter pushes' key, from the trainer's environment (never the file).
    let sync_key = if config.sync.servers.is_empty() {
        None
    } else {
        config.sync.api_key()?
    };
    if fresh && dir.exists() {
        fs::remove_dir_all(&dir).map_err(io(&dir))?;
    }
    fs::create_dir_all(dir.join("checkpoints")).map_err(io(&dir))?;
    // A run directory belongs to one configuration.
    let recorded = json!({"algorithm": algorithm, "config": config});
    let config_path = dir.join("config.json");
    match fs::read_to_string(&config_path) {
        Ok(text) => {
            let found: Value = serde_json::from_str(&text).unwrap_or_default();
            if found != recorded {
                return Err(TrainError::Config(format!(
                    "{} holds a run with another configuration; pick another run id, or pass --fresh to discard it",
                    dir.display()
                )));
            }
        }
        Err(_) => write_atomic(
            &config_path,
            &serde_json::to_vec_pretty(&recorded).unwrap_or_default(),
        )?,
    }

    let load = |form| {
        let path = config.model.clone();
        move || LanguageModel::load(&path, form)
    };
    let load_error = |source| TrainError::LoadModel {
        role: "model",
        path: config.model.clone(),
        source: Box::new(source),
    };
    let learner_lm = tokio::task::spawn_blocking(load(WeightForm::Dense(DType::F32)))
        .await
        .map_err(join("loading the model"))?
        .map_err(load_error)?;
    let rollout_lm = match config.rollout.weights {
        RolloutWeights::F32 => learner_lm.clone(),
        RolloutWeights::Quantized => tokio::task::spawn_blocking(load(WeightForm::Quantized))
            .await
            .map_err(join("loading the model"))?
            .map_err(load_error)?,
    };
    let rollout_lm = Arc::new(rollout_lm);
    let engine = Engine::start(
        rollout_lm.clone(),
        EngineConfig {
            max_running: config.rollout.concurrency.max(1),
            ..EngineConfig::default()
        },
    );
    let run_id = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "run".into());
    let model_client = ModelClient::engine_adapter(engine.clone(), &run_id, Some(POLICY_ADAPTER));
    let eval_client = ModelClient::engine_adapter(engine.clone(), &run_id, Some(EVAL_ADAPTER));

    let lora_config = config.lora_config()?;
    let base = learner_lm.model().clone();
    let mut lora =
        Lora::new(&base, lora_config, config.seed).map_err(tensor("creating the adapters"))?;
    let mut optim = Optim::new(lora.vars(), config.optim_config()?)
        .map_err(tensor("creating the optimizer"))?;
    let metrics_path = dir.join("metrics.jsonl");
    let mut start = 0;
    // The adapters that sampled the batch of the next step (staleness 1).
    let mut previous: Option<Lora> = None;
    if let Some((step, path)) = latest_checkpoint(&dir) {
        let adapter = path.join("adapter.safetensors");
        lora = Lora::load(&adapter, &base).map_err(tensors("read", &adapter))?;
        optim = Optim::new(lora.vars(), optim.config().clone())
            .map_err(tensor("creating the optimizer"))?;
        let moments = path.join("optim.safetensors");
        optim.load(&moments).map_err(tensors("read", &moments))?;
        let prev = path.join("adapter_prev.safetensors");
        if prev.is_file() {
            previous = Some(Lora::load(&prev, &base).map_err(tensors("read", &prev))?);
        }
        let state_path = path.join("state.json");
        let state: CheckpointState = serde_json::from_slice(
            &fs::read(&state_path).map_err(io(&state_path))?,
        )
        .map_err(|source| TrainError::Json {
            path: state_path.clone(),
            line: None,
            source,
        })?;
        truncate_lines(&metrics_path, state.metrics_lines)?;
        start = step;
        tracing::info!(step, "resuming from checkpoint");
    } else {
        truncate_lines(&metrics_path, 0)?;
    }
    let mut metrics_lines = fs::read_to_string(&metrics_path)
        .map(|t| t.lines().count())
        .unwrap_or(0);

    let teacher = match (&config.distill, algorithm) {
        (Some(d), Algorithm::Distill) => {
            let path = d.teacher.clone();
            let teacher = tokio::task::spawn_blocking(move || {
                LanguageModel::load(&path, WeightForm::Quantized)
            })
            .await
            .map_err(join("loading the teacher"))?
            .map_err(|source| TrainError::LoadModel {
                role: "teacher",
                path: d.teacher.clone(),
                source: Box::new(source),
            })?;
            if teacher.model().config().vocab_size != base.config().vocab_size {
                return Err(TrainError::Config(
                    "the teacher's vocabulary differs from the student's; distillation needs the same tokenizer".into(),
                ));
            }
            Some(Arc::new(teacher))
        }
        (None, Algorithm::Distill) => {
            return Err(TrainError::Config(
                "train distill needs a [distill] section with teacher = \"teacher.gguf\"".into(),
            ));
        }
        _ => None,
    };
    let reference = (config.loss.kl != "none" && config.loss.kl_coef > 0.0).then(|| base.clone());
    let loss_config = config.loss_config()?;
    let normalization = config.normalization()?;
    let learner = Arc::new(Mutex::new(Learner {
        base: base.clone(),
        reference,
        lora: lora.clone(),
        optim,
        loss: loss_config,
        micro_batch: config.optim.micro_batch,
    }));

    // SFT data, from eval runs.
    let sft_samples = match algorithm {
        Algorithm::Sft => Some(sft_data(&config)?),
        _ => None,
    };
    let presenter = match &env {
        Some(env) => Some(Presenter::new(
            config
                .profile
                .clone()
                .unwrap_or_else(|| Profile::for_env(env.name())),
            env.description(),
            &env.schema().action,
            env.tools(),
        )?),
        None => None,
    };
    if algorithm != Algorithm::Sft && env.is_none() {
        return Err(TrainError::Config(
            "training on rollouts needs an environment (env = ...)".into(),
        ));
    }

    let rollout_base = rollout_lm.model().clone();
    let sync_to = |slot: &str, lora: &Lora| -> Result<f64, TrainError> {
        let t = Instant::now();
        let adapter = lora.snapshot().map_err(tensor("copying the adapters"))?;
        let adapted = adapter
            .apply(&rollout_base)
            .map_err(|source| TrainError::Model {
                what: "applying the adapters to the rollout model",
                source: Box::new(source),
            })?;
        engine.set_adapter(slot, adapted);
        Ok(t.elapsed().as_secs_f64() * 1e3)
    };
    let sync = |lora: &Lora| sync_to(POLICY_ADAPTER, lora);
    let http = reqwest::Client::new();
    let adapter_name = config.sync.name.clone().unwrap_or_else(|| run_id.clone());

    let evaluate = |step: usize, lora: &Lora| {
        let synced = sync_to(EVAL_ADAPTER, lora);
        let dir = dir.clone();
        let env = env.clone();
        let config = config.clone();
        let client = eval_client.clone();
        async move {
            synced?;
            eval_at(&config, &dir, env.as_ref(), &client, step).await
        }
    };
    let mut report = Report {
        dir: dir.clone(),
        steps: config.steps,
        resumed_from: start,
        stopped_at: None,
        eval_before: None,
        eval_after: None,
    };
    let mut evals: BTreeMap<usize, (f64, (f64, f64))> = read_evals(&metrics_path);
    if start == 0 && config.eval.every > 0 && env.is_some() {
        let before = evaluate(0, &lora).await?;
        evals.insert(0, before);
        fs::write(
            dir.join("eval-0.json"),
            serde_json::to_vec(&before).unwrap_or_default(),
        )
        .map_err(io(&dir))?;
    }
    if let Ok(bytes) = fs::read(dir.join("eval-0.json")) {
        report.eval_before = serde_json::from_slice(&bytes).ok();
    }

    // The batch of the next step when rollouts run one step ahead.
    let mut pending: Option<tokio::task::JoinHandle<Result<Rollout, TrainError>>> = None;
    let ahead = config.rollout.max_staleness > 0;
    let env_arc = env.clone().map(Arc::new);
    let presenter_arc = presenter.map(Arc::new);
    let config_arc = Arc::new(config.clone());
    let spawn_rollout = |step: usize| {
        let (config, model_client) = (config_arc.clone(), model_client.clone());
        let (env, presenter) = (env_arc.clone(), presenter_arc.clone());
        tokio::spawn(async move {
            let (env, presenter) = (
                env.expect("checked above"),
                presenter.expect("checked above"),
            );
            let t = Instant::now();
            let resets = step_resets(&config, &env, step)?;
            let episodes = rollouts(&config, &model_client, &env, &presenter, step, resets).await?;
            Ok((episodes, t.elapsed().as_secs_f64()))
        })
    };

    for step in start..config.steps {
        let mut m = StepMetrics {
            step: step + 1,
            ..StepMetrics::default()
        };
        let (samples, advantages, masks) = if let Some(data) = &sft_samples {
            let batch = sft_batch(data, &config, step);
            let masks: Vec<Vec<f32>> = batch
                .iter()
                .map(|s| vec![1.0; s.completion.len()])
                .collect();
            let advantages = masks.clone();
            m.reward_mean = f64::NAN;
            (batch, advantages, masks)
        } else {
            // The rollouts of this step: started during the last step (one step
            // ahead), or now on the current adapters.
            let handle = match pending.take() {
                Some(handle) => handle,
                None => {
                    // Resuming one step ahead: the batch was sampled by the adapters
                    // from before the last step.
                    let sampler = if ahead {
                        previous.as_ref().unwrap_or(&lora)
                    } else {
                        &lora
                    };
                    m.sync_ms += sync(sampler)?;
                    spawn_rollout(step)
                }
            };
            let (episodes, generate_s) = handle.await.map_err(join("the step's rollouts"))??;
            m.generate_s = generate_s;
            if ahead && step + 1 < config.steps {
                // The next batch samples from the adapters as they are now (before
                // this step learns).
                m.sync_ms += sync(&lora)?;
                pending = Some(spawn_rollout(step + 1));
            }
            let samples = samples_of(&episodes);
            let rewards: Vec<f64> = episodes.iter().map(|(_, e)| e.reward).collect();
            (m.reward_mean, m.reward_std) = mean_std(&rewards);
            // Off the async runtime: with a teacher, shaping scores every sample.
            let (shaped, metrics) = {
                let (config, teacher) = (config.clone(), teacher.clone());
                let mut metrics = std::mem::take(&mut m);
                tokio::task::spawn_blocking(move || {
                    let shaped = shape(
                        &config,
                        samples,
                        normalization,
                        teacher.as_deref(),
                        &mut metrics,
                    );
                    (shaped, metrics)
                })
                .await
                .map_err(join("shaping the rewards"))?
            };
            m = metrics;
            shaped?
        };
        m.samples = samples.len();
        m.completion_len = if samples.is_empty() {
            0.0
        } else {
            samples.iter().map(|s| s.completion.len()).sum::<usize>() as f64 / samples.len() as f64
        };
        // A copy of the values: `lora`'s variables are the learner's own, which the
        // optimizer step below changes in place.
        let before_learning = lora
            .snapshot()
            .and_then(|adapter| Lora::from_adapter(&adapter))
            .map_err(tensor("copying the adapters"))?;
        if !samples.is_empty() {
            let t = Instant::now();
            let learner = learner.clone();
            let sft = algorithm == Algorithm::Sft;
            let learned = tokio::task::spawn_blocking(move || {
                learner
                    .lock()
                    .expect("learner lock")
                    .step(&samples, &advantages, &masks, sft)
            })
            .await
            .map_err(join("the learning step"))?
            .map_err(tensor("the learning step"))?;
            m.learn_s = t.elapsed().as_secs_f64();
            m.loss = learned.loss;
            m.clip_fraction = learned.clip_fraction;
            m.kl = learned.kl;
            m.rollout_mismatch = learned.mismatch;
            m.tokens = learned.tokens;
            m.grad_norm = learned.grad_norm;
            m.lr = learned.lr;
        }
        lora = learner.lock().expect("learner lock").lora.clone();
        previous = Some(before_learning);
        if !config.sync.servers.is_empty() {
            let t = Instant::now();
            let path = dir.join("adapter.safetensors");
            lora.save(&path).map_err(tensors("write", &path))?;
            let wait = std::time::Duration::from_secs(config.sync.wait_seconds);
            let body = json!({"name": adapter_name, "path": path});
            for server in &config.sync.servers {
                push_adapter(&http, server, sync_key.as_ref(), &body, wait).await?;
            }
            m.remote_sync_ms = Some(t.elapsed().as_secs_f64() * 1e3);
        }
        let stopping = stop.load(std::sync::atomic::Ordering::SeqCst);
        let last = step + 1 == config.steps;
        if config.eval.every > 0 && env.is_some() && ((step + 1) % config.eval.every == 0 || last) {
            let (mean, ci) = evaluate(step + 1, &lora).await?;
            m.eval_reward = Some(mean);
            m.eval_ci95 = Some(ci);
            evals.insert(step + 1, (mean, ci));
        }
        let line = serde_json::to_string(&m).unwrap_or_default();
        let mut file = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&metrics_path)
            .map_err(io(&metrics_path))?;
        writeln!(file, "{line}").map_err(io(&metrics_path))?;
        file.sync_data().map_err(io(&metrics_path))?;
        metrics_lines += 1;
        on_step(&m);
        if last
            || stopping
            || (config.checkpoint.every > 0 && (step + 1) % config.checkpoint.every == 0)
        {
            let optim_path;
            {
                let learner = learner.lock().expect("learner lock");
                let target = checkpoint_dir(&dir, step + 1);
                let partial = target.with_extension("partial");
                let _ = fs::remove_dir_all(&partial);
                fs::create_dir_all(&partial).map_err(io(&partial))?;
                let adapter = partial.join("adapter.safetensors");
                learner
                    .lora
                    .save(&adapter)
                    .map_err(tensors("write", &adapter))?;
                optim_path = partial.join("optim.safetensors");
                learner
                    .optim
                    .save(&optim_path)
                    .map_err(tensors("write", &optim_path))?;
                if ahead && let Some(prev) = &previous {
                    let prev_path = partial.join("adapter_prev.safetensors");
                    prev.save(&prev_path)
                        .map_err(tensors("write", &prev_path))?;
                }
                write_atomic(
                    &partial.join("state.json"),
                    &serde_json::to_vec(&CheckpointState {
                        step: step + 1,
                        metrics_lines,
                    })
                    .unwrap_or_default(),
                )?;
                let _ = fs::remove_dir_all(&target);
                fs::rename(&partial, &target).map_err(io(&target))?;
            }
            prune_checkpoints(&dir, config.checkpoint.keep.max(1))?;
        }
        if m.eval_reward.is_some() || last {
            let lines = read_metrics(&metrics_path);
            let curve: Vec<(usize, f64)> = lines
                .iter()
                .filter(|m| m.reward_mean.is_finite())
                .map(|m| (m.step, m.reward_mean))
                .collect();
            if let Err(e) =
                crate::plot::reward_curve(&curve, &evals, &dir.join("reward.png"), &run_id)
            {
                tracing::warn!(error = %e, "could not draw the reward curve");
            }
            let kl: Vec<(usize, f64)> = lines
                .iter()
                .filter_map(|m| Some((m.step, m.reverse_kl?)))
                .collect();
            if !kl.is_empty()
                && let Err(e) = crate::plot::step_curve(
                    &kl,
                    &dir.join("reverse_kl.png"),
                    &format!("Reverse KL to the teacher: {run_id}"),
                    "mean log p_student − log p_teacher",
                )
            {
                tracing::warn!(error = %e, "could not draw the reverse KL curve");
            }
        }
        if stopping && !last {
            report.stopped_at = Some(step + 1);
            break;
        }
    }
    if let Some(handle) = pending.take() {
        handle.abort();
    }
    report.eval_after = evals.range(1..).next_back().map(|(_, v)| *v);
    Ok(report)
}

fn prune_checkpoints(dir: &Path, keep: usize) -> Result<(), TrainError> {
    let root = dir.join("checkpoints");
    let mut steps: Vec<(usize, PathBuf)> = fs::read_dir(&root)
        .map_err(io(&root))?
        .filter_map(|e| {
            let e = e.ok()?;
            let name = e.file_name().into_string().ok()?;
            Some((name.strip_prefix("step-")?.parse().ok()?, e.path()))
        })
        .collect();
    steps.sort();
    let excess = steps.len().saturating_sub(keep);
    for (_, path) in steps.into_iter().take(excess) {
        fs::remove_dir_all(&path).map_err(io(&path))?;
    }
    Ok(())
}

fn read_metrics(path: &Path) -> Vec<StepMetrics> {
    fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn read_evals(path: &Path) -> BTreeMap<usize, (f64, (f64, f64))> {
    let mut evals = BTreeMap::new();
    if let Some(before) = path
        .parent()
        .and_then(|d| fs::read(d.join("eval-0.json")).ok())
        .and_then(|b| serde_json::from_slice(&b).ok())
    {
        evals.insert(0, before);
    }
    for m in read_metrics(path) {
        if let (Some(r), Some(ci)) = (m.eval_reward, m.eval_ci95) {
            evals.insert(m.step, (r, ci));
        }
    }
    evals
}

/// Rewards → per-token advantages and masks (group normalisation, dynamic sampling,
/// overlong handling, distillation's reverse KL).
fn shape(
    config: &TrainConfig,
    samples: Vec<Sample>,
    normalization: crate::advantage::Normalization,
    teacher: Option<&LanguageModel>,
    m: &mut StepMetrics,
) -> Result<Shaped, TrainError> {
    let mut by_group: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (i, s) in samples.iter().enumerate() {
        by_group.entry(s.group).or_default().push(i);
    }
    let max_tokens = config.rollout.max_tokens;
    let reward_of = |s: &Sample| -> f64 {
        match config.loss.overlong.as_str() {
            "penalty" => {
                s.reward
                    + overlong_penalty(s.completion.len(), max_tokens, config.loss.overlong_cache)
            }
            _ => s.reward,
        }
    };
    let reward_weight = config.distill.as_ref().map_or(1.0, |d| d.reward_weight);
    let mut kept = Vec::new();
    let mut advantages = Vec::new();
    let mut masks = Vec::new();
    let mut reverse_kl = (0.0, 0usize);
    for members in by_group.values() {
        let rewards: Vec<f64> = members.iter().map(|&i| reward_of(&samples[i])).collect();
        let informative = is_informative(&rewards);
        if config.loss.dynamic_sampling && !informative && teacher.is_none() {
            continue;
        }
        m.groups_kept += 1;
        let group_adv = group_advantages(&rewards, normalization);
        let teacher_logps = match teacher {
            Some(teacher) => {
                let t = Instant::now();
                let scored = teacher_logprobs(teacher, members.iter().map(|&i| &samples[i]))?;
                m.teacher_s = Some(m.teacher_s.unwrap_or(0.0) + t.elapsed().as_secs_f64());
                scored
            }
            None => Vec::new(),
        };
        for (k, (&i, a)) in members.iter().zip(group_adv).enumerate() {
            let s = &samples[i];
            let a = if teacher.is_some() {
                a * reward_weight
            } else {
                a
            };
            let mut adv = vec![a as f32; s.completion.len()];
            if let (Some(teacher_logp), Some(d)) = (teacher_logps.get(k), &config.distill) {
                for (st, te) in s.logprobs.iter().zip(teacher_logp) {
                    reverse_kl.0 += f64::from(st - te);
                    reverse_kl.1 += 1;
                }
                add_reverse_kl(&mut adv, &s.logprobs, teacher_logp, d.kl_coef as f32);
            }
            let mask = match config.loss.overlong.as_str() {
                "filter" => overlong_mask(s.truncated, s.completion.len()),
                _ => vec![1.0; s.completion.len()],
            };
            kept.push(s.clone());
            advantages.push(adv);
            masks.push(mask);
        }
    }
    if teacher.is_some() {
        m.reverse_kl = Some(reverse_kl.0 / reverse_kl.1.max(1) as f64);
    }
    Ok((kept, advantages, masks))
}

/// The teacher's log-probability of every completion token of `samples`: the
/// completions of one prompt (a GRPO group's) scored together, the prompt read once.
fn teacher_logprobs<'a>(
    teacher: &LanguageModel,
    samples: impl Iterator<Item = &'a Sample>,
) -> Result<Vec<Vec<f32>>, TrainError> {
    let samples: Vec<&Sample> = samples.collect();
    let mut out = vec![Vec::new(); samples.len()];
    let mut done = vec![false; samples.len()];
    for i in 0..samples.len() {
        if done[i] {
            continue;
        }
        let same: Vec<usize> = (i..samples.len())
            .filter(|&j| !done[j] && samples[j].prompt == samples[i].prompt)
            .collect();
        let completions: Vec<&[u32]> = same
            .iter()
            .map(|&j| samples[j].completion.as_slice())
            .collect();
        let scored = teacher
            .score_completions(&samples[i].prompt, &completions)
            .map_err(|source| TrainError::Model {
                what: "the teacher scoring the samples",
                source: Box::new(source),
            })?;
        for (j, lp) in same.into_iter().zip(scored) {
            out[j] = lp;
            done[j] = true;
        }
    }
    Ok(out)
}

/// SFT's examples: every model turn of the episodes with at least `min_reward` in
/// the given eval runs, exactly as the engine sampled them.
fn sft_data(config: &TrainConfig) -> Result<Vec<Sample>, TrainError> {
    let sft = config.sft.as_ref().ok_or_else(|| {
        TrainError::Config(
            "train sft needs an [sft] section with runs = [\"runs/<eval run>\"]".into(),
        )
    })?;
    let mut samples = Vec::new();
    for run in &sft.runs {
        let path = run.join("results.jsonl");
        let text = fs::read_to_string(&path).map_err(io(&path))?;
        for (n, line) in text.lines().enumerate() {
            let record: agentstack_harness::run::EpisodeRecord = serde_json::from_str(line)
                .map_err(|source| TrainError::Json {
                    path: path.clone(),
                    line: Some(n + 1),
                    source,
                })?;
            if record.episode.reward < sft.min_reward {
                continue;
            }
            let episode = [(0usize, record.episode)];
            samples.extend(samples_of(&episode));
        }
    }
    if samples.is_empty() {
        return Err(TrainError::Config(format!(
            "no episode with reward ≥ {} and token ids in {:?}; run eval with an in-process model (it records token ids), or lower sft.min_reward",
            sft.min_reward, sft.runs
        )));
    }
    Ok(samples)
}

fn sft_batch(data: &[Sample], config: &TrainConfig, step: usize) -> Vec<Sample> {
    let size = config.sft.as_ref().map_or(8, |s| s.batch_size).max(1);
    let n = data.len();
    (0..size)
        .map(|j| data[shuffled(&[config.seed, 0x5f7], n, (step * size + j) as u64)].clone())
        .collect()
}

/// Held-out evaluation of the adapters now in the engine, as an `eval` run in
/// `<run>/eval/step-<k>` (resumable, like any eval run).
async fn eval_at(
    config: &TrainConfig,
    dir: &Path,
    env: Option<&EnvHandle>,
    model: &ModelClient,
    step: usize,
) -> Result<(f64, (f64, f64)), TrainError> {
    let env = env.ok_or_else(|| TrainError::Config("evaluation needs an environment".into()))?;
    let split = config
        .eval
        .split
        .clone()
        .filter(|s| !s.is_empty() && env.tasks().is_some());
    let eval = EvalConfig {
        env: config.env.clone(),
        model: config.model.display().to_string(),
        tasks: config.eval.episodes,
        samples: 1,
        seed: config.eval.seed,
        split,
        reset_options: config.env_options.clone(),
        play: LoopConfig {
            max_turns: config.rollout.max_turns,
            sampling: Sampling {
                temperature: config.eval.temperature,
                top_p: 1.0,
                max_tokens: config.rollout.max_tokens,
            },
            context: ContextPolicy::default(),
            constrain: false,
        },
        profile: config
            .profile
            .clone()
            .unwrap_or_else(|| Profile::for_env(env.name())),
        success_threshold: 1.0,
    };
    let run_dir = dir.join("eval").join(format!("step-{step:06}"));
    let eval_error = |source| TrainError::Eval {
        dir: run_dir.clone(),
        source: Box::new(source),
    };
    let run = Run::open(&run_dir, eval, config.rollout.concurrency, false).map_err(eval_error)?;
    let summary = run.play(model, env, |_| {}).await.map_err(eval_error)?;
    Ok((summary.mean_reward, summary.ci95))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    /// Whether `got` holds a whole HTTP request (headers and `content-length` bytes).
    fn complete(got: &[u8]) -> bool {
        let text = String::from_utf8_lossy(got);
        let Some(end) = text.find("\r\n\r\n") else {
            return false;
        };
        let length = text[..end]
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("content-length:")
                    .map(|v| v.trim().parse::<usize>().unwrap_or(0))
            })
            .unwrap_or(0);
        got.len() >= end + 4 + length
    }

    /// Answers one request on `listener` with `status` and `body`; returns the request.
    async fn answer(listener: &TcpListener, status: &str, body: &str) -> String {
        let (mut socket, _) = listener.accept().await.unwrap();
        let (mut buf, mut got) = (vec![0u8; 8192], Vec::new());
        while !complete(&got) {
            let n = socket.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        let reply = format!(
            "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        socket.write_all(reply.as_bytes()).await.unwrap();
        String::from_utf8_lossy(&got).into_owned()
    }

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// Each message leaves its cause to the source chain (which the CLI prints line by
    /// line), so the cause shows once.
    #[test]
    fn error_messages_leave_their_cause_to_the_source_chain() {
        let errors = [
            io(Path::new("/runs/r/metrics.jsonl"))(std::io::Error::other("disk on fire")),
            TrainError::Json {
                path: "/runs/r/results.jsonl".into(),
                line: Some(3),
                source: serde_json::from_str::<Value>("{").unwrap_err(),
            },
            tensor("creating the adapters")(candle_core::Error::Msg("bad shape".into())),
            tensors("read", Path::new("/c/adapter.safetensors"))(candle_core::Error::Msg(
                "truncated".into(),
            )),
        ];
        for e in errors {
            let cause = std::error::Error::source(&e).expect("a source").to_string();
            let message = e.to_string();
            assert!(!message.contains(&cause), "{message} repeats {cause}");
        }
    }

    /// A model server that is not up yet, then answers 503 while it loads, gets the
    /// adapters once it is ready; a 4xx fails at once with the server's message; a
    /// server that never comes fails the push after `wait`, saying how to wait longer.
    #[tokio::test]
    async fn adapter_pushes_wait_for_a_starting_server_but_not_for_a_refusal() {
        let http = reqwest::Client::new();
        let body = json!({"name": "run", "path": "/x/adapter.safetensors"});
        let port = free_port();
        let server = format!("http://127.0.0.1:{port}");
        let push = {
            let (http, body, server) = (http.clone(), body.clone(), server.clone());
            tokio::spawn(async move {
                let key = ApiKey::new("the-key").unwrap();
                push_adapter(&http, &server, Some(&key), &body, Duration::from_secs(20)).await
            })
        };
        tokio::time::sleep(Duration::from_millis(600)).await;
        let listener = TcpListener::bind(("127.0.0.1", port)).await.unwrap();
        answer(&listener, "503 Service Unavailable", "loading").await;
        let request = answer(&listener, "200 OK", "{}").await;
        push.await.unwrap().unwrap();
        assert!(request.starts_with("POST /v1/adapters "), "{request}");
        assert!(request.contains("\"name\":\"run\""), "{request}");
        assert!(
            request
                .to_ascii_lowercase()
                .contains("authorization: bearer the-key\r\n"),
            "{request}"
        );

        let refusing = |status: &'static str, text: &'static str| {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap();
            listener.set_nonblocking(true).unwrap();
            let listener = TcpListener::from_std(listener).unwrap();
            tokio::spawn(async move {
                answer(&listener, status, text).await;
            });
            format!("http://{addr}")
        };
        let t = Instant::now();
        let server = refusing("400 Bad Request", "the adapter's shapes do not fit");
        let e = push_adapter(&http, &server, None, &body, Duration::from_secs(20))
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("400") && e.contains("shapes do not fit"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        // A missing key is a refusal too, with the variable to set.
        let server = refusing("401 Unauthorized", "this server needs an API key");
        let e = push_adapter(&http, &server, None, &body, Duration::from_secs(20))
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("401") && e.contains("hint: set AGENTSTACK_API_KEY"),
            "{e}"
        );
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());

        let nobody = format!("http://127.0.0.1:{}", free_port());
        let e = push_adapter(&http, &nobody, None, &body, Duration::from_secs(1))
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("still failing after 1 s") && e.contains("sync.wait_seconds"),
            "{e}"
        );
    }
}
