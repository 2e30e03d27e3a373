//! Figures, the tables printed, and the JSON written: all plain data, no I/O.

use agentstack_bench_support::machine;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::bandwidth::Bandwidth;
use crate::settings::{Kernels, Phase, Plan};

/// A throughput over several runs, tok/s.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Rate {
    /// Mean of the runs.
    pub mean: f64,
    /// Sample standard deviation of the runs (0 for one run), as llama-bench's.
    pub stddev: f64,
    /// Each run.
    pub samples: Vec<f64>,
}

impl Rate {
    /// The mean and sample standard deviation of `samples`.
    pub fn of(samples: Vec<f64>) -> Self {
        let n = samples.len() as f64;
        let mean = if samples.is_empty() {
            0.0
        } else {
            samples.iter().sum::<f64>() / n
        };
        let stddev = if samples.len() < 2 {
            0.0
        } else {
            (samples.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt()
        };
        Self {
            mean,
            stddev,
            samples,
        }
    }
}

/// The machine, at the start of the run.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    /// Logical CPUs.
    pub cpus: usize,
    /// `model name` from `/proc/cpuinfo`.
    pub cpu_model: String,
    /// `MemTotal`, GiB.
    pub memory_gib: f64,
    /// `/proc/loadavg`'s three averages at the start.
    pub load_average_start: String,
    /// And at the end.
    pub load_average_end: String,
}

impl Machine {
    /// Reads `/proc`; what it cannot read stays empty.
    pub fn read() -> Self {
        let mem_kib = machine::mem_total_kib().unwrap_or(0) as f64;
        Self {
            cpus: std::thread::available_parallelism().map_or(0, usize::from),
            cpu_model: machine::cpu_model().unwrap_or_else(|| "unknown CPU".to_owned()),
            memory_gib: mem_kib / (1024.0 * 1024.0),
            load_average_start: load_average(),
            load_average_end: String::new(),
        }
    }
}

/// The 1, 5 and 15 minute load averages.
pub fn load_average() -> String {
    machine::load_average().unwrap_or_default()
}

/// What was run, for the record.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Versions {
    /// `agentstack --version` and the git commit.
    pub agentstack: String,
    /// llama.cpp's version and commit.
    pub llamacpp: String,
}

/// Prefill and decode at one thread count and one of our kernel families, both
/// engines.
#[derive(Debug, Clone, Serialize)]
pub struct PpTg {
    /// Compute threads.
    pub threads: usize,
    /// Our kernel family (llama.cpp runs one build on every row: [`Versions::llamacpp`]).
    pub kernels: Kernels,
    /// The llama-bench command.
    pub llamacpp_command: String,
    /// Why ours has no figures (`cannot load: ...`, or a failed run).
    pub agentstack_error: Option<String>,
    /// Why llama.cpp has no figures.
    pub llamacpp_error: Option<String>,
    /// Ours: prefill, tok/s.
    pub agentstack_pp: Rate,
    /// Ours: decode, tok/s.
    pub agentstack_tg: Rate,
    /// Ours: seconds to load the model.
    pub agentstack_load_seconds: f64,
    /// llama.cpp: prefill, tok/s.
    pub llamacpp_pp: Rate,
    /// llama.cpp: decode, tok/s.
    pub llamacpp_tg: Rate,
    /// Ours / llama.cpp, prefill means.
    pub pp_ratio: f64,
    /// Ours / llama.cpp, decode means.
    pub tg_ratio: f64,
    /// Memory-bandwidth ceiling of decode at this thread count, tok/s: best `memcpy`
    /// bandwidth at up to this many threads / weight bytes read per token.
    pub decode_ceiling: f64,
    /// Our decode mean / the ceiling.
    pub agentstack_tg_of_ceiling: f64,
    /// llama.cpp's decode mean / the ceiling.
    pub llamacpp_tg_of_ceiling: f64,
    /// The ceiling from read-only bandwidth ([`crate::bandwidth::measure_read`]) at up
    /// to this many threads, tok/s.
    pub read_ceiling: f64,
    /// Our decode mean / the read ceiling.
    pub agentstack_tg_of_read_ceiling: f64,
    /// llama.cpp's decode mean / the read ceiling.
    pub llamacpp_tg_of_read_ceiling: f64,
}

