//! A job group as Kubernetes objects: per component, a headless Service and an
//! Indexed `batch/v1` Job.
//!
//! The Job runs one Pod per instance (replica or node), each with index `i`, hostname
//! `<group>-<component>-<i>` and the Service as its subdomain, so every instance has a
//! DNS name known before anything runs: `<group>-<component>-<i>.<group>-<component>.<namespace>.svc`.
//! Those names fill the discovery variables; the per-Pod ones (`AGENTSTACK_REPLICA` or
//! `SKYPILOT_NODE_RANK`, and `SKYPILOT_NODE_IPS` for single-node instances) come from
//! the Pod itself through the downward API.
//!
//! `job_recovery` becomes the Job's failure policy: `backoffLimit` is
//! `max_restarts_on_errors`; exits with a code in `recover_on_exit_codes`, and Pods
//! disrupted by preemption or eviction, are retried without counting (`podFailurePolicy`
//! `Ignore`). In a group with `recovery: group` the Job never retries a Pod
//! (`backoffLimit: 0`, no `Ignore` rules): a failed Pod fails its Job, and the
//! supervisor restarts the whole group by the component's `job_recovery`. A named Kueue queue adds the `kueue.x-k8s.io/queue-name` label and creates
//! the Jobs suspended, for Kueue to admit.

use serde_json::{Map, Value, json};

use crate::discovery::{
    self, AGENTSTACK_REPLICA, Addresses, Endpoint, SKYPILOT_NODE_IPS, SKYPILOT_NODE_RANK,
};
use crate::entrypoint::{self, EntrypointOptions};
use crate::request::{self, BuildError};
use crate::spec::{JobGroup, MemoryAmount, Task};

/// Prefix of the labels and annotations agentstack puts on its objects.
pub const LABEL_PREFIX: &str = "agentstack.dev";
/// Kueue's label naming the LocalQueue a Job is submitted to.
pub const KUEUE_QUEUE_LABEL: &str = "kueue.x-k8s.io/queue-name";
/// The annotation holding a Pod's index in an Indexed Job.
pub const COMPLETION_INDEX_ANNOTATION: &str = "batch.kubernetes.io/job-completion-index";
/// The container's name in every Pod.
pub const CONTAINER_NAME: &str = "main";
/// Most ports one component's Service may list.
pub const MAX_SERVICE_PORTS: usize = 100;

/// Launch settings that are not part of the spec.
#[derive(Debug, Clone)]
pub struct KubernetesOptions<'a> {
    /// The namespace.
    pub namespace: &'a str,
    /// The container image: it must hold `bash` and whatever `run` starts.
    pub image: &'a str,
    /// A Kueue LocalQueue, when the cluster uses Kueue.
    pub queue: Option<&'a str>,
    /// Seconds between SIGTERM and SIGKILL when a Pod stops: the time to checkpoint.
    pub termination_grace_seconds: u32,
    /// The extended resource that counts accelerators.
    pub accelerator_resource: &'a str,
}

impl<'a> KubernetesOptions<'a> {
    /// Options with Kubernetes' defaults: 30 s of grace, `nvidia.com/gpu`, no queue.
    pub fn new(namespace: &'a str, image: &'a str) -> Self {
        Self {
            namespace,
            image,
            queue: None,
            termination_grace_seconds: 30,
            accelerator_resource: "nvidia.com/gpu",
        }
    }
}

/// The Service and Job name of a component: `<group>-<component>`.
pub fn object_name(group: &JobGroup, task: &Task) -> String {
    format!("{}-{}", group.name, task.name)
}

/// Every instance's DNS name, with the component's first port.
pub fn addresses(group: &JobGroup, options: &KubernetesOptions<'_>) -> Addresses {
    group
        .components
        .iter()
        .map(|task| {
            let name = object_name(group, task);
            let endpoints = (0..task.instances())
                .map(|i| {
                    Endpoint::new(
                        format!("{name}-{i}.{name}.{}.svc", options.namespace),
                        task.resources.main_port(),
                    )
                })
                .collect();
            (task.name.clone(), endpoints)
        })
        .collect()
}

