//! `agentstack launch | status | logs | cancel | down`: job groups on the user's
//! compute, through agentstack-compute.
//!
//! A launch's state is in `<data dir>/jobs/jobs.db`; its logs and discovery files in
//! `<data dir>/jobs/<id>/`. A supervisor process runs each launch (in the foreground,
//! or in the background with `--detach`); when it is gone while the launch still runs
//! (the machine's `agentstack` was killed), `status`, `logs` and `cancel` start a new
//! one, which picks the launch up where it was.

pub mod cancel;
pub mod down;
pub mod logs;
pub mod start;
pub mod status;

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use agentstack_compute::backend::AnyBackend;
use agentstack_compute::launch::{self as launch_plan, LaunchOptions};
use agentstack_compute::state::{JobRecord, JobState, Store, now_ms};
use agentstack_compute::supervisor::{Supervisor, SupervisorSettings};
use agentstack_static::env_vars;
use anyhow::{anyhow, bail};

use crate::Exit;
use crate::args::JobNameArgs;
use crate::settings::data_dir;

/// A supervisor that has not written for this long is taken for dead.
const SUPERVISOR_SILENCE: Duration = Duration::from_secs(60);

/// Where launches live.
pub(crate) fn jobs_dir() -> PathBuf {
    data_dir().join("jobs")
}

/// The state database. It is ours, not the user's: one we cannot open is an
/// internal error (exit 2).
pub(crate) async fn open_store() -> Result<Store, Exit> {
    let path = jobs_dir().join("jobs.db");
    Store::open(&path)
        .await
        .map_err(|e| internal(anyhow!(e).context(format!("opening {}", path.display()))))
}

/// The launch named (or with the id) `name`.
pub(crate) async fn find(store: &Store, name: &str) -> Result<JobRecord, Exit> {
    store
        .job_by_name(name)
        .await
        .map_err(internal)?
        .ok_or_else(|| {
            Exit::user(anyhow!(
                "there is no launch named `{name}`\nhint: `agentstack status` lists the launches"
            ))
        })
}

pub(crate) fn internal(e: impl Into<anyhow::Error>) -> Exit {
    Exit::internal(e)
}

/// A launch's backends, one per engine of its order that can be built (the one it is on
/// must be: else the user's error), and the supervisor's pace.
pub(crate) fn backends_of(job: &JobRecord) -> Result<(Vec<AnyBackend>, SupervisorSettings), Exit> {
    let options: LaunchOptions = serde_json::from_str(&job.options).unwrap_or_default();
    let mut backends = vec![launch_plan::backend(job.infra, &options).map_err(launch_exit)?];
    for kind in job.infra_order.iter().filter(|k| **k != job.infra) {
        // One that cannot be built now is passed over if the launch moves on.
        if let Ok(b) = launch_plan::backend(*kind, &options) {
            backends.push(b);
        }
    }
    Ok((
        backends,
        launch_plan::supervisor_settings(job.infra, &options),
    ))
}

/// A [`LaunchError`](launch_plan::LaunchError) as an exit: the user's or ours, as it
/// says.
pub(crate) fn launch_exit(error: launch_plan::LaunchError) -> Exit {
    if error.is_users() {
        Exit::user(anyhow!(error))
    } else {
        internal(error)
    }
}

/// `AGENTSTACK_LOCAL_CPUS`, read (empty is unset, like every variable).
pub(crate) fn local_cpus() -> Result<Option<f64>, Exit> {
    crate::settings::flag_or_env(None, env_vars::AGENTSTACK_LOCAL_CPUS, |text| {
        text.trim()
            .parse::<f64>()
            .ok()
            .filter(|n| *n > 0.0)
            .ok_or_else(|| {
                format!(
                    "is not a number of CPUs\nhint: e.g. {}=8",
                    env_vars::AGENTSTACK_LOCAL_CPUS
                )
            })
    })
    .map_err(Exit::from)
}

/// Runs the launch's supervisor in this process until the launch ends.
pub(crate) async fn supervise_here(store: &Store, job: &JobRecord) -> Result<JobState, Exit> {
    let (backends, settings) = backends_of(job)?;
    let supervisor = Supervisor::with_backends(store.clone(), backends, settings, &job.id)
        .await
        .map_err(internal)?;
    supervisor.run().await.map_err(internal)
}

/// Starts a supervisor for the launch in the background (`agentstack supervise ID`),
/// its output in the launch's `supervisor.log`.
pub(crate) fn spawn_supervisor(job: &JobRecord) -> Result<u32, Exit> {
    let exe = std::env::current_exe().map_err(internal)?;
    let log_path = PathBuf::from(&job.dir).join("supervisor.log");
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .map_err(|e| internal(anyhow!(e).context(log_path.display().to_string())))?;
    let err = log.try_clone().map_err(internal)?;
    let child = std::process::Command::new(exe)
        .args(["supervise", &job.id])
        .env(env_vars::AGENTSTACK_HOME, data_dir())
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(err)
        // Its own process group: a Ctrl-C in this terminal does not reach it.
        .process_group(0)
        .spawn()
        .map_err(internal)?;
    Ok(child.id())
}

/// Whether the launch's supervisor is alive: its process exists and it wrote lately.
pub(crate) fn supervisor_alive(job: &JobRecord) -> bool {
    let recent = job
        .heartbeat_ms
        .is_some_and(|h| now_ms() - h < SUPERVISOR_SILENCE.as_millis() as i64);
    let exists = job.supervisor_pid.is_some_and(|pid| {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
            s.rsplit_once(") ")
                .is_some_and(|(_, r)| !r.starts_with('Z'))
        })
    });
    recent && exists
}

/// For a launch that still runs with no supervisor: starts one in the background, and
/// says so.
pub(crate) fn revive(job: &JobRecord) -> Result<(), Exit> {
    if job.state.is_terminal() || supervisor_alive(job) {
        return Ok(());
    }
    let pid = spawn_supervisor(job)?;
    eprintln!(
        "note: launch `{}` had no supervisor running; started one (pid {pid})",
        job.name
    );
    Ok(())
}

/// `agentstack supervise ID` (hidden): what `launch --detach` starts.
pub async fn supervise(args: JobNameArgs) -> Result<(), Exit> {
    let store = open_store().await?;
    let job = find(&store, &args.name).await?;
    if supervisor_alive(&job) && job.supervisor_pid != Some(i64::from(std::process::id())) {
        bail_user(format!(
            "launch `{}` already has a supervisor (pid {})",
            job.name,
            job.supervisor_pid.unwrap_or_default()
        ))?;
    }
    let end = supervise_here(&store, &job).await?;
    eprintln!("launch {} ended: {end}", job.id);
    Ok(())
}

fn bail_user(message: String) -> Result<(), Exit> {
    Err(Exit::user(anyhow!(message)))
}

/// How long ago `ms` was, for people.
pub(crate) fn ago(ms: i64) -> String {
    let s = (now_ms() - ms).max(0) / 1000;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m", s / 60),
        3600..86400 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86400),
    }
}

/// `KEY=VALUE` from `--env`.
pub(crate) fn env_pair(text: &str) -> anyhow::Result<(String, String)> {
    let Some((key, value)) = text.split_once('=') else {
        bail!("--env `{text}` is not KEY=VALUE\nhint: --env MODEL=path/to/model.gguf");
    };
    if !agentstack_compute::spec::is_env_name(key) {
        bail!(
            "--env `{key}` is not a variable name\nhint: letters, digits and _, not starting with a digit"
        );
    }
    Ok((key.to_owned(), value.to_owned()))
}
