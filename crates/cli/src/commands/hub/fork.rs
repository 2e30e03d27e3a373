//! `agentstack hub fork owner/name[@version] [--name NEW]`.

use crate::Exit;
use crate::args::HubForkArgs;
use crate::settings;

/// Forks and prints the new package.
pub async fn run(args: HubForkArgs) -> Result<(), Exit> {
    let source = super::package_ref(&args.package)?;
    let client = settings::hub_client(args.client.hub.as_deref())?;
    let info = client
        .fork(&source, args.name.as_deref())
        .await
        .map_err(super::client_exit)?;
    if args.client.json {
        super::print_json(&info);
    } else {
        let parent = info
            .parent
            .as_ref()
            .map(|p| format!("{}@{}", p.package, p.version))
            .unwrap_or_default();
        println!("forked {parent} as {}/{}", info.owner, info.name);
    }
    Ok(())
}
