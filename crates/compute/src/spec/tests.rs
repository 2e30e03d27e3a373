use super::*;

fn parse(text: &str) -> JobGroup {
    JobGroup::parse(text).unwrap_or_else(|e| panic!("{e}\n--- in\n{text}"))
}

fn error(text: &str) -> SpecError {
    match JobGroup::parse(text) {
        Ok(group) => panic!("parsed, but should not have:\n{text}\n{group:#?}"),
        Err(e) => e,
    }
}

fn round_trips(group: &JobGroup) {
    let yaml = group.to_yaml();
    let again = JobGroup::parse(&yaml).unwrap_or_else(|e| panic!("{e}\n--- in\n{yaml}"));
    assert_eq!(&again, group, "{yaml}");
    assert_eq!(again.to_yaml(), yaml);
}

const FULL_TASK: &str = r#"
name: trainer
workdir: ~/code
num_nodes: 2
resources:
  infra: slurm/hpc/gpu
  cpus: 4+
  memory: 16GB
  accelerators: {A100: 8}
  ports: [8080, "9000-9010"]
  job_recovery:
    strategy: failover
    max_restarts_on_errors: 3
    recover_on_exit_codes: [33, 34]
  priority: -10
envs:
  MODEL: smollm2
  STEPS: 100
  DEBUG: false
  TOKEN:
file_mounts:
  /data: ./data
  ~/ckpt: /scratch/ckpt
setup: pip install -r requirements.txt
run: |
  python train.py --steps $STEPS
  echo 'done'
"#;

#[test]
fn a_single_task_is_a_group_of_one() {
    let group = parse(FULL_TASK);
    assert_eq!(group.name, "trainer");
    assert!(group.is_primary("trainer"));
    let t = &group.components[0];
    assert_eq!(t.num_nodes, 2);
    assert_eq!(t.workdir.as_deref(), Some("~/code"));
    assert_eq!(
        t.resources.infra,
        [Infra::Slurm {
            cluster: Some("hpc".into()),
            partition: Some("gpu".into())
        }]
    );
    assert_eq!(
        t.resources.cpus,
        Some(Cpus {
            count: 4.0,
            or_more: true
        })
    );
    assert_eq!(t.resources.memory_bytes(), Some(16 << 30));
    assert_eq!(
        t.resources.accelerators.as_ref().unwrap().to_string(),
        "A100:8"
    );
    assert_eq!(t.resources.main_port(), Some(8080));
    let recovery = t.resources.job_recovery.as_ref().unwrap();
    assert_eq!(recovery.strategy, Some(RecoveryStrategy::Failover));
    assert_eq!(recovery.max_restarts_on_errors, 3);
    assert_eq!(recovery.recover_on_exit_codes, vec![33, 34]);
    assert_eq!(t.resources.priority, Some(-10));
    assert_eq!(t.envs["STEPS"].as_deref(), Some("100"));
    assert_eq!(t.envs["DEBUG"].as_deref(), Some("false"));
    assert_eq!(t.envs["TOKEN"], None);
    assert_eq!(t.file_mounts["/data"], "./data");
    assert_eq!(t.instances(), 2);
    round_trips(&group);
}

const GROUP: &str = r#"
name: rl-run
execution: parallel
primary_tasks: [trainer]
termination_delay: {default: 30s, replay: 1m}
---
name: server
replicas: 3
resources: {ports: 8000, job_recovery: FAILOVER}
readiness_probe: /health
run: serve --port $AGENTSTACK_PORT
---
name: replay
resources: {memory: 4x, cpus: 0.5, ports: 9000}
readiness_probe:
  path: /ready
  initial_delay_seconds: 60
  timeout_seconds: 2.5
  post_data: {model: m}
  headers: {Authorization: Bearer x}
run: replay
---
name: trainer
run: train
"#;

