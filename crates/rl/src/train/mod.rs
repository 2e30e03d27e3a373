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
//!
//! [`train`] reads as a step's phases, each a method of a `Trainer` opened from the
//! run's [`Setup`]: the step's batch (`rollout` and `batch`; one step ahead or not as
//! `schedule`'s `RolloutScheduler`, which owns that state, decides; or, with
//! `rollout.mode = "async"`, the first groups `producer`'s continuous rollouts
//! finish), learning
//! (`learner`), the push to model servers (`sync`), evaluation (`eval`), the metrics
//! line and curves (`metrics`), and the checkpoint (`checkpoint`).

mod batch;
mod checkpoint;
mod error;
mod eval;
mod learner;
mod metrics;
mod producer;
mod rollout;
mod schedule;
mod servers;
mod sync;

use std::collections::BTreeMap;
use std::fs;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentstack_harness::prompt::Presenter;
use agentstack_harness::{EnvHandle, ModelClient, Profile};
use agentstack_model::engine::{Engine, EngineConfig};
use agentstack_model::speculate::Speculation;
use agentstack_model::{LanguageModel, WeightForm};
use candle_core::DType;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use self::batch::{Shaped, continuations, mean_std, samples_of, sft_batch, sft_data, shape};
use self::checkpoint::write_atomic;
pub use self::error::TrainError;
use self::error::{io, join, tensor};
use self::learner::Learner;
use self::metrics::MetricsLog;
use self::producer::{Producer, ProducerSetup};
use self::rollout::{Player, RolloutSide, RolloutTask};
use self::schedule::RolloutScheduler;
use self::servers::ServerPool;
use self::sync::RemoteSync;
use crate::config::{Algorithm, RolloutMode, RolloutWeights, TrainConfig};
use crate::lora::Lora;
use crate::optim::Optim;

/// The engine's adapter slot the rollouts run on.
pub const POLICY_ADAPTER: &str = "policy";

/// The slot held-out evaluations run on (apart, so an evaluation never changes the
/// weights under rollouts running one step ahead).
pub const EVAL_ADAPTER: &str = "eval";

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
    /// The policy slot's version that sampled each completion token (asynchronous
    /// runs; empty when the model side does not say).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub versions: Vec<u64>,
    /// Which completion tokens are the model's (1) and which came from elsewhere (0:
    /// a multi-turn episode's observations between its turns); empty: all the model's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mask: Vec<f32>,
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
    /// Fraction of trained tokens masked by `loss.is_mask` (when set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub is_masked: Option<f64>,
    /// Multi-turn episodes: turns after the first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub later_turns: Option<usize>,
    /// Of those, turns whose prompt does not continue the previous turn's token ids
    /// exactly (the history tokenized again): 0 on the in-process engine unless the
    /// context policy cut the history.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retokenized_turns: Option<usize>,
    /// Fraction of the step's prompt tokens the engine read from its cache instead of
    /// running them (a group's samples share their prompt; a later turn continues the
    /// earlier one); absent when the model side does not say (a server that does not
    /// report cached tokens counts 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix_hit_rate: Option<f64>,
    /// The same over the turns after each episode's first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub later_turn_prefix_hit_rate: Option<f64>,
    /// Fraction of the step's generated tokens that came from kept speculative drafts
    /// (forward passes saved; the rollouts are the same with drafts or without);
    /// absent when the model side does not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accepted_draft_rate: Option<f64>,
    /// Asynchronous runs: mean updates between the weights that sampled a trained
    /// token and the learner's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staleness_mean: Option<f64>,
    /// Asynchronous runs: the most.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staleness_max: Option<u64>,
    /// Asynchronous runs: tokens masked for being more than `max_staleness` updates old.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stale_masked: Option<usize>,
    /// Asynchronous runs: samples whose tokens came from more than one weight version
    /// (generations that went on across an update).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partial_samples: Option<usize>,
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
    /// Seconds generating the step's rollouts (asynchronous runs: waiting for them).
    pub generate_s: f64,
    /// Seconds learning.
    pub learn_s: f64,
    /// Milliseconds pushing the adapters to the rollout engine.
    pub sync_ms: f64,
    /// Milliseconds pushing them to `model serve` processes (when configured).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_sync_ms: Option<f64>,
    /// Rollouts on `rollout.servers`: episodes played again because their server
    /// failed during the step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replayed_episodes: Option<usize>,
    /// Rollouts on `rollout.servers`: servers up after the step's adapter push.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub servers_up: Option<usize>,
    /// Rollouts on `rollout.servers`: the longest time from a server's failure to its
    /// return with the current adapters, among those back during the step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_recovery_s: Option<f64>,
    /// Seconds from the end of the last step (or the run's start) to the end of this
    /// one's learning and pushes: what throughput is measured by.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_s: Option<f64>,
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
    /// The step after which the time limit ended the run (evaluated and checkpointed
    /// as a last step; the same command goes on).
    pub time_limit_at: Option<usize>,
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
    pub stop: Arc<AtomicBool>,
    /// End the run after the step during which this much time has passed since its
    /// first step began (the held-out evaluation and checkpoint of a last step follow).
    pub time_limit: Option<Duration>,
}

