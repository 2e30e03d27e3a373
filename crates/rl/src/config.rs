//! `train.toml`: what a training run does, read with errors that name the key.
//!
//! ```toml
//! model = "SmolLM2-135M-Instruct.Q4_1.gguf"
//! env = "arithmetic"
//! steps = 60
//! seed = 1
//!
//! [env_options]
//! difficulty = 1
//!
//! [rollout]
//! group_size = 8
//! prompts_per_step = 4
//! max_tokens = 32
//!
//! [lora]
//! rank = 8
//! alpha = 16
//! targets = ["q_proj", "v_proj"]
//!
//! [optim]
//! lr = 1e-4
//! ```

use std::path::PathBuf;

use agentstack_harness::Profile;
use agentstack_model::server::{API_KEY_ENV, ApiKey};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::advantage::Normalization;
use crate::lora::{LoraConfig, Target};
use crate::loss::{Aggregation, KlEstimator, LossConfig, Ratio};
use crate::optim::{OptimConfig, Schedule};

/// Which algorithm a run trains with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// GRPO and its variants (DAPO, Dr. GRPO, GSPO) on environment rewards.
    Grpo,
    /// On-policy distillation: reverse KL to a teacher on the student's own samples
    /// (plus GRPO advantages when `distill.reward_weight` > 0).
    Distill,
    /// Supervised fine-tuning on trajectories from `eval` runs.
    Sft,
}

/// A whole training run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// The model: a GGUF file (or a Hugging Face checkpoint directory).
    pub model: PathBuf,
    /// The environment: a built-in name, an OpenEnv URL, a package directory or
    /// `hub:owner/name[@version]`.
    #[serde(default)]
    pub env: String,
    /// Optimizer steps.
    pub steps: usize,
    /// Seeds the adapters' initialisation, task order and sampling.
    #[serde(default)]
    pub seed: u64,
    /// Reset options for every episode (e.g. `difficulty`).
    #[serde(default)]
    pub env_options: Map<String, Value>,
    /// How the environment is presented (the built-in profile when absent).
    #[serde(default)]
    pub profile: Option<Profile>,
    /// Sampling the rollouts.
    #[serde(default)]
    pub rollout: RolloutSection,
    /// The adapters.
    #[serde(default)]
    pub lora: LoraSection,
    /// The policy loss.
    #[serde(default)]
    pub loss: LossSection,
    /// The optimizer.
    #[serde(default)]
    pub optim: OptimSection,
    /// Held-out evaluation during training.
    #[serde(default)]
    pub eval: EvalSection,
    /// Checkpoints.
    #[serde(default)]
    pub checkpoint: CheckpointSection,
    /// Pushing adapters to `model serve` processes.
    #[serde(default)]
    pub sync: SyncSection,
    /// On-policy distillation (`train distill`).
    #[serde(default)]
    pub distill: Option<DistillSection>,
    /// Supervised fine-tuning (`train sft`).
    #[serde(default)]
    pub sft: Option<SftSection>,
}

/// Which weights the rollouts run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum RolloutWeights {
    /// The file's quantized blocks (fast; the learner's f32 differs slightly, which
    /// TIS corrects and `rollout_mismatch` reports).
    #[default]
    Quantized,
    /// The same f32 weights the learner uses.
    F32,
}

