//! The supervisor's timers on a paused clock: the gang-start timeout, restarts by
//! `job_recovery`, the termination delay of auxiliaries and the stop grace before
//! SIGKILL. A scripted engine stands in for the processes, the supervisor's clock is
//! Tokio's ([`Clock::Runtime`]), and the test steps the supervisor and moves the clock
//! with `tokio::time::advance`: ten minutes of a launch take milliseconds, and each
//! deadline is checked to the step.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use agentstack_compute::JobGroup;
use agentstack_compute::backend::local::LocalBackend;
use agentstack_compute::backend::{Backend, BackendError, LogSource, UnitLaunch, UnitStatus};
use agentstack_compute::discovery::Addresses;
use agentstack_compute::state::{JobRecord, JobState, Store, UnitRecord, UnitState};
use agentstack_compute::supervisor::{Clock, Supervisor, SupervisorSettings, create_launch};
use tokio::time::Instant;

/// The clock moves this much between two steps (the supervisor's poll interval).
const STEP: Duration = Duration::from_secs(1);

/// The most clock time any scenario here may take.
const LIMIT: Duration = Duration::from_secs(3600);

/// Exit code of a unit stopped with SIGTERM (128 + 15).
const TERMINATED: i32 = 143;

/// Exit code of a unit stopped with SIGKILL (128 + 9).
const KILLED: i32 = 137;

/// A call the supervisor made to the engine.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Call {
    /// `start` of `component/replica/attempt`.
    Start(String),
    /// `stop` of a unit, graceful (SIGTERM) or not (SIGKILL).
    Stop(String, bool),
}

/// An engine whose units run until the test says otherwise. Handles are
/// `component/replica/attempt`; addresses are local's.
struct Scripted {
    addresses: LocalBackend,
    /// What each started unit reports now.
    units: Mutex<HashMap<String, UnitStatus>>,
    /// Components whose units stay pending when started.
    never_run: HashSet<String>,
    /// Components whose units ignore SIGTERM.
    ignore_term: HashSet<String>,
    /// Every start and stop, with the clock's time since the test began.
    calls: Mutex<Vec<(Duration, Call)>>,
    origin: Instant,
}

impl Scripted {
    fn new(never_run: &[&str], ignore_term: &[&str]) -> Self {
        Self {
            addresses: LocalBackend::new(),
            units: Mutex::default(),
            never_run: never_run.iter().map(|c| (*c).to_owned()).collect(),
            ignore_term: ignore_term.iter().map(|c| (*c).to_owned()).collect(),
            calls: Mutex::default(),
            origin: Instant::now(),
        }
    }

    /// The unit `handle` ends with `code`.
    fn exit(&self, handle: &str, code: i32) {
        let mut units = self.units.lock().unwrap();
        assert!(units.contains_key(handle), "{handle} was never started");
        units.insert(handle.to_owned(), UnitStatus::Exited { code });
    }

    fn calls(&self) -> Vec<(Duration, Call)> {
        self.calls.lock().unwrap().clone()
    }

    fn record(&self, call: Call) {
        let at = self.origin.elapsed();
        self.calls.lock().unwrap().push((at, call));
    }
}

impl Backend for Scripted {
    fn kind(&self) -> agentstack_compute::spec::InfraKind {
        agentstack_compute::spec::InfraKind::Local
    }

    fn addresses_up_front(&self, group: &JobGroup) -> Option<Addresses> {
        self.addresses.addresses_up_front(group)
    }

    async fn start(&self, launch: &UnitLaunch<'_>) -> Result<String, BackendError> {
        let handle = format!("{}/{}/{}", launch.task.name, launch.replica, launch.attempt);
        let status = if self.never_run.contains(&launch.task.name) {
            UnitStatus::Pending
        } else {
            UnitStatus::Running {
                hosts: vec!["127.0.0.1".into()],
            }
        };
        self.units.lock().unwrap().insert(handle.clone(), status);
        self.record(Call::Start(handle.clone()));
        Ok(handle)
    }

    async fn poll(&self, handles: &[String]) -> Result<Vec<UnitStatus>, BackendError> {
        let units = self.units.lock().unwrap();
        Ok(handles.iter().map(|h| units[h].clone()).collect())
    }

    async fn stop(&self, handle: &str, graceful: bool) -> Result<(), BackendError> {
        self.record(Call::Stop(handle.to_owned(), graceful));
        let component = handle.split('/').next().unwrap_or_default();
        if !(graceful && self.ignore_term.contains(component)) {
            let code = if graceful { TERMINATED } else { KILLED };
            self.units
                .lock()
                .unwrap()
                .insert(handle.to_owned(), UnitStatus::Exited { code });
        }
        Ok(())
    }

