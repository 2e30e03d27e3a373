//! `agentstack status [NAME]`.

use super::{ago, find, internal, open_store, revive};
use crate::Exit;
use crate::args::JobStatusArgs;

/// Runs `agentstack status`.
pub async fn run(args: JobStatusArgs) -> Result<(), Exit> {
    let store = open_store().await?;
    let Some(name) = args.name else {
        let jobs = store.jobs().await.map_err(internal)?;
        if jobs.is_empty() {
            eprintln!("no launches\nhint: `agentstack launch FILE` starts one");
            return Ok(());
        }
        println!(
            "{:<24} {:<10} {:<10} {:>6}  {:<24} MESSAGE",
            "NAME", "INFRA", "STATE", "AGE", "ID"
        );
        for job in &jobs {
            revive(job)?;
            println!(
                "{:<24} {:<10} {:<10} {:>6}  {:<24} {}",
                job.name,
                job.infra,
                job.state,
                ago(job.created_ms),
                job.id,
                job.message.as_deref().unwrap_or("")
            );
        }
        return Ok(());
    };
    let job = find(&store, &name).await?;
    revive(&job)?;
    println!(
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
            println!("  passed over {line}");
        }
    }
    if job.recoveries > 0 {
        println!("  group recoveries: {}", job.recoveries);
    }
    println!(
        "{:<20} {:>7} {:<11} {:>7} {:>8}  {:<16} MESSAGE",
        "COMPONENT", "REPLICA", "STATE", "ATTEMPT", "RESTARTS", "HOSTS"
    );
    for u in store.units(&job.id).await.map_err(internal)? {
        println!(
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
    Ok(())
}
