//! Playing a step's episodes on the rollout engine: which tasks, which seeds.

use std::sync::Arc;
use std::time::Instant;

use agentstack_harness::episode::{LoopConfig, play};
use agentstack_harness::prompt::Presenter;
use agentstack_harness::{ContextPolicy, EnvHandle, ModelClient, Sampling};
use agentstack_model::Model;
use agentstack_model::engine::Engine;
use agentstack_protocol::http::ResetRequest;
use futures_util::StreamExt as _;
use rand::SeedableRng;
use rand::seq::SliceRandom;

use super::error::tensor;
use super::servers::ServerPool;
use super::{POLICY_ADAPTER, TrainError};
use crate::config::TrainConfig;
use crate::lora::Lora;

/// A step's episodes (with their task index) and the seconds they took.
pub(super) type Rollout = (Vec<(usize, agentstack_harness::Episode)>, f64);

/// A step's episodes being played.
pub(super) type RolloutTask = tokio::task::JoinHandle<Result<Rollout, TrainError>>;

/// Where a run's episodes play: the in-process engine's policy slot, or the rollout
/// servers.
#[derive(Clone)]
pub(super) enum Player {
    /// The in-process engine, through this client.
    Engine(ModelClient),
    /// `rollout.servers`.
    Servers(Arc<ServerPool>),
}

impl Player {
    /// Plays one episode.
    pub(super) async fn play(
        &self,
        env: &EnvHandle,
        presenter: &Presenter,
        reset: ResetRequest,
        seed: u64,
        config: &LoopConfig,
    ) -> Result<agentstack_harness::Episode, TrainError> {
        match self {
            Self::Engine(model) => play(model, env, presenter, reset, seed, config)
                .await
                .map(|(episode, _)| episode)
                .map_err(|e| TrainError::Episode(Box::new(e))),
            Self::Servers(pool) => pool.play(env, presenter, reset, seed, config).await,
        }
    }
}

/// The rollout side of a run: the engine on the rollout weights, and what a step's
/// episodes need.
pub(super) struct RolloutSide {
    config: Arc<TrainConfig>,
    engine: Engine,
    /// The rollout weights the adapters go on.
    base: Model,
    /// Where the episodes play.
    player: Player,
    env: Option<Arc<EnvHandle>>,
    presenter: Option<Arc<Presenter>>,
}

impl RolloutSide {
    pub(super) fn new(
        config: Arc<TrainConfig>,
        engine: Engine,
        base: Model,
        player: Player,
        env: Option<Arc<EnvHandle>>,
        presenter: Option<Arc<Presenter>>,
    ) -> Self {
        Self {
            config,
            engine,
            base,
            player,
            env,
            presenter,
        }
    }

    /// Puts `lora` on the rollout weights in the engine's `slot`; the milliseconds
    /// that took.
    pub(super) fn sync(&self, slot: &str, lora: &Lora) -> Result<f64, TrainError> {
        self.sync_version(slot, lora).map(|(ms, _)| ms)
    }

    /// [`Self::sync`], also returning the slot's new version (which tokens sampled
    /// from these weights name).
    pub(super) fn sync_version(&self, slot: &str, lora: &Lora) -> Result<(f64, u64), TrainError> {
        let t = Instant::now();
        let adapter = lora.snapshot().map_err(tensor("copying the adapters"))?;
        let adapted = adapter
            .apply(&self.base)
            .map_err(|source| TrainError::Model {
                what: "applying the adapters to the rollout model",
                source: Box::new(source),
            })?;
        let version = self.engine.set_adapter(slot, adapted);
        Ok((t.elapsed().as_secs_f64() * 1e3, version))
    }

    /// Where the episodes play.
    pub(super) fn player(&self) -> &Player {
        &self.player
    }

    /// The environment and how its episodes are presented (training on rollouts).
    pub(super) fn env_and_presenter(&self) -> Option<(Arc<EnvHandle>, Arc<Presenter>)> {
        Some((self.env.clone()?, self.presenter.clone()?))
    }

    /// Puts `sampler` in the policy slot (adding the milliseconds to `sync_ms`) and
    /// starts playing `step`'s episodes on it.
    pub(super) fn start(
        &self,
        step: usize,
        sampler: &Lora,
        sync_ms: &mut f64,
    ) -> Result<RolloutTask, TrainError> {
        *sync_ms += self.sync(POLICY_ADAPTER, sampler)?;
        let (config, player) = (self.config.clone(), self.player.clone());
        let (env, presenter) = (self.env.clone(), self.presenter.clone());
        Ok(tokio::spawn(async move {
            let (env, presenter) = (
                env.expect("training on rollouts has an environment"),
                presenter.expect("an environment has a presenter"),
            );
            let t = Instant::now();
            let resets = step_resets(&config, &env, step)?;
            let episodes = rollouts(&config, &player, &env, &presenter, step, resets).await?;
            Ok((episodes, t.elapsed().as_secs_f64()))
        }))
    }
}

/// SplitMix64 of several words: the seed of one episode or one shuffle.
pub(super) fn mix(words: &[u64]) -> u64 {
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
pub(super) fn shuffled(salt: &[u64], n: usize, position: u64) -> usize {
    let pass = position / n as u64;
    let mut order: Vec<usize> = (0..n).collect();
    let seed = mix(&[salt, &[pass]].concat());
    order.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(seed));
    order[(position % n as u64) as usize]
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
pub(super) fn step_resets(
    config: &TrainConfig,
    env: &EnvHandle,
    step: usize,
) -> Result<Vec<ResetRequest>, TrainError> {
    let per_step = config.rollout.prompts_per_step;
    (0..per_step)
        .map(|j| {
            let position = (step * per_step + j) as u64;
            reset_at(config, env, position, format!("train-{step}-{j}"))
        })
        .collect()
}

/// The reset of the run's task at `position` of its endless task sequence: a task
/// from a seeded permutation of the split (a new one each pass over it), or a seeded
/// problem without a split.
pub(super) fn reset_at(
    config: &TrainConfig,
    env: &EnvHandle,
    position: u64,
    episode_id: String,
) -> Result<ResetRequest, TrainError> {
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
    Ok(ResetRequest {
        seed,
        episode_id: Some(episode_id),
        options,
    })
}

/// How a training episode is played: the rollout section's sampling and turns.
pub(super) fn loop_config(config: &TrainConfig) -> LoopConfig {
    LoopConfig {
        max_turns: config.rollout.max_turns,
        sampling: Sampling {
            temperature: config.rollout.temperature,
            top_p: config.rollout.top_p,
            max_tokens: config.rollout.max_tokens,
        },
        context: ContextPolicy::default(),
        constrain: false,
    }
}

/// Plays the step's episodes: `group_size` per reset, each seeded from the run's seed,
/// the step and its place, so the same step always samples the same way.
pub(super) async fn rollouts(
    config: &TrainConfig,
    player: &Player,
    env: &EnvHandle,
    presenter: &Presenter,
    step: usize,
    resets: Vec<ResetRequest>,
) -> Result<Vec<(usize, agentstack_harness::Episode)>, TrainError> {
    let play_config = loop_config(config);
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
            let played = player.play(env, presenter, reset, seed, play_config).await;
            (index, j, played)
        },
    ))
    .buffer_unordered(config.rollout.concurrency);
    while let Some((index, j, played)) = stream.next().await {
        results[index] = Some((j, played?));
    }
    Ok(results.into_iter().flatten().collect())
}
