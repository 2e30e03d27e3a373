//! `agentstack cancel NAME`.

use std::time::Duration;

use anyhow::anyhow;

use super::{find, internal, open_store, supervise_here, supervisor_alive};
use crate::Exit;
use crate::args::JobNameArgs;

/// Longest wait for a running supervisor to stop a launch.
const CANCEL_WAIT: Duration = Duration::from_secs(300);

/// Runs `agentstack cancel`.
pub async fn run(args: JobNameArgs) -> Result<(), Exit> {
    let store = open_store().await?;
    let job = find(&store, &args.name).await?;
    if job.state.is_terminal() {
        eprintln!("`{}` already {}", job.name, job.state);
        return Ok(());
    }
    let end = cancel(&store, &job).await?;
    eprintln!("`{}` {end}", job.name);
    Ok(())
}

/// Asks the launch's supervisor to cancel and waits for the end; with no supervisor,
/// cancels here.
pub(crate) async fn cancel(
    store: &agentstack_compute::state::Store,
    job: &agentstack_compute::state::JobRecord,
) -> Result<agentstack_compute::state::JobState, Exit> {
    store.request_cancel(&job.id).await.map_err(internal)?;
    if !supervisor_alive(job) {
        let job = find(store, &job.id).await?;
        return supervise_here(store, &job).await;
    }
    eprintln!("stopping `{}`...", job.name);
    let start = std::time::Instant::now();
    loop {
        let now = find(store, &job.id).await?;
        if now.state.is_terminal() {
            return Ok(now.state);
        }
        if !supervisor_alive(&now) {
            // It died while stopping: finish here.
            return supervise_here(store, &now).await;
        }
        if start.elapsed() > CANCEL_WAIT {
            return Err(internal(anyhow!(
                "`{}` is still {} after {} s; its supervisor (pid {}) is stopping it",
                now.name,
                now.state,
                CANCEL_WAIT.as_secs(),
                now.supervisor_pid.unwrap_or_default()
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
