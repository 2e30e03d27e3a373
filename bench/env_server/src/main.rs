//! Side-by-side load benchmark of two OpenEnv servers serving the same trivial echo
//! environment, in one run on one machine: `agentstack env serve echo` and the
//! OpenEnv 0.10.0 reference server (`create_app` under uvicorn, see
//! `reference_server.py`).
//!
//! Both servers are children of this process. It drives them over the raw OpenEnv
//! `/ws` protocol and reads their CPU time and memory from `/proc`, then prints a
//! markdown table with ratios, and with `--write-results` appends it, with the
//! machine, date and command, to `bench/RESULTS.md`. See `bench/README.md`.

mod load;
mod procfs;
mod report;
mod servers;

use std::fmt::Write as _;
use std::fs::OpenOptions;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use agentstack_bench_support::machine;
use agentstack_bench_support::report::command_line;
use agentstack_static::env_vars;
use anyhow::{Context, Result, bail};
use clap::Parser;
use nix::sys::resource::{Resource, getrlimit, setrlimit};
use tokio::process::Command;
use tokio::time::{sleep, timeout};

use load::{RampPlan, kib_to_mib};
use report::{ServerResults, StepFigures, TableShape};
use servers::{ServerKind, ServerProcess};

/// `--max-sessions` given to agentstack, at least: the brief's fixed value.
const AGENTSTACK_MAX_SESSIONS: usize = 20_000;
/// Sessions the servers allow beyond the ramp's cap, so that the ramp's cap, not
/// the server's, is what stops it, even while closed sessions are being torn down.
const SESSION_HEADROOM: usize = 64;
/// Pause after startup before reading the idle RSS.
const IDLE_SETTLE: Duration = Duration::from_secs(2);
/// Longest `--version`-style queries may take.
const VERSION_QUERY_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Parser)]
#[command(
    name = "agentstack-bench-env-server",
    about = "Benchmark agentstack's env server against the OpenEnv 0.10.0 reference server, side by side"
)]
struct Args {
    /// The agentstack binary to serve `echo` with.
    #[arg(long, default_value = "target/release/agentstack")]
    agentstack_bin: PathBuf,
    /// Python with openenv==0.10.0 installed
    /// [default: ~/.cache/agentstack/venv-openenv-0.10.0/bin/python].
    #[arg(long)]
    python: Option<PathBuf>,
    /// The reference server script [default: reference_server.py beside this crate's Cargo.toml].
    #[arg(long)]
    reference_script: Option<PathBuf>,
    /// Smaller counts, for a smoke run of a minute or two.
    #[arg(long)]
    quick: bool,
    /// Append the results, with date, machine and command, to this markdown file.
    #[arg(long, value_name = "PATH")]
    write_results: Option<PathBuf>,
    /// Servers to run.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "agentstack,reference"
    )]
    servers: Vec<ServerKind>,
    /// Steps of the one-session phase [default: 20000; quick: 300].
    #[arg(long)]
    single_steps: Option<usize>,
    /// Sessions of the many-session phase [default: 32].
    #[arg(long)]
    sessions: Option<usize>,
    /// Steps per session of the many-session phase [default: 1000; quick: 30].
    #[arg(long)]
    multi_steps: Option<usize>,
    /// Runs of each step phase per server; the table shows medians [default: 3; quick: 1].
    #[arg(long)]
    repeats: Option<usize>,
    /// Idle sessions over which RSS per session is measured [default: 1000; quick: 100].
    #[arg(long)]
    idle_sessions: Option<usize>,
    /// Most sessions the ramp opens on agentstack [default: 10000; quick: 500].
    #[arg(long)]
    agentstack_max_sessions: Option<usize>,
    /// Most sessions the ramp opens on the reference [default: 10000; quick: 500].
    #[arg(long)]
    reference_max_sessions: Option<usize>,
    /// Time budget of each server's ramp, seconds [default: 180; quick: 60].
    #[arg(long)]
    ramp_seconds: Option<u64>,
    /// Worker threads of the load generator's runtime.
    #[arg(long, default_value_t = 2)]
    worker_threads: usize,
    /// How long each server may take to answer `GET /health`, seconds.
    #[arg(long, default_value_t = 120)]
    startup_timeout: u64,
}