    async fn logs(&self, handle: &str) -> Result<LogSource, BackendError> {
        Ok(LogSource::Text(format!("{handle}\n")))
    }
}

/// Keeps a paused clock from moving on its own. SQLite (the state database) works on a
/// thread of its own that the runtime cannot see: while a query is in flight the runtime
/// looks idle, and a paused clock would jump to the next timer (the connection pool's,
/// minutes away). Tokio holds auto-advance while a blocking task runs, so with this
/// guard alive the clock moves only by `advance`.
struct HeldClock(
    #[expect(dead_code, reason = "dropping it ends the blocking task")] std::sync::mpsc::Sender<()>,
);

fn hold_the_clock() -> HeldClock {
    let (release, released) = std::sync::mpsc::channel::<()>();
    tokio::task::spawn_blocking(move || {
        let _ = released.recv();
    });
    HeldClock(release)
}

/// A launch of `yaml` under a supervisor on the runtime's clock.
struct Launch {
    supervisor: Supervisor<Scripted>,
    store: Store,
    id: String,
    _home: tempfile::TempDir,
}

impl Launch {
    async fn new(yaml: &str, engine: Scripted) -> Self {
        let home = tempfile::tempdir().unwrap();
        let group = JobGroup::parse(yaml).unwrap();
        let settings = SupervisorSettings {
            poll_interval: STEP,
            clock: Clock::Runtime,
            local_cpus: 8.0,
            ..SupervisorSettings::default()
        };
        let store = Store::open(&home.path().join("jobs.db")).await.unwrap();
        let job = create_launch(
            &store,
            &engine,
            &group,
            home.path(),
            &serde_json::json!({}),
            &settings,
        )
        .await
        .unwrap();
        let supervisor = Supervisor::new(store.clone(), engine, settings, &job.id)
            .await
            .unwrap();
        Self {
            supervisor,
            store,
            id: job.id,
            _home: home,
        }
    }

    fn engine(&self) -> &Scripted {
        self.supervisor.backend()
    }

    fn now(&self) -> Duration {
        self.engine().origin.elapsed()
    }

    async fn job(&self) -> JobRecord {
        self.store.job(&self.id).await.unwrap().unwrap()
    }

    async fn unit(&self, component: &str) -> UnitRecord {
        let units = self.store.units(&self.id).await.unwrap();
        units
            .into_iter()
            .find(|u| u.component == component)
            .unwrap()
    }

    /// Steps, moving the clock a step after each, until `done` holds (checked after
    /// each step); returns the clock's time then.
    async fn step_until(&self, what: &str, done: impl AsyncFn(&Self) -> bool) -> Duration {
        loop {
            self.supervisor.step().await.unwrap();
            if done(self).await {
                return self.now();
            }
            assert!(self.now() < LIMIT, "no {what} within {LIMIT:?}");
            tokio::time::advance(STEP).await;
        }
    }

    /// Steps until the launch has ended; returns how.
    async fn run_out(&self) -> JobRecord {
        self.step_until("end", async |l: &Self| l.job().await.state.is_terminal())
            .await;
        self.job().await
    }
}

fn start(handle: &str) -> Call {
    Call::Start(handle.into())
}

fn stop(handle: &str, graceful: bool) -> Call {
    Call::Stop(handle.into(), graceful)
}

const fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// A unit that never runs fails the gang start after `start_timeout` (600 s), not a
/// step sooner; the unit that ran is stopped gracefully, the one still starting is
/// killed, and the launch fails saying which unit did not run.
#[tokio::test(start_paused = true)]
async fn the_gang_start_times_out_after_start_timeout() {
    let _clock = hold_the_clock();
    let launch = Launch::new(
        "name: gang\nexecution: parallel\n---\nname: a\nrun: x\n---\nname: b\nrun: x\n",
        Scripted::new(&["b"], &[]),
    )
    .await;
    let timed_out = launch
        .step_until("gang-start timeout", async |l: &Launch| {
            l.job().await.state != JobState::Starting
        })
        .await;
    let timeout = SupervisorSettings::default().start_timeout;
    // The launch was recorded a moment (real time) before the supervisor's clock
    // started, so the timeout is seen at 600 s or one step later.
    assert!(
        timed_out >= timeout && timed_out <= timeout + STEP,
        "timed out at {timed_out:?}"
    );
    let job = launch.run_out().await;
    assert_eq!(job.state, JobState::Failed);
    assert_eq!(
        launch.engine().calls(),
        [
            (secs(0), start("a/0/0")),
            (secs(0), start("b/0/0")),
            (timed_out, stop("a/0/0", true)),
            (timed_out, stop("b/0/0", false)),
        ]
    );
    assert_eq!(launch.unit("b").await.state, UnitState::Stopped);
    assert!(
        job.message
            .as_deref()
            .is_some_and(|m| m.contains("not every unit ran within 600 s: b/0 (starting)")),
        "{job:?}"
    );
}