/// Trains as `setup` says, resuming from the newest checkpoint in its directory;
/// `on_step` sees every step's metrics as they are written.
pub async fn train(
    setup: Setup,
    mut on_step: impl FnMut(&StepMetrics),
) -> Result<Report, TrainError> {
    let stop = setup.stop.clone();
    let time_limit = setup.time_limit;
    let mut trainer = Trainer::open(setup).await?;
    trainer.evaluate_before().await?;
    trainer.start_rollouts().await?;
    let steps = trainer.config.steps;
    let (mut stopped_at, mut time_limit_at) = (None, None);
    let started = Instant::now();
    let mut step_start = Instant::now();
    for step in trainer.resumed_from..steps {
        let done = step + 1;
        let mut m = StepMetrics {
            step: done,
            ..StepMetrics::default()
        };
        let batch = trainer.batch(step, &mut m).await?;
        trainer.learn(batch, &mut m).await?;
        trainer.push_to_servers(&mut m).await?;
        m.step_s = Some(step_start.elapsed().as_secs_f64());
        let out_of_time = time_limit.is_some_and(|limit| started.elapsed() >= limit);
        let last = done == steps || out_of_time;
        if out_of_time && done < steps {
            time_limit_at = Some(done);
        }
        let stopping = stop.load(Ordering::SeqCst);
        if last || stopping {
            // No rollouts past the run's end (an asynchronous run's producer).
            trainer.producer = None;
        }
        if trainer.evaluates_after(done, last) {
            let (mean, ci) = trainer.evaluate(done).await?;
            (m.eval_reward, m.eval_ci95) = (Some(mean), Some(ci));
        }
        trainer.metrics.append(&m)?;
        on_step(&m);
        if last || stopping || trainer.checkpoints_after(done) {
            trainer.checkpoint(done)?;
        }
        if m.eval_reward.is_some() || last {
            trainer.metrics.draw_curves(&trainer.evals, &trainer.run_id);
        }
        if stopping && !last {
            stopped_at = Some(done);
            break;
        }
        if last {
            break;
        }
        step_start = Instant::now();
    }
    Ok(trainer.finish(stopped_at, time_limit_at))
}

