//! The task YAML and job groups, with SkyPilot's key names where they apply.
//!
//! A file is either one task (one YAML document) or a job group: a header document
//! (`name`, `execution: parallel`, `primary_tasks`, `termination_delay`) followed by one
//! task document per component. Both read into a [`JobGroup`]; a single task is a group
//! of one component named after it.
//!
//! Every key is checked: an unknown key is an error that names it and lists the allowed
//! ones, and a key SkyPilot has that agentstack does not (`use_spot`, `service`, ...)
//! says so. Values take SkyPilot's forms (`cpus: 4+`, `memory: 16GB`,
//! `accelerators: A100:8`, `ports: [8080, "9000-9010"]`, `job_recovery: FAILOVER`).
//! [`JobGroup::to_yaml`] writes a group back in a form that parses to the same value.

mod error;
mod reader;
mod values;

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize, Serializer};
use serde_norway::Value;

pub use error::{Location, SpecError};
pub use values::{
    Accelerators, Cpus, JobRecovery, MAX_ACCELERATORS, MAX_CPUS, MAX_DURATION_SECONDS,
    MAX_MEMORY_BYTES, MAX_RESTARTS, Memory, MemoryAmount, PortRange, RecoveryStrategy,
    format_bytes,
};

use reader::{At, Keys, NotSupported, kind, string, whole};

/// Largest spec file read, in bytes.
pub const MAX_SPEC_BYTES: usize = 1 << 20;
/// Most components in one job group.
pub const MAX_COMPONENTS: usize = 64;
/// Longest job group name. With a component name it makes Kubernetes object names
/// (`<group>-<component>-<index>`), which must fit in a 63-character DNS label.
pub const MAX_GROUP_NAME_LEN: usize = 30;
/// Longest component name (see [`MAX_GROUP_NAME_LEN`]).
pub const MAX_COMPONENT_NAME_LEN: usize = 24;
/// Most nodes one component may span.
pub const MAX_NODES: u64 = 4096;
/// Most replicas of one component.
pub const MAX_REPLICAS: u64 = 1000;
/// SkyPilot's priority range (`sky/skylet/constants.py`): higher runs first.
pub const PRIORITY_RANGE: (i64, i64) = (-1000, 1000);

/// SkyPilot's readiness probe defaults (`sky/serve/constants.py`): how long a replica
/// may take to become ready before it counts as failed.
pub const DEFAULT_INITIAL_DELAY_SECONDS: f64 = 1200.0;
/// How long one probe may take.
pub const DEFAULT_PROBE_TIMEOUT_SECONDS: f64 = 15.0;
/// Time between probes.
pub const DEFAULT_PROBE_INTERVAL_SECONDS: f64 = 10.0;

const HEADER_KEYS: &[&str] = &[
    "name",
    "execution",
    "primary_tasks",
    "termination_delay",
    "recovery",
];
const HEADER_NOT_SUPPORTED: NotSupported<'static> = &[(
    "inter_connection",
    "the components of a group always reach each other through the discovery variables",
)];

const TASK_KEYS: &[&str] = &[
    "name",
    "workdir",
    "num_nodes",
    "resources",
    "envs",
    "file_mounts",
    "setup",
    "run",
    "replicas",
    "readiness_probe",
    "service",
];
const TASK_NOT_SUPPORTED: NotSupported<'static> = &[
    ("secrets", "put values in `envs`"),
    ("managed_secrets", "put values in `envs`"),
    (
        "config",
        "backend settings are launch options, not task keys",
    ),
    ("event_callback", "not implemented"),
    ("pool", "not implemented"),
    ("inputs", "not implemented"),
    ("outputs", "not implemented"),
    ("file_mounts_mapping", "not implemented"),
    (
        "volumes",
        "not implemented; mount a local path with `file_mounts`",
    ),
    (
        "volume_mounts",
        "not implemented; mount a local path with `file_mounts`",
    ),
    ("api_server_access", "there is no API server"),
];

const RESOURCE_KEYS: &[&str] = &[
    "infra",
    "cpus",
    "memory",
    "accelerators",
    "ports",
    "job_recovery",
    "priority",
];
const ON_OWN_COMPUTE: &str =
    "agentstack runs on your own compute: name it with `infra` (local, slurm, ray or k8s)";
const RESOURCE_NOT_SUPPORTED: NotSupported<'static> = &[
    ("cloud", ON_OWN_COMPUTE),
    ("region", ON_OWN_COMPUTE),
    ("zone", ON_OWN_COMPUTE),
    ("instance_type", ON_OWN_COMPUTE),
    ("use_spot", ON_OWN_COMPUTE),
    ("max_hourly_cost", ON_OWN_COMPUTE),
    ("any_of", ON_OWN_COMPUTE),
    ("ordered", ON_OWN_COMPUTE),
    ("disk_size", "disks are what the node has"),
    ("disk_tier", "disks are what the node has"),
    ("network_tier", "networks are what the nodes have"),
    ("local_disk", "disks are what the node has"),
    ("volumes", "mount a local path with `file_mounts`"),
    (
        "image_id",
        "container images are a Kubernetes launch option",
    ),
    ("labels", "not implemented"),
    ("accelerator_args", "not implemented"),
    (
        "autostop",
        "nothing is provisioned, so nothing needs stopping",
    ),
    ("priority_class", "use `priority`"),
];

const PROBE_KEYS: &[&str] = &[
    "path",
    "initial_delay_seconds",
    "timeout_seconds",
    "endpoint_probe_interval_seconds",
    "consecutive_failure_threshold_timeout",
    "post_data",
    "headers",
];

