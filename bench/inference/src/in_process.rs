//! Our side of llama-bench's protocol, measured on `Model::forward` directly.
//!
//! candle's kernels and our rayon kernels read their thread counts once, when they
//! first start, so each thread count runs in a child: this binary again, with the
//! hidden `__measure` subcommand, `RAYON_NUM_THREADS` set and `CANDLE_NUM_THREADS=1`
//! (as the CLI sets it).
//! The child prints one JSON line of results on stdout and draws its progress on
//! stderr. A model our runtime cannot load is an outcome, not a failure: the child
//! says so in its line (`{"cannot_load": ...}`) and the benchmark goes on.
//!
//! What llama-bench does, and so what we do (llama.cpp 0c1e570, `llama-bench.cpp`):
//! - **pp N**: on an empty cache, one call with N tokens (BOS, then random ids),
//!   logits of the last position only. One warm-up run, then R timed runs.
//! - **tg N**: on an empty cache, N calls of one token each (BOS, then random ids),
//!   each appending to the cache, logits every time. The warm-up is one token, as
//!   llama-bench's is.
//! - tok/s of a run = N / its time; the figure is the mean and sample standard
//!   deviation of the runs' tok/s.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use agentstack_model::{LanguageModel, Logits, Model, SeqInput, WeightForm};
use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use tokio::process::Command;
use tokio::time::timeout;

use crate::report::Rate;
use crate::settings::{Kernels, Plan, env_vars};

/// Seed of the token ids fed to the model; any fixed value does.
const TOKEN_SEED: u64 = 0x5eed_1234_abcd_0001;
/// Longest one child may take (load, warm-ups and all runs).
const CHILD_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// The hidden subcommand's arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct MeasureArgs {
    /// The GGUF file.
    #[arg(long)]
    pub model: PathBuf,
    /// Prompt tokens of the prefill test.
    #[arg(long)]
    pub prompt_tokens: usize,
    /// Generated tokens of the decode test.
    #[arg(long)]
    pub gen_tokens: usize,
    /// Timed runs of each test.
    #[arg(long)]
    pub repetitions: usize,
}

/// What a child measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InProcess {
    /// Threads candle's kernels use, as candle reports it.
    pub candle_threads: usize,
    /// Threads of rayon's global pool.
    pub rayon_threads: usize,
    /// Seconds to load the model.
    pub load_seconds: f64,
    /// Prefill, tok/s.
    pub pp: Rate,
    /// Decode, tok/s.
    pub tg: Rate,
}

/// What a child reports.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// It loaded the model and measured.
    Measured(InProcess),
    /// Our runtime cannot load the model; why.
    CannotLoad {
        /// The loader's error, with its causes.
        error: String,
    },
}

/// Runs in the child: measures, then prints the outcome as one JSON line.
pub fn measure(args: &MeasureArgs) -> Result<()> {
    let started = Instant::now();
    let lm = match LanguageModel::load(&args.model, WeightForm::Quantized) {
        Ok(lm) => lm,
        Err(e) => {
            // The first line, without the path the benchmark already shows (candle's
            // errors carry a backtrace on the following lines when RUST_BACKTRACE is set).
            let error = format!("{:#}", anyhow::Error::new(e));
            let error = error
                .lines()
                .next()
                .unwrap_or_default()
                .replace(&args.model.display().to_string(), "the file");
            println!("{}", serde_json::to_string(&Outcome::CannotLoad { error })?);
            return Ok(());
        }
    };
    let load_seconds = started.elapsed().as_secs_f64();
    let model = lm.model();
    let vocab = u32::try_from(model.config().vocab_size).context("vocabulary size")?;
    let first = lm.tokenizer().bos().unwrap_or(0);
    let mut ids = TokenIds::new(TOKEN_SEED, vocab);

    let runs = 1 + args.repetitions;
    let bar = ProgressBar::new(
        (runs * args.prompt_tokens + 1 + args.repetitions * args.gen_tokens) as u64,
    );
    bar.set_style(
        ProgressStyle::with_template("  {prefix} [{bar:30}] {pos}/{len} tokens, {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_prefix(format!(
        "agentstack, {} thread(s)",
        candle_core::utils::get_num_threads()
    ));

    let mut pp = Vec::with_capacity(args.repetitions);
    for run in 0..runs {
        let prompt: Vec<u32> = std::iter::once(first)
            .chain((1..args.prompt_tokens).map(|_| ids.next()))
            .collect();
        let mut cache = model.new_cache();
        let start = Instant::now();
        model.forward(&mut [SeqInput {
            cache: &mut cache,
            tokens: &prompt,
            logits: Logits::Last,
        }])?;
        let elapsed = start.elapsed();
        bar.inc(args.prompt_tokens as u64);
        if run > 0 {
            pp.push(args.prompt_tokens as f64 / elapsed.as_secs_f64());
        }
    }

    decode(model, first, 1, &mut ids, &bar)?;
    let mut tg = Vec::with_capacity(args.repetitions);
    for _ in 0..args.repetitions {
        let elapsed = decode(model, first, args.gen_tokens, &mut ids, &bar)?;
        tg.push(args.gen_tokens as f64 / elapsed.as_secs_f64());
    }
    bar.finish_and_clear();

    let result = InProcess {
        candle_threads: candle_core::utils::get_num_threads(),
        rayon_threads: rayon::current_num_threads(),
        load_seconds,
        pp: Rate::of(pp),
        tg: Rate::of(tg),
    };
    println!("{}", serde_json::to_string(&Outcome::Measured(result))?);
    Ok(())
}

