//! Components as process groups on this machine.
//!
//! Each unit (a replica) is `bash` running a small wrapper in a process group of its
//! own: the wrapper applies the resource limits (`ulimit`), starts the
//! [entrypoint] in the background with its output appended to the
//! unit's log file, waits for it through any signal, and writes the exit code to a
//! file. So:
//!
//! - stopping is `killpg`: SIGTERM reaches the program (the entrypoint `exec`s it) and
//!   the wrapper, which keeps waiting; SIGKILL after the grace period takes the rest;
//! - the exit code survives the supervisor: a supervisor started later (after
//!   `agentstack` was restarted) reads it from the file, and tells a live unit from a
//!   gone one by its process group;
//! - when the program ends, whatever it left behind in its group is killed, so nothing
//!   outlives its unit.
//!
//! Limits: `memory` is the data limit (`ulimit -d`: heap and private anonymous
//! mappings, so a read-only mmapped model file does not count against it); `cpus`
//! is admission, counted by the supervisor against the machine's CPUs (see
//! [`crate::supervisor::SupervisorSettings::local_cpus`]). Multi-node components do not
//! run locally.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Mutex;

use nix::errno::Errno;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

use super::{Backend, BackendError, LogSource, UnitLaunch, UnitStatus, signal_exit_code};
use crate::discovery::{Addresses, Endpoint};
use crate::entrypoint::{self, EntrypointOptions};
use crate::request::{self, BuildError, shell_quote};
use crate::spec::{InfraKind, JobGroup};

/// The host local components reach each other on.
pub const LOCAL_HOST: &str = "127.0.0.1";

/// Processes on this machine.
#[derive(Debug, Default)]
pub struct LocalBackend {
    /// The wrappers this process started, so it can reap them.
    children: Mutex<HashMap<i32, tokio::process::Child>>,
}

impl LocalBackend {
    /// A backend.
    pub fn new() -> Self {
        Self::default()
    }
}

/// A unit's handle: `<pid> <exit-code file>`.
fn handle(pid: i32, exit_file: &Path) -> String {
    format!("{pid} {}", exit_file.display())
}

fn parse_handle(handle: &str) -> Result<(i32, PathBuf), BackendError> {
    handle
        .split_once(' ')
        .and_then(|(pid, file)| Some((pid.parse().ok()?, PathBuf::from(file))))
        .ok_or_else(|| BackendError::Parse {
            what: "a local handle".into(),
            detail: format!("`{handle}` is not `<pid> <file>`"),
        })
}

/// The unit's log file: `<dir>/logs/<group>-<component>[-<replica>].log`.
pub fn log_file(dir: &Path, name: &str) -> PathBuf {
    dir.join("logs").join(format!("{name}.log"))
}

/// The wrapper: limits, the entrypoint in the background, its exit code to a file.
fn wrapper(launch: &UnitLaunch<'_>, exit_file: &Path) -> String {
    let task = launch.task;
    let mut s = String::new();
    if let Some(bytes) = task.resources.memory_bytes() {
        s.push_str(&format!("ulimit -d {} || exit 1\n", bytes.div_ceil(1024)));
    }
    let script = entrypoint::script(
        task,
        &EntrypointOptions {
            workdir: task.workdir.as_deref(),
            discovery_file: launch.discovery_file.as_deref().and_then(Path::to_str),
            discovery_timeout_seconds: launch.discovery_timeout_seconds,
            rank_from: None,
        },
    );
    s.push_str(&format!(
        "echo \"== agentstack: {} attempt {} started $(date -u +%FT%TZ)\"\n",
        request::instance_name(launch.group, task, launch.replica),
        launch.attempt
    ));
    s.push_str(&format!("bash -c {} &\n", shell_quote(&script)));
    // The wrapper ignores the group's signals, set after the child is started (which
    // keeps the default handling): so `wait` is not cut short, and returns how the
    // program ended.
    s.push_str("child=$!\ntrap '' TERM INT HUP USR1 USR2\nwait \"$child\"\nstatus=$?\n");
    let file = shell_quote(&exit_file.to_string_lossy());
    s.push_str(&format!(
        "echo \"== agentstack: exited with $status\"\necho \"$status\" > {file}.tmp && mv {file}.tmp {file}\nexit \"$status\"\n"
    ));
    s
}

fn group_alive(pid: i32) -> bool {
    // ESRCH: no process in the group; EPERM would mean it exists.
    killpg(Pid::from_raw(pid), None) != Err(Errno::ESRCH)
}

fn kill_group(pid: i32, signal: Signal) {
    // The group may be gone already; nothing else to do then.
    let _ = killpg(Pid::from_raw(pid), signal);
}