/// The objects to create, in order: for each component its Service, then its Job.
pub fn manifests(
    group: &JobGroup,
    options: &KubernetesOptions<'_>,
) -> Result<Vec<Value>, BuildError> {
    let addresses = addresses(group, options);
    let mut objects = Vec::with_capacity(group.components.len() * 2);
    for task in &group.components {
        check_supported(task)?;
        objects.push(service(group, task, options)?);
        objects.push(job(group, task, &addresses, options)?);
    }
    Ok(objects)
}

fn unsupported(task: &Task, what: &str, hint: &str) -> BuildError {
    BuildError::Unsupported {
        backend: "kubernetes",
        component: task.name.clone(),
        what: what.to_owned(),
        hint: hint.to_owned(),
    }
}

fn check_supported(task: &Task) -> Result<(), BuildError> {
    if task.workdir.is_some() {
        return Err(unsupported(
            task,
            "`workdir`",
            "local files are not copied into Pods: put the code in the image and `cd` to it in `run`",
        ));
    }
    if !task.file_mounts.is_empty() {
        return Err(unsupported(
            task,
            "`file_mounts`",
            "local files are not copied into Pods: put the data in the image or on a volume the image mounts",
        ));
    }
    if task
        .readiness_probe
        .as_ref()
        .is_some_and(|p| p.post_data.is_some())
    {
        return Err(unsupported(
            task,
            "`readiness_probe.post_data`",
            "Kubernetes probes send GET requests: probe a path that answers GET",
        ));
    }
    let ports: usize = task.resources.ports.iter().map(|r| r.len()).sum();
    if ports > MAX_SERVICE_PORTS {
        return Err(unsupported(
            task,
            &format!("{ports} ports"),
            &format!("a Service lists each port; use at most {MAX_SERVICE_PORTS}"),
        ));
    }
    Ok(())
}

fn labels(group: &JobGroup, task: &Task) -> Map<String, Value> {
    let role = if group.is_primary(&task.name) {
        "primary"
    } else {
        "auxiliary"
    };
    let mut labels = Map::new();
    labels.insert("app.kubernetes.io/managed-by".into(), json!("agentstack"));
    labels.insert(format!("{LABEL_PREFIX}/group"), json!(group.name));
    labels.insert(format!("{LABEL_PREFIX}/component"), json!(task.name));
    labels.insert(format!("{LABEL_PREFIX}/role"), json!(role));
    labels
}

fn selector(group: &JobGroup, task: &Task) -> Value {
    json!({
        format!("{LABEL_PREFIX}/group"): group.name,
        format!("{LABEL_PREFIX}/component"): task.name,
    })
}

fn ports(task: &Task) -> impl Iterator<Item = u16> + '_ {
    task.resources.ports.iter().flat_map(|r| r.ports())
}

fn service(
    group: &JobGroup,
    task: &Task,
    options: &KubernetesOptions<'_>,
) -> Result<Value, BuildError> {
    let ports: Vec<Value> = ports(task)
        .map(|p| json!({"name": format!("p{p}"), "port": p, "targetPort": p, "protocol": "TCP"}))
        .collect();
    Ok(json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": object_name(group, task),
            "namespace": options.namespace,
            "labels": labels(group, task),
        },
        "spec": {
            // Headless: DNS names for each Pod rather than one virtual IP, published before
            // the Pods are ready so that multi-node components can rendezvous.
            "clusterIP": "None",
            "publishNotReadyAddresses": true,
            "selector": selector(group, task),
            "ports": ports,
        },
    }))
}

/// Kubernetes expands `$(NAME)` in commands and env values and reads `$$` as `$`:
/// doubling every `$` keeps the text as written.
fn literal(text: &str) -> String {
    text.replace('$', "$$")
}

