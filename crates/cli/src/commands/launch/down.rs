//! `agentstack down [NAME]`.

use super::cancel::cancel;
use super::{find, internal, open_store};
use crate::Exit;
use crate::args::JobDownArgs;

/// Runs `agentstack down`: cancels what runs, then forgets the launches and their
/// files.
pub async fn run(args: JobDownArgs) -> Result<(), Exit> {
    let store = open_store().await?;
    let jobs = match &args.name {
        Some(name) => vec![find(&store, name).await?],
        None => store.jobs().await.map_err(internal)?,
    };
    for job in jobs {
        if !job.state.is_terminal() {
            let end = cancel(&store, &job).await?;
            eprintln!("`{}` {end}", job.name);
        }
        store.delete_job(&job.id).await.map_err(internal)?;
        let _ = std::fs::remove_dir_all(&job.dir);
        eprintln!("removed `{}` ({})", job.name, job.id);
    }
    Ok(())
}
