//! `agentstack env import`: a verifiers environment wrapped as an OpenEnv package.

use agentstack_env::import::{self, ImportRequest};
use anyhow::anyhow;
use serde_json::Value;

use crate::Exit;
use crate::args::ImportArgs;
use crate::settings;

/// Imports the environment and says what was written.
pub async fn run(args: ImportArgs) -> Result<(), Exit> {
    let mut request = ImportRequest::new(args.path);
    request.out = args.out;
    request.name = args.name;
    if let Some(text) = &args.args {
        request.args = match serde_json::from_str::<Value>(text) {
            Ok(Value::Object(map)) => map,
            _ => {
                return Err(Exit::user(anyhow!(
                    "--args must be a JSON object of load_environment's keyword arguments, got {text}\nhint: e.g. --args '{{\"num_examples\": 100}}'"
                )));
            }
        };
    }
    let python = settings::python(args.python.as_deref());
    let imported = import::import(&request, &python)
        .await
        .map_err(|e| Exit::user(e.into()))?;
    let probe = &imported.probe;
    let range = probe
        .reward_range()
        .map_or_else(|| "unknown".to_owned(), |[lo, hi]| format!("[{lo}, {hi}]"));
    println!("created {}", imported.dir.display());
    println!(
        "  {} ({}), {} {} examples, reward range {range}",
        probe.class, probe.kind, probe.examples, probe.split
    );
    println!(
        "  serve it: agentstack env serve {} --python {python}",
        imported.dir.display()
    );
    Ok(())
}
