//! Evaluation runs: N episodes of a model on an environment, K at a time, written to
//! `runs/<id>/` as they finish, resumable after a kill.
//!
//! A run directory holds:
//!
//! - `config.json`: the run's configuration (what decides its results) and its hash;
//! - `results.jsonl`: one [`EpisodeRecord`] per line, **in episode order**, each line
//!   written whole and synced before the next; the same configuration gives the same
//!   bytes, whatever the concurrency;
//! - `timings.jsonl`: wall times per episode, in the same order (apart, because they
//!   differ from run to run);
//! - `summary.json`: the statistics, written atomically when the run completes.
//!
//! After a kill the file ends with at most one partial line. Rerunning the same
//! command finds the directory by the configuration's hash, cuts the partial line,
//! and plays the episodes not yet written: none is lost and none repeated.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use agentstack_protocol::http::ResetRequest;
use agentstack_static::with_causes;
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use crate::env::EnvHandle;
use crate::episode::{Episode, EpisodeError, LoopConfig, Timing, play};
use crate::model::ModelClient;
use crate::prompt::{Presenter, Profile};
use crate::stats;

/// Everything that decides a run's results. Two runs with equal configurations give
/// identical `results.jsonl` files.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvalConfig {
    /// The environment, as the user named it.
    pub env: String,
    /// The model, as the user named it.
    pub model: String,
    /// Tasks to play.
    pub tasks: usize,
    /// Episodes per task (for pass@k); episodes = tasks × samples.
    pub samples: usize,
    /// The run's seed: task `t` resets with seed `seed + t` (unless a split gives the
    /// tasks), and sampling seeds derive from it.
    pub seed: u64,
    /// Take tasks from this split of the environment's task list.
    pub split: Option<String>,
    /// Extra reset options for every episode (e.g. `difficulty`).
    pub reset_options: Map<String, Value>,
    /// How episodes are played.
    pub play: LoopConfig,
    /// How the environment is presented to the model.
    pub profile: Profile,
    /// An episode with at least this reward is a success.
    pub success_threshold: f64,
}

impl EvalConfig {
    /// Episodes in the run.
    pub fn episodes(&self) -> usize {
        self.tasks * self.samples
    }

    /// A short hash of the configuration: the default run id's suffix.
    pub fn digest(&self) -> String {
        stats::short_hash(&serde_json::to_string(self).unwrap_or_default())
    }

    /// The default run id: `<env>-<model>-<hash>`, made filesystem-safe.
    pub fn default_run_id(&self) -> String {
        let clean = |s: &str| -> String {
            let base = s.rsplit(['/', ':']).next().unwrap_or(s);
            let base = base.strip_suffix(".gguf").unwrap_or(base);
            base.chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                        c
                    } else {
                        '_'
                    }
                })
                .take(40)
                .collect()
        };
        format!(
            "{}-{}-{}",
            clean(&self.env),
            clean(&self.model),
            self.digest()
        )
    }
}

/// One line of `results.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EpisodeRecord {
    /// Position in the run, from 0.
    pub index: usize,
    /// The task played.
    pub task: usize,
    /// Which sample of the task.
    pub sample: usize,
    /// The sampling seed.
    pub seed: u64,
    /// Whether the reward reached the success threshold.
    pub success: bool,
    /// The episode.
    #[serde(flatten)]
    pub episode: Episode,
}

/// One line of `timings.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TimingRecord {
    /// Position in the run.
    pub index: usize,
    /// The times.
    #[serde(flatten)]
    pub timing: Timing,
}

