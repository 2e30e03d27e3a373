//! Units as Slurm batch jobs, through the CLI (`sbatch --parsable`, `squeue --json`,
//! `scancel [--signal]`), as SkyPilot does: it needs nothing but the client commands
//! on PATH (and `SLURM_CONF` where the cluster's configuration is not the default).
//!
//! Each replica is one job of the [batch script](crate::slurm::batch_script), its output
//! in `<launch dir>/logs/`. Jobs are submitted `--no-requeue`: recovery is the
//! supervisor's. Addresses are the nodes' `NodeAddr`s, learned once Slurm has placed
//! the job, and reach the program through the discovery file. The launch directory must
//! be on a file system the nodes share (one host, or NFS as on most clusters).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde_json::Value;

use super::{Backend, BackendError, LogSource, UnitLaunch, UnitStatus, signal_exit_code};
use crate::discovery::Addresses;
use crate::request;
use crate::slurm::{SlurmOptions, batch_script};
use crate::spec::{InfraKind, JobGroup};

/// Launch settings for Slurm.
#[derive(Debug, Clone, Default)]
pub struct SlurmSettings {
    /// `--time` in minutes; the partition's default when `None`.
    pub time_limit_minutes: Option<u32>,
    /// More `#SBATCH` options (`--account=ml`).
    pub extra_options: Vec<String>,
    /// The cluster's `slurm.conf`, given to every command as `SLURM_CONF`; `None`: the
    /// environment's.
    pub conf: Option<PathBuf>,
}

/// The Slurm CLI.
#[derive(Debug, Default)]
pub struct SlurmBackend {
    settings: SlurmSettings,
    /// Node name → NodeAddr.
    node_addrs: Mutex<HashMap<String, String>>,
}

impl SlurmBackend {
    /// A backend with `settings`.
    pub fn new(settings: SlurmSettings) -> Self {
        Self {
            settings,
            node_addrs: Mutex::default(),
        }
    }

    async fn node_addr(&self, node: &str) -> Result<String, BackendError> {
        if let Some(addr) = self.node_addrs.lock().expect("never poisoned").get(node) {
            return Ok(addr.clone());
        }
        let out = self
            .run("scontrol", &["show", "node", "-o", node], None)
            .await?;
        let addr = out
            .split_whitespace()
            .find_map(|w| w.strip_prefix("NodeAddr="))
            .unwrap_or(node)
            .to_owned();
        self.node_addrs
            .lock()
            .expect("never poisoned")
            .insert(node.to_owned(), addr.clone());
        Ok(addr)
    }

