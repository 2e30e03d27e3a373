//! `agentstack-bench-sandbox`: what isolation costs. The same command,
//! `/usr/bin/python3 -c 'print(1)'`, run four ways in one run, side by side:
//!
//! - **floor**: a plain subprocess (`std::process::Command`, spawn and wait);
//! - **agentstack cold**: `agentstack-sandbox` with no warm pool, so every run starts a
//!   fresh init process: start, isolate, run, tear down;
//! - **agentstack warm pool**: two sandboxes kept isolated and waiting; only `run` is
//!   timed, the pool refills between runs;
//! - **bubblewrap**: `bwrap --unshare-all ...` with a read-only `/usr`, the usual
//!   alternative.
//!
//! Latency (p50, p99, mean over `--runs` sequential runs each, the variants taking
//! turns in `--rounds` rounds) and throughput (runs/s with K concurrent workers, the
//! warm pool and the concurrency limit both K) are reported against the floor. The
//! issue's goal: agentstack's p50 at most 2× the floor's. See bench/README.md.
//!
//! ```text
//! cargo run --release -p agentstack-bench-sandbox -- --runs 1000
//! ```

use std::fmt::Write as _;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use agentstack_bench_support::machine::{self, Machine};
use agentstack_bench_support::report::{publish, version_of};
use agentstack_bench_support::stats::{self, Stats};
use agentstack_sandbox::{Job, Outcome, Sandbox, SandboxConfig};
use anyhow::{Context, bail, ensure};
use clap::Parser;
use indicatif::ProgressBar;
use serde_json::{Value, json};

/// The interpreter every variant runs.
const PYTHON: &str = "/usr/bin/python3";
/// Its program.
const SCRIPT: &str = "print(1)";
/// What every run must print.
const EXPECTED: &[u8] = b"1\n";
/// `PATH` inside the sandbox, given to every variant.
const SANDBOX_PATH: &str = "/usr/local/bin:/usr/bin:/bin";
/// The longest the warm pool may take to refill before the benchmark gives up.
const REFILL_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Parser)]
#[command(about = "Sandboxed run latency and throughput vs a plain subprocess and bubblewrap")]
struct Args {
    /// Timed sequential runs of each variant.
    #[arg(long, default_value_t = 1000)]
    runs: usize,
    /// Jobs per throughput measurement.
    #[arg(long, default_value_t = 400)]
    throughput_runs: usize,
    /// Concurrency levels of the throughput phase (workers, warm pool and concurrency
    /// limit all equal to it).
    #[arg(long, value_delimiter = ',', default_value = "2,8")]
    concurrency: Vec<usize>,
    /// Untimed runs of each variant before it is measured.
    #[arg(long, default_value_t = 20)]
    warmup: usize,
    /// The latency runs are split into this many rounds; in each, every variant takes
    /// its turn, so that background load falls on all alike.
    #[arg(long, default_value_t = 10)]
    rounds: usize,
    /// bubblewrap; skipped with a note when it is not there.
    #[arg(long, default_value = "/usr/bin/bwrap")]
    bwrap: PathBuf,
    /// Write every figure (and every latency sample) as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Append a section to this Markdown file.
    #[arg(long)]
    write_results: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    // The sandbox's init process is this executable started again: it must take over
    // before anything else, above all before the runtime starts threads.
    agentstack_sandbox::run_if_init();
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    // Sandboxes (their `kill_on_drop` children) are dropped outside `block_on` too.
    let _context = runtime.enter();
    let scratch = Scratch::new()?;
    let result = bench(&args, &runtime, &scratch.0);
    drop(scratch);
    result
}