/// `[rollout]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RolloutSection {
    /// Samples per prompt (the GRPO group).
    pub group_size: usize,
    /// Prompts (tasks) per step.
    pub prompts_per_step: usize,
    /// Sampling temperature.
    pub temperature: f32,
    /// Nucleus mass.
    pub top_p: f32,
    /// Most tokens per model turn.
    pub max_tokens: usize,
    /// Most model turns per episode.
    pub max_turns: usize,
    /// The split of the environment's task list to train on (`""`: seeded resets,
    /// for environments without a task list).
    pub split: Option<String>,
    /// Episodes played at once.
    pub concurrency: usize,
    /// Quantized or f32 rollout weights.
    pub weights: RolloutWeights,
    /// `sync` (the default): each step plays its own batch, then learns (one step
    /// ahead with `max_staleness = 1`). `async`: rollouts are played continuously into
    /// a bounded buffer and each step learns from the first groups to finish, at most
    /// `max_staleness` weight updates old.
    pub mode: RolloutMode,
    /// Base URLs of `agentstack model serve` processes (`http://host:port`) to play the
    /// episodes on instead of the in-process engine: each episode goes to the least
    /// busy one that is up; a server that dies has its episodes played again on the
    /// others and gets the current adapters when it is back. They get the adapters
    /// after every step (with `[sync]`'s key, name and wait), so their `--adapter-dir`
    /// must hold the runs directory.
    pub servers: Vec<String>,
    /// Sync mode: 0 (rollout, then learn) or 1 (the rollouts of step k+1 run while
    /// step k learns, on the weights from before step k). Async mode: k ≥ 1, how many
    /// updates behind the learner a group may start and a token may be sampled (older
    /// tokens are masked out of the loss).
    pub max_staleness: usize,
    /// Draft tokens verified per pass at most by the in-process engine's prompt-lookup
    /// speculative decoding (0 = off). Drafts run only where they pay; each token is
    /// still sampled from the policy's own logits, so the rollouts (tokens and
    /// log-probabilities) are the same with it or without.
    pub speculative_draft: usize,
}

/// How rollouts and learning take turns (`rollout.mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum RolloutMode {
    /// A step's batch, then its learning (optionally one step ahead).
    #[default]
    Sync,
    /// Continuous rollouts into a bounded buffer; partial rollouts continue on new
    /// weights; importance correction and staleness masking in the loss.
    Async,
}

impl Default for RolloutSection {
    fn default() -> Self {
        Self {
            group_size: 8,
            prompts_per_step: 4,
            temperature: 1.0,
            top_p: 1.0,
            max_tokens: 64,
            max_turns: 1,
            split: Some("train".into()),
            concurrency: 16,
            weights: RolloutWeights::Quantized,
            mode: RolloutMode::Sync,
            servers: Vec::new(),
            max_staleness: 0,
            speculative_draft: 16,
        }
    }
}

/// `[lora]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoraSection {
    /// Rank.
    pub rank: usize,
    /// Alpha (the update is scaled by alpha / rank).
    pub alpha: f64,
    /// Weights adapted in every block: `q_proj`, `k_proj`, `v_proj`, `o_proj`,
    /// `gate_proj`, `up_proj`, `down_proj`, or `all`.
    pub targets: Vec<String>,
}

impl Default for LoraSection {
    fn default() -> Self {
        Self {
            rank: 8,
            alpha: 16.0,
            targets: vec!["q_proj".into(), "v_proj".into()],
        }
    }
}

/// `[loss]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LossSection {
    /// `std` (GRPO) or `mean` (Dr. GRPO: no division by the group's deviation).
    pub advantage: String,
    /// `token` (GRPO/DAPO) or `sequence` (GSPO).
    pub ratio: String,
    /// ε_low.
    pub eps_low: f64,
    /// ε_high (clip-higher: 0.28).
    pub eps_high: f64,
    /// `token_mean` (DAPO), `sequence_mean` (GRPO) or `constant` (Dr. GRPO, divided by
    /// `rollout.max_tokens`).
    pub aggregation: String,
    /// `none`, `k1`, `k2` or `k3`: a KL penalty to the base model.
    pub kl: String,
    /// β.
    pub kl_coef: f64,
    /// `loss` or `reward`: where the KL penalty goes.
    pub kl_in: String,
    /// Truncated importance sampling cap (none: no TIS).
    pub tis_cap: Option<f64>,
    /// Masked importance sampling: tokens whose ratio `π_old / μ` to the rollout
    /// policy falls outside `[low, high]` get no gradient (e.g. `[0.5, 2.0]`; none:
    /// no masking). Catches tokens an asynchronous rollout sampled from weights too
    /// far from the learner's.
    pub is_mask: Option<(f64, f64)>,
    /// Drop groups whose rewards are all equal (DAPO's dynamic sampling).
    pub dynamic_sampling: bool,
    /// `none`, `filter` (mask truncated samples) or `penalty` (DAPO's soft penalty).
    pub overlong: String,
    /// The soft penalty's buffer (tokens before `max_tokens` where it starts).
    pub overlong_cache: usize,
}

