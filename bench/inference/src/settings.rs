//! Flags and environment resolved into what one run needs: the files it uses, checked
//! to exist (with a hint saying how to get each), and the counts of every phase.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use anyhow::Result;
use clap::ValueEnum as _;
use serde::Serialize;

use crate::Args;

/// The environment variables this benchmark reads or sets (`AGENTSTACK_TEST_MODEL`,
/// `AGENTSTACK_LLAMACPP_BIN`, and `RAYON_NUM_THREADS`, `CANDLE_NUM_THREADS`,
/// `AGENTSTACK_KERNELS` on the in-process children), declared in the workspace's
/// registry.
pub use agentstack_static::env_vars;

/// The model file the llama.cpp interop tests use too.
const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// A mistake the user can fix (a missing file, a bad flag): exit code 1, and the
/// message carries a `hint:` line.
#[derive(Debug)]
pub struct UserError(pub String);

impl fmt::Display for UserError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UserError {}

/// Returns early with a [`UserError`].
macro_rules! user_error {
    ($($arg:tt)*) => {
        return Err(anyhow::Error::new($crate::settings::UserError(format!($($arg)*))))
    };
}

/// Which parts of the benchmark run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// Prefill and decode, llama-bench's protocol: `llama-bench` against our forward
    /// pass in a child process.
    PpTg,
    /// Aggregate throughput of concurrent `/v1/completions` requests: `llama-server`
    /// against `agentstack model serve`.
    Concurrent,
    /// Load time and peak memory: each engine loads the model and computes one token
    /// in a fresh process (`llama-completion` against our forward pass).
    Startup,
}

/// Which kernels our side runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Kernels {
    /// The widest family this CPU has (AVX-512 VNNI where present).
    Native,
    /// Capped at AVX2 (`AGENTSTACK_KERNELS=avx2`): what CPUs without AVX-512 run.
    Avx2,
}

impl Kernels {
    /// `AGENTSTACK_KERNELS`'s value for this family, if it sets one.
    pub fn env_value(self) -> Option<&'static str> {
        match self {
            Self::Native => None,
            Self::Avx2 => Some("avx2"),
        }
    }
}

impl fmt::Display for Kernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Native => "native",
            Self::Avx2 => "AVX2",
        })
    }
}

/// The counts of one run.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    /// Phases to run.
    pub phases: Vec<Phase>,
    /// Compute thread counts, each measured separately.
    pub threads: Vec<usize>,
    /// Our kernel families, each measured separately.
    pub kernels: Vec<Kernels>,
    /// Prompt tokens of the prefill test (llama-bench `-p`).
    pub prompt_tokens: usize,
    /// Generated tokens of the decode test (llama-bench `-n`).
    pub gen_tokens: usize,
    /// Repetitions of each prefill/decode test (llama-bench `-r`).
    pub repetitions: usize,
    /// Concurrent requests per round.
    pub requests: usize,
    /// `max_tokens` of each request.
    pub max_tokens: usize,
    /// Measured rounds per server and thread count.
    pub rounds: usize,
    /// Unmeasured rounds first, per server and thread count.
    pub warmup_rounds: usize,
    /// The prompt of every request.
    pub prompt: String,
    /// `llama-server -c`: context shared by its slots.
    pub llama_server_ctx: usize,
    /// Machine price assumed for the cost floor, $ per hour.
    pub price_per_hour: f64,
}

impl Plan {
    /// pp8/tg8 once: a check that a model loads and runs, not a measurement.
    pub fn tiny() -> Self {
        Self {
            phases: vec![Phase::PpTg],
            threads: vec![1],
            kernels: vec![Kernels::Native],
            prompt_tokens: 8,
            gen_tokens: 8,
            repetitions: 1,
            requests: 1,
            max_tokens: 8,
            rounds: 1,
            warmup_rounds: 0,
            prompt: "x".into(),
            llama_server_ctx: 512,
            price_per_hour: 0.1,
        }
    }
}

