//! `agentstack train grpo|distill|sft --config train.toml`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use agentstack_harness::reference::EnvReference;
use agentstack_rl::config::{Algorithm, TrainConfig};
use agentstack_rl::train::{Setup, StepMetrics, train};
use anyhow::{Context, anyhow};
use indicatif::{ProgressBar, ProgressStyle};

use crate::args::{TrainArgs, TrainExportArgs};
use crate::commands::env::serve::builtins;
use crate::commands::eval::{open_env, pull_env, runs_dir};
use crate::{Exit, IntoUserError, settings};

/// What `train grpo|distill|sft` runs with: the configuration file with the flags'
/// overrides applied, and where the run goes, resolved by the one precedence rule (see
/// [`crate::settings`]).
#[derive(Debug)]
pub struct TrainSettings {
    /// The configuration file.
    pub config_file: PathBuf,
    /// Its configuration, overrides applied and checked; paths in the file made
    /// relative to it.
    pub config: TrainConfig,
    /// GRPO, distillation or SFT.
    pub algorithm: Algorithm,
    /// The run directory: `--runs-dir` (else the data directory's `runs/`) and
    /// `--run-id` (else `<config file>-<algorithm>`).
    pub dir: PathBuf,
    /// Discard an existing run instead of resuming it.
    pub fresh: bool,
    /// The Python for a Python environment package: `--python`, else
    /// `AGENTSTACK_PYTHON`, else `python3`.
    pub python: String,
    /// Compute threads (`None`: all cores).
    pub threads: Option<usize>,
    /// `--time-limit`: end the run after the step during which this much time passed.
    pub time_limit: Option<Duration>,
    /// Report as JSON.
    pub json: bool,
}

impl TrainSettings {
    /// Reads the configuration and applies the flags.
    pub fn resolve(args: &TrainArgs, algorithm: Algorithm) -> Result<Self, Exit> {
        let text = std::fs::read_to_string(&args.config)
            .with_context(|| format!("could not read {}", args.config.display()))
            .map_err(Exit::user)?;
        let mut config = TrainConfig::parse(&text)
            .map_err(|e| Exit::user(anyhow!("{}: {e}", args.config.display())))?;
        if let Some(steps) = args.steps {
            config.steps = steps;
        }
        if let Some(model) = &args.model {
            config.model = model.clone();
        }
        if let Some(env) = &args.env {
            config.env = env.clone();
        }
        if let Some(teacher) = &args.teacher {
            match &mut config.distill {
                Some(d) => d.teacher = teacher.clone(),
                None => {
                    return Err(Exit::user(anyhow!(
                        "{}: --teacher needs a [distill] section in the config",
                        args.config.display()
                    )));
                }
            }
        }
        config
            .sync
            .servers
            .extend(args.sync_servers.iter().cloned());
        config.rollout.servers.extend(
            args.rollout_servers
                .iter()
                .map(|s| s.trim())
                .filter(|s| !s.is_empty())
                .map(|s| {
                    if s.contains("://") {
                        s.to_owned()
                    } else {
                        format!("http://{s}")
                    }
                }),
        );
        // Paths in the file are relative to the file.
        let base = args
            .config
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default();
        let relative = |p: &mut PathBuf| {
            if p.is_relative() && !p.as_os_str().is_empty() && base.join(&*p).exists() {
                *p = base.join(&*p);
            }
        };
        if args.model.is_none() {
            relative(&mut config.model);
        }
        if let Some(d) = &mut config.distill
            && args.teacher.is_none()
        {
            relative(&mut d.teacher);
        }
        if let Some(s) = &mut config.sft {
            s.runs.iter_mut().for_each(relative);
        }
        config
            .check()
            .map_err(|e| Exit::user(anyhow!("{}: {e}", args.config.display())))?;
        let stem = args
            .config
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "train".into());
        let id = args.run_id.clone().unwrap_or_else(|| {
            format!(
                "{stem}-{}",
                serde_json::to_value(algorithm)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned))
                    .unwrap_or_default()
            )
        });
        Ok(Self {
            config_file: args.config.clone(),
            config,
            algorithm,
            dir: runs_dir(args.runs_dir.clone()).join(id),
            fresh: args.fresh,
            python: settings::python(args.python.as_deref()),
            threads: args.threads,
            time_limit: args.time_limit,
            json: args.json,
        })
    }
}