/// `summary.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// The run's id (its directory name).
    pub run_id: String,
    /// The environment.
    pub env: String,
    /// The model.
    pub model: String,
    /// The configuration's hash.
    pub config_hash: String,
    /// The prompt profile's hash.
    pub profile_hash: String,
    /// Episodes played.
    pub episodes: usize,
    /// Mean episode reward.
    pub mean_reward: f64,
    /// Sample standard deviation of the rewards.
    pub reward_sd: f64,
    /// Standard error of the mean.
    pub stderr: f64,
    /// 95% confidence interval of the mean: Wilson for 0/1 rewards, bootstrap
    /// percentile otherwise; it never leaves the range of the rewards (see
    /// [`stats::ci95`]).
    pub ci95: (f64, f64),
    /// Fraction of episodes at or above the success threshold.
    pub success_rate: f64,
    /// pass@k for k = 1 and k = samples (unbiased estimator, mean over tasks).
    pub pass_at_k: BTreeMap<String, f64>,
    /// Mean model turns per episode.
    pub mean_turns: f64,
    /// Replies that were not an action, per model turn.
    pub parse_error_rate: f64,
    /// Actions the environment rejected, per model turn.
    pub invalid_action_rate: f64,
    /// How episodes ended: `done`, `turn_limit`, `context`.
    pub finishes: BTreeMap<String, usize>,
    /// Prompt tokens over all turns.
    pub prompt_tokens: usize,
    /// Generated tokens over all turns.
    pub completion_tokens: usize,
    /// How much of this invocation's prompts the model side read from its cache instead
    /// of running them through the model (absent from summaries written before it was
    /// counted).
    #[serde(default)]
    pub prefix_reuse: PrefixReuse,
    /// The model side's speculative decoding in this invocation's episodes (absent from
    /// summaries written before it was counted).
    #[serde(default)]
    pub speculative_decoding: Drafts,
    /// Wall time of the invocation that finished the run, seconds.
    pub wall_s: f64,
    /// Episodes per second in that invocation.
    pub episodes_per_s: f64,
    /// Fraction of that invocation's wall time in which no model call was running.
    pub model_idle_fraction: f64,
    /// Episodes played by that invocation (fewer than `episodes` after a resume).
    pub played_now: usize,
}

/// Prompt tokens read from the model side's cache (its prefix reuse) in the episodes
/// this invocation played (a cache does not outlive its process, and episodes read back
/// from the results file do not say), over all turns and over the turns after an
/// episode's first, whose prompt starts with the conversation so far. A server that
/// does not report cached tokens counts 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct PrefixReuse {
    /// Prompt tokens of the turns played by this invocation.
    pub prompt_tokens: usize,
    /// Of those, read from the cache.
    pub cached_tokens: usize,
    /// `cached_tokens` over `prompt_tokens`.
    pub hit_rate: f64,
    /// Prompt tokens of the turns after each episode's first.
    pub later_turn_prompt_tokens: usize,
    /// Of those, read from the cache.
    pub later_turn_cached_tokens: usize,
    /// `later_turn_cached_tokens` over `later_turn_prompt_tokens`.
    pub later_turn_hit_rate: f64,
}

impl PrefixReuse {
    /// Counts the turns of `episodes` that were played by this process.
    pub fn of<'a>(episodes: impl Iterator<Item = &'a Episode>) -> Self {
        let mut reuse = Self::default();
        for episode in episodes {
            reuse.add(episode);
        }
        reuse
    }

    /// Adds the turns of `episode` that were played by this process.
    pub fn add(&mut self, episode: &Episode) {
        for (i, turn) in episode.turns.iter().enumerate() {
            let Some(cached) = turn.cached_tokens else {
                continue;
            };
            self.prompt_tokens += turn.prompt_tokens;
            self.cached_tokens += cached;
            if i > 0 {
                self.later_turn_prompt_tokens += turn.prompt_tokens;
                self.later_turn_cached_tokens += cached;
            }
        }
        self.hit_rate = share(self.cached_tokens, self.prompt_tokens);
        self.later_turn_hit_rate =
            share(self.later_turn_cached_tokens, self.later_turn_prompt_tokens);
    }
}

/// Speculative decoding in the turns of the episodes this invocation played: how many
/// of their tokens came from kept drafts (each saved a forward pass). The output is the
/// same with it or without. A server that does not report drafts counts 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Drafts {
    /// Tokens generated in the turns played by this invocation.
    pub completion_tokens: usize,
    /// Draft tokens verified.
    pub draft_tokens: usize,
    /// Of those, kept.
    pub accepted_draft_tokens: usize,
    /// `accepted_draft_tokens` over `draft_tokens`.
    pub acceptance_rate: f64,
    /// `accepted_draft_tokens` over `completion_tokens`: the share of forward passes
    /// saved.
    pub accepted_per_completion_token: f64,
}

impl Drafts {
    /// Counts the turns of `episodes` that were played by this process.
    pub fn of<'a>(episodes: impl Iterator<Item = &'a Episode>) -> Self {
        let mut drafts = Self::default();
        for episode in episodes {
            drafts.add(episode);
        }
        drafts
    }

    /// Adds the turns of `episode` that were played by this process.
    pub fn add(&mut self, episode: &Episode) {
        for turn in &episode.turns {
            let Some(counts) = turn.drafts else {
                continue;
            };
            self.completion_tokens += turn.completion_tokens;
            self.draft_tokens += counts.drafted;
            self.accepted_draft_tokens += counts.accepted;
        }
        self.acceptance_rate = share(self.accepted_draft_tokens, self.draft_tokens);
        self.accepted_per_completion_token =
            share(self.accepted_draft_tokens, self.completion_tokens);
    }
}