/// The counts of one run, from `--quick` or the full profile, then the flags.
#[derive(Debug, Clone, Copy)]
struct Plan {
    warmup_steps: usize,
    single_steps: usize,
    sessions: usize,
    multi_steps: usize,
    repeats: usize,
    idle_sessions: usize,
    agentstack_cap: usize,
    reference_cap: usize,
    ramp_batch: usize,
    ramp_budget: Duration,
}

impl Plan {
    fn resolve(args: &Args) -> Result<Self> {
        let base = if args.quick {
            Self {
                warmup_steps: 50,
                single_steps: 300,
                sessions: 32,
                multi_steps: 30,
                repeats: 1,
                idle_sessions: 100,
                agentstack_cap: 500,
                reference_cap: 500,
                ramp_batch: 100,
                ramp_budget: Duration::from_secs(60),
            }
        } else {
            Self {
                warmup_steps: 200,
                single_steps: 20_000,
                sessions: 32,
                multi_steps: 1_000,
                repeats: 3,
                idle_sessions: 1_000,
                agentstack_cap: 10_000,
                // The same cap as agentstack's: the reference holds 10,000 idle
                // sessions on this kind of machine (one OS thread each), so equal caps
                // compare memory and ramp time at the same count.
                reference_cap: 10_000,
                ramp_batch: 250,
                ramp_budget: Duration::from_secs(180),
            }
        };
        let plan = Self {
            single_steps: args.single_steps.unwrap_or(base.single_steps),
            sessions: args.sessions.unwrap_or(base.sessions),
            multi_steps: args.multi_steps.unwrap_or(base.multi_steps),
            repeats: args.repeats.unwrap_or(base.repeats),
            idle_sessions: args.idle_sessions.unwrap_or(base.idle_sessions),
            agentstack_cap: args.agentstack_max_sessions.unwrap_or(base.agentstack_cap),
            reference_cap: args.reference_max_sessions.unwrap_or(base.reference_cap),
            ramp_budget: args
                .ramp_seconds
                .map_or(base.ramp_budget, Duration::from_secs),
            ..base
        };
        if plan.single_steps == 0 || plan.sessions == 0 || plan.multi_steps == 0 {
            bail!("--single-steps, --sessions and --multi-steps must be at least 1");
        }
        if plan.repeats == 0 {
            bail!("--repeats must be at least 1");
        }
        Ok(plan)
    }

    fn cap(&self, kind: ServerKind) -> usize {
        match kind {
            ServerKind::Agentstack => self.agentstack_cap,
            ServerKind::Reference => self.reference_cap,
        }
    }

    fn shape(&self) -> TableShape {
        TableShape {
            single_steps: self.single_steps,
            sessions: self.sessions,
            multi_steps: self.multi_steps,
            repeats: self.repeats,
        }
    }
}