const SERVICE_KEYS: &[&str] = &[
    "readiness_probe",
    "replicas",
    "ports",
    "load_balancing_policy",
];
const SERVICE_NOT_SUPPORTED: NotSupported<'static> = &[
    (
        "replica_policy",
        "autoscaling is not implemented: set a fixed number of `replicas`",
    ),
    (
        "tls",
        "terminate TLS in front of the load balancer (it speaks plain HTTP)",
    ),
    ("workers", "not implemented"),
];

/// A job group: components launched together, finding each other through environment
/// variables (see [`crate::discovery`]).
#[derive(Debug, Clone, PartialEq)]
pub struct JobGroup {
    /// The group's name (DNS-label rules, at most [`MAX_GROUP_NAME_LEN`]).
    pub name: String,
    /// What a member's failure restarts: that member, or the whole group.
    pub recovery: GroupRecovery,
    /// The components whose end ends the group; `None` means all of them.
    pub primary_tasks: Option<Vec<String>>,
    /// How long auxiliary components keep running after the primaries finish.
    pub termination_delay: Option<TerminationDelay>,
    /// The components, in file order.
    pub components: Vec<Task>,
}

/// `recovery` in a job group's header: what a member's failure, when its `job_recovery`
/// starts it again, restarts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GroupRecovery {
    /// `member` (the default): that member alone, which learns the others' addresses
    /// as they are.
    #[default]
    Member,
    /// `group`: every running member is stopped (SIGTERM, then SIGKILL after the grace
    /// period) and the whole group starts again as a gang, with fresh discovery: for
    /// components that cannot go on without a peer (a collective of trainers, a server
    /// whose clients hold its state).
    Group,
}

impl GroupRecovery {
    /// `member` or `group`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Member => "member",
            Self::Group => "group",
        }
    }
}

/// `termination_delay`: `30s` for every auxiliary component, or per component with a
/// `default`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TerminationDelay {
    /// Seconds for components not named.
    pub default: Option<u64>,
    /// Seconds per auxiliary component.
    pub per_component: BTreeMap<String, u64>,
}

impl TerminationDelay {
    /// Seconds for `component`.
    pub fn seconds(&self, component: &str) -> u64 {
        self.per_component
            .get(component)
            .copied()
            .or(self.default)
            .unwrap_or(0)
    }
}

impl Serialize for TerminationDelay {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let text = |s: u64| format!("{s}s");
        match (self.default, self.per_component.is_empty()) {
            (Some(default), true) => serializer.serialize_str(&text(default)),
            _ => {
                let mut map = BTreeMap::new();
                if let Some(default) = self.default {
                    map.insert("default".to_owned(), text(default));
                }
                for (name, s) in &self.per_component {
                    map.insert(name.clone(), text(*s));
                }
                map.serialize(serializer)
            }
        }
    }
}

/// One task: a component of a job group.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Task {
    /// The component's name (DNS-label rules, at most [`MAX_COMPONENT_NAME_LEN`]); it
    /// names its variables: `AGENTSTACK_<NAME>_ADDRS`.
    pub name: String,
    /// A local directory the commands run in.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
    /// Nodes the task spans; each runs `setup` then `run` with its own
    /// `SKYPILOT_NODE_RANK`.
    #[serde(skip_serializing_if = "is_one")]
    pub num_nodes: u32,
    /// What each node needs.
    #[serde(skip_serializing_if = "Resources::is_empty")]
    pub resources: Resources,
    /// Environment variables; `None` (SkyPilot's `null`) must be given a value at launch.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub envs: BTreeMap<String, Option<String>>,
    /// Local paths made visible on the node: node path → local path.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub file_mounts: BTreeMap<String, String>,
    /// Commands run before `run` on every node, on every (re)start.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub setup: Option<String>,
    /// The command that is the component.
    pub run: String,
    /// Identical copies of the component, each restarted on its own.
    #[serde(skip_serializing_if = "is_one")]
    pub replicas: u32,
    /// How to tell that a replica is ready to serve (SkyPilot's `service.readiness_probe`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub readiness_probe: Option<ReadinessProbe>,
    /// A load balancer in front of the replicas (SkyPilot's `service`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service: Option<Service>,
}

/// `service`: the replicas are served through one load balancer, which the supervisor
/// runs on `ports` and which sends each request to a ready replica (see
/// [`crate::balancer`]). Its `readiness_probe` and `replicas` are the component's.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Service {
    /// The load balancer's port.
    pub ports: u16,
    /// How it picks a replica.
    pub load_balancing_policy: LoadBalancingPolicy,
}

/// `service.load_balancing_policy`, SkyServe's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadBalancingPolicy {
    /// The replica with the fewest requests in flight (the default).
    #[default]
    LeastLoad,
    /// Each replica in turn.
    RoundRobin,
}

impl Task {
    /// How many copies of the command run: one per replica, or one per node.
    pub fn instances(&self) -> usize {
        self.replicas as usize * self.num_nodes as usize
    }
}

fn is_one(n: &u32) -> bool {
    *n == 1
}

/// `resources`: what each node of a task needs, and how it recovers.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct Resources {
    /// Where it runs, in order of preference: when an engine refuses the group or
    /// cannot place it, the next is tried. Empty: the launch's `--infra`, else local.
    #[serde(
        skip_serializing_if = "Vec::is_empty",
        serialize_with = "serialize_infra"
    )]
    pub infra: Vec<Infra>,
    /// CPUs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpus: Option<Cpus>,
    /// Memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory: Option<Memory>,
    /// GPUs or other accelerators.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub accelerators: Option<Accelerators>,
    /// Ports the task listens on, sorted; the first is the one peers and probes use.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<PortRange>,
    /// When a failed task is started again; never, when absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub job_recovery: Option<JobRecovery>,
    /// Higher runs first, and may preempt lower (from -1000 to 1000; 0 when absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
}

