//! A launch's life, the same on every backend: gang start, service discovery, recovery
//! of each unit by its component's `job_recovery`, auxiliary components stopped
//! `termination_delay` after the primaries finish, preemption on local, cancel.
//!
//! All of it lives in the [state database](crate::state): every tick the supervisor
//! reads the launch, asks the engine about the units it has started, writes what
//! changed and acts on it. So a supervisor that dies loses nothing: another one (a
//! restarted `agentstack`) picks the launch up where it was, and `agentstack cancel`
//! from another process is a flag in the database.
//!
//! Recovery follows SkyPilot: a unit the engine lost (not the program's own failure)
//! always starts again; an exit code in `recover_on_exit_codes` starts it again without
//! counting; any other non-zero code starts it again while `max_restarts_on_errors`
//! allows; without `job_recovery` nothing is restarted. A unit that fails past its
//! policy fails the launch, which then stops everything else.
//!
//! Preemption (local): units hold their `cpus` out of the machine's. A unit that does
//! not fit stops running units of lower priority (SIGTERM: the program checkpoints and
//! exits), waits for them to go, and starts; the preempted units wait, and start again
//! (without counting a restart) when there is room — a trainer resumes from its
//! checkpoint.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

use agentstack_serve::auth::ApiKey;

use crate::backend::{Backend, BackendError, UnitLaunch, UnitStatus};
use crate::balancer::{Balancer, BalancerConfig, Policy, Replica};
use crate::discovery::{self, Addresses, Endpoint, SKYPILOT_NODE_IPS, SKYPILOT_NODE_RANK};
use crate::request;
use crate::spec::{GroupRecovery, InfraKind, JobGroup, LoadBalancingPolicy, SpecError, Task};
use crate::state::{
    Admission, JobRecord, JobState, NewUnit, StateError, Store, UnitRecord, UnitState, UnitUpdate,
    now_ms,
};

/// Why a launch whose components all ended is stopping; the one way to success.
const EVERYTHING_FINISHED: &str = "every component finished";

/// How long a ready replica may fail every probe before it is replaced, when its
/// `consecutive_failure_threshold_timeout` does not say.
pub const DEFAULT_FAILURE_THRESHOLD_SECONDS: f64 = 180.0;

/// How often a replica that is not ready yet is probed, at most: a replacement takes
/// traffic within this long of answering its probe.
pub const NOT_READY_PROBE_INTERVAL: Duration = Duration::from_millis(500);

/// Where a service's load balancer listens when the launch does not say.
pub const DEFAULT_SERVICE_HOST: &str = "127.0.0.1";

/// How a supervisor paces itself.
#[derive(Debug, Clone)]
pub struct SupervisorSettings {
    /// The address services' load balancers listen on (with each `service.ports`).
    pub service_host: String,
    /// Time between looks at the engine.
    pub poll_interval: Duration,
    /// Time from SIGTERM to SIGKILL when stopping a unit: the time to checkpoint.
    pub stop_grace: Duration,
    /// Time every unit has to run at the first start (gang start), else the launch fails.
    pub start_timeout: Duration,
    /// Seconds a unit waits for its discovery file.
    pub discovery_timeout_seconds: u64,
    /// CPUs of this machine that local units may hold.
    pub local_cpus: f64,
    /// Where the supervisor reads the time from.
    pub clock: Clock,
}

/// Where a supervisor reads the time from. Its deadlines (gang start, termination
/// delays, stop grace, readiness probes) are times in the state database, milliseconds
/// since the Unix epoch, so that another process can pick a launch up.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Clock {
    /// The system's clock, the one every other process writes into the database.
    #[default]
    System,
    /// Tokio's clock, set to the system's time when the supervisor is made: it moves
    /// only with the runtime's time, so a test that pauses time
    /// (`#[tokio::test(start_paused = true)]`, `tokio::time::advance`) steps through
    /// timeouts, delays and restarts without waiting for them.
    Runtime,
}

impl Default for SupervisorSettings {
    fn default() -> Self {
        Self {
            service_host: DEFAULT_SERVICE_HOST.into(),
            poll_interval: Duration::from_millis(100),
            stop_grace: Duration::from_secs(10),
            start_timeout: Duration::from_secs(600),
            discovery_timeout_seconds: 600,
            local_cpus: std::thread::available_parallelism().map_or(1, |n| n.get()) as f64,
            clock: Clock::System,
        }
    }
}

/// Why supervising failed (the launch itself failing is a state, not an error).
#[derive(Debug, thiserror::Error)]
pub enum SuperviseError {
    /// The state database.
    #[error(transparent)]
    State(#[from] StateError),
    /// The engine.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The stored spec no longer parses.
    #[error("the stored spec of launch {0}")]
    Spec(String, #[source] SpecError),
    /// No such launch.
    #[error("there is no launch {0}")]
    NoJob(String),
    /// The group can never fit.
    #[error(
        "`{group}` needs {need} CPUs at once, and local has {capacity}\nhint: lower `resources.cpus`, or set AGENTSTACK_LOCAL_CPUS to share the CPUs anyway"
    )]
    TooLarge {
        /// The group.
        group: String,
        /// CPUs the group needs.
        need: f64,
        /// CPUs there are.
        capacity: f64,
    },
}

/// Records a new launch of `group` on `backend`'s engine, in a directory under
/// `jobs_dir`, ready for a [`Supervisor`].
pub async fn create_launch<B: Backend>(
    store: &Store,
    backend: &B,
    group: &JobGroup,
    jobs_dir: &Path,
    options: &serde_json::Value,
    settings: &SupervisorSettings,
) -> Result<JobRecord, SuperviseError> {
    create_launch_on(
        store,
        std::slice::from_ref(backend),
        &[],
        group,
        jobs_dir,
        options,
        settings,
    )
    .await
}

