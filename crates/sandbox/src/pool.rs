//! The host side: a pool of warm sandboxes, a concurrency limit and a bounded queue.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::sync::Semaphore;

use crate::job::{Job, Outcome};
use crate::wire::{FileHeader, Hello, INIT_ARG, INIT_NAME, Isolation, JobHeader, Report, Setup};

/// Names the program started as the sandbox's init process, when it is not the
/// current executable (tests, or a library embedding the sandbox in another binary).
/// The program must call [`run_if_init`](crate::run_if_init) first thing in `main`.
pub const INIT_PROGRAM_ENV: &str = agentstack_static::env_vars::AGENTSTACK_SANDBOX_INIT;

/// How long a sandbox may take to isolate itself.
const SETUP_TIMEOUT: Duration = Duration::from_secs(20);
/// Slack over a job's wall-time limit before the host gives up on its init process.
const REPORT_GRACE: Duration = Duration::from_secs(10);

/// How sandboxes are made and how many run at once.
#[derive(Debug, Clone)]
pub struct SandboxConfig {
    /// Isolation; [`Isolation::UnsafeNone`] only when asked for explicitly.
    pub isolation: Isolation,
    /// The init program; `AGENTSTACK_SANDBOX_INIT` or the current executable if unset.
    pub program: Option<PathBuf>,
    /// Sandboxes kept isolated and waiting, so a run starts in milliseconds.
    pub warm: usize,
    /// Runs at once; more wait in the queue.
    pub max_concurrent: usize,
    /// Runs that may wait; more are refused with [`Error::Busy`].
    pub max_queued: usize,
    /// Extra host paths visible read-only at the same place (an interpreter installed
    /// outside `/usr`, a virtual environment). Not under `/work`, `/tmp`, `/proc`, `/dev`.
    pub read_only: Vec<PathBuf>,
    /// The host uid and gid sandboxes run as when the host runs as root (`nobody`).
    pub unprivileged_id: u32,
    /// Make the init program (this stack's own binary) runnable inside, read-only, at
    /// [`PROGRAM_IN_SANDBOX`](crate::PROGRAM_IN_SANDBOX), so a job can use its tools (e.g. validate a package it
    /// serves) without the host's paths. It is bound from a hard link (or a copy) in a
    /// private temporary directory that lives as long as the pool, so that not even
    /// `/proc/self/mountinfo` shows where the program lives on the host.
    pub expose_program: bool,
}

impl Default for SandboxConfig {
    fn default() -> Self {
        Self {
            isolation: Isolation::Namespaces,
            program: None,
            warm: 2,
            max_concurrent: 8,
            max_queued: 1024,
            read_only: Vec::new(),
            unprivileged_id: 65534,
            expose_program: false,
        }
    }
}

/// What can go wrong running a job.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The job is malformed; nothing ran.
    #[error("invalid job: {0}")]
    InvalidJob(String),
    /// The configuration is unusable.
    #[error("invalid sandbox configuration: {0}")]
    InvalidConfig(String),
    /// This machine does not allow the isolation asked for.
    #[error("sandbox isolation is not available: {step} failed: {message}\nhint: {hint}")]
    Unavailable {
        /// The step that failed.
        step: String,
        /// The system's error.
        message: String,
        /// What to do about it.
        hint: String,
    },
    /// The queue is full.
    #[error(
        "the sandbox is busy: {queued} runs are already waiting; retry later or raise the queue size"
    )]
    Busy {
        /// Runs waiting.
        queued: usize,
    },
    /// The init program could not be started.
    #[error("could not start the sandbox's init program {program}")]
    Spawn {
        /// The program.
        program: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The init process broke off or answered nonsense.
    #[error("the sandbox's init process failed: {0}")]
    Init(String),
}

struct Warm {
    child: Child,
    stdin: ChildStdin,
    stdout: ChildStdout,
}

struct Inner {
    config: SandboxConfig,
    program: PathBuf,
    /// The [`Setup`], encoded as its header.
    setup: Vec<u8>,
    /// What sandboxes that expose `program` bind; the path went into `setup`.
    #[expect(dead_code, reason = "held so the link lives as long as the pool")]
    exposed: Option<ExposedProgram>,
    warm: Mutex<Vec<Warm>>,
    permits: Semaphore,
    waiting: AtomicUsize,
    refilling: AtomicBool,
}

/// Runs jobs in fresh sandboxes, each used once. Cheap to clone.
#[derive(Clone)]
pub struct Sandbox {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Sandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sandbox")
            .field("isolation", &self.inner.config.isolation)
            .field("program", &self.inner.program)
            .finish_non_exhaustive()
    }
}

