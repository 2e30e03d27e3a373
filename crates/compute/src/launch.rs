//! A launch's choices, before anything runs: which infra ([`InfraKind`], from the
//! caller's choice or the components' `resources.infra`), the backend built for it from
//! [`LaunchOptions`], the supervisor's pace, and the dry-run [`plan`]: what each engine
//! would be given (bash scripts with their environment, `sbatch` scripts, Ray Jobs
//! request bodies, Kubernetes manifests). The plan is text, made without I/O.
//!
//! ```
//! use agentstack_compute::JobGroup;
//! use agentstack_compute::launch::{InfraKind, LaunchOptions, choose_infra, plan};
//!
//! let group = JobGroup::parse("name: t\nrun: echo hi\nresources: {infra: slurm}\n")?;
//! let infra = choose_infra(&group, None)?;
//! assert_eq!(infra, [InfraKind::Slurm]);
//! let text = plan(&group, infra[0], &LaunchOptions::default())?;
//! assert!(text.contains("#SBATCH --job-name=t-t"));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fmt;
use std::time::Duration;

use agentstack_static::env_vars;
use serde::{Deserialize, Serialize};

use crate::backend::kubernetes::{Credentials, KubernetesBackend, KubernetesSettings};
use crate::backend::local::LocalBackend;
use crate::backend::ray::RayBackend;
use crate::backend::slurm::{SlurmBackend, SlurmSettings};
use crate::backend::{AnyBackend, Backend, BackendError};
use crate::discovery;
use crate::entrypoint::{self, EntrypointOptions};
use crate::kubernetes::{KubernetesOptions, manifests};
use crate::ray::{RayOptions, submit_request};
use crate::slurm::{SlurmOptions, batch_script};
pub use crate::spec::InfraKind;
use crate::supervisor::SupervisorSettings;
use crate::{BuildError, JobGroup};

/// Ray's default Jobs API address (the dashboard port of a local head).
pub const DEFAULT_RAY_ADDRESS: &str = "http://127.0.0.1:8265";

/// What a launch's backend needs besides the spec, kept with the launch (as JSON in the
/// state database) so that a later supervisor builds the same backend.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LaunchOptions {
    /// Ray's Jobs API (`None`: [`DEFAULT_RAY_ADDRESS`]).
    pub ray_address: Option<String>,
    /// Slurm `--time` in minutes.
    pub slurm_time: Option<u32>,
    /// The container image for Kubernetes.
    pub k8s_image: Option<String>,
    /// The Kubernetes namespace (`None`: the context's, else `default`).
    pub k8s_namespace: Option<String>,
    /// The kubeconfig context (`None`: the current one).
    pub k8s_context: Option<String>,
    /// A Kueue LocalQueue.
    pub k8s_queue: Option<String>,
    /// CPUs local launches may hold at once (`None`: the machine's).
    pub local_cpus: Option<f64>,
    /// Seconds every component has to start.
    pub start_timeout: Option<u64>,
    /// The address `service` load balancers listen on (`None`: 127.0.0.1).
    #[serde(default)]
    pub service_host: Option<String>,
}

