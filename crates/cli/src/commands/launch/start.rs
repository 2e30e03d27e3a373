//! `agentstack launch FILE [--infra local|slurm|ray|k8s] [--detach] [--dry-run]`.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use agentstack_compute::backend::Backend;
use agentstack_compute::launch::{self as launch_plan, InfraKind, LaunchOptions};
use agentstack_compute::state::{JobState, Store};
use agentstack_compute::supervisor::{SuperviseError, create_launch_on};
use agentstack_compute::{BuildError, JobGroup};
use agentstack_static::env_vars;
use anyhow::anyhow;

use super::{
    env_pair, find, internal, jobs_dir, launch_exit, local_cpus, open_store, spawn_supervisor,
    supervise_here,
};
use crate::args::LaunchArgs;
use crate::{Exit, settings};

/// What `agentstack launch` runs with: its flags, environment variables and the job
/// group's file, resolved by the one precedence rule (see [`crate::settings`]).
pub struct LaunchSettings {
    /// The task or job-group YAML.
    pub file: PathBuf,
    /// The job group read from it, with `--env` applied and paths resolved.
    pub group: JobGroup,
    /// Where it runs, in order of preference: `--infra`, else the components'
    /// `resources.infra`, else local.
    pub infra: Vec<InfraKind>,
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
        let infra = launch_plan::choose_infra(&group, args.infra.map(InfraKind::from))
            .map_err(launch_exit)?;
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
            service_host: text(&None, env_vars::AGENTSTACK_SERVICE_HOST),
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
        return dry_run(&group, infra[0], &options);
    }

    // Every engine of the order that can be reached; one that cannot is passed over
    // (and the launch says why), unless none can.
    let mut backends = Vec::new();
    let mut unavailable = Vec::new();
    let mut first_error = None;
    for kind in &infra {
        match launch_plan::backend(*kind, &options) {
            Ok(b) => backends.push(b),
            Err(e) => {
                unavailable.push(format!(
                    "{kind}: {}",
                    e.to_string().lines().next().unwrap_or_default()
                ));
                first_error.get_or_insert(e);
            }
        }
    }
    if backends.is_empty() {
        return Err(launch_exit(first_error.expect("infra is never empty")));
    }
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
    let settings = launch_plan::supervisor_settings(backends[0].kind(), &options);
    let options_json = serde_json::to_value(&options).map_err(internal)?;
    let job = create_launch_on(
        &store,
        &backends,
        &unavailable,
        &group,
        &jobs_dir(),
        &options_json,
        &settings,
    )
    .await
    .map_err(|e| match e {
        SuperviseError::TooLarge { .. } => Exit::user(anyhow!(e)),
        SuperviseError::Backend(_) => {
            Exit::user(anyhow!(e).context(format!("{} on {}", file.display(), backends[0].kind())))
        }
        e => internal(e),
    })?;
    drop(backends);
    let units: usize = store.units(&job.id).await.map_err(internal)?.len();
    eprintln!(
        "launching `{}` on {}: {} component(s), {units} unit(s) (id {})",
        group.name,
        job.infra,
        group.components.len(),
        job.id
    );
    if let Some(placement) = &job.placement {
        for line in placement.lines() {
            eprintln!("  passed over {line}");
        }
    }
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

/// Prints what each engine would be given.
fn dry_run(group: &JobGroup, infra: InfraKind, options: &LaunchOptions) -> Result<(), Exit> {
    let plan = launch_plan::plan(group, infra, options).map_err(launch_exit)?;
    // Written in one go: a closed pipe (`| head`) is then one io error, which the CLI
    // takes for success.
    std::io::Write::write_all(&mut std::io::stdout(), plan.as_bytes()).map_err(internal)?;
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