impl Default for LossSection {
    fn default() -> Self {
        Self {
            advantage: "std".into(),
            ratio: "token".into(),
            eps_low: 0.2,
            eps_high: 0.28,
            aggregation: "token_mean".into(),
            kl: "none".into(),
            kl_coef: 0.0,
            kl_in: "loss".into(),
            tis_cap: Some(2.0),
            is_mask: None,
            dynamic_sampling: false,
            overlong: "none".into(),
            overlong_cache: 8,
        }
    }
}

/// `[optim]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimSection {
    /// Peak learning rate.
    pub lr: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Adam's β1.
    pub beta1: f64,
    /// Adam's β2.
    pub beta2: f64,
    /// Clip the gradient norm (0: no clipping).
    pub max_grad_norm: f64,
    /// Warm-up steps.
    pub warmup: usize,
    /// `constant`, `linear` or `cosine` (to 0 at the last step).
    pub schedule: String,
    /// Sequences per backward pass (gradient accumulation over the step's batch).
    pub micro_batch: usize,
}

impl Default for OptimSection {
    fn default() -> Self {
        Self {
            lr: 1e-4,
            weight_decay: 0.0,
            beta1: 0.9,
            beta2: 0.999,
            max_grad_norm: 1.0,
            warmup: 0,
            schedule: "constant".into(),
            micro_batch: 8,
        }
    }
}

/// `[eval]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvalSection {
    /// Evaluate every this many steps (and before the first and after the last); 0:
    /// never.
    pub every: usize,
    /// Held-out tasks per evaluation.
    pub episodes: usize,
    /// The held-out split (`""`: seeded resets from `seed`).
    pub split: Option<String>,
    /// Sampling temperature (0: greedy).
    pub temperature: f32,
    /// Seed of the evaluation's tasks when the environment has no split.
    pub seed: u64,
}

impl Default for EvalSection {
    fn default() -> Self {
        Self {
            every: 10,
            episodes: 50,
            split: Some("test".into()),
            temperature: 0.0,
            seed: 1 << 40,
        }
    }
}

/// `[checkpoint]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointSection {
    /// Save every this many steps (and after the last); 0: only after the last.
    pub every: usize,
    /// Checkpoints kept (the newest).
    pub keep: usize,
}

impl Default for CheckpointSection {
    fn default() -> Self {
        Self { every: 5, keep: 2 }
    }
}

/// `[sync]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SyncSection {
    /// Base URLs of `agentstack model serve` processes (`http://host:port`) that get
    /// the adapters after every step (`POST /v1/adapters`).
    pub servers: Vec<String>,
    /// The adapter's name there (default: the run id).
    pub name: Option<String>,
    /// How long, in seconds, a push keeps retrying a server that cannot be reached or
    /// answers 5xx (one still starting, or being replaced) before the run fails.
    pub wait_seconds: u64,
    /// The environment variable of the trainer that holds the API key the servers ask
    /// for (sent as `Authorization: Bearer`; the first of a comma-separated list).
    /// Default: `AGENTSTACK_API_KEY`, when set. The key itself never goes in this file,
    /// which is saved in the run directory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_key_env: Option<String>,
}

impl Default for SyncSection {
    fn default() -> Self {
        Self {
            servers: Vec::new(),
            name: None,
            wait_seconds: 120,
            api_key_env: None,
        }
    }
}

impl SyncSection {
    /// The API key to send to the servers, from the trainer's environment: the
    /// variable `api_key_env` names (which must then be set), else
    /// `AGENTSTACK_API_KEY` if it is.
    pub fn api_key(&self) -> Result<Option<ApiKey>, ConfigError> {
        self.api_key_from(|name| std::env::var(name).ok())
    }

