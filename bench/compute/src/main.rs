//! `agentstack-bench-compute`: what agentstack-compute adds on top of each engine.
//!
//! On each engine (local processes, a Slurm cluster, a Ray head), in one run, round
//! after round:
//!
//! - **bare submit**: the engine's own path, no agentstack — 3 jobs (`sleep`) submitted
//!   one after the other (`sbatch --parsable --wrap`, `POST /api/jobs/`, a spawned
//!   process) and polled every 20 ms until all run; and one job alone;
//! - **agentstack launch**: a job group of 3 components through the supervisor the CLI
//!   runs (`agentstack launch`, same poll intervals: 100 ms local, 250 ms engines), from
//!   the launch call until the launch is `running` (every component running);
//! - **recovery**: one component's program killed (SIGKILL); the time until its
//!   replacement runs (detection by the supervisor's poll, its policy, the resubmit,
//!   the engine's start).
//!
//! - **group recovery** (`recovery: group`): one component of three killed (SIGKILL);
//!   the time until every member was stopped and started again as a gang, with its
//!   discovery written anew (the launch `running` again);
//! - **failover** (`resources.infra: [ENGINE, local]`): the group placed on local when
//!   the engine cannot take it: Slurm with its controller stopped (slurmctld killed,
//!   started again after), Slurm asked for more memory than any node has, a Ray head
//!   that does not answer. From the launch until every component runs on local.
//!
//! The issue's goal: overhead ≤ 1 s over the engine at launch; a failed component back
//! ≤ 2 s after detection; a group recovered (discovery re-established) within 30 s.
//! p50 and p90 over `--rounds`.
//!
//! ```text
//! export SLURM_CONF="$(scripts/start-slurm)" AGENTSTACK_RAY_ADDRESS="$(scripts/start-ray)"
//! cargo run --release -p agentstack-bench-compute -- --rounds 10 --write-results bench/RESULTS.md
//! ```

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use agentstack_bench_support::machine;
use agentstack_bench_support::report::append_section;
use agentstack_compute::JobGroup;
use agentstack_compute::backend::AnyBackend;
use agentstack_compute::backend::local::LocalBackend;
use agentstack_compute::backend::ray::RayBackend;
use agentstack_compute::backend::slurm::{SlurmBackend, SlurmSettings};
use agentstack_compute::spec::InfraKind;
use agentstack_compute::state::{JobState, Store, UnitState};
use agentstack_compute::supervisor::{
    Supervisor, SupervisorSettings, create_launch, create_launch_on,
};
use agentstack_static::env_vars;
use anyhow::{Context, bail, ensure};
use clap::Parser;
use serde_json::json;

/// How often the bare paths look at the engine.
const BARE_POLL: Duration = Duration::from_millis(20);
/// How often the benchmark looks at agentstack's state.
const STATE_POLL: Duration = Duration::from_millis(10);
/// Longest any one wait may take.
const PATIENCE: Duration = Duration::from_secs(120);

#[derive(Parser)]
#[command(about = "Launch and recovery overhead of agentstack-compute on local, Slurm and Ray")]
struct Args {
    /// Rounds per engine.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Engines to measure.
    #[arg(long, value_delimiter = ',', default_value = "local,slurm,ray")]
    engines: Vec<String>,
    /// The Ray Jobs API (default: AGENTSTACK_RAY_ADDRESS, else http://127.0.0.1:8265).
    #[arg(long)]
    ray_address: Option<String>,
    /// Append a section with the results to this file (bench/RESULTS.md).
    #[arg(long)]
    write_results: Option<PathBuf>,
}

#[derive(Default)]
struct Figures {
    bare_three: Vec<f64>,
    bare_one: Vec<f64>,
    launch: Vec<f64>,
    recovery: Vec<f64>,
    group_recovery: Vec<f64>,
}