/// `part` over `whole` (0 when `whole` is).
fn share(part: usize, whole: usize) -> f64 {
    part as f64 / whole.max(1) as f64
}

/// Progress, reported after each episode is written.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    /// Episodes written.
    pub done: usize,
    /// Episodes in the run.
    pub total: usize,
    /// Mean reward of those written.
    pub mean_reward: f64,
}

/// Why a run failed.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Reading or writing the run directory failed.
    #[error("cannot read or write {path}")]
    Io {
        /// Which file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The directory holds a run with another configuration.
    #[error(
        "{dir} holds a run with a different configuration (hash {found}, this one {wanted}); pick another --run-id, or pass --fresh to discard it"
    )]
    ConfigMismatch {
        /// The directory.
        dir: PathBuf,
        /// Its hash.
        found: String,
        /// Ours.
        wanted: String,
    },
    /// Another process is writing the run.
    #[error("{dir} is in use by process {pid}; wait for it or stop it")]
    Locked {
        /// The directory.
        dir: PathBuf,
        /// The holder.
        pid: u32,
    },
    /// An episode failed three times.
    #[error("episode {index} failed")]
    Episode {
        /// Which.
        index: usize,
        /// Why.
        #[source]
        source: Box<EpisodeError>,
    },
    /// The configuration is unusable.
    #[error("{0}")]
    Config(String),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> RunError + '_ {
    move |source| RunError::Io {
        path: path.to_owned(),
        source,
    }
}

/// How many times an episode is tried before the run stops.
const EPISODE_ATTEMPTS: usize = 3;

/// How long an episode waits for a session on an environment server at capacity.
const CAPACITY_WAIT: Duration = Duration::from_secs(600);

/// Whether the environment refused a session because it holds its maximum.
fn at_capacity(error: &EpisodeError) -> bool {
    matches!(
        error,
        EpisodeError::Env(crate::env::EnvError::Client(agentstack_env::client::ClientError::Server(e)))
            if e.code == agentstack_protocol::ws::ErrorCode::CapacityReached
    )
}

/// A run in progress.
pub struct Run {
    dir: PathBuf,
    config: EvalConfig,
    concurrency: usize,
    _lock: LockFile,
}