impl Sandbox {
    /// Checks that this machine allows the isolation asked for, by isolating one
    /// sandbox, and fills the warm pool. Fails with [`Error::Unavailable`] and a hint
    /// when it does not; never falls back to less isolation.
    pub async fn start(config: SandboxConfig) -> Result<Self, Error> {
        if config.max_concurrent == 0 {
            return Err(Error::InvalidConfig(
                "max_concurrent must be at least 1".into(),
            ));
        }
        for path in &config.read_only {
            // The sandbox's own /work, /tmp, /proc and /dev would hide it.
            let reserved = ["/work", "/tmp", "/proc", "/dev"];
            if !path.is_absolute()
                || path == Path::new("/")
                || reserved.iter().any(|r| path.starts_with(r))
            {
                return Err(Error::InvalidConfig(format!(
                    "read-only path {} must be absolute and not /, nor under {}",
                    path.display(),
                    reserved.join(", ")
                )));
            }
        }
        let program = match &config.program {
            Some(program) => program.clone(),
            None => match std::env::var_os(INIT_PROGRAM_ENV) {
                Some(program) => PathBuf::from(program),
                None => std::env::current_exe().map_err(|source| Error::Spawn {
                    program: PathBuf::from("(current executable)"),
                    source,
                })?,
            },
        };
        let exposed = if config.expose_program && config.isolation == Isolation::Namespaces {
            Some(
                ExposedProgram::new(&program).map_err(|source| Error::Spawn {
                    program: program.clone(),
                    source,
                })?,
            )
        } else {
            None
        };
        let setup = crate::wire::encode_header(&Setup {
            isolation: config.isolation,
            read_only: config.read_only.clone(),
            unprivileged_id: config.unprivileged_id,
            exposed_program: exposed.as_ref().map(|exposed| exposed.path.clone()),
        });
        let inner = Arc::new(Inner {
            permits: Semaphore::new(config.max_concurrent),
            config,
            program,
            setup,
            exposed,
            warm: Mutex::new(Vec::new()),
            waiting: AtomicUsize::new(0),
            refilling: AtomicBool::new(false),
        });
        let first = inner.spawn().await?;
        inner.warm.lock().expect("pool lock").push(first);
        Inner::refill(&inner);
        Ok(Self { inner })
    }

    /// How this sandbox isolates.
    pub fn isolation(&self) -> Isolation {
        self.inner.config.isolation
    }

    /// Sandboxes isolated and waiting right now.
    pub fn warm_now(&self) -> usize {
        self.inner.warm.lock().expect("pool lock").len()
    }

    /// Runs one job in a fresh sandbox, waiting in the queue if the concurrency limit
    /// is reached.
    pub async fn run(&self, job: &Job) -> Result<Outcome, Error> {
        job.validate().map_err(Error::InvalidJob)?;
        let inner = &self.inner;
        let waiting = inner.waiting.fetch_add(1, Ordering::SeqCst);
        if inner.permits.available_permits() == 0 && waiting >= inner.config.max_queued {
            inner.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(Error::Busy { queued: waiting });
        }
        let permit = inner.permits.acquire().await;
        inner.waiting.fetch_sub(1, Ordering::SeqCst);
        let _permit = permit.expect("the semaphore is never closed");
        // A warm sandbox that died while waiting is replaced once.
        let mut retried = false;
        loop {
            let warm = inner.warm.lock().expect("pool lock").pop();
            let fresh = warm.is_none();
            let warm = match warm {
                Some(warm) => warm,
                None => inner.spawn().await?,
            };
            Inner::refill(inner);
            match inner.exchange(warm, job).await {
                Err(Exchange::NotDelivered(_)) if !retried && !fresh => retried = true,
                Err(Exchange::NotDelivered(e) | Exchange::Failed(e)) => return Err(e),
                Ok(outcome) => return Ok(outcome),
            }
        }
    }
}

enum Exchange {
    /// The job never reached the init process.
    NotDelivered(Error),
    /// It did, and then something broke.
    Failed(Error),
}