/// `n` one-token forward passes on a fresh cache; the time they took.
fn decode(
    model: &Model,
    first: u32,
    n: usize,
    ids: &mut TokenIds,
    bar: &ProgressBar,
) -> Result<Duration> {
    let mut cache = model.new_cache();
    let mut token = first;
    let start = Instant::now();
    for _ in 0..n {
        model.forward(&mut [SeqInput {
            cache: &mut cache,
            tokens: std::slice::from_ref(&token),
            logits: Logits::Last,
        }])?;
        token = ids.next();
        bar.inc(1);
    }
    Ok(start.elapsed())
}

/// Pseudo-random token ids (xorshift64*), as llama-bench feeds `rand() % n_vocab`.
struct TokenIds {
    state: u64,
    vocab: u32,
}

impl TokenIds {
    fn new(seed: u64, vocab: u32) -> Self {
        Self {
            state: seed.max(1),
            vocab: vocab.max(1),
        }
    }

    fn next(&mut self) -> u32 {
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        let x = self.state.wrapping_mul(0x2545_f491_4f6c_dd1d);
        ((x >> 32) % u64::from(self.vocab)) as u32
    }
}

/// The child's command line: this binary's `__measure` on `model`, `prompt_tokens`
/// and `gen_tokens` per run, `repetitions` timed runs, at `threads` threads with
/// `kernels`.
/// The repack cache our children use: one folder per model, which the first child
/// fills (see [`set_repack_cache`]).
static REPACK_CACHE: std::sync::Mutex<Option<PathBuf>> = std::sync::Mutex::new(None);

/// Points our children's repack cache (`AGENTSTACK_REPACK_CACHE`) at `dir`, so they
/// run as a user's second and later loads do, and the user's own cache is untouched.
pub fn set_repack_cache(dir: Option<PathBuf>) {
    *REPACK_CACHE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = dir;
}

/// Our children's `AGENTSTACK_REPACK_CACHE` setting: the folder set, else off.
pub fn repack_cache_env() -> (&'static str, std::ffi::OsString) {
    let dir = REPACK_CACHE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    (
        env_vars::AGENTSTACK_REPACK_CACHE,
        dir.map_or_else(|| "off".into(), PathBuf::into_os_string),
    )
}

pub fn measure_command(
    model: &Path,
    (prompt_tokens, gen_tokens, repetitions): (usize, usize, usize),
    threads: usize,
    kernels: Kernels,
) -> Result<std::process::Command> {
    let exe = std::env::current_exe().context("finding this benchmark's own binary")?;
    let mut command = std::process::Command::new(exe);
    command
        .arg("__measure")
        .arg("--model")
        .arg(model)
        .args([
            "--prompt-tokens",
            &prompt_tokens.to_string(),
            "--gen-tokens",
            &gen_tokens.to_string(),
            "--repetitions",
            &repetitions.to_string(),
        ])
        .env(env_vars::RAYON_NUM_THREADS, threads.to_string())
        // As the CLI does: no spinning workers in candle's element-wise pool.
        .env(env_vars::CANDLE_NUM_THREADS, "1")
        .env_remove(env_vars::AGENTSTACK_KERNELS);
    let (name, value) = repack_cache_env();
    command.env(name, value);
    if let Some(cap) = kernels.env_value() {
        command.env(env_vars::AGENTSTACK_KERNELS, cap);
    }
    Ok(command)
}

/// Runs the measurement at `threads` threads with `kernels` in a child process and
/// reads back what it measured, or that it cannot load the model.
pub async fn run_child(
    model: &Path,
    plan: &Plan,
    threads: usize,
    kernels: Kernels,
) -> Result<Outcome> {
    let mut command = Command::from(measure_command(
        model,
        (plan.prompt_tokens, plan.gen_tokens, plan.repetitions),
        threads,
        kernels,
    )?);
    command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    let output = timeout(CHILD_TIMEOUT, command.output())
        .await
        .with_context(|| {
            format!("the in-process measurement at {threads} thread(s) took over {CHILD_TIMEOUT:?}")
        })?
        .context("running the in-process measurement")?;
    if !output.status.success() {
        bail!(
            "the in-process measurement at {threads} thread(s) failed ({}); its error is above",
            output.status
        );
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout.lines().last().unwrap_or_default();
    let outcome: Outcome = serde_json::from_str(line)
        .with_context(|| format!("reading the in-process measurement's output {line:?}"))?;
    let Outcome::Measured(result) = &outcome else {
        return Ok(outcome);
    };
    if result.candle_threads != threads || result.rayon_threads != threads {
        bail!(
            "asked for {threads} thread(s), but candle used {} and rayon {}",
            result.candle_threads,
            result.rayon_threads
        );
    }
    Ok(outcome)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_ids_stay_in_the_vocabulary_and_vary() {
        let mut ids = TokenIds::new(TOKEN_SEED, 49_152);
        let drawn: Vec<u32> = (0..1000).map(|_| ids.next()).collect();
        assert!(drawn.iter().all(|&id| id < 49_152));
        let mut distinct = drawn.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert!(distinct.len() > 900, "only {} distinct ids", distinct.len());
    }
}
