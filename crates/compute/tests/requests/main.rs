//! The example job group (`examples/rl-job.yaml`) through service discovery and every
//! request builder, snapshotted; the generated shell is checked with `bash -n`.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use agentstack_compute::discovery::{self, Addresses};
use agentstack_compute::kubernetes::{self, KubernetesOptions};
use agentstack_compute::ray::{self, RayOptions};
use agentstack_compute::slurm::{self, SlurmOptions};
use agentstack_compute::{BuildError, JobGroup};

fn example() -> JobGroup {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/rl-job.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut group = JobGroup::parse(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    // A fixed directory, so that snapshots do not depend on where the checkout is.
    group.resolve_paths(Path::new("/home/user/project/examples"));
    group
}

/// One host, as with a local or single-host Slurm or Ray cluster: replicas on
/// consecutive ports.
fn local_addresses(group: &JobGroup) -> Addresses {
    group
        .components
        .iter()
        .map(|t| {
            let endpoints = (0..t.instances())
                .map(|i| {
                    let port = t.resources.main_port().map(|p| p + i as u16);
                    discovery::Endpoint::new("127.0.0.1", port)
                })
                .collect();
            (t.name.clone(), endpoints)
        })
        .collect()
}

fn bash_syntax_ok(script: &str) {
    let mut child = Command::new("bash")
        .arg("-n")
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(script.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "bash -n: {}\n{script}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_example_parses_and_round_trips() {
    let group = example();
    assert_eq!(group.name, "rl-arithmetic");
    assert_eq!(
        group.component_names(),
        ["env-server", "model-server", "trainer"]
    );
    assert!(group.is_primary("trainer"));
    assert!(!group.is_primary("env-server") && !group.is_primary("model-server"));
    assert_eq!(group.termination_delay_seconds("env-server"), 30);
    let env_server = group.component("env-server").unwrap();
    assert_eq!(env_server.replicas, 2);
    for server in ["env-server", "model-server"] {
        let probe = group.component(server).unwrap().readiness_probe.as_ref();
        assert_eq!(probe.map(|p| p.path.as_str()), Some("/health"));
    }
    assert_eq!(
        group.component("trainer").unwrap().workdir.as_deref(),
        Some("/home/user/project/examples")
    );
    assert_eq!(JobGroup::parse(&group.to_yaml()).unwrap(), group);
}

#[test]
fn discovery_variables() {
    let group = example();
    let all = discovery::environments(&group, &local_addresses(&group)).unwrap();
    let report: BTreeMap<String, BTreeMap<String, String>> = all
        .into_iter()
        .map(|e| (format!("{}/{}", e.component, e.instance), e.vars))
        .collect();
    insta::assert_json_snapshot!(report);
}

#[test]
fn slurm_batch_scripts() {
    let group = example();
    let addresses = local_addresses(&group);
    let options = SlurmOptions {
        time_limit_minutes: Some(120),
        log_dir: Some("/home/user/.local/share/agentstack/jobs/rl-arithmetic/logs"),
        discovery_file: Some("/home/user/.local/share/agentstack/jobs/rl-arithmetic/peers.env"),
        discovery_timeout_seconds: 600,
        extra_options: &["--account=ml"],
    };
    let mut scripts = String::new();
    for (component, replica) in [("env-server", 1), ("model-server", 0), ("trainer", 0)] {
        let env = discovery::environment(&group, &addresses, component, replica as usize).unwrap();
        let script = slurm::batch_script(&group, component, replica, &env, &options).unwrap();
        bash_syntax_ok(&script);
        scripts.push_str(&format!("===== {component} replica {replica}\n{script}"));
    }
    insta::assert_snapshot!(scripts);
}

#[test]
fn ray_submissions() {
    let group = example();
    let addresses = local_addresses(&group);
    let options = RayOptions {
        launch_id: "a1b2c3",
        attempt: 0,
        ..Default::default()
    };
    let mut bodies = Vec::new();
    for (component, replica) in [("env-server", 1), ("model-server", 0), ("trainer", 0)] {
        let env = discovery::environment(&group, &addresses, component, replica as usize).unwrap();
        let body = ray::submit_request(&group, component, replica, &env, &options).unwrap();
        let entrypoint = body["entrypoint"].as_str().unwrap();
        bash_syntax_ok(entrypoint);
        bodies.push(body);
    }
    insta::assert_json_snapshot!(bodies);
}

#[test]
fn kubernetes_manifests() {
    let mut group = example();
    // Pods take their code from the image, not from a local directory.
    group.components[2].workdir = None;
    let options = KubernetesOptions {
        queue: Some("team-a"),
        ..KubernetesOptions::new("rl", "ghcr.io/agentstack/agentstack:latest")
    };
    let objects = kubernetes::manifests(&group, &options).unwrap();
    assert_eq!(objects.len(), 6);
    for job in objects.iter().filter(|o| o["kind"] == "Job") {
        let command = job["spec"]["template"]["spec"]["containers"][0]["command"][2]
            .as_str()
            .unwrap();
        bash_syntax_ok(&command.replace("$$", "$"));
    }
    insta::assert_json_snapshot!(objects);
}

#[test]
fn builders_refuse_what_they_cannot_run() {
    let group = example();
    let env = BTreeMap::new();
    let err = slurm::batch_script(&group, "nope", 0, &env, &SlurmOptions::default()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "there is no component named `nope`\nhint: the components are: env-server, model-server, trainer"
    );
    let err =
        slurm::batch_script(&group, "env-server", 2, &env, &SlurmOptions::default()).unwrap_err();
    assert!(matches!(err, BuildError::NoSuchReplica { replicas: 2, .. }));

    let multi = JobGroup::parse("name: t\nnum_nodes: 2\nrun: x\n").unwrap();
    let err = ray::submit_request(&multi, "t", 0, &env, &RayOptions::default()).unwrap_err();
    assert!(
        err.to_string()
            .contains("`num_nodes: 2` is not supported on ray"),
        "{err}"
    );

    let unset = JobGroup::parse("name: t\nenvs: {TOKEN: null}\nrun: x\n").unwrap();
    let err = slurm::batch_script(&unset, "t", 0, &env, &SlurmOptions::default()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "component `t`: `envs.TOKEN` has no value\nhint: give it one in the spec, or at launch with --env TOKEN=VALUE"
    );

    let err = kubernetes::manifests(&group, &KubernetesOptions::new("rl", "img")).unwrap_err();
    assert!(
        err.to_string()
            .contains("`workdir` is not supported on kubernetes"),
        "{err}"
    );
}

/// Submits `script` with `sbatch --parsable` and returns the job id.
fn sbatch(script: &str, dir: &Path) -> String {
    let path = dir.join(format!("job-{}.sh", std::process::id()));
    std::fs::write(&path, script).unwrap();
    let out = Command::new("sbatch")
        .arg("--parsable")
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "sbatch: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// Waits until `file`'s text passes `done` (or a minute passes) and returns it.
fn wait_for(file: &Path, done: impl Fn(&str) -> bool) -> String {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        if done(&text) || std::time::Instant::now() > deadline {
            return text;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// The batch script on a real cluster: every node of a two-node component gets its
/// rank and the nodes' addresses, and `scancel --signal=TERM` (to the step, or with
/// `--batch` to the shell) reaches the program's handler.
#[test]
#[ignore = "needs a Slurm cluster with two nodes: sbatch and scancel on PATH (SLURM_CONF)"]
fn slurm_runs_the_batch_script() {
    let dir = std::env::temp_dir().join(format!("agentstack-slurm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log_dir = dir.to_str().unwrap();
    let options = SlurmOptions {
        log_dir: Some(log_dir),
        ..Default::default()
    };
    let group = JobGroup::parse(
        "name: t\nexecution: parallel\n\
         ---\nname: ranks\nnum_nodes: 2\nrun: echo \"rank=$SKYPILOT_NODE_RANK of $SKYPILOT_NUM_NODES ips=$(echo $SKYPILOT_NODE_IPS) me=$AGENTSTACK_COMPONENT\"\n\
         ---\nname: trainer\nsetup: echo set up\nrun: |\n  trap 'echo checkpointed; exit 0' TERM\n  echo started\n  while true; do sleep 0.1; done\n",
    )
    .unwrap();
    let mut addresses = Addresses::new();
    addresses.insert(
        "ranks".into(),
        vec!["n1".parse().unwrap(), "n2".parse().unwrap()],
    );
    addresses.insert("trainer".into(), vec!["n1".parse().unwrap()]);

    let env = discovery::environment(&group, &addresses, "ranks", 0).unwrap();
    let id = sbatch(
        &slurm::batch_script(&group, "ranks", 0, &env, &options).unwrap(),
        &dir,
    );
    let log = dir.join(format!("t-ranks-{id}.log"));
    let text = wait_for(&log, |t| t.lines().count() >= 2);
    let mut lines: Vec<&str> = text.lines().collect();
    lines.sort();
    assert_eq!(
        lines,
        [
            "rank=0 of 2 ips=127.0.0.1 127.0.0.1 me=ranks",
            "rank=1 of 2 ips=127.0.0.1 127.0.0.1 me=ranks"
        ]
    );

    let env = discovery::environment(&group, &addresses, "trainer", 0).unwrap();
    let script = slurm::batch_script(&group, "trainer", 0, &env, &options).unwrap();
    for batch in [false, true] {
        let id = sbatch(&script, &dir);
        let log = dir.join(format!("t-trainer-{id}.log"));
        assert_eq!(
            wait_for(&log, |t| t.lines().count() >= 2),
            "set up\nstarted\n"
        );
        let mut scancel = Command::new("scancel");
        scancel.arg("--signal=TERM");
        if batch {
            scancel.arg("--batch");
        }
        assert!(scancel.arg(&id).status().unwrap().success());
        // Slurm adds its own lines ("STEP ... CANCELLED") around the program's.
        let text = wait_for(&log, |text| text.contains("checkpointed"));
        assert!(
            text.starts_with("set up\nstarted\n"),
            "--batch: {batch}\n{text}"
        );
        assert!(text.contains("checkpointed\n"), "--batch: {batch}\n{text}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