/// One infra as a string, several as a list.
fn serialize_infra<S: Serializer>(infra: &[Infra], serializer: S) -> Result<S::Ok, S::Error> {
    match infra {
        [one] => one.serialize(serializer),
        many => many.serialize(serializer),
    }
}

impl Resources {
    fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// The port peers and probes use: the first one listed.
    pub fn main_port(&self) -> Option<u16> {
        self.ports.first().map(|r| r.start)
    }

    /// Bytes of memory per node, when asked for.
    pub fn memory_bytes(&self) -> Option<u64> {
        self.memory.and_then(|m| m.bytes(self.cpus))
    }
}

/// `resources.infra`: which of the user's engines runs the task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Infra {
    /// `local`: processes on this machine.
    Local,
    /// `slurm[/CLUSTER[/PARTITION]]`.
    Slurm {
        /// A configured cluster's name.
        cluster: Option<String>,
        /// The partition to submit to.
        partition: Option<String>,
    },
    /// `ray[/CLUSTER]`.
    Ray {
        /// A configured cluster's name.
        cluster: Option<String>,
    },
    /// `k8s[/CONTEXT]` or `kubernetes[/CONTEXT]`.
    Kubernetes {
        /// A kubeconfig context (may hold `/`, as EKS ones do).
        context: Option<String>,
    },
}

/// Which of the user's engines runs a launch: the kind of an [`Infra`], without its
/// cluster, partition or context. Written in the state database as [`as_str`](Self::as_str).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum InfraKind {
    /// Process groups on this machine.
    Local,
    /// A Slurm cluster, through its CLI.
    Slurm,
    /// A Ray cluster's Jobs API.
    Ray,
    /// A Kubernetes cluster.
    Kubernetes,
}

impl InfraKind {
    /// `local`, `slurm`, `ray` or `kubernetes`: the name stored and shown.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Local => "local",
            Self::Slurm => "slurm",
            Self::Ray => "ray",
            Self::Kubernetes => "kubernetes",
        }
    }
}

impl fmt::Display for InfraKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // `pad`, so that tables can give it a width.
        f.pad(self.as_str())
    }
}

impl std::str::FromStr for InfraKind {
    type Err = String;

    /// Reads [`as_str`](Self::as_str)'s names (what the state database holds).
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Ok(match text {
            "local" => Self::Local,
            "slurm" => Self::Slurm,
            "ray" => Self::Ray,
            "kubernetes" => Self::Kubernetes,
            other => return Err(format!("unknown infra `{other}`")),
        })
    }
}

impl From<&Infra> for InfraKind {
    fn from(infra: &Infra) -> Self {
        match infra {
            Infra::Local => Self::Local,
            Infra::Slurm { .. } => Self::Slurm,
            Infra::Ray { .. } => Self::Ray,
            Infra::Kubernetes { .. } => Self::Kubernetes,
        }
    }
}

const INFRA_HINT: &str = "one of `local`, `slurm`, `slurm/CLUSTER`, `slurm/CLUSTER/PARTITION`, `ray`, `ray/CLUSTER`, `k8s`, `k8s/CONTEXT`";

impl Infra {
    /// Reads an `infra` string.
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        let (kind, rest) = match text.split_once('/') {
            Some((kind, rest)) => (kind, Some(rest)),
            None => (text, None),
        };
        let part = |p: &str| -> Result<String, String> {
            if p.is_empty() || p.contains(char::is_whitespace) {
                Err(format!("`{text}` has an empty or blank part"))
            } else {
                Ok(p.to_owned())
            }
        };
        match kind.to_ascii_lowercase().as_str() {
            "local" if rest.is_none() => Ok(Self::Local),
            "local" => Err("`local` takes no cluster name".into()),
            "slurm" => {
                let mut parts = rest
                    .map(|r| r.split('/').collect::<Vec<_>>())
                    .unwrap_or_default();
                if parts.len() > 2 {
                    return Err(format!("`{text}` has too many parts"));
                }
                let partition = if parts.len() == 2 {
                    Some(part(parts.pop().expect("two"))?)
                } else {
                    None
                };
                let cluster = parts.pop().map(part).transpose()?;
                Ok(Self::Slurm { cluster, partition })
            }
            "ray" => match rest {
                Some(r) if r.contains('/') => Err(format!("`{text}` has too many parts")),
                r => Ok(Self::Ray {
                    cluster: r.map(part).transpose()?,
                }),
            },
            "k8s" | "kubernetes" => Ok(Self::Kubernetes {
                context: rest.map(part).transpose()?,
            }),
            "aws" | "gcp" | "azure" | "lambda" | "runpod" | "nebius" | "oci" | "ibm" | "scp"
            | "vast" | "fluidstack" | "cudo" | "paperspace" | "do" | "hyperbolic" | "ssh"
            | "vsphere" | "*" => Err(format!(
                "`{text}` is a SkyPilot cloud; agentstack runs on your own compute"
            )),
            _ => Err(format!("unknown infra `{text}`")),
        }
    }
}

impl fmt::Display for Infra {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Local => f.write_str("local"),
            Self::Slurm { cluster, partition } => {
                f.write_str("slurm")?;
                if let Some(c) = cluster {
                    write!(f, "/{c}")?;
                }
                if let Some(p) = partition {
                    write!(f, "/{p}")?;
                }
                Ok(())
            }
            Self::Ray { cluster } => match cluster {
                Some(c) => write!(f, "ray/{c}"),
                None => f.write_str("ray"),
            },
            Self::Kubernetes { context } => match context {
                Some(c) => write!(f, "k8s/{c}"),
                None => f.write_str("k8s"),
            },
        }
    }
}