/// Recovery has no backoff: a unit is started again in the step that sees it exit. An
/// exit code in `recover_on_exit_codes` does not count; other codes count against
/// `max_restarts_on_errors`, and the exit past it fails the launch.
#[tokio::test(start_paused = true)]
async fn restarts_follow_job_recovery_in_the_step_that_sees_the_exit() {
    let _clock = hold_the_clock();
    let launch = Launch::new(
        "name: flaky\nexecution: parallel\n---\nname: flaky\nresources: {job_recovery: {max_restarts_on_errors: 2, recover_on_exit_codes: [33]}}\nrun: x\n---\nname: other\nrun: x\n",
        Scripted::new(&[], &[]),
    )
    .await;
    launch
        .step_until("running", async |l: &Launch| {
            l.job().await.state == JobState::Running
        })
        .await;
    let mut exits = Vec::new();
    for (attempt, code) in [(0, 33), (1, 4), (2, 4), (3, 4)] {
        tokio::time::advance(secs(10)).await;
        let at = launch.now();
        launch.engine().exit(&format!("flaky/0/{attempt}"), code);
        exits.push(at);
        launch
            .step_until("the exit seen", async |l: &Launch| {
                l.unit("flaky").await.attempt > attempt
                    || l.unit("flaky").await.state == UnitState::Failed
            })
            .await;
    }
    let job = launch.run_out().await;
    assert_eq!(job.state, JobState::Failed);
    assert_eq!(
        job.message.as_deref(),
        Some("component `flaky` failed: exit code 4; max_restarts_on_errors (2) spent")
    );
    let flaky = launch.unit("flaky").await;
    assert_eq!((flaky.attempt, flaky.restarts_on_errors), (3, 2));
    let starts: Vec<(Duration, Call)> = launch
        .engine()
        .calls()
        .into_iter()
        .filter(|(_, c)| matches!(c, Call::Start(h) if h.starts_with("flaky/")))
        .collect();
    assert_eq!(
        starts,
        [
            (secs(0), start("flaky/0/0")),
            (exits[0], start("flaky/0/1")),
            (exits[1], start("flaky/0/2")),
            (exits[2], start("flaky/0/3")),
        ]
    );
}

/// When every primary has succeeded, an auxiliary gets SIGTERM `termination_delay`
/// later; one that ignores it gets SIGKILL after `stop_grace`, and the launch succeeds.
#[tokio::test(start_paused = true)]
async fn auxiliaries_get_sigterm_after_the_delay_and_sigkill_after_the_grace() {
    let _clock = hold_the_clock();
    let launch = Launch::new(
        "name: aux\nexecution: parallel\nprimary_tasks: [main]\ntermination_delay: 30s\n---\nname: main\nrun: x\n---\nname: helper\nrun: x\n",
        Scripted::new(&[], &["helper"]),
    )
    .await;
    launch
        .step_until("running", async |l: &Launch| {
            l.job().await.state == JobState::Running
        })
        .await;
    tokio::time::advance(secs(5)).await;
    let finished = launch.now();
    launch.engine().exit("main/0/0", 0);
    let job = launch.run_out().await;
    assert_eq!(job.state, JobState::Succeeded, "{job:?}");
    let grace = SupervisorSettings::default().stop_grace;
    assert_eq!(
        launch.engine().calls()[2..],
        [
            (finished + secs(30), stop("helper/0/0", true)),
            (finished + secs(30) + grace, stop("helper/0/0", false)),
        ]
    );
    assert_eq!(launch.unit("helper").await.exit_code, Some(KILLED));
}

