//! The Kubernetes backend against a scripted API server on 127.0.0.1 (no real API
//! server can run on these machines; see `reference/compute.md`), in the style of
//! kube's mock tests: every call that changes the cluster is asserted in order, with
//! its body, and a call that never comes fails the test on a timeout. Reads (`GET` of
//! a Job) are answered from the mock's state, which the test moves along.
//!
//! With `KUBECONFIG` set, `real_cluster_launch_and_cancel` runs the same kind of
//! launch on that cluster.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentstack_compute::JobGroup;
use agentstack_compute::backend::kubernetes::{Credentials, KubernetesBackend, KubernetesSettings};
use agentstack_compute::state::{JobState, Store, UnitState};
use agentstack_compute::supervisor::{Supervisor, SupervisorSettings, create_launch};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::IntoResponse;
use serde_json::{Value, json};
use tokio::sync::mpsc;

/// How long a call the script expects may take to come.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// A call that changed something: method, path, body.
type Call = (Method, String, Value);

#[derive(Default)]
struct Cluster {
    /// Job name → the Job as stored (its status set by the test).
    jobs: HashMap<String, Value>,
    /// Calls the mock does not know.
    unexpected: Vec<String>,
    /// `GET`s of Jobs answered.
    reads: usize,
}

#[derive(Clone)]
struct Mock {
    cluster: Arc<Mutex<Cluster>>,
    calls: mpsc::UnboundedSender<Call>,
}

