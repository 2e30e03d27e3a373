//! Turning measurements into the side-by-side markdown table.

use std::fmt::Write as _;
use std::time::Duration;

use crate::load::{Ramp, RampStop, StepRun, kib_to_mib};

/// One step phase, reduced to the figures the table shows.
#[derive(Debug, Clone, Copy)]
pub struct StepFigures {
    /// Steps per second over all sessions.
    pub steps_per_second: f64,
    /// Median step latency, ms.
    pub p50_ms: f64,
    /// 99th percentile step latency, ms.
    pub p99_ms: f64,
    /// Server CPU per step, µs.
    pub server_cpu_us: f64,
    /// Load generator CPU per step, µs.
    pub generator_cpu_us: f64,
}

#[expect(
    clippy::cast_precision_loss,
    reason = "step counts, ticks and nanoseconds here are far below 2^52"
)]
impl StepFigures {
    /// Figures of one run; `ticks_per_second` converts the CPU clock ticks.
    pub fn of(run: &StepRun, ticks_per_second: u64) -> Self {
        let mut latencies = run.latencies_ns.clone();
        latencies.sort_unstable();
        let steps = run.steps.max(1) as f64;
        let us_per_tick = 1e6 / ticks_per_second as f64;
        Self {
            steps_per_second: run.steps as f64 / run.wall.as_secs_f64(),
            p50_ms: percentile(&latencies, 0.50) as f64 / 1e6,
            p99_ms: percentile(&latencies, 0.99) as f64 / 1e6,
            server_cpu_us: run.server_cpu_ticks as f64 * us_per_tick / steps,
            generator_cpu_us: run.generator_cpu_ticks as f64 * us_per_tick / steps,
        }
    }

    /// Each figure's median over several runs (figure by figure).
    pub fn median(runs: &[Self]) -> Option<Self> {
        let field = |get: fn(&Self) -> f64| median(runs.iter().map(get).collect());
        Some(Self {
            steps_per_second: field(|f| f.steps_per_second)?,
            p50_ms: field(|f| f.p50_ms)?,
            p99_ms: field(|f| f.p99_ms)?,
            server_cpu_us: field(|f| f.server_cpu_us)?,
            generator_cpu_us: field(|f| f.generator_cpu_us)?,
        })
    }
}

/// Nearest-rank percentile of sorted values; 0 when empty.
fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss,
        reason = "a rank between 1 and len"
    )]
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

fn median(mut values: Vec<f64>) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    Some(if values.len() % 2 == 1 {
        values[mid]
    } else {
        f64::midpoint(values[mid - 1], values[mid])
    })
}

/// Everything measured on one server.
#[derive(Debug, Clone, Default)]
pub struct ServerResults {
    /// From spawn until `GET /health` answered 200.
    pub startup: Duration,
    /// RSS right after startup, KiB.
    pub idle_rss_kib: u64,
    /// Threads right after startup.
    pub idle_threads: u64,
    /// The one-session runs.
    pub single: Vec<StepFigures>,
    /// The many-session runs.
    pub multi: Vec<StepFigures>,
    /// The ramp of idle sessions, if it ran.
    pub ramp: Option<Ramp>,
    /// The cap the ramp had.
    pub ramp_cap: usize,
}

/// What the table's header says about the run.
#[derive(Debug, Clone, Copy)]
pub struct TableShape {
    /// Steps of the one-session phase.
    pub single_steps: usize,
    /// Sessions of the many-session phase.
    pub sessions: usize,
    /// Steps per session of the many-session phase.
    pub multi_steps: usize,
    /// Runs of each step phase.
    pub repeats: usize,
}

/// Which way a row's ratio goes, so that above 1 always means agentstack is better.
#[derive(Debug, Clone, Copy)]
enum Better {
    /// Higher is better: ratio = agentstack / reference.
    Higher,
    /// Lower is better: ratio = reference / agentstack.
    Lower,
    /// No ratio.
    Neither,
}

struct Row {
    metric: String,
    ours: Option<f64>,
    reference: Option<f64>,
    ours_text: String,
    reference_text: String,
    better: Better,
    ratio_override: Option<String>,
}