#[test]
fn a_job_group_reads_and_round_trips() {
    let group = parse(GROUP);
    assert_eq!(group.component_names(), ["server", "replay", "trainer"]);
    assert!(group.is_primary("trainer") && !group.is_primary("server"));
    assert_eq!(group.termination_delay_seconds("server"), 30);
    assert_eq!(group.termination_delay_seconds("replay"), 60);
    let server = group.component("server").unwrap();
    assert_eq!(server.replicas, 3);
    let probe = server.readiness_probe.as_ref().unwrap();
    assert_eq!(probe.path, "/health");
    assert_eq!(probe.initial_delay(), DEFAULT_INITIAL_DELAY_SECONDS);
    let replay = group.component("replay").unwrap();
    let probe = replay.readiness_probe.as_ref().unwrap();
    assert_eq!(probe.timeout(), 2.5);
    assert_eq!(probe.post_data.as_deref(), Some(r#"{"model":"m"}"#));
    assert_eq!(replay.resources.memory_bytes(), Some(2 << 30));
    round_trips(&group);
}

#[test]
fn value_forms_round_trip() {
    for text in [
        "name: a\nrun: x\nresources: {cpus: 0.25, memory: 0.5}",
        "name: a\nrun: x\nresources: {cpus: '8', memory: 1536MB+, accelerators: H100}",
        "name: a\nrun: x\nresources: {memory: 1.5x, cpus: 3}",
        "name: a\nrun: x\nresources: {memory: 3KB, ports: '100-200'}",
        "name: a\nrun: x\nresources: {job_recovery: {recover_on_exit_codes: 7}}",
        "name: a\nrun: x\nresources: {infra: k8s/aws:eks:us-east-1:1:cluster/prod}",
        "name: a\nrun: x\nresources: {infra: kubernetes, priority: 1000}",
        "name: a\nrun: x\nresources: {infra: ray/lab}\nenvs: {A: '1.0', B: 'null', C: ''}",
        "name: a\nrun: \"x\\n  y \\t\\n\"\nsetup: \"  leading spaces\"",
        "---\nname: g\nexecution: parallel\nprimary_tasks: [a]\ntermination_delay: 0\n---\nname: a\nrun: x\n---\nname: b\nrun: y\n---\n",
    ] {
        round_trips(&parse(text));
    }
}

#[test]
fn relative_paths_resolve_against_the_spec_directory() {
    let mut group = parse(FULL_TASK);
    group.resolve_paths(Path::new("/home/u/project"));
    let t = &group.components[0];
    assert_eq!(t.workdir.as_deref(), Some("~/code"));
    assert_eq!(t.file_mounts["/data"], "/home/u/project/data");
    assert_eq!(t.file_mounts["~/ckpt"], "/scratch/ckpt");
}

/// Every class of mistake, with where it is and how to fix it, in one snapshot.
#[test]
fn errors_say_where_and_how_to_fix() {
    let cases: &[(&str, &str)] = &[
        ("not YAML", "name: [unclosed"),
        ("empty file", ""),
        ("not a mapping", "- just a list"),
        (
            "unknown key, near an allowed one",
            "name: t\nrun: x\nresources: {cpu: 4}",
        ),
        ("unknown key, nothing near", "name: t\nrun: x\ncolour: blue"),
        (
            "SkyPilot key we do not support",
            "name: t\nrun: x\nresources: {use_spot: true}",
        ),
        (
            "service without the load balancer's port",
            "name: t\nrun: x\nservice: {replicas: 2}",
        ),
        (
            "service without a readiness probe",
            "name: t\nrun: x\nresources: {ports: 8000}\nservice: {replicas: 2, ports: 9000}",
        ),
        (
            "service without replica ports",
            "name: t\nrun: x\nservice: {replicas: 2, ports: 9000, readiness_probe: /health}",
        ),
        (
            "load balancer on a replica's port",
            "name: t\nrun: x\nresources: {ports: 8000}\nservice: {replicas: 3, ports: 8002, readiness_probe: /health}",
        ),
        (
            "replicas twice",
            "name: t\nrun: x\nreplicas: 2\nresources: {ports: 8000}\nservice: {replicas: 2, ports: 9000, readiness_probe: /health}",
        ),
        (
            "unknown load balancing policy",
            "name: t\nrun: x\nresources: {ports: 8000}\nservice: {ports: 9000, readiness_probe: /health, load_balancing_policy: fastest}",
        ),
        (
            "SkyServe autoscaling",
            "name: t\nrun: x\nresources: {ports: 8000}\nservice: {ports: 9000, readiness_probe: /health, replica_policy: {min_replicas: 1}}",
        ),
        (
            "an engine twice in the infra list",
            "name: t\nrun: x\nresources: {infra: [slurm/a, local, slurm/b]}",
        ),
        (
            "an empty infra list",
            "name: t\nrun: x\nresources: {infra: []}",
        ),
        (
            "unknown group recovery",
            "name: g\nexecution: parallel\nrecovery: everything\n---\nname: a\nrun: x",
        ),
        ("missing name", "run: x"),
        ("missing run", "name: t"),
        ("name not a DNS label", "name: Env_Server\nrun: x"),
        (
            "name too long",
            "name: a-very-long-component-name-indeed\nrun: x",
        ),
        ("negative cpus", "name: t\nrun: x\nresources: {cpus: -4}"),
        (
            "cpus not a number",
            "name: t\nrun: x\nresources: {cpus: lots}",
        ),
        (
            "unknown memory unit",
            "name: t\nrun: x\nresources: {memory: 4XB}",
        ),
        (
            "memory per CPU without cpus",
            "name: t\nrun: x\nresources: {memory: 4x}",
        ),
        (
            "fractional accelerators",
            "name: t\nrun: x\nresources: {accelerators: 'A100:0.5'}",
        ),
        (
            "alternative accelerators",
            "name: t\nrun: x\nresources: {accelerators: [A100, H100]}",
        ),
        ("unknown infra", "name: t\nrun: x\nresources: {infra: mars}"),
        (
            "a cloud as infra",
            "name: t\nrun: x\nresources: {infra: aws/us-east-1}",
        ),
        (
            "port out of range",
            "name: t\nrun: x\nresources: {ports: [8080, 70000]}",
        ),
        (
            "overlapping ports",
            "name: t\nrun: x\nresources: {ports: ['8000-8010', 8005]}",
        ),
        (
            "unknown recovery strategy",
            "name: t\nrun: x\nresources: {job_recovery: SOMETIMES}",
        ),
        (
            "exit code 0 to recover on",
            "name: t\nrun: x\nresources: {job_recovery: {recover_on_exit_codes: [0]}}",
        ),
        (
            "unknown job_recovery key",
            "name: t\nrun: x\nresources: {job_recovery: {max_restart: 3}}",
        ),
        (
            "priority out of range",
            "name: t\nrun: x\nresources: {priority: 5000}",
        ),
        ("zero nodes", "name: t\nrun: x\nnum_nodes: 0"),
        (
            "nodes and replicas",
            "name: t\nrun: x\nnum_nodes: 2\nreplicas: 2",
        ),
        ("bad env name", "name: t\nrun: x\nenvs: {2FAST: y}"),
        (
            "env set by the launcher",
            "name: t\nrun: x\nenvs: {SKYPILOT_NODE_RANK: '3'}",
        ),
        ("env value a list", "name: t\nrun: x\nenvs: {A: [1]}"),
        (
            "bucket mount",
            "name: t\nrun: x\nfile_mounts: {/data: 's3://bucket/data'}",
        ),
        (
            "storage object mount",
            "name: t\nrun: x\nfile_mounts: {/data: {source: ./d, mode: COPY}}",
        ),
        (
            "git workdir",
            "name: t\nrun: x\nworkdir: {url: 'https://x/y.git'}",
        ),
        (
            "probe without ports",
            "name: t\nrun: x\nreadiness_probe: /health",
        ),
        (
            "probe path not a path",
            "name: t\nrun: x\nresources: {ports: 80}\nreadiness_probe: health",
        ),
        (
            "probe unknown key",
            "name: t\nrun: x\nresources: {ports: 80}\nreadiness_probe: {path: /h, period: 3}",
        ),
        (
            "probe negative timeout",
            "name: t\nrun: x\nresources: {ports: 80}\nreadiness_probe: {path: /h, timeout_seconds: -1}",
        ),
        ("header alone", "name: g\nexecution: parallel"),
        (
            "group without header",
            "name: a\nrun: x\n---\nname: b\nrun: y",
        ),
        ("group without execution", "name: g\n---\nname: a\nrun: x"),
        (
            "pipeline",
            "name: g\nexecution: serial\n---\nname: a\nrun: x",
        ),
        (
            "inter_connection",
            "name: g\nexecution: parallel\ninter_connection: false\n---\nname: a\nrun: x",
        ),
        (
            "duplicate component",
            "name: g\nexecution: parallel\n---\nname: a\nrun: x\n---\nname: a\nrun: y",
        ),
        (
            "primary that does not exist",
            "name: g\nexecution: parallel\nprimary_tasks: [trainer]\n---\nname: a\nrun: x",
        ),
        (
            "primary listed twice",
            "name: g\nexecution: parallel\nprimary_tasks: [a, a]\n---\nname: a\nrun: x",
        ),
        (
            "delay without primaries",
            "name: g\nexecution: parallel\ntermination_delay: 30s\n---\nname: a\nrun: x",
        ),
        (
            "delay for a primary",
            "name: g\nexecution: parallel\nprimary_tasks: [a]\ntermination_delay: {a: 1m}\n---\nname: a\nrun: x\n---\nname: b\nrun: x",
        ),
        (
            "delay not a duration",
            "name: g\nexecution: parallel\nprimary_tasks: [a]\ntermination_delay: soon\n---\nname: a\nrun: x\n---\nname: b\nrun: x",
        ),
        (
            "error in a later component",
            "name: g\nexecution: parallel\n---\nname: a\nrun: x\n---\nname: b\nrun: y\nresources: {memory: lots}",
        ),
    ];
    let mut report = String::new();
    for (title, text) in cases {
        let message = match error(text) {
            e @ SpecError::Yaml { .. } => {
                format!("{e}: {}", std::error::Error::source(&e).expect("a cause"))
            }
            e => e.to_string(),
        };
        report.push_str(&format!("## {title}\n{text}\n=> {message}\n\n"));
    }
    insta::assert_snapshot!(report);
}

#[test]
fn errors_carry_their_location() {
    let e = error(
        GROUP
            .replace("timeout_seconds: 2.5", "timeout_seconds: soon")
            .as_str(),
    );
    assert_eq!(
        e.location(),
        Some(&Location {
            document: 3,
            component: Some("replay".into()),
            path: "readiness_probe.timeout_seconds".into(),
        })
    );
    let e = error("name: t\nrun: x\nresources: {ports: [80, 0]}");
    assert_eq!(e.location().unwrap().path, "resources.ports[1]");
}

#[test]
fn limits_are_enforced() {
    let big = format!("name: t\nrun: '{}'", "x".repeat(MAX_SPEC_BYTES));
    assert!(matches!(error(&big), SpecError::TooLarge { .. }));
    let mut many = String::from("name: g\nexecution: parallel\n");
    for i in 0..=MAX_COMPONENTS {
        many.push_str(&format!("---\nname: c{i}\nrun: x\n"));
    }
    assert!(error(&many).to_string().contains("too many documents"));
}

/// The fuzz target's property (`fuzz/fuzz_targets/compute_spec.rs`) over thousands of
/// mutations of the specs above, so that plain `cargo nextest` checks it too: whatever
/// parses writes back to YAML that parses to the same group.
#[test]
fn round_trip_holds_for_mutated_specs() {
    const TOKENS: &[&str] = &[
        ":",
        "+",
        "x",
        "GB",
        "KB",
        "- ",
        "{",
        "}",
        "[",
        "]",
        "'",
        "\"",
        "\n",
        "  ",
        "0",
        "-1",
        "1e9",
        ".5",
        "0.1",
        "null",
        "~",
        "!!str ",
        "&a ",
        "*a",
        "<<: ",
        "---\n",
        "\t",
        "é",
        "\\",
        "#",
        "s",
        "m",
        "9000-9010",
        ",",
        "A100:",
        "true",
        "|\n  ",
        ">-\n  ",
    ];
    let corpus = [
        FULL_TASK,
        GROUP,
        "name: a\nrun: x\nresources: {cpus: 4+, memory: 1.5x}",
    ];
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = |bound: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % bound as u64) as usize
    };
    let mut parsed = 0;
    for _ in 0..10_000 {
        let mut text: Vec<char> = corpus[next(corpus.len())].chars().collect();
        for _ in 0..1 + next(2) {
            let at = next(text.len() + 1);
            match next(3) {
                0 => text
                    .splice(at..at, TOKENS[next(TOKENS.len())].chars())
                    .for_each(drop),
                1 => {
                    let end = (at + 1 + next(8)).min(text.len());
                    text.drain(at.min(end)..end).for_each(drop);
                }
                _ => {
                    let end = (at + 1 + next(16)).min(text.len());
                    let copy: Vec<char> = text[at.min(end)..end].to_vec();
                    let to = next(text.len() + 1);
                    text.splice(to..to, copy).for_each(drop);
                }
            }
        }
        let text: String = text.into_iter().collect();
        if let Ok(group) = JobGroup::parse(&text) {
            parsed += 1;
            round_trips(&group);
        }
    }
    // The mutations must leave enough specs valid for the property to mean something.
    assert!(parsed > 500, "only {parsed} mutated specs parsed");
}

