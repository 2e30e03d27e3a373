//! `agentstack logs NAME[/COMPONENT[/REPLICA]] [--follow]`.

use std::io::{Read, Seek, SeekFrom, Write};
use std::time::Duration;

use agentstack_compute::backend::{Backend, LogSource};
use agentstack_compute::launch::InfraKind;
use agentstack_compute::state::UnitRecord;
use anyhow::anyhow;

use super::{backends_of, find, internal, open_store, revive};
use crate::Exit;
use crate::args::JobLogsArgs;

/// Time between looks for new output with `--follow`.
const FOLLOW_INTERVAL: Duration = Duration::from_millis(250);

/// Runs `agentstack logs`.
pub async fn run(args: JobLogsArgs) -> Result<(), Exit> {
    let mut parts = args.name.splitn(3, '/');
    let name = parts.next().unwrap_or_default();
    let component = parts.next();
    let replica = match parts.next() {
        Some(r) => Some(r.parse::<u32>().map_err(|_| {
            Exit::user(anyhow!(
                "`{r}` is not a replica number\nhint: NAME/COMPONENT/REPLICA, e.g. rl/env-server/1"
            ))
        })?),
        None => None,
    };
    let store = open_store().await?;
    let job = find(&store, name).await?;
    revive(&job)?;
    let (backends, _) = backends_of(&job)?;
    let backend = backends
        .into_iter()
        .next()
        .expect("the current engine's backend");
    let all = store.units(&job.id).await.map_err(internal)?;
    let units: Vec<UnitRecord> = all
        .iter()
        .filter(|u| component.is_none_or(|c| u.component == c))
        .filter(|u| replica.is_none_or(|r| u.replica == r))
        .cloned()
        .collect();
    if units.is_empty() {
        let known: Vec<String> = all
            .iter()
            .map(|u| format!("{}/{}", u.component, u.replica))
            .collect();
        return Err(Exit::user(anyhow!(
            "`{}` has no such component or replica\nhint: its units are {}",
            args.name,
            known.join(", ")
        )));
    }
    let prefix = units.len() > 1;
    // What was printed of each unit: (handle, bytes).
    let mut printed: Vec<(Option<String>, u64)> = vec![(None, 0); units.len()];
    let mut stdout = std::io::stdout().lock();
    loop {
        let now = store.units(&job.id).await.map_err(internal)?;
        for (i, u) in units.iter().enumerate() {
            let Some(current) = now.iter().find(|n| *n == u) else {
                continue;
            };
            let Some(handle) = &current.handle else {
                continue;
            };
            if printed[i].0.as_deref() != Some(handle) {
                // A new attempt: a local unit keeps one log file; elsewhere each attempt
                // has its own.
                let same_file = job.infra == InfraKind::Local;
                printed[i] = (
                    Some(handle.clone()),
                    if same_file { printed[i].1 } else { 0 },
                );
            }
            let text = match backend.logs(handle).await {
                Ok(LogSource::File(path)) => read_from(&path, printed[i].1),
                Ok(LogSource::Text(text)) => text
                    .get(printed[i].1 as usize..)
                    .unwrap_or_default()
                    .to_owned(),
                Err(e) => {
                    tracing::debug!(error = %e, "no logs yet");
                    String::new()
                }
            };
            if text.is_empty() {
                continue;
            }
            printed[i].1 += text.len() as u64;
            let label = format!("[{}/{}] ", u.component, u.replica);
            let out = if prefix {
                text.split_inclusive('\n')
                    .map(|l| format!("{label}{l}"))
                    .collect()
            } else {
                text
            };
            stdout.write_all(out.as_bytes()).map_err(internal)?;
        }
        stdout.flush().map_err(internal)?;
        if !args.follow || find(&store, &job.id).await?.state.is_terminal() {
            return Ok(());
        }
        tokio::time::sleep(FOLLOW_INTERVAL).await;
    }
}

/// The file from byte `offset` on (whole lines only, so lines are not split between
/// looks).
fn read_from(path: &std::path::Path, offset: u64) -> String {
    let Ok(mut file) = std::fs::File::open(path) else {
        return String::new();
    };
    let mut bytes = Vec::new();
    if file.seek(SeekFrom::Start(offset)).is_err() || file.read_to_end(&mut bytes).is_err() {
        return String::new();
    }
    let end = bytes.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}