    /// One `squeue --json` for `ids`; an unknown id alone is a lost job.
    async fn squeue(&self, ids: &[&str]) -> Result<Vec<UnitStatus>, BackendError> {
        let jobs = match self
            .run(
                "squeue",
                &[
                    "--json",
                    "--states=all",
                    &format!("--jobs={}", ids.join(",")),
                ],
                None,
            )
            .await
        {
            Ok(out) => out,
            Err(BackendError::Command { stderr, .. })
                if ids.len() == 1 && stderr.contains("Invalid job id") =>
            {
                return Ok(vec![UnitStatus::Lost {
                    reason: "Slurm no longer knows the job".into(),
                }]);
            }
            Err(e) => return Err(e),
        };
        let value: Value = serde_json::from_str(&jobs).map_err(|e| BackendError::Parse {
            what: "squeue --json".into(),
            detail: e.to_string(),
        })?;
        let by_id: HashMap<String, &Value> = value["jobs"]
            .as_array()
            .map(|jobs| jobs.iter().map(|j| (j["job_id"].to_string(), j)).collect())
            .unwrap_or_default();
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            out.push(match by_id.get(*id) {
                Some(job) => self.status(job).await?,
                None => UnitStatus::Lost {
                    reason: "Slurm no longer knows the job".into(),
                },
            });
        }
        Ok(out)
    }

    async fn status(&self, job: &Value) -> Result<UnitStatus, BackendError> {
        let state = job["job_state"].as_str().unwrap_or("");
        let wait = job["exit_code"].as_i64().unwrap_or(0) as i32;
        let code = if wait & 0x7f != 0 {
            signal_exit_code(wait & 0x7f)
        } else {
            (wait >> 8) & 0xff
        };
        let reason = job["state_reason"].as_str().unwrap_or("");
        Ok(match state {
            "PENDING" if NEVER_PLACED.contains(&reason) => UnitStatus::Unplaceable {
                reason: format!("Slurm holds it pending for good: {reason}"),
            },
            "PENDING" | "CONFIGURING" | "REQUEUED" | "REQUEUE_HOLD" | "RESV_DEL_HOLD"
            | "SUSPENDED" => UnitStatus::Pending,
            "RUNNING" | "COMPLETING" | "STAGE_OUT" | "SIGNALING" | "RESIZING" => {
                let mut hosts = Vec::new();
                let nodes = job["job_resources"]["allocated_nodes"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default();
                for node in nodes {
                    if let Some(name) = node["nodename"].as_str() {
                        hosts.push(self.node_addr(name).await?);
                    }
                }
                if hosts.is_empty() {
                    UnitStatus::Pending
                } else {
                    UnitStatus::Running { hosts }
                }
            }
            "COMPLETED" if code == 0 => UnitStatus::Exited { code: 0 },
            "COMPLETED" | "FAILED" => UnitStatus::Exited {
                code: if code == 0 { 1 } else { code },
            },
            "CANCELLED" => UnitStatus::Exited {
                code: if code == 0 {
                    signal_exit_code(15)
                } else {
                    code
                },
            },
            "OUT_OF_MEMORY" => UnitStatus::Exited {
                code: signal_exit_code(9),
            },
            "TIMEOUT" | "DEADLINE" => UnitStatus::Exited {
                code: if code == 0 { 1 } else { code },
            },
            other => UnitStatus::Lost {
                reason: format!(
                    "Slurm says {other} ({})",
                    job["state_reason"].as_str().unwrap_or("no reason")
                ),
            },
        })
    }
}

/// Reasons Slurm gives for a pending job that no amount of waiting fixes: the request
/// exceeds what the partition or the account allows (unless the cluster's
/// `EnforcePartLimits` rejects such jobs at submission, Slurm queues them for ever).
const NEVER_PLACED: &[&str] = &[
    "PartitionNodeLimit",
    "PartitionTimeLimit",
    "BadConstraints",
    "InvalidAccount",
    "InvalidQOS",
];

impl SlurmBackend {
    async fn run(
        &self,
        program: &str,
        args: &[&str],
        cwd: Option<&Path>,
    ) -> Result<String, BackendError> {
        run(program, args, cwd, self.settings.conf.as_deref()).await
    }
}

