//! Flags and environment resolved into what one run needs: the files it uses, checked
//! to exist (with a hint saying how to get each), and the counts of every phase.

use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use anyhow::Result;
use serde::Serialize;

use crate::Args;

/// The environment variables this benchmark reads, each once, here.
pub mod env_vars {
    /// The GGUF file both engines run (default: `$AGENTSTACK_CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf`,
    /// which `scripts/fetch-model` fetches). The model tests read it too.
    pub const AGENTSTACK_TEST_MODEL: &str = "AGENTSTACK_TEST_MODEL";
    /// A folder holding `llama-bench` and `llama-server` (default:
    /// `$AGENTSTACK_CACHE/llama.cpp-0.3.36/bin`, which `scripts/install-llamacpp` builds).
    pub const AGENTSTACK_LLAMACPP_BIN: &str = "AGENTSTACK_LLAMACPP_BIN";
    /// agentstack's cache folder (default `~/.cache/agentstack`).
    pub const AGENTSTACK_CACHE: &str = "AGENTSTACK_CACHE";
    /// Where `~` is.
    pub const HOME: &str = "HOME";
    /// Threads of rayon's global pool (our kernels), set on the in-process children.
    pub const RAYON_NUM_THREADS: &str = "RAYON_NUM_THREADS";
    /// Threads of candle's CPU kernels, set on the in-process children.
    pub const CANDLE_NUM_THREADS: &str = "CANDLE_NUM_THREADS";
}

/// The model file the llama.cpp interop tests use too.
const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
/// Where `scripts/install-llamacpp` puts the tools, under the cache folder.
const DEFAULT_LLAMACPP_BIN: &str = "llama.cpp-0.3.36/bin";

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
}

/// The counts of one run.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    /// Phases to run.
    pub phases: Vec<Phase>,
    /// Compute thread counts, each measured separately.
    pub threads: Vec<usize>,
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

/// Everything a run needs, checked.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The counts.
    pub plan: Plan,
    /// The GGUF file.
    pub model: PathBuf,
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
        let plan = Plan {
            phases: dedup(
                args.only
                    .clone()
                    .unwrap_or_else(|| vec![Phase::PpTg, Phase::Concurrent]),
            ),
            threads: dedup(
                args.threads
                    .clone()
                    .unwrap_or_else(|| if quick { vec![1] } else { vec![1, 2] }),
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

        let cache = std::env::var_os(env_vars::AGENTSTACK_CACHE)
            .map(PathBuf::from)
            .unwrap_or_else(|| home().join(".cache/agentstack"));
        let model = args
            .model
            .clone()
            .or_else(|| std::env::var_os(env_vars::AGENTSTACK_TEST_MODEL).map(PathBuf::from))
            .unwrap_or_else(|| cache.join(DEFAULT_MODEL));
        if !model.is_file() {
            user_error!(
                "the model {} does not exist\nhint: run scripts/fetch-model, or pass --model (or set {}) to a GGUF file",
                model.display(),
                env_vars::AGENTSTACK_TEST_MODEL
            );
        }
        let llama_dir = args
            .llamacpp_bin
            .clone()
            .or_else(|| std::env::var_os(env_vars::AGENTSTACK_LLAMACPP_BIN).map(PathBuf::from))
            .unwrap_or_else(|| cache.join(DEFAULT_LLAMACPP_BIN));
        let llama_bench = llama_dir.join("llama-bench");
        let llama_server = llama_dir.join("llama-server");
        let needed: &[&Path] = match (
            plan.phases.contains(&Phase::PpTg),
            plan.phases.contains(&Phase::Concurrent),
        ) {
            (true, true) => &[&llama_bench, &llama_server],
            (true, false) => &[&llama_bench],
            (false, _) => &[&llama_server],
        };
        for tool in needed {
            if !tool.is_file() {
                user_error!(
                    "{} does not exist\nhint: run scripts/install-llamacpp, or pass --llamacpp-bin (or set {}) to a folder with llama-bench and llama-server",
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
            model,
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

fn home() -> PathBuf {
    std::env::var_os(env_vars::HOME).map_or_else(|| PathBuf::from("/root"), PathBuf::from)
}

/// The newer of `target/{release,debug}/agentstack` beside this benchmark's own
/// binary: a stale release build next to a fresh debug one is the usual trap.
fn default_agentstack() -> PathBuf {
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

/// This process's command line, quoted for a POSIX shell where needed.
pub fn command_line() -> String {
    std::env::args_os()
        .map(OsString::into_string)
        .map(|arg| {
            let arg = arg.unwrap_or_else(|raw| raw.to_string_lossy().into_owned());
            let plain = !arg.is_empty()
                && arg
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_./=:,-+@".contains(c));
            if plain {
                arg
            } else {
                format!("'{}'", arg.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}