fn bench(args: &Args, rt: &tokio::runtime::Runtime, scratch: &Path) -> anyhow::Result<()> {
    ensure!(args.runs >= 1, "--runs must be at least 1");
    ensure!(
        args.throughput_runs >= 1,
        "--throughput-runs must be at least 1"
    );
    ensure!(
        args.concurrency.iter().all(|&k| k >= 1),
        "every --concurrency must be at least 1"
    );
    ensure!(
        Path::new(PYTHON).exists(),
        "{PYTHON} is not there; every variant runs it"
    );
    let load_start = machine::load_average().unwrap_or_default();
    let python_version = version_of(Path::new(PYTHON));
    let bwrap = Bwrap::find(&args.bwrap, scratch);
    match &bwrap {
        Ok(b) => eprintln!("bubblewrap: {}", b.shown()),
        Err(note) => eprintln!("bubblewrap skipped: {note}"),
    }
    let job = {
        let mut job = Job::new([PYTHON, "-c", SCRIPT]);
        job.limits.wall = Duration::from_secs(30);
        job
    };

    // Latency: sequential runs, the variants taking turns.
    let cold = rt
        .block_on(Sandbox::start(SandboxConfig {
            warm: 0,
            max_concurrent: 1,
            ..SandboxConfig::default()
        }))
        .context("starting the sandbox (cold)")?;
    let warm = rt
        .block_on(Sandbox::start(SandboxConfig {
            warm: 2,
            max_concurrent: 1,
            ..SandboxConfig::default()
        }))
        .context("starting the sandbox (warm pool)")?;
    let mut variants = vec![
        Variant::new(
            "floor",
            "plain subprocess (floor)",
            Runner::Plain(plain_command(scratch)),
        ),
        Variant::new(
            "agentstack_cold",
            "agentstack, cold (start + isolate + run + teardown)",
            Runner::Sandbox {
                sandbox: cold,
                warm: 0,
            },
        ),
        Variant::new(
            "agentstack_warm",
            "agentstack, warm pool of 2",
            Runner::Sandbox {
                sandbox: warm,
                warm: 2,
            },
        ),
    ];
    if let Ok(b) = &bwrap {
        variants.push(Variant::new(
            "bwrap",
            "bubblewrap",
            Runner::Plain(b.command()),
        ));
    }
    let rounds = args.rounds.clamp(1, args.runs);
    let total = variants.len() * (args.warmup + args.runs);
    let bar = progress(total, "latency: warm-up");
    for variant in &mut variants {
        bar.set_message(format!("latency: warm-up, {}", variant.key));
        for _ in 0..args.warmup {
            variant.run_once(rt, &job)?;
            bar.inc(1);
        }
        variant.settle(rt)?;
    }
    for round in 0..rounds {
        let count = args.runs / rounds + usize::from(round < args.runs % rounds);
        // Each round starts with another variant.
        let n = variants.len();
        for i in 0..n {
            let variant = &mut variants[(i + round) % n];
            bar.set_message(format!(
                "latency: round {}/{rounds}, {}",
                round + 1,
                variant.key
            ));
            for _ in 0..count {
                let (took, inside) = variant.run_once(rt, &job)?;
                variant.samples_ms.push(took.as_secs_f64() * 1e3);
                variant
                    .inside_ms
                    .extend(inside.map(|d| d.as_secs_f64() * 1e3));
                bar.inc(1);
            }
            variant.settle(rt)?;
        }
    }
    bar.finish_and_clear();
    let latency: Vec<Latency> = variants
        .into_iter()
        .map(|v| Latency {
            key: v.key,
            label: v.label,
            stats: Stats::of(&v.samples_ms),
            inside: (!v.inside_ms.is_empty()).then(|| Stats::of(&v.inside_ms)),
            samples_ms: v.samples_ms,
        })
        .collect();
    for l in &latency {
        eprintln!(
            "{:<52} p50 {:>7.2} ms  p99 {:>7.2} ms  mean {:>7.2} ms",
            l.label, l.stats.p50, l.stats.p99, l.stats.mean
        );
    }

    // Throughput: K workers at once.
    let sides = 2 + usize::from(bwrap.is_ok());
    let bar = progress(
        args.concurrency.len() * sides * args.throughput_runs,
        "throughput",
    );
    let mut throughput = Vec::new();
    for &k in &args.concurrency {
        let m = args.throughput_runs;
        bar.set_message(format!("throughput: {k} at once, floor"));
        let floor = rt.block_on(throughput_plain(
            plain_command(scratch),
            k,
            m,
            args.warmup,
            &bar,
        ))?;
        throughput.push(Throughput::new(
            "floor",
            "plain subprocess (floor)",
            k,
            m,
            floor,
        ));
        bar.set_message(format!("throughput: {k} at once, agentstack"));
        let ours = rt.block_on(throughput_sandbox(&job, k, m, args.warmup, &bar))?;
        throughput.push(Throughput::new(
            "agentstack_warm",
            &format!("agentstack, warm pool of {k}"),
            k,
            m,
            ours,
        ));
        if let Ok(b) = &bwrap {
            bar.set_message(format!("throughput: {k} at once, bubblewrap"));
            let theirs = rt.block_on(throughput_plain(b.command(), k, m, args.warmup, &bar))?;
            throughput.push(Throughput::new("bwrap", "bubblewrap", k, m, theirs));
        }
        for t in throughput.iter().filter(|t| t.concurrency == k) {
            bar.suspend(|| {
                eprintln!(
                    "{:<52} {k} at once: {:>7.1} runs/s",
                    t.label,
                    t.runs_per_s()
                );
            });
        }
    }
    bar.finish_and_clear();

    let load_end = machine::load_average().unwrap_or_default();
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let machine = Machine::here(load_start, load_end);
    let report = Report {
        command,
        machine,
        python: python_version,
        bwrap: bwrap.as_ref().map(Bwrap::shown).map_err(String::clone),
        bwrap_version: bwrap.as_ref().ok().map(|b| version_of(&b.program)),
        runs: args.runs,
        warmup: args.warmup,
        rounds,
        latency,
        throughput,
    };
    let section = report.markdown();
    publish(
        &section,
        args.json.as_deref(),
        || report.json(),
        args.write_results.as_deref(),
    )
}