/// A server under test and what has been measured on it.
struct Contender {
    server: ServerProcess,
    results: ServerResults,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.worker_threads.max(1))
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the tokio runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<()> {
    let plan = Plan::resolve(&args)?;
    let machine = procfs::Machine::read();
    let (ticks_per_second, ticks_from_sysconf) = procfs::clock_ticks_per_second();
    let command_line = command_line();
    let nofile = raise_nofile_limit(&plan)?;

    let mut selected = args.servers.clone();
    selected.dedup();
    let python = args.python.clone().unwrap_or_else(default_python);
    let script = args
        .reference_script
        .clone()
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("reference_server.py"));
    if selected.contains(&ServerKind::Agentstack) && !args.agentstack_bin.is_file() {
        bail!(
            "{} does not exist\nhint: build it with `cargo build --release -p agentstack`, or pass --agentstack-bin",
            args.agentstack_bin.display()
        );
    }
    if selected.contains(&ServerKind::Reference) && !python.is_file() {
        bail!(
            "{} does not exist\nhint: pass --python with a Python that has openenv==0.10.0 installed",
            python.display()
        );
    }
    let versions = versions(&selected, &args.agentstack_bin, &python).await;

    let log_dir = std::env::temp_dir().join(format!(
        "agentstack-bench-env-server-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&log_dir).with_context(|| format!("creating {}", log_dir.display()))?;
    eprintln!(
        "servers' stderr goes to {}; RLIMIT_NOFILE {}/{}",
        log_dir.display(),
        nofile.0,
        nofile.1
    );

    // Both servers run the whole time, and the step phases alternate between
    // them, so that the machine's background load falls on both alike.
    let startup_timeout = Duration::from_secs(args.startup_timeout);
    let mut contenders = Vec::new();
    for &kind in &selected {
        let cap = plan.cap(kind);
        let command = match kind {
            ServerKind::Agentstack => {
                let mut command = Command::new(&args.agentstack_bin);
                command.args(["env", "serve", "echo", "--port", "0", "--max-sessions"]);
                command.arg(
                    AGENTSTACK_MAX_SESSIONS
                        .max(cap + SESSION_HEADROOM)
                        .to_string(),
                );
                command
            }
            ServerKind::Reference => {
                let mut command = Command::new(&python);
                command
                    .arg(&script)
                    .args(["--port", "0", "--max-concurrent-envs"]);
                command.arg((cap.max(plan.sessions) + SESSION_HEADROOM).to_string());
                command
                    .env_remove("ENABLE_WEB_INTERFACE")
                    .env_remove("OPENENV_MODE");
                command
            }
        };
        eprintln!("starting the {kind} server: {command:?}");
        let server = ServerProcess::start(
            kind,
            command,
            log_dir.join(format!("{kind}.stderr")),
            startup_timeout,
        )
        .await?;
        eprintln!(
            "  [{kind}] pid {}, port {}, healthy after {:.2} s",
            server.pid,
            server.port,
            server.startup.as_secs_f64()
        );
        contenders.push(Contender {
            results: ServerResults {
                startup: server.startup,
                ramp_cap: cap,
                ..ServerResults::default()
            },
            server,
        });
    }

    sleep(IDLE_SETTLE).await;
    for contender in &mut contenders {
        let server = &mut contender.server;
        server.ensure_running()?;
        contender.results.idle_rss_kib = server.rss_kib()?;
        contender.results.idle_threads = server.threads()?;
        eprintln!(
            "  [{}] idle: RSS {:.1} MiB, {} threads",
            server.kind,
            kib_to_mib(contender.results.idle_rss_kib),
            contender.results.idle_threads
        );
    }

    for contender in &mut contenders {
        load::run_steps(&mut contender.server, 1, plan.warmup_steps)
            .await
            .with_context(|| format!("{} server, warm-up", contender.server.kind))?;
    }
    let phases = [(1, plan.single_steps), (plan.sessions, plan.multi_steps)];
    for (sessions, steps) in phases {
        for repeat in 1..=plan.repeats {
            for contender in &mut contenders {
                let kind = contender.server.kind;
                let run = load::run_steps(&mut contender.server, sessions, steps)
                    .await
                    .with_context(|| {
                        format!("{kind} server, {sessions} sessions × {steps} steps, run {repeat}")
                    })?;
                let figures = StepFigures::of(&run, ticks_per_second);
                eprintln!(
                    "  [{kind}] {sessions} × {steps} run {repeat}: {:.0} steps/s, p50 {:.3} ms, p99 {:.3} ms, server {:.1} µs/step",
                    figures.steps_per_second, figures.p50_ms, figures.p99_ms, figures.server_cpu_us
                );
                if sessions == 1 {
                    contender.results.single.push(figures);
                } else {
                    contender.results.multi.push(figures);
                }
            }
        }
    }

    for contender in &mut contenders {
        let kind = contender.server.kind;
        let ramp_plan = RampPlan {
            cap: plan.cap(kind),
            idle_sessions: plan.idle_sessions.min(plan.cap(kind)),
            batch: plan.ramp_batch,
            budget: plan.ramp_budget,
        };
        eprintln!("  [{kind}] ramp of idle sessions: {ramp_plan:?}");
        let ramp = load::ramp(&mut contender.server, ramp_plan)
            .await
            .with_context(|| format!("{kind} server, ramp of idle sessions"))?;
        contender.results.ramp = Some(ramp);
    }

    let load_at_end = procfs::load_average();
    let mut ours = None;
    let mut reference = None;
    for contender in contenders {
        let kind = contender.server.kind;
        contender.server.stop().await;
        match kind {
            ServerKind::Agentstack => ours = Some(contender.results),
            ServerKind::Reference => reference = Some(contender.results),
        }
    }

    let shape = plan.shape();
    let table = report::table(shape, ours.as_ref(), reference.as_ref());
    let runs = report::runs_table(shape, ours.as_ref(), reference.as_ref());
    let ramp_notes = report::ramp_notes(ours.as_ref(), reference.as_ref());
    println!("{table}\n{runs}\n{ramp_notes}");

    if let Some(path) = &args.write_results {
        let mut section = String::new();
        let _ = writeln!(
            section,
            "\n## env server: agentstack vs OpenEnv 0.10.0 reference, {}{}\n",
            machine::utc_now(),
            if args.quick { " (quick)" } else { "" }
        );
        let _ = writeln!(
            section,
            "- Machine: {} × {}, {:.1} GiB RAM; load average {} at start, {} at end.",
            machine.cpus,
            machine.model,
            kib_to_mib(machine.mem_total_kib) / 1024.0,
            machine.load_average,
            load_at_end
        );
        let _ = writeln!(section, "- Command: `{command_line}`");
        for version in &versions {
            let _ = writeln!(section, "- {version}");
        }
        let _ = writeln!(
            section,
            "- Servers, both on 127.0.0.1 and children of the load generator (so they inherit \
             its RLIMIT_NOFILE, raised to {}/{}): `agentstack env serve echo --port 0 \
             --max-sessions {}`; `python bench/env_server/reference_server.py --port 0 \
             --max-concurrent-envs {}` (the `openenv init` echo env, `create_app` under \
             uvicorn's defaults: asyncio loop, h11, websockets; access log off).",
            nofile.0,
            nofile.1,
            AGENTSTACK_MAX_SESSIONS.max(plan.agentstack_cap + SESSION_HEADROOM),
            plan.reference_cap.max(plan.sessions) + SESSION_HEADROOM
        );
        let _ = writeln!(
            section,
            "- Load generator: this crate, Rust, tokio with {} worker threads, tokio-tungstenite \
             with Nagle off, raw OpenEnv `/ws` protocol (`reset` with seed 1, then `step` \
             `{{\"message\":\"hello\"}}`, one request outstanding per session, every reply \
             checked). **It shares the machine's {} cores with the server under test**, so the \
             many-session figures measure both; the single-session figures and CPU per step \
             are the steadier ones.",
            args.worker_threads, machine.cpus
        );
        let _ = writeln!(
            section,
            "- Order: both servers run the whole time; after a {}-step warm-up each step phase \
             alternates between them ({} runs each, medians shown), then each server's ramp \
             runs alone.",
            plan.warmup_steps, plan.repeats
        );
        let _ = writeln!(
            section,
            "- Latency: step sent to reply parsed, in the generator. CPU: the server's \
             `utime+stime+cutime+cstime` from `/proc/<pid>/stat` over the step phase only \
             (connect, reset and close excluded), at {ticks_per_second} ticks/s ({}).",
            if ticks_from_sysconf {
                "from sysconf(_SC_CLK_TCK)"
            } else {
                "assumed; sysconf did not say"
            }
        );
        let _ = writeln!(
            section,
            "- Memory: VmRSS from `/proc/<pid>/status`. Idle: {} s after `/health` first \
             answered, before any session. Per idle session: VmRSS growth from just before the \
             ramp (after the step phases) to {} sessions opened, reset and held open (the \
             server's pings answered), divided by the sessions held. The ramp opens batches of \
             {}, 32 at a time, up to a cap of {} (agentstack) / {} (reference), and stops at \
             the first failed session, the first session the server drops, or after {} s.",
            IDLE_SETTLE.as_secs(),
            plan.idle_sessions,
            plan.ramp_batch,
            plan.agentstack_cap,
            plan.reference_cap,
            plan.ramp_budget.as_secs()
        );
        let _ = writeln!(section, "\n{table}");
        let _ = writeln!(
            section,
            "<details><summary>Every run</summary>\n\n{runs}\n</details>\n\n{ramp_notes}"
        );
        let is_new = std::fs::metadata(path).map_or(true, |meta| meta.len() == 0);
        if is_new {
            section.insert_str(
                0,
                "# Benchmark results\n\nEach section is appended by the benchmark that produced it, \
                 newest last; see bench/README.md.\n",
            );
        }
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        file.write_all(section.as_bytes())
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("appended the results to {}", path.display());
    }
    Ok(())
}

/// Raises the soft RLIMIT_NOFILE to the hard limit (the servers, spawned later,
/// inherit it) and says whether that is enough for the caps.
fn raise_nofile_limit(plan: &Plan) -> Result<(u64, u64)> {
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).context("getrlimit(RLIMIT_NOFILE)")?;
    setrlimit(Resource::RLIMIT_NOFILE, hard, hard).context("setrlimit(RLIMIT_NOFILE)")?;
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).context("getrlimit(RLIMIT_NOFILE)")?;
    let needed = plan.agentstack_cap.max(plan.reference_cap) + 2 * SESSION_HEADROOM;
    if soft < u64::try_from(needed)? {
        eprintln!(
            "warning: RLIMIT_NOFILE is {soft}, but the ramp needs about {needed} descriptors on each side; \
             the ramp will stop early\nhint: raise the hard limit (`ulimit -Hn`) or lower the caps"
        );
    }
    Ok((soft, hard))
}