impl Run {
    /// Opens (or creates) the run directory `dir` for `config`. With `fresh`, an
    /// existing run there is discarded.
    pub fn open(
        dir: &Path,
        config: EvalConfig,
        concurrency: usize,
        fresh: bool,
    ) -> Result<Self, RunError> {
        if config.tasks == 0 || config.samples == 0 {
            return Err(RunError::Config(
                "a run needs at least one task and one sample".into(),
            ));
        }
        if concurrency == 0 {
            return Err(RunError::Config("concurrency must be at least 1".into()));
        }
        fs::create_dir_all(dir).map_err(io(dir))?;
        let lock = LockFile::take(dir)?;
        let config_path = dir.join("config.json");
        if fresh {
            for name in [
                "config.json",
                "results.jsonl",
                "timings.jsonl",
                "summary.json",
            ] {
                let path = dir.join(name);
                if path.exists() {
                    fs::remove_file(&path).map_err(io(&path))?;
                }
            }
        }
        let wanted = config.digest();
        match fs::read_to_string(&config_path) {
            Ok(text) => {
                let found: Value = serde_json::from_str(&text).unwrap_or_default();
                let found = found["config_hash"]
                    .as_str()
                    .unwrap_or("unreadable")
                    .to_owned();
                if found != wanted {
                    return Err(RunError::ConfigMismatch {
                        dir: dir.to_owned(),
                        found,
                        wanted,
                    });
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let body = json!({"config_hash": wanted, "config": config});
                write_atomic(
                    &config_path,
                    &serde_json::to_vec_pretty(&body).unwrap_or_default(),
                )?;
            }
            Err(e) => return Err(io(&config_path)(e)),
        }
        Ok(Self {
            dir: dir.to_owned(),
            config,
            concurrency,
            _lock: lock,
        })
    }

    /// The run directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Plays the episodes not yet written and writes the summary.
    pub async fn play(
        &self,
        model: &ModelClient,
        env: &EnvHandle,
        mut progress: impl FnMut(Progress),
    ) -> Result<Summary, RunError> {
        let started = Instant::now();
        let presenter = Presenter::new(
            self.config.profile.clone(),
            env.description(),
            &env.schema().action,
            env.tools(),
        )
        .map_err(|e| RunError::Config(e.to_string()))?;
        let results_path = self.dir.join("results.jsonl");
        let timings_path = self.dir.join("timings.jsonl");
        let written: Vec<EpisodeRecord> = recover(&results_path)?;
        let timed: Vec<TimingRecord> = recover(&timings_path)?;
        let total = self.config.episodes();
        let mut rewards: Vec<f64> = written.iter().map(|r| r.episode.reward).collect();
        // Timings are kept for the episodes whose results exist.
        truncate_lines(&timings_path, timed.len().min(written.len()))?;
        let mut results = append(&results_path)?;
        let mut timings = append(&timings_path)?;
        let start = written.len();
        progress(Progress {
            done: start,
            total,
            mean_reward: mean(&rewards),
        });
        let resets = (start..total)
            .map(|i| self.reset_for(env, i).map(|r| (i, r)))
            .collect::<Result<Vec<_>, _>>()?;
        let activity = model.activity().restart();
        let work = futures_util::stream::iter(resets.into_iter().map(|(index, reset)| {
            let presenter = &presenter;
            async move {
                let seed = crate::episode::turn_seed(self.config.seed, index + (1 << 32));
                let mut last = None;
                let mut attempts = 0;
                let mut backoff = Duration::from_millis(50);
                let waiting_since = Instant::now();
                while attempts < EPISODE_ATTEMPTS {
                    let played = play(
                        model,
                        env,
                        presenter,
                        reset.clone(),
                        seed,
                        &self.config.play,
                    )
                    .await;
                    match played {
                        Ok(done) => return (index, seed, Ok(done)),
                        // A server at its session limit is busy, not broken: wait for
                        // a session to free up (the run's concurrency exceeds the
                        // server's), without counting an attempt.
                        Err(e) if at_capacity(&e) && waiting_since.elapsed() < CAPACITY_WAIT => {
                            tracing::debug!(index, "environment at capacity; waiting");
                            tokio::time::sleep(backoff).await;
                            backoff = (backoff * 2).min(Duration::from_secs(1));
                        }
                        Err(e) => {
                            tracing::warn!(
                                index,
                                error = %with_causes(&e),
                                "episode failed; retrying"
                            );
                            attempts += 1;
                            last = Some(e);
                        }
                    }
                }
                (index, seed, Err(last.expect("at least one attempt")))
            }
        }))
        .buffer_unordered(self.concurrency);
        futures_util::pin_mut!(work);
        let mut pending = BTreeMap::new();
        let mut next = start;
        let mut reuse = PrefixReuse::default();
        let mut drafts = Drafts::default();
        while let Some((index, seed, outcome)) = work.next().await {
            let (episode, timing) = outcome.map_err(|source| RunError::Episode {
                index,
                source: Box::new(source),
            })?;
            pending.insert(index, (seed, episode, timing));
            while let Some((seed, episode, timing)) = pending.remove(&next) {
                let record = EpisodeRecord {
                    index: next,
                    task: next / self.config.samples,
                    sample: next % self.config.samples,
                    seed,
                    success: episode.reward >= self.config.success_threshold,
                    episode,
                };
                rewards.push(record.episode.reward);
                reuse.add(&record.episode);
                drafts.add(&record.episode);
                write_line(&mut results, &results_path, &record)?;
                write_line(
                    &mut timings,
                    &timings_path,
                    &TimingRecord {
                        index: next,
                        timing,
                    },
                )?;
                next += 1;
                progress(Progress {
                    done: next,
                    total,
                    mean_reward: mean(&rewards),
                });
            }
        }
        let summary = summarize(
            &self.dir,
            &self.config,
            &recover::<EpisodeRecord>(&results_path)?,
            Invocation {
                wall: started.elapsed(),
                model_idle_fraction: activity.idle_fraction(),
                played_now: total - start,
                prefix_reuse: reuse,
                speculative_decoding: drafts,
            },
        );
        write_atomic(
            &self.dir.join("summary.json"),
            &serde_json::to_vec_pretty(&summary).unwrap_or_default(),
        )?;
        Ok(summary)
    }

    fn reset_for(&self, env: &EnvHandle, index: usize) -> Result<ResetRequest, RunError> {
        let task = index / self.config.samples;
        let mut options = self.config.reset_options.clone();
        let mut seed = Some(self.config.seed.wrapping_add(task as u64));
        if let Some(split) = &self.config.split {
            let tasks = env.tasks().ok_or_else(|| {
                RunError::Config(format!(
                    "{} publishes no task list; drop --split",
                    env.name()
                ))
            })?;
            let n = tasks
                .num_tasks(split)
                .map_err(|e| RunError::Config(e.to_string()))?;
            let args = tasks
                .task(split, task % n.max(1))
                .map_err(|e| RunError::Config(e.to_string()))?;
            apply_task(args, &mut options, &mut seed);
        }
        Ok(ResetRequest {
            seed,
            episode_id: Some(format!("episode-{index}")),
            options,
        })
    }
}

/// Merges a task from an environment's task list (its reset arguments) into a reset:
/// its `seed` replaces `seed`, its other keys fill `options` where the caller set none.
pub fn apply_task(task: Value, options: &mut Map<String, Value>, seed: &mut Option<u64>) {
    if let Value::Object(args) = task {
        for (k, v) in args {
            if k == "seed" {
                *seed = v.as_u64();
            } else {
                options.entry(k).or_insert(v);
            }
        }
    }
}

fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        f64::NAN
    } else {
        xs.iter().sum::<f64>() / xs.len() as f64
    }
}