    /// [`SyncSection::api_key`] over the variables `var` gives.
    fn api_key_from(
        &self,
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<ApiKey>, ConfigError> {
        match &self.api_key_env {
            None => Ok(var(API_KEY_ENV).and_then(|list| ApiKey::first_of_list(&list))),
            Some(name) => var(name)
                .and_then(|list| ApiKey::first_of_list(&list))
                .map(Some)
                .ok_or_else(|| {
                    ConfigError(format!(
                        "sync.api_key_env names `{name}`, which is not set (or empty) in the trainer's environment\nhint: export {name} with the model servers' API key"
                    ))
                }),
        }
    }
}

/// `[distill]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DistillSection {
    /// The teacher: a GGUF file with the student's tokenizer.
    pub teacher: PathBuf,
    /// Weight of the per-token reverse KL in the advantages.
    #[serde(default = "one")]
    pub kl_coef: f64,
    /// Weight of the environment's GRPO advantages (0: pure distillation).
    #[serde(default)]
    pub reward_weight: f64,
}

fn one() -> f64 {
    1.0
}

/// `[sft]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SftSection {
    /// `eval` run directories (their `results.jsonl`) to learn from.
    pub runs: Vec<PathBuf>,
    /// Only episodes with at least this reward.
    #[serde(default = "one")]
    pub min_reward: f64,
    /// Sequences per step.
    #[serde(default = "eight")]
    pub batch_size: usize,
}

fn eight() -> usize {
    8
}

/// A configuration that cannot run.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

fn pick<T: Copy>(key: &str, value: &str, options: &[(&str, T)]) -> Result<T, ConfigError> {
    options
        .iter()
        .find(|(name, _)| *name == value)
        .map(|(_, v)| *v)
        .ok_or_else(|| {
            let names: Vec<&str> = options.iter().map(|(n, _)| *n).collect();
            ConfigError(format!(
                "{key} = \"{value}\" is not one of: {}",
                names.join(", ")
            ))
        })
}

