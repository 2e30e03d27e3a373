//! `agentstack status [NAME]`.

use std::fmt::Write as _;

use agentstack_compute::JobGroup;
use agentstack_compute::launch::LaunchOptions;
use agentstack_compute::state::{JobRecord, UnitRecord, UnitState};
use agentstack_compute::supervisor::DEFAULT_SERVICE_HOST;

use super::{ago, find, internal, open_store, revive};
use crate::Exit;
use crate::args::JobStatusArgs;

/// Runs `agentstack status`.
pub async fn run(args: JobStatusArgs) -> Result<(), Exit> {
    let store = open_store().await?;
    // Written in one go: a closed pipe (`| head`) is then one io error, which the CLI
    // takes for success.
    let mut out = String::new();
    let Some(name) = args.name else {
        let jobs = store.jobs().await.map_err(internal)?;
        if jobs.is_empty() {
            eprintln!("no launches\nhint: `agentstack launch FILE` starts one");
            return Ok(());
        }
        let _ = writeln!(
            out,
            "{:<24} {:<10} {:<10} {:>6}  {:<24} MESSAGE",
            "NAME", "INFRA", "STATE", "AGE", "ID"
        );
        for job in &jobs {
            revive(job)?;
            let _ = writeln!(
                out,
                "{:<24} {:<10} {:<10} {:>6}  {:<24} {}",
                job.name,
                job.infra,
                job.state,
                ago(job.created_ms),
                job.id,
                job.message.as_deref().unwrap_or("")
            );
        }
        return write_out(&out);
    };
    let job = find(&store, &name).await?;
    revive(&job)?;
    let units = store.units(&job.id).await.map_err(internal)?;
    let _ = writeln!(
        out,
        "{} ({}) on {}: {}{}",
        job.name,
        job.id,
        job.infra,
        job.state,
        job.message
            .as_deref()
            .map(|m| format!(": {m}"))
            .unwrap_or_default()
    );
    if let Some(placement) = &job.placement {
        // Where the launch could not be placed, and why, in the order it was tried.
        for line in placement.lines() {
            let _ = writeln!(out, "  passed over {line}");
        }
    }
    if job.recoveries > 0 {
        let _ = writeln!(out, "  group recoveries: {}", job.recoveries);
    }
    services(&mut out, &job, &units);
    let _ = writeln!(
        out,
        "{:<20} {:>7} {:<11} {:>7} {:>8}  {:<16} MESSAGE",
        "COMPONENT", "REPLICA", "STATE", "ATTEMPT", "RESTARTS", "HOSTS"
    );
    for u in &units {
        let _ = writeln!(
            out,
            "{:<20} {:>7} {:<11} {:>7} {:>8}  {:<16} {}",
            u.component,
            u.replica,
            u.state,
            u.attempt,
            u.restarts_on_errors,
            u.hosts.as_deref().unwrap_or("-"),
            u.message.as_deref().unwrap_or("")
        );
    }
    write_out(&out)
}

/// A line per `service` component: where its load balancer listens, and how many of
/// its replicas it sends requests to.
fn services(out: &mut String, job: &JobRecord, units: &[UnitRecord]) {
    let Ok(group) = JobGroup::parse(&job.spec) else {
        return;
    };
    let options: LaunchOptions = serde_json::from_str(&job.options).unwrap_or_default();
    let host = options
        .service_host
        .unwrap_or_else(|| DEFAULT_SERVICE_HOST.into());
    for task in &group.components {
        let Some(service) = &task.service else {
            continue;
        };
        let ready = units
            .iter()
            .filter(|u| {
                u.component == task.name && u.state == UnitState::Running && u.ready_ms.is_some()
            })
            .count();
        let _ = writeln!(
            out,
            "  service `{}`: http://{host}:{} → {ready} of {} replicas ready",
            task.name, service.ports, task.replicas
        );
    }
}

fn write_out(text: &str) -> Result<(), Exit> {
    std::io::Write::write_all(&mut std::io::stdout(), text.as_bytes()).map_err(internal)
}
