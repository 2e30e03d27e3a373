//! A component as an `sbatch` script.
//!
//! One script per component (one per replica for replicated components, so each
//! restarts on its own). It asks for the resources with `#SBATCH` lines, exports the
//! environment, learns the nodes' addresses from Slurm at run time, and runs the
//! [entrypoint] as one `srun` step with a task per node. Stopping
//! gracefully (checked on Slurm 22.05):
//!
//! - `scancel --signal=TERM JOBID` signals the step, so the program (the entrypoint
//!   `exec`s it);
//! - `scancel --signal=TERM --batch JOBID` and `#SBATCH --signal=B:TERM@60` signal only
//!   the batch shell, which passes the signal on to the step with `scancel`. (It cannot
//!   simply `exec srun`: `srun` answers SIGTERM by killing the step.)
//! - plain `scancel` and the time limit send SIGTERM to everything, then SIGKILL after
//!   the cluster's `KillWait`: the program has that long to checkpoint (and may see the
//!   signal twice, directly and passed on).
//!
//! Jobs are submitted `--no-requeue`: recovery is the launcher's, by the component's
//! `job_recovery`, as in SkyPilot.

use std::collections::BTreeMap;

use crate::discovery::{SKYPILOT_NODE_IPS, SKYPILOT_NODE_RANK};
use crate::entrypoint::{self, EntrypointOptions};
use crate::request::{self, BuildError, shell_quote};
use crate::spec::{Infra, JobGroup, MemoryAmount};

/// Signals sent to the batch shell alone go on to the step (the shell is not the
/// program, and `srun` would answer SIGTERM by killing the step).
const FORWARD_SIGNALS: &str = r#"forward() { scancel --signal="$1" "$SLURM_JOB_ID"; }
for signal in TERM INT HUP USR1 USR2; do trap "forward $signal" "$signal"; done
"#;

/// Waits for `srun` through trapped signals (a trap ends `wait` early) and exits with
/// its status.
const WAIT_FOR_STEP: &str = r#"step=$!
while :; do
  wait "$step"
  status=$?
  kill -0 "$step" 2>/dev/null || break
done
exit "$status"
"#;

/// Launch settings that are not part of the spec.
#[derive(Debug, Clone, Default)]
pub struct SlurmOptions<'a> {
    /// `--time` in minutes; the partition's default when `None`.
    pub time_limit_minutes: Option<u32>,
    /// Where the job's output goes: `<dir>/<job-name>-<job-id>.log`; Slurm's
    /// `slurm-<job-id>.out` in the submit directory when `None`.
    pub log_dir: Option<&'a str>,
    /// The discovery file the launcher writes once every component runs (see
    /// [`EntrypointOptions::discovery_file`]); needed when components are separate
    /// allocations, since no address is known before Slurm places them.
    pub discovery_file: Option<&'a str>,
    /// Seconds to wait for it.
    pub discovery_timeout_seconds: u64,
    /// More `#SBATCH` options, as SkyPilot's `slurm.sbatch_options` (`--account=ml`).
    pub extra_options: &'a [&'a str],
}