#[test]
fn group_recovery_failover_order_and_a_service_read_and_write_back() {
    let group = parse(
        r#"
name: serving
execution: parallel
recovery: group
---
name: model
resources:
  infra: [slurm/hpc/gpu, ray, local]
  ports: 8000
  job_recovery: {max_restarts_on_errors: 3}
run: agentstack model serve --port $AGENTSTACK_PORT
service:
  readiness_probe: {path: /health, endpoint_probe_interval_seconds: 1}
  replicas: 2
  ports: 9000
  load_balancing_policy: round_robin
---
name: client
resources: {infra: [slurm/hpc/gpu, ray, local]}
run: curl http://127.0.0.1:9000/health
"#,
    );
    assert_eq!(group.recovery, GroupRecovery::Group);
    let model = group.component("model").unwrap();
    assert_eq!(model.replicas, 2);
    assert_eq!(model.readiness_probe.as_ref().unwrap().path, "/health");
    assert_eq!(
        model.service,
        Some(Service {
            ports: 9000,
            load_balancing_policy: LoadBalancingPolicy::RoundRobin,
        })
    );
    assert_eq!(
        model.resources.infra,
        [
            Infra::Slurm {
                cluster: Some("hpc".into()),
                partition: Some("gpu".into())
            },
            Infra::Ray { cluster: None },
            Infra::Local
        ]
    );
    round_trips(&group);
    // The component's own `replicas` and `readiness_probe` serve a `service` too.
    let plain = parse(
        "name: m\nreplicas: 3\nreadiness_probe: /health\nresources: {ports: 8000}\nrun: x\nservice: {ports: 7999}\n",
    );
    let m = &plain.components[0];
    assert_eq!((m.replicas, m.service.as_ref().unwrap().ports), (3, 7999));
    assert_eq!(
        m.service.as_ref().unwrap().load_balancing_policy,
        LoadBalancingPolicy::LeastLoad
    );
    round_trips(&plain);
}

#[test]
fn the_service_example_reads() {
    let group = parse(include_str!("../../../../examples/chat-service.yaml"));
    let chat = group.component("chat").unwrap();
    assert_eq!(chat.replicas, 2);
    assert_eq!(chat.service.as_ref().unwrap().ports, 9000);
    assert_eq!(chat.resources.infra.len(), 2);
    round_trips(&group);
}