async fn api(
    State(mock): State<Mock>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> impl IntoResponse {
    let path = uri.path().to_owned();
    if headers.get("authorization").and_then(|v| v.to_str().ok()) != Some("Bearer t0ken") {
        mock.cluster
            .lock()
            .unwrap()
            .unexpected
            .push(format!("{method} {path} without the token"));
        return (StatusCode::UNAUTHORIZED, axum::Json(json!({})));
    }
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let mut cluster = mock.cluster.lock().unwrap();
    let jobs_prefix = "/apis/batch/v1/namespaces/ml/jobs";
    let reply = match (&method, path.as_str()) {
        (&Method::POST, "/api/v1/namespaces/ml/services") => (StatusCode::CREATED, body.clone()),
        (&Method::POST, p) if p == jobs_prefix => {
            let name = body["metadata"]["name"].as_str().unwrap().to_owned();
            cluster.jobs.insert(name, body.clone());
            (StatusCode::CREATED, body.clone())
        }
        (&Method::GET, p) if p.starts_with(jobs_prefix) => {
            cluster.reads += 1;
            let name = p.rsplit('/').next().unwrap();
            match cluster.jobs.get(name) {
                Some(job) => (StatusCode::OK, job.clone()),
                None => (
                    StatusCode::NOT_FOUND,
                    json!({"kind": "Status", "code": 404}),
                ),
            }
        }
        (&Method::DELETE, p) if p.starts_with(jobs_prefix) => {
            let name = p.rsplit('/').next().unwrap();
            match cluster.jobs.remove(name) {
                Some(_) => (
                    StatusCode::OK,
                    json!({"kind": "Status", "status": "Success"}),
                ),
                None => (
                    StatusCode::NOT_FOUND,
                    json!({"kind": "Status", "code": 404}),
                ),
            }
        }
        (&Method::DELETE, p) if p.starts_with("/api/v1/namespaces/ml/services/") => (
            StatusCode::OK,
            json!({"kind": "Status", "status": "Success"}),
        ),
        _ => {
            cluster.unexpected.push(format!("{method} {path}"));
            (StatusCode::NOT_FOUND, json!({}))
        }
    };
    if method != Method::GET {
        mock.calls.send((method, path, body)).unwrap();
    }
    (reply.0, axum::Json(reply.1))
}

struct Server {
    address: String,
    cluster: Arc<Mutex<Cluster>>,
    calls: mpsc::UnboundedReceiver<Call>,
}

async fn serve() -> Server {
    let (tx, rx) = mpsc::unbounded_channel();
    let cluster = Arc::new(Mutex::new(Cluster::default()));
    let mock = Mock {
        cluster: cluster.clone(),
        calls: tx,
    };
    let app = axum::Router::new().fallback(api).with_state(mock);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Server {
        address,
        cluster,
        calls: rx,
    }
}

impl Server {
    /// The next call that changes the cluster, which must be `method path`.
    async fn expect(&mut self, method: Method, path: &str) -> Value {
        let call = tokio::time::timeout(CALL_TIMEOUT, self.calls.recv())
            .await
            .unwrap_or_else(|_| panic!("no {method} {path} within {CALL_TIMEOUT:?}"))
            .expect("the mock is running");
        assert_eq!((&call.0, call.1.as_str()), (&method, path));
        call.2
    }

    fn set_status(&self, job: &str, status: Value) {
        let mut cluster = self.cluster.lock().unwrap();
        cluster.jobs.get_mut(job).unwrap()["status"] = status;
    }
}

const GROUP: &str = "
name: rl
execution: parallel
primary_tasks: [trainer]
---
name: env-server
replicas: 2
resources: {ports: 8000, job_recovery: {max_restarts_on_errors: 3}}
run: serve --port $AGENTSTACK_PORT
---
name: trainer
resources: {cpus: 2, job_recovery: {max_restarts_on_errors: 1, recover_on_exit_codes: [33]}}
run: train --env $AGENTSTACK_ENV_SERVER_ADDRS
";

fn backend(server: &Server) -> KubernetesBackend {
    KubernetesBackend::new(
        Credentials {
            server: server.address.clone(),
            token: Some("t0ken".into()),
            ..Default::default()
        },
        KubernetesSettings {
            namespace: "ml".into(),
            image: "example/agentstack:1".into(),
            queue: None,
            termination_grace_seconds: 30,
        },
    )
    .unwrap()
}

fn settings() -> SupervisorSettings {
    SupervisorSettings {
        poll_interval: Duration::from_millis(20),
        stop_grace: Duration::from_secs(2),
        ..Default::default()
    }
}

const SERVICES: &str = "/api/v1/namespaces/ml/services";
const JOBS: &str = "/apis/batch/v1/namespaces/ml/jobs";

/// Creates both Services and both Jobs, and waits for the launch to run.
async fn start(
    server: &mut Server,
    store: &Store,
    home: &std::path::Path,
) -> (String, tokio::task::JoinHandle<JobState>) {
    let group = JobGroup::parse(GROUP).unwrap();
    let backend = backend(server);
    let job = create_launch(store, &backend, &group, home, &json!({}), &settings())
        .await
        .unwrap();
    let supervisor = Supervisor::new(store.clone(), backend, settings(), &job.id)
        .await
        .unwrap();
    let handle = tokio::spawn(async move { supervisor.run().await.unwrap() });

    let svc = server.expect(Method::POST, SERVICES).await;
    assert_eq!(svc["metadata"]["name"], "rl-env-server");
    assert_eq!(svc["spec"]["clusterIP"], "None");
    let svc = server.expect(Method::POST, SERVICES).await;
    assert_eq!(svc["metadata"]["name"], "rl-trainer");
    let env_job = server.expect(Method::POST, JOBS).await;
    assert_eq!(env_job["metadata"]["name"], "rl-env-server");
    assert_eq!(env_job["spec"]["completions"], 2);
    assert_eq!(env_job["spec"]["backoffLimit"], 3);
    let trainer = server.expect(Method::POST, JOBS).await;
    assert_eq!(trainer["spec"]["backoffLimit"], 1);
    let env: Vec<&Value> = trainer["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()
        .unwrap()
        .iter()
        .collect();
    let addrs = env
        .iter()
        .find(|e| e["name"] == "AGENTSTACK_ENV_SERVER_ADDRS")
        .unwrap();
    assert_eq!(
        addrs["value"],
        "rl-env-server-0.rl-env-server.ml.svc:8000,rl-env-server-1.rl-env-server.ml.svc:8000"
    );

    // Nothing runs until every Pod of every Job is ready (gang start).
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        store.job(&job.id).await.unwrap().unwrap().state,
        JobState::Starting
    );
    server.set_status("rl-env-server", json!({"active": 2, "ready": 2}));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        store.job(&job.id).await.unwrap().unwrap().state,
        JobState::Starting
    );
    server.set_status("rl-trainer", json!({"active": 1, "ready": 1}));
    for _ in 0..100 {
        if store.job(&job.id).await.unwrap().unwrap().state == JobState::Running {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        store.job(&job.id).await.unwrap().unwrap().state,
        JobState::Running
    );
    assert!(server.cluster.lock().unwrap().reads > 0);
    (job.id, handle)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_deletes_every_job_then_every_service() {
    let mut server = serve().await;
    let home = tempfile::tempdir().unwrap();
    let store = Store::open(&home.path().join("jobs.db")).await.unwrap();
    let (id, supervisor) = start(&mut server, &store, home.path()).await;

    store.request_cancel(&id).await.unwrap();
    let delete = server
        .expect(Method::DELETE, &format!("{JOBS}/rl-env-server"))
        .await;
    assert_eq!(delete["propagationPolicy"], "Background");
    assert_eq!(delete["gracePeriodSeconds"], 30);
    server
        .expect(Method::DELETE, &format!("{JOBS}/rl-trainer"))
        .await;
    // Cleanup: each Job again (already gone: 404 is fine), then each Service.
    server
        .expect(Method::DELETE, &format!("{JOBS}/rl-env-server"))
        .await;
    server
        .expect(Method::DELETE, &format!("{JOBS}/rl-trainer"))
        .await;
    server
        .expect(Method::DELETE, &format!("{SERVICES}/rl-env-server"))
        .await;
    server
        .expect(Method::DELETE, &format!("{SERVICES}/rl-trainer"))
        .await;
    assert_eq!(supervisor.await.unwrap(), JobState::Cancelled);
    assert!(server.calls.try_recv().is_err(), "a call after the end");
    assert!(server.cluster.lock().unwrap().unexpected.is_empty());
    for u in store.units(&id).await.unwrap() {
        assert_eq!(u.state, UnitState::Stopped);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_job_fails_the_launch_and_the_rest_is_deleted() {
    let mut server = serve().await;
    let home = tempfile::tempdir().unwrap();
    let store = Store::open(&home.path().join("jobs.db")).await.unwrap();
    let (id, supervisor) = start(&mut server, &store, home.path()).await;

    // The Job controller spent the trainer's retries.
    server.set_status(
        "rl-trainer",
        json!({"failed": 2, "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "message": "Job has reached the specified backoff limit"}]}),
    );
    server
        .expect(Method::DELETE, &format!("{JOBS}/rl-env-server"))
        .await;
    server
        .expect(Method::DELETE, &format!("{JOBS}/rl-env-server"))
        .await;
    server
        .expect(Method::DELETE, &format!("{JOBS}/rl-trainer"))
        .await;
    server
        .expect(Method::DELETE, &format!("{SERVICES}/rl-env-server"))
        .await;
    server
        .expect(Method::DELETE, &format!("{SERVICES}/rl-trainer"))
        .await;
    assert_eq!(supervisor.await.unwrap(), JobState::Failed);
    let job = store.job(&id).await.unwrap().unwrap();
    assert!(
        job.message
            .as_deref()
            .unwrap()
            .starts_with("component `trainer` failed"),
        "{:?}",
        job.message
    );
    assert!(server.cluster.lock().unwrap().unexpected.is_empty());
    assert!(server.cluster.lock().unwrap().jobs.is_empty());
}

/// `recovery: group`: the Jobs never retry a Pod themselves; when one fails, the
/// supervisor deletes the others, then creates every Job again (the failed one deleted
/// first, to free its name), and the launch runs again once all are ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_recovery_deletes_every_job_and_creates_them_again() {
    let mut server = serve().await;
    let home = tempfile::tempdir().unwrap();
    let store = Store::open(&home.path().join("jobs.db")).await.unwrap();
    let group = JobGroup::parse(&GROUP.replace(
        "execution: parallel\n",
        "execution: parallel\nrecovery: group\n",
    ))
    .unwrap();
    let backend = backend(&server);
    let job = create_launch(
        &store,
        &backend,
        &group,
        home.path(),
        &json!({}),
        &settings(),
    )
    .await
    .unwrap();
    let supervisor = Supervisor::new(store.clone(), backend, settings(), &job.id)
        .await
        .unwrap();
    let supervisor = tokio::spawn(async move { supervisor.run().await.unwrap() });
    server.expect(Method::POST, SERVICES).await;
    server.expect(Method::POST, SERVICES).await;
    for name in ["rl-env-server", "rl-trainer"] {
        let created = server.expect(Method::POST, JOBS).await;
        assert_eq!(created["metadata"]["name"], name);
        assert_eq!(created["spec"]["backoffLimit"], 0, "{name}");
        assert_eq!(
            created["spec"]["podFailurePolicy"]["rules"],
            json!([]),
            "{name}"
        );
    }
    let running = async |store: &Store| {
        for _ in 0..200 {
            if store.job(&job.id).await.unwrap().unwrap().state == JobState::Running {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the launch did not run");
    };
    server.set_status("rl-env-server", json!({"active": 2, "ready": 2}));
    server.set_status("rl-trainer", json!({"active": 1, "ready": 1}));
    running(&store).await;

    // The trainer's Pod fails, and with it its Job.
    server.set_status(
        "rl-trainer",
        json!({"failed": 1, "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "message": "Job has reached the specified backoff limit"}]}),
    );
    server
        .expect(Method::DELETE, &format!("{JOBS}/rl-env-server"))
        .await;
    // The group starts again: each Job's name is freed, then the Job created anew.
    server
        .expect(Method::DELETE, &format!("{JOBS}/rl-env-server"))
        .await;
    let again = server.expect(Method::POST, JOBS).await;
    assert_eq!(again["metadata"]["name"], "rl-env-server");
    server
        .expect(Method::DELETE, &format!("{JOBS}/rl-trainer"))
        .await;
    let again = server.expect(Method::POST, JOBS).await;
    assert_eq!(again["metadata"]["name"], "rl-trainer");
    assert_eq!(
        store.job(&job.id).await.unwrap().unwrap().state,
        JobState::Starting
    );
    server.set_status("rl-env-server", json!({"active": 2, "ready": 2}));
    server.set_status("rl-trainer", json!({"active": 1, "ready": 1}));
    running(&store).await;
    let record = store.job(&job.id).await.unwrap().unwrap();
    assert_eq!(record.recoveries, 1);
    for u in store.units(&job.id).await.unwrap() {
        assert_eq!(u.attempt, 1, "{}", u.component);
        let counted = u32::from(u.component == "trainer");
        assert_eq!(u.restarts_on_errors, counted, "{}", u.component);
    }

    store.request_cancel(&job.id).await.unwrap();
    assert_eq!(supervisor.await.unwrap(), JobState::Cancelled);
    assert!(server.cluster.lock().unwrap().unexpected.is_empty());
    assert!(server.cluster.lock().unwrap().jobs.is_empty());
}

/// On a real cluster (`KUBECONFIG` set): two components run, find each other by DNS,
/// and cancel deletes everything. The image must hold bash
/// (`AGENTSTACK_TEST_K8S_IMAGE`, default `bash:5`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_cluster_launch_and_cancel() {
    if std::env::var_os("KUBECONFIG").is_none() {
        eprintln!("KUBECONFIG is not set: skipping the real-cluster test");
        return;
    }
    let path = Credentials::default_path().unwrap();
    let credentials = Credentials::from_kubeconfig(&path, None).unwrap();
    let namespace = credentials
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let backend = KubernetesBackend::new(
        credentials,
        KubernetesSettings {
            namespace,
            image: std::env::var("AGENTSTACK_TEST_K8S_IMAGE").unwrap_or_else(|_| "bash:5".into()),
            queue: None,
            termination_grace_seconds: 5,
        },
    )
    .unwrap();
    let group = JobGroup::parse(&format!(
        "name: as-test-{}\nexecution: parallel\n---\nname: server\nresources: {{ports: 8000}}\nrun: exec sleep 600\n---\nname: client\nrun: |\n  echo \"$AGENTSTACK_SERVER_ADDRS\"\n  exec sleep 600\n",
        std::process::id() % 100_000
    ))
    .unwrap();
    let home = tempfile::tempdir().unwrap();
    let store = Store::open(&home.path().join("jobs.db")).await.unwrap();
    let settings = SupervisorSettings {
        poll_interval: Duration::from_millis(500),
        start_timeout: Duration::from_secs(300),
        ..Default::default()
    };
    let job = create_launch(&store, &backend, &group, home.path(), &json!({}), &settings)
        .await
        .unwrap();
    let supervisor = Supervisor::new(store.clone(), backend, settings, &job.id)
        .await
        .unwrap();
    let handle = tokio::spawn(async move { supervisor.run().await.unwrap() });
    for _ in 0..600 {
        if store.job(&job.id).await.unwrap().unwrap().state == JobState::Running {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(
        store.job(&job.id).await.unwrap().unwrap().state,
        JobState::Running
    );
    store.request_cancel(&job.id).await.unwrap();
    assert_eq!(handle.await.unwrap(), JobState::Cancelled);
}