/// Records a new launch of `group` on the first of `backends` (in order of preference,
/// one per engine) that can run it; the rest are where a [`Supervisor`] made
/// [`with_backends`](Supervisor::with_backends) moves it when that engine refuses or
/// cannot place it. An engine whose check fails is passed over, and the launch's
/// `placement` says why (after `unavailable`: engines the caller could not reach, one
/// `engine: why` line each); when none passes, the first's error is returned.
pub async fn create_launch_on<B: Backend>(
    store: &Store,
    backends: &[B],
    unavailable: &[String],
    group: &JobGroup,
    jobs_dir: &Path,
    options: &serde_json::Value,
    settings: &SupervisorSettings,
) -> Result<JobRecord, SuperviseError> {
    let mut passed_over: Vec<String> = unavailable.to_vec();
    let mut first_error = None;
    let mut chosen = None;
    for backend in backends {
        match backend.check(group) {
            Ok(()) => {
                chosen = Some(backend);
                break;
            }
            Err(e) => {
                passed_over.push(format!("{}: {}", backend.kind(), summary(&e)));
                first_error.get_or_insert(e);
            }
        }
    }
    let Some(backend) = chosen else {
        return Err(first_error
            .map(SuperviseError::Backend)
            .unwrap_or_else(|| SuperviseError::NoJob("no engine given".into())));
    };
    let local = backend.kind() == InfraKind::Local;
    let mut units: Vec<NewUnit> = Vec::new();
    for task in &group.components {
        let replicas = if backend.unit_is_component() {
            1
        } else {
            task.replicas
        };
        // Kept on every engine: a launch that fails over to local needs them there.
        let cpus = task.resources.cpus.map_or(0.0, |c| c.count);
        for r in 0..replicas {
            units.push((
                task.name.clone(),
                r,
                task.resources.priority.unwrap_or(0),
                cpus,
            ));
        }
    }
    let need: f64 = units.iter().map(|u| u.3).sum();
    if local && need > settings.local_cpus + 1e-9 {
        return Err(SuperviseError::TooLarge {
            group: group.name.clone(),
            need,
            capacity: settings.local_cpus,
        });
    }
    let id = format!(
        "{}-{}",
        group.name,
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let dir = jobs_dir.join(&id);
    std::fs::create_dir_all(&dir).map_err(|e| BackendError::io(&dir, e))?;
    let record = JobRecord {
        id,
        name: group.name.clone(),
        infra: backend.kind(),
        spec: group.to_yaml(),
        state: JobState::Starting,
        cancel_requested: false,
        message: None,
        supervisor_pid: None,
        heartbeat_ms: None,
        dir: dir.display().to_string(),
        created_ms: now_ms(),
        running_ms: None,
        ended_ms: None,
        options: options.to_string(),
        infra_order: backends.iter().map(Backend::kind).collect(),
        placement: (!passed_over.is_empty()).then(|| passed_over.join("\n")),
        gang_ms: None,
        recovering_ms: None,
        recoveries: 0,
    };
    store.insert_job(&record, &units).await?;
    Ok(record)
}

/// The first line of a text, for one-line notes.
fn one_line(text: &str) -> String {
    text.lines().next().unwrap_or_default().trim().to_owned()
}

/// An error and its causes on one line (each one's first line; hints left out), for
/// the launch's notes: `submitting a Ray job at URL: error sending request: ...`.
fn summary(error: &dyn std::error::Error) -> String {
    let mut parts = vec![one_line(&error.to_string())];
    let mut cause = error.source();
    while let Some(c) = cause {
        parts.push(one_line(&c.to_string()));
        cause = c.source();
    }
    parts.join(": ")
}

/// Runs one launch to its end.
pub struct Supervisor<B> {
    store: Store,
    /// One per engine, in the launch's order of preference; `current` is the one the
    /// launch is on.
    backends: Vec<B>,
    current: std::sync::atomic::AtomicUsize,
    settings: SupervisorSettings,
    job_id: String,
    group: JobGroup,
    dir: PathBuf,
    http: reqwest::Client,
    /// Per unit and attempt: when it was last probed and last answered, ms.
    probes: std::sync::Mutex<HashMap<(String, u32, u32), Probed>>,
    /// Whether this tick started a unit: the next tick then comes at once, so a unit
    /// that starts quickly is seen running a poll interval sooner.
    started: std::sync::atomic::AtomicBool,
    /// The system's time and Tokio's when the supervisor was made ([`Clock::Runtime`]).
    made: (i64, tokio::time::Instant),
    /// Per `service` component: its load balancer and the replicas it was last given;
    /// `None` until they are started.
    balancers: std::sync::Mutex<Option<Services>>,
    /// Dropped (or set) when the supervisor ends: the load balancers stop.
    stop_balancers: tokio::sync::watch::Sender<bool>,
}

/// Per `service` component: its load balancer and the replicas it was last given.
type Services = BTreeMap<String, (Balancer, Vec<Replica>)>;

#[derive(Debug, Clone, Copy, Default)]
struct Probed {
    last_probe_ms: i64,
    last_ok_ms: Option<i64>,
}

/// What a look at the engine found besides the units' states.
#[derive(Debug, Default)]
struct Observed {
    /// A unit's end began a group recovery.
    began_recovery: bool,
    /// A unit the engine says it cannot place (`component/replica: why`).
    unplaceable: Option<String>,
}

/// How one unit ended, and what its policy says.
enum Verdict {
    Succeeded,
    Restart { counted: bool, why: String },
    Failed(String),
}

impl<B: Backend> Supervisor<B> {
    /// A supervisor for the launch `job_id`.
    pub async fn new(
        store: Store,
        backend: B,
        settings: SupervisorSettings,
        job_id: &str,
    ) -> Result<Self, SuperviseError> {
        Self::with_backends(store, vec![backend], settings, job_id).await
    }

    /// A supervisor for the launch `job_id` that may move it between engines:
    /// `backends` in the launch's order of preference ([`create_launch_on`]'s), one per
    /// engine. When the engine the launch is on refuses a unit of its first start, or
    /// does not run every unit within the start timeout, what it started is stopped
    /// and the launch is placed on the next.
    pub async fn with_backends(
        store: Store,
        backends: Vec<B>,
        settings: SupervisorSettings,
        job_id: &str,
    ) -> Result<Self, SuperviseError> {
        let job = store
            .job(job_id)
            .await?
            .ok_or_else(|| SuperviseError::NoJob(job_id.to_owned()))?;
        let group =
            JobGroup::parse(&job.spec).map_err(|e| SuperviseError::Spec(job.id.clone(), e))?;
        let current = backends
            .iter()
            .position(|b| b.kind() == job.infra)
            .ok_or_else(|| {
                SuperviseError::Backend(BackendError::Config {
                    what: format!(
                        "launch {} is on {}, and no backend for it was given",
                        job.id, job.infra
                    ),
                    hint: "give the supervisor a backend for every engine in the launch's order"
                        .into(),
                })
            })?;
        Ok(Self {
            store,
            backends,
            current: current.into(),
            settings,
            job_id: job.id,
            group,
            dir: PathBuf::from(job.dir),
            http: reqwest::Client::new(),
            probes: std::sync::Mutex::default(),
            started: std::sync::atomic::AtomicBool::new(false),
            made: (now_ms(), tokio::time::Instant::now()),
            balancers: std::sync::Mutex::default(),
            stop_balancers: tokio::sync::watch::Sender::new(false),
        })
    }

    /// The engine the launch is on.
    pub fn backend(&self) -> &B {
        &self.backends[self.current.load(std::sync::atomic::Ordering::Relaxed)]
    }

    /// Whether the engine restarts failed units itself: Kubernetes' Job controller,
    /// for members recovered one at a time (a group recovery is the supervisor's).
    fn engine_recovers(&self) -> bool {
        self.backend().engine_recovers() && self.group.recovery == GroupRecovery::Member
    }

    /// Supervises until the launch ends; returns how it ended.
    pub async fn run(&self) -> Result<JobState, SuperviseError> {
        let span = tracing::info_span!("launch", id = %self.job_id, infra = %self.backend().kind());
        let _enter = span.enter();
        loop {
            let stepped = self.step().await;
            if !matches!(stepped, Ok(None)) {
                self.stop_balancers.send_replace(true);
            }
            if let Some(end) = stepped? {
                return Ok(end);
            }
            if !self
                .started
                .swap(false, std::sync::atomic::Ordering::Relaxed)
            {
                tokio::time::sleep(self.settings.poll_interval).await;
            }
        }
    }

    /// One look at the launch: a heartbeat, then the engine asked and what changed
    /// acted on. Returns how the launch ended once it has. [`run`](Self::run) steps every
    /// `poll_interval`; a test steps itself, between moves of a paused clock.
    pub async fn step(&self) -> Result<Option<JobState>, SuperviseError> {
        self.store
            .heartbeat(&self.job_id, std::process::id())
            .await?;
        let job = self
            .store
            .job(&self.job_id)
            .await?
            .ok_or_else(|| SuperviseError::NoJob(self.job_id.clone()))?;
        if job.state.is_terminal() {
            return Ok(Some(job.state));
        }
        if let Err(e) = self.tick(&job).await {
            // An engine that does not answer for a moment is not the end of the
            // launch; the next tick asks again.
            match e {
                // Errors that another try will not mend end the launch (what runs
                // is stopped).
                SuperviseError::Backend(BackendError::Build(_) | BackendError::Config { .. }) => {
                    let message = format!("cannot go on: {e}");
                    tracing::warn!(%message, "stopping the launch");
                    self.store
                        .set_job_state(&self.job_id, JobState::Stopping, Some(&message))
                        .await?;
                }
                SuperviseError::Backend(e) => tracing::warn!(error = %e, "engine call failed"),
                e => return Err(e),
            }
        }
        Ok(None)
    }

    /// Now on the supervisor's [`Clock`], ms since the Unix epoch.
    fn now_ms(&self) -> i64 {
        match self.settings.clock {
            Clock::System => now_ms(),
            Clock::Runtime => self.made.0 + self.made.1.elapsed().as_millis() as i64,
        }
    }

    fn task(&self, component: &str) -> &Task {
        self.group
            .component(component)
            .expect("units are made from the group's components")
    }

    async fn update(&self, u: &UnitRecord, update: UnitUpdate) -> Result<(), StateError> {
        self.store
            .update_unit(&u.job_id, &u.component, u.replica, &update)
            .await
    }

    async fn tick(&self, job: &JobRecord) -> Result<(), SuperviseError> {
        let observed = self.observe(job).await?;
        let job = &if observed.began_recovery {
            // A group recovery began: what follows acts on it.
            self.store
                .job(&self.job_id)
                .await?
                .ok_or_else(|| SuperviseError::NoJob(self.job_id.clone()))?
        } else {
            job.clone()
        };
        let units = self.store.units(&self.job_id).await?;
        let now = self.now_ms();
        let winding_down = job.cancel_requested || job.state == JobState::Stopping;

        if winding_down {
            return self.wind_down(job, &units, now).await;
        }
        if let Some(failed) = units.iter().find(|u| u.state == UnitState::Failed) {
            let message = format!(
                "component `{}` failed: {}",
                failed.component,
                failed.message.as_deref().unwrap_or("no reason given")
            );
            tracing::warn!(%message, "stopping the launch");
            self.store
                .set_job_state(&self.job_id, JobState::Stopping, Some(&message))
                .await?;
            return Ok(());
        }
        if self.group.recovery == GroupRecovery::Group
            && self.recover_group(job, &units, now).await?
        {
            return Ok(());
        }
        if let Some(why) = &observed.unplaceable
            && job.state == JobState::Starting
            && job.running_ms.is_none()
            && job.recoveries == 0
            && job.next_infra().is_some()
        {
            return self
                .fail_over(job, &units, &format!("it cannot place the group: {why}"))
                .await;
        }
        if job.state == JobState::Starting {
            if units
                .iter()
                .all(|u| matches!(u.state, UnitState::Running | UnitState::Succeeded))
                && units.iter().any(|u| u.state == UnitState::Running)
            {
                let message = (job.recoveries > 0 || job.gang_ms.is_some()).then(|| {
                    let took = (now - job.gang_started_ms()) as f64 / 1000.0;
                    if job.recoveries > 0 {
                        format!("group recovery {}: every member running again {took:.1} s after its start", job.recoveries)
                    } else {
                        format!("every unit running on {}, {took:.1} s after it was placed there", job.infra)
                    }
                });
                self.store
                    .set_job_state(&self.job_id, JobState::Running, message.as_deref())
                    .await?;
            } else if now - job.gang_started_ms() > self.settings.start_timeout.as_millis() as i64 {
                let waiting: Vec<String> = units
                    .iter()
                    .filter(|u| u.state != UnitState::Running)
                    .map(|u| format!("{}/{} ({})", u.component, u.replica, u.state))
                    .collect();
                let message = format!(
                    "gang start: not every unit ran within {} s: {}",
                    self.settings.start_timeout.as_secs(),
                    waiting.join(", ")
                );
                if job.next_infra().is_some() && job.recoveries == 0 && job.running_ms.is_none() {
                    return self.fail_over(job, &units, &message).await;
                }
                self.store
                    .set_job_state(&self.job_id, JobState::Stopping, Some(&message))
                    .await?;
                return Ok(());
            }
        }
        self.finish_auxiliaries(&units, now).await?;
        if units.iter().all(|u| u.state.is_terminal()) {
            self.store
                .set_job_state(&self.job_id, JobState::Stopping, Some(EVERYTHING_FINISHED))
                .await?;
            return Ok(());
        }
        if let Err(e) = self.start_units(job, &units).await {
            // The first start refused on this engine: the next one in the launch's
            // order gets the group.
            if job.state == JobState::Starting
                && job.running_ms.is_none()
                && job.next_infra().is_some()
                && matches!(e, SuperviseError::Backend(_))
            {
                let units = self.store.units(&self.job_id).await?;
                return self
                    .fail_over(
                        job,
                        &units,
                        &format!("it refused the group: {}", summary(&e)),
                    )
                    .await;
            }
            return Err(e);
        }
        self.discover(job).await?;
        self.probe_readiness().await?;
        self.route_services().await?;
        Ok(())
    }

    /// Starts the load balancer of every `service` component (once), listening on
    /// [`SupervisorSettings::service_host`] and its `service.ports`. API keys in the
    /// component's `AGENTSTACK_API_KEY` (else this process's) are asked of every client
    /// before a body is read. A port that cannot be listened on ends the launch.
    async fn start_balancers(&self) -> Result<(), SuperviseError> {
        if self.balancers.lock().expect("never poisoned").is_some() {
            return Ok(());
        }
        let mut started = BTreeMap::new();
        for task in &self.group.components {
            let Some(service) = &task.service else {
                continue;
            };
            let keys_text = task
                .envs
                .get(agentstack_serve::auth::API_KEY_ENV)
                .cloned()
                .flatten()
                .or_else(|| std::env::var(agentstack_serve::auth::API_KEY_ENV).ok())
                .unwrap_or_default();
            let keys = keys_text
                .split(',')
                .filter(|k| !k.trim().is_empty())
                .filter_map(|k| ApiKey::new(k.trim()).ok())
                .collect();
            let balancer = Balancer::new(BalancerConfig {
                policy: match service.load_balancing_policy {
                    LoadBalancingPolicy::LeastLoad => Policy::LeastLoad,
                    LoadBalancingPolicy::RoundRobin => Policy::RoundRobin,
                },
                keys,
                ..BalancerConfig::default()
            });
            let address = format!("{}:{}", self.settings.service_host, service.ports);
            let listener = tokio::net::TcpListener::bind(&address).await.map_err(|e| {
                SuperviseError::Backend(BackendError::Config {
                    what: format!(
                        "the load balancer of `{}` cannot listen on {address}: {e}",
                        task.name
                    ),
                    hint: "give `service.ports` a free port (`ss -ltnp` shows who holds it)".into(),
                })
            })?;
            tracing::info!(component = %task.name, %address, "load balancer listening");
            let mut stop = self.stop_balancers.subscribe();
            let serving = balancer.clone();
            tokio::spawn(async move {
                let shutdown = async move {
                    let _ = stop.wait_for(|s| *s).await;
                };
                if let Err(e) = serving.serve(listener, shutdown).await {
                    tracing::error!(error = %e, "a load balancer stopped");
                }
            });
            started.insert(task.name.clone(), (balancer, Vec::new()));
        }
        *self.balancers.lock().expect("never poisoned") = Some(started);
        Ok(())
    }

    /// Gives each load balancer the replicas of its component that are ready now:
    /// running and passing their readiness probe.
    async fn route_services(&self) -> Result<(), SuperviseError> {
        if !self.group.components.iter().any(|t| t.service.is_some()) {
            return Ok(());
        }
        self.start_balancers().await?;
        let units = self.store.units(&self.job_id).await?;
        let mut balancers = self.balancers.lock().expect("never poisoned");
        for (component, (balancer, given)) in balancers.iter_mut().flatten() {
            let task = self.task(component);
            let ready: Vec<Replica> = units
                .iter()
                .filter(|u| {
                    u.component == *component
                        && u.state == UnitState::Running
                        && u.ready_ms.is_some()
                })
                .map(|u| Replica {
                    id: format!("{}/{}#{}", u.component, u.replica, u.attempt),
                    url: replica_url(task, u),
                })
                .collect();
            if ready != *given {
                tracing::info!(%component, ready = ready.len(), "replicas behind the load balancer");
                balancer.set_replicas(ready.clone());
                *given = ready;
            }
        }
        Ok(())
    }

    /// `recovery: group`, once a member's end began a recovery ([`Self::ended`]): every
    /// other member is stopped (SIGTERM, SIGKILL after the grace period), and when none
    /// runs, all of them start again as a gang (the launch is `starting`; discovery is
    /// written anew once every member runs). Returns whether the tick is this
    /// recovery's.
    async fn recover_group(
        &self,
        job: &JobRecord,
        units: &[UnitRecord],
        now: i64,
    ) -> Result<bool, SuperviseError> {
        if job.recovering_ms.is_none() {
            return Ok(false);
        }
        let mut active = false;
        for u in units.iter().filter(|u| u.state.is_active()) {
            active = true;
            self.stop_unit(u, now).await?;
        }
        if !active {
            let message = format!(
                "group recovery {}: every member stopped; starting the group again",
                job.recoveries + 1
            );
            self.store
                .end_group_recovery(&self.job_id, now, &message)
                .await?;
            self.started
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(true)
    }

    /// Moves the launch to the next engine in its order: what was started here is
    /// stopped (best effort: an engine whose controller is down may not answer), what
    /// the group shares here is removed, and the units wait to be placed there.
    async fn fail_over(
        &self,
        job: &JobRecord,
        units: &[UnitRecord],
        why: &str,
    ) -> Result<(), SuperviseError> {
        let mut note = format!("{}: {}", job.infra, one_line(why));
        for u in units
            .iter()
            .filter(|u| u.handle.is_some() && !u.state.is_terminal())
        {
            let handle = u.handle.as_deref().expect("filtered");
            if let Err(e) = self.backend().stop(handle, false).await {
                note.push_str(&format!(
                    " (could not stop {}/{} there: {})",
                    u.component,
                    u.replica,
                    summary(&e)
                ));
            }
        }
        if let Err(e) = self.backend().cleanup(&self.group, &self.job_id).await {
            tracing::warn!(error = %e, "cleaning up on the engine left behind");
        }
        // The next engine of the order that this supervisor can reach and that says it
        // can run the group.
        let mut notes = vec![note];
        let mut target = None;
        let after = job
            .infra_order
            .iter()
            .skip_while(|k| **k != job.infra)
            .skip(1);
        for kind in after {
            let Some(index) = self.backends.iter().position(|b| b.kind() == *kind) else {
                notes.push(format!(
                    "{kind}: its backend could not be made here (see `agentstack launch`'s message)"
                ));
                continue;
            };
            match self.backends[index].check(&self.group) {
                Ok(()) => {
                    target = Some((index, *kind));
                    break;
                }
                Err(e) => notes.push(format!("{kind}: {}", summary(&e))),
            }
        }
        let Some((index, next)) = target else {
            let message = format!(
                "no engine of the launch's order can take the group: {}",
                notes.join("; ")
            );
            tracing::warn!(%message, "stopping the launch");
            self.store
                .set_job_state(&self.job_id, JobState::Stopping, Some(&message))
                .await?;
            return Ok(());
        };
        let note = notes.join("\n");
        tracing::warn!(from = %job.infra, to = %next, %note, "failing over");
        self.store
            .fail_over(&self.job_id, next, &note, self.now_ms())
            .await?;
        self.current
            .store(index, std::sync::atomic::Ordering::Relaxed);
        self.started
            .store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Probes running replicas that have a `readiness_probe` (engines that do not
    /// probe themselves): a replica not ready `initial_delay_seconds` after it started,
    /// or failing every probe for `consecutive_failure_threshold_timeout` after it was
    /// ready, is killed, and its `job_recovery` decides whether it starts again.
    async fn probe_readiness(&self) -> Result<(), SuperviseError> {
        if self.engine_recovers() {
            // Kubernetes runs the probe itself (it is in the Pod spec).
            return Ok(());
        }
        let up_front = self.backend().addresses_up_front(&self.group).is_some();
        let units = self.store.units(&self.job_id).await?;
        for u in units.iter().filter(|u| {
            u.state == UnitState::Running && (up_front || u.discovered) && u.handle.is_some()
        }) {
            let task = self.task(&u.component);
            let Some(probe) = task.readiness_probe.as_ref() else {
                continue;
            };
            let now = self.now_ms();
            let key = (u.component.clone(), u.replica, u.attempt);
            let probed = self
                .probes
                .lock()
                .expect("never poisoned")
                .get(&key)
                .copied()
                .unwrap_or_default();
            // Until it is ready, a replica is probed often: a replacement then takes
            // traffic soon after it answers.
            let interval = if u.ready_ms.is_none() {
                probe.interval().min(NOT_READY_PROBE_INTERVAL.as_secs_f64())
            } else {
                probe.interval()
            };
            if now - probed.last_probe_ms < (interval * 1000.0) as i64 {
                continue;
            }
            let ok = self.probe_once(probe, &replica_url(task, u)).await;
            let last_ok_ms = if ok { Some(now) } else { probed.last_ok_ms };
            self.probes.lock().expect("never poisoned").insert(
                key,
                Probed {
                    last_probe_ms: now,
                    last_ok_ms,
                },
            );
            let failure = match (ok, u.ready_ms) {
                (true, None) => {
                    self.update(
                        u,
                        UnitUpdate {
                            ready_ms: Some(Some(now)),
                            message: Some(Some("ready".into())),
                            ..Default::default()
                        },
                    )
                    .await?;
                    None
                }
                (true, Some(_)) => None,
                (false, None) => {
                    let since = u.running_ms.unwrap_or(now);
                    (now - since > (probe.initial_delay() * 1000.0) as i64).then(|| {
                        format!(
                            "not ready within initial_delay_seconds ({} s)",
                            probe.initial_delay()
                        )
                    })
                }
                (false, Some(ready)) => {
                    let threshold = probe
                        .consecutive_failure_threshold_timeout
                        .unwrap_or(DEFAULT_FAILURE_THRESHOLD_SECONDS);
                    let since = last_ok_ms.unwrap_or(ready);
                    (now - since > (threshold * 1000.0) as i64).then(|| {
                        format!(
                            "failed every readiness probe for consecutive_failure_threshold_timeout ({threshold} s)"
                        )
                    })
                }
            };
            if let Some(why) = failure {
                tracing::warn!(component = %u.component, replica = u.replica, %why, "replacing a replica");
                self.backend()
                    .stop(u.handle.as_deref().expect("filtered"), false)
                    .await?;
                self.update(
                    u,
                    UnitUpdate {
                        message: Some(Some(format!("readiness probe: {why}"))),
                        ..Default::default()
                    },
                )
                .await?;
            }
        }
        Ok(())
    }

    /// One probe of the replica at `base` (its [`replica_url`]).
    async fn probe_once(&self, probe: &crate::spec::ReadinessProbe, base: &str) -> bool {
        let url = format!("{base}{}", probe.path);
        let mut request = match &probe.post_data {
            Some(body) => self
                .http
                .post(&url)
                .header("content-type", "application/json")
                .body(body.clone()),
            None => self.http.get(&url),
        };
        for (k, v) in &probe.headers {
            request = request.header(k, v);
        }
        request
            .timeout(Duration::from_secs_f64(probe.timeout()))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
    }

    /// Asks the engine about every unit it may have, and records what changed.
    async fn observe(&self, job: &JobRecord) -> Result<Observed, SuperviseError> {
        let units = self.store.units(&self.job_id).await?;
        let watched: Vec<&UnitRecord> = units
            .iter()
            .filter(|u| u.state.is_active() && u.handle.is_some())
            .collect();
        if watched.is_empty() {
            return Ok(Observed::default());
        }
        let handles: Vec<String> = watched
            .iter()
            .map(|u| u.handle.clone().expect("filtered"))
            .collect();
        let statuses = self.backend().poll(&handles).await?;
        let now = self.now_ms();
        let mut recovering = job.recovering_ms.is_some();
        let mut began = false;
        let mut unplaceable = None;
        for (u, status) in watched.into_iter().zip(statuses) {
            match status {
                UnitStatus::Pending => {}
                UnitStatus::Unplaceable { reason } => {
                    if u.message.as_deref() != Some(reason.as_str()) {
                        tracing::warn!(component = %u.component, replica = u.replica, %reason, "the engine cannot place a unit");
                        self.update(
                            u,
                            UnitUpdate {
                                message: Some(Some(reason.clone())),
                                ..Default::default()
                            },
                        )
                        .await?;
                    }
                    unplaceable
                        .get_or_insert_with(|| format!("{}/{}: {reason}", u.component, u.replica));
                }
                UnitStatus::Running { hosts } => {
                    if u.state == UnitState::Starting {
                        tracing::debug!(component = %u.component, replica = u.replica, attempt = u.attempt, "running");
                        self.update(
                            u,
                            UnitUpdate {
                                state: Some(UnitState::Running),
                                running_ms: Some(Some(now)),
                                hosts: Some(Some(hosts.join(","))),
                                ..Default::default()
                            },
                        )
                        .await?;
                    }
                }
                UnitStatus::Exited { .. } | UnitStatus::Lost { .. } => {
                    if self.ended(u, &status, now, recovering).await? {
                        recovering = true;
                        began = true;
                    }
                }
            }
        }
        Ok(Observed {
            began_recovery: began,
            unplaceable,
        })
    }

    /// Records how a unit ended; `recovering`: a group recovery is under way, so a
    /// unit it stopped starts again with the group. Returns whether this end began a
    /// group recovery (`recovery: group`, and the unit's policy restarts it).
    async fn ended(
        &self,
        u: &UnitRecord,
        status: &UnitStatus,
        now: i64,
        recovering: bool,
    ) -> Result<bool, SuperviseError> {
        // Read the unit again: another launch's supervisor may have marked it
        // `preempting` after this tick read it, and the exit is that preemption.
        let fresh = self.store.units(&self.job_id).await?;
        let u = fresh.iter().find(|f| *f == u).unwrap_or(u);
        let code = match status {
            UnitStatus::Exited { code } => Some(*code),
            _ => None,
        };
        let mut update = UnitUpdate {
            exit_code: Some(code),
            ended_ms: Some(Some(now)),
            deadline_ms: Some(None),
            ..Default::default()
        };
        let described = match (status, &u.message) {
            // Killed for failing its probe: that is the story, not the kill's code.
            (_, Some(m)) if m.starts_with("readiness probe: ") => m.clone(),
            (UnitStatus::Lost { reason }, _) => format!("lost: {reason}"),
            _ => format!("exit code {}", code.unwrap_or(-1)),
        };
        let state = match u.state {
            UnitState::Stopping if recovering => {
                update.message = Some(Some(format!(
                    "stopped by the group recovery ({described}); starts again with the group"
                )));
                UnitState::Restarting
            }
            UnitState::Stopping => UnitState::Stopped,
            UnitState::Preempting => {
                update.message = Some(Some(format!(
                    "preempted ({described}); starts again when there is room"
                )));
                UnitState::Preempted
            }
            _ => match self.verdict(u, status) {
                Verdict::Succeeded => UnitState::Succeeded,
                Verdict::Restart { counted, why } => {
                    if counted {
                        update.restarts_on_errors = Some(u.restarts_on_errors + 1);
                    }
                    update.message = Some(Some(format!("{described}; restarting: {why}")));
                    UnitState::Restarting
                }
                Verdict::Failed(why) => {
                    update.message = Some(Some(format!("{described}; {why}")));
                    UnitState::Failed
                }
            },
        };
        tracing::debug!(component = %u.component, replica = u.replica, %described, to = %state, "unit ended");
        let begins_recovery = self.group.recovery == GroupRecovery::Group
            && !recovering
            && u.state != UnitState::Stopping
            && state == UnitState::Restarting;
        let message = update.message.clone().flatten();
        update.state = Some(state);
        self.update(u, update).await?;
        if begins_recovery {
            let job = self
                .store
                .job(&self.job_id)
                .await?
                .ok_or_else(|| SuperviseError::NoJob(self.job_id.clone()))?;
            let message = format!(
                "group recovery {}: `{}`/{} {}; stopping every member to start the group again",
                job.recoveries + 1,
                u.component,
                u.replica,
                message.as_deref().unwrap_or("ended")
            );
            tracing::warn!(%message, "recovering the group");
            self.store
                .begin_group_recovery(&self.job_id, now, &message)
                .await?;
        }
        Ok(begins_recovery)
    }

    fn verdict(&self, u: &UnitRecord, status: &UnitStatus) -> Verdict {
        let code = match status {
            UnitStatus::Exited { code: 0 } => return Verdict::Succeeded,
            UnitStatus::Exited { code } => Some(*code),
            _ => None,
        };
        if self.engine_recovers() {
            return Verdict::Failed("the engine's retries (job_recovery) are spent".into());
        }
        let Some(policy) = &self.task(&u.component).resources.job_recovery else {
            return Verdict::Failed("no `job_recovery`, so it is not restarted".into());
        };
        let Some(code) = code else {
            return Verdict::Restart {
                counted: false,
                why: "the engine lost it".into(),
            };
        };
        if u8::try_from(code).is_ok_and(|c| policy.recover_on_exit_codes.contains(&c)) {
            return Verdict::Restart {
                counted: false,
                why: format!("{code} is in recover_on_exit_codes"),
            };
        }
        if u.restarts_on_errors < policy.max_restarts_on_errors {
            return Verdict::Restart {
                counted: true,
                why: format!(
                    "restart {} of max_restarts_on_errors {}",
                    u.restarts_on_errors + 1,
                    policy.max_restarts_on_errors
                ),
            };
        }
        Verdict::Failed(format!(
            "max_restarts_on_errors ({}) spent",
            policy.max_restarts_on_errors
        ))
    }

    /// Stops the auxiliaries `termination_delay` after every primary succeeded.
    async fn finish_auxiliaries(
        &self,
        units: &[UnitRecord],
        now: i64,
    ) -> Result<(), SuperviseError> {
        let primaries_done = units
            .iter()
            .filter(|u| self.group.is_primary(&u.component))
            .all(|u| u.state == UnitState::Succeeded);
        if !primaries_done {
            return Ok(());
        }
        for u in units
            .iter()
            .filter(|u| !self.group.is_primary(&u.component))
        {
            if u.state.is_terminal() {
                continue;
            }
            if u.state == UnitState::Stopping {
                // SIGTERM was sent; SIGKILL once the grace period is over (one that
                // ignored SIGTERM kept the launch running for ever).
                self.stop_unit(u, now).await?;
                continue;
            }
            match u.deadline_ms {
                None => {
                    let delay = self.group.termination_delay_seconds(&u.component) as i64;
                    tracing::debug!(component = %u.component, delay, "primaries done: auxiliary stops after its delay");
                    self.update(
                        u,
                        UnitUpdate {
                            deadline_ms: Some(Some(now + delay * 1000)),
                            ..Default::default()
                        },
                    )
                    .await?;
                }
                Some(deadline) if now >= deadline => self.stop_unit(u, now).await?,
                Some(_) => {}
            }
        }
        Ok(())
    }

    /// SIGTERM now, SIGKILL after the grace period; a unit with nothing running is
    /// just marked stopped.
    async fn stop_unit(&self, u: &UnitRecord, now: i64) -> Result<(), SuperviseError> {
        let grace = self.settings.stop_grace.as_millis() as i64;
        match (&u.handle, u.state) {
            (Some(h), UnitState::Running | UnitState::Starting | UnitState::Preempting) => {
                let graceful = u.state != UnitState::Starting;
                self.backend().stop(h, graceful).await?;
                self.update(
                    u,
                    UnitUpdate {
                        state: Some(UnitState::Stopping),
                        deadline_ms: Some(Some(now + grace)),
                        ..Default::default()
                    },
                )
                .await?;
            }
            (Some(h), UnitState::Stopping) if u.deadline_ms.is_some_and(|d| now >= d) => {
                tracing::debug!(component = %u.component, "grace period over: killing");
                self.backend().stop(h, false).await?;
                self.update(
                    u,
                    UnitUpdate {
                        deadline_ms: Some(Some(now + grace)),
                        ..Default::default()
                    },
                )
                .await?;
            }
            (_, state) if !state.is_terminal() && !state.is_active() => {
                self.update(
                    u,
                    UnitUpdate {
                        state: Some(UnitState::Stopped),
                        ..Default::default()
                    },
                )
                .await?;
            }
            _ => {}
        }
        Ok(())
    }

    async fn wind_down(
        &self,
        job: &JobRecord,
        units: &[UnitRecord],
        now: i64,
    ) -> Result<(), SuperviseError> {
        if job.state != JobState::Stopping {
            self.store
                .set_job_state(&self.job_id, JobState::Stopping, Some("cancel requested"))
                .await?;
        }
        for u in units {
            self.stop_unit(u, now).await?;
        }
        let units = self.store.units(&self.job_id).await?;
        if units.iter().all(|u| u.state.is_terminal()) {
            self.backend().cleanup(&self.group, &self.job_id).await?;
            let end = if job.cancel_requested {
                JobState::Cancelled
            } else if job.message.as_deref() == Some(EVERYTHING_FINISHED)
                && !units.iter().any(|u| u.state == UnitState::Failed)
            {
                JobState::Succeeded
            } else {
                // A unit failed, the gang did not start, or a unit could not be started.
                JobState::Failed
            };
            tracing::debug!(%end, "launch ended");
            self.store.set_job_state(&self.job_id, end, None).await?;
        }
        Ok(())
    }

    /// Starts what should run: the gang at first, then restarts and preempted units.
    async fn start_units(
        &self,
        job: &JobRecord,
        units: &[UnitRecord],
    ) -> Result<(), SuperviseError> {
        let first = job.state == JobState::Starting
            && units
                .iter()
                .all(|u| u.state == UnitState::Pending && u.handle.is_none());
        if first {
            if self.backend().unit_is_component() || self.backend().kind() != InfraKind::Local {
                self.backend().prepare(&self.group, &self.job_id).await?;
            }
            if self.admit(units).await? {
                // Every unit is tried, so none is left marked `starting` with nothing
                // started; the first refusal is reported. With another engine to move
                // to, the first refusal is enough: the failover resets every unit.
                let mut first_error = None;
                for u in units {
                    if let Err(e) = self.try_start(u, 0).await {
                        first_error.get_or_insert(e);
                        if job.next_infra().is_some() {
                            break;
                        }
                    }
                }
                if let Some(e) = first_error {
                    return Err(e);
                }
            }
            return Ok(());
        }
        // Restarts, preempted units with room again, and gang members whose first
        // start failed (an engine that did not answer).
        let waiting = units.iter().filter(|u| {
            matches!(u.state, UnitState::Restarting | UnitState::Preempted)
                || (u.state == UnitState::Pending && job.state == JobState::Starting)
        });
        for u in waiting {
            if self.admit(std::slice::from_ref(u)).await? {
                let attempt = if u.handle.is_some() { u.attempt + 1 } else { 0 };
                self.try_start(u, attempt).await?;
            }
        }
        Ok(())
    }

    /// Starts a unit; when the engine refuses, puts the unit back as it was (so the
    /// next tick tries again, and local CPUs are not held) and says why.
    async fn try_start(&self, u: &UnitRecord, attempt: u32) -> Result<(), SuperviseError> {
        match self.start_unit(u, attempt).await {
            Ok(()) => Ok(()),
            Err(e) => {
                self.update(
                    u,
                    UnitUpdate {
                        state: Some(u.state),
                        message: Some(Some(format!("could not start: {e}"))),
                        ..Default::default()
                    },
                )
                .await?;
                Err(e)
            }
        }
    }

    /// Reserves CPUs on local (preempting lower priorities when needed); elsewhere the
    /// engine queues. Marks the units `starting` when admitted.
    async fn admit(&self, units: &[UnitRecord]) -> Result<bool, SuperviseError> {
        let need: f64 = units.iter().map(|u| u.cpus).sum();
        if self.backend().kind() != InfraKind::Local || need <= 0.0 {
            for u in units {
                self.update(
                    u,
                    UnitUpdate {
                        state: Some(UnitState::Starting),
                        started_ms: Some(Some(self.now_ms())),
                        ..Default::default()
                    },
                )
                .await?;
            }
            return Ok(true);
        }
        let priority = units.iter().map(|u| u.priority).min().unwrap_or(0);
        let keys: Vec<(String, u32)> = units
            .iter()
            .map(|u| (u.component.clone(), u.replica))
            .collect();
        match self
            .store
            .admit_local(
                &self.job_id,
                &keys,
                need,
                priority,
                self.settings.local_cpus,
            )
            .await?
        {
            Admission::Admitted => Ok(true),
            Admission::Preempt(victims) => {
                for v in victims {
                    tracing::debug!(victim = %v.job_id, component = %v.component, replica = v.replica, "preempting");
                    if let Some(h) = &v.handle {
                        // Local handles name process groups on this machine, so any
                        // supervisor may signal them; the victim's own supervisor
                        // sees the exit and marks it preempted.
                        self.backend().stop(h, true).await?;
                        self.store
                            .update_unit(
                                &v.job_id,
                                &v.component,
                                v.replica,
                                &UnitUpdate {
                                    deadline_ms: Some(Some(
                                        self.now_ms() + self.settings.stop_grace.as_millis() as i64,
                                    )),
                                    ..Default::default()
                                },
                            )
                            .await?;
                    }
                }
                Ok(false)
            }
            Admission::Wait { need, free } => {
                let message = if need <= free + 1e-9 {
                    format!(
                        "waiting for {need} CPUs: a unit of higher priority waits for them first"
                    )
                } else {
                    format!("waiting for {need} CPUs ({free} free)")
                };
                for u in units {
                    // A preempted unit's message already says it waits for room, and
                    // why it stopped.
                    if u.state == UnitState::Preempted {
                        continue;
                    }
                    if u.message.as_deref() != Some(message.as_str()) {
                        self.update(
                            u,
                            UnitUpdate {
                                message: Some(Some(message.clone())),
                                ..Default::default()
                            },
                        )
                        .await?;
                    }
                }
                Ok(false)
            }
        }
    }

    async fn start_unit(&self, u: &UnitRecord, attempt: u32) -> Result<(), SuperviseError> {
        let task = self.task(&u.component);
        let up_front = self.backend().addresses_up_front(&self.group);
        let addresses = match &up_front {
            Some(a) => a.clone(),
            None => placeholder_addresses(&self.group),
        };
        let instance = u.replica as usize * task.num_nodes as usize;
        let discovery = discovery::environment(&self.group, &addresses, &task.name, instance)
            .map_err(|e| BackendError::from(request::BuildError::from(e)))?;
        let discovery_file = up_front
            .is_none()
            .then(|| self.discovery_file(task, u.replica, attempt));
        if let Some(file) = &discovery_file {
            let _ = std::fs::remove_file(file);
        }
        let launch = UnitLaunch {
            group: &self.group,
            task,
            replica: u.replica,
            attempt,
            job_id: &self.job_id,
            dir: &self.dir,
            discovery: &discovery,
            discovery_file,
            discovery_timeout_seconds: self.settings.discovery_timeout_seconds,
        };
        let handle = self.backend().start(&launch).await?;
        self.started
            .store(true, std::sync::atomic::Ordering::Relaxed);
        tracing::debug!(component = %u.component, replica = u.replica, attempt, %handle, "started");
        self.update(
            u,
            UnitUpdate {
                state: Some(UnitState::Starting),
                attempt: Some(attempt),
                handle: Some(Some(handle)),
                started_ms: Some(Some(self.now_ms())),
                running_ms: Some(None),
                ready_ms: Some(None),
                discovered: Some(false),
                // What admission said while it waited is over now.
                message: u
                    .message
                    .as_deref()
                    .is_some_and(|m| m.starts_with("waiting for "))
                    .then_some(None),
                ..Default::default()
            },
        )
        .await?;
        Ok(())
    }

    fn discovery_file(&self, task: &Task, replica: u32, attempt: u32) -> PathBuf {
        let name = request::instance_name(&self.group, task, replica);
        self.dir
            .join("discovery")
            .join(format!("{name}.{attempt}.env"))
    }

    /// Once every unit has run, writes each running unit's discovery file (engines
    /// that place units before their addresses are known).
    async fn discover(&self, job: &JobRecord) -> Result<(), SuperviseError> {
        if self.backend().addresses_up_front(&self.group).is_some() {
            return Ok(());
        }
        let units = self.store.units(&self.job_id).await?;
        let everyone_placed = units.iter().all(|u| u.hosts.is_some());
        if !everyone_placed
            || (job.state == JobState::Starting
                && !units
                    .iter()
                    .all(|u| matches!(u.state, UnitState::Running | UnitState::Succeeded)))
        {
            return Ok(());
        }
        let addresses = self.addresses(&units);
        for u in units
            .iter()
            .filter(|u| u.state == UnitState::Running && !u.discovered)
        {
            let task = self.task(&u.component);
            let instance = u.replica as usize * task.num_nodes as usize;
            let mut vars = discovery::environment(&self.group, &addresses, &task.name, instance)
                .map_err(|e| BackendError::from(request::BuildError::from(e)))?;
            if task.num_nodes > 1 {
                // Each node learns its own rank and the node list from the engine.
                vars.remove(SKYPILOT_NODE_RANK);
                vars.remove(SKYPILOT_NODE_IPS);
            }
            let file = self.discovery_file(task, u.replica, u.attempt);
            write_atomically(&file, &discovery::env_file(&vars))?;
            self.update(
                u,
                UnitUpdate {
                    discovered: Some(true),
                    ..Default::default()
                },
            )
            .await?;
        }
        Ok(())
    }

    /// Every instance's address from where the units run (the last place, for a unit
    /// being restarted); replicas on one host take consecutive ports.
    fn addresses(&self, units: &[UnitRecord]) -> Addresses {
        let mut addresses = Addresses::new();
        for task in &self.group.components {
            let mut endpoints = Vec::new();
            for r in 0..task.replicas {
                let port = task
                    .resources
                    .main_port()
                    .map(|p| p.saturating_add(r as u16));
                let hosts: Vec<String> = units
                    .iter()
                    .find(|u| u.component == task.name && u.replica == r)
                    .and_then(|u| u.hosts.clone())
                    .map(|h| h.split(',').map(str::to_owned).collect())
                    .unwrap_or_default();
                for node in 0..task.num_nodes as usize {
                    let host = hosts
                        .get(node)
                        .or(hosts.first())
                        .cloned()
                        .unwrap_or_else(|| "unplaced".into());
                    endpoints.push(Endpoint::new(host, port));
                }
            }
            addresses.insert(task.name.clone(), endpoints);
        }
        addresses
    }
}

/// Where replica `u` of `task` answers HTTP, `http://host:port`: its first host (an
/// IPv6 one in brackets), on the task's first port plus the replica index (replicas on
/// one host take consecutive ports).
fn replica_url(task: &Task, u: &UnitRecord) -> String {
    let host = u
        .hosts
        .as_deref()
        .and_then(|h| h.split(',').next())
        .unwrap_or("127.0.0.1");
    let port = task
        .resources
        .main_port()
        .map_or(80, |p| p.saturating_add(u.replica as u16));
    if host.contains(':') {
        format!("http://[{host}]:{port}")
    } else {
        format!("http://{host}:{port}")
    }
}

/// Addresses for the variables given at submission when the real ones come later in
/// the discovery file (which the entrypoint reads before anything runs).
pub(crate) fn placeholder_addresses(group: &JobGroup) -> Addresses {
    group
        .components
        .iter()
        .map(|t| {
            let endpoints = (0..t.instances())
                .map(|_| Endpoint::new("unplaced", t.resources.main_port()))
                .collect();
            (t.name.clone(), endpoints)
        })
        .collect()
}

fn write_atomically(path: &Path, text: &str) -> Result<(), BackendError> {
    let dir = path.parent().expect("discovery files are in a directory");
    std::fs::create_dir_all(dir).map_err(|e| BackendError::io(dir, e))?;
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).map_err(|e| BackendError::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| BackendError::io(path, e))
}

/// The discovery variables every unit of `group` gets on a backend with addresses up
/// front, by unit (for `--dry-run`).
pub fn planned_environment(
    group: &JobGroup,
    addresses: &Addresses,
) -> Result<BTreeMap<String, BTreeMap<String, String>>, request::BuildError> {
    let mut out = BTreeMap::new();
    for task in &group.components {
        for r in 0..task.replicas {
            let vars = discovery::environment(
                group,
                addresses,
                &task.name,
                r as usize * task.num_nodes as usize,
            )?;
            out.insert(request::instance_name(group, task, r), vars);
        }
    }
    Ok(out)
}