impl Row {
    fn figure(
        metric: impl Into<String>,
        ours: Option<f64>,
        reference: Option<f64>,
        format: fn(f64) -> String,
        better: Better,
    ) -> Self {
        Self {
            metric: metric.into(),
            ours,
            reference,
            ours_text: ours.map_or_else(|| "—".to_owned(), format),
            reference_text: reference.map_or_else(|| "—".to_owned(), format),
            better,
            ratio_override: None,
        }
    }

    fn ratio(&self) -> String {
        if let Some(text) = &self.ratio_override {
            return text.clone();
        }
        let (Some(ours), Some(reference)) = (self.ours, self.reference) else {
            return "—".to_owned();
        };
        let ratio = match self.better {
            Better::Higher => ours / reference,
            Better::Lower => reference / ours,
            Better::Neither => return "—".to_owned(),
        };
        format_ratio(ratio)
    }
}

fn format_ratio(ratio: f64) -> String {
    if !ratio.is_finite() {
        "—".to_owned()
    } else if ratio >= 10.0 {
        format!("{ratio:.0}×")
    } else {
        format!("{ratio:.1}×")
    }
}

fn thousands(value: f64) -> String {
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "rounded, non-negative counts and rates"
    )]
    let value = value.round().max(0.0) as u64;
    let digits = value.to_string();
    let mut out = String::new();
    for (i, digit) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(digit);
    }
    out
}

fn ms(value: f64) -> String {
    if value < 1.0 {
        format!("{value:.3} ms")
    } else {
        format!("{value:.2} ms")
    }
}

fn us(value: f64) -> String {
    format!("{value:.1} µs")
}

fn mib(value: f64) -> String {
    format!("{value:.1} MiB")
}

fn kib(value: f64) -> String {
    format!("{value:.1} KiB")
}

fn seconds(value: f64) -> String {
    if value < 1.0 {
        format!("{:.1} ms", value * 1e3)
    } else {
        format!("{value:.2} s")
    }
}

fn usize_f64(value: usize) -> f64 {
    #[expect(clippy::cast_precision_loss, reason = "session counts")]
    let value = value as f64;
    value
}

fn u64_f64(value: u64) -> f64 {
    #[expect(clippy::cast_precision_loss, reason = "thread counts")]
    let value = value as f64;
    value
}