impl Serialize for Infra {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

/// `readiness_probe`: an HTTP request that succeeds once a replica can serve.
///
/// The names are SkyPilot's `service.readiness_probe`; the probe goes to the task's
/// first port.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReadinessProbe {
    /// The path, starting with `/`.
    pub path: String,
    /// Time a replica may take to become ready before it counts as failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub initial_delay_seconds: Option<f64>,
    /// Time one probe may take.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<f64>,
    /// Time between probes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub endpoint_probe_interval_seconds: Option<f64>,
    /// How long a ready replica may fail probes before it is replaced.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub consecutive_failure_threshold_timeout: Option<f64>,
    /// A body to POST instead of a GET (a mapping is sent as JSON).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub post_data: Option<String>,
    /// Request headers.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
}

impl ReadinessProbe {
    /// [`Self::initial_delay_seconds`] or SkyPilot's default.
    pub fn initial_delay(&self) -> f64 {
        self.initial_delay_seconds
            .unwrap_or(DEFAULT_INITIAL_DELAY_SECONDS)
    }

    /// [`Self::timeout_seconds`] or SkyPilot's default.
    pub fn timeout(&self) -> f64 {
        self.timeout_seconds
            .unwrap_or(DEFAULT_PROBE_TIMEOUT_SECONDS)
    }

    /// [`Self::endpoint_probe_interval_seconds`] or SkyPilot's default.
    pub fn interval(&self) -> f64 {
        self.endpoint_probe_interval_seconds
            .unwrap_or(DEFAULT_PROBE_INTERVAL_SECONDS)
    }
}

impl JobGroup {
    /// Reads a task or job group YAML.
    pub fn parse(text: &str) -> Result<Self, SpecError> {
        if text.len() > MAX_SPEC_BYTES {
            return Err(SpecError::TooLarge {
                size: text.len(),
                limit: MAX_SPEC_BYTES,
            });
        }
        let mut documents = Vec::new();
        for (index, document) in serde_norway::Deserializer::from_str(text).enumerate() {
            let number = index + 1;
            let yaml = |source| SpecError::Yaml {
                document: number,
                source,
            };
            let mut value = Value::deserialize(document).map_err(yaml)?;
            value.apply_merge().map_err(yaml)?;
            if value.is_null() {
                // An empty document (a stray `---`) holds nothing to run.
                continue;
            }
            if documents.len() > MAX_COMPONENTS {
                return Err(At::document(number).fix(
                    "too many documents",
                    format!("a job group has at most {MAX_COMPONENTS} components"),
                ));
            }
            documents.push((number, value));
        }
        match documents.as_slice() {
            [] => Err(SpecError::Empty),
            [(number, value)] => {
                let at = At::document(*number);
                if let Value::Mapping(m) = value
                    && m.contains_key("execution")
                {
                    return Err(at.fix(
                        "this is a job group header with no components after it",
                        "add one document per component after it, each starting with `---`",
                    ));
                }
                let task = parse_task(value, &at)?;
                Ok(Self {
                    name: task.name.clone(),
                    recovery: GroupRecovery::Member,
                    primary_tasks: None,
                    termination_delay: None,
                    components: vec![task],
                })
            }
            [(number, header), tasks @ ..] => parse_group(*number, header, tasks),
        }
    }

    /// The group as YAML: the header, then one document per component. It parses back
    /// to an equal group.
    pub fn to_yaml(&self) -> String {
        #[derive(Serialize)]
        struct Header<'a> {
            name: &'a str,
            execution: &'static str,
            #[serde(skip_serializing_if = "Option::is_none")]
            primary_tasks: Option<&'a Vec<String>>,
            #[serde(skip_serializing_if = "Option::is_none")]
            termination_delay: Option<&'a TerminationDelay>,
            #[serde(skip_serializing_if = "Option::is_none")]
            recovery: Option<&'static str>,
        }
        let header = Header {
            name: &self.name,
            execution: "parallel",
            recovery: (self.recovery != GroupRecovery::Member).then(|| self.recovery.as_str()),
            primary_tasks: self.primary_tasks.as_ref(),
            termination_delay: self.termination_delay.as_ref(),
        };
        let mut out = String::new();
        let mut push = |text: String| {
            out.push_str("---\n");
            out.push_str(&text);
        };
        push(serde_norway::to_string(&header).expect("a header serializes"));
        for task in &self.components {
            push(serde_norway::to_string(task).expect("a task serializes"));
        }
        out
    }

    /// The component named `name`.
    pub fn component(&self, name: &str) -> Option<&Task> {
        self.components.iter().find(|t| t.name == name)
    }

    /// The component names, in file order.
    pub fn component_names(&self) -> Vec<&str> {
        self.components.iter().map(|t| t.name.as_str()).collect()
    }

    /// Whether the group ends when `component` does (all are, without `primary_tasks`).
    pub fn is_primary(&self, component: &str) -> bool {
        self.primary_tasks
            .as_ref()
            .is_none_or(|p| p.iter().any(|n| n == component))
    }

    /// Seconds an auxiliary component keeps running after the primaries finish.
    pub fn termination_delay_seconds(&self, component: &str) -> u64 {
        self.termination_delay
            .as_ref()
            .map_or(0, |d| d.seconds(component))
    }

    /// Makes relative `workdir` and `file_mounts` sources relative to `base` (the spec
    /// file's directory); `~` paths are left for the node's shell.
    pub fn resolve_paths(&mut self, base: &Path) {
        let resolve = |path: &mut String| {
            if !path.starts_with('/') && !path.starts_with('~') {
                // `components` drops the `.` parts: `./data` is `<base>/data`.
                let joined: std::path::PathBuf = base.join(&*path).components().collect();
                *path = joined.to_string_lossy().into_owned();
            }
        };
        for task in &mut self.components {
            if let Some(workdir) = &mut task.workdir {
                resolve(workdir);
            }
            for source in task.file_mounts.values_mut() {
                resolve(source);
            }
        }
    }
}

