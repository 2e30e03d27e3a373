//! `agentstack env validate`: OpenEnv's URL checks plus real protocol conformance.
//! Exit 0 pass, 1 fail (or a server that refuses the API key: it sends the first key
//! of `AGENTSTACK_API_KEY`), 2 could not run.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use agentstack_env::conformance::{self, Options, Status, ValidateError};
use agentstack_env::foreign::{ForeignCommand, ForeignEnv};
use agentstack_env::server::{Server, ServerConfig};
use anyhow::{Context, anyhow};

use crate::Exit;
use crate::args::ValidateArgs;
use crate::settings;

fn could_not_run(e: anyhow::Error) -> Exit {
    Exit::internal(e)
}

/// The declared reward range from an `openenv.yaml`: `agentstack.reward_range`, or
/// `validation.reward.range`.
fn manifest_reward_range(dir: &Path) -> Option<(f64, f64)> {
    let text = std::fs::read_to_string(dir.join("openenv.yaml")).ok()?;
    let yaml: serde_json::Value = serde_norway::from_str(&text).ok()?;
    let range = yaml
        .pointer("/agentstack/reward_range")
        .or_else(|| yaml.pointer("/validation/reward/range"))?
        .as_array()?;
    Some((range.first()?.as_f64()?, range.get(1)?.as_f64()?))
}

/// Validates and prints the report.
pub async fn run(args: ValidateArgs) -> Result<(), Exit> {
    let mut options = Options::default();
    let mut _server = None;
    let mut _child = None;
    // A malformed `hub:` reference or one the hub refuses is the user's; a hub that
    // cannot be reached is not.
    let target = crate::commands::hub::pull_target(&args.target).await?;
    let url = if target.starts_with("http://") || target.starts_with("https://") {
        // A server started with keys gets the first key of AGENTSTACK_API_KEY.
        options.api_key = settings::env_client().api_key;
        target.clone()
    } else if let Some(spec) = agentstack_envs::find(&target) {
        options.reward_range = Some(spec.info().reward_range);
        let server = Server::bind(ServerConfig::default(), vec![spec])
            .await
            .context("starting an in-process server")
            .map_err(could_not_run)?;
        let url = server.url();
        _server = Some(server.handle());
        tokio::spawn(server.serve());
        url
    } else if Path::new(&target).is_dir() {
        let dir = Path::new(&target);
        options.reward_range = manifest_reward_range(dir);
        let python = settings::python(args.python.as_deref());
        let command = ForeignCommand::package(dir, &python).map_err(|e| Exit::user(e.into()))?;
        let child = ForeignEnv::start(command, Duration::from_secs(60))
            .await
            .context("starting the package's server")
            .map_err(could_not_run)?;
        let url = child.url().to_owned();
        _child = Some(child);
        url
    } else {
        return Err(Exit::user(anyhow!(
            "'{}' is not a URL, a built-in environment, a directory or hub:owner/name\nhint: built-in environments are: {}",
            args.target,
            super::serve::builtin_names()
        )));
    };
    let report = conformance::validate(&url, &options)
        .await
        .map_err(|e| match e {
            // The user can fix this one: a key.
            ValidateError::Unauthorized(_) => Exit::user(e.into()),
            ValidateError::Unreachable { .. } => could_not_run(e.into()),
        })?;
    let mut out = std::io::stdout().lock();
    if args.json {
        writeln!(
            out,
            "{}",
            serde_json::to_string_pretty(&report).context("JSON")?
        )
        .context("stdout")?;
    } else {
        for check in &report.checks {
            let mark = match check.status {
                Status::Pass => "PASS",
                Status::Fail => "FAIL",
                Status::Warn => "WARN",
                Status::Skip => "SKIP",
            };
            writeln!(out, "{mark}  {:<28} {}", check.id, check.detail).context("stdout")?;
        }
        let passed = report
            .checks
            .iter()
            .filter(|c| c.status == Status::Pass)
            .count();
        let warned = report
            .checks
            .iter()
            .filter(|c| c.status == Status::Warn)
            .count();
        let warnings = match warned {
            0 => String::new(),
            1 => " (1 warning)".to_owned(),
            n => format!(" ({n} warnings)"),
        };
        writeln!(
            out,
            "{}: {passed}/{} checks passed{warnings} at {}",
            if report.passed { "PASS" } else { "FAIL" },
            report.checks.len(),
            report.url
        )
        .context("stdout")?;
    }
    if report.passed {
        Ok(())
    } else {
        Err(Exit::quiet(1))
    }
}
