//! `agentstack env init`: a new environment that serves and validates out of the box.

use crate::Exit;
use crate::args::InitArgs;

/// Writes the new environment.
pub fn run(args: InitArgs) -> Result<(), Exit> {
    let dir = agentstack_env::scaffold::create(
        &args.name,
        matches!(args.lang, crate::args::Lang::Python),
        &args.output_dir,
    )
    .map_err(|e| Exit::user(e.into()))?;
    println!("created {}", dir.display());
    Ok(())
}