/// Runs (or resumes) a training run.
pub async fn run(args: TrainArgs, algorithm: Algorithm) -> Result<(), Exit> {
    let resolved = TrainSettings::resolve(&args, algorithm)?;
    if args.show_settings {
        return settings::show(&resolved);
    }
    let TrainSettings {
        config_file,
        config,
        algorithm,
        dir,
        fresh,
        python,
        threads: _,
        time_limit,
        json,
    } = resolved;
    if !config.model.exists() {
        return Err(Exit::user(anyhow!(
            "the model {} does not exist\nhint: scripts/fetch-model fetches the test model; paths in the config are relative to it",
            config.model.display()
        )));
    }
    if algorithm == Algorithm::Distill
        && let Some(d) = &config.distill
        && !d.teacher.exists()
    {
        return Err(Exit::user(anyhow!(
            "the teacher {} does not exist\nhint: `agentstack train export RUN -o teacher.gguf` makes one from a training run; paths in the config are relative to it",
            d.teacher.display()
        )));
    }
    let env = if algorithm == Algorithm::Sft && config.env.is_empty() {
        None
    } else {
        if config.env.is_empty() {
            return Err(Exit::user(anyhow!(
                "{}: env is required (a built-in name, an OpenEnv URL, a package directory or hub:owner/name)",
                config_file.display()
            )));
        }
        let reference = EnvReference::parse(&config.env, &builtins()).user()?;
        let (_, target) = pull_env(&reference).await?;
        Some(open_env(&target, &python).await?)
    };
    let bar = ProgressBar::new(config.steps as u64).with_style(
        ProgressStyle::with_template(
            "{msg:>10} {bar:30} {pos}/{len} steps  {elapsed_precise} eta {eta}  {prefix}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message("training");
    bar.enable_steady_tick(Duration::from_millis(250));
    let steps = config.steps;
    // SIGTERM (a scheduler's preemption or cancel) and Ctrl-C: finish the step, write
    // a checkpoint, exit; the same command resumes.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    {
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut term =
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                    Ok(term) => term,
                    Err(_) => return,
                };
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            eprintln!("stopping after this step (a checkpoint will be written)");
            stop.store(true, std::sync::atomic::Ordering::SeqCst);
        });
    }
    let report = train(
        Setup {
            config,
            algorithm,
            dir: dir.clone(),
            env: env.as_ref().map(|e| e.handle.clone()),
            fresh,
            stop,
            time_limit,
        },
        |m: &StepMetrics| {
            bar.set_position(m.step as u64);
            let mut prefix = format!("reward {:.3}  loss {:+.4}", m.reward_mean, m.loss);
            if let Some(e) = m.eval_reward {
                prefix.push_str(&format!("  held-out {e:.3}"));
            }
            bar.set_prefix(prefix);
        },
    )
    .await;
    bar.finish_and_clear();
    let report = report.map_err(|e| {
        anyhow!(e).context(format!(
            "training in {} stopped; rerun the same command to resume from the last checkpoint",
            dir.display()
        ))
    })?;
    let fmt = |e: Option<(f64, (f64, f64))>| match e {
        Some((m, (lo, hi))) => format!("{m:.3} (95% CI {lo:.3}–{hi:.3})"),
        None => "–".into(),
    };
    if json {
        let text = serde_json::to_string(&report).map_err(|e| anyhow!(e))?;
        println!("{text}");
        return match report.stopped_at {
            Some(_) => Err(Exit::quiet(143)),
            None => Ok(()),
        };
    }
    println!("run: {}", report.dir.display());
    if report.resumed_from > 0 {
        println!("resumed from step {}", report.resumed_from);
    }
    if let Some(step) = report.stopped_at {
        println!("stopped after step {step} with a checkpoint; run the same command to continue");
        return Err(Exit::quiet(143));
    }
    match report.time_limit_at {
        Some(step) => println!(
            "steps: {step} of {steps} (the time limit ended the run; the same command without --time-limit goes on)"
        ),
        None => println!("steps: {steps}"),
    }
    println!("held-out reward before: {}", fmt(report.eval_before));
    println!("held-out reward after:  {}", fmt(report.eval_after));
    println!(
        "metrics: {}\nreward curve: {}\nadapters: {}",
        report.dir.join("metrics.jsonl").display(),
        report.dir.join("reward.png").display(),
        report.dir.join("checkpoints").display()
    );
    Ok(())
}

/// `train export`: a run's (or an adapter file's) adapters merged into the model.
pub async fn export(args: TrainExportArgs) -> Result<(), Exit> {
    let ty: agentstack_quant::types::GgmlType = args
        .ty
        .parse()
        .map_err(|e| Exit::user(anyhow!("--type {}: {e}", args.ty)))?;
    let (adapter, model) = if args.source.is_dir() {
        let config: serde_json::Value = std::fs::read(args.source.join("config.json"))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .ok_or_else(|| {
                Exit::user(anyhow!(
                    "{} is not a training run (no readable config.json)",
                    args.source.display()
                ))
            })?;
        let checkpoints = args.source.join("checkpoints");
        let newest = std::fs::read_dir(&checkpoints)
            .map(|entries| {
                entries
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.join("state.json").is_file())
                    .max()
            })
            .ok()
            .flatten()
            .ok_or_else(|| {
                Exit::user(anyhow!(
                    "{} has no checkpoint yet; train at least checkpoint.every steps",
                    args.source.display()
                ))
            })?;
        let model = match &args.model {
            Some(m) => m.clone(),
            None => config["config"]["model"]
                .as_str()
                .map(PathBuf::from)
                .ok_or_else(|| {
                    Exit::user(anyhow!("the run's config names no model; pass --model"))
                })?,
        };
        (newest.join("adapter.safetensors"), model)
    } else {
        let model = args.model.clone().ok_or_else(|| {
            Exit::user(anyhow!(
                "--model is needed with an adapter file (the GGUF it was trained on)"
            ))
        })?;
        (args.source.clone(), model)
    };
    let out = args.out.clone();
    let (a, m, o) = (adapter.clone(), model.clone(), out.clone());
    let exported =
        tokio::task::spawn_blocking(move || agentstack_rl::export::export(&m, &a, &o, ty))
            .await
            .map_err(|e| anyhow!(e))?
            .map_err(|e| Exit::user(anyhow!(e)))?;
    println!(
        "wrote {} ({} bytes): {} weights merged from {} as {}, {} tensors copied from {}",
        out.display(),
        exported.bytes,
        exported.merged,
        adapter.display(),
        ty,
        exported.copied,
        model.display()
    );
    Ok(())
}