fn parse_group(
    number: usize,
    header: &Value,
    tasks: &[(usize, Value)],
) -> Result<JobGroup, SpecError> {
    let at = At::document(number);
    if let Value::Mapping(m) = header
        && (m.contains_key("run") || m.contains_key("resources"))
    {
        return Err(at.fix(
            "a file of several documents is a job group, and its first document is the header, not a task",
            "start the file with a header: `name: my-group`, `execution: parallel`, then `---` and the tasks",
        ));
    }
    let keys = Keys::read(
        header,
        &at,
        "a job group header",
        HEADER_KEYS,
        HEADER_NOT_SUPPORTED,
    )?;
    let name = match keys.get("name") {
        Some(v) => name(v, &at.key("name"), "job group", MAX_GROUP_NAME_LEN)?,
        None => {
            return Err(at.fix(
                "a job group needs a `name`",
                "add `name: my-group` to the header",
            ));
        }
    };
    match keys.get("execution") {
        Some(Value::String(s)) if s == "parallel" => {}
        Some(Value::String(s)) if s == "serial" => {
            return Err(at.key("execution").fix(
                "pipelines (`execution: serial`) are not supported: agentstack runs job groups, whose components run at the same time",
                "`execution: parallel`",
            ));
        }
        Some(other) => {
            return Err(at.key("execution").fix(
                format!("`{}` is not an execution mode", values::value_text(other)),
                "`execution: parallel`",
            ));
        }
        None => {
            return Err(at.fix(
                "a job group header needs `execution: parallel` (without it SkyPilot reads the file as a pipeline)",
                "add `execution: parallel` to the header",
            ));
        }
    }
    let mut components: Vec<Task> = Vec::with_capacity(tasks.len());
    for (number, value) in tasks {
        let task = parse_task(value, &At::document(*number))?;
        if let Some(first) = components.iter().position(|t| t.name == task.name) {
            return Err(At::document(*number)
                .in_component(&task.name)
                .key("name")
                .fix(
                    format!("two components are named `{}`", task.name),
                    format!(
                        "component names must be unique; document {} has it too",
                        tasks[first].0
                    ),
                ));
        }
        components.push(task);
    }
    let names: Vec<&str> = components.iter().map(|t| t.name.as_str()).collect();
    let known = || format!("the components are: {}", names.join(", "));
    let primary_tasks = match keys.get("primary_tasks") {
        None => None,
        Some(Value::Sequence(items)) => {
            let at = at.key("primary_tasks");
            if items.is_empty() {
                return Err(at.fix("the list is empty", "name at least one component, or leave `primary_tasks` out to make all of them primary"));
            }
            let mut primary = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                let at = at.index(i);
                let n = string(item, &at)?;
                if !names.contains(&n.as_str()) {
                    return Err(at.fix(format!("there is no component named `{n}`"), known()));
                }
                if primary.contains(&n) {
                    return Err(at.fix(
                        format!("`{n}` is listed twice"),
                        "list each primary component once",
                    ));
                }
                primary.push(n);
            }
            Some(primary)
        }
        Some(other) => {
            return Err(at.key("primary_tasks").fix(
                format!("must be a list, found {}", kind(other)),
                "`primary_tasks: [trainer]`",
            ));
        }
    };
    let termination_delay = match keys.get("termination_delay") {
        None => None,
        Some(value) => {
            let at = at.key("termination_delay");
            let Some(primary) = &primary_tasks else {
                return Err(at.fix(
                    "every component is primary (there is no `primary_tasks`), so no component waits out a termination delay",
                    "name the primary components with `primary_tasks: [...]`",
                ));
            };
            let mut delay = TerminationDelay::default();
            match value {
                Value::Mapping(map) => {
                    for (key, v) in map {
                        let Value::String(key) = key else {
                            return Err(
                                at.fix("keys must be component names or `default`", known())
                            );
                        };
                        let at = at.key(key);
                        let seconds = values::duration_seconds(v, &at)?;
                        if key == "default" {
                            delay.default = Some(seconds);
                        } else if !names.contains(&key.as_str()) {
                            return Err(
                                at.fix(format!("there is no component named `{key}`"), known())
                            );
                        } else if primary.contains(key) {
                            return Err(at.fix(
                                format!("`{key}` is primary: the delay applies to auxiliary components, which stop after the primaries finish"),
                                "name auxiliary components only, or `default`",
                            ));
                        } else {
                            delay.per_component.insert(key.clone(), seconds);
                        }
                    }
                }
                single => delay.default = Some(values::duration_seconds(single, &at)?),
            }
            Some(delay)
        }
    };
    let recovery = match keys.get("recovery") {
        None => GroupRecovery::Member,
        Some(Value::String(s)) if s == "member" => GroupRecovery::Member,
        Some(Value::String(s)) if s == "group" => GroupRecovery::Group,
        Some(other) => {
            return Err(at.key("recovery").fix(
                format!("`{}` is not a recovery mode", values::value_text(other)),
                "`recovery: member` restarts the failed member alone (the default); `recovery: group` restarts the whole group",
            ));
        }
    };
    Ok(JobGroup {
        name,
        recovery,
        primary_tasks,
        termination_delay,
        components,
    })
}

