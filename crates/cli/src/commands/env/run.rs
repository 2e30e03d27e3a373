//! `agentstack env run`: drive episodes with a simple policy and print the rewards.
//! A smoke test for any environment URL, and the end-to-end demo on built-ins.
//!
//! An episode that fails (its reset, a step, or its connection) ends there with its
//! error recorded; the other episodes still run, and the command exits 1 when any
//! episode failed. A server reached by URL gets the first key of `AGENTSTACK_API_KEY`.

use std::io::Write;
use std::time::{Duration, Instant};

use agentstack_env::client::{ClientConfig, EnvClient, HttpClient};
use agentstack_env::policy::{self, Policy};
use agentstack_env::server::{Server, ServerConfig};
use agentstack_protocol::http::ResetRequest;
use agentstack_protocol::mcp::{ListToolsObservation, StepTool};
use anyhow::{Context, anyhow};
use futures_util::StreamExt;
use rand::SeedableRng;
use serde_json::{Map, Value};

use crate::Exit;
use crate::args::{PolicyArg, RunArgs};

/// One finished episode.
#[derive(Debug, Clone, serde::Serialize)]
pub struct EpisodeReport {
    /// Index of the episode.
    pub episode: usize,
    /// Its seed.
    pub seed: u64,
    /// Steps taken.
    pub steps: usize,
    /// Sum of rewards.
    pub total_reward: f64,
    /// Whether the environment ended the episode (vs the step limit).
    pub done: bool,
    /// Wall time, seconds.
    pub seconds: f64,
    /// Why the episode stopped early, when it failed (`null` when it did not).
    pub error: Option<String>,
}

/// How far an episode got, kept when it fails part way.
#[derive(Default)]
struct Progress {
    steps: usize,
    total_reward: f64,
    done: bool,
}

/// What every episode of a run shares.
struct Plan<'a> {
    url: &'a str,
    /// The client settings (the API key of a server reached by URL).
    client: &'a ClientConfig,
    action_schema: &'a Value,
    /// The tools, for environments driven by tool calls.
    tools: Option<&'a [StepTool]>,
    policy: Policy,
    options: &'a Map<String, Value>,
    max_steps: usize,
}

/// Plays one episode; a failure ends it and is recorded in the report.
async fn episode(plan: &Plan<'_>, index: usize, seed: u64) -> EpisodeReport {
    let started = Instant::now();
    let mut progress = Progress::default();
    let error = play(plan, index, seed, &mut progress)
        .await
        .err()
        .map(|e| format!("{e:#}"));
    if let Some(error) = &error {
        tracing::warn!(episode = index, seed, "episode failed: {error}");
    }
    EpisodeReport {
        episode: index,
        seed,
        steps: progress.steps,
        total_reward: progress.total_reward,
        done: progress.done,
        seconds: started.elapsed().as_secs_f64(),
        error,
    }
}

async fn play(
    plan: &Plan<'_>,
    index: usize,
    seed: u64,
    progress: &mut Progress,
) -> anyhow::Result<()> {
    let Plan {
        url,
        client: config,
        action_schema: schema,
        tools,
        policy,
        options,
        max_steps,
    } = *plan;
    let mut client = EnvClient::connect(url, config.clone())
        .await
        .context("connecting")?;
    let mut result = client
        .reset(ResetRequest {
            seed: Some(seed),
            episode_id: Some(format!("run-{index}")),
            options: options.clone(),
        })
        .await
        .context("reset")?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    while !result.done && progress.steps < max_steps {
        let action = match tools {
            Some(tools) => policy::choose_tool_call(policy, tools, &mut rng)
                .ok_or_else(|| anyhow!("the environment takes tool calls but lists no tools"))?,
            None => policy::choose(policy, schema, &result.observation, &mut rng),
        };
        result = client
            .step(&action)
            .await
            .with_context(|| format!("step {} with action {action}", progress.steps + 1))?;
        progress.steps += 1;
        progress.total_reward += result.reward.unwrap_or(0.0);
        progress.done = result.done;
    }
    if let Err(e) = client.close().await {
        // The episode is complete; a session that did not close cleanly is the
        // server's to reap.
        tracing::warn!(episode = index, "closing the session: {e}");
    }
    Ok(())
}

/// Lists an MCP environment's tools with a `list_tools` step on a session of its own.
async fn list_tools(url: &str, config: &ClientConfig) -> anyhow::Result<Vec<StepTool>> {
    let mut client = EnvClient::connect(url, config.clone()).await?;
    let reply = client
        .step(&serde_json::json!({"type": "list_tools"}))
        .await
        .context("listing the environment's tools")?;
    client.close().await?;
    let listed: ListToolsObservation = serde_json::from_value(Value::Object(reply.observation))
        .context("the list_tools observation has no tools list")?;
    Ok(listed.tools)
}