/// What the invocation that finished a run measured of its own episodes.
#[derive(Debug, Clone, Copy)]
pub struct Invocation {
    /// Its wall time.
    pub wall: Duration,
    /// Fraction of it in which no model call was running.
    pub model_idle_fraction: f64,
    /// Episodes it played.
    pub played_now: usize,
    /// Their prompt tokens read from the model side's cache.
    pub prefix_reuse: PrefixReuse,
    /// Their speculative decoding.
    pub speculative_decoding: Drafts,
}

/// The statistics of a run's records and of the invocation that finished it.
pub fn summarize(
    dir: &Path,
    config: &EvalConfig,
    records: &[EpisodeRecord],
    invocation: Invocation,
) -> Summary {
    let Invocation {
        wall,
        model_idle_fraction,
        played_now,
        prefix_reuse,
        speculative_decoding,
    } = invocation;
    let rewards: Vec<f64> = records.iter().map(|r| r.episode.reward).collect();
    let (mean_reward, reward_sd, stderr) = stats::mean_sd_se(&rewards);
    let turns: usize = records
        .iter()
        .map(|r| {
            r.episode
                .turns
                .iter()
                .filter(|t| t.kind == crate::episode::TurnKind::Act)
                .count()
        })
        .sum();
    let per_turn = |n: usize| {
        if turns == 0 {
            0.0
        } else {
            n as f64 / turns as f64
        }
    };
    let mut finishes = BTreeMap::new();
    for r in records {
        let name = serde_json::to_value(r.episode.finish)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        *finishes.entry(name).or_insert(0) += 1;
    }
    let mut by_task: BTreeMap<usize, (usize, usize)> = BTreeMap::new();
    for r in records {
        let e = by_task.entry(r.task).or_default();
        e.0 += 1;
        e.1 += usize::from(r.success);
    }
    let mut pass_at_k = BTreeMap::new();
    for k in [1, config.samples] {
        let values: Vec<f64> = by_task
            .values()
            .map(|&(n, c)| stats::pass_at_k(n, c, k))
            .filter(|v| v.is_finite())
            .collect();
        pass_at_k.insert(format!("pass@{k}"), mean(&values));
    }
    let n = records.len();
    Summary {
        run_id: dir
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default(),
        env: config.env.clone(),
        model: config.model.clone(),
        config_hash: config.digest(),
        profile_hash: config.profile.digest(),
        episodes: n,
        mean_reward,
        reward_sd,
        stderr,
        ci95: stats::ci95(&rewards),
        success_rate: records.iter().filter(|r| r.success).count() as f64 / n.max(1) as f64,
        pass_at_k,
        mean_turns: turns as f64 / n.max(1) as f64,
        parse_error_rate: per_turn(records.iter().map(|r| r.episode.parse_errors).sum()),
        invalid_action_rate: per_turn(records.iter().map(|r| r.episode.invalid_actions).sum()),
        finishes,
        prompt_tokens: records
            .iter()
            .flat_map(|r| &r.episode.turns)
            .map(|t| t.prompt_tokens)
            .sum(),
        completion_tokens: records
            .iter()
            .flat_map(|r| &r.episode.turns)
            .map(|t| t.completion_tokens)
            .sum(),
        prefix_reuse,
        speculative_decoding,
        wall_s: wall.as_secs_f64(),
        episodes_per_s: played_now as f64 / wall.as_secs_f64().max(1e-9),
        model_idle_fraction,
        played_now,
    }
}