/// Everything a run needs, checked.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The counts.
    pub plan: Plan,
    /// The GGUF files, in order.
    pub models: Vec<PathBuf>,
    /// `llama-bench`.
    pub llama_bench: PathBuf,
    /// `llama-server`.
    pub llama_server: PathBuf,
    /// The agentstack binary (only checked when the concurrent phase runs).
    pub agentstack: PathBuf,
    /// Where the JSON results go.
    pub json: PathBuf,
    /// Markdown file to append the results to.
    pub write_results: Option<PathBuf>,
    /// Longest a server may take to answer `GET /health`.
    pub startup_timeout: Duration,
    /// Longest one request may take.
    pub request_timeout: Duration,
}

impl Settings {
    /// Flags first, then the environment, then the defaults.
    pub fn resolve(args: &Args) -> Result<Self> {
        let quick = args.quick;
        let several = args.set.is_some() || args.models.as_ref().is_some_and(|m| m.len() > 1);
        let plan = Plan {
            // Serving every model of a set would take hours: pp/tg only, unless asked.
            phases: dedup(args.only.clone().unwrap_or_else(|| {
                if several {
                    vec![Phase::Startup, Phase::PpTg]
                } else {
                    vec![Phase::Startup, Phase::PpTg, Phase::Concurrent]
                }
            })),
            threads: dedup(
                args.threads
                    .clone()
                    .unwrap_or_else(|| if quick { vec![1] } else { vec![1, 2] }),
            ),
            kernels: dedup(
                args.kernels
                    .clone()
                    .unwrap_or_else(|| vec![Kernels::Native]),
            ),
            prompt_tokens: args.prompt_tokens,
            gen_tokens: args.gen_tokens,
            repetitions: args.repetitions.unwrap_or(if quick { 1 } else { 3 }),
            requests: args.requests,
            max_tokens: args.max_tokens.unwrap_or(if quick { 32 } else { 128 }),
            rounds: args.rounds.unwrap_or(if quick { 1 } else { 3 }),
            warmup_rounds: args.warmup_rounds,
            prompt: args.prompt.clone(),
            llama_server_ctx: args.llama_server_ctx,
            price_per_hour: args.price_per_hour,
        };
        for (flag, value) in [
            ("--threads", plan.threads.iter().copied().min().unwrap_or(0)),
            ("--kernels", plan.kernels.len()),
            ("--prompt-tokens", plan.prompt_tokens),
            ("--gen-tokens", plan.gen_tokens),
            ("--repetitions", plan.repetitions),
            ("--requests", plan.requests),
            ("--max-tokens", plan.max_tokens),
            ("--rounds", plan.rounds),
        ] {
            if value == 0 {
                user_error!("{flag} must be at least 1\nhint: see --help for the defaults");
            }
        }
        if plan.prompt.is_empty() {
            user_error!("--prompt must not be empty");
        }
        if !(plan.price_per_hour.is_finite() && plan.price_per_hour > 0.0) {
            user_error!("--price-per-hour must be a positive number of dollars, e.g. 0.10");
        }
        if plan.llama_server_ctx < plan.requests * (plan.max_tokens + 256) {
            user_error!(
                "--llama-server-ctx {} is too small for {} requests of {} tokens (llama-server splits it between its slots)\n\
                 hint: give at least --requests × (--max-tokens + 256)",
                plan.llama_server_ctx,
                plan.requests,
                plan.max_tokens
            );
        }

        let cache = cache_dir();
        let llama_dir = llamacpp_bin(args.llamacpp_bin.as_deref(), &cache);
        let models = match (&args.set, &args.models, &args.model) {
            (Some(set), _, _) => {
                let dir = crate::models::set_dir(&cache, &llama_dir);
                let files = crate::models::files(&dir, *set);
                let missing: Vec<String> = files
                    .iter()
                    .filter(|f| !f.is_file())
                    .map(|f| f.display().to_string())
                    .collect();
                if !missing.is_empty() {
                    user_error!(
                        "the model set is not prepared; missing:\n  {}\nhint: run `agentstack-bench-inference models --set {}` first",
                        missing.join("\n  "),
                        set.to_possible_value()
                            .map_or("all".into(), |v| v.get_name().to_owned())
                    );
                }
                files
            }
            (None, Some(list), _) => list.clone(),
            (None, None, model) => vec![model.clone().unwrap_or_else(|| default_model(&cache))],
        };
        for model in &models {
            if !model.is_file() {
                user_error!(
                    "the model {} does not exist\nhint: run scripts/fetch-model, or pass --model (or set {}) to a GGUF file",
                    model.display(),
                    env_vars::AGENTSTACK_TEST_MODEL
                );
            }
        }
        let llama_bench = llama_dir.join("llama-bench");
        let llama_server = llama_dir.join("llama-server");
        let llama_completion = crate::startup::llama_completion(&llama_bench);
        let needed: Vec<&Path> = [
            (Phase::PpTg, &llama_bench),
            (Phase::Concurrent, &llama_server),
            (Phase::Startup, &llama_completion),
        ]
        .into_iter()
        .filter(|(phase, _)| plan.phases.contains(phase))
        .map(|(_, tool)| tool.as_path())
        .collect();
        for tool in needed {
            if !tool.is_file() {
                user_error!(
                    "{} does not exist\nhint: run scripts/install-llamacpp, or pass --llamacpp-bin (or set {}) to a folder with llama-bench, llama-server and llama-completion",
                    tool.display(),
                    env_vars::AGENTSTACK_LLAMACPP_BIN
                );
            }
        }
        let agentstack = match &args.agentstack {
            Some(path) => path.clone(),
            None => default_agentstack(),
        };
        if plan.phases.contains(&Phase::Concurrent) {
            check_agentstack(&agentstack)?;
        }
        Ok(Self {
            plan,
            models,
            llama_bench,
            llama_server,
            agentstack,
            json: args.json.clone(),
            write_results: args.write_results.clone(),
            startup_timeout: Duration::from_secs(args.startup_timeout),
            request_timeout: Duration::from_secs(args.request_timeout),
        })
    }
}