/// Everything measured on one model file.
#[derive(Debug, Clone, Serialize)]
pub struct ModelResults {
    /// The GGUF file.
    pub path: String,
    /// Its name in the tables (file stem, with its type).
    pub label: String,
    /// Bytes of weights one decoded token reads (see [`crate::bandwidth`]).
    pub weight_bytes_per_token: u64,
    /// Prefill and decode, per thread count and kernel family.
    pub pp_tg: Vec<PpTg>,
    /// Concurrent requests, per thread count.
    pub concurrent: Vec<Concurrent>,
    /// Load time and peak memory.
    pub startup: Option<crate::startup::Startup>,
}

/// One measured round of one server.
#[derive(Debug, Clone, Serialize)]
pub struct RoundRecord {
    /// Wall seconds.
    pub wall_seconds: f64,
    /// Tokens generated.
    pub tokens: u64,
    /// Answers shorter than `max_tokens`.
    pub short_answers: usize,
}

/// One server's rounds.
#[derive(Debug, Clone, Serialize)]
pub struct ServerFigures {
    /// How it was started.
    pub command: String,
    /// Aggregate tok/s over the rounds.
    pub tokens_per_second: Rate,
    /// Each round.
    pub rounds: Vec<RoundRecord>,
}

/// Concurrent requests at one thread count, both servers.
#[derive(Debug, Clone, Serialize)]
pub struct Concurrent {
    /// Compute threads of both servers.
    pub threads: usize,
    /// `agentstack model serve`.
    pub agentstack: ServerFigures,
    /// `llama-server`.
    pub llamacpp: ServerFigures,
    /// Ours / llama.cpp, aggregate tok/s means.
    pub ratio: f64,
}

/// The cost floor of one throughput.
#[derive(Debug, Clone, Serialize)]
pub struct Cost {
    /// Which throughput.
    pub basis: String,
    /// Ours, $ per million generated tokens.
    pub agentstack_usd_per_million: f64,
    /// llama.cpp's.
    pub llamacpp_usd_per_million: f64,
    /// Ours / llama.cpp (below 1: we are cheaper).
    pub ratio: f64,
}

/// Everything, as written to the JSON file.
#[derive(Debug, Clone, Serialize)]
pub struct Results {
    /// `inference`.
    pub benchmark: &'static str,
    /// When, UTC.
    pub date: String,
    /// The command that produced them.
    pub command: String,
    /// Where.
    pub machine: Machine,
    /// What ran.
    pub versions: Versions,
    /// The counts.
    pub plan: Plan,
    /// `memcpy` bandwidth per thread count.
    pub bandwidth: Vec<Bandwidth>,
    /// Read-only bandwidth per thread count.
    pub read_bandwidth: Vec<Bandwidth>,
    /// Each model's figures.
    pub models: Vec<ModelResults>,
    /// The cost floor, from `plan.price_per_hour`.
    pub cost: Vec<Cost>,
}

/// $ per million tokens of a machine costing `price_per_hour` that generates
/// `tokens_per_second` and does nothing else.
pub fn usd_per_million(price_per_hour: f64, tokens_per_second: f64) -> f64 {
    price_per_hour / (tokens_per_second * 3600.0) * 1e6
}

/// Ours / theirs, or NaN when theirs is 0.
pub fn ratio(ours: f64, theirs: f64) -> f64 {
    if theirs > 0.0 {
        ours / theirs
    } else {
        f64::NAN
    }
}

/// The cost rows for the decode and concurrent figures measured (native kernels; a
/// model's name when there are several).
pub fn costs(plan: &Plan, models: &[ModelResults]) -> Vec<Cost> {
    let row = |basis: String, ours: f64, theirs: f64| {
        let ours = usd_per_million(plan.price_per_hour, ours);
        let theirs = usd_per_million(plan.price_per_hour, theirs);
        Cost {
            basis,
            agentstack_usd_per_million: ours,
            llamacpp_usd_per_million: theirs,
            ratio: ratio(ours, theirs),
        }
    };
    let mut rows = Vec::new();
    for m in models {
        let prefix = if models.len() > 1 {
            format!("{}: ", m.label)
        } else {
            String::new()
        };
        for r in m.pp_tg.iter().filter(|r| r.kernels == Kernels::Native) {
            if r.agentstack_error.is_some() || r.llamacpp_error.is_some() {
                continue;
            }
            rows.push(row(
                format!(
                    "{prefix}tg{}, {}, one sequence",
                    plan.gen_tokens,
                    threads(r.threads)
                ),
                r.agentstack_tg.mean,
                r.llamacpp_tg.mean,
            ));
        }
        for c in &m.concurrent {
            rows.push(row(
                format!(
                    "{prefix}{} concurrent requests, {}",
                    plan.requests,
                    threads(c.threads)
                ),
                c.agentstack.tokens_per_second.mean,
                c.llamacpp.tokens_per_second.mean,
            ));
        }
    }
    rows
}