/// A replica that never answers its readiness probe is killed at the first probe past
/// `initial_delay_seconds` (probes come every `endpoint_probe_interval_seconds`), and
/// its `job_recovery` starts it again in the next step, saying why.
#[tokio::test(start_paused = true)]
async fn a_replica_not_ready_within_its_initial_delay_is_replaced() {
    let _clock = hold_the_clock();
    // Nothing listens there: every probe is refused at once.
    let port = agentstack_test_support::ports::free_port();
    let launch = Launch::new(
        &format!(
            "name: probed\nresources: {{ports: {port}, job_recovery: {{max_restarts_on_errors: 1}}}}\nreadiness_probe: {{path: /ready, initial_delay_seconds: 20, endpoint_probe_interval_seconds: 5}}\nrun: x\n"
        ),
        Scripted::new(&[], &[]),
    )
    .await;
    let running = launch
        .step_until("running", async |l: &Launch| {
            l.unit("probed").await.state == UnitState::Running
        })
        .await;
    let restarted = launch
        .step_until("a restart", async |l: &Launch| {
            l.unit("probed").await.attempt == 1
        })
        .await;
    let kills: Vec<Duration> = launch
        .engine()
        .calls()
        .into_iter()
        .filter(|(_, c)| *c == stop("probed/0/0", false))
        .map(|(at, _)| at)
        .collect();
    let [killed] = kills[..] else {
        panic!("killed {kills:?}")
    };
    let (delay, interval) = (secs(20), secs(5));
    assert!(
        killed > running + delay && killed <= running + delay + interval,
        "running at {running:?}, killed at {killed:?}"
    );
    assert_eq!(restarted, killed + STEP);
    let unit = launch.unit("probed").await;
    assert_eq!(unit.restarts_on_errors, 1);
    assert_eq!(
        unit.message.as_deref(),
        Some(
            "readiness probe: not ready within initial_delay_seconds (20 s); restarting: restart 1 of max_restarts_on_errors 1"
        )
    );
}

/// A loopback HTTP server that answers every request 200 while `healthy`, else 503.
struct ProbeTarget {
    port: u16,
    healthy: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl ProbeTarget {
    fn start() -> Self {
        use std::io::{Read as _, Write as _};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let healthy = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let answers = std::sync::Arc::clone(&healthy);
        std::thread::spawn(move || {
            for mut stream in listener.incoming().map_while(Result::ok) {
                let mut request = [0u8; 4096];
                let _ = stream.read(&mut request);
                let status = if answers.load(std::sync::atomic::Ordering::SeqCst) {
                    "200 OK"
                } else {
                    "503 Service Unavailable"
                };
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                );
            }
        });
        Self { port, healthy }
    }

    fn fail(&self) {
        self.healthy
            .store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A ready replica that then fails every probe is killed once
/// `consecutive_failure_threshold_timeout` has passed since its last good answer (at the
/// first probe past it), and started again.
#[tokio::test(start_paused = true)]
async fn a_ready_replica_failing_its_probes_past_the_threshold_is_replaced() {
    let _clock = hold_the_clock();
    let target = ProbeTarget::start();
    let launch = Launch::new(
        &format!(
            "name: flapping\nresources: {{ports: {}, job_recovery: {{max_restarts_on_errors: 1}}}}\nreadiness_probe: {{path: /ready, initial_delay_seconds: 5, endpoint_probe_interval_seconds: 5, consecutive_failure_threshold_timeout: 30}}\nrun: x\n",
            target.port
        ),
        Scripted::new(&[], &[]),
    )
    .await;
    let ready = launch
        .step_until("ready", async |l: &Launch| {
            l.unit("flapping").await.ready_ms.is_some()
        })
        .await;
    // Probed (and answered) every interval for a while; the last step with good
    // answers is `healthy_until`.
    let healthy_until = launch
        .step_until("20 s of good answers", async move |l: &Launch| {
            l.now() >= ready + secs(20)
        })
        .await;
    target.fail();
    tokio::time::advance(STEP).await;
    let restarted = launch
        .step_until("a restart", async |l: &Launch| {
            l.unit("flapping").await.attempt == 1
        })
        .await;
    let killed = restarted - STEP;
    assert!(
        launch
            .engine()
            .calls()
            .contains(&(killed, stop("flapping/0/0", false))),
        "{:?}",
        launch.engine().calls()
    );
    // The last good answer came at most one probe interval before the failures began.
    let (threshold, interval) = (secs(30), secs(5));
    assert!(
        killed > healthy_until - interval + threshold
            && killed <= healthy_until + threshold + interval,
        "healthy until {healthy_until:?}, killed at {killed:?}"
    );
    assert_eq!(
        launch.unit("flapping").await.message.as_deref(),
        Some(
            "readiness probe: failed every readiness probe for consecutive_failure_threshold_timeout (30 s); restarting: restart 1 of max_restarts_on_errors 1"
        )
    );
}
