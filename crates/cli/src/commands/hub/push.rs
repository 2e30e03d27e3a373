//! `agentstack hub push [DIR]`: pack deterministically and push to your namespace.

use crate::Exit;
use crate::args::HubPushArgs;
use crate::settings;

/// Pushes and prints what was stored.
pub async fn run(args: HubPushArgs) -> Result<(), Exit> {
    let client = settings::hub_client(args.client.hub.as_deref())?;
    let owner = client.whoami().await.map_err(super::client_exit)?;
    let pushed = client
        .push_dir(
            &args.dir,
            &owner,
            args.name.as_deref(),
            args.version.as_deref(),
            args.private,
        )
        .await
        .map_err(super::client_exit)?;
    if args.client.json {
        super::print_json(&pushed);
    } else {
        println!(
            "pushed {}@{}{} ({} bytes, sha256 {}); validation: {}",
            pushed.package,
            pushed.version,
            if pushed.private { " (private)" } else { "" },
            pushed.size,
            pushed.sha256,
            pushed.validation
        );
    }
    Ok(())
}