/// A run in progress: what [`train`]'s phases share.
struct Trainer {
    config: Arc<TrainConfig>,
    algorithm: Algorithm,
    /// The run directory.
    dir: PathBuf,
    /// Its last component: the adapters' default name and the plots' title.
    run_id: String,
    env: Option<Arc<EnvHandle>>,
    /// The engine the episodes play on, and how a step's episodes start.
    rollouts: RolloutSide,
    /// The engine under the evaluation slot.
    eval_client: ModelClient,
    /// Which adapters sample which step's batch (synchronous runs).
    scheduler: RolloutScheduler<Lora, RolloutTask>,
    /// The continuous rollouts (asynchronous runs, once started).
    producer: Option<Producer>,
    /// The policy slot's version: which weights the newest rollout tokens come from.
    policy_version: Arc<AtomicU64>,
    /// Where an asynchronous run's rollouts go on in its task sequence.
    next_position: u64,
    /// The current adapters (their variables are the learner's own).
    lora: Lora,
    learner: Arc<Mutex<Learner>>,
    normalization: crate::advantage::Normalization,
    teacher: Option<Arc<LanguageModel>>,
    /// SFT's examples (SFT learns from these instead of rollouts).
    sft: Option<Vec<Sample>>,
    /// Pushes to `model serve` processes, when any are configured.
    remote: Option<RemoteSync>,
    /// The rollout servers, when the episodes play on them.
    pool: Option<Arc<ServerPool>>,
    metrics: MetricsLog,
    /// Held-out rewards by step (0: before training).
    evals: BTreeMap<usize, (f64, (f64, f64))>,
    /// The step the run resumed from (0: a fresh start).
    resumed_from: usize,
    eval_before: Option<(f64, (f64, f64))>,
}

impl Trainer {
    /// Checks the configuration, claims the run directory, loads the models, and
    /// resumes from the newest checkpoint there.
    async fn open(setup: Setup) -> Result<Self, TrainError> {
        let Setup {
            config,
            algorithm,
            dir,
            env,
            fresh,
            stop: _,
            time_limit: _,
        } = setup;
        config.check()?;
        // The adapter pushes' key, from the trainer's environment (never the file).
        let sync_key = if config.sync.servers.is_empty() && config.rollout.servers.is_empty() {
            None
        } else {
            config.sync.api_key()?
        };
        claim_run_dir(&dir, &config, algorithm, fresh)?;
        let (learner_lm, rollout_lm) = load_models(&config).await?;
        let rollout_base = rollout_lm.model().clone();
        let engine = Engine::start(
            Arc::new(rollout_lm),
            EngineConfig {
                max_running: config.rollout.concurrency.max(1),
                speculation: Speculation {
                    max_draft: config.rollout.speculative_draft,
                    ..Speculation::default()
                },
                ..EngineConfig::default()
            },
        );
        let run_id = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "run".into());
        let policy_client =
            ModelClient::engine_adapter(engine.clone(), &run_id, Some(POLICY_ADAPTER));
        let pool = (!config.rollout.servers.is_empty()).then(|| {
            ServerPool::new(
                &config.rollout.servers,
                sync_key.clone(),
                config.sync.name.clone().unwrap_or_else(|| run_id.clone()),
                dir.join("rollout-adapter.safetensors"),
                Duration::from_secs(config.sync.wait_seconds),
            )
        });
        let player = match &pool {
            Some(pool) => Player::Servers(pool.clone()),
            None => Player::Engine(policy_client),
        };
        let eval_client = ModelClient::engine_adapter(engine.clone(), &run_id, Some(EVAL_ADAPTER));

        let base = learner_lm.model().clone();
        let lora = Lora::new(&base, config.lora_config()?, config.seed)
            .map_err(tensor("creating the adapters"))?;
        let optim = Optim::new(lora.vars(), config.optim_config()?)
            .map_err(tensor("creating the optimizer"))?;
        let start = checkpoint::start(&dir, &base, lora, optim)?;
        let metrics = MetricsLog::open(dir.join("metrics.jsonl"), start.metrics_lines)?;

