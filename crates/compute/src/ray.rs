//! A component as a Ray Jobs REST API submission: the body of `POST /api/jobs/`.
//!
//! One job per replica. The entrypoint is the [entrypoint] script
//! under `bash -c`; the environment goes in `runtime_env.env_vars`; the resources become
//! `entrypoint_num_cpus`, `entrypoint_num_gpus` and `entrypoint_memory`, so Ray places the
//! entrypoint on a node that has them. `POST /api/jobs/{id}/stop` sends SIGTERM to the
//! entrypoint's process group, which after the script's `exec` holds the program.
//!
//! A Ray job runs one entrypoint process, so multi-node components (`num_nodes > 1`)
//! are not built here: distributed work inside Ray uses Ray's own API.

use std::collections::BTreeMap;

use serde_json::{Map, Value, json};

use crate::entrypoint::{self, EntrypointOptions};
use crate::request::{self, BuildError, shell_quote};
use crate::spec::JobGroup;

/// Launch settings that are not part of the spec.
#[derive(Debug, Clone, Default)]
pub struct RayOptions<'a> {
    /// Names this launch of the group (from the launcher's state), so that submission
    /// ids of different launches never collide.
    pub launch_id: &'a str,
    /// Which start of the replica this is, from 0; restarts need new submission ids.
    pub attempt: u32,
    /// A `working_dir` URI the launcher uploaded the workdir to
    /// (`gcs://_ray_pkg_<hash>.zip`, via `PUT /api/packages/...`). Without one, the
    /// entrypoint `cd`s into the task's `workdir`, which must then be on the Ray nodes'
    /// file system (one host, or a shared file system).
    pub working_dir_uri: Option<&'a str>,
    /// The discovery file to wait for (see [`EntrypointOptions::discovery_file`]).
    pub discovery_file: Option<&'a str>,
    /// Seconds to wait for it.
    pub discovery_timeout_seconds: u64,
}

/// The submission body for replica `replica` of `component`, with its discovery
/// variables.
pub fn submit_request(
    group: &JobGroup,
    component: &str,
    replica: u32,
    discovery: &BTreeMap<String, String>,
    options: &RayOptions<'_>,
) -> Result<Value, BuildError> {
    let task = request::component(group, component)?;
    request::check_replica(task, replica)?;
    if task.num_nodes > 1 {
        return Err(BuildError::Unsupported {
            backend: "ray",
            component: task.name.clone(),
            what: format!("`num_nodes: {}`", task.num_nodes),
            hint: "a Ray job runs one entrypoint process: use `replicas` for independent copies, or start the distributed work with Ray's own API inside `run`".into(),
        });
    }
    let env = request::environment(task, discovery)?;
    let script = entrypoint::script(
        task,
        &EntrypointOptions {
            workdir: match options.working_dir_uri {
                Some(_) => None,
                None => task.workdir.as_deref(),
            },
            discovery_file: options.discovery_file,
            discovery_timeout_seconds: options.discovery_timeout_seconds,
            rank_from: None,
        },
    );
    let mut runtime_env = Map::new();
    runtime_env.insert("env_vars".into(), json!(env));
    if let Some(uri) = options.working_dir_uri {
        runtime_env.insert("working_dir".into(), json!(uri));
    }
    let name = request::instance_name(group, task, replica);
    let mut body = Map::new();
    body.insert(
        "entrypoint".into(),
        json!(format!("exec bash -c {}", shell_quote(&script))),
    );
    body.insert(
        "submission_id".into(),
        json!(format!("{name}-{}-{}", options.launch_id, options.attempt)),
    );
    body.insert("runtime_env".into(), Value::Object(runtime_env));
    let resources = &task.resources;
    if let Some(cpus) = resources.cpus {
        body.insert("entrypoint_num_cpus".into(), json!(cpus.count));
    }
    if let Some(acc) = &resources.accelerators {
        body.insert("entrypoint_num_gpus".into(), json!(acc.count));
    }
    if let Some(bytes) = resources.memory_bytes() {
        body.insert("entrypoint_memory".into(), json!(bytes));
    }
    body.insert(
        "metadata".into(),
        json!({
            "agentstack.group": group.name,
            "agentstack.component": task.name,
            "agentstack.replica": replica.to_string(),
            "agentstack.launch": options.launch_id,
            "agentstack.attempt": options.attempt.to_string(),
        }),
    );
    Ok(Value::Object(body))
}