fn dedup<T: PartialEq>(items: Vec<T>) -> Vec<T> {
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        if !out.contains(&item) {
            out.push(item);
        }
    }
    out
}

pub use agentstack_bench_support::paths::{cache_dir, llamacpp_bin};

/// `$AGENTSTACK_TEST_MODEL`, else the cache's SmolLM2 Q4_1.
pub fn default_model(cache: &Path) -> PathBuf {
    std::env::var_os(env_vars::AGENTSTACK_TEST_MODEL)
        .map(PathBuf::from)
        .unwrap_or_else(|| cache.join(DEFAULT_MODEL))
}

/// The newer of `target/{release,debug}/agentstack` beside this benchmark's own
/// binary: a stale release build next to a fresh debug one is the usual trap.
pub fn default_agentstack() -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_default();
    let target = exe.parent().and_then(Path::parent).map(Path::to_path_buf);
    let candidates: Vec<PathBuf> = match target {
        Some(target) => ["release", "debug"]
            .iter()
            .map(|profile| target.join(profile).join("agentstack"))
            .collect(),
        None => vec![PathBuf::from("target/release/agentstack")],
    };
    let modified = |path: &PathBuf| std::fs::metadata(path).and_then(|m| m.modified()).ok();
    candidates
        .iter()
        .filter_map(|path| Some((modified(path)?, path)))
        .max_by_key(|(time, _)| *time)
        .map(|(_, path): (SystemTime, &PathBuf)| path.clone())
        .unwrap_or_else(|| candidates[0].clone())
}

/// The binary exists and has `model serve` (an old build may not).
fn check_agentstack(path: &Path) -> Result<()> {
    let hint = "hint: build it with `cargo build -p agentstack` (or `--release`), or pass --agentstack PATH";
    if !path.is_file() {
        user_error!(
            "the agentstack binary {} does not exist\n{hint}",
            path.display()
        );
    }
    let status = std::process::Command::new(path)
        .args(["model", "serve", "--help"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status();
    if !status.is_ok_and(|s| s.success()) {
        user_error!(
            "{} has no `model serve` command (an old build?)\n{hint}",
            path.display()
        );
    }
    Ok(())
}