        let teacher = load_teacher(&config, algorithm, &base).await?;
        let reference =
            (config.loss.kl != "none" && config.loss.kl_coef > 0.0).then(|| base.clone());
        let learner = Arc::new(Mutex::new(Learner {
            base,
            reference,
            lora: start.lora.clone(),
            optim: start.optim,
            loss: config.loss_config()?,
            micro_batch: config.optim.micro_batch,
        }));
        let normalization = config.normalization()?;
        let per_step = config.rollout.prompts_per_step;
        // SFT data, from eval runs.
        let sft = match algorithm {
            Algorithm::Sft => Some(sft_data(&config)?),
            _ => None,
        };
        let presenter = env
            .as_ref()
            .map(|env| presenter(&config, env))
            .transpose()?;
        if algorithm != Algorithm::Sft && env.is_none() {
            return Err(TrainError::Config(
                "training on rollouts needs an environment (env = ...)".into(),
            ));
        }
        let remote = (!config.sync.servers.is_empty())
            .then(|| RemoteSync::new(&config.sync, sync_key, &run_id, &dir));
        let config = Arc::new(config);
        let env = env.map(Arc::new);
        let evals = metrics.evals();
        Ok(Self {
            scheduler: RolloutScheduler::new(
                config.rollout.max_staleness,
                config.steps,
                start.next_sampler,
            ),
            rollouts: RolloutSide::new(
                config.clone(),
                engine,
                rollout_base,
                player,
                env.clone(),
                presenter,
            ),
            config,
            algorithm,
            dir,
            run_id,
            env,
            eval_client,
            lora: start.lora,
            learner,
            normalization,
            teacher,
            sft,
            remote,
            pool,
            metrics,
            evals,
            producer: None,
            policy_version: Arc::default(),
            next_position: start
                .next_position
                .unwrap_or((start.step * per_step) as u64),
            resumed_from: start.step,
            eval_before: None,
        })
    }

    /// Whether the rollouts are asynchronous.
    fn is_async(&self) -> bool {
        self.sft.is_none() && self.config.rollout.mode == RolloutMode::Async
    }

    /// Before the first step: the rollout servers get the current adapters, and an
    /// asynchronous run puts them in the policy slot and starts its continuous
    /// rollouts.
    async fn start_rollouts(&mut self) -> Result<(), TrainError> {
        if self.sft.is_some() || self.resumed_from >= self.config.steps {
            return Ok(());
        }
        // Rollouts on this process's engine beside the learner: the engine's spinning
        // helper would take a core from the learner's products (bench/rl/async.py at
        // 2026-12-06: 18 steps against 15 in 150 s without it).
        if self.is_async() && self.pool.is_none() {
            agentstack_model::kernels::stop_spinning();
        }
        if self.is_async() {
            let (_, version) = self.rollouts.sync_version(POLICY_ADAPTER, &self.lora)?;
            self.policy_version.store(version, Ordering::Release);
        }
        if let Some(pool) = &self.pool {
            pool.push(&self.lora, self.policy_version.load(Ordering::Acquire))
                .await?;
        }
        if !self.is_async() {
            return Ok(());
        }
        let (env, presenter) = self
            .rollouts
            .env_and_presenter()
            .expect("training on rollouts has an environment");
        self.producer = Some(Producer::start(ProducerSetup {
            config: self.config.clone(),
            player: self.rollouts.player().clone(),
            env,
            presenter,
            first_position: self.next_position,
            version: self.policy_version.clone(),
        }));
        Ok(())
    }

    /// The held-out evaluation before the first step (on a fresh start, when the run
    /// evaluates), or the one a resumed run made then.
    async fn evaluate_before(&mut self) -> Result<(), TrainError> {
        let path = self.dir.join("eval-0.json");
        if self.resumed_from == 0 && self.config.eval.every > 0 && self.env.is_some() {
            let before = self.evaluate(0).await?;
            fs::write(&path, serde_json::to_vec(&before).unwrap_or_default()).map_err(io(&path))?;
        }
        if let Ok(bytes) = fs::read(&path) {
            self.eval_before = serde_json::from_slice(&bytes).ok();
        }
        Ok(())
    }

    /// The samples `step` learns from, with their advantages and masks: SFT's batch,
    /// or the step's rollouts (started during the last step when one ahead) shaped.
    async fn batch(&mut self, step: usize, m: &mut StepMetrics) -> Result<Shaped, TrainError> {
        if let Some(data) = &self.sft {
            let batch = sft_batch(data, &self.config, step);
            let masks: Vec<Vec<f32>> = batch
                .iter()
                .map(|s| vec![1.0; s.completion.len()])
                .collect();
            m.reward_mean = f64::NAN;
            return Ok((batch, masks.clone(), masks));
        }
        if self.is_async() {
            return self.async_batch(m).await;
        }
        let Self {
            scheduler,
            rollouts,
            lora,
            ..
        } = self;
        let task = scheduler.batch(step, lora, |step, sampler| {
            rollouts.start(step, sampler, &mut m.sync_ms)
        })?;
        let (episodes, generate_s) = task.await.map_err(join("the step's rollouts"))??;
        m.generate_s = generate_s;
        // The next batch samples from the adapters as they are now (before this step
        // learns).
        scheduler.start_next(step, lora, |step, sampler| {
            rollouts.start(step, sampler, &mut m.sync_ms)
        })?;
        self.shape_episodes(&episodes, m).await
    }

    /// An asynchronous step's batch: the first `prompts_per_step` groups to finish,
    /// shaped, with tokens sampled more than `max_staleness` updates ago masked out.
    async fn async_batch(&mut self, m: &mut StepMetrics) -> Result<Shaped, TrainError> {
        let per_step = self.config.rollout.prompts_per_step;
        let producer = self
            .producer
            .as_mut()
            .expect("an asynchronous run's producer starts before its first step");
        let t = Instant::now();
        let mut groups = Vec::with_capacity(per_step);
        while groups.len() < per_step {
            groups.push(producer.next().await?);
        }
        m.generate_s = t.elapsed().as_secs_f64();
        if let Some(last) = groups.iter().map(|g| g.position + 1).max() {
            self.next_position = self.next_position.max(last);
        }
        tracing::debug!(
            positions = ?groups.iter().map(|g| g.position).collect::<Vec<_>>(),
            started = ?groups.iter().map(|g| g.started_version).collect::<Vec<_>>(),
            seconds = ?groups.iter().map(|g| g.seconds).collect::<Vec<_>>(),
            "asynchronous groups taken"
        );
        let started: Vec<u64> = groups.iter().map(|g| g.started_version).collect();
        let episodes: Vec<(usize, agentstack_harness::Episode)> = groups
            .into_iter()
            .enumerate()
            .flat_map(|(i, g)| g.episodes.into_iter().map(move |e| (i, e)))
            .collect();
        let (mut samples, advantages, mut masks) = self.shape_episodes(&episodes, m).await?;
        // Tokens whose server did not say which weights sampled them (or whose version
        // the pool could not place) count at the version their group started under
        // (the oldest they can be).
        for sample in &mut samples {
            if sample.versions.is_empty() {
                sample.versions = vec![started[sample.group]; sample.completion.len()];
            }
        }
        let current = self.policy_version.load(Ordering::Acquire);
        let staleness = mask_stale_tokens(
            &samples,
            &mut masks,
            current,
            self.config.rollout.max_staleness as u64,
        );
        m.staleness_mean = Some(staleness.mean());
        m.staleness_max = Some(staleness.max);
        m.stale_masked = Some(staleness.masked);
        m.partial_samples = Some(staleness.partial_samples);
        Ok((samples, advantages, masks))
    }

    /// Episodes → the samples a step learns from, their advantages and masks (with a
    /// teacher, shaping scores every sample, off the async runtime).
    async fn shape_episodes(
        &self,
        episodes: &[(usize, agentstack_harness::Episode)],
        m: &mut StepMetrics,
    ) -> Result<Shaped, TrainError> {
        let samples = samples_of(episodes);
        let (later, broken) = continuations(episodes);
        if later > 0 {
            (m.later_turns, m.retokenized_turns) = (Some(later), Some(broken));
        }
        let reuse = agentstack_harness::run::PrefixReuse::of(episodes.iter().map(|(_, e)| e));
        if reuse.prompt_tokens > 0 {
            m.prefix_hit_rate = Some(reuse.hit_rate);
        }
        if reuse.later_turn_prompt_tokens > 0 {
            m.later_turn_prefix_hit_rate = Some(reuse.later_turn_hit_rate);
        }
        let drafts = agentstack_harness::run::Drafts::of(episodes.iter().map(|(_, e)| e));
        if drafts.completion_tokens > 0 {
            m.accepted_draft_rate = Some(drafts.accepted_per_completion_token);
        }
        let rewards: Vec<f64> = episodes.iter().map(|(_, e)| e.reward).collect();
        (m.reward_mean, m.reward_std) = mean_std(&rewards);
        let (config, teacher, normalization) = (
            self.config.clone(),
            self.teacher.clone(),
            self.normalization,
        );
        let mut metrics = std::mem::take(m);
        let (shaped, metrics) = tokio::task::spawn_blocking(move || {
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
        .map_err(join("shaping the rewards"))?;
        *m = metrics;
        shaped
    }

    /// One optimizer step on the batch (none for an empty one); the adapters from
    /// before it go to the scheduler, as the sampler of the next batch.
    async fn learn(
        &mut self,
        (samples, advantages, masks): Shaped,
        m: &mut StepMetrics,
    ) -> Result<(), TrainError> {
        m.samples = samples.len();
        m.completion_len = if samples.is_empty() {
            0.0
        } else {
            samples.iter().map(|s| s.completion.len()).sum::<usize>() as f64 / samples.len() as f64
        };
        // A copy of the values: `lora`'s variables are the learner's own, which the
        // optimizer step below changes in place. (Asynchronous runs keep no sampler.)
        let before_learning = if self.is_async() {
            None
        } else {
            Some(
                self.lora
                    .snapshot()
                    .and_then(|adapter| Lora::from_adapter(&adapter))
                    .map_err(tensor("copying the adapters"))?,
            )
        };
        if !samples.is_empty() {
            let t = Instant::now();
            let learner = self.learner.clone();
            let sft = self.algorithm == Algorithm::Sft;
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
            m.is_masked = self.config.loss.is_mask.map(|_| learned.is_masked);
            m.tokens = learned.tokens;
            m.grad_norm = learned.grad_norm;
            m.lr = learned.lr;
        }
        self.lora = self.learner.lock().expect("learner lock").lora.clone();
        match before_learning {
            Some(before) => self.scheduler.learned(before),
            None => self.publish(m)?,
        }
        Ok(())
    }

    /// Asynchronous runs: the new adapters go into the policy slot (generations in
    /// flight go on with them from their next token), and more groups may start.
    fn publish(&mut self, m: &mut StepMetrics) -> Result<(), TrainError> {
        let Some(producer) = &self.producer else {
            return Ok(());
        };
        let (ms, version) = self.rollouts.sync_version(POLICY_ADAPTER, &self.lora)?;
        m.sync_ms += ms;
        self.policy_version.store(version, Ordering::Release);
        producer.learned();
        Ok(())
    }

    /// Pushes the new adapters to the `model serve` processes and the rollout servers,
    /// if any.
    async fn push_to_servers(&self, m: &mut StepMetrics) -> Result<(), TrainError> {
        if let Some(remote) = &self.remote {
            m.remote_sync_ms = Some(remote.push(&self.lora).await?);
        }
        if let Some(pool) = &self.pool {
            let ms = pool
                .push(&self.lora, self.policy_version.load(Ordering::Acquire))
                .await?;
            m.remote_sync_ms = Some(m.remote_sync_ms.unwrap_or(0.0) + ms);
            let (replayed, recoveries) = pool.take_counts();
            m.replayed_episodes = Some(replayed);
            m.servers_up = Some(pool.up());
            m.server_recovery_s = recoveries.into_iter().reduce(f64::max);
        }
        Ok(())
    }

    /// Whether a held-out evaluation follows step `done` (every `eval.every` steps and
    /// after the `last`, when the run evaluates).
    fn evaluates_after(&self, done: usize, last: bool) -> bool {
        let every = self.config.eval.every;
        every > 0 && self.env.is_some() && (done.is_multiple_of(every) || last)
    }

    /// Evaluates the current adapters on the held-out tasks, as of step `done`.
    async fn evaluate(&mut self, done: usize) -> Result<(f64, (f64, f64)), TrainError> {
        self.rollouts.sync(EVAL_ADAPTER, &self.lora)?;
        let result = eval::eval_at(
            &self.config,
            &self.dir,
            self.env.as_deref(),
            &self.eval_client,
            done,
        )
        .await?;
        self.evals.insert(done, result);
        Ok(result)
    }

    /// Whether `checkpoint.every` asks for a checkpoint after step `done`.
    fn checkpoints_after(&self, done: usize) -> bool {
        let every = self.config.checkpoint.every;
        every > 0 && done.is_multiple_of(every)
    }

    /// Writes the checkpoint of step `done` (with the scheduler's sampler of the next
    /// batch) and drops the oldest beyond `checkpoint.keep`.
    fn checkpoint(&self, done: usize) -> Result<(), TrainError> {
        {
            let learner = self.learner.lock().expect("learner lock");
            checkpoint::write(
                &self.dir,
                done,
                &learner.lora,
                &learner.optim,
                checkpoint::Extra {
                    metrics_lines: self.metrics.lines(),
                    next_sampler: self.scheduler.checkpoint_sampler(),
                    next_position: self.is_async().then_some(self.next_position),
                },
            )?;
        }
        checkpoint::prune(&self.dir, self.config.checkpoint.keep.max(1))
    }

    /// Drops a batch started ahead of a stopped run (and an asynchronous run's
    /// rollouts in flight), and reports.
    fn finish(mut self, stopped_at: Option<usize>, time_limit_at: Option<usize>) -> Report {
        if let Some(task) = self.scheduler.take_pending() {
            task.abort();
        }
        self.producer = None;
        Report {
            dir: self.dir,
            steps: self.config.steps,
            resumed_from: self.resumed_from,
            stopped_at,
            time_limit_at,
            eval_before: self.eval_before,
            eval_after: self.evals.range(1..).next_back().map(|(_, v)| *v),
        }
    }
}

/// Makes `dir` this run's: emptied first with `fresh`, refused when it holds a run
/// with another configuration.
fn claim_run_dir(
    dir: &std::path::Path,
    config: &TrainConfig,
    algorithm: Algorithm,
    fresh: bool,
) -> Result<(), TrainError> {
    if fresh && dir.exists() {
        fs::remove_dir_all(dir).map_err(io(dir))?;
    }
    fs::create_dir_all(dir.join("checkpoints")).map_err(io(dir))?;
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
            Ok(())
        }
        Err(_) => write_atomic(
            &config_path,
            &serde_json::to_vec_pretty(&recorded).unwrap_or_default(),
        ),
    }
}