/// Reads the complete records of a results file and cuts anything after the last
/// complete line (the remains of a kill mid-write).
fn recover<T: serde::de::DeserializeOwned>(path: &Path) -> Result<Vec<T>, RunError> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io(path)(e)),
    };
    let mut reader = BufReader::new(file);
    let mut records = Vec::new();
    let mut good_bytes = 0u64;
    let mut line = String::new();
    loop {
        line.clear();
        let n = reader.read_line(&mut line).map_err(io(path))?;
        if n == 0 || !line.ends_with('\n') {
            break;
        }
        match serde_json::from_str::<T>(&line) {
            Ok(record) => {
                records.push(record);
                good_bytes += n as u64;
            }
            Err(_) => break,
        }
    }
    let len = fs::metadata(path).map_err(io(path))?.len();
    if len != good_bytes {
        tracing::warn!(path = %path.display(), kept = records.len(), "cutting an incomplete last line");
        let file = OpenOptions::new()
            .write(true)
            .open(path)
            .map_err(io(path))?;
        file.set_len(good_bytes).map_err(io(path))?;
        file.sync_all().map_err(io(path))?;
    }
    Ok(records)
}

/// Keeps the first `keep` lines of `path`.
fn truncate_lines(path: &Path, keep: usize) -> Result<(), RunError> {
    let Ok(text) = fs::read_to_string(path) else {
        return Ok(());
    };
    let cut: usize = text.split_inclusive('\n').take(keep).map(str::len).sum();
    if cut != text.len() {
        let file = OpenOptions::new()
            .write(true)
            .open(path)
            .map_err(io(path))?;
        file.set_len(cut as u64).map_err(io(path))?;
        file.sync_all().map_err(io(path))?;
    }
    Ok(())
}

fn append(path: &Path) -> Result<File, RunError> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(io(path))
}

/// Writes one JSON line with a single `write` and syncs it.
fn write_line<T: Serialize>(file: &mut File, path: &Path, record: &T) -> Result<(), RunError> {
    let mut line = serde_json::to_vec(record).unwrap_or_default();
    line.push(b'\n');
    file.write_all(&line).map_err(io(path))?;
    file.sync_data().map_err(io(path))
}

/// Writes a file through a temporary file and a rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), RunError> {
    let tmp = path.with_extension("tmp");
    {
        let mut f = File::create(&tmp).map_err(io(&tmp))?;
        f.write_all(bytes).map_err(io(&tmp))?;
        f.sync_all().map_err(io(&tmp))?;
    }
    fs::rename(&tmp, path).map_err(io(path))
}

/// Reads a run's records (for `eval compare` and tests).
pub fn read_results(dir: &Path) -> Result<Vec<EpisodeRecord>, RunError> {
    let path = dir.join("results.jsonl");
    let text = fs::read_to_string(&path).map_err(io(&path))?;
    text.lines()
        .map(|l| {
            serde_json::from_str(l).map_err(|e| RunError::Io {
                path: path.clone(),
                source: std::io::Error::other(e),
            })
        })
        .collect()
}

/// A `.lock` file holding the writer's pid; a stale one (dead process) is taken over.
struct LockFile(PathBuf);

impl LockFile {
    fn take(dir: &Path) -> Result<Self, RunError> {
        let path = dir.join(".lock");
        for _ in 0..2 {
            match OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(mut f) => {
                    let _ = write!(f, "{}", std::process::id());
                    return Ok(Self(path));
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let pid: u32 = fs::read_to_string(&path)
                        .ok()
                        .and_then(|s| s.trim().parse().ok())
                        .unwrap_or(0);
                    if pid != 0
                        && pid != std::process::id()
                        && Path::new(&format!("/proc/{pid}")).exists()
                    {
                        return Err(RunError::Locked {
                            dir: dir.to_owned(),
                            pid,
                        });
                    }
                    let _ = fs::remove_file(&path);
                }
                Err(e) => return Err(io(&path)(e)),
            }
        }
        Err(RunError::Locked {
            dir: dir.to_owned(),
            pid: 0,
        })
    }
}

impl Drop for LockFile {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}