fn threads(n: usize) -> String {
    if n == 1 {
        "1 thread".into()
    } else {
        format!("{n} threads")
    }
}

/// The main table: throughput of both engines with the ratio, and decode as a share of
/// its memory-bandwidth ceiling; a group of rows per model.
pub fn table(results: &Results) -> String {
    let plan = &results.plan;
    let mut out = String::new();
    let runs = match (
        plan.phases.contains(&Phase::PpTg),
        plan.phases.contains(&Phase::Concurrent),
    ) {
        (true, true) => format!(
            "{} runs; {} rounds for concurrent",
            plan.repetitions, plan.rounds
        ),
        (true, false) => format!("{} runs", plan.repetitions),
        (false, _) => format!("{} rounds", plan.rounds),
    };
    let _ = writeln!(
        out,
        "| Model (weights read per decoded token) | Throughput, tok/s (mean ± sd of {runs}) | agentstack | llama.cpp | agentstack / llama.cpp (above 1× is faster) | decode ceiling, tok/s (memcpy bandwidth / weight bytes per token) | agentstack, % of ceiling | llama.cpp, % of ceiling | read ceiling, tok/s (read bandwidth / weight bytes per token) | agentstack, % of read ceiling | llama.cpp, % of read ceiling |"
    );
    let _ = writeln!(out, "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|");
    let several_kernels = plan.kernels.len() > 1 || plan.kernels != [Kernels::Native];
    for m in &results.models {
        let mut first = true;
        let mut model_cell = || {
            if std::mem::take(&mut first) {
                format!(
                    "**{}** ({:.1} MiB)",
                    m.label,
                    m.weight_bytes_per_token as f64 / (1024.0 * 1024.0)
                )
            } else {
                String::new()
            }
        };
        for r in &m.pp_tg {
            let kernels = if several_kernels {
                format!(", {} kernels", r.kernels)
            } else {
                String::new()
            };
            let ours = |rate: &Rate| match &r.agentstack_error {
                Some(e) => cell_text(e),
                None => fmt_rate(rate),
            };
            let theirs = |rate: &Rate| match &r.llamacpp_error {
                Some(e) => cell_text(e),
                None => fmt_rate(rate),
            };
            let _ = writeln!(
                out,
                "| {} | pp{}, {}{kernels}: prefill | {} | {} | {} | | | | | | |",
                model_cell(),
                plan.prompt_tokens,
                threads(r.threads),
                ours(&r.agentstack_pp),
                theirs(&r.llamacpp_pp),
                fmt_ratio(r.pp_ratio)
            );
            let _ = writeln!(
                out,
                "| {} | tg{}, {}{kernels}: decode | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                model_cell(),
                plan.gen_tokens,
                threads(r.threads),
                ours(&r.agentstack_tg),
                theirs(&r.llamacpp_tg),
                fmt_ratio(r.tg_ratio),
                fmt_significant(r.decode_ceiling),
                fmt_percent(r.agentstack_tg_of_ceiling),
                fmt_percent(r.llamacpp_tg_of_ceiling),
                fmt_significant(r.read_ceiling),
                fmt_percent(r.agentstack_tg_of_read_ceiling),
                fmt_percent(r.llamacpp_tg_of_read_ceiling)
            );
        }
        for c in &m.concurrent {
            let _ = writeln!(
                out,
                "| {} | {} concurrent × {} tokens, {}: aggregate | {} | {} | {} | | | | | | |",
                model_cell(),
                plan.requests,
                plan.max_tokens,
                threads(c.threads),
                fmt_rate(&c.agentstack.tokens_per_second),
                fmt_rate(&c.llamacpp.tokens_per_second),
                fmt_ratio(c.ratio)
            );
        }
    }
    out
}

/// The bandwidth lines under the table: `memcpy`'s, then the reads'.
pub fn bandwidth_line(results: &Results) -> String {
    let figures = |measured: &[Bandwidth]| {
        measured
            .iter()
            .map(|b| {
                format!(
                    "{}: best {:.1} GB/s (median {:.1})",
                    threads(b.threads),
                    b.best_bytes_per_second / 1e9,
                    b.median_bytes_per_second / 1e9
                )
            })
            .collect::<Vec<_>>()
            .join("; ")
    };
    let mut line = format!(
        "memcpy bandwidth (memory traffic, read + written, per second; a {} MiB buffer): {}.\n",
        results.bandwidth.first().map_or(0, |b| b.bytes >> 20),
        figures(&results.bandwidth)
    );
    if !results.read_bandwidth.is_empty() {
        let _ = write!(
            line,
            "\nRead bandwidth (bytes read per second; a {} MiB buffer, each thread's part read as {} prefetched streams and as one stream, the faster counted): {}.\n",
            results.read_bandwidth.first().map_or(0, |b| b.bytes >> 20),
            crate::bandwidth::READ_STREAMS,
            figures(&results.read_bandwidth)
        );
    }
    line
}