/// Why a launch's infra, backend or plan could not be made.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// Components name different infra and the caller chose none.
    #[error(
        "components ask for different infra: `{first}` for {first_kind}, `{second}` for {second_kind}\nhint: a group runs on one infra at a time: make their `resources.infra` agree (the same engines in the same order), or choose with --infra"
    )]
    MixedInfra {
        /// The component that named the first engines.
        first: String,
        /// What it named.
        first_kind: String,
        /// A component that named others.
        second: String,
        /// What it named.
        second_kind: String,
    },
    /// No kubeconfig to reach Kubernetes with.
    #[error(
        "no kubeconfig: KUBECONFIG is not set and ~/.kube/config does not exist\nhint: point KUBECONFIG at your cluster's kubeconfig"
    )]
    NoKubeconfig,
    /// Kubernetes without an image to run.
    #[error(
        "Kubernetes needs a container image to run the components in\nhint: pass --k8s-image IMAGE (or set {}); it must hold bash and what `run` starts",
        env_vars::AGENTSTACK_K8S_IMAGE
    )]
    NoImage,
    /// The backend could not be made (a kubeconfig that does not read, say).
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// A component's request could not be built.
    #[error(transparent)]
    Build(#[from] BuildError),
    /// The plan could not be written (a request body or manifest that does not
    /// serialize: a bug).
    #[error("could not write the plan")]
    Write(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl LaunchError {
    /// Whether the user can fix it (their files, flags or environment), rather than a
    /// failure of agentstack's own state or code.
    pub fn is_users(&self) -> bool {
        !matches!(self, Self::Write(_))
    }
}

/// The engines to try, in order: `chosen` (a flag) alone, else the list the components
/// name (they must agree), else local.
pub fn choose_infra(
    group: &JobGroup,
    chosen: Option<InfraKind>,
) -> Result<Vec<InfraKind>, LaunchError> {
    if let Some(kind) = chosen {
        return Ok(vec![kind]);
    }
    let mut named: Option<(Vec<InfraKind>, &str)> = None;
    for task in &group.components {
        if task.resources.infra.is_empty() {
            continue;
        }
        let kinds: Vec<InfraKind> = task.resources.infra.iter().map(InfraKind::from).collect();
        match &named {
            Some((other, component)) if *other != kinds => {
                return Err(LaunchError::MixedInfra {
                    first: (*component).to_owned(),
                    first_kind: list_text(other),
                    second: task.name.clone(),
                    second_kind: list_text(&kinds),
                });
            }
            _ => named = Some((kinds, &task.name)),
        }
    }
    Ok(named.map_or_else(|| vec![InfraKind::Local], |(kinds, _)| kinds))
}

/// `slurm`, or `[slurm, local]`.
fn list_text(kinds: &[InfraKind]) -> String {
    match kinds {
        [one] => one.to_string(),
        many => format!(
            "[{}]",
            many.iter()
                .map(|k| k.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// The backend for `infra`, with `options`. Kubernetes reads the kubeconfig
/// (`KUBECONFIG`, else `~/.kube/config`).
pub fn backend(infra: InfraKind, options: &LaunchOptions) -> Result<AnyBackend, LaunchError> {
    Ok(match infra {
        InfraKind::Local => AnyBackend::Local(LocalBackend::new()),
        InfraKind::Slurm => AnyBackend::Slurm(SlurmBackend::new(SlurmSettings {
            time_limit_minutes: options.slurm_time,
            ..Default::default()
        })),
        InfraKind::Ray => AnyBackend::Ray(RayBackend::new(
            options
                .ray_address
                .as_deref()
                .unwrap_or(DEFAULT_RAY_ADDRESS),
        )),
        InfraKind::Kubernetes => {
            let Some(path) = Credentials::default_path().filter(|p| p.exists()) else {
                return Err(LaunchError::NoKubeconfig);
            };
            let credentials = Credentials::from_kubeconfig(&path, options.k8s_context.as_deref())?;
            let Some(image) = options.k8s_image.clone() else {
                return Err(LaunchError::NoImage);
            };
            let namespace = options
                .k8s_namespace
                .clone()
                .or_else(|| credentials.namespace.clone())
                .unwrap_or_else(|| "default".into());
            AnyBackend::Kubernetes(KubernetesBackend::new(
                credentials,
                KubernetesSettings {
                    namespace,
                    image,
                    queue: options.k8s_queue.clone(),
                    termination_grace_seconds: 30,
                },
            )?)
        }
    })
}

/// The supervisor's pace for `infra`.
pub fn supervisor_settings(infra: InfraKind, options: &LaunchOptions) -> SupervisorSettings {
    let defaults = SupervisorSettings::default();
    SupervisorSettings {
        // Engines are asked less often than our own process table.
        poll_interval: if infra == InfraKind::Local {
            Duration::from_millis(100)
        } else {
            Duration::from_millis(250)
        },
        start_timeout: options
            .start_timeout
            .map_or(defaults.start_timeout, Duration::from_secs),
        local_cpus: options.local_cpus.unwrap_or(defaults.local_cpus),
        service_host: options
            .service_host
            .clone()
            .unwrap_or(defaults.service_host.clone()),
        ..defaults
    }
}

/// What each engine would be given for `group` on `infra`, as text: per replica a
/// `# component/replica: how` line, then the script, body or manifest. Addresses not
/// known before placement are `unplaced`; the launch's directory and id are
/// `<launch dir>` and `<id>`.
pub fn plan(
    group: &JobGroup,
    infra: InfraKind,
    options: &LaunchOptions,
) -> Result<String, LaunchError> {
    use std::fmt::Write as _;
    let mut out = String::new();
    let placeholders = crate::supervisor::placeholder_addresses(group);
    let discovery_file = "<launch dir>/discovery/<unit>.<attempt>.env";
    let write_error = |e: fmt::Error| LaunchError::Write(Box::new(e));
    match infra {
        InfraKind::Local => {
            let addresses = LocalBackend::new()
                .addresses_up_front(group)
                .expect("local knows its addresses");
            for task in &group.components {
                for r in 0..task.replicas {
                    let vars = discovery::environment(group, &addresses, &task.name, r as usize)
                        .map_err(BuildError::from)?;
                    let env = crate::request::environment(task, &vars)?;
                    writeln!(out, "# {}/{r}: bash -c with this environment", task.name)
                        .map_err(write_error)?;
                    out.push_str(&discovery::env_file(&env));
                    out.push_str(&entrypoint::script(
                        task,
                        &EntrypointOptions {
                            workdir: task.workdir.as_deref(),
                            ..Default::default()
                        },
                    ));
                    out.push('\n');
                }
            }
        }
        InfraKind::Slurm => {
            for task in &group.components {
                for r in 0..task.replicas {
                    let vars = discovery::environment(
                        group,
                        &placeholders,
                        &task.name,
                        r as usize * task.num_nodes as usize,
                    )
                    .map_err(BuildError::from)?;
                    writeln!(out, "# {}/{r}: sbatch --parsable", task.name).map_err(write_error)?;
                    out.push_str(&batch_script(
                        group,
                        &task.name,
                        r,
                        &vars,
                        &SlurmOptions {
                            time_limit_minutes: options.slurm_time,
                            log_dir: Some("<launch dir>/logs"),
                            discovery_file: Some(discovery_file),
                            discovery_timeout_seconds: 600,
                            extra_options: &[],
                        },
                    )?);
                    out.push('\n');
                }
            }
        }
        InfraKind::Ray => {
            for task in &group.components {
                for r in 0..task.replicas {
                    let vars = discovery::environment(group, &placeholders, &task.name, r as usize)
                        .map_err(BuildError::from)?;
                    let body = submit_request(
                        group,
                        &task.name,
                        r,
                        &vars,
                        &RayOptions {
                            launch_id: "<id>",
                            attempt: 0,
                            working_dir_uri: None,
                            discovery_file: Some(discovery_file),
                            discovery_timeout_seconds: 600,
                        },
                    )?;
                    writeln!(out, "# {}/{r}: POST /api/jobs/", task.name).map_err(write_error)?;
                    let body = serde_json::to_string_pretty(&body)
                        .map_err(|e| LaunchError::Write(Box::new(e)))?;
                    writeln!(out, "{body}").map_err(write_error)?;
                }
            }
        }
        InfraKind::Kubernetes => {
            let namespace = options.k8s_namespace.as_deref().unwrap_or("default");
            let image = options.k8s_image.as_deref().unwrap_or("<--k8s-image>");
            let k8s = KubernetesOptions {
                queue: options.k8s_queue.as_deref(),
                ..KubernetesOptions::new(namespace, image)
            };
            for object in manifests(group, &k8s)? {
                out.push_str("---\n");
                let yaml = serde_norway::to_string(&object)
                    .map_err(|e| LaunchError::Write(Box::new(e)))?;
                out.push_str(&yaml);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(text: &str) -> JobGroup {
        JobGroup::parse(text).unwrap()
    }

    #[test]
    fn the_choice_wins_then_the_components_then_local() {
        let slurm = group("name: t\nrun: x\nresources: {infra: slurm/hpc}\n");
        assert_eq!(choose_infra(&slurm, None).unwrap(), [InfraKind::Slurm]);
        assert_eq!(
            choose_infra(&slurm, Some(InfraKind::Ray)).unwrap(),
            [InfraKind::Ray]
        );
        let plain = group("name: t\nrun: x\n");
        assert_eq!(choose_infra(&plain, None).unwrap(), [InfraKind::Local]);
        let list = group(
            "name: g\nexecution: parallel\n---\nname: a\nrun: x\nresources: {infra: [slurm/hpc, ray, local]}\n---\nname: b\nrun: x\n",
        );
        assert_eq!(
            choose_infra(&list, None).unwrap(),
            [InfraKind::Slurm, InfraKind::Ray, InfraKind::Local]
        );
    }

    #[test]
    fn components_that_disagree_are_the_users_to_fix() {
        let mixed = group(
            "name: g\nexecution: parallel\n---\nname: a\nrun: x\nresources: {infra: ray}\n---\nname: b\nrun: x\nresources: {infra: k8s}\n",
        );
        let error = choose_infra(&mixed, None).unwrap_err();
        assert!(error.is_users());
        assert_eq!(
            error.to_string().lines().next().unwrap(),
            "components ask for different infra: `a` for ray, `b` for kubernetes"
        );
        let order = group(
            "name: g\nexecution: parallel\n---\nname: a\nrun: x\nresources: {infra: [ray, local]}\n---\nname: b\nrun: x\nresources: {infra: [local, ray]}\n",
        );
        assert_eq!(
            choose_infra(&order, None)
                .unwrap_err()
                .to_string()
                .lines()
                .next()
                .unwrap(),
            "components ask for different infra: `a` for [ray, local], `b` for [local, ray]"
        );
    }

    #[test]
    fn kinds_read_back_what_the_state_holds() {
        for kind in [
            InfraKind::Local,
            InfraKind::Slurm,
            InfraKind::Ray,
            InfraKind::Kubernetes,
        ] {
            assert_eq!(kind.as_str().parse::<InfraKind>().unwrap(), kind);
        }
        assert!("mars".parse::<InfraKind>().is_err());
    }

    #[test]
    fn options_keep_their_json_names() {
        // A launch's options are stored as JSON: a later supervisor must read them.
        let options: LaunchOptions =
            serde_json::from_str(r#"{"ray_address":"http://h:1","start_timeout":5}"#).unwrap();
        assert_eq!(options.ray_address.as_deref(), Some("http://h:1"));
        assert_eq!(options.start_timeout, Some(5));
    }

    #[test]
    fn a_plan_per_engine() {
        let g = group("name: t\nrun: echo hi\n");
        let options = LaunchOptions::default();
        let local = plan(&g, InfraKind::Local, &options).unwrap();
        assert!(
            local.starts_with("# t/0: bash -c with this environment\n"),
            "{local}"
        );
        let ray = plan(&g, InfraKind::Ray, &options).unwrap();
        assert!(ray.starts_with("# t/0: POST /api/jobs/\n{"), "{ray}");
        let k8s = plan(&g, InfraKind::Kubernetes, &options).unwrap();
        assert!(k8s.starts_with("---\n"), "{k8s}");
        assert!(k8s.contains("<--k8s-image>"), "{k8s}");
    }
}