fn parse_task(value: &Value, at: &At) -> Result<Task, SpecError> {
    // Name the component in every error, even those found before `name` is checked.
    let at = &match value.get("name") {
        Some(Value::String(n)) if is_name(n, MAX_COMPONENT_NAME_LEN) => at.in_component(n),
        _ => at.clone(),
    };
    let keys = Keys::read(value, at, "a task", TASK_KEYS, TASK_NOT_SUPPORTED)?;
    let name = match keys.get("name") {
        Some(v) => name(v, &at.key("name"), "component", MAX_COMPONENT_NAME_LEN)?,
        None => {
            return Err(at.fix(
                "a task needs a `name`",
                "add `name: trainer`: it names the component and its variables (AGENTSTACK_TRAINER_ADDRS)",
            ));
        }
    };
    let at = at.in_component(&name);
    let workdir = match keys.get("workdir") {
        None => None,
        Some(Value::String(s)) if !s.trim().is_empty() => Some(s.clone()),
        Some(Value::Mapping(_)) => {
            return Err(at.key("workdir").fix(
                "git workdirs ({url, ref}) are not supported",
                "clone the repository and give its local path: `workdir: ./my-repo`",
            ));
        }
        Some(other) => {
            return Err(at.key("workdir").fix(
                format!("must be a local path, found {}", kind(other)),
                "`workdir: .` runs the commands in the spec's directory",
            ));
        }
    };
    let num_nodes = match keys.get("num_nodes") {
        Some(v) => whole(v, &at.key("num_nodes"), 1, MAX_NODES)? as u32,
        None => 1,
    };
    let replicas = match keys.get("replicas") {
        Some(v) => whole(v, &at.key("replicas"), 1, MAX_REPLICAS)? as u32,
        None => 1,
    };
    if replicas > 1 && num_nodes > 1 {
        return Err(at.key("replicas").fix(
            "a component is either multi-node (`num_nodes`) or replicated (`replicas`), not both",
            "split it into two components, or drop one of the keys",
        ));
    }
    let resources = match keys.get("resources") {
        Some(v) => parse_resources(v, &at.key("resources"))?,
        None => Resources::default(),
    };
    let envs = match keys.get("envs") {
        Some(v) => parse_envs(v, &at.key("envs"))?,
        None => BTreeMap::new(),
    };
    let file_mounts = match keys.get("file_mounts") {
        Some(v) => parse_file_mounts(v, &at.key("file_mounts"))?,
        None => BTreeMap::new(),
    };
    let setup = keys
        .get("setup")
        .map(|v| string(v, &at.key("setup")))
        .transpose()?;
    let run = match keys.get("run") {
        Some(v) => string(v, &at.key("run"))?,
        None => String::new(),
    };
    if run.trim().is_empty() {
        return Err(at.key("run").fix(
            "a task needs a `run` command",
            "add `run: ...`: the command that is the component",
        ));
    }
    let mut readiness_probe = match keys.get("readiness_probe") {
        None => None,
        Some(v) => {
            let at = at.key("readiness_probe");
            if resources.ports.is_empty() {
                return Err(at.fix(
                    "a readiness probe needs a port to probe",
                    "add `resources: {ports: 8000}`: the probe goes to the first port",
                ));
            }
            Some(parse_probe(v, &at)?)
        }
    };
    let mut replicas = replicas;
    let service = match keys.get("service") {
        None => None,
        Some(v) => {
            let at = at.key("service");
            let parsed = parse_service(v, &at)?;
            if let Some(probe) = parsed.readiness_probe {
                if readiness_probe.is_some() {
                    return Err(at.key("readiness_probe").fix(
                        "the component has a `readiness_probe` too",
                        "give it once, in `service`",
                    ));
                }
                readiness_probe = Some(probe);
            }
            if let Some(n) = parsed.replicas {
                if keys.get("replicas").is_some() {
                    return Err(at.key("replicas").fix(
                        "the component has `replicas` too",
                        "give them once, in `service`",
                    ));
                }
                replicas = n;
            }
            if readiness_probe.is_none() {
                return Err(at.fix(
                    "a service needs a readiness probe: the load balancer sends requests only to replicas that pass it",
                    "add `readiness_probe: /health` to `service`",
                ));
            }
            let Some(first) = resources.main_port() else {
                return Err(at.fix(
                    "a service's replicas need a port the load balancer can reach them on",
                    "add `resources: {ports: 8000}`: replica r listens on 8000 + r on one host",
                ));
            };
            if num_nodes > 1 {
                return Err(at.fix(
                    "a service's replicas are one node each",
                    "drop `num_nodes`, or make the multi-node part its own component",
                ));
            }
            let replica_ports = u32::from(first)..u32::from(first) + replicas;
            if replica_ports.contains(&u32::from(parsed.ports)) {
                return Err(at.key("ports").fix(
                    format!(
                        "the load balancer's port {} is one the replicas listen on ({}-{})",
                        parsed.ports,
                        replica_ports.start,
                        replica_ports.end - 1
                    ),
                    "give the load balancer a port outside the replicas' range",
                ));
            }
            Some(Service {
                ports: parsed.ports,
                load_balancing_policy: parsed.policy,
            })
        }
    };
    Ok(Task {
        name,
        workdir,
        num_nodes,
        resources,
        envs,
        file_mounts,
        setup,
        run,
        replicas,
        readiness_probe,
        service,
    })
}

/// `service` as written: its probe and replicas go to the component.
struct ParsedService {
    readiness_probe: Option<ReadinessProbe>,
    replicas: Option<u32>,
    ports: u16,
    policy: LoadBalancingPolicy,
}