/// An error in a table cell: its first line, short, without pipes.
fn cell_text(error: &str) -> String {
    /// Longest error shown in a cell; the JSON has it whole.
    const MAX_CHARS: usize = 120;
    let line = error.lines().next().unwrap_or_default().replace('|', "/");
    if line.chars().count() > MAX_CHARS {
        format!("{}…", line.chars().take(MAX_CHARS).collect::<String>())
    } else {
        line
    }
}

fn fmt_percent(fraction: f64) -> String {
    if fraction.is_finite() {
        format!("{:.0}%", fraction * 100.0)
    } else {
        "—".into()
    }
}

/// The cost-floor table.
pub fn cost_table(results: &Results) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| Cost floor, $ per 1M generated tokens at ${:.2}/h (an assumed machine price) | agentstack | llama.cpp | agentstack / llama.cpp (below 1× is cheaper) |",
        results.plan.price_per_hour
    );
    let _ = writeln!(out, "|---|--:|--:|--:|");
    for c in &results.cost {
        let _ = writeln!(
            out,
            "| {} | ${} | ${} | {} |",
            c.basis,
            fmt_significant(c.agentstack_usd_per_million),
            fmt_significant(c.llamacpp_usd_per_million),
            fmt_ratio(c.ratio)
        );
    }
    out
}

fn fmt_rate(rate: &Rate) -> String {
    if rate.samples.len() < 2 {
        fmt_significant(rate.mean)
    } else {
        format!(
            "{} ± {}",
            fmt_significant(rate.mean),
            fmt_significant(rate.stddev)
        )
    }
}

fn fmt_ratio(ratio: f64) -> String {
    if ratio.is_finite() {
        format!("{ratio:.2}×")
    } else {
        "—".into()
    }
}

/// Three significant digits, no exponent; whole numbers from 100 up.
fn fmt_significant(x: f64) -> String {
    if !x.is_finite() {
        return "—".into();
    }
    let magnitude = if x == 0.0 {
        0
    } else {
        x.abs().log10().floor() as i32
    };
    let decimals = (2 - magnitude).clamp(0, 9) as usize;
    format!("{x:.decimals$}")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tolerance of the float comparisons below.
    const TOLERANCE: f64 = 1e-9;

    #[test]
    fn rate_is_mean_and_sample_stddev() {
        let rate = Rate::of(vec![2.0, 4.0, 6.0]);
        assert!((rate.mean - 4.0).abs() < TOLERANCE);
        assert!((rate.stddev - 2.0).abs() < TOLERANCE);
        assert!(Rate::of(vec![5.0]).stddev.abs() < TOLERANCE);
        assert!(Rate::of(Vec::new()).mean.abs() < TOLERANCE);
    }

    #[test]
    fn cost_floor_of_one_token_per_second_at_a_dollar_an_hour() {
        // 3600 tokens an hour for $1: a million cost 1e6 / 3600 dollars.
        assert!((usd_per_million(1.0, 1.0) - 1e6 / 3600.0).abs() < TOLERANCE);
        // The brief's example: $0.10/h at 100 tok/s.
        assert!((usd_per_million(0.10, 100.0) - 0.277_777_777_8).abs() < 1e-6);
    }

    #[test]
    fn numbers_print_with_three_significant_digits() {
        assert_eq!(fmt_significant(1234.4), "1234");
        assert_eq!(fmt_significant(123.45), "123");
        assert_eq!(fmt_significant(12.345), "12.3");
        assert_eq!(fmt_significant(0.012345), "0.0123");
        assert_eq!(fmt_significant(0.0), "0.00");
        assert_eq!(fmt_ratio(f64::NAN), "—");
        assert_eq!(fmt_ratio(0.5), "0.50×");
        assert_eq!(fmt_percent(0.856), "86%");
        assert_eq!(fmt_percent(f64::NAN), "—");
        assert_eq!(cell_text("cannot load: a | b\ncause"), "cannot load: a / b");
    }
}
