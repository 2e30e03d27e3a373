//! `agentstack sandbox check`: can this machine isolate commands?

use agentstack_sandbox::{Job, Sandbox};
use anyhow::anyhow;

use crate::Exit;
use crate::args::SandboxCheckArgs;

/// Starts one sandbox and runs `true` in it.
pub async fn run(args: SandboxCheckArgs) -> Result<(), Exit> {
    let result = async {
        let sandbox = Sandbox::start(super::config(false, Vec::new())).await?;
        sandbox.run(&Job::new(["true"])).await
    }
    .await;
    match result {
        Ok(outcome) if outcome.end.success() => {
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({"isolation": "namespaces", "ok": true})
                );
            } else {
                println!(
                    "ok: sandboxes are isolated with user, mount, PID, network, IPC, UTS and cgroup namespaces"
                );
            }
            Ok(())
        }
        Ok(outcome) => Err(Exit::user(anyhow!(
            "a sandbox started but `true` {} (stderr: {})",
            outcome.end,
            outcome.stderr_text().trim()
        ))),
        Err(e) => {
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({"isolation": "namespaces", "ok": false, "error": e.to_string()})
                );
                return Err(Exit::quiet(1));
            }
            Err(Exit::user(anyhow!(e)))
        }
    }
}