/// The failovers measured: name, the engine, and what makes it refuse.
const FAILOVERS: [(&str, &str); 3] = [
    ("slurm", "controller stopped"),
    ("slurm", "more memory than any node has"),
    ("ray", "head not answering"),
];

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let ray_address = args
        .ray_address
        .clone()
        .or_else(|| std::env::var(env_vars::AGENTSTACK_RAY_ADDRESS).ok())
        .unwrap_or_else(|| "http://127.0.0.1:8265".into());
    let load_start = machine::load_average().unwrap_or_default();
    let mut results = Vec::new();
    for engine in &args.engines {
        let mut figures = Figures::default();
        for round in 0..args.rounds {
            eprintln!("{engine}: round {}/{}", round + 1, args.rounds);
            figures
                .bare_three
                .push(bare(engine, 3, &ray_address).await?);
            figures.bare_one.push(bare(engine, 1, &ray_address).await?);
            let (launched, recovery) = launch(engine, &ray_address, round, false).await?;
            figures.launch.push(launched);
            figures.recovery.push(recovery);
            let (_, group) = launch(engine, &ray_address, round, true).await?;
            figures.group_recovery.push(group);
        }
        results.push((engine.clone(), figures));
    }
    let mut failovers = Vec::new();
    for (engine, case) in FAILOVERS {
        if !args.engines.iter().any(|e| e == engine) {
            continue;
        }
        let mut times = Vec::new();
        let mut said = String::new();
        for round in 0..args.rounds {
            eprintln!(
                "failover, {engine} {case}: round {}/{}",
                round + 1,
                args.rounds
            );
            let (took, why) = failover(engine, case, round).await?;
            times.push(took);
            said = why;
        }
        failovers.push((engine, case, times, said));
    }
    let section = report(&args, &results, &failovers, &load_start);
    print!("{section}");
    if let Some(path) = &args.write_results {
        append_section(path, &section)?;
    }
    Ok(())
}

