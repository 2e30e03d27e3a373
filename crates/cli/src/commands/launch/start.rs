//! `agentstack launch FILE [--infra local|slurm|ray|k8s] [--detach] [--dry-run]`.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use agentstack_compute::backend::Backend;
use agentstack_compute::discovery::{self, Addresses, Endpoint};
use agentstack_compute::entrypoint::{self, EntrypointOptions};
use agentstack_compute::kubernetes::{KubernetesOptions, manifests};
use agentstack_compute::ray::{RayOptions, submit_request};
use agentstack_compute::slurm::{SlurmOptions, batch_script};
use agentstack_compute::spec::Infra;
use agentstack_compute::state::{JobState, Store};
use agentstack_compute::supervisor::{SuperviseError, create_launch};
use agentstack_compute::{BuildError, JobGroup};
use agentstack_static::env_vars;
use anyhow::anyhow;

use super::{
    LaunchOptions, backend, env_pair, find, internal, jobs_dir, local_cpus, open_store,
    spawn_supervisor, supervise_here, supervisor_settings,
};
use crate::args::{InfraArg, LaunchArgs};
use crate::{Exit, settings};

/// What `agentstack launch` runs with: its flags, environment variables and the job
/// group's file, resolved by the one precedence rule (see [`crate::settings`]).
pub struct LaunchSettings {
    /// The task or job-group YAML.
    pub file: PathBuf,
    /// The job group read from it, with `--env` applied and paths resolved.
    pub group: JobGroup,
    /// Where it runs: `--infra`, else the components' `resources.infra`, else local.
    pub infra: &'static str,
    /// Return once submitted.
    pub detach: bool,
    /// Print what would be submitted and stop.
    pub dry_run: bool,
    /// What the backend needs besides the spec (kept with the launch).
    pub options: LaunchOptions,
}

impl fmt::Debug for LaunchSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The group by its name and components: the whole spec is the file's.
        let components: Vec<&str> = self
            .group
            .components
            .iter()
            .map(|t| t.name.as_str())
            .collect();
        f.debug_struct("LaunchSettings")
            .field("file", &self.file)
            .field("group", &self.group.name)
            .field("components", &components)
            .field("infra", &self.infra)
            .field("detach", &self.detach)
            .field("dry_run", &self.dry_run)
            .field("options", &self.options)
            .finish()
    }
}

impl LaunchSettings {
    /// Reads the file and resolves the flags and `AGENTSTACK_RAY_ADDRESS`,
    /// `AGENTSTACK_K8S_IMAGE`, `AGENTSTACK_K8S_NAMESPACE` and `AGENTSTACK_LOCAL_CPUS`.
    pub fn resolve(args: &LaunchArgs) -> Result<Self, Exit> {
        let file = &args.file;
        let text = std::fs::read_to_string(file).map_err(|e| {
            Exit::user(anyhow!(
                "cannot read {}: {e}\nhint: give the path of a task or job-group YAML, e.g. examples/rl-job.yaml",
                file.display()
            ))
        })?;
        let mut group =
            JobGroup::parse(&text).map_err(|e| Exit::user(anyhow!("{}: {e}", file.display())))?;
        let base = file
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let base = base.canonicalize().unwrap_or_else(|_| base.to_path_buf());
        group.resolve_paths(&base);
        for pair in &args.envs {
            let (key, value) = env_pair(pair).map_err(Exit::user)?;
            for task in &mut group.components {
                task.envs.insert(key.clone(), Some(value.clone()));
            }
        }
        for task in &group.components {
            if let Some((key, _)) = task.envs.iter().find(|(_, v)| v.is_none()) {
                return Err(Exit::user(anyhow!(BuildError::UnsetEnv {
                    component: task.name.clone(),
                    key: key.clone(),
                })));
            }
        }
        let infra = infra(&group, args.infra)?;
        let text = |flag: &Option<String>, name| settings::flag_or_env_text(flag.as_deref(), name);
        let options = LaunchOptions {
            ray_address: text(&args.ray_address, env_vars::AGENTSTACK_RAY_ADDRESS),
            slurm_time: args.slurm_time,
            k8s_image: text(&args.k8s_image, env_vars::AGENTSTACK_K8S_IMAGE),
            k8s_namespace: text(&args.k8s_namespace, env_vars::AGENTSTACK_K8S_NAMESPACE),
            k8s_context: args.k8s_context.clone(),
            k8s_queue: args.k8s_queue.clone(),
            local_cpus: local_cpus()?,
            start_timeout: Some(args.start_timeout),
        };
        Ok(Self {
            file: file.clone(),
            group,
            infra,
            detach: args.detach,
            dry_run: args.dry_run,
            options,
        })
    }
}

