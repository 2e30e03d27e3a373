//! `agentstack eval`: evaluate a model on an environment; `eval compare`.

pub mod compare;

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use agentstack_env::client::ClientConfig;
use agentstack_env::foreign::ForeignEnv;
use agentstack_harness::context::{ContextPolicy, Overflow};
use agentstack_harness::episode::LoopConfig;
use agentstack_harness::model::Sampling;
use agentstack_harness::reference::{EnvReference, ModelReference};
use agentstack_harness::{EnvHandle, EvalConfig, ModelClient, Profile, Run, Summary};
use agentstack_model::engine::{Engine, EngineConfig};
use agentstack_model::speculate::Speculation;
use anyhow::{Context, anyhow};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{Map, Value};

use crate::args::{EvalArgs, EvalCommand, EvalRunArgs};
use crate::commands::env::serve::{Target, builtins, resolve as resolve_env};
use crate::settings;
use crate::{Exit, IntoUserError, user_error};

/// Runs `eval` or `eval compare`.
pub async fn run(args: EvalArgs) -> Result<(), Exit> {
    match args.command {
        Some(EvalCommand::Compare(args)) => compare::run(args),
        None => {
            let resolved = EvalSettings::resolve(&args.run)?;
            if args.run.show_settings {
                return settings::show(&resolved);
            }
            let post = resolved.post;
            let (summary, dir) = evaluate(resolved).await?;
            print_summary(&summary, &dir, args.run.json);
            if post {
                post_summary(&summary).await?;
            }
            Ok(())
        }
    }
}

/// The runs directory: the flag, else the data directory's `runs/`.
pub(crate) fn runs_dir(flag: Option<PathBuf>) -> PathBuf {
    flag.unwrap_or_else(|| settings::data_dir().join("runs"))
}

/// An environment opened for a run, and the foreign server behind it (kept alive).
pub(crate) struct OpenedEnv {
    pub handle: EnvHandle,
    _foreign: Option<ForeignEnv>,
}

/// Posts a run's summary to the leaderboard of the hub package it evaluated.
async fn post_summary(summary: &Summary) -> Result<(), Exit> {
    let package = agentstack_harness::leaderboard::package_of(&summary.env)
        .ok_or_else(|| user_error!("--post needs --env hub:owner/name[@version]"))?;
    let hub = settings::hub_client(None)?;
    agentstack_harness::leaderboard::post(&hub, &package, summary)
        .await
        .map_err(crate::commands::hub::client_exit)?;
    eprintln!("posted to the leaderboard of {package} at {}", hub.url());
    Ok(())
}

/// Opens an environment reference (a `hub:` reference is pulled by the caller and
/// passed as its [`EnvReference::Package`]). A server reached by URL gets the first key
/// of `AGENTSTACK_API_KEY`, when it is set; a package runs with `python`.
pub(crate) async fn open_env(reference: &EnvReference, python: &str) -> anyhow::Result<OpenedEnv> {
    let target = match reference {
        EnvReference::Url(url) => {
            let handle = EnvHandle::remote(url, settings::env_client())
                .await
                .with_context(|| format!("could not open the environment at {url}"))?;
            return Ok(OpenedEnv {
                handle,
                _foreign: None,
            });
        }
        EnvReference::Hub(package) => {
            return Err(anyhow!("hub:{package} must be pulled before it is opened"));
        }
        other => resolve_env(&other.to_string(), python)?,
    };
    match target {
        Target::Builtin(spec) => Ok(OpenedEnv {
            handle: EnvHandle::local(*spec).map_err(|e| anyhow!("{e}"))?,
            _foreign: None,
        }),
        Target::Foreign(command) => {
            let foreign = ForeignEnv::start(command, Duration::from_secs(120))
                .await
                .user_context("starting the environment")?;
            let handle = EnvHandle::remote(foreign.url(), ClientConfig::default())
                .await
                .context("opening the environment")?;
            Ok(OpenedEnv {
                handle,
                _foreign: Some(foreign),
            })
        }
    }
}