/// The side-by-side markdown table.
pub fn table(
    shape: TableShape,
    ours: Option<&ServerResults>,
    reference: Option<&ServerResults>,
) -> String {
    let mut rows = Vec::new();
    let both =
        |get: &dyn Fn(&ServerResults) -> Option<f64>| (ours.and_then(get), reference.and_then(get));

    let (a, b) = both(&|r| Some(r.startup.as_secs_f64()));
    rows.push(Row::figure(
        "Startup until /health answers",
        a,
        b,
        seconds,
        Better::Lower,
    ));
    let (a, b) = both(&|r| Some(kib_to_mib(r.idle_rss_kib)));
    rows.push(Row::figure(
        "Idle RSS after startup",
        a,
        b,
        mib,
        Better::Lower,
    ));
    let (a, b) = both(&|r| Some(u64_f64(r.idle_threads)));
    rows.push(Row::figure(
        "Threads after startup",
        a,
        b,
        thousands,
        Better::Neither,
    ));

    let phases = [
        (
            format!("1 session × {} steps", shape.single_steps),
            (|r: &ServerResults| StepFigures::median(&r.single)) as fn(&ServerResults) -> _,
        ),
        (
            format!("{} sessions × {} steps", shape.sessions, shape.multi_steps),
            |r: &ServerResults| StepFigures::median(&r.multi),
        ),
    ];
    for (label, figures) in phases {
        let get = |pick: fn(&StepFigures) -> f64| {
            (
                ours.and_then(figures).map(|f| pick(&f)),
                reference.and_then(figures).map(|f| pick(&f)),
            )
        };
        let (a, b) = get(|f| f.steps_per_second);
        rows.push(Row::figure(
            format!("{label}: steps/s"),
            a,
            b,
            thousands,
            Better::Higher,
        ));
        let (a, b) = get(|f| f.p50_ms);
        rows.push(Row::figure(
            format!("{label}: p50 latency"),
            a,
            b,
            ms,
            Better::Lower,
        ));
        let (a, b) = get(|f| f.p99_ms);
        rows.push(Row::figure(
            format!("{label}: p99 latency"),
            a,
            b,
            ms,
            Better::Lower,
        ));
        let (a, b) = get(|f| f.server_cpu_us);
        rows.push(Row::figure(
            format!("{label}: server CPU per step"),
            a,
            b,
            us,
            Better::Lower,
        ));
        let (a, b) = get(|f| f.generator_cpu_us);
        rows.push(Row::figure(
            format!("{label}: load generator CPU per step"),
            a,
            b,
            us,
            Better::Neither,
        ));
    }

    let per_session = |r: &ServerResults| r.ramp.as_ref().and_then(Ramp::per_session_kib);
    let (a, b) = (ours.and_then(per_session), reference.and_then(per_session));
    let label = match (a, b) {
        (Some((_, x)), Some((_, y))) if x == y => format!("RSS per idle session ({x} held)"),
        (Some((_, x)), Some((_, y))) => format!("RSS per idle session ({x} / {y} held)"),
        (Some((_, x)), None) | (None, Some((_, x))) => format!("RSS per idle session ({x} held)"),
        (None, None) => "RSS per idle session".to_owned(),
    };
    rows.push(Row::figure(
        label,
        a.map(|p| p.0),
        b.map(|p| p.0),
        kib,
        Better::Lower,
    ));

    let held = |r: &ServerResults| r.ramp.as_ref().map(|ramp| usize_f64(ramp.max_held));
    let mut row = Row::figure(
        "Most sessions held at once",
        ours.and_then(held),
        reference.and_then(held),
        thousands,
        Better::Higher,
    );
    let describe = |r: &ServerResults| {
        r.ramp.as_ref().map(|ramp| {
            let why = match &ramp.stop {
                RampStop::Cap => format!("the cap, {}", thousands(usize_f64(r.ramp_cap))),
                RampStop::Failed(_) => "stopped: a session failed".to_owned(),
                RampStop::SessionsLost(n) => format!("stopped: {n} sessions dropped"),
                RampStop::TimeBudget(t) => format!("stopped: {}s budget", t.as_secs()),
            };
            (
                format!("{} ({why})", thousands(usize_f64(ramp.max_held))),
                matches!(ramp.stop, RampStop::Cap),
            )
        })
    };
    let (ours_held, reference_held) = (ours.and_then(describe), reference.and_then(describe));
    if let Some((text, _)) = &ours_held {
        row.ours_text.clone_from(text);
    }
    if let Some((text, _)) = &reference_held {
        row.reference_text.clone_from(text);
    }
    // A server that stopped at its cap could have held more, so its count is only
    // a lower bound; a ratio is exact only if neither hit a cap.
    row.ratio_override = match (&ours_held, &reference_held) {
        (Some((_, true)), Some((_, true))) => Some("— (both at cap)".to_owned()),
        (Some((_, true)), Some((_, false))) => Some(format!("≥ {}", row.ratio())),
        (Some((_, false)), Some((_, true))) => Some(format!("≤ {}", row.ratio())),
        _ => None,
    };
    rows.push(row);

    // RSS and ramp time compare only when both held the same number of sessions.
    let same_count = matches!(
        (ours.and_then(held), reference.and_then(held)),
        (Some(a), Some(b)) if a == b
    );
    let at_same_count = if same_count {
        Better::Lower
    } else {
        Better::Neither
    };
    let rss_at_max =
        |r: &ServerResults| r.ramp.as_ref().map(|ramp| kib_to_mib(ramp.rss_at_max_kib));
    rows.push(Row::figure(
        "RSS with that many sessions held",
        ours.and_then(rss_at_max),
        reference.and_then(rss_at_max),
        mib,
        at_same_count,
    ));
    let threads_at_max =
        |r: &ServerResults| r.ramp.as_ref().map(|ramp| u64_f64(ramp.threads_at_max));
    rows.push(Row::figure(
        "Threads with that many sessions held",
        ours.and_then(threads_at_max),
        reference.and_then(threads_at_max),
        thousands,
        Better::Neither,
    ));
    let ramp_time = |r: &ServerResults| r.ramp.as_ref().map(|ramp| ramp.elapsed.as_secs_f64());
    rows.push(Row::figure(
        "Time to open them (32 opening at once)",
        ours.and_then(ramp_time),
        reference.and_then(ramp_time),
        seconds,
        at_same_count,
    ));

    let mut out = String::new();
    let _ = writeln!(
        out,
        "| Metric (step figures: median of {} runs) | agentstack | OpenEnv 0.10.0 reference | agentstack advantage |",
        shape.repeats
    );
    out.push_str("|---|--:|--:|--:|\n");
    for row in &rows {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} |",
            row.metric,
            row.ours_text,
            row.reference_text,
            row.ratio()
        );
    }
    out.push_str(
        "\nAdvantage: agentstack / reference for steps/s and sessions held; reference / \
         agentstack for latency, CPU and memory. Above 1× means agentstack is better.\n",
    );
    out
}

