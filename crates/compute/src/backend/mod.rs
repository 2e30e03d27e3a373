//! The engines that run components, behind one small trait.
//!
//! A backend starts *units* — what the engine restarts on its own: a replica of a
//! component on local processes, Slurm and Ray; a whole component (an Indexed Job) on
//! Kubernetes — and answers where they are. Everything about a group's life (gang
//! start, discovery, recovery by each component's policy, termination delays,
//! preemption, cancel) is the [supervisor](crate::supervisor)'s, the same for every
//! backend; a backend only talks to its engine.
//!
//! | backend | engine call | handle |
//! |---|---|---|
//! | [`local`] | a process group per unit (`bash` with `ulimit`, logs to a file) | pid and exit-code file |
//! | [`slurm`] | `sbatch --parsable`, `squeue --json`, `scancel [--signal]` | job id |
//! | [`ray`] | Jobs REST API: `POST /api/jobs/`, `GET /api/jobs/{id}`, `/stop`, `/logs` | submission id |
//! | [`kubernetes`] | REST: headless Services, Indexed Jobs, Pod logs | Job name |
pub mod kubernetes;
pub mod local;
pub mod ray;
pub mod slurm;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;

use crate::discovery::Addresses;
use crate::spec::{InfraKind, JobGroup, Task};

/// What a backend needs to start one unit.
#[derive(Debug, Clone)]
pub struct UnitLaunch<'a> {
    /// The group.
    pub group: &'a JobGroup,
    /// The component.
    pub task: &'a Task,
    /// The replica (0 for backends whose unit is a whole component).
    pub replica: u32,
    /// Which start of the unit this is, from 0.
    pub attempt: u32,
    /// The launch's id (unique across launches).
    pub job_id: &'a str,
    /// The launch's directory on this machine: logs, discovery files, exit codes.
    pub dir: &'a std::path::Path,
    /// The unit's discovery variables (with placeholder addresses when the backend
    /// learns them only once placed; the discovery file then brings the real ones).
    pub discovery: &'a BTreeMap<String, String>,
    /// The file to wait for before `setup`, when addresses are learned after placement.
    pub discovery_file: Option<PathBuf>,
    /// Seconds to wait for it.
    pub discovery_timeout_seconds: u64,
}

/// What the engine says about a unit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UnitStatus {
    /// Accepted, not running yet (queued, being scheduled).
    Pending,
    /// Accepted, and the engine says it cannot run as asked until someone changes the
    /// cluster or the request (more nodes than the partition has, an unknown account):
    /// it waits for ever otherwise. A launch with another engine to try moves there.
    Unplaceable {
        /// What the engine said.
        reason: String,
    },
    /// Running, on these hosts (one per node).
    Running {
        /// Node addresses, in node-rank order.
        hosts: Vec<String>,
    },
    /// The program ended with this exit code (128 + N for signal N).
    Exited {
        /// The code.
        code: i32,
    },
    /// The engine lost it for reasons not the program's own (node failure, preemption
    /// by the engine, a vanished process): recovery always restarts these.
    Lost {
        /// What the engine said.
        reason: String,
    },
}

/// Where a unit's output is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogSource {
    /// A file on this machine, appended while the unit runs.
    File(PathBuf),
    /// The text, as the engine returned it.
    Text(String),
}