/// An environment reference, its `hub:` package pulled: what a run records (the
/// package with the version it resolved to, so a run and its leaderboard entry name
/// exactly what it evaluated) and what to open.
pub(crate) async fn pull_env(reference: &EnvReference) -> anyhow::Result<(String, EnvReference)> {
    Ok(match reference {
        EnvReference::Hub(package) => {
            let pulled = crate::commands::hub::pull_package(package).await?;
            (
                format!("hub:{}@{}", pulled.package, pulled.version),
                EnvReference::Package(pulled.dir),
            )
        }
        other => (other.to_string(), other.clone()),
    })
}

/// Opens a model reference: an OpenAI-compatible base URL, or a local model run by the
/// in-process engine.
pub(crate) async fn open_model(
    reference: &ModelReference,
    name: Option<&str>,
    api_key_env: &str,
    threads: Option<usize>,
    speculation: Speculation,
) -> anyhow::Result<ModelClient> {
    let local = match reference {
        ModelReference::Local(local) => local,
        ModelReference::Url(_) => {
            // By default AGENTSTACK_API_KEY (what `model serve` asks for), then
            // OPENAI_API_KEY; a variable named with --api-key-env alone.
            let api_key = if api_key_env == agentstack_harness::model::OPENAI_API_KEY_ENV {
                agentstack_harness::model::api_key_from_env()
            } else {
                settings::env_var(api_key_env)
            };
            let base = reference.base_url().unwrap_or_default();
            let name = match name {
                Some(name) => name.to_owned(),
                None => first_model(base, api_key.as_deref()).await?,
            };
            return Ok(ModelClient::openai(
                base,
                &name,
                api_key,
                Duration::from_secs(600),
            ));
        }
    };
    let lm = Arc::new(crate::commands::model::load(local, threads).await?);
    let name = name
        .map(str::to_owned)
        .unwrap_or_else(|| lm.info().name.clone());
    let engine = Engine::start(
        lm,
        EngineConfig {
            speculation,
            ..EngineConfig::default()
        },
    );
    Ok(ModelClient::engine(engine, &name))
}

/// The first model a server lists at `/models`.
async fn first_model(base: &str, api_key: Option<&str>) -> anyhow::Result<String> {
    let url = format!("{base}/models");
    let mut request = reqwest::Client::new()
        .get(&url)
        .timeout(Duration::from_secs(30));
    if let Some(key) = api_key {
        request = request.bearer_auth(key);
    }
    let hint = |e: &reqwest::Error| {
        if e.status() == Some(reqwest::StatusCode::UNAUTHORIZED) {
            "set AGENTSTACK_API_KEY (or the variable --api-key-env names) to the server's API key"
        } else {
            "pass --model-name"
        }
    };
    let reply: Value = request
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .map_err(|e| {
            let hint = hint(&e);
            // A refusal (a missing key, a path that is not a server's) is the user's to
            // fix; an unreachable server is not.
            let refused = e.status().is_some_and(|s| s.is_client_error());
            let error = anyhow::Error::new(e)
                .context(format!("could not list the models at {url}\nhint: {hint}"));
            if refused {
                anyhow::Error::from(crate::UserError::new(error))
            } else {
                error
            }
        })?
        .json()
        .await
        .with_context(|| format!("{url} did not answer with JSON"))?;
    reply
        .pointer("/data/0/id")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .ok_or_else(|| user_error!("{url} lists no models\nhint: pass --model-name"))
}

fn parse_options(text: Option<&str>) -> anyhow::Result<Map<String, Value>> {
    match text {
        None => Ok(Map::new()),
        Some(text) => match serde_json::from_str::<Value>(text) {
            Ok(Value::Object(map)) => Ok(map),
            _ => Err(user_error!(
                "--options must be a JSON object, got {text}\nhint: e.g. --options '{{\"difficulty\": 3}}'"
            )),
        },
    }
}

fn read_profile(path: Option<&PathBuf>, env: &str) -> anyhow::Result<Profile> {
    let Some(path) = path else {
        return Ok(Profile::for_env(env));
    };
    let text = std::fs::read_to_string(path)
        .with_user_context(|| format!("could not read the profile {}", path.display()))?;
    serde_json::from_str(&text).with_user_context(|| {
        format!(
            "{} is not a prompt profile\nhint: a JSON object with system, user (minijinja templates), and optionally action and answer_pattern",
            path.display()
        )
    })
}

