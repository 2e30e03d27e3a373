//! Launches on real engines: local processes always; a real Slurm cluster and a real
//! Ray head when `scripts/start-slurm` and `scripts/start-ray` have started them
//! (the tests marked `#[ignore]`, which `scripts/test` runs).
//!
//! The same scenario runs on each: three components start together, find each other
//! through the discovery variables (the client reaches the server's port), a killed
//! component is started again by its `job_recovery`, and cancel leaves nothing
//! running.

use std::path::Path;
use std::time::{Duration, Instant};

use agentstack_compute::JobGroup;
use agentstack_compute::backend::local::LocalBackend;
use agentstack_compute::backend::ray::RayBackend;
use agentstack_compute::backend::slurm::{SlurmBackend, SlurmSettings};
use agentstack_compute::backend::{AnyBackend, Backend};
use agentstack_compute::spec::InfraKind;
use agentstack_compute::state::{JobState, Store, UnitRecord, UnitState};
use agentstack_compute::supervisor::{Supervisor, SupervisorSettings, create_launch_on};
use agentstack_test_support::ports::{free_port, free_port_pair};

/// Longest wait for anything in these tests; engines on a loaded 2-core machine are slow.
const PATIENCE: Duration = Duration::from_secs(90);

async fn wait_for<T>(what: &str, mut check: impl AsyncFnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(t) = check().await {
            return t;
        }
        assert!(start.elapsed() < PATIENCE, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn read(path: &Path) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .filter(|t| t.ends_with('\n'))
}

fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(") ")
            .is_some_and(|(_, r)| !r.starts_with('Z'))
    })
}

/// The three components: a server on a port, a worker that can be killed, and a
/// client that reaches the server by the address it was given.
fn trio(name: &str, dir: &Path, port: u16, policy: &str) -> JobGroup {
    let d = dir.display();
    JobGroup::parse(&format!(
        r#"
name: {name}
execution: parallel
primary_tasks: [client]
---
name: server
resources: {{ports: {port}, job_recovery: {policy}}}
run: |
  echo "$AGENTSTACK_SERVER_ADDRS $AGENTSTACK_WORKER_ADDRS $AGENTSTACK_CLIENT_ADDRS" > {d}/server.seen
  exec python3 -m http.server "$AGENTSTACK_PORT" --bind 127.0.0.1
---
name: worker
resources: {{job_recovery: {policy}}}
run: |
  echo "$AGENTSTACK_SERVER_ADDRS $AGENTSTACK_WORKER_ADDRS $AGENTSTACK_CLIENT_ADDRS" > {d}/worker.seen
  echo $$ >> {d}/worker.pids
  exec sleep 120
---
name: client
resources: {{job_recovery: {policy}}}
run: |
  echo "$AGENTSTACK_SERVER_ADDRS $AGENTSTACK_WORKER_ADDRS $AGENTSTACK_CLIENT_ADDRS" > {d}/client.seen
  host="${{AGENTSTACK_SERVER_ADDRS%:*}}" port="${{AGENTSTACK_SERVER_ADDRS##*:}}"
  until (exec 3<>"/dev/tcp/$host/$port") 2>/dev/null; do sleep 0.2; done
  echo reached > {d}/client.reached
  echo $$ > {d}/client.pid
  exec sleep 120
"#
    ))
    .unwrap()
}

struct Launched {
    store: Store,
    id: String,
    supervisor: tokio::task::JoinHandle<JobState>,
}

async fn launch<B: Backend + 'static>(
    backend: B,
    group: &JobGroup,
    home: &Path,
    settings: SupervisorSettings,
) -> Launched {
    launch_on(vec![backend], group, home, settings).await
}

/// A launch on the first of `backends` that can take it, moving down the list as they
/// refuse.
async fn launch_on<B: Backend + 'static>(
    backends: Vec<B>,
    group: &JobGroup,
    home: &Path,
    settings: SupervisorSettings,
) -> Launched {
    let store = Store::open(&home.join("jobs.db")).await.unwrap();
    let job = create_launch_on(
        &store,
        &backends,
        &[],
        group,
        home,
        &serde_json::json!({}),
        &settings,
    )
    .await
    .unwrap();
    let supervisor = Supervisor::with_backends(store.clone(), backends, settings, &job.id)
        .await
        .unwrap();
    Launched {
        store,
        id: job.id,
        supervisor: tokio::spawn(async move { supervisor.run().await.unwrap() }),
    }
}

impl Launched {
    async fn units(&self) -> Vec<UnitRecord> {
        self.store.units(&self.id).await.unwrap()
    }

    async fn unit(&self, component: &str) -> UnitRecord {
        self.units()
            .await
            .into_iter()
            .find(|u| u.component == component)
            .unwrap()
    }

    async fn state(&self) -> JobState {
        self.store.job(&self.id).await.unwrap().unwrap().state
    }

    async fn wait_state(&self, want: JobState) {
        wait_for(&format!("the launch to be {want}"), async || {
            (self.state().await == want).then_some(())
        })
        .await;
    }
}

/// Runs `cleanup` with the group's name if the test fails midway, so a failed run
/// leaves nothing behind on a shared engine.
struct Cleanup<F: FnMut()>(F);