fn default_python() -> PathBuf {
    let home =
        std::env::var_os(env_vars::HOME).map_or_else(|| PathBuf::from("/root"), PathBuf::from);
    home.join(".cache/agentstack/venv-openenv-0.10.0/bin/python")
}

/// One line per server saying what was measured: versions and the git commit.
async fn versions(selected: &[ServerKind], agentstack_bin: &Path, python: &Path) -> Vec<String> {
    let mut lines = Vec::new();
    if selected.contains(&ServerKind::Agentstack) {
        let version = output_of(Command::new(agentstack_bin).arg("--version"))
            .await
            .unwrap_or_else(|| "version unknown".to_owned());
        let manifest_dir = env!("CARGO_MANIFEST_DIR");
        let commit = output_of(Command::new("git").args([
            "-C",
            manifest_dir,
            "rev-parse",
            "--short",
            "HEAD",
        ]))
        .await
        .unwrap_or_else(|| "unknown".to_owned());
        let dirty = output_of(Command::new("git").args([
            "-C",
            manifest_dir,
            "status",
            "--porcelain",
            "--",
            "../../crates",
        ]))
        .await
        .is_some_and(|status| !status.is_empty());
        lines.push(format!(
            "agentstack: `{version}`, {} at git {commit}{}.",
            agentstack_bin.display(),
            if dirty {
                " plus uncommitted changes in crates/"
            } else {
                ""
            }
        ));
    }
    if selected.contains(&ServerKind::Reference) {
        let query = "import importlib.metadata as m, sys; \
                     print(', '.join(f'{p} {m.version(p)}' for p in ('openenv', 'fastapi', 'uvicorn', 'websockets', 'pydantic')) + ', Python ' + sys.version.split()[0])";
        let version = output_of(Command::new(python).args(["-c", query]))
            .await
            .unwrap_or_else(|| "versions unknown".to_owned());
        lines.push(format!("Reference: {version}."));
    }
    lines
}

/// The trimmed stdout of a command that succeeded within [`VERSION_QUERY_TIMEOUT`].
async fn output_of(command: &mut Command) -> Option<String> {
    command.kill_on_drop(true);
    let output = timeout(VERSION_QUERY_TIMEOUT, command.output())
        .await
        .ok()?
        .ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).trim().to_owned())
}