async fn run(
    program: &str,
    args: &[&str],
    cwd: Option<&Path>,
    conf: Option<&Path>,
) -> Result<String, BackendError> {
    let mut command = tokio::process::Command::new(program);
    command.args(args).kill_on_drop(true);
    if let Some(conf) = conf {
        command.env("SLURM_CONF", conf);
    }
    if let Some(dir) = cwd {
        command.current_dir(dir);
    }
    let out = command
        .output()
        .await
        .map_err(|source| BackendError::Spawn {
            command: program.into(),
            hint: "install the Slurm client commands (Debian: slurm-client) and set SLURM_CONF if the cluster's configuration is not in /etc/slurm".into(),
            source,
        })?;
    if !out.status.success() {
        return Err(BackendError::Command {
            command: format!("{program} {}", args.join(" ")),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn parse_handle(handle: &str) -> (&str, Option<&str>) {
    match handle.split_once(' ') {
        Some((id, log)) => (id, Some(log)),
        None => (handle, None),
    }
}

impl Backend for SlurmBackend {
    fn kind(&self) -> InfraKind {
        InfraKind::Slurm
    }

    fn addresses_up_front(&self, _group: &JobGroup) -> Option<Addresses> {
        None
    }

    /// Asks the controller whether it is up (`scontrol ping`, milliseconds either
    /// way) before the group is submitted: `sbatch` to a controller that is down
    /// retries for about 9 s per job before it gives up.
    async fn prepare(&self, _group: &JobGroup, _job_id: &str) -> Result<(), BackendError> {
        let mut command = tokio::process::Command::new("scontrol");
        command.arg("ping").kill_on_drop(true);
        if let Some(conf) = &self.settings.conf {
            command.env("SLURM_CONF", conf);
        }
        let out = command.output().await.map_err(|source| BackendError::Spawn {
            command: "scontrol".into(),
            hint: "install the Slurm client commands (Debian: slurm-client) and set SLURM_CONF if the cluster's configuration is not in /etc/slurm".into(),
            source,
        })?;
        if out.status.success() {
            return Ok(());
        }
        let said = [out.stdout, out.stderr]
            .iter()
            .map(|b| String::from_utf8_lossy(b).trim().to_owned())
            .find(|t| !t.is_empty())
            .unwrap_or_default();
        Err(BackendError::Command {
            command: "scontrol ping".into(),
            stderr: said.lines().next().unwrap_or_default().to_owned(),
        })
    }

    async fn start(&self, launch: &UnitLaunch<'_>) -> Result<String, BackendError> {
        let logs = launch.dir.join("logs");
        let units = launch.dir.join("units");
        for dir in [&logs, &units] {
            std::fs::create_dir_all(dir).map_err(|e| BackendError::io(dir, e))?;
        }
        let extra: Vec<&str> = self
            .settings
            .extra_options
            .iter()
            .map(String::as_str)
            .collect();
        let log_dir = logs.to_string_lossy();
        let discovery_file = launch
            .discovery_file
            .as_ref()
            .map(|f| f.to_string_lossy().into_owned());
        let script = batch_script(
            launch.group,
            &launch.task.name,
            launch.replica,
            launch.discovery,
            &SlurmOptions {
                time_limit_minutes: self.settings.time_limit_minutes,
                log_dir: Some(&log_dir),
                discovery_file: discovery_file.as_deref(),
                discovery_timeout_seconds: launch.discovery_timeout_seconds,
                extra_options: &extra,
            },
        )?;
        let name = request::instance_name(launch.group, launch.task, launch.replica);
        let file = units.join(format!("{name}.{}.sbatch", launch.attempt));
        std::fs::write(&file, &script).map_err(|e| BackendError::io(&file, e))?;
        let out = self
            .run(
                "sbatch",
                &["--parsable", &file.to_string_lossy()],
                Some(launch.dir),
            )
            .await?;
        let id = out.trim().split(';').next().unwrap_or("").to_owned();
        if id.is_empty() || !id.chars().all(|c| c.is_ascii_digit()) {
            return Err(BackendError::Parse {
                what: "sbatch --parsable".into(),
                detail: format!("expected a job id, got `{}`", out.trim()),
            });
        }
        let log = logs.join(format!("{name}-{id}.log"));
        Ok(format!("{id} {}", log.display()))
    }

    async fn poll(&self, handles: &[String]) -> Result<Vec<UnitStatus>, BackendError> {
        let ids: Vec<&str> = handles.iter().map(|h| parse_handle(h).0).collect();
        match self.squeue(&ids).await {
            // squeue refuses the whole list when one id is unknown (purged after
            // MinJobAge): ask one by one.
            Err(BackendError::Command { .. }) if ids.len() > 1 => {
                let mut out = Vec::with_capacity(ids.len());
                for id in ids {
                    out.extend(self.squeue(&[id]).await?);
                }
                Ok(out)
            }
            other => other,
        }
    }

    async fn stop(&self, handle: &str, graceful: bool) -> Result<(), BackendError> {
        let (id, _) = parse_handle(handle);
        if graceful {
            // The job's steps get SIGTERM: the program (the entrypoint `exec`s it).
            if self
                .run("scancel", &["--signal=TERM", id], None)
                .await
                .is_ok()
            {
                return Ok(());
            }
        }
        self.run("scancel", &[id], None).await.map(drop)
    }

    async fn logs(&self, handle: &str) -> Result<LogSource, BackendError> {
        match parse_handle(handle) {
            (_, Some(log)) => Ok(LogSource::File(PathBuf::from(log))),
            (id, None) => Err(BackendError::Parse {
                what: "a Slurm handle".into(),
                detail: format!("job {id} has no log file recorded"),
            }),
        }
    }
}