fn command(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("running {program}"))?;
    ensure!(
        out.status.success(),
        "{program} {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// Seconds from the first submit until `n` bare jobs run; the jobs are then removed.
async fn bare(engine: &str, n: usize, ray: &str) -> anyhow::Result<f64> {
    let start = Instant::now();
    let elapsed = match engine {
        "local" => {
            let mut children = Vec::new();
            for _ in 0..n {
                children.push(
                    tokio::process::Command::new("bash")
                        .args(["-c", "exec sleep 120"])
                        .kill_on_drop(true)
                        .spawn()?,
                );
            }
            // A spawned process runs: spawn returns after its exec.
            let elapsed = start.elapsed();
            for mut c in children {
                c.kill().await?;
            }
            elapsed
        }
        "slurm" => {
            let mut ids = Vec::new();
            for _ in 0..n {
                ids.push(command(
                    "sbatch",
                    &[
                        "--parsable",
                        "--output=/dev/null",
                        "--wrap",
                        "exec sleep 120",
                    ],
                )?);
            }
            let list = ids.join(",");
            loop {
                let states = command("squeue", &["-h", "-j", &list, "-o", "%T"])?;
                if states.lines().filter(|l| *l == "RUNNING").count() == n {
                    break;
                }
                ensure!(
                    start.elapsed() < PATIENCE,
                    "Slurm jobs {list} never all ran"
                );
                tokio::time::sleep(BARE_POLL).await;
            }
            let elapsed = start.elapsed();
            command(
                "scancel",
                &ids.iter().map(String::as_str).collect::<Vec<_>>(),
            )?;
            elapsed
        }
        "ray" => {
            let client = reqwest::Client::new();
            let mut ids = Vec::new();
            for _ in 0..n {
                let answer: serde_json::Value = client
                    .post(format!("{ray}/api/jobs/"))
                    .json(&json!({"entrypoint": "exec sleep 120"}))
                    .send()
                    .await?
                    .error_for_status()?
                    .json()
                    .await?;
                ids.push(
                    answer["submission_id"]
                        .as_str()
                        .context("no id")?
                        .to_owned(),
                );
            }
            loop {
                let mut running = 0;
                for id in &ids {
                    let job: serde_json::Value = client
                        .get(format!("{ray}/api/jobs/{id}"))
                        .send()
                        .await?
                        .json()
                        .await?;
                    running += usize::from(job["status"] == "RUNNING");
                }
                if running == n {
                    break;
                }
                ensure!(start.elapsed() < PATIENCE, "Ray jobs never all ran");
                tokio::time::sleep(BARE_POLL).await;
            }
            let elapsed = start.elapsed();
            for id in &ids {
                client
                    .post(format!("{ray}/api/jobs/{id}/stop"))
                    .send()
                    .await?;
            }
            elapsed
        }
        other => bail!("unknown engine `{other}`: local, slurm or ray"),
    };
    // Let the engine take the jobs down before the next measurement.
    tokio::time::sleep(Duration::from_millis(500)).await;
    Ok(elapsed.as_secs_f64())
}

/// A launch of three components: seconds to all running, and from killing one to its
/// replacement running (`group`: to the whole group running again, `recovery: group`,
/// every member's discovery written anew).
async fn launch(engine: &str, ray: &str, round: usize, group: bool) -> anyhow::Result<(f64, f64)> {
    let home = tempfile::tempdir()?;
    let dir = home.path().join("work");
    std::fs::create_dir_all(&dir)?;
    let name = format!("bench{}{round}", if group { "g" } else { "" });
    let group_spec = JobGroup::parse(&trio(&name, &dir, group))?;
    let (backend, poll) = match engine {
        "local" => (
            AnyBackend::Local(LocalBackend::new()),
            Duration::from_millis(100),
        ),
        "slurm" => (
            AnyBackend::Slurm(SlurmBackend::new(SlurmSettings::default())),
            Duration::from_millis(250),
        ),
        "ray" => (
            AnyBackend::Ray(RayBackend::new(ray)),
            Duration::from_millis(250),
        ),
        other => bail!("unknown engine `{other}`"),
    };
    let settings = SupervisorSettings {
        poll_interval: poll,
        stop_grace: Duration::from_secs(2),
        ..Default::default()
    };
    let store = Store::open(&home.path().join("jobs.db")).await?;

    let start = Instant::now();
    let job = create_launch(
        &store,
        &backend,
        &group_spec,
        home.path(),
        &json!({}),
        &settings,
    )
    .await?;
    let supervisor = Supervisor::new(store.clone(), backend, settings, &job.id).await?;
    let running = tokio::spawn(async move { supervisor.run().await });
    loop {
        if store.job(&job.id).await?.map(|j| j.state) == Some(JobState::Running) {
            break;
        }
        ensure!(start.elapsed() < PATIENCE, "the launch never ran");
        tokio::time::sleep(STATE_POLL).await;
    }
    let launched = start.elapsed().as_secs_f64();

    let pid_file = dir.join("worker.pid");
    let pid: i32 = loop {
        if let Some(pid) = std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|t| t.trim().parse().ok())
        {
            break pid;
        }
        ensure!(start.elapsed() < PATIENCE, "the worker never wrote its pid");
        tokio::time::sleep(STATE_POLL).await;
    };
    let killed = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    let up_front = engine == "local";
    loop {
        let units = store.units(&job.id).await?;
        let back = if group {
            let record = store.job(&job.id).await?.context("no launch")?;
            record.recoveries == 1
                && record.state == JobState::Running
                && units
                    .iter()
                    .all(|u| u.attempt == 1 && (u.discovered || up_front))
        } else {
            let worker = units
                .iter()
                .find(|u| u.component == "worker")
                .context("no worker")?;
            worker.attempt == 1 && worker.state == UnitState::Running
        };
        if back {
            break;
        }
        ensure!(killed.elapsed() < PATIENCE, "the worker never came back");
        tokio::time::sleep(STATE_POLL).await;
    }
    let recovered = killed.elapsed().as_secs_f64();

    store.request_cancel(&job.id).await?;
    let end = running.await??;
    ensure!(end == JobState::Cancelled, "the launch ended {end}");
    Ok((launched, recovered))
}