/// The `sbatch` script for replica `replica` of `component`; `discovery` holds its
/// discovery variables (see [`crate::discovery::environment`]), of which the node rank
/// and node addresses are replaced by what Slurm says at run time.
pub fn batch_script(
    group: &JobGroup,
    component: &str,
    replica: u32,
    discovery: &BTreeMap<String, String>,
    options: &SlurmOptions<'_>,
) -> Result<String, BuildError> {
    let task = request::component(group, component)?;
    request::check_replica(task, replica)?;
    let mut env = request::environment(task, discovery)?;
    env.remove(SKYPILOT_NODE_RANK);
    env.remove(SKYPILOT_NODE_IPS);
    let name = request::instance_name(group, task, replica);
    let nodes = task.num_nodes;
    let resources = &task.resources;

    let mut s = String::from("#!/bin/bash\n");
    let mut sbatch = |option: String| {
        s.push_str("#SBATCH ");
        s.push_str(&option);
        s.push('\n');
    };
    sbatch(format!("--job-name={name}"));
    sbatch(format!("--nodes={nodes}"));
    sbatch("--ntasks-per-node=1".into());
    if let Some(cpus) = resources.cpus {
        sbatch(format!("--cpus-per-task={}", cpus.whole()));
    }
    match resources.memory.map(|m| m.amount) {
        Some(MemoryAmount::PerCpu(ratio)) => {
            sbatch(format!("--mem-per-cpu={}M", (ratio * 1024.0).ceil() as u64));
        }
        Some(MemoryAmount::Bytes(bytes)) => {
            sbatch(format!("--mem={}M", bytes.div_ceil(1 << 20)));
        }
        None => {}
    }
    if let Some(acc) = &resources.accelerators {
        sbatch(format!("--gres=gpu:{}:{}", acc.name, acc.count));
    }
    if let Some(Infra::Slurm {
        partition: Some(partition),
        ..
    }) = resources
        .infra
        .iter()
        .find(|i| matches!(i, Infra::Slurm { .. }))
    {
        sbatch(format!("--partition={partition}"));
    }
    if let Some(minutes) = options.time_limit_minutes {
        sbatch(format!("--time={minutes}"));
    }
    if let Some(dir) = options.log_dir {
        sbatch(format!(
            "--output={}/{name}-%j.log",
            dir.trim_end_matches('/')
        ));
    }
    sbatch("--no-requeue".into());
    if nodes > 1 {
        sbatch("--wait-all-nodes=1".into());
    }
    for option in options.extra_options {
        sbatch((*option).to_owned());
    }

    s.push_str(&format!(
        "\n# agentstack: component `{}` of job group `{}`.\n",
        task.name, group.name
    ));
    s.push_str(
        "# Stop it gracefully with `scancel --signal=TERM JOBID` (with or without --batch).\n\n",
    );
    for (key, value) in &env {
        s.push_str(&format!("export {key}={}\n", shell_quote(value)));
    }
    // Slurm knows the nodes only once it has placed the job: ask it for their addresses
    // (NodeAddr, which may differ from the node name, as on a one-host test cluster).
    s.push_str(&format!(
        "{SKYPILOT_NODE_IPS}=\"$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | while read -r node; do\n  scontrol show node -o \"$node\" | sed -n 's/.* NodeAddr=\\([^ ]*\\).*/\\1/p'\ndone)\"\nexport {SKYPILOT_NODE_IPS}\n\n"
    ));

    let script = entrypoint::script(
        task,
        &EntrypointOptions {
            workdir: task.workdir.as_deref(),
            discovery_file: options.discovery_file,
            discovery_timeout_seconds: options.discovery_timeout_seconds,
            rank_from: Some("SLURM_NODEID"),
        },
    );
    let mut delimiter = String::from("AGENTSTACK_ENTRYPOINT");
    while script.lines().any(|l| l == delimiter) {
        delimiter.push('_');
    }
    if let Some(file) = options.discovery_file {
        s.push_str(&format!(
            "# Peer addresses also come from this file, which the launcher writes once every\n# component runs; the entrypoint waits for it, and its values win:\n#   {file}\n"
        ));
    }
    s.push_str(&format!(
        "IFS= read -r -d '' entrypoint <<'{delimiter}' || true\n{script}{delimiter}\n"
    ));
    // srun no longer takes --cpus-per-task from the allocation (Slurm 22.05), so say it again.
    let cpus = resources
        .cpus
        .map(|c| format!(" --cpus-per-task={}", c.whole()))
        .unwrap_or_default();
    s.push_str(FORWARD_SIGNALS);
    s.push_str(&format!(
        "srun --nodes={nodes} --ntasks={nodes} --ntasks-per-node=1{cpus} --kill-on-bad-exit=1 bash -c \"$entrypoint\" &\n"
    ));
    s.push_str(WAIT_FOR_STEP);
    Ok(s)
}