impl TrainConfig {
    /// Reads `train.toml` text; errors name the key and say what is allowed.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let config: Self = toml::from_str(text).map_err(|e| ConfigError(e.to_string()))?;
        config.check()?;
        Ok(config)
    }

    /// Checks values that parse but cannot run.
    pub fn check(&self) -> Result<(), ConfigError> {
        let positive = [
            ("steps", self.steps),
            ("rollout.group_size", self.rollout.group_size),
            ("rollout.prompts_per_step", self.rollout.prompts_per_step),
            ("rollout.max_tokens", self.rollout.max_tokens),
            ("rollout.max_turns", self.rollout.max_turns),
            ("rollout.concurrency", self.rollout.concurrency),
            ("lora.rank", self.lora.rank),
            ("optim.micro_batch", self.optim.micro_batch),
        ];
        for (key, value) in positive {
            if value == 0 {
                return Err(ConfigError(format!("{key} must be at least 1")));
            }
        }
        for server in &self.rollout.servers {
            let url = reqwest::Url::parse(server).ok();
            if !url.is_some_and(|u| matches!(u.scheme(), "http" | "https") && u.has_host()) {
                return Err(ConfigError(format!(
                    "rollout.servers: `{server}` is not a server's base URL; write http://host:port"
                )));
            }
        }
        if self.rollout.speculative_draft > agentstack_model::speculate::MAX_DRAFT_LIMIT {
            return Err(ConfigError(format!(
                "rollout.speculative_draft must be at most {}, got {}",
                agentstack_model::speculate::MAX_DRAFT_LIMIT,
                self.rollout.speculative_draft
            )));
        }
        match self.rollout.mode {
            RolloutMode::Sync if self.rollout.max_staleness > 1 => {
                return Err(ConfigError(format!(
                    "rollout.max_staleness = {} needs rollout.mode = \"async\"; in sync mode use 0 (synchronous) or 1 (rollouts one step ahead)",
                    self.rollout.max_staleness
                )));
            }
            RolloutMode::Sync
                if self.rollout.max_staleness == 1 && !self.rollout.servers.is_empty() =>
            {
                return Err(ConfigError(
                    "rollout.servers with rollout.max_staleness = 1 is not supported (the servers get each step's adapters while the next batch plays); use 0, or rollout.mode = \"async\"".into(),
                ));
            }
            RolloutMode::Async if self.rollout.max_staleness == 0 => {
                return Err(ConfigError(
                    "rollout.mode = \"async\" needs rollout.max_staleness of at least 1 (2 is usual)".into(),
                ));
            }
            _ => {}
        }
        if self.rollout.temperature.is_nan() || self.rollout.temperature <= 0.0 {
            return Err(ConfigError(
                "rollout.temperature must be above 0: GRPO needs sampled, varied answers".into(),
            ));
        }
        if !self.optim.lr.is_finite() || self.optim.lr <= 0.0 {
            return Err(ConfigError("optim.lr must be a positive number".into()));
        }
        self.lora_config()?;
        self.loss_config()?;
        self.optim_config()?;
        self.normalization()?;
        pick(
            "loss.overlong",
            &self.loss.overlong,
            &[("none", ()), ("filter", ()), ("penalty", ())],
        )?;
        pick(
            "loss.kl_in",
            &self.loss.kl_in,
            &[("loss", ()), ("reward", ())],
        )?;
        Ok(())
    }

    /// The adapters' settings.
    pub fn lora_config(&self) -> Result<LoraConfig, ConfigError> {
        let mut targets = Vec::new();
        for name in &self.lora.targets {
            if name == "all" || name == "all-linear" {
                targets = Target::ALL.to_vec();
                break;
            }
            let target = Target::parse(name).ok_or_else(|| {
                ConfigError(format!(
                    "lora.targets: `{name}` is not a weight; use q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj or all"
                ))
            })?;
            if !targets.contains(&target) {
                targets.push(target);
            }
        }
        if targets.is_empty() {
            return Err(ConfigError(
                "lora.targets must name at least one weight".into(),
            ));
        }
        Ok(LoraConfig {
            rank: self.lora.rank,
            alpha: self.lora.alpha,
            targets,
        })
    }

    /// The loss's settings.
    pub fn loss_config(&self) -> Result<LossConfig, ConfigError> {
        let l = &self.loss;
        let ratio = pick(
            "loss.ratio",
            &l.ratio,
            &[("token", Ratio::Token), ("sequence", Ratio::Sequence)],
        )?;
        let aggregation = pick(
            "loss.aggregation",
            &l.aggregation,
            &[
                ("token_mean", Aggregation::TokenMean),
                ("sequence_mean", Aggregation::SequenceMean),
                ("constant", Aggregation::Constant(self.rollout.max_tokens)),
            ],
        )?;
        let kl = pick(
            "loss.kl",
            &l.kl,
            &[
                ("none", None),
                ("k1", Some(KlEstimator::K1)),
                ("k2", Some(KlEstimator::K2)),
                ("k3", Some(KlEstimator::K3)),
            ],
        )?;
        if !(0.0..1.0).contains(&l.eps_low) || l.eps_high < 0.0 {
            return Err(ConfigError(
                "loss.eps_low must be in [0, 1) and loss.eps_high at least 0".into(),
            ));
        }
        if let Some(cap) = l.tis_cap
            && (cap.is_nan() || cap < 1.0)
        {
            return Err(ConfigError(
                "loss.tis_cap must be at least 1 (2 is usual); leave it out for no TIS".into(),
            ));
        }
        Ok(LossConfig {
            ratio,
            eps_low: l.eps_low,
            eps_high: l.eps_high,
            aggregation,
            kl: kl
                .filter(|_| l.kl_in == "loss" && l.kl_coef > 0.0)
                .map(|k| (k, l.kl_coef)),
            tis_cap: l.tis_cap,
            is_mask: match l.is_mask {
                Some((low, high)) if !((0.0..1.0).contains(&low) && high > 1.0) => {
                    return Err(ConfigError(format!(
                        "loss.is_mask = [{low}, {high}] must hold 1 inside, as [low, high] with 0 <= low < 1 < high (e.g. [0.5, 2.0])"
                    )));
                }
                other => other,
            },
        })
    }

    /// Group advantage normalisation.
    pub fn normalization(&self) -> Result<Normalization, ConfigError> {
        pick(
            "loss.advantage",
            &self.loss.advantage,
            &[
                ("std", Normalization::Std),
                ("mean", Normalization::MeanOnly),
            ],
        )
    }

    /// The optimizer's settings.
    pub fn optim_config(&self) -> Result<OptimConfig, ConfigError> {
        let o = &self.optim;
        let schedule = match o.schedule.as_str() {
            "constant" => Schedule::Constant,
            "linear" => Schedule::Linear { total: self.steps },
            "cosine" => Schedule::Cosine { total: self.steps },
            other => {
                return Err(ConfigError(format!(
                    "optim.schedule = \"{other}\" is not one of: constant, linear, cosine"
                )));
            }
        };
        Ok(OptimConfig {
            lr: o.lr,
            weight_decay: o.weight_decay,
            betas: (o.beta1, o.beta2),
            eps: 1e-8,
            max_grad_norm: (o.max_grad_norm > 0.0).then_some(o.max_grad_norm),
            warmup: o.warmup,
            schedule,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_minimal_file_gets_the_defaults_and_bad_values_are_named() {
        let c =
            TrainConfig::parse("model = \"m.gguf\"\nenv = \"arithmetic\"\nsteps = 3\n").unwrap();
        assert_eq!(c.rollout.group_size, 8);
        assert_eq!(c.lora_config().unwrap().targets, vec![Target::Q, Target::V]);
        let unknown = TrainConfig::parse("model = \"m\"\nsteps = 1\nstep = 2\n").unwrap_err();
        assert!(
            unknown.to_string().contains("unknown field `step`"),
            "{unknown}"
        );
        let bad =
            TrainConfig::parse("model = \"m\"\nsteps = 1\n[loss]\nratio = \"seq\"\n").unwrap_err();
        assert!(
            bad.to_string()
                .contains("loss.ratio = \"seq\" is not one of: token, sequence"),
            "{bad}"
        );
        let zero = TrainConfig::parse("model = \"m\"\nsteps = 1\n[rollout]\ngroup_size = 0\n")
            .unwrap_err();
        assert!(
            zero.to_string()
                .contains("rollout.group_size must be at least 1")
        );
        let target = TrainConfig::parse("model = \"m\"\nsteps = 1\n[lora]\ntargets = [\"qq\"]\n")
            .unwrap_err();
        assert!(target.to_string().contains("`qq` is not a weight"));
    }

    /// Regression (issue 19): the key pushed adapters carry comes from the trainer's
    /// environment (`AGENTSTACK_API_KEY`, or the variable `[sync] api_key_env` names,
    /// which must then be set), never from the file, and is not saved with the run's
    /// configuration.
    #[test]
    fn the_sync_key_comes_from_the_environment_and_is_never_recorded() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| (*v).to_owned())
            }
        };
        let key = |sync: &SyncSection, vars| {
            sync.api_key_from(vars)
                .map(|k| k.map(|k| k.expose().to_owned()))
        };
        let plain = TrainConfig::parse("model = \"m\"\nsteps = 1\n")
            .unwrap()
            .sync;
        assert_eq!(key(&plain, env(&[])).unwrap(), None);
        assert_eq!(
            key(&plain, env(&[("AGENTSTACK_API_KEY", "k1,k2")]))
                .unwrap()
                .as_deref(),
            Some("k1")
        );
        let named = TrainConfig::parse(
            "model = \"m\"\nsteps = 1\n[sync]\napi_key_env = \"MY_SERVER_KEY\"\n",
        )
        .unwrap();
        assert_eq!(
            key(
                &named.sync,
                env(&[("MY_SERVER_KEY", "mine"), ("AGENTSTACK_API_KEY", "other")])
            )
            .unwrap()
            .as_deref(),
            Some("mine")
        );
        let unset = key(&named.sync, env(&[("AGENTSTACK_API_KEY", "other")])).unwrap_err();
        assert!(
            unset.0.contains("MY_SERVER_KEY") && unset.0.contains("hint:"),
            "{}",
            unset.0
        );
        let recorded = serde_json::to_value(&named).unwrap();
        assert_eq!(recorded["sync"]["api_key_env"], "MY_SERVER_KEY");
        // A run recorded before the field existed still matches its configuration.
        let before =
            serde_json::to_value(TrainConfig::parse("model = \"m\"\nsteps = 1\n").unwrap())
                .unwrap();
        assert!(before["sync"].get("api_key_env").is_none(), "{before}");
        assert!(
            TrainConfig::parse("model = \"m\"\nsteps = 1\n[sync]\napi_key = \"k\"\n").is_err(),
            "a key in the file is refused"
        );
    }
}