impl Inner {
    async fn spawn(&self) -> Result<Warm, Error> {
        let mut command = Command::new(&self.program);
        command
            // The command sees its pid 1's argv: a neutral name, not the host's path.
            .arg0(INIT_NAME)
            .arg(INIT_ARG)
            // Nothing of the host's environment reaches a sandbox.
            .env_clear()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let spawn_error = |source| Error::Spawn {
            program: self.program.clone(),
            source,
        };
        let mut child = command.spawn().map_err(spawn_error)?;
        let mut stdin = child.stdin.take().expect("piped stdin");
        let mut stdout = child.stdout.take().expect("piped stdout");
        let hello = tokio::time::timeout(SETUP_TIMEOUT, async {
            stdin.write_all(&self.setup).await?;
            stdin.flush().await?;
            read_header::<Hello>(&mut stdout).await
        })
        .await;
        match hello {
            Ok(Ok(Some(Hello::Ready))) => Ok(Warm {
                child,
                stdin,
                stdout,
            }),
            Ok(Ok(Some(Hello::Failed { step, message }))) => Err(Error::Unavailable {
                hint: hint_for(&step, &message),
                step,
                message,
            }),
            Ok(Ok(None) | Err(_)) => {
                let mut stderr = String::new();
                if let Some(mut err) = child.stderr.take() {
                    let _ = tokio::time::timeout(
                        Duration::from_secs(2),
                        err.read_to_string(&mut stderr),
                    )
                    .await;
                }
                Err(Error::Init(format!(
                    "{} did not start as a sandbox init process ({}); it must call agentstack_sandbox::run_if_init() first in main, or set {INIT_PROGRAM_ENV} to the agentstack binary",
                    self.program.display(),
                    first_line(&stderr).unwrap_or("no message"),
                )))
            }
            Err(_) => Err(Error::Init(format!(
                "isolating a sandbox took more than {SETUP_TIMEOUT:?}"
            ))),
        }
    }

    /// Tops the pool up in the background, one sandbox at a time.
    fn refill(inner: &Arc<Self>) {
        if inner.config.warm == 0 || inner.refilling.swap(true, Ordering::SeqCst) {
            return;
        }
        let inner = Arc::clone(inner);
        tokio::spawn(async move {
            while inner.warm.lock().expect("pool lock").len() < inner.config.warm {
                match inner.spawn().await {
                    Ok(warm) => inner.warm.lock().expect("pool lock").push(warm),
                    Err(e) => {
                        tracing::warn!("could not refill the sandbox pool: {e}");
                        break;
                    }
                }
            }
            inner.refilling.store(false, Ordering::SeqCst);
        });
    }

    async fn exchange(&self, mut warm: Warm, job: &Job) -> Result<Outcome, Exchange> {
        let header = JobHeader {
            argv: job.argv.clone(),
            env: job.env.clone(),
            limits: job.limits,
            stdin_len: job.stdin.len() as u64,
            files: job
                .files
                .iter()
                .map(|f| FileHeader {
                    path: f.path.clone(),
                    len: f.contents.len() as u64,
                    executable: f.executable,
                })
                .collect(),
        };
        let not_delivered = |e: std::io::Error| {
            Exchange::NotDelivered(Error::Init(format!("could not send the job: {e}")))
        };
        warm.stdin
            .write_all(&crate::wire::encode_header(&header))
            .await
            .map_err(not_delivered)?;
        warm.stdin
            .write_all(&job.stdin)
            .await
            .map_err(not_delivered)?;
        for file in &job.files {
            warm.stdin
                .write_all(&file.contents)
                .await
                .map_err(not_delivered)?;
        }
        warm.stdin.flush().await.map_err(not_delivered)?;
        let failed = |what: String| Exchange::Failed(Error::Init(what));
        let deadline = job.limits.wall + REPORT_GRACE;
        let received = tokio::time::timeout(deadline, async {
            let report = read_header::<Report>(&mut warm.stdout)
                .await
                .map_err(|e| e.to_string())?
                .ok_or_else(|| "it exited without a report".to_owned())?;
            let mut stdout = vec![0u8; report.stdout_len as usize];
            let mut stderr = vec![0u8; report.stderr_len as usize];
            warm.stdout
                .read_exact(&mut stdout)
                .await
                .map_err(|e| e.to_string())?;
            warm.stdout
                .read_exact(&mut stderr)
                .await
                .map_err(|e| e.to_string())?;
            Ok::<_, String>((report, stdout, stderr))
        })
        .await;
        // The init process exits after its one job; make sure of it.
        drop(warm.stdin);
        if tokio::time::timeout(Duration::from_secs(5), warm.child.wait())
            .await
            .is_err()
        {
            let _ = warm.child.kill().await;
        }
        let (report, stdout, stderr) = match received {
            Ok(Ok(received)) => received,
            Ok(Err(e)) => return Err(failed(e)),
            Err(_) => return Err(failed(format!("no report within {deadline:?}"))),
        };
        if let Some(error) = report.error {
            return Err(failed(error));
        }
        Ok(Outcome {
            end: report.end,
            stdout,
            stderr,
            stdout_truncated: report.stdout_truncated,
            stderr_truncated: report.stderr_truncated,
            usage: report.usage,
        })
    }
}

async fn read_header<T: serde::de::DeserializeOwned>(
    input: &mut ChildStdout,
) -> std::io::Result<Option<T>> {
    let mut prefix = [0u8; 4];
    match input.read_exact(&mut prefix).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let mut body = vec![0u8; crate::wire::header_len(prefix)?];
    input.read_exact(&mut body).await?;
    crate::wire::decode_header(&body).map(Some)
}