/// Runs the episodes and prints one line each and a summary.
pub async fn run(args: RunArgs) -> Result<(), Exit> {
    let options = match &args.options {
        None => Map::new(),
        Some(text) => match serde_json::from_str::<Value>(text) {
            Ok(Value::Object(map)) => map,
            _ => {
                return Err(Exit::user(anyhow!(
                    "--options must be a JSON object, got {text}\nhint: e.g. --options '{{\"difficulty\": 3}}'"
                )));
            }
        },
    };
    if args.episodes == 0 {
        return Err(Exit::user(anyhow!("--episodes must be at least 1")));
    }
    // Built-ins are served in-process so the episodes go through the real protocol; a
    // server reached by URL gets the first key of AGENTSTACK_API_KEY.
    let mut client = ClientConfig::default();
    let (url, _server) = if let Some(spec) = agentstack_envs::find(&args.target) {
        let server = Server::bind(ServerConfig::default(), vec![spec])
            .await
            .context("starting an in-process server")?;
        let url = server.url();
        let handle = server.handle();
        tokio::spawn(server.serve());
        (url, Some(handle))
    } else if args.target.starts_with("http://") || args.target.starts_with("https://") {
        client = crate::settings::env_client();
        (args.target.clone(), None)
    } else {
        return Err(Exit::user(anyhow!(
            "'{}' is neither a built-in environment nor an http:// URL\nhint: built-in environments are: {}",
            args.target,
            super::serve::builtin_names()
        )));
    };
    let http = HttpClient::from_config(
        &url,
        &ClientConfig {
            message_timeout: Duration::from_secs(10),
            ..client.clone()
        },
    )
    .context("server URL")?;
    let schema = http
        .schema()
        .await
        .with_context(|| format!("reading the action schema from {url}/schema"))?;
    let policy = match args.policy {
        PolicyArg::Random => Policy::Random,
        PolicyArg::Scripted => Policy::Scripted,
    };
    let bar = indicatif::ProgressBar::new(args.episodes as u64).with_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} episodes {elapsed}")
            .expect("static template"),
    );
    if args.json {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    // MCP environments (OpenEnv's CallToolAction) are driven through their tools.
    let tools = if policy::is_tool_call_schema(&schema.action) {
        Some(list_tools(&url, &client).await?)
    } else {
        None
    };
    let plan = Plan {
        url: &url,
        client: &client,
        action_schema: &schema.action,
        tools: tools.as_deref(),
        policy,
        options: &options,
        max_steps: args.max_steps,
    };
    let plan_ref = &plan;
    let bar_ref = &bar;
    let mut results = futures_util::stream::iter(0..args.episodes)
        .map(|i| async move {
            let r = episode(plan_ref, i, args.seed + i as u64).await;
            bar_ref.inc(1);
            r
        })
        .buffer_unordered(args.concurrency.max(1))
        .collect::<Vec<_>>()
        .await;
    bar.finish_and_clear();
    results.sort_by_key(|r| r.episode);
    let mut out = std::io::stdout().lock();
    let rewards: Vec<f64> = results
        .iter()
        .filter(|r| r.error.is_none())
        .map(|r| r.total_reward)
        .collect();
    let failed = results.len() - rewards.len();
    if args.json {
        for r in &results {
            writeln!(out, "{}", serde_json::to_string(r).context("JSON")?).context("stdout")?;
        }
    } else {
        writeln!(out, "episode  seed  steps  reward    done").context("stdout")?;
        for r in &results {
            let done = if r.error.is_some() {
                "failed".to_owned()
            } else {
                r.done.to_string()
            };
            writeln!(
                out,
                "{:>7}  {:>4}  {:>5}  {:>8.3}  {done}",
                r.episode, r.seed, r.steps, r.total_reward
            )
            .context("stdout")?;
        }
        for r in &results {
            if let Some(error) = &r.error {
                writeln!(out, "episode {} failed: {error}", r.episode).context("stdout")?;
            }
        }
        if !rewards.is_empty() {
            let mean = rewards.iter().sum::<f64>() / rewards.len() as f64;
            let (low, high) = agentstack_harness::stats::ci95(&rewards);
            writeln!(
                out,
                "mean reward {mean:.3} (95% CI [{low:.3}, {high:.3}]) over {} episodes",
                rewards.len()
            )
            .context("stdout")?;
        }
    }
    if failed > 0 {
        return Err(Exit::user(anyhow!(
            "{failed} of {} episodes failed (each ends at its error; the others ran to the end)",
            results.len()
        )));
    }
    Ok(())
}
