//! `agentstack env list`: the built-in environments.

use std::io::Write;

use anyhow::Context;

use crate::Exit;
use crate::args::ListArgs;

/// Prints the built-in environments.
pub fn run(args: ListArgs) -> Result<(), Exit> {
    let specs = agentstack_envs::builtin();
    let mut out = std::io::stdout().lock();
    if args.json {
        let rows: Vec<_> = specs
            .iter()
            .map(|s| {
                serde_json::json!({
                    "name": s.name(),
                    "description": s.info().description,
                    "version": s.info().version,
                    "reward_range": [s.info().reward_range.0, s.info().reward_range.1],
                    "tools": !s.instantiate().map(|e| e.tools().is_empty()).unwrap_or(true),
                    "tasks": s.tasks().is_some(),
                })
            })
            .collect();
        writeln!(
            out,
            "{}",
            serde_json::to_string_pretty(&rows).context("JSON")?
        )
        .context("stdout")?;
        return Ok(());
    }
    let width = specs.iter().map(|s| s.name().len()).max().unwrap_or(4);
    for spec in &specs {
        writeln!(out, "{:width$}  {}", spec.name(), spec.info().description).context("stdout")?;
    }
    Ok(())
}