fn job(
    group: &JobGroup,
    task: &Task,
    addresses: &Addresses,
    options: &KubernetesOptions<'_>,
) -> Result<Value, BuildError> {
    let name = object_name(group, task);
    let instances = task.instances();
    let discovery = discovery::environment(group, addresses, &task.name, 0)?;
    let mut env = request::environment(task, &discovery)?;

    // Per-Pod values from the Pod itself.
    let index_ref = json!({"fieldRef": {"fieldPath": format!("metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']")}});
    let mut env_list = Vec::new();
    let per_pod = |name: &str, source: Value| json!({"name": name, "valueFrom": source});
    if task.num_nodes > 1 {
        env.remove(SKYPILOT_NODE_RANK);
        env_list.push(per_pod(SKYPILOT_NODE_RANK, index_ref));
    } else {
        env.remove(SKYPILOT_NODE_IPS);
        env_list.push(per_pod(
            SKYPILOT_NODE_IPS,
            json!({"fieldRef": {"fieldPath": "status.podIP"}}),
        ));
        if task.replicas > 1 {
            env.remove(AGENTSTACK_REPLICA);
            env_list.push(per_pod(AGENTSTACK_REPLICA, index_ref));
        }
    }
    env_list.extend(
        env.iter()
            .map(|(k, v)| json!({"name": k, "value": literal(v)})),
    );

    let script = entrypoint::script(task, &EntrypointOptions::default());
    let mut container = Map::new();
    container.insert("name".into(), json!(CONTAINER_NAME));
    container.insert("image".into(), json!(options.image));
    container.insert("command".into(), json!(["bash", "-c", literal(&script)]));
    container.insert("env".into(), Value::Array(env_list));
    let container_ports: Vec<Value> = ports(task)
        .map(|p| json!({"containerPort": p, "protocol": "TCP"}))
        .collect();
    if !container_ports.is_empty() {
        container.insert("ports".into(), Value::Array(container_ports));
    }
    container.insert("resources".into(), resources(task, options));
    if let (Some(probe), Some(port)) = (&task.readiness_probe, task.resources.main_port()) {
        let headers: Vec<Value> = probe
            .headers
            .iter()
            .map(|(k, v)| json!({"name": k, "value": v}))
            .collect();
        let mut http_get = json!({"path": probe.path, "port": port});
        if !headers.is_empty() {
            http_get["httpHeaders"] = Value::Array(headers);
        }
        let period = probe.interval().ceil().max(1.0) as u64;
        let timeout = probe.timeout().ceil().max(1.0) as u64;
        container.insert(
            "readinessProbe".into(),
            json!({"httpGet": http_get, "periodSeconds": period, "timeoutSeconds": timeout}),
        );
        // SkyPilot's initial delay is the time a replica has to become ready before it
        // counts as failed: a startup probe that gives up after that long.
        let attempts = (probe.initial_delay() / period as f64).ceil().max(1.0) as u64;
        container.insert(
            "startupProbe".into(),
            json!({"httpGet": http_get, "periodSeconds": period, "timeoutSeconds": timeout, "failureThreshold": attempts}),
        );
    }

    let recovery = task.resources.job_recovery.clone().unwrap_or_default();
    let by_group = group.recovery == crate::spec::GroupRecovery::Group;
    let mut rules = Vec::new();
    if !by_group {
        rules.push(json!({
            "action": "Ignore",
            "onPodConditions": [{"type": "DisruptionTarget"}],
        }));
    }
    if !recovery.recover_on_exit_codes.is_empty() && !by_group {
        rules.push(json!({
            "action": "Ignore",
            "onExitCodes": {
                "containerName": CONTAINER_NAME,
                "operator": "In",
                "values": recovery.recover_on_exit_codes,
            },
        }));
    }

    let mut metadata_labels = labels(group, task);
    if let Some(queue) = options.queue {
        metadata_labels.insert(KUEUE_QUEUE_LABEL.into(), json!(queue));
    }
    let mut annotations = Map::new();
    if let Some(priority) = task.resources.priority {
        annotations.insert(
            format!("{LABEL_PREFIX}/priority"),
            json!(priority.to_string()),
        );
    }
    if !group.is_primary(&task.name) {
        annotations.insert(
            format!("{LABEL_PREFIX}/termination-delay-seconds"),
            json!(group.termination_delay_seconds(&task.name).to_string()),
        );
    }
    let mut metadata = json!({
        "name": name,
        "namespace": options.namespace,
        "labels": metadata_labels,
    });
    if !annotations.is_empty() {
        metadata["annotations"] = Value::Object(annotations);
    }
    let mut spec = json!({
        "completionMode": "Indexed",
        "completions": instances,
        "parallelism": instances,
        "backoffLimit": if by_group { 0 } else { recovery.max_restarts_on_errors },
        "podFailurePolicy": {"rules": rules},
        "template": {
            "metadata": {"labels": labels(group, task)},
            "spec": {
                // podFailurePolicy needs Never: a failed Pod is replaced by a new one.
                "restartPolicy": "Never",
                "subdomain": name,
                "terminationGracePeriodSeconds": options.termination_grace_seconds,
                "containers": [Value::Object(container)],
            },
        },
    });
    if options.queue.is_some() {
        spec["suspend"] = json!(true);
    }
    Ok(json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata,
        "spec": spec,
    }))
}