/// How episodes in `env` are presented to the model.
fn presenter(config: &TrainConfig, env: &EnvHandle) -> Result<Arc<Presenter>, TrainError> {
    let profile = config
        .profile
        .clone()
        .unwrap_or_else(|| Profile::for_env(env.name()));
    let presenter = Presenter::new(
        profile,
        env.description(),
        &env.schema().action,
        env.tools(),
    )?;
    Ok(Arc::new(presenter))
}

/// The learner's model (f32) and the rollout engine's (quantized, or the same).
async fn load_models(config: &TrainConfig) -> Result<(LanguageModel, LanguageModel), TrainError> {
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
    Ok((learner_lm, rollout_lm))
}

/// Distillation's teacher (quantized), checked to share the student's vocabulary.
async fn load_teacher(
    config: &TrainConfig,
    algorithm: Algorithm,
    student: &agentstack_model::Model,
) -> Result<Option<Arc<LanguageModel>>, TrainError> {
    Ok(match (&config.distill, algorithm) {
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
            if teacher.model().config().vocab_size != student.config().vocab_size {
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
    })
}

/// The staleness of a step's trained tokens.
#[derive(Debug, Default, PartialEq)]
struct Staleness {
    /// Sum and count of the trained tokens' staleness, for the mean.
    sum: u64,
    tokens: u64,
    /// The most.
    max: u64,
    /// Tokens masked for being more than `max_staleness` updates old.
    masked: usize,
    /// Samples sampled by more than one weight version.
    partial_samples: usize,
}

impl Staleness {
    fn mean(&self) -> f64 {
        if self.tokens == 0 {
            0.0
        } else {
            self.sum as f64 / self.tokens as f64
        }
    }
}

/// Masks out of `masks` the tokens sampled more than `max_staleness` updates before
/// `current` (the policy slot's version the learner's weights hold), and measures the
/// staleness of the tokens it keeps. Samples without versions are left as they are.
fn mask_stale_tokens(
    samples: &[Sample],
    masks: &mut [Vec<f32>],
    current: u64,
    max_staleness: u64,
) -> Staleness {
    let mut out = Staleness::default();
    for (sample, mask) in samples.iter().zip(masks) {
        if sample.versions.len() != mask.len() {
            continue;
        }
        if sample.versions.first() != sample.versions.last() {
            out.partial_samples += 1;
        }
        for (m, &version) in mask.iter_mut().zip(&sample.versions) {
            if *m == 0.0 {
                continue;
            }
            let age = current.saturating_sub(version);
            if age > max_staleness {
                *m = 0.0;
                out.masked += 1;
            } else {
                out.sum += age;
                out.tokens += 1;
                out.max = out.max.max(age);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(versions: Vec<u64>) -> Sample {
        Sample {
            group: 0,
            prompt: vec![1],
            completion: vec![2; versions.len()],
            logprobs: vec![-1.0; versions.len()],
            versions,
            mask: Vec::new(),
            reward: 1.0,
            truncated: false,
        }
    }

    /// Tokens more than `max_staleness` updates old lose their gradient; the rest are
    /// measured; a generation that went on across an update counts as partial; tokens
    /// already masked and samples without versions are left alone.
    #[test]
    fn too_stale_tokens_are_masked_and_the_rest_measured() {
        let samples = [
            sample(vec![3, 3, 4, 5]),
            sample(vec![5, 5]),
            sample(vec![2, 2, 2]),
            sample(Vec::new()),
        ];
        let mut masks = vec![
            vec![1.0, 1.0, 1.0, 1.0],
            vec![1.0, 0.0],
            vec![0.0, 1.0, 1.0],
            vec![1.0, 1.0],
        ];
        let got = mask_stale_tokens(&samples, &mut masks, 5, 2);
        assert_eq!(
            masks,
            [
                vec![1.0, 1.0, 1.0, 1.0],
                vec![1.0, 0.0],
                vec![0.0, 0.0, 0.0],
                vec![1.0, 1.0],
            ]
        );
        assert_eq!(
            got,
            Staleness {
                sum: 2 + 2 + 1,
                tokens: 5,
                max: 2,
                masked: 2,
                partial_samples: 1,
            }
        );
        assert!((got.mean() - 1.0).abs() < 1e-12);
    }
}
