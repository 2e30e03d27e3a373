//! `agentstack eval compare`: a table of finished runs and a PNG chart.

use std::io::Write;
use std::path::PathBuf;

use agentstack_harness::compare;
use anyhow::anyhow;

use crate::Exit;
use crate::args::CompareArgs;

/// Runs the command.
pub fn run(args: CompareArgs) -> Result<(), Exit> {
    let runs_dir = super::runs_dir(args.runs_dir.clone());
    let mut dirs = Vec::with_capacity(args.runs.len());
    for run in &args.runs {
        let as_path = PathBuf::from(run);
        let dir = if as_path.join("summary.json").is_file() {
            as_path
        } else if runs_dir.join(run).join("summary.json").is_file() {
            runs_dir.join(run)
        } else {
            return Err(Exit::user(anyhow!(
                "{run} is not a finished run (no summary.json there or in {})\nhint: pass run directories, or ids under --runs-dir",
                runs_dir.display()
            )));
        };
        dirs.push(dir);
    }
    let runs = compare::load(&dirs).map_err(|e| anyhow!(e))?;
    compare::chart(&runs, &args.png).map_err(|e| anyhow!(e))?;
    let mut out = std::io::stdout().lock();
    let _ = write!(out, "{}", compare::table(&runs));
    let _ = writeln!(out, "chart: {}", args.png.display());
    Ok(())
}