/// An empty directory on the host: the plain subprocess's working directory and home,
/// as `/work` is the sandbox's.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> anyhow::Result<Self> {
        let dir =
            std::env::temp_dir().join(format!("agentstack-bench-sandbox-{}", std::process::id()));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Self(dir))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The environment the sandbox gives its command (`HOME` its scratch directory), so
/// that Python starts the same way everywhere.
fn sandbox_env(home: &str) -> [(&'static str, String); 5] {
    [
        ("PATH", SANDBOX_PATH.to_owned()),
        ("HOME", home.to_owned()),
        ("TMPDIR", format!("{home}/.tmp")),
        ("LANG", "C.UTF-8".to_owned()),
        ("PYTHONDONTWRITEBYTECODE", "1".to_owned()),
    ]
}

/// A program and its arguments, run without isolation by the bench (the floor, or
/// bubblewrap, which isolates by itself).
#[derive(Clone)]
struct PlainCommand {
    program: PathBuf,
    args: Vec<String>,
    env: Vec<(&'static str, String)>,
    dir: PathBuf,
}

impl PlainCommand {
    fn std(&self) -> Command {
        let mut command = Command::new(&self.program);
        command
            .args(&self.args)
            .env_clear()
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        command
    }

    fn tokio(&self) -> tokio::process::Command {
        tokio::process::Command::from(self.std())
    }

    fn shown(&self) -> String {
        std::iter::once(self.program.display().to_string())
            .chain(self.args.iter().map(|a| shell_quote(a)))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

fn plain_command(scratch: &Path) -> PlainCommand {
    PlainCommand {
        program: PathBuf::from(PYTHON),
        args: vec!["-c".into(), SCRIPT.into()],
        env: sandbox_env(&scratch.to_string_lossy()).to_vec(),
        dir: scratch.to_owned(),
    }
}

/// bubblewrap, found and checked.
struct Bwrap {
    program: PathBuf,
    args: Vec<String>,
    scratch: PathBuf,
}

impl Bwrap {
    /// The issue's command: every namespace, a read-only `/usr`, the top-level
    /// directories that are links into `/usr` (`/bin -> usr/bin` on Debian 12) made the
    /// same links (real directories bound read-only instead), `/proc`, `/dev`, a tmpfs
    /// `/work` to start in, uid and gid 1000. Fails with a note when bubblewrap is not
    /// there or does not run `print(1)`.
    fn find(program: &Path, scratch: &Path) -> Result<Self, String> {
        if !program.exists() {
            return Err(format!("{} is not there", program.display()));
        }
        let mut args: Vec<String> = [
            "--unshare-all",
            "--die-with-parent",
            "--new-session",
            "--ro-bind",
            "/usr",
            "/usr",
        ]
        .map(String::from)
        .to_vec();
        for name in ["bin", "lib", "lib64", "sbin", "lib32", "libx32"] {
            let path = format!("/{name}");
            match std::fs::symlink_metadata(&path) {
                Ok(meta) if meta.file_type().is_symlink() => {
                    let target = std::fs::read_link(&path).map_err(|e| format!("{path}: {e}"))?;
                    args.extend([
                        "--symlink".into(),
                        target.to_string_lossy().into_owned(),
                        path,
                    ]);
                }
                Ok(meta) if meta.is_dir() => args.extend(["--ro-bind".into(), path.clone(), path]),
                _ => {}
            }
        }
        args.extend(
            [
                "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/work", "--chdir", "/work",
                "--uid", "1000", "--gid", "1000", PYTHON, "-c", SCRIPT,
            ]
            .map(String::from),
        );
        let bwrap = Self {
            program: program.to_owned(),
            args,
            scratch: scratch.to_owned(),
        };
        let output = bwrap
            .command()
            .std()
            .output()
            .map_err(|e| format!("could not start {}: {e}", program.display()))?;
        if let Err(e) = check_output(&output) {
            return Err(format!("a trial run failed: {e:#}"));
        }
        Ok(bwrap)
    }

    fn command(&self) -> PlainCommand {
        PlainCommand {
            program: self.program.clone(),
            args: self.args.clone(),
            env: sandbox_env("/work").to_vec(),
            dir: self.scratch.clone(),
        }
    }

    fn shown(&self) -> String {
        self.command().shown()
    }
}

fn shell_quote(arg: &str) -> String {
    if !arg.is_empty()
        && arg
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._-=:,".contains(c))
    {
        arg.to_owned()
    } else {
        format!("'{}'", arg.replace('\'', r"'\''"))
    }
}

fn check_output(output: &Output) -> anyhow::Result<()> {
    ensure!(
        output.status.success() && output.stdout == EXPECTED,
        "expected exit 0 and {:?} on stdout, got {} and stdout {:?}, stderr {:?}",
        String::from_utf8_lossy(EXPECTED),
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(())
}

fn check_outcome(outcome: &Outcome) -> anyhow::Result<()> {
    ensure!(
        outcome.end.success() && outcome.stdout == EXPECTED,
        "expected exit 0 and {:?} on stdout; the sandboxed run {} with stdout {:?}, stderr {:?}",
        String::from_utf8_lossy(EXPECTED),
        outcome.end,
        outcome.stdout_text(),
        outcome.stderr_text()
    );
    Ok(())
}

/// Waits (untimed) until the pool holds `warm` sandboxes again.
async fn pool_full(sandbox: &Sandbox, warm: usize) -> anyhow::Result<()> {
    let deadline = Instant::now() + REFILL_TIMEOUT;
    while sandbox.warm_now() < warm {
        if Instant::now() > deadline {
            bail!(
                "the warm pool did not refill to {warm} within {REFILL_TIMEOUT:?} (it holds {})",
                sandbox.warm_now()
            );
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Ok(())
}

enum Runner {
    /// Spawned and waited for by `std::process`.
    Plain(PlainCommand),
    /// `Sandbox::run`, after waiting for the pool to hold `warm` sandboxes.
    Sandbox { sandbox: Sandbox, warm: usize },
}

/// One row of the latency table while it is measured.
struct Variant {
    key: &'static str,
    label: String,
    runner: Runner,
    samples_ms: Vec<f64>,
    /// The sandbox's own measure of each run, fork to the command's end.
    inside_ms: Vec<f64>,
}

impl Variant {
    fn new(key: &'static str, label: &str, runner: Runner) -> Self {
        Self {
            key,
            label: label.to_owned(),
            runner,
            samples_ms: Vec::new(),
            inside_ms: Vec::new(),
        }
    }

    /// Waits until a warm pool is full again, so that its refilling does not load the
    /// next variant's runs.
    fn settle(&self, rt: &tokio::runtime::Runtime) -> anyhow::Result<()> {
        match &self.runner {
            Runner::Plain(_) => Ok(()),
            Runner::Sandbox { sandbox, warm } => rt.block_on(pool_full(sandbox, *warm)),
        }
    }

    /// One run, checked; returns the time it took and, in a sandbox, the time from
    /// the command's fork to its end as the sandbox measured it.
    fn run_once(
        &self,
        rt: &tokio::runtime::Runtime,
        job: &Job,
    ) -> anyhow::Result<(Duration, Option<Duration>)> {
        match &self.runner {
            Runner::Plain(command) => {
                let start = Instant::now();
                let output = command
                    .std()
                    .spawn()
                    .with_context(|| format!("starting {}", command.program.display()))?
                    .wait_with_output()?;
                let took = start.elapsed();
                check_output(&output).with_context(|| self.label.clone())?;
                Ok((took, None))
            }
            Runner::Sandbox { sandbox, warm } => rt.block_on(async {
                pool_full(sandbox, *warm).await?;
                let start = Instant::now();
                let outcome = sandbox.run(job).await;
                let took = start.elapsed();
                let outcome = outcome?;
                check_outcome(&outcome).with_context(|| self.label.clone())?;
                Ok((took, Some(outcome.usage.wall)))
            }),
        }
    }
}

/// Runs `total` jobs as `k` workers; returns the wall time.
async fn workers<F, Fut>(
    k: usize,
    total: usize,
    bar: &ProgressBar,
    job: F,
) -> anyhow::Result<Duration>
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let job = Arc::new(job);
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..k {
        let (job, next, bar) = (Arc::clone(&job), Arc::clone(&next), bar.clone());
        set.spawn(async move {
            while next.fetch_add(1, Ordering::Relaxed) < total {
                job().await?;
                bar.inc(1);
            }
            Ok::<_, anyhow::Error>(())
        });
    }
    while let Some(joined) = set.join_next().await {
        joined.context("a worker panicked")??;
    }
    Ok(start.elapsed())
}

/// Throughput of a plain command (`tokio::process`) with `k` at once.
async fn throughput_plain(
    command: PlainCommand,
    k: usize,
    m: usize,
    warmup: usize,
    bar: &ProgressBar,
) -> anyhow::Result<Duration> {
    let command = Arc::new(command);
    let one = move || {
        let command = Arc::clone(&command);
        async move {
            let output = command
                .tokio()
                .output()
                .await
                .with_context(|| format!("running {}", command.program.display()))?;
            check_output(&output)
        }
    };
    workers(k, warmup, &ProgressBar::hidden(), one.clone()).await?;
    workers(k, m, bar, one).await
}

/// Throughput of a sandbox with a warm pool of `k` and `k` at once.
async fn throughput_sandbox(
    job: &Job,
    k: usize,
    m: usize,
    warmup: usize,
    bar: &ProgressBar,
) -> anyhow::Result<Duration> {
    let sandbox = Sandbox::start(SandboxConfig {
        warm: k,
        max_concurrent: k,
        ..SandboxConfig::default()
    })
    .await
    .with_context(|| format!("starting the sandbox (warm pool of {k})"))?;
    let job = Arc::new(job.clone());
    let one = {
        let sandbox = sandbox.clone();
        move || {
            let (sandbox, job) = (sandbox.clone(), Arc::clone(&job));
            async move { check_outcome(&sandbox.run(&job).await?) }
        }
    };
    pool_full(&sandbox, k).await?;
    workers(k, warmup, &ProgressBar::hidden(), one.clone()).await?;
    // Every measurement starts with a full pool.
    pool_full(&sandbox, k).await?;
    let wall = workers(k, m, bar, one).await?;
    // The refill runs on after the last job; let it end before the next measurement.
    pool_full(&sandbox, k).await?;
    Ok(wall)
}

fn progress(total: usize, message: &str) -> ProgressBar {
    stats::progress(total, "{msg:48} [{bar:30}] {pos}/{len} {elapsed}", message)
}

struct Latency {
    key: &'static str,
    label: String,
    stats: Stats,
    /// For a sandbox, its own measure: fork to the command's end.
    inside: Option<Stats>,
    samples_ms: Vec<f64>,
}

struct Throughput {
    key: &'static str,
    label: String,
    concurrency: usize,
    runs: usize,
    wall: Duration,
}

impl Throughput {
    fn new(
        key: &'static str,
        label: &str,
        concurrency: usize,
        runs: usize,
        wall: Duration,
    ) -> Self {
        Self {
            key,
            label: label.to_owned(),
            concurrency,
            runs,
            wall,
        }
    }

    fn runs_per_s(&self) -> f64 {
        self.runs as f64 / self.wall.as_secs_f64()
    }
}

struct Report {
    command: String,
    machine: Machine,
    python: String,
    bwrap: Result<String, String>,
    bwrap_version: Option<String>,
    runs: usize,
    warmup: usize,
    rounds: usize,
    latency: Vec<Latency>,
    throughput: Vec<Throughput>,
}

impl Report {
    fn floor_p50(&self) -> f64 {
        self.latency
            .iter()
            .find(|l| l.key == "floor")
            .map_or(f64::NAN, |l| l.stats.p50)
    }

    fn floor_runs_per_s(&self, k: usize) -> f64 {
        self.throughput
            .iter()
            .find(|t| t.key == "floor" && t.concurrency == k)
            .map_or(f64::NAN, Throughput::runs_per_s)
    }

    fn markdown(&self) -> String {
        let m = &self.machine;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "\n## sandbox: `python3 -c 'print(1)'` isolated vs a plain subprocess, {}\n",
            m.date
        );
        let _ = writeln!(
            s,
            "- Command: `{}`; load average {} at start, {} at end.",
            self.command, m.load_start, m.load_end
        );
        let _ = writeln!(
            s,
            "- Machine: {} CPUs ({}), Linux {}; {} ({PYTHON}).",
            m.cpus, m.cpu_model, m.kernel, self.python
        );
        match (&self.bwrap, &self.bwrap_version) {
            (Ok(command), version) => {
                let _ = writeln!(
                    s,
                    "- bubblewrap ({}): `{command}`.",
                    version.as_deref().unwrap_or("version unknown")
                );
            }
            (Err(note), _) => {
                let _ = writeln!(s, "- bubblewrap skipped: {note}.");
            }
        }
        let _ = writeln!(
            s,
            "- Latency: {} sequential runs per variant after {} untimed, the variants taking turns in {} rounds; every run checked to print `1`. Nearest-rank percentiles. The warm pool is refilled (untimed) before each run. Inside p50: the sandbox's own measure of the run, from the command's fork to its end (`Outcome::usage.wall`); the rest of its time is the host's side (sending the job, isolation when cold, the report, teardown).\n",
            self.runs, self.warmup, self.rounds
        );
        let _ = writeln!(
            s,
            "| variant | runs | p50 ms | p99 ms | mean ms | p50 vs floor | inside p50 ms |\n|:--|--:|--:|--:|--:|--:|--:|"
        );
        let floor = self.floor_p50();
        for l in &self.latency {
            let _ = writeln!(
                s,
                "| {} | {} | {:.2} | {:.2} | {:.2} | {:.2}× | {} |",
                l.label,
                l.stats.n,
                l.stats.p50,
                l.stats.p99,
                l.stats.mean,
                l.stats.p50 / floor,
                l.inside.map_or("–".to_owned(), |i| format!("{:.2}", i.p50))
            );
        }
        let goal: Vec<String> = self
            .latency
            .iter()
            .filter(|l| l.key.starts_with("agentstack"))
            .map(|l| {
                let ratio = l.stats.p50 / floor;
                format!(
                    "{} {ratio:.2}× ({})",
                    l.key.trim_start_matches("agentstack_"),
                    if ratio <= 2.0 { "met" } else { "not met" }
                )
            })
            .collect();
        let _ = writeln!(
            s,
            "\nGoal, agentstack's p50 ≤ 2× the floor's: {}.\n",
            goal.join(", ")
        );
        let _ = writeln!(
            s,
            "Throughput: K workers at once, each running the next job as soon as its last one ended; agentstack with a warm pool of K and at most K at once (full before the first job); {} untimed jobs first.\n",
            self.warmup
        );
        let _ = writeln!(
            s,
            "| variant | at once | jobs | wall s | runs/s | vs floor |\n|:--|--:|--:|--:|--:|--:|"
        );
        for t in &self.throughput {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {:.2} | {:.1} | {:.2}× |",
                t.label,
                t.concurrency,
                t.runs,
                t.wall.as_secs_f64(),
                t.runs_per_s(),
                t.runs_per_s() / self.floor_runs_per_s(t.concurrency)
            );
        }
        s
    }

    fn json(&self) -> Value {
        let m = &self.machine;
        let floor = self.floor_p50();
        json!({
            "command": self.command,
            "date": m.date,
            "machine": {
                "cpus": m.cpus,
                "cpu_model": m.cpu_model,
                "kernel": m.kernel,
                "load_average_start": m.load_start,
                "load_average_end": m.load_end,
            },
            "python": self.python,
            "program": [PYTHON, "-c", SCRIPT],
            "bwrap": match &self.bwrap {
                Ok(command) => json!({"command": command, "version": self.bwrap_version}),
                Err(note) => json!({"skipped": note}),
            },
            "runs": self.runs,
            "warmup": self.warmup,
            "rounds": self.rounds,
            "latency": self.latency.iter().map(|l| json!({
                "variant": l.key,
                "label": l.label,
                "runs": l.stats.n,
                "p50_ms": l.stats.p50,
                "p99_ms": l.stats.p99,
                "mean_ms": l.stats.mean,
                "min_ms": l.stats.min,
                "max_ms": l.stats.max,
                "p50_vs_floor": l.stats.p50 / floor,
                "inside_p50_ms": l.inside.map(|i| i.p50),
                "inside_p99_ms": l.inside.map(|i| i.p99),
                "samples_ms": l.samples_ms,
            })).collect::<Vec<_>>(),
            "throughput": self.throughput.iter().map(|t| json!({
                "variant": t.key,
                "label": t.label,
                "concurrency": t.concurrency,
                "runs": t.runs,
                "wall_s": t.wall.as_secs_f64(),
                "runs_per_s": t.runs_per_s(),
                "vs_floor": t.runs_per_s() / self.floor_runs_per_s(t.concurrency),
            })).collect::<Vec<_>>(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_are_quoted_for_the_shell() {
        assert_eq!(shell_quote("/usr/bin/python3"), "/usr/bin/python3");
        assert_eq!(shell_quote("print(1)"), "'print(1)'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
    }
}