fn resources(task: &Task, options: &KubernetesOptions<'_>) -> Value {
    let r = &task.resources;
    let mut requests = Map::new();
    let mut limits = Map::new();
    if let Some(cpus) = r.cpus {
        let quantity = if cpus.count.fract() == 0.0 {
            format!("{}", cpus.count as u64)
        } else {
            format!("{}m", (cpus.count * 1000.0).ceil() as u64)
        };
        requests.insert("cpu".into(), json!(quantity));
    }
    if let (Some(memory), Some(bytes)) = (r.memory, r.memory_bytes()) {
        let quantity = memory_quantity(bytes);
        requests.insert("memory".into(), json!(quantity));
        // An exact amount is also the most the Pod may use; `16GB+` leaves it unbounded.
        let exact = !memory.or_more && matches!(memory.amount, MemoryAmount::Bytes(_));
        if exact {
            limits.insert("memory".into(), json!(quantity));
        }
    }
    if let Some(acc) = &r.accelerators {
        limits.insert(
            options.accelerator_resource.into(),
            json!(acc.count.to_string()),
        );
    }
    let mut out = Map::new();
    if !requests.is_empty() {
        out.insert("requests".into(), Value::Object(requests));
    }
    if !limits.is_empty() {
        out.insert("limits".into(), Value::Object(limits));
    }
    Value::Object(out)
}

/// Bytes as a Kubernetes quantity in the largest binary unit that divides them.
fn memory_quantity(bytes: u64) -> String {
    for (unit, size) in [
        ("Ti", 1u64 << 40),
        ("Gi", 1 << 30),
        ("Mi", 1 << 20),
        ("Ki", 1 << 10),
    ] {
        if bytes.is_multiple_of(size) {
            return format!("{}{unit}", bytes / size);
        }
    }
    bytes.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dollars_survive_kubernetes_expansion() {
        assert_eq!(
            literal("echo $(date) $$ $HOME"),
            "echo $$(date) $$$$ $$HOME"
        );
    }

    #[test]
    fn quantities() {
        assert_eq!(memory_quantity(16 << 30), "16Gi");
        assert_eq!(memory_quantity(1536 << 20), "1536Mi");
        assert_eq!(memory_quantity(3 << 10), "3Ki");
    }

    #[test]
    fn local_files_are_refused() {
        let group = JobGroup::parse("name: t\nworkdir: .\nrun: x\n").unwrap();
        let err = manifests(&group, &KubernetesOptions::new("ns", "img")).unwrap_err();
        assert!(
            err.to_string()
                .contains("`workdir` is not supported on kubernetes"),
            "{err}"
        );
        let group = JobGroup::parse(
            "name: t\nresources: {ports: 80}\nreadiness_probe: {path: /, post_data: x}\nrun: x\n",
        )
        .unwrap();
        assert!(manifests(&group, &KubernetesOptions::new("ns", "img")).is_err());
    }
}