/// Why an engine call failed.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// A command could not be run.
    #[error("could not run `{command}`\nhint: {hint}")]
    Spawn {
        /// The command.
        command: String,
        /// How to fix it.
        hint: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A command ran and failed.
    #[error("`{command}` failed: {stderr}")]
    Command {
        /// The command.
        command: String,
        /// What it printed on stderr.
        stderr: String,
    },
    /// An HTTP call failed.
    #[error("{what} at {url}")]
    Http {
        /// What was asked.
        what: String,
        /// The URL.
        url: String,
        /// The cause.
        #[source]
        source: reqwest::Error,
    },
    /// The engine answered with an error.
    #[error("{what}: the engine answered {status}: {body}")]
    Engine {
        /// What was asked.
        what: String,
        /// The HTTP status.
        status: u16,
        /// Its body (truncated).
        body: String,
    },
    /// The engine's answer could not be read.
    #[error("unexpected answer from {what}: {detail}")]
    Parse {
        /// What was asked.
        what: String,
        /// What was wrong.
        detail: String,
    },
    /// A request could not be built from the spec.
    #[error(transparent)]
    Build(#[from] crate::request::BuildError),
    /// A file could not be read or written.
    #[error("{path}")]
    Io {
        /// The path.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The configuration of the backend is missing something.
    #[error("{what}\nhint: {hint}")]
    Config {
        /// What is wrong.
        what: String,
        /// How to fix it.
        hint: String,
    },
}

impl BackendError {
    pub(crate) fn io(path: impl AsRef<std::path::Path>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.as_ref().display().to_string(),
            source,
        }
    }
}

/// One engine.
///
/// Calls take handles (the strings [`Backend::start`] returned, kept in the state
/// database), so a new process can pick up units an earlier one started.
pub trait Backend: Send + Sync {
    /// Which engine it is.
    fn kind(&self) -> InfraKind;

    /// Whether the engine itself restarts a failed unit by the component's
    /// `job_recovery` (Kubernetes' Job controller); else the supervisor does.
    fn engine_recovers(&self) -> bool {
        false
    }

    /// Whether a unit is a whole component rather than one replica.
    fn unit_is_component(&self) -> bool {
        false
    }

    /// Where every instance will be, when that is known before anything runs (local
    /// ports, Kubernetes DNS names); `None` when the engine places units first, and the
    /// supervisor then writes discovery files once they run.
    fn addresses_up_front(&self, group: &JobGroup) -> Option<Addresses>;

    /// Checks that the engine can run `group` (before anything starts).
    fn check(&self, group: &JobGroup) -> Result<(), BackendError> {
        let _ = group;
        Ok(())
    }

    /// Creates what the whole group shares (Kubernetes: the Services).
    fn prepare(
        &self,
        group: &JobGroup,
        job_id: &str,
    ) -> impl Future<Output = Result<(), BackendError>> + Send {
        let _ = (group, job_id);
        async { Ok(()) }
    }

    /// Starts one unit; returns its handle.
    fn start(
        &self,
        launch: &UnitLaunch<'_>,
    ) -> impl Future<Output = Result<String, BackendError>> + Send;

    /// The status of each handle, in order (one engine call where the engine allows).
    fn poll(
        &self,
        handles: &[String],
    ) -> impl Future<Output = Result<Vec<UnitStatus>, BackendError>> + Send;

    /// Stops a unit: `graceful` sends SIGTERM to the program (so it can checkpoint),
    /// else it is killed.
    fn stop(
        &self,
        handle: &str,
        graceful: bool,
    ) -> impl Future<Output = Result<(), BackendError>> + Send;

    /// Where a unit's output is.
    fn logs(&self, handle: &str) -> impl Future<Output = Result<LogSource, BackendError>> + Send;

    /// Removes what [`Backend::prepare`] created.
    fn cleanup(
        &self,
        group: &JobGroup,
        job_id: &str,
    ) -> impl Future<Output = Result<(), BackendError>> + Send {
        let _ = (group, job_id);
        async { Ok(()) }
    }
}

/// The exit code a shell reports for a process killed by `signal`.
pub fn signal_exit_code(signal: i32) -> i32 {
    128 + signal
}

/// Any of the backends, chosen at run time (`--infra`).
#[derive(Debug)]
pub enum AnyBackend {
    /// Local process groups.
    Local(local::LocalBackend),
    /// The Slurm CLI.
    Slurm(slurm::SlurmBackend),
    /// The Ray Jobs API.
    Ray(ray::RayBackend),
    /// The Kubernetes API.
    Kubernetes(kubernetes::KubernetesBackend),
}

macro_rules! each {
    ($self:ident, $b:ident => $e:expr) => {
        match $self {
            AnyBackend::Local($b) => $e,
            AnyBackend::Slurm($b) => $e,
            AnyBackend::Ray($b) => $e,
            AnyBackend::Kubernetes($b) => $e,
        }
    };
}

impl Backend for AnyBackend {
    fn kind(&self) -> InfraKind {
        each!(self, b => b.kind())
    }

    fn engine_recovers(&self) -> bool {
        each!(self, b => b.engine_recovers())
    }

    fn unit_is_component(&self) -> bool {
        each!(self, b => b.unit_is_component())
    }

    fn addresses_up_front(&self, group: &JobGroup) -> Option<Addresses> {
        each!(self, b => b.addresses_up_front(group))
    }

    fn check(&self, group: &JobGroup) -> Result<(), BackendError> {
        each!(self, b => b.check(group))
    }

    async fn prepare(&self, group: &JobGroup, job_id: &str) -> Result<(), BackendError> {
        each!(self, b => b.prepare(group, job_id).await)
    }

    async fn start(&self, launch: &UnitLaunch<'_>) -> Result<String, BackendError> {
        each!(self, b => b.start(launch).await)
    }

    async fn poll(&self, handles: &[String]) -> Result<Vec<UnitStatus>, BackendError> {
        each!(self, b => b.poll(handles).await)
    }

    async fn stop(&self, handle: &str, graceful: bool) -> Result<(), BackendError> {
        each!(self, b => b.stop(handle, graceful).await)
    }

    async fn logs(&self, handle: &str) -> Result<LogSource, BackendError> {
        each!(self, b => b.logs(handle).await)
    }

    async fn cleanup(&self, group: &JobGroup, job_id: &str) -> Result<(), BackendError> {
        each!(self, b => b.cleanup(group, job_id).await)
    }
}
