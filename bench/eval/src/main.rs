//! `agentstack-bench-eval`: how fast `eval` plays episodes, and how much of the time
//! the model waits for work, at several concurrencies, on the built-in `arithmetic`
//! environment with the in-process engine. See bench/README.md.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;

use agentstack_bench_support::machine;
use agentstack_bench_support::report::append_section;
use agentstack_harness::episode::LoopConfig;
use agentstack_harness::model::Sampling;
use agentstack_harness::{EnvHandle, EvalConfig, ModelClient, Profile, Run};
use agentstack_model::engine::{Engine, EngineConfig};
use agentstack_model::{LanguageModel, WeightForm};
use anyhow::Context;
use clap::Parser;
use serde_json::Map;

#[derive(Parser)]
struct Args {
    /// The GGUF model.
    #[arg(long)]
    model: PathBuf,
    /// Episodes per concurrency level.
    #[arg(long, default_value_t = 32)]
    episodes: usize,
    /// Concurrency levels.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    concurrency: Vec<usize>,
    /// Most tokens per answer.
    #[arg(long, default_value_t = 96)]
    max_tokens: usize,
    /// Append a section to this Markdown file.
    #[arg(long)]
    write_results: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let lm = Arc::new(
        LanguageModel::load(&args.model, WeightForm::Quantized).context("loading the model")?,
    );
    let env =
        EnvHandle::local(agentstack_envs::find("arithmetic").context("arithmetic is built in")?)?;
    let load_before = machine::load_average().unwrap_or_default();
    let mut rows = Vec::new();
    for &k in &args.concurrency {
        let engine = Engine::start(
            lm.clone(),
            EngineConfig {
                max_running: k.max(1),
                ..Default::default()
            },
        );
        let model = ModelClient::engine(engine, "SmolLM2-135M-Instruct");
        let config = EvalConfig {
            env: "arithmetic".into(),
            model: args.model.display().to_string(),
            tasks: args.episodes,
            samples: 1,
            seed: 0,
            split: None,
            reset_options: Map::new(),
            play: LoopConfig {
                max_turns: 1,
                sampling: Sampling {
                    max_tokens: args.max_tokens,
                    ..Sampling::default()
                },
                ..LoopConfig::default()
            },
            profile: Profile::for_env("arithmetic"),
            success_threshold: 1.0,
        };
        let dir = tempfile::tempdir()?;
        let run = Run::open(dir.path(), config, k, true)?;
        let summary = run.play(&model, &env, |_| {}).await?;
        eprintln!(
            "concurrency {k:>2}: {:.3} episodes/s, model idle {:.1}%, {} tokens generated in {:.1} s",
            summary.episodes_per_s,
            100.0 * summary.model_idle_fraction,
            summary.completion_tokens,
            summary.wall_s
        );
        rows.push((k, summary));
    }
    let base = rows.first().map(|(_, s)| s.episodes_per_s).unwrap_or(1.0);
    let mut section = String::new();
    let _ = writeln!(
        section,
        "\n## eval: episodes/s and model idle time vs concurrency, {}\n",
        machine::utc_now()
    );
    let _ = writeln!(
        section,
        "- Command: `target/debug/agentstack-bench-eval --model {} --episodes {} --write-results bench/RESULTS.md`; load average {load_before} at start, {} at end.\n- `arithmetic` (difficulty 1, one answer per episode), SmolLM2-135M-Instruct Q4_1 in process (the batching engine, `max_running` = concurrency), greedy, at most {} tokens per answer; all cores (2).\n- Model idle: the fraction of wall time in which no model call was in flight (the harness's own clock, `summary.json`'s `model_idle_fraction`).\n",
        args.model.display(),
        args.episodes,
        machine::load_average().unwrap_or_default(),
        args.max_tokens
    );
    let _ = writeln!(
        section,
        "| concurrency | episodes | wall s | episodes/s | vs concurrency {} | generated tok/s | model idle | mean reward |\n|--:|--:|--:|--:|--:|--:|--:|--:|",
        rows.first().map(|r| r.0).unwrap_or(1)
    );
    for (k, s) in &rows {
        let _ = writeln!(
            section,
            "| {k} | {} | {:.1} | {:.3} | {:.2}× | {:.1} | {:.1}% | {:.3} |",
            s.episodes,
            s.wall_s,
            s.episodes_per_s,
            s.episodes_per_s / base,
            s.completion_tokens as f64 / s.wall_s,
            100.0 * s.model_idle_fraction,
            s.mean_reward
        );
    }
    print!("{section}");
    if let Some(path) = args.write_results {
        append_section(&path, &section)?;
    }
    Ok(())
}
