//! llama.cpp's side of the prefill/decode test: `llama-bench -o json`, one thread
//! count per call so that it can alternate with ours.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use tokio::process::Command;
use tokio::time::timeout;

use crate::report::Rate;
use crate::settings::Plan;

/// Longest one llama-bench call may take.
const LLAMA_BENCH_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// One test of llama-bench's JSON output (the fields we use).
#[derive(Debug, Deserialize)]
struct Test {
    build_commit: String,
    n_prompt: usize,
    n_gen: usize,
    n_threads: usize,
    samples_ns: Vec<u64>,
}

/// What one llama-bench call measured.
#[derive(Debug, Clone)]
pub struct LlamaBench {
    /// llama.cpp's commit.
    pub build_commit: String,
    /// Prefill, tok/s.
    pub pp: Rate,
    /// Decode, tok/s.
    pub tg: Rate,
}

/// The arguments of the llama-bench call, for the report.
pub fn arguments(model: &Path, plan: &Plan, threads: usize) -> Vec<String> {
    vec![
        "-m".into(),
        model.display().to_string(),
        "-p".into(),
        plan.prompt_tokens.to_string(),
        "-n".into(),
        plan.gen_tokens.to_string(),
        "-t".into(),
        threads.to_string(),
        "-r".into(),
        plan.repetitions.to_string(),
        "-o".into(),
        "json".into(),
    ]
}

/// Runs `llama-bench -m MODEL -p P -n N -t T -r R -o json`.
pub async fn run(
    bin: &Path,
    model: &Path,
    plan: &Plan,
    threads: usize,
    log: &Path,
) -> Result<LlamaBench> {
    let log_file =
        std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let mut command = Command::new(bin);
    command
        .args(arguments(model, plan, threads))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log_file))
        .kill_on_drop(true);
    let output = timeout(LLAMA_BENCH_TIMEOUT, command.output())
        .await
        .with_context(|| format!("llama-bench took over {LLAMA_BENCH_TIMEOUT:?}"))?
        .with_context(|| format!("running {}", bin.display()))?;
    if !output.status.success() {
        let stderr = std::fs::read_to_string(log).unwrap_or_default();
        let tail: Vec<&str> = stderr.lines().rev().take(20).collect();
        bail!(
            "llama-bench failed ({}); the end of its stderr ({}):\n{}",
            output.status,
            log.display(),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    parse(&String::from_utf8_lossy(&output.stdout), plan, threads)
}

fn parse(json: &str, plan: &Plan, threads: usize) -> Result<LlamaBench> {
    let tests: Vec<Test> =
        serde_json::from_str(json).context("reading llama-bench's JSON output")?;
    let find = |n_prompt: usize, n_gen: usize| {
        tests
            .iter()
            .find(|t| t.n_prompt == n_prompt && t.n_gen == n_gen && t.n_threads == threads)
            .with_context(|| format!("llama-bench's output has no test with n_prompt {n_prompt}, n_gen {n_gen}, {threads} threads"))
    };
    let pp = find(plan.prompt_tokens, 0)?;
    let tg = find(0, plan.gen_tokens)?;
    // tok/s per run from the nanoseconds, as llama-bench computes its avg_ts and
    // stddev_ts (its samples_ts are rounded for printing).
    let rate = |test: &Test, tokens: usize| {
        Rate::of(
            test.samples_ns
                .iter()
                .map(|&ns| tokens as f64 * 1e9 / ns.max(1) as f64)
                .collect(),
        )
    };
    Ok(LlamaBench {
        build_commit: pp.build_commit.clone(),
        pp: rate(pp, plan.prompt_tokens),
        tg: rate(tg, plan.gen_tokens),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tolerance of rates recomputed from nanoseconds.
    const RATE_TOLERANCE: f64 = 1e-6;

    fn plan() -> Plan {
        Plan {
            phases: Vec::new(),
            threads: vec![1],
            kernels: vec![crate::settings::Kernels::Native],
            prompt_tokens: 64,
            gen_tokens: 128,
            repetitions: 2,
            requests: 8,
            max_tokens: 128,
            rounds: 1,
            warmup_rounds: 1,
            prompt: "x".into(),
            llama_server_ctx: 8192,
            price_per_hour: 0.1,
        }
    }

    #[test]
    fn reads_pp_and_tg_from_llama_bench_json() {
        let json = r#"[
          {"build_commit": "0c1e570", "n_prompt": 64, "n_gen": 0, "n_threads": 1,
           "avg_ts": 1000.0, "samples_ns": [64000000, 32000000]},
          {"build_commit": "0c1e570", "n_prompt": 0, "n_gen": 128, "n_threads": 1,
           "samples_ns": [1280000000, 1280000000]}
        ]"#;
        let result = parse(json, &plan(), 1).unwrap();
        assert_eq!(result.build_commit, "0c1e570");
        assert!((result.pp.mean - 1500.0).abs() < RATE_TOLERANCE);
        assert_eq!(result.pp.samples.len(), 2);
        assert!((result.tg.mean - 100.0).abs() < RATE_TOLERANCE);
        assert!(result.tg.stddev.abs() < RATE_TOLERANCE);
        assert!(
            parse(json, &plan(), 2).is_err(),
            "wrong thread count must not match"
        );
    }
}