/// Runs `agentstack launch`.
pub async fn run(args: LaunchArgs) -> Result<(), Exit> {
    let resolved = LaunchSettings::resolve(&args)?;
    if args.show_settings {
        return settings::show(&resolved);
    }
    let LaunchSettings {
        file,
        group,
        infra,
        detach,
        dry_run: dry,
        options,
    } = resolved;
    let file = &file;
    if dry {
        return dry_run(&group, infra, &options);
    }

    let backend = backend(infra, &options)?;
    backend
        .check(&group)
        .map_err(|e| Exit::user(anyhow!(e).context(format!("{} on {infra}", file.display()))))?;
    let store = open_store().await?;
    if let Some(running) = store.job_by_name(&group.name).await.map_err(internal)?
        && !running.state.is_terminal()
    {
        return Err(Exit::user(anyhow!(
            "a launch named `{}` is still {} (id {})\nhint: `agentstack cancel {}` first, or give the group another `name`",
            group.name,
            running.state,
            running.id,
            group.name
        )));
    }
    let settings = supervisor_settings(infra, &options);
    let options_json = serde_json::to_value(&options).map_err(internal)?;
    let job = create_launch(
        &store,
        &backend,
        &group,
        &jobs_dir(),
        &options_json,
        &settings,
    )
    .await
    .map_err(|e| match e {
        SuperviseError::TooLarge { .. } | SuperviseError::Backend(_) => Exit::user(anyhow!(e)),
        e => internal(e),
    })?;
    drop(backend);
    let units: usize = store.units(&job.id).await.map_err(internal)?.len();
    eprintln!(
        "launching `{}` on {infra}: {} component(s), {units} unit(s) (id {})",
        group.name,
        group.components.len(),
        job.id
    );
    if detach {
        let pid = spawn_supervisor(&job)?;
        eprintln!("supervisor running in the background (pid {pid})");
        eprintln!("  agentstack status {}", group.name);
        eprintln!("  agentstack logs {} --follow", group.name);
        eprintln!("  agentstack cancel {}", group.name);
        println!("{}", job.id);
        return Ok(());
    }
    foreground(&store, &job.id).await
}

/// The infra: `--infra`, else what the components name (they must agree), else local.
fn infra(group: &JobGroup, flag: Option<InfraArg>) -> Result<&'static str, Exit> {
    if let Some(flag) = flag {
        return Ok(match flag {
            InfraArg::Local => "local",
            InfraArg::Slurm => "slurm",
            InfraArg::Ray => "ray",
            InfraArg::K8s => "kubernetes",
        });
    }
    let mut chosen: Option<(&str, &str)> = None;
    for task in &group.components {
        let Some(infra) = &task.resources.infra else {
            continue;
        };
        let kind = match infra {
            Infra::Local => "local",
            Infra::Slurm { .. } => "slurm",
            Infra::Ray { .. } => "ray",
            Infra::Kubernetes { .. } => "kubernetes",
        };
        match chosen {
            Some((other, component)) if other != kind => {
                return Err(Exit::user(anyhow!(
                    "components ask for different infra: `{component}` for {other}, `{}` for {kind}\nhint: a group runs on one infra: make their `resources.infra` agree, or choose with --infra",
                    task.name
                )));
            }
            _ => chosen = Some((kind, &task.name)),
        }
    }
    Ok(chosen.map_or("local", |(kind, _)| kind))
}