impl<F: FnMut()> Drop for Cleanup<F> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            (self.0)();
        }
    }
}

/// The scenario, on any engine whose hosts are this machine.
async fn three_components_find_each_other_recover_and_cancel<B: Backend + 'static>(
    backend: B,
    settings: SupervisorSettings,
    after_cancel: impl AsyncFnOnce(&[UnitRecord]),
) {
    let home = tempfile::tempdir().unwrap();
    let dir = home.path().join("work");
    std::fs::create_dir_all(&dir).unwrap();
    let port = free_port();
    let name = format!("trio{}", std::process::id() % 100_000);
    let group = trio(&name, &dir, port, "{max_restarts_on_errors: 2}");
    let launched = launch(backend, &group, home.path(), settings).await;
    let _cleanup = Cleanup(|| {
        // The engine's own tools, as a person would: the units' processes are gone
        // with a cancel on every engine the tests run.
        for component in ["server", "worker", "client"] {
            let job_name = format!("{name}-{component}");
            let _ = std::process::Command::new("scancel")
                .args(["--name", &job_name])
                .status();
        }
        let _ = std::process::Command::new("bash")
            .arg("-c")
            .arg(format!(
                "for p in $(cat {d}/worker.pids {d}/client.pid 2>/dev/null); do kill -9 $p; done; \
                 curl -s \"$AGENTSTACK_RAY_ADDRESS/api/jobs/\" | python3 -c 'import json,sys; [print(j[\"submission_id\"]) for j in json.load(sys.stdin) if j[\"status\"] in (\"RUNNING\",\"PENDING\") and j[\"submission_id\"].startswith(\"{name}-\")]' | while read id; do curl -s -X POST \"$AGENTSTACK_RAY_ADDRESS/api/jobs/$id/stop\"; done",
                d = dir.display()
            ))
            .status();
    });

    launched.wait_state(JobState::Running).await;
    let reached = dir.join("client.reached");
    wait_for("the client to reach the server", async || read(&reached)).await;
    let expected = format!("127.0.0.1:{port} 127.0.0.1 127.0.0.1\n");
    for component in ["server", "worker", "client"] {
        let seen = wait_for("the discovery variables", async || {
            read(&dir.join(format!("{component}.seen")))
        })
        .await;
        assert_eq!(seen, expected, "what {component} was told");
    }

    // Kill the worker: its policy starts it again.
    let pids = dir.join("worker.pids");
    let first: i32 = wait_for("the worker's pid", async || read(&pids))
        .await
        .trim()
        .parse()
        .unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(first),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let worker = wait_for("the worker to run again", async || {
        let w = launched.unit("worker").await;
        (w.attempt == 1 && w.state == UnitState::Running).then_some(w)
    })
    .await;
    assert_eq!(worker.restarts_on_errors, 1);
    assert!(
        worker
            .message
            .as_deref()
            .is_some_and(|m| m.starts_with("exit code 137; restarting")),
        "{:?}",
        worker.message
    );
    let second: i32 = wait_for("the new worker's pid", async || {
        read(&pids).and_then(|t| t.lines().nth(1).map(str::to_owned))
    })
    .await
    .parse()
    .unwrap();
    assert_ne!(first, second);
    assert_eq!(launched.state().await, JobState::Running);

    // Cancel: everything stops, and nothing is left running.
    launched.store.request_cancel(&launched.id).await.unwrap();
    launched.wait_state(JobState::Cancelled).await;
    assert_eq!(launched.supervisor.await.unwrap(), JobState::Cancelled);
    let units = launched.store.units(&launched.id).await.unwrap();
    for u in &units {
        assert_eq!(u.state, UnitState::Stopped, "{}", u.component);
    }
    let client: i32 = read(&dir.join("client.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    for pid in [second, client] {
        wait_for("the programs to be gone", async || {
            (!alive(pid)).then_some(())
        })
        .await;
    }
    let listening = std::net::TcpStream::connect(("127.0.0.1", port)).is_ok();
    assert!(!listening, "the server still listens on {port}");
    after_cancel(&units).await;
}

fn local_settings() -> SupervisorSettings {
    SupervisorSettings {
        stop_grace: Duration::from_secs(3),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_three_components() {
    three_components_find_each_other_recover_and_cancel(
        LocalBackend::new(),
        local_settings(),
        async |_| {},
    )
    .await;
}

fn slurm_settings() -> SupervisorSettings {
    SupervisorSettings {
        poll_interval: Duration::from_millis(250),
        stop_grace: Duration::from_secs(5),
        start_timeout: Duration::from_secs(120),
        discovery_timeout_seconds: 120,
        ..Default::default()
    }
}

/// Slurm has nothing of the launch's units left running.
async fn slurm_has_nothing_left(units: &[UnitRecord]) {
    let ids: Vec<String> = units
        .iter()
        .filter_map(|u| u.handle.as_deref()?.split(' ').next().map(str::to_owned))
        .collect();
    wait_for("Slurm to end every job", async || {
        let out = std::process::Command::new("squeue")
            .args(["-h", "-o", "%i %T", "--states=RUNNING,PENDING,COMPLETING"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        (!text
            .lines()
            .any(|l| ids.iter().any(|id| l.split(' ').next() == Some(id))))
        .then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Slurm cluster: scripts/start-slurm, with SLURM_CONF set"]
async fn slurm_three_components() {
    three_components_find_each_other_recover_and_cancel(
        SlurmBackend::new(SlurmSettings::default()),
        slurm_settings(),
        slurm_has_nothing_left,
    )
    .await;
}

fn ray_address() -> String {
    std::env::var("AGENTSTACK_RAY_ADDRESS").unwrap_or_else(|_| "http://127.0.0.1:8265".into())
}

fn ray_settings() -> SupervisorSettings {
    SupervisorSettings {
        poll_interval: Duration::from_millis(250),
        stop_grace: Duration::from_secs(5),
        start_timeout: Duration::from_secs(120),
        discovery_timeout_seconds: 120,
        ..Default::default()
    }
}

/// Ray has every unit's last job ended.
async fn ray_has_nothing_left(address: &str, units: &[UnitRecord]) {
    let client = reqwest::Client::new();
    for u in units {
        let h = u.handle.as_deref().unwrap();
        let job: serde_json::Value = client
            .get(format!("{address}/api/jobs/{h}"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let status = job["status"].as_str().unwrap();
        assert!(
            ["STOPPED", "FAILED", "SUCCEEDED"].contains(&status),
            "{h}: {status}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Ray head: scripts/start-ray (AGENTSTACK_RAY_ADDRESS)"]
async fn ray_three_components() {
    let address = ray_address();
    three_components_find_each_other_recover_and_cancel(
        RayBackend::new(&address),
        ray_settings(),
        async |units| ray_has_nothing_left(&address, units).await,
    )
    .await;
}

/// A group of three with `recovery: group`: a server, a worker that is killed, and a
/// client that must reach the server. Every start appends what it was told to
/// `<component>.seen` and its pid to `<component>.pids`; the client appends to
/// `client.reached` once it reached the server.
fn recovering_trio(name: &str, dir: &Path, port: u16) -> JobGroup {
    let d = dir.display();
    let component = |name: &str, ports: &str, body: &str| {
        format!(
            "---\nname: {name}\nresources: {{{ports}job_recovery: {{max_restarts_on_errors: 2}}}}\nrun: |\n  echo \"$AGENTSTACK_SERVER_ADDRS $AGENTSTACK_WORKER_ADDRS $AGENTSTACK_CLIENT_ADDRS\" >> {d}/{name}.seen\n  echo $$ >> {d}/{name}.pids\n{body}"
        )
    };
    let text = format!(
        "name: {name}\nexecution: parallel\nrecovery: group\nprimary_tasks: [client]\n{}{}{}",
        component(
            "server",
            &format!("ports: {port}, "),
            "  exec python3 -m http.server \"$AGENTSTACK_PORT\" --bind 127.0.0.1\n"
        ),
        component("worker", "", "  exec sleep 120\n"),
        component(
            "client",
            "",
            &format!(
                "  host=\"${{AGENTSTACK_SERVER_ADDRS%:*}}\" port=\"${{AGENTSTACK_SERVER_ADDRS##*:}}\"\n  until (exec 3<>\"/dev/tcp/$host/$port\") 2>/dev/null; do sleep 0.2; done\n  echo reached >> {d}/client.reached\n  exec sleep 120\n"
            )
        ),
    );
    JobGroup::parse(&text).unwrap()
}

/// Lines of a file written line by line (none while it does not exist).
fn lines(path: &Path) -> Vec<String> {
    read(path)
        .map(|t| t.lines().map(str::to_owned).collect())
        .unwrap_or_default()
}

/// `recovery: group` on any engine whose hosts are this machine: one member killed,
/// every member is stopped and the group starts again as a gang, with discovery
/// written anew, within 30 s; only the killed member's restart counts; cancel leaves
/// nothing running.
async fn a_group_recovers_as_one<B: Backend + 'static>(
    backend: B,
    settings: SupervisorSettings,
    after_cancel: impl AsyncFnOnce(&[UnitRecord]),
) {
    let home = tempfile::tempdir().unwrap();
    let dir = home.path().join("work");
    std::fs::create_dir_all(&dir).unwrap();
    let port = free_port();
    let name = format!("regroup{}", std::process::id() % 100_000);
    let group = recovering_trio(&name, &dir, port);
    let launched = launch(backend, &group, home.path(), settings).await;
    let _cleanup = Cleanup(|| {
        for component in ["server", "worker", "client"] {
            let _ = std::process::Command::new("scancel")
                .args(["--name", &format!("{name}-{component}")])
                .status();
            for pid in lines(&dir.join(format!("{component}.pids"))) {
                let _ = std::process::Command::new("kill")
                    .args(["-9", &pid])
                    .status();
            }
        }
    });
    launched.wait_state(JobState::Running).await;
    let reached = dir.join("client.reached");
    wait_for("the client to reach the server", async || {
        (lines(&reached).len() == 1).then_some(())
    })
    .await;
    let first: Vec<i32> = ["server", "worker", "client"]
        .iter()
        .map(|c| lines(&dir.join(format!("{c}.pids")))[0].parse().unwrap())
        .collect();

    // Kill the worker: the whole group starts again.
    let killed = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(first[1]),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    wait_for("every member to start again", async || {
        ["server", "worker", "client"]
            .iter()
            .all(|c| lines(&dir.join(format!("{c}.pids"))).len() == 2)
            .then_some(())
    })
    .await;
    wait_for("the new client to reach the new server", async || {
        (lines(&reached).len() == 2).then_some(())
    })
    .await;
    launched.wait_state(JobState::Running).await;
    let recovered = killed.elapsed();
    assert!(
        recovered < Duration::from_secs(30),
        "discovery took {recovered:?} to be re-established"
    );
    // The old server and client were stopped, not left beside the new ones.
    for pid in [first[0], first[2]] {
        wait_for("the first generation to be gone", async || {
            (!alive(pid)).then_some(())
        })
        .await;
    }
    let expected = format!("127.0.0.1:{port} 127.0.0.1 127.0.0.1");
    for component in ["server", "worker", "client"] {
        assert_eq!(
            lines(&dir.join(format!("{component}.seen"))),
            [expected.clone(), expected.clone()],
            "what {component} was told at each start"
        );
        let u = launched.unit(component).await;
        assert_eq!(u.attempt, 1, "{component}");
        let counted = u32::from(component == "worker");
        assert_eq!(u.restarts_on_errors, counted, "{component}");
    }
    let job = launched.store.job(&launched.id).await.unwrap().unwrap();
    assert_eq!(job.recoveries, 1);
    assert!(
        job.message
            .as_deref()
            .is_some_and(|m| m.starts_with("group recovery 1: every member running again")),
        "{:?}",
        job.message
    );

    launched.store.request_cancel(&launched.id).await.unwrap();
    assert_eq!(launched.supervisor.await.unwrap(), JobState::Cancelled);
    let units = launched.store.units(&launched.id).await.unwrap();
    for component in ["server", "worker", "client"] {
        for pid in lines(&dir.join(format!("{component}.pids"))) {
            let pid: i32 = pid.parse().unwrap();
            wait_for("the programs to be gone", async || {
                (!alive(pid)).then_some(())
            })
            .await;
        }
    }
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "the server still listens on {port}"
    );
    after_cancel(&units).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_group_recovery() {
    a_group_recovers_as_one(LocalBackend::new(), local_settings(), async |_| {}).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Slurm cluster: scripts/start-slurm, with SLURM_CONF set"]
async fn slurm_group_recovery() {
    a_group_recovers_as_one(
        SlurmBackend::new(SlurmSettings::default()),
        slurm_settings(),
        slurm_has_nothing_left,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Ray head: scripts/start-ray (AGENTSTACK_RAY_ADDRESS)"]
async fn ray_group_recovery() {
    let address = ray_address();
    a_group_recovers_as_one(RayBackend::new(&address), ray_settings(), async |units| {
        ray_has_nothing_left(&address, units).await;
    })
    .await;
}

/// A `slurm.conf` naming a controller that is not running (its port is closed): to
/// Slurm's commands, a stopped controller.
fn stopped_controller_conf(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("stopped-slurm.conf");
    std::fs::write(
        &path,
        format!(
            "ClusterName=stopped\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort={}\nAuthType=auth/munge\nNodeName=n1 NodeAddr=127.0.0.1 CPUs=1\nPartitionName=p Nodes=n1 Default=YES\n",
            free_port()
        ),
    )
    .unwrap();
    path
}

/// `resources.infra: [slurm, local]` with Slurm's controller stopped: the submission
/// fails, the group is placed on local, where it runs; the launch says where and why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_slurm_refuses_fails_over_to_local() {
    let home = tempfile::tempdir().unwrap();
    let dir = home.path().join("work");
    std::fs::create_dir_all(&dir).unwrap();
    let port = free_port();
    let name = format!("failover{}", std::process::id() % 100_000);
    let d = dir.display();
    let group = JobGroup::parse(&format!(
        "name: {name}\nexecution: parallel\n---\nname: server\nresources: {{infra: [slurm, local], ports: {port}}}\nrun: |\n  echo $$ >> {d}/server.pids\n  exec python3 -m http.server \"$AGENTSTACK_PORT\" --bind 127.0.0.1\n---\nname: client\nresources: {{infra: [slurm, local]}}\nrun: |\n  echo $$ >> {d}/client.pids\n  echo \"$AGENTSTACK_SERVER_ADDRS\" > {d}/client.seen\n  exec sleep 120\n"
    ))
    .unwrap();
    let backends = vec![
        AnyBackend::Slurm(SlurmBackend::new(SlurmSettings {
            conf: Some(stopped_controller_conf(home.path())),
            ..Default::default()
        })),
        AnyBackend::Local(LocalBackend::new()),
    ];
    let started = Instant::now();
    let launched = launch_on(backends, &group, home.path(), local_settings()).await;
    let job = launched.store.job(&launched.id).await.unwrap().unwrap();
    assert_eq!(job.infra_order, [InfraKind::Slurm, InfraKind::Local]);
    launched.wait_state(JobState::Running).await;
    let placed = started.elapsed();
    let job = launched.store.job(&launched.id).await.unwrap().unwrap();
    assert_eq!(job.infra, InfraKind::Local);
    let placement = job.placement.clone().unwrap();
    assert!(
        placement.starts_with("slurm: it refused the group: "),
        "{placement}"
    );
    let slurm_installed = std::process::Command::new("sbatch")
        .arg("--version")
        .output()
        .is_ok();
    // The controller is asked before anything is submitted.
    let why = if slurm_installed {
        "is DOWN"
    } else {
        "could not run `scontrol`"
    };
    assert!(placement.contains(why), "{placement}");
    if slurm_installed {
        assert!(placement.contains("`scontrol ping` failed"), "{placement}");
    }
    assert!(
        job.message
            .as_deref()
            .is_some_and(|m| m.starts_with("every unit running on local")),
        "{:?}",
        job.message
    );
    for u in launched.units().await {
        assert_eq!(u.infra, InfraKind::Local);
        assert_eq!(
            (u.state, u.attempt),
            (UnitState::Running, 0),
            "{}",
            u.component
        );
    }
    let seen = wait_for("the client's discovery", async || {
        read(&dir.join("client.seen"))
    })
    .await;
    assert_eq!(seen, format!("127.0.0.1:{port}\n"));
    eprintln!("placed on local {placed:?} after the launch");

    launched.store.request_cancel(&launched.id).await.unwrap();
    assert_eq!(launched.supervisor.await.unwrap(), JobState::Cancelled);
    for component in ["server", "client"] {
        for pid in lines(&dir.join(format!("{component}.pids"))) {
            let pid: i32 = pid.parse().unwrap();
            wait_for("the programs to be gone", async || {
                (!alive(pid)).then_some(())
            })
            .await;
        }
    }
    if slurm_installed {
        // Nothing reached Slurm.
        let out = std::process::Command::new("squeue")
            .args(["-h", "--name", &format!("{name}-server,{name}-client")])
            .output()
            .unwrap();
        assert!(String::from_utf8_lossy(&out.stdout).trim().is_empty());
    }
}

/// A one-component group (`exec sleep 120`, with `extra` keys) launched with
/// `resources.infra: [slurm, local]` on the test cluster and this machine.
async fn on_slurm_then_local(name: &str, extra: &str, home: &Path) -> Launched {
    let name = format!("{name}{}", std::process::id() % 100_000);
    let group = JobGroup::parse(&format!(
        "name: {name}\n{extra}resources: {{infra: [slurm, local]}}\nrun: exec sleep 120\n"
    ))
    .unwrap();
    let backends = vec![
        AnyBackend::Slurm(SlurmBackend::new(SlurmSettings::default())),
        AnyBackend::Local(LocalBackend::new()),
    ];
    launch_on(backends, &group, home, slurm_settings()).await
}

/// Starts the test cluster's missing daemons again (`scripts/start-slurm` is
/// idempotent), also when the test that stopped one fails.
struct RestartSlurm;

impl Drop for RestartSlurm {
    fn drop(&mut self) {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/start-slurm");
        let out = std::process::Command::new(script).output().unwrap();
        assert!(
            out.status.success() || std::thread::panicking(),
            "restarting slurmctld: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The real cluster's controller stopped (slurmctld killed): a group that prefers Slurm
/// runs on local, and Slurm works again once the controller is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Slurm cluster: scripts/start-slurm, with SLURM_CONF set"]
async fn a_stopped_slurm_controller_sends_the_group_to_local() {
    let conf = std::fs::read_to_string(std::env::var("SLURM_CONF").unwrap()).unwrap();
    let pid_file = conf
        .lines()
        .find_map(|l| l.strip_prefix("SlurmctldPidFile="))
        .expect("scripts/start-slurm's configuration names the pid file");
    let pid: i32 = read(Path::new(pid_file)).unwrap().trim().parse().unwrap();
    let _restart = RestartSlurm;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    wait_for("slurmctld to stop", async || (!alive(pid)).then_some(())).await;

    let home = tempfile::tempdir().unwrap();
    let launched = on_slurm_then_local("ctlddown", "", home.path()).await;
    launched.wait_state(JobState::Running).await;
    let job = launched.store.job(&launched.id).await.unwrap().unwrap();
    assert_eq!(job.infra, InfraKind::Local);
    let placement = job.placement.unwrap_or_default();
    assert!(
        placement.starts_with("slurm: it refused the group: `scontrol ping` failed: ")
            && placement.contains("is DOWN"),
        "{placement}"
    );
    launched.store.request_cancel(&launched.id).await.unwrap();
    assert_eq!(launched.supervisor.await.unwrap(), JobState::Cancelled);
}

/// Slurm queues a job that asks for more nodes than the partition has for ever (reason
/// `PartitionNodeLimit`): the supervisor takes that for "cannot place" and moves the
/// group on; local cannot run a multi-node component either, so the launch fails,
/// saying why for each engine, and nothing is left in Slurm's queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Slurm cluster: scripts/start-slurm, with SLURM_CONF set"]
async fn a_group_neither_slurm_nor_local_can_place_fails_saying_why() {
    let home = tempfile::tempdir().unwrap();
    let launched = on_slurm_then_local("toobig", "num_nodes: 3\n", home.path()).await;
    let end = tokio::time::timeout(PATIENCE, launched.supervisor)
        .await
        .expect("the launch ended")
        .unwrap();
    assert_eq!(end, JobState::Failed);
    let store = launched.store;
    let job = store.job(&launched.id).await.unwrap().unwrap();
    let message = job.message.unwrap_or_default();
    assert!(
        message.starts_with(
            "no engine of the launch's order can take the group: slurm: it cannot place the group: "
        ),
        "{message}"
    );
    assert!(message.contains("PartitionNodeLimit"), "{message}");
    assert!(message.contains("local: "), "{message}");
    let units = store.units(&job.id).await.unwrap();
    slurm_has_nothing_left(&units).await;
}

/// The primaries finish: the auxiliaries are stopped after their termination delay,
/// and the launch succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auxiliaries_stop_after_the_primaries_and_their_delay() {
    let home = tempfile::tempdir().unwrap();
    let group = JobGroup::parse(
        "name: aux\nexecution: parallel\nprimary_tasks: [main]\ntermination_delay: 1s\n---\nname: main\nrun: sleep 0.5\n---\nname: helper\nrun: |\n  trap 'echo stopped; exit 0' TERM\n  while true; do sleep 0.05; done\n",
    )
    .unwrap();
    let launched = launch(LocalBackend::new(), &group, home.path(), local_settings()).await;
    let started = Instant::now();
    assert_eq!(launched.supervisor.await.unwrap(), JobState::Succeeded);
    let elapsed = started.elapsed();
    let units = launched.store.units(&launched.id).await.unwrap();
    assert_eq!(units[0].state, UnitState::Succeeded);
    assert_eq!(units[1].state, UnitState::Stopped);
    let main_end = units[0].ended_ms.unwrap();
    let helper_end = units[1].ended_ms.unwrap();
    assert!(helper_end - main_end >= 1000, "{main_end} {helper_end}");
    assert!(elapsed < Duration::from_secs(10), "{elapsed:?}");
}

/// A unit that fails past its policy fails the launch, and the rest is stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_past_the_policy_fails_the_launch() {
    let home = tempfile::tempdir().unwrap();
    let group = JobGroup::parse(
        "name: fails\nexecution: parallel\n---\nname: flaky\nresources: {job_recovery: {max_restarts_on_errors: 1, recover_on_exit_codes: [33]}}\nrun: |\n  n=$(cat count 2>/dev/null || echo 0); echo $((n + 1)) > count\n  if [ $n -eq 0 ]; then exit 33; fi\n  exit 4\n---\nname: other\nrun: sleep 600\n",
    )
    .unwrap();
    let mut group = group;
    group.components[0].workdir = Some(home.path().display().to_string());
    let launched = launch(LocalBackend::new(), &group, home.path(), local_settings()).await;
    assert_eq!(launched.supervisor.await.unwrap(), JobState::Failed);
    let job = launched.store.job(&launched.id).await.unwrap().unwrap();
    assert_eq!(
        job.message.as_deref(),
        Some("component `flaky` failed: exit code 4; max_restarts_on_errors (1) spent")
    );
    let units = launched.store.units(&launched.id).await.unwrap();
    // 33 restarted without counting, 4 once with counting, 4 again is the end.
    assert_eq!((units[0].attempt, units[0].restarts_on_errors), (2, 1));
    assert_eq!(units[1].state, UnitState::Stopped);
    assert_eq!(
        std::fs::read_to_string(home.path().join("count")).unwrap(),
        "3\n"
    );
}

/// Preemption on local: a serving spike (a launch of higher priority) stops the
/// trainer, which checkpoints and exits; when the spike is over, the trainer starts
/// again and resumes from its checkpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_serving_spike_preempts_training_which_resumes_from_its_checkpoint() {
    let home = tempfile::tempdir().unwrap();
    let work = home.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let w = work.display();
    let settings = SupervisorSettings {
        local_cpus: 2.0,
        ..local_settings()
    };
    // The trainer counts steps, saves the count on SIGTERM and exits, and starts from
    // the saved count.
    let trainer = JobGroup::parse(&format!(
        r#"
name: train
resources: {{cpus: 2, priority: -100, job_recovery: {{max_restarts_on_errors: 0}}}}
run: |
  step=$(cat {w}/checkpoint 2>/dev/null || echo 0)
  echo "resumed at $step" >> {w}/trainer.log
  trap 'echo $step > {w}/checkpoint; echo "checkpointed at $step" >> {w}/trainer.log; exit 0' TERM
  while true; do step=$((step + 1)); echo $step > {w}/progress; sleep 0.02; done
"#
    ))
    .unwrap();
    let serve = JobGroup::parse(&format!(
        "name: spike\nresources: {{cpus: 2, priority: 100}}\nrun: |\n  echo serving >> {w}/server.log\n  exec sleep 120\n"
    ))
    .unwrap();
    let training = launch(LocalBackend::new(), &trainer, home.path(), settings.clone()).await;
    training.wait_state(JobState::Running).await;
    let progress = work.join("progress");
    let before: u64 = wait_for("training steps", async || {
        read(&progress)?
            .trim()
            .parse::<u64>()
            .ok()
            .filter(|s| *s > 5)
    })
    .await;

    // The spike: the server needs both CPUs.
    let spike = launch(LocalBackend::new(), &serve, home.path(), settings.clone()).await;
    spike.wait_state(JobState::Running).await;
    let trainer_unit = training.unit("train").await;
    assert_eq!(trainer_unit.state, UnitState::Preempted);
    let checkpoint: u64 = read(&work.join("checkpoint"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(checkpoint >= before, "{checkpoint} < {before}");
    assert_eq!(training.state().await, JobState::Running);

    // The spike ends: the trainer comes back and resumes.
    spike.store.request_cancel(&spike.id).await.unwrap();
    assert_eq!(spike.supervisor.await.unwrap(), JobState::Cancelled);
    let resumed = wait_for("the trainer to run again", async || {
        let u = training.unit("train").await;
        (u.state == UnitState::Running && u.attempt == 1).then_some(u)
    })
    .await;
    // A preemption is not the program's failure: nothing was counted.
    assert_eq!(resumed.restarts_on_errors, 0);
    let log = wait_for("the trainer's second start", async || {
        read(&work.join("trainer.log")).filter(|t| t.lines().count() >= 3)
    })
    .await;
    assert_eq!(
        log,
        format!("resumed at 0\ncheckpointed at {checkpoint}\nresumed at {checkpoint}\n")
    );
    wait_for("steps past the checkpoint", async || {
        read(&progress)?
            .trim()
            .parse::<u64>()
            .ok()
            .filter(|s| *s > checkpoint)
    })
    .await;
    training.store.request_cancel(&training.id).await.unwrap();
    assert_eq!(training.supervisor.await.unwrap(), JobState::Cancelled);
}

/// A supervisor that dies leaves its units running; a new one picks the launch up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_supervisor_picks_up_a_running_launch() {
    let home = tempfile::tempdir().unwrap();
    let group = JobGroup::parse(
        "name: pickup\nresources: {job_recovery: {max_restarts_on_errors: 1}}\nrun: exec sleep 120\n",
    )
    .unwrap();
    let mut launched = launch(LocalBackend::new(), &group, home.path(), local_settings()).await;
    launched.wait_state(JobState::Running).await;
    launched.supervisor.abort();
    let _ = (&mut launched.supervisor).await;
    let unit = launched.unit("pickup").await;
    let pid: i32 = unit
        .handle
        .as_deref()
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(alive(pid));

    let store = launched.store.clone();
    let again = Supervisor::new(
        store.clone(),
        LocalBackend::new(),
        local_settings(),
        &launched.id,
    )
    .await
    .unwrap();
    let supervisor = tokio::spawn(async move { again.run().await.unwrap() });
    // Its units are still known and still running; cancel reaches them.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(launched.unit("pickup").await.state, UnitState::Running);
    assert_eq!(launched.unit("pickup").await.attempt, 0);
    store.request_cancel(&launched.id).await.unwrap();
    assert_eq!(supervisor.await.unwrap(), JobState::Cancelled);
    wait_for("the program to be gone", async || {
        (!alive(pid)).then_some(())
    })
    .await;
}

/// Serving replicas count as ready once their readiness probe answers; a replica that
/// never does is replaced by its policy, then fails the launch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_are_probed_and_one_never_ready_is_replaced() {
    let home = tempfile::tempdir().unwrap();
    let served = home.path().join("served");
    std::fs::create_dir_all(&served).unwrap();
    // Replicas on one host take consecutive ports: both must be free.
    let port = free_port_pair();
    let group = JobGroup::parse(&format!(
        r#"
name: serve
replicas: 2
resources: {{ports: {port}}}
readiness_probe: {{path: /ready, initial_delay_seconds: 20, endpoint_probe_interval_seconds: 0.1, timeout_seconds: 1}}
run: |
  cd {served}
  (sleep 0.5; touch ready) &
  exec python3 -m http.server "$AGENTSTACK_PORT" --bind 127.0.0.1
"#,
        served = served.display()
    ))
    .unwrap();
    let launched = launch(LocalBackend::new(), &group, home.path(), local_settings()).await;
    let units = wait_for("both replicas ready", async || {
        let units = launched.units().await;
        units
            .iter()
            .all(|u| u.ready_ms.is_some() && u.message.as_deref() == Some("ready"))
            .then_some(units)
    })
    .await;
    for u in &units {
        let waited = u.ready_ms.unwrap() - u.running_ms.unwrap();
        assert!(
            waited >= 300,
            "ready {waited} ms after it ran: before `ready` existed"
        );
    }
    launched.store.request_cancel(&launched.id).await.unwrap();
    assert_eq!(launched.supervisor.await.unwrap(), JobState::Cancelled);

    let never = JobGroup::parse(&format!(
        "name: never\nresources: {{ports: {port}, job_recovery: {{max_restarts_on_errors: 1}}}}\nreadiness_probe: {{path: /ready, initial_delay_seconds: 0.5, endpoint_probe_interval_seconds: 0.1}}\nrun: exec python3 -m http.server \"$AGENTSTACK_PORT\" --bind 127.0.0.1 --directory {}\n",
        home.path().join("empty").display()
    ))
    .unwrap();
    std::fs::create_dir_all(home.path().join("empty")).unwrap();
    let launched = launch(LocalBackend::new(), &never, home.path(), local_settings()).await;
    assert_eq!(launched.supervisor.await.unwrap(), JobState::Failed);
    let unit = &launched.store.units(&launched.id).await.unwrap()[0];
    assert_eq!((unit.attempt, unit.restarts_on_errors), (1, 1));
    let job = launched.store.job(&launched.id).await.unwrap().unwrap();
    assert_eq!(
        job.message.as_deref(),
        Some(
            "component `never` failed: readiness probe: not ready within initial_delay_seconds (0.5 s); max_restarts_on_errors (1) spent"
        )
    );
}

/// A component of two nodes on Slurm: each node learns its own rank and the node list
/// from Slurm, and every address of the group from the discovery file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Slurm cluster: scripts/start-slurm, with SLURM_CONF set"]
async fn slurm_multi_node_component() {
    let home = tempfile::tempdir().unwrap();
    let dir = home.path().join("work");
    std::fs::create_dir_all(&dir).unwrap();
    let d = dir.display();
    let group = JobGroup::parse(&format!(
        r#"
name: nodes{}
execution: parallel
primary_tasks: [ranks]
---
name: ranks
num_nodes: 2
run: |
  echo "$SKYPILOT_NODE_RANK of $SKYPILOT_NUM_NODES: $(echo $SKYPILOT_NODE_IPS) peer=$AGENTSTACK_PEER_ADDRS ranks=$AGENTSTACK_RANKS_ADDRS" > {d}/rank.$SKYPILOT_NODE_RANK
---
name: peer
resources: {{ports: 9000}}
run: exec sleep 120
"#,
        std::process::id() % 100_000
    ))
    .unwrap();
    let launched = launch(
        SlurmBackend::new(SlurmSettings::default()),
        &group,
        home.path(),
        slurm_settings(),
    )
    .await;
    let _cleanup = Cleanup(|| {
        for c in ["ranks", "peer"] {
            let _ = std::process::Command::new("scancel")
                .args(["--name", &format!("{}-{c}", group.name)])
                .status();
        }
    });
    // The primary ends when both nodes have written; the peer is then stopped.
    assert_eq!(launched.supervisor.await.unwrap(), JobState::Succeeded);
    for rank in 0..2 {
        let text = std::fs::read_to_string(dir.join(format!("rank.{rank}"))).unwrap();
        assert_eq!(
            text,
            format!(
                "{rank} of 2: 127.0.0.1 127.0.0.1 peer=127.0.0.1:9000 ranks=127.0.0.1,127.0.0.1\n"
            )
        );
    }
}

/// An engine that refuses `b`'s first submission, then behaves like local processes.
struct Refusing {
    inner: LocalBackend,
    refused: std::sync::atomic::AtomicBool,
}

impl Backend for Refusing {
    fn kind(&self) -> InfraKind {
        InfraKind::Local
    }

    fn addresses_up_front(
        &self,
        group: &JobGroup,
    ) -> Option<agentstack_compute::discovery::Addresses> {
        self.inner.addresses_up_front(group)
    }

    async fn start(
        &self,
        launch: &agentstack_compute::backend::UnitLaunch<'_>,
    ) -> Result<String, agentstack_compute::backend::BackendError> {
        if launch.task.name == "b" && !self.refused.swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            return Err(agentstack_compute::backend::BackendError::Command {
                command: "submit".into(),
                stderr: "the engine is busy".into(),
            });
        }
        self.inner.start(launch).await
    }

    async fn poll(
        &self,
        handles: &[String],
    ) -> Result<
        Vec<agentstack_compute::backend::UnitStatus>,
        agentstack_compute::backend::BackendError,
    > {
        self.inner.poll(handles).await
    }

    async fn stop(
        &self,
        handle: &str,
        graceful: bool,
    ) -> Result<(), agentstack_compute::backend::BackendError> {
        self.inner.stop(handle, graceful).await
    }

    async fn logs(
        &self,
        handle: &str,
    ) -> Result<agentstack_compute::backend::LogSource, agentstack_compute::backend::BackendError>
    {
        self.inner.logs(handle).await
    }
}

/// A refused submission is retried at the next tick: the gang still starts, and no
/// unit is left marked starting with nothing behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_submission_is_tried_again() {
    let home = tempfile::tempdir().unwrap();
    let group = JobGroup::parse(
        "name: retry\nexecution: parallel\n---\nname: a\nresources: {cpus: 1}\nrun: exec sleep 120\n---\nname: b\nresources: {cpus: 1}\nrun: exec sleep 120\n---\nname: c\nresources: {cpus: 1}\nrun: exec sleep 120\n",
    )
    .unwrap();
    let backend = Refusing {
        inner: LocalBackend::new(),
        refused: false.into(),
    };
    let settings = SupervisorSettings {
        local_cpus: 3.0,
        ..local_settings()
    };
    let launched = launch(backend, &group, home.path(), settings).await;
    launched.wait_state(JobState::Running).await;
    let units = launched.units().await;
    assert!(units.iter().all(|u| u.attempt == 0), "{units:?}");
    launched.store.request_cancel(&launched.id).await.unwrap();
    assert_eq!(launched.supervisor.await.unwrap(), JobState::Cancelled);
}