impl Backend for LocalBackend {
    fn kind(&self) -> InfraKind {
        InfraKind::Local
    }

    fn addresses_up_front(&self, group: &JobGroup) -> Option<Addresses> {
        Some(
            group
                .components
                .iter()
                .map(|task| {
                    let port = task.resources.main_port();
                    let endpoints = (0..task.replicas)
                        .map(|r| {
                            // Replicas share the host, so each takes the next port.
                            let port = port.map(|p| p.saturating_add(r as u16));
                            Endpoint::new(LOCAL_HOST, port)
                        })
                        .collect();
                    (task.name.clone(), endpoints)
                })
                .collect(),
        )
    }

    fn check(&self, group: &JobGroup) -> Result<(), BackendError> {
        for task in &group.components {
            if task.num_nodes > 1 {
                return Err(BuildError::Unsupported {
                    backend: "local",
                    component: task.name.clone(),
                    what: format!("`num_nodes: {}`", task.num_nodes),
                    hint: "one machine is one node: use `replicas` for copies, or launch on slurm"
                        .into(),
                }
                .into());
            }
            if task.resources.accelerators.is_some() {
                tracing::warn!(component = %task.name, "accelerators are not counted on local: the component sees the machine's devices");
            }
        }
        Ok(())
    }

    async fn start(&self, launch: &UnitLaunch<'_>) -> Result<String, BackendError> {
        let name = request::instance_name(launch.group, launch.task, launch.replica);
        let log = log_file(launch.dir, &name);
        let units = launch.dir.join("units");
        for dir in [log.parent().expect("a log file has a directory"), &units] {
            std::fs::create_dir_all(dir).map_err(|e| BackendError::io(dir, e))?;
        }
        let exit_file = units.join(format!("{name}.{}.exit", launch.attempt));
        let _ = std::fs::remove_file(&exit_file);
        let env = request::environment(launch.task, launch.discovery)?;
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .map_err(|e| BackendError::io(&log, e))?;
        let err = out.try_clone().map_err(|e| BackendError::io(&log, e))?;
        let mut command = tokio::process::Command::new("bash");
        command
            .arg("-c")
            .arg(wrapper(launch, &exit_file))
            .envs(&env)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0);
        let child = command.spawn().map_err(|source| BackendError::Spawn {
            command: "bash".into(),
            hint: "the local backend runs components with bash; install it".into(),
            source,
        })?;
        let pid = child.id().expect("a child that was just spawned has a pid") as i32;
        self.children
            .lock()
            .expect("the children lock is never poisoned")
            .insert(pid, child);
        Ok(handle(pid, &exit_file))
    }

    async fn poll(&self, handles: &[String]) -> Result<Vec<UnitStatus>, BackendError> {
        let mut out = Vec::with_capacity(handles.len());
        for h in handles {
            let (pid, exit_file) = parse_handle(h)?;
            let reaped = {
                let mut children = self.children.lock().expect("never poisoned");
                match children.get_mut(&pid).map(|c| c.try_wait()) {
                    Some(Ok(Some(status))) => {
                        children.remove(&pid);
                        Some(status)
                    }
                    _ => None,
                }
            };
            let written = std::fs::read_to_string(&exit_file)
                .ok()
                .and_then(|t| t.trim().parse::<i32>().ok());
            let status = match (written, reaped) {
                (Some(code), _) => UnitStatus::Exited { code },
                (None, Some(status)) => {
                    use std::os::unix::process::ExitStatusExt;
                    let code = status
                        .code()
                        .or_else(|| status.signal().map(signal_exit_code))
                        .unwrap_or(1);
                    UnitStatus::Exited { code }
                }
                (None, None) if group_alive(pid) => UnitStatus::Running {
                    hosts: vec![LOCAL_HOST.into()],
                },
                (None, None) => UnitStatus::Lost {
                    reason: "its process group is gone and left no exit code".into(),
                },
            };
            if !matches!(status, UnitStatus::Running { .. }) {
                // Nothing the program started may outlive it.
                kill_group(pid, Signal::SIGKILL);
            }
            out.push(status);
        }
        Ok(out)
    }

    async fn stop(&self, handle: &str, graceful: bool) -> Result<(), BackendError> {
        let (pid, _) = parse_handle(handle)?;
        let signal = if graceful {
            Signal::SIGTERM
        } else {
            Signal::SIGKILL
        };
        kill_group(pid, signal);
        Ok(())
    }

    async fn logs(&self, handle: &str) -> Result<LogSource, BackendError> {
        let (_, exit_file) = parse_handle(handle)?;
        // <dir>/units/<name>.<attempt>.exit → <dir>/logs/<name>.log
        let dir = exit_file
            .parent()
            .and_then(Path::parent)
            .ok_or_else(|| BackendError::Parse {
                what: "a local handle".into(),
                detail: handle.into(),
            })?;
        let file = exit_file
            .file_name()
            .map(|f| f.to_string_lossy().into_owned());
        let name = file
            .as_deref()
            .and_then(|f| f.strip_suffix(".exit"))
            .and_then(|f| f.rsplit_once('.'))
            .map(|(name, _)| name.to_owned())
            .unwrap_or_default();
        Ok(LogSource::File(log_file(dir, &name)))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use super::*;

    async fn until_exited(backend: &LocalBackend, h: &str) -> UnitStatus {
        for _ in 0..200 {
            let s = backend.poll(&[h.to_owned()]).await.unwrap().remove(0);
            if !matches!(s, UnitStatus::Running { .. }) {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("{h} still running after 10 s");
    }

    fn launch<'a>(
        group: &'a JobGroup,
        task: &'a crate::spec::Task,
        dir: &'a Path,
        discovery: &'a BTreeMap<String, String>,
    ) -> UnitLaunch<'a> {
        UnitLaunch {
            group,
            task,
            replica: 0,
            attempt: 0,
            job_id: "j",
            dir,
            discovery,
            discovery_file: None,
            discovery_timeout_seconds: 0,
        }
    }

    /// Alive and not a zombie.
    fn process_alive(pid: i32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
            s.rsplit_once(") ")
                .is_some_and(|(_, rest)| !rest.starts_with('Z'))
        })
    }

    #[tokio::test]
    async fn runs_logs_limits_and_stops_a_process_group() {
        let dir = tempfile::tempdir().unwrap();
        let group = JobGroup::parse(
            "name: g\nexecution: parallel\n---\nname: a\nresources: {memory: 64MB}\nenvs: {X: hello}\nrun: |\n  echo \"$X $AGENTSTACK_COMPONENT $(ulimit -d)\"\n  exit 3\n---\nname: b\nrun: |\n  trap 'echo checkpointed; exit 0' TERM\n  (trap '' TERM; exec sleep 300) &\n  echo $! > child.pid\n  while true; do sleep 0.05; done\n",
        )
        .unwrap();
        let backend = LocalBackend::new();
        let addresses = backend.addresses_up_front(&group).unwrap();
        let env_a = crate::discovery::environment(&group, &addresses, "a", 0).unwrap();
        let a = group.component("a").unwrap();
        let h = backend
            .start(&launch(&group, a, dir.path(), &env_a))
            .await
            .unwrap();
        assert_eq!(
            until_exited(&backend, &h).await,
            UnitStatus::Exited { code: 3 }
        );
        let LogSource::File(log) = backend.logs(&h).await.unwrap() else {
            panic!("a local log is a file")
        };
        let text = std::fs::read_to_string(&log).unwrap();
        assert!(text.contains("hello a 65536\n"), "{text}");
        assert!(text.contains("== agentstack: exited with 3"), "{text}");

        // A fresh backend (a restarted supervisor) still reads the exit code.
        assert_eq!(
            LocalBackend::new().poll(&[h]).await.unwrap(),
            [UnitStatus::Exited { code: 3 }]
        );

        let env_b = crate::discovery::environment(&group, &addresses, "b", 0).unwrap();
        let mut b = group.component("b").unwrap().clone();
        b.workdir = Some(dir.path().display().to_string());
        let h = backend
            .start(&launch(&group, &b, dir.path(), &env_b))
            .await
            .unwrap();
        let pid_file = dir.path().join("child.pid");
        for _ in 0..100 {
            if pid_file.exists() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let child: i32 = std::fs::read_to_string(&pid_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(matches!(
            backend.poll(std::slice::from_ref(&h)).await.unwrap()[0],
            UnitStatus::Running { .. }
        ));
        backend.stop(&h, true).await.unwrap();
        let end = until_exited(&backend, &h).await;
        let LogSource::File(log) = backend.logs(&h).await.unwrap() else {
            panic!("a local log is a file")
        };
        let text = std::fs::read_to_string(log).unwrap();
        assert_eq!(end, UnitStatus::Exited { code: 0 }, "{text}");
        assert!(text.contains("checkpointed"), "{text}");
        // What the program left behind (here deaf to SIGTERM) went with its group.
        for _ in 0..50 {
            if !process_alive(child) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("process {child} outlived its unit");
    }
}
