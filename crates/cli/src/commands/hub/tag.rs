//! `agentstack hub tag owner/name@version TAG`.

use anyhow::anyhow;

use crate::Exit;
use crate::args::HubTagArgs;
use crate::settings;

/// Points the tag at the version.
pub async fn run(args: HubTagArgs) -> Result<(), Exit> {
    let package = super::package_ref(&args.package)?;
    let Some(version) = &package.reference else {
        return Err(Exit::user(anyhow!(
            "name the version to tag: {}/{}@1.0.0",
            package.owner,
            package.name
        )));
    };
    let client = settings::hub_client(args.client.hub.as_deref())?;
    client
        .set_tag(&package.owner, &package.name, &args.tag, version)
        .await
        .map_err(super::client_exit)?;
    if args.client.json {
        super::print_json(&serde_json::json!({"tag": args.tag, "version": version}));
    } else {
        println!(
            "{}/{}:{} → {version}",
            package.owner, package.name, args.tag
        );
    }
    Ok(())
}