/// What `eval` runs with: its flags and environment variables, checked and resolved by
/// the one precedence rule (see [`crate::settings`]). The environment and model are
/// references here; they are opened (and a `hub:` package pulled) when the run starts.
#[derive(Debug)]
pub struct EvalSettings {
    /// The environment (`--env`).
    pub env: EnvReference,
    /// The model (`--model`).
    pub model: ModelReference,
    /// The model name sent to an OpenAI-compatible server (`None`: its first).
    pub model_name: Option<String>,
    /// The variable holding an OpenAI-compatible server's API key.
    pub api_key_env: String,
    /// Tasks to play.
    pub episodes: usize,
    /// Episodes per task.
    pub samples: usize,
    /// Episodes played at once.
    pub concurrency: usize,
    /// The run's seed.
    pub seed: u64,
    /// The split tasks come from.
    pub split: Option<String>,
    /// Reset options for every episode.
    pub reset_options: Map<String, Value>,
    /// How an episode is played: turns, sampling, context.
    pub play: LoopConfig,
    /// A prompt profile file (`None`: the environment's built-in profile).
    pub profile: Option<PathBuf>,
    /// Reward at or above which an episode counts as a success.
    pub success_threshold: f64,
    /// The run's id (`None`: from env, model and the configuration's hash).
    pub run_id: Option<String>,
    /// Where runs are kept: `--runs-dir`, else the data directory's `runs/`.
    pub runs_dir: PathBuf,
    /// Discard an existing run with the same id.
    pub fresh: bool,
    /// Compute threads for an in-process model.
    pub threads: Option<usize>,
    /// An in-process model's speculative decoding (`--speculative-draft`).
    pub speculation: Speculation,
    /// The Python for OpenEnv package directories: `--python`, else
    /// `AGENTSTACK_PYTHON`, else `python3`.
    pub python: String,
    /// Post the summary to the hub's leaderboard.
    pub post: bool,
}

impl EvalSettings {
    /// Checks the flags and resolves them.
    pub fn resolve(args: &EvalRunArgs) -> Result<Self, Exit> {
        let env = args
            .env
            .clone()
            .ok_or_else(|| user_error!("--env is required"))?;
        let model = args
            .model
            .clone()
            .ok_or_else(|| user_error!("--model is required"))?;
        if args.episodes == 0 || args.samples == 0 || args.concurrency == 0 || args.max_turns == 0 {
            return Err(Exit::user(anyhow!(
                "--episodes, --samples, --concurrency and --max-turns must be at least 1"
            )));
        }
        if args.max_tokens == 0 {
            return Err(Exit::user(anyhow!("--max-tokens must be at least 1")));
        }
        let overflow: Overflow = args.overflow.parse().map_err(|e: String| user_error!(e))?;
        if let Some(budget) = args.context_tokens
            && budget <= args.max_tokens
        {
            return Err(Exit::user(anyhow!(
                "--context-tokens ({budget}) must be larger than --max-tokens ({}): the budget holds the prompt and the answer",
                args.max_tokens
            )));
        }
        let reset_options = parse_options(args.options.as_deref())?;
        if args.post && !env.starts_with("hub:") {
            return Err(Exit::user(anyhow!(
                "--post needs --env hub:owner/name[@version]: leaderboards belong to hub packages"
            )));
        }
        let env = EnvReference::parse(&env, &builtins()).user()?;
        Ok(Self {
            env,
            model: ModelReference::parse(&model),
            model_name: args.model_name.clone(),
            api_key_env: args.api_key_env.clone(),
            episodes: args.episodes,
            samples: args.samples,
            concurrency: args.concurrency,
            seed: args.seed,
            split: args.split.clone(),
            reset_options,
            play: LoopConfig {
                max_turns: args.max_turns,
                sampling: Sampling {
                    temperature: args.temperature,
                    top_p: args.top_p,
                    max_tokens: args.max_tokens,
                },
                context: ContextPolicy {
                    max_tokens: args.context_tokens,
                    overflow,
                    keep_thinking: !args.strip_thinking,
                },
                constrain: args.constrain,
            },
            profile: args.profile.clone(),
            success_threshold: args.success_threshold.unwrap_or(1.0),
            run_id: args.run_id.clone(),
            runs_dir: runs_dir(args.runs_dir.clone()),
            fresh: args.fresh,
            threads: args.threads,
            speculation: Speculation {
                max_draft: args.speculative_draft,
                ..Speculation::default()
            },
            python: settings::python(args.python.as_deref()),
            post: args.post,
        })
    }
}