/// The init program as sandboxes that expose it bind it: a hard link (or, across file
/// systems, a copy) under a neutral name in a private temporary directory. A bind of
/// the program itself would show its host path in the sandbox's `/proc/self/mountinfo`
/// (a bind mount's root is the file's path within its file system); this shows only
/// the temporary one. One link serves every sandbox of a pool, and goes with it; the
/// links of processes that died without dropping their pool go at the next start.
struct ExposedProgram {
    dir: PathBuf,
    path: PathBuf,
}

/// Names the directories of [`ExposedProgram`]: `<prefix><pid>-<pool>`.
const EXPOSED_DIR_PREFIX: &str = "agentstack-exposed-";

impl ExposedProgram {
    fn new(program: &Path) -> std::io::Result<Self> {
        static POOLS: AtomicUsize = AtomicUsize::new(0);
        let temp = std::env::temp_dir();
        remove_dead_processes_links(&temp);
        let dir = temp.join(format!(
            "{EXPOSED_DIR_PREFIX}{}-{}",
            std::process::id(),
            POOLS.fetch_add(1, Ordering::SeqCst)
        ));
        // Left by an earlier process with this pid, if any.
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir)?;
        let exposed = Self {
            path: dir.join("agentstack"),
            dir,
        };
        if std::fs::hard_link(program, &exposed.path).is_err() {
            std::fs::copy(program, &exposed.path)?;
        }
        Ok(exposed)
    }
}

/// Removes the [`ExposedProgram`] directories under `temp` whose process is gone
/// (killed, or exited without dropping its pool).
fn remove_dead_processes_links(temp: &Path) {
    let Ok(entries) = std::fs::read_dir(temp) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|name| name.strip_prefix(EXPOSED_DIR_PREFIX))
            .and_then(|rest| rest.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new("/proc").join(pid.to_string()).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

impl Drop for ExposedProgram {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn first_line(text: &str) -> Option<&str> {
    text.lines().map(str::trim).find(|l| !l.is_empty())
}

/// What to do when a set-up step fails.
fn hint_for(step: &str, message: &str) -> String {
    let dev_only = "for development only, `--unsafe-no-isolation` runs commands without isolation";
    if step.contains("namespaces") {
        format!(
            "this kernel refuses unprivileged user namespaces ({message}). Allow them: `sysctl -w user.max_user_namespaces=15000`, `sysctl -w kernel.unprivileged_userns_clone=1` (Debian), or `sysctl -w kernel.apparmor_restrict_unprivileged_userns=0` (Ubuntu 24.04+); inside a container, run it with user namespaces allowed (e.g. a seccomp profile that permits unshare); a chroot cannot create them at all (the kernel refuses a process whose root is not its mount namespace's): use a container or `unshare --mount` with `pivot_root`. {dev_only}"
        )
    } else if step.contains("unprivileged") || step.contains("groups") {
        format!(
            "could not drop root privileges to the unprivileged id; pick another with the sandbox configuration. {dev_only}"
        )
    } else {
        format!(
            "the kernel refused a step of isolation; run with AGENTSTACK_LOG=debug and report it. {dev_only}"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposed_programs_are_linked_and_cleaned_up() {
        let program = std::env::current_exe().unwrap();
        let exposed = ExposedProgram::new(&program).unwrap();
        let dir = exposed.dir.clone();
        assert!(!exposed.path.starts_with(program.parent().unwrap()));
        assert_eq!(
            std::fs::read(&exposed.path).unwrap().len() as u64,
            program.metadata().unwrap().len()
        );
        drop(exposed);
        assert!(!dir.exists());
        // A dead process's directory goes at the next start; a live one's stays.
        let temp = std::env::temp_dir().join(format!("exposed-test-{}", std::process::id()));
        // Beyond any pid_max: never alive.
        let dead = temp.join(format!("{EXPOSED_DIR_PREFIX}999999999-0"));
        let alive = temp.join(format!("{EXPOSED_DIR_PREFIX}{}-7", std::process::id()));
        let other = temp.join("agentstack-sandbox-999999999");
        for dir in [&dead, &alive, &other] {
            std::fs::create_dir_all(dir).unwrap();
        }
        remove_dead_processes_links(&temp);
        let left = (dead.exists(), alive.exists(), other.exists());
        let _ = std::fs::remove_dir_all(&temp);
        assert_eq!(left, (false, true, true));
    }

    #[test]
    fn refusals_say_what_to_change() {
        let hint = hint_for(
            "create user, mount, network, IPC, UTS and cgroup namespaces",
            "Operation not permitted (os error 1)",
        );
        assert!(hint.contains("max_user_namespaces") && hint.contains("--unsafe-no-isolation"));
        let hint = hint_for("switch to the unprivileged user", "EPERM");
        assert!(hint.contains("unprivileged id"));
    }
}