fn parse_service(value: &Value, at: &At) -> Result<ParsedService, SpecError> {
    let keys = Keys::read(value, at, "service", SERVICE_KEYS, SERVICE_NOT_SUPPORTED)?;
    let readiness_probe = keys
        .get("readiness_probe")
        .map(|v| parse_probe(v, &at.key("readiness_probe")))
        .transpose()?;
    let replicas = keys
        .get("replicas")
        .map(|v| whole(v, &at.key("replicas"), 1, MAX_REPLICAS).map(|n| n as u32))
        .transpose()?;
    let ports = match keys.get("ports") {
        Some(v) => whole(v, &at.key("ports"), 1, u64::from(u16::MAX))? as u16,
        None => {
            return Err(at.fix(
                "a service needs the port its load balancer listens on",
                "add `ports: 8080` to `service`: clients send their requests there",
            ));
        }
    };
    let policy = match keys.get("load_balancing_policy") {
        None => LoadBalancingPolicy::default(),
        Some(v) => {
            let at = at.key("load_balancing_policy");
            match string(v, &at)?.to_ascii_lowercase().as_str() {
                "least_load" => LoadBalancingPolicy::LeastLoad,
                "round_robin" => LoadBalancingPolicy::RoundRobin,
                other => {
                    return Err(at.fix(
                        format!("`{other}` is not a load balancing policy"),
                        "`least_load` (the default) or `round_robin`",
                    ));
                }
            }
        }
    };
    Ok(ParsedService {
        readiness_probe,
        replicas,
        ports,
        policy,
    })
}

fn parse_resources(value: &Value, at: &At) -> Result<Resources, SpecError> {
    let keys = Keys::read(
        value,
        at,
        "resources",
        RESOURCE_KEYS,
        RESOURCE_NOT_SUPPORTED,
    )?;
    let infra = match keys.get("infra") {
        None => Vec::new(),
        Some(Value::Sequence(items)) => {
            let at = at.key("infra");
            if items.is_empty() {
                return Err(at.fix(
                    "the list is empty",
                    "name the engines in order of preference, `infra: [slurm, local]`, or leave `infra` out",
                ));
            }
            let mut list: Vec<Infra> = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                let at = at.index(i);
                let text = string(item, &at)?;
                let infra = Infra::parse(&text).map_err(|message| at.fix(message, INFRA_HINT))?;
                if let Some(earlier) = list
                    .iter()
                    .find(|e| InfraKind::from(*e) == InfraKind::from(&infra))
                {
                    return Err(at.fix(
                        format!("`{earlier}` is already in the list"),
                        "name each engine once: a group that one cannot place goes to the next",
                    ));
                }
                list.push(infra);
            }
            list
        }
        Some(v) => {
            let at = at.key("infra");
            let text = string(v, &at)?;
            vec![Infra::parse(&text).map_err(|message| at.fix(message, INFRA_HINT))?]
        }
    };
    let cpus = keys
        .get("cpus")
        .map(|v| Cpus::parse(v, &at.key("cpus")))
        .transpose()?;
    let memory = keys
        .get("memory")
        .map(|v| Memory::parse(v, &at.key("memory")))
        .transpose()?;
    if let Some(Memory {
        amount: MemoryAmount::PerCpu(ratio),
        ..
    }) = memory
        && cpus.is_none()
    {
        return Err(at.key("memory").fix(
            format!(
                "`{}x` means {} GB per CPU, but `cpus` is not set",
                values::display_number(ratio),
                values::display_number(ratio)
            ),
            "set `cpus`, or give the memory as a size (`memory: 16GB`)",
        ));
    }
    let accelerators = keys
        .get("accelerators")
        .map(|v| Accelerators::parse(v, &at.key("accelerators")))
        .transpose()?;
    let ports = match keys.get("ports") {
        Some(v) => PortRange::parse_list(v, &at.key("ports"))?,
        None => Vec::new(),
    };
    let job_recovery = keys
        .get("job_recovery")
        .map(|v| JobRecovery::parse(v, &at.key("job_recovery")))
        .transpose()?;
    let priority = keys
        .get("priority")
        .map(|v| {
            reader::integer(v, &at.key("priority"), PRIORITY_RANGE.0, PRIORITY_RANGE.1)
                .map(|p| p as i32)
        })
        .transpose()?;
    Ok(Resources {
        infra,
        cpus,
        memory,
        accelerators,
        ports,
        job_recovery,
        priority,
    })
}

fn parse_envs(value: &Value, at: &At) -> Result<BTreeMap<String, Option<String>>, SpecError> {
    let Value::Mapping(map) = value else {
        return Err(at.fix(
            format!("must be a mapping, found {}", kind(value)),
            "`envs: {MODEL: smollm2}`",
        ));
    };
    let mut envs = BTreeMap::new();
    for (key, v) in map {
        let Value::String(key) = key else {
            return Err(at.fix("variable names must be strings", "`envs: {MODEL: smollm2}`"));
        };
        let at = at.key(key);
        if !is_env_name(key) {
            return Err(at.fix(
                format!("`{key}` is not an environment variable name"),
                "letters, digits and `_`, not starting with a digit",
            ));
        }
        if crate::discovery::is_reserved(key) {
            return Err(at.fix(
                format!("`{key}` is set by the launcher for service discovery"),
                "use another name; the launcher's value is there at run time",
            ));
        }
        let value = match v {
            Value::Null => None,
            Value::String(s) => Some(s.clone()),
            Value::Number(n) => Some(n.to_string()),
            Value::Bool(b) => Some(b.to_string()),
            other => {
                return Err(at.fix(
                    format!("must be a string, found {}", kind(other)),
                    "a value, or null to require one at launch",
                ));
            }
        };
        envs.insert(key.clone(), value);
    }
    Ok(envs)
}