/// Plays a run to completion (resuming it if it exists) and returns its summary and
/// directory.
pub(crate) async fn evaluate(settings: EvalSettings) -> Result<(Summary, PathBuf), Exit> {
    let (env_ref, target) = pull_env(&settings.env).await?;
    let env = open_env(&target, &settings.python).await?;
    let profile = read_profile(settings.profile.as_ref(), env.handle.name())?;
    let model = open_model(
        &settings.model,
        settings.model_name.as_deref(),
        &settings.api_key_env,
        settings.threads,
        settings.speculation,
    )
    .await?;
    let config = EvalConfig {
        env: env_ref,
        model: settings.model.to_string(),
        tasks: settings.episodes,
        samples: settings.samples,
        seed: settings.seed,
        split: settings.split,
        reset_options: settings.reset_options,
        play: settings.play,
        profile,
        success_threshold: settings.success_threshold,
    };
    let dir = settings
        .runs_dir
        .join(settings.run_id.unwrap_or_else(|| config.default_run_id()));
    let run =
        Run::open(&dir, config, settings.concurrency, settings.fresh).map_err(|e| anyhow!(e))?;
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template(
            "{msg:>12} {bar:30} {pos}/{len} episodes  {elapsed_precise} eta {eta}  mean reward {prefix}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(env.handle.name().to_owned());
    bar.enable_steady_tick(Duration::from_millis(250));
    let summary = run
        .play(&model, &env.handle, |p| {
            bar.set_length(p.total as u64);
            bar.set_position(p.done as u64);
            if p.mean_reward.is_finite() {
                bar.set_prefix(format!("{:.3}", p.mean_reward));
            }
        })
        .await;
    bar.finish_and_clear();
    let summary = summary.map_err(|e| {
        anyhow!(e).context(format!(
            "the run in {} stopped; rerun the same command to resume it",
            dir.display()
        ))
    })?;
    Ok((summary, dir))
}

/// Prints a run's summary.
pub(crate) fn print_summary(summary: &Summary, dir: &std::path::Path, json: bool) {
    let mut out = std::io::stdout().lock();
    if json {
        let _ = writeln!(
            out,
            "{}",
            serde_json::to_string_pretty(summary).unwrap_or_default()
        );
        return;
    }
    let pass: Vec<String> = summary
        .pass_at_k
        .iter()
        .map(|(k, v)| format!("{k} {v:.3}"))
        .collect();
    let _ = writeln!(
        out,
        "{env} × {model}: mean reward {mean:.3} ± {se:.3} (95% CI {lo:.3}–{hi:.3}) over {n} episodes\n  success {success:.1}%  {pass}  turns/episode {turns:.1}  parse errors/turn {parse:.3}  invalid actions/turn {invalid:.3}\n  tokens: {prompt} prompt, {completion} generated  wall {wall:.1} s  ({eps:.2} episodes/s, model idle {idle:.0}%)\n  results: {dir}",
        env = summary.env,
        model = summary.model,
        mean = summary.mean_reward,
        se = summary.stderr,
        lo = summary.ci95.0,
        hi = summary.ci95.1,
        n = summary.episodes,
        success = 100.0 * summary.success_rate,
        pass = pass.join("  "),
        turns = summary.mean_turns,
        parse = summary.parse_error_rate,
        invalid = summary.invalid_action_rate,
        prompt = summary.prompt_tokens,
        completion = summary.completion_tokens,
        wall = summary.wall_s,
        eps = summary.episodes_per_s,
        idle = 100.0 * summary.model_idle_fraction,
        dir = dir.display(),
    );
}