/// Prints what each engine would be given.
fn dry_run(group: &JobGroup, infra: &str, options: &LaunchOptions) -> Result<(), Exit> {
    use std::fmt::Write as _;
    let mut out = String::new();
    // Written at the end in one go: a closed pipe (`| head`) is then one io error,
    // which the CLI takes for success.
    macro_rules! say {
        ($($t:tt)*) => { let _ = write!(out, $($t)*); };
    }
    macro_rules! sayln {
        () => { out.push('\n'); };
        ($($t:tt)*) => { let _ = writeln!(out, $($t)*); };
    }
    let user = |e: BuildError| Exit::user(anyhow!(e));
    let placeholders: Addresses = group
        .components
        .iter()
        .map(|t| {
            let endpoints = (0..t.instances())
                .map(|_| Endpoint::new("unplaced", t.resources.main_port()))
                .collect();
            (t.name.clone(), endpoints)
        })
        .collect();
    let discovery_file = "<launch dir>/discovery/<unit>.<attempt>.env";
    match infra {
        "local" => {
            let addresses = agentstack_compute::backend::local::LocalBackend::new()
                .addresses_up_front(group)
                .expect("local knows its addresses");
            for task in &group.components {
                for r in 0..task.replicas {
                    let vars = discovery::environment(group, &addresses, &task.name, r as usize)
                        .map_err(|e| user(e.into()))?;
                    let env =
                        agentstack_compute::request::environment(task, &vars).map_err(user)?;
                    sayln!("# {}/{r}: bash -c with this environment", task.name);
                    say!("{}", discovery::env_file(&env));
                    say!(
                        "{}",
                        entrypoint::script(
                            task,
                            &EntrypointOptions {
                                workdir: task.workdir.as_deref(),
                                ..Default::default()
                            }
                        )
                    );
                    sayln!();
                }
            }
        }
        "slurm" => {
            for task in &group.components {
                for r in 0..task.replicas {
                    let vars = discovery::environment(
                        group,
                        &placeholders,
                        &task.name,
                        r as usize * task.num_nodes as usize,
                    )
                    .map_err(|e| user(e.into()))?;
                    sayln!("# {}/{r}: sbatch --parsable", task.name);
                    say!(
                        "{}",
                        batch_script(
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
                        )
                        .map_err(user)?
                    );
                    sayln!();
                }
            }
        }
        "ray" => {
            for task in &group.components {
                for r in 0..task.replicas {
                    let vars = discovery::environment(group, &placeholders, &task.name, r as usize)
                        .map_err(|e| user(e.into()))?;
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
                    )
                    .map_err(user)?;
                    sayln!("# {}/{r}: POST /api/jobs/", task.name);
                    sayln!("{}", serde_json::to_string_pretty(&body).map_err(internal)?);
                }
            }
        }
        _ => {
            let namespace = options.k8s_namespace.as_deref().unwrap_or("default");
            let image = options.k8s_image.as_deref().unwrap_or("<--k8s-image>");
            let k8s = KubernetesOptions {
                queue: options.k8s_queue.as_deref(),
                ..KubernetesOptions::new(namespace, image)
            };
            for object in manifests(group, &k8s).map_err(user)? {
                sayln!("---");
                say!("{}", serde_norway::to_string(&object).map_err(internal)?);
            }
        }
    }
    std::io::Write::write_all(&mut std::io::stdout(), out.as_bytes()).map_err(internal)?;
    Ok(())
}

/// Supervises in this process, printing what changes; Ctrl-C cancels (twice: leaves).
async fn foreground(store: &Store, id: &str) -> Result<(), Exit> {
    let job = find(store, id).await?;
    let printer = {
        let store = store.clone();
        let id = id.to_owned();
        tokio::spawn(async move { print_changes(&store, &id).await })
    };
    let cancel = {
        let store = store.clone();
        let id = id.to_owned();
        let name = job.name.clone();
        tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                eprintln!(
                    "cancelling `{name}`: stopping every component (Ctrl-C again to leave them running)"
                );
                let _ = store.request_cancel(&id).await;
                if tokio::signal::ctrl_c().await.is_ok() {
                    eprintln!("leaving `{name}` running; `agentstack status {name}` picks it up");
                    std::process::exit(130);
                }
            }
        })
    };
    let end = supervise_here(store, &job).await;
    cancel.abort();
    // One last look, so the final states are printed.
    tokio::time::sleep(Duration::from_millis(250)).await;
    printer.abort();
    let end = end?;
    let job = find(store, id).await?;
    match end {
        JobState::Succeeded => {
            eprintln!("`{}` succeeded", job.name);
            Ok(())
        }
        JobState::Cancelled => {
            eprintln!("`{}` cancelled", job.name);
            Err(Exit::quiet(1))
        }
        other => Err(Exit::user(anyhow!(
            "`{}` {other}: {}\nhint: `agentstack logs {}` shows what the components printed",
            job.name,
            job.message.unwrap_or_default(),
            job.name
        ))),
    }
}

async fn print_changes(store: &Store, id: &str) {
    let mut seen: HashMap<(String, u32), String> = HashMap::new();
    let mut job_state = String::new();
    loop {
        if let Ok(Some(job)) = store.job(id).await
            && job.state.as_str() != job_state
        {
            job_state = job.state.as_str().to_owned();
            eprintln!("{}: {job_state}", job.name);
        }
        if let Ok(units) = store.units(id).await {
            for u in units {
                let line = format!(
                    "{}/{}: {} (attempt {}){}",
                    u.component,
                    u.replica,
                    u.state,
                    u.attempt,
                    u.message.map(|m| format!(": {m}")).unwrap_or_default()
                );
                let key = (u.component.clone(), u.replica);
                if seen.get(&key) != Some(&line) {
                    eprintln!("  {line}");
                    seen.insert(key, line);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