/// Every run's step figures, one line each, so the spread behind the medians shows.
pub fn runs_table(
    shape: TableShape,
    ours: Option<&ServerResults>,
    reference: Option<&ServerResults>,
) -> String {
    let mut out = String::from(
        "| Server | Phase | Run | steps/s | p50 | p99 | server CPU/step | generator CPU/step |\n\
         |---|---|--:|--:|--:|--:|--:|--:|\n",
    );
    let servers = [("agentstack", ours), ("reference", reference)];
    for (name, results) in servers {
        let Some(results) = results else { continue };
        let phases = [
            (format!("1 × {}", shape.single_steps), &results.single),
            (
                format!("{} × {}", shape.sessions, shape.multi_steps),
                &results.multi,
            ),
        ];
        for (phase, runs) in phases {
            for (i, f) in runs.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "| {name} | {phase} | {} | {} | {} | {} | {} | {} |",
                    i + 1,
                    thousands(f.steps_per_second),
                    ms(f.p50_ms),
                    ms(f.p99_ms),
                    us(f.server_cpu_us),
                    us(f.generator_cpu_us)
                );
            }
        }
    }
    out
}

/// Why each ramp stopped, in full, for the notes under the table.
pub fn ramp_notes(ours: Option<&ServerResults>, reference: Option<&ServerResults>) -> String {
    let mut out = String::new();
    for (name, results) in [("agentstack", ours), ("reference", reference)] {
        let Some(ramp) = results.and_then(|r| r.ramp.as_ref()) else {
            continue;
        };
        let why = match &ramp.stop {
            RampStop::Cap => "reached its cap".to_owned(),
            RampStop::Failed(error) => format!("stopped at the first failure: `{error}`"),
            RampStop::SessionsLost(n) => format!("stopped: the server dropped {n} held sessions"),
            RampStop::TimeBudget(t) => format!("stopped: the {}s time budget ran out", t.as_secs()),
        };
        let _ = writeln!(
            out,
            "- {name} ramp: {why}; baseline RSS before the ramp {:.1} MiB.",
            kib_to_mib(ramp.baseline_rss_kib)
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let values: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&values, 0.50), 50);
        assert_eq!(percentile(&values, 0.99), 99);
        assert_eq!(percentile(&[7], 0.99), 7);
        assert_eq!(percentile(&[], 0.5), 0);
    }

    #[test]
    fn medians_of_odd_and_even_counts() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(vec![]), None);
    }

    #[test]
    fn thousands_separators() {
        assert_eq!(thousands(0.0), "0");
        assert_eq!(thousands(999.4), "999");
        assert_eq!(thousands(12_345.0), "12,345");
        assert_eq!(thousands(1_234_567.0), "1,234,567");
    }

    #[test]
    fn ratios_read_as_agentstack_advantage() {
        let throughput = Row::figure("x", Some(30.0), Some(10.0), thousands, Better::Higher);
        assert_eq!(throughput.ratio(), "3.0×");
        let memory = Row::figure("x", Some(2.0), Some(50.0), mib, Better::Lower);
        assert_eq!(memory.ratio(), "25×");
        let missing = Row::figure("x", None, Some(50.0), mib, Better::Lower);
        assert_eq!(missing.ratio(), "—");
    }
}