/// `resources.infra: [ENGINE, local]` where the engine refuses (`case`): seconds from
/// the launch until every component runs on local, and what the engine said.
async fn failover(engine: &str, case: &str, round: usize) -> anyhow::Result<(f64, String)> {
    let home = tempfile::tempdir()?;
    let dir = home.path().join("work");
    std::fs::create_dir_all(&dir)?;
    let memory = if case == "more memory than any node has" {
        // The test cluster's nodes have 4000 MB.
        ", memory: 64GB"
    } else {
        ""
    };
    let name = format!("failover{round}");
    let d = dir.display();
    let component = |c: &str| {
        format!(
            "---\nname: {c}\nresources: {{infra: [{engine}, local]{memory}}}\nrun: |\n  echo $$ >> {d}/{c}.pids\n  exec sleep 120\n"
        )
    };
    let group = JobGroup::parse(&format!(
        "name: {name}\nexecution: parallel\n{}{}",
        component("server"),
        component("client")
    ))?;
    let slurm_dir = PathBuf::from(std::env::var(env_vars::HOME).unwrap_or_default())
        .join(".cache/agentstack/slurm");
    let first = match (engine, case) {
        ("slurm", "controller stopped") => {
            let pid = std::fs::read_to_string(slurm_dir.join("run/slurmctld.pid"))
                .context("no slurmctld pid file: is scripts/start-slurm's cluster up?")?;
            command("kill", &[pid.trim()])?;
            // Until it is gone.
            while Path::new(&format!("/proc/{}", pid.trim())).exists() {
                tokio::time::sleep(STATE_POLL).await;
            }
            AnyBackend::Slurm(SlurmBackend::new(SlurmSettings::default()))
        }
        ("slurm", _) => AnyBackend::Slurm(SlurmBackend::new(SlurmSettings::default())),
        _ => {
            // A Jobs API on a port nobody listens on: a head that is down.
            let port = std::net::TcpListener::bind("127.0.0.1:0")?
                .local_addr()?
                .port();
            AnyBackend::Ray(RayBackend::new(&format!("http://127.0.0.1:{port}")))
        }
    };
    let backends = vec![first, AnyBackend::Local(LocalBackend::new())];
    let settings = SupervisorSettings {
        stop_grace: Duration::from_secs(2),
        ..Default::default()
    };
    let store = Store::open(&home.path().join("jobs.db")).await?;
    let start = Instant::now();
    let job = create_launch_on(
        &store,
        &backends,
        &[],
        &group,
        home.path(),
        &json!({}),
        &settings,
    )
    .await?;
    let supervisor = Supervisor::with_backends(store.clone(), backends, settings, &job.id).await?;
    let running = tokio::spawn(async move { supervisor.run().await });
    let record = loop {
        let record = store.job(&job.id).await?.context("no launch")?;
        if record.state == JobState::Running {
            break record;
        }
        ensure!(
            start.elapsed() < PATIENCE,
            "the launch never ran: {:?}",
            record.message
        );
        tokio::time::sleep(STATE_POLL).await;
    };
    let took = start.elapsed().as_secs_f64();
    ensure!(
        record.infra == InfraKind::Local,
        "placed on {}, not local",
        record.infra
    );
    let said = record.placement.unwrap_or_default();
    store.request_cancel(&job.id).await?;
    let end = running.await??;
    ensure!(end == JobState::Cancelled, "the launch ended {end}");
    if case == "controller stopped" {
        let out = Command::new("scripts/start-slurm").output()?;
        ensure!(
            out.status.success(),
            "restarting the Slurm controller: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok((took, said))
}

fn trio(name: &str, dir: &Path, group: bool) -> String {
    let d = dir.display();
    let recovery = if group { "recovery: group\n" } else { "" };
    let component = |c: &str| {
        format!(
            "---\nname: {c}\nresources: {{job_recovery: {{max_restarts_on_errors: 5}}}}\nrun: |\n  echo $$ > {d}/{c}.pid\n  exec sleep 120\n"
        )
    };
    format!(
        "name: {name}\nexecution: parallel\n{recovery}{}{}{}",
        component("server"),
        component("worker"),
        component("client")
    )
}

fn percentile(values: &[f64], p: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// A failover case's figures: engine, case, seconds per round, the launch's placement
/// note.
type Failover = (&'static str, &'static str, Vec<f64>, String);

fn report(
    args: &Args,
    results: &[(String, Figures)],
    failovers: &[Failover],
    load_start: &str,
) -> String {
    let ms = |v: &[f64], p: f64| format!("{:.0}", percentile(v, p) * 1000.0);
    let mut s = String::new();
    let date = machine::utc_now();
    let _ = writeln!(
        s,
        "\n## compute: launch, recovery, group recovery and failover on local, Slurm and Ray, {date}\n"
    );
    let _ = writeln!(
        s,
        "Command: `cargo run {}-p agentstack-bench-compute -- --rounds {} --engines {}`. \
         Machine: {} CPUs ({}), load average {} at the start, {} at the end. \
         Engines: Slurm {} (scripts/start-slurm: two slurmd on 127.0.0.1), Ray {} (scripts/start-ray, one head). \
         Times in ms, p50 / p90 over {} rounds; every job is `sleep`, so the figures are the engines' and agentstack's own.\n",
        if cfg!(debug_assertions) {
            ""
        } else {
            "--release "
        },
        args.rounds,
        args.engines.join(","),
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        machine::cpu_model().unwrap_or_else(|| "unknown CPU".into()),
        load_start,
        machine::load_average().unwrap_or_default(),
        command("sinfo", &["--version"]).unwrap_or_else(|_| "-".into()),
        ray_version(),
        args.rounds,
    );
    let _ = writeln!(
        s,
        "| engine | bare submit, 3 jobs → all running | agentstack launch, 3 components → all running | launch overhead (p50) | bare submit, 1 job → running | a component killed → replacement running | recovery over a bare submit (p50) | `recovery: group`: a component killed → all 3 running again, discovery rewritten |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|");
    for (engine, f) in results {
        let over = (percentile(&f.launch, 0.5) - percentile(&f.bare_three, 0.5)) * 1000.0;
        let rec = (percentile(&f.recovery, 0.5) - percentile(&f.bare_one, 0.5)) * 1000.0;
        let _ = writeln!(
            s,
            "| {engine} | {} / {} | {} / {} | {over:+.0} | {} / {} | {} / {} | {rec:+.0} | {} / {} |",
            ms(&f.bare_three, 0.5),
            ms(&f.bare_three, 0.9),
            ms(&f.launch, 0.5),
            ms(&f.launch, 0.9),
            ms(&f.bare_one, 0.5),
            ms(&f.bare_one, 0.9),
            ms(&f.recovery, 0.5),
            ms(&f.recovery, 0.9),
            ms(&f.group_recovery, 0.5),
            ms(&f.group_recovery, 0.9),
        );
    }
    if !failovers.is_empty() {
        let _ = writeln!(
            s,
            "\nFailover, `resources.infra: [ENGINE, local]` (2 components): from the launch until both run on local.\n"
        );
        let _ = writeln!(
            s,
            "| engine | why it cannot take the group | launch → running on local, ms p50 / p90 | what the launch records (`placement`) |"
        );
        let _ = writeln!(s, "|---|---|---|---|");
        for (engine, case, times, said) in failovers {
            let _ = writeln!(
                s,
                "| {engine} | {case} | {} / {} | {} |",
                ms(times, 0.5),
                ms(times, 0.9),
                said.replace('|', "\\|").replace('\n', " / ")
            );
        }
    }
    s
}

fn ray_version() -> String {
    let venv = std::env::var(env_vars::HOME).unwrap_or_default() + "/.cache/agentstack";
    std::fs::read_dir(venv)
        .ok()
        .and_then(|entries| {
            entries
                .filter_map(Result::ok)
                .filter_map(|e| {
                    e.file_name()
                        .to_str()
                        .and_then(|n| n.strip_prefix("venv-ray-").map(str::to_owned))
                })
                .next()
        })
        .unwrap_or_else(|| "-".into())
}
