//! `agentstack env run`: drive episodes with a simple policy and print the rewards.
//! A smoke test for any environment URL, and the end-to-end demo on built-ins.

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
}

/// What every episode of a run shares.
struct Plan<'a> {
    url: &'a str,
    action_schema: &'a Value,
    /// The tools, for environments driven by tool calls.
    tools: Option<&'a [StepTool]>,
    policy: Policy,
    options: &'a Map<String, Value>,
    max_steps: usize,
}

async fn episode(plan: &Plan<'_>, index: usize, seed: u64) -> anyhow::Result<EpisodeReport> {
    let Plan {
        url,
        action_schema: schema,
        tools,
        policy,
        options,
        max_steps,
    } = *plan;
    let started = Instant::now();
    let mut client = EnvClient::connect(url, ClientConfig::default()).await?;
    let mut result = client
        .reset(ResetRequest {
            seed: Some(seed),
            episode_id: Some(format!("run-{index}")),
            options: options.clone(),
        })
        .await
        .with_context(|| format!("episode {index}: reset"))?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut steps = 0;
    let mut total = 0.0;
    while !result.done && steps < max_steps {
        let action = match tools {
            Some(tools) => policy::choose_tool_call(policy, tools, &mut rng)
                .ok_or_else(|| anyhow!("the environment takes tool calls but lists no tools"))?,
            None => policy::choose(policy, schema, &result.observation, &mut rng),
        };
        result = client
            .step(&action)
            .await
            .with_context(|| format!("episode {index}: step {} with action {action}", steps + 1))?;
        steps += 1;
        total += result.reward.unwrap_or(0.0);
    }
    client.close().await?;
    Ok(EpisodeReport {
        episode: index,
        seed,
        steps,
        total_reward: total,
        done: result.done,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// Lists an MCP environment's tools with a `list_tools` step on a session of its own.
async fn list_tools(url: &str) -> anyhow::Result<Vec<StepTool>> {
    let mut client = EnvClient::connect(url, ClientConfig::default()).await?;
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
    // Built-ins are served in-process so the episodes go through the real protocol.
    let (url, _server) = if let Some(spec) = agentstack_envs::find(&args.target) {
        let server = Server::bind(ServerConfig::default(), vec![spec])
            .await
            .context("starting an in-process server")?;
        let url = server.url();
        let handle = server.handle();
        tokio::spawn(server.serve());
        (url, Some(handle))
    } else if args.target.starts_with("http://") || args.target.starts_with("https://") {
        (args.target.clone(), None)
    } else {
        return Err(Exit::user(anyhow!(
            "'{}' is neither a built-in environment nor an http:// URL\nhint: built-in environments are: {}",
            args.target,
            super::serve::builtin_names()
        )));
    };
    let http = HttpClient::new(&url, Duration::from_secs(10)).context("server URL")?;
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
        Some(list_tools(&url).await?)
    } else {
        None
    };
    let plan = Plan {
        url: &url,
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
        .await
        .into_iter()
        .collect::<anyhow::Result<Vec<_>>>()?;
    bar.finish_and_clear();
    results.sort_by_key(|r| r.episode);
    let mut out = std::io::stdout().lock();
    let mean = results.iter().map(|r| r.total_reward).sum::<f64>() / results.len() as f64;
    let var = results
        .iter()
        .map(|r| (r.total_reward - mean).powi(2))
        .sum::<f64>()
        / (results.len().max(2) - 1) as f64;
    let ci95 = 1.96 * (var / results.len() as f64).sqrt();
    if args.json {
        for r in &results {
            writeln!(out, "{}", serde_json::to_string(r).context("JSON")?).context("stdout")?;
        }
    } else {
        writeln!(out, "episode  seed  steps  reward    done").context("stdout")?;
        for r in &results {
            writeln!(
                out,
                "{:>7}  {:>4}  {:>5}  {:>8.3}  {}",
                r.episode, r.seed, r.steps, r.total_reward, r.done
            )
            .context("stdout")?;
        }
        writeln!(
            out,
            "mean reward {mean:.3} ± {ci95:.3} (95% CI) over {} episodes",
            results.len()
        )
        .context("stdout")?;
    }
    Ok(())
}
