//! `agentstack model pull`: fetch a model into the cache and print its path.

use crate::Exit;
use crate::args::PullArgs;

/// Runs the command.
pub async fn run(args: PullArgs) -> Result<(), Exit> {
    let path = super::resolve(&args.model).await?;
    println!("{}", path.display());
    Ok(())
}