/// Whether `name` can name an environment variable (SkyPilot's `^[a-zA-Z_][a-zA-Z0-9_]*$`).
pub fn is_env_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn parse_file_mounts(value: &Value, at: &At) -> Result<BTreeMap<String, String>, SpecError> {
    let hint = "node path → local path: `file_mounts: {/data: ./data}`";
    let Value::Mapping(map) = value else {
        return Err(at.fix(format!("must be a mapping, found {}", kind(value)), hint));
    };
    let mut mounts = BTreeMap::new();
    for (key, v) in map {
        let Value::String(target) = key else {
            return Err(at.fix("node paths must be strings", hint));
        };
        let at = at.key(target);
        if target.trim().is_empty() || target.contains('\0') {
            return Err(at.fix("the node path is empty", hint));
        }
        let source = match v {
            Value::String(s) if s.contains("://") => {
                return Err(at.fix(
                    format!("`{s}` is a URL: only local paths can be mounted"),
                    "copy the data to a local path first",
                ));
            }
            Value::String(s) if !s.trim().is_empty() && !s.contains('\0') => s.clone(),
            Value::Mapping(_) => {
                return Err(at.fix(
                    "storage objects (buckets) are not supported: only local paths can be mounted",
                    hint,
                ));
            }
            other => {
                return Err(at.fix(format!("must be a local path, found {}", kind(other)), hint));
            }
        };
        mounts.insert(target.clone(), source);
    }
    Ok(mounts)
}

fn parse_probe(value: &Value, at: &At) -> Result<ReadinessProbe, SpecError> {
    let path_of = |v: &Value, at: &At| -> Result<String, SpecError> {
        let path = string(v, at)?;
        if !path.starts_with('/') || path.chars().any(char::is_whitespace) {
            return Err(at.fix(
                format!("`{path}` is not a URL path"),
                "a path such as `/health`",
            ));
        }
        Ok(path)
    };
    if let Value::String(_) = value {
        return Ok(ReadinessProbe {
            path: path_of(value, at)?,
            initial_delay_seconds: None,
            timeout_seconds: None,
            endpoint_probe_interval_seconds: None,
            consecutive_failure_threshold_timeout: None,
            post_data: None,
            headers: BTreeMap::new(),
        });
    }
    let keys = Keys::read(value, at, "readiness_probe", PROBE_KEYS, &[])?;
    let path = match keys.get("path") {
        Some(v) => path_of(v, &at.key("path"))?,
        None => {
            return Err(at.fix(
                "a readiness probe needs a `path`",
                "`readiness_probe: {path: /health}`",
            ));
        }
    };
    let secs = |key: &str, positive: bool| {
        keys.get(key)
            .map(|v| reader::seconds(v, &at.key(key), positive))
            .transpose()
    };
    let post_data = match keys.get("post_data") {
        None => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(v @ Value::Mapping(_)) => Some(serde_json::to_string(v).map_err(|e| {
            at.key("post_data").fix(
                format!("cannot be sent as JSON: {e}"),
                "give the body as a string",
            )
        })?),
        Some(other) => {
            return Err(at.key("post_data").fix(
                format!("must be a string or a mapping, found {}", kind(other)),
                "`post_data: {model: smollm2}` is sent as JSON",
            ));
        }
    };
    let mut headers = BTreeMap::new();
    if let Some(v) = keys.get("headers") {
        let at = at.key("headers");
        let Value::Mapping(map) = v else {
            return Err(at.fix(
                format!("must be a mapping, found {}", kind(v)),
                "`headers: {Authorization: Bearer x}`",
            ));
        };
        for (name, value) in map {
            let (Value::String(name), Value::String(value)) = (name, value) else {
                return Err(at.fix(
                    "header names and values must be strings",
                    "`headers: {Authorization: Bearer x}`",
                ));
            };
            let valid_name = !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
            if !valid_name || value.contains(['\r', '\n']) {
                return Err(at.key(name).fix(
                    "not a valid HTTP header",
                    "a token name and a one-line value",
                ));
            }
            headers.insert(name.clone(), value.clone());
        }
    }
    Ok(ReadinessProbe {
        path,
        initial_delay_seconds: secs("initial_delay_seconds", false)?,
        timeout_seconds: secs("timeout_seconds", true)?,
        endpoint_probe_interval_seconds: secs("endpoint_probe_interval_seconds", true)?,
        consecutive_failure_threshold_timeout: secs(
            "consecutive_failure_threshold_timeout",
            false,
        )?,
        post_data,
        headers,
    })
}

/// Reads a group or component name: a DNS label (lowercase letters, digits, `-`,
/// starting with a letter) that also makes an environment variable name once upper-cased
/// with `-` as `_`.
fn name(value: &Value, at: &At, what: &str, max: usize) -> Result<String, SpecError> {
    let text = string(value, at)?;
    if is_name(&text, max) {
        return Ok(text);
    }
    let suggestion: String = text
        .trim()
        .to_ascii_lowercase()
        .chars()
        .map(|c| {
            if c.is_ascii_lowercase() || c.is_ascii_digit() {
                c
            } else {
                '-'
            }
        })
        .collect::<String>()
        .trim_matches('-')
        .chars()
        .take(max)
        .collect();
    let example = if is_name(&suggestion, max) {
        format!(", e.g. `{suggestion}`")
    } else {
        String::new()
    };
    Err(at.fix(
        format!("`{text}` cannot name a {what}: names are used as DNS names and in environment variable names"),
        format!("lowercase letters, digits and `-`, starting with a letter, at most {max} characters{example}"),
    ))
}

fn is_name(text: &str, max: usize) -> bool {
    !text.is_empty()
        && text.len() <= max
        && text.starts_with(|c: char| c.is_ascii_lowercase())
        && !text.ends_with('-')
        && text
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
}

#[cfg(test)]
mod tests;
