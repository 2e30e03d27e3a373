//! `agentstack hub pull owner/name[@version]`: into the checked local cache.

use crate::Exit;
use crate::args::HubRefArgs;
use crate::settings;

/// Pulls and prints the directory.
pub async fn run(args: HubRefArgs) -> Result<(), Exit> {
    let package = super::package_ref(&args.package)?;
    let client = settings::hub_client(args.client.hub.as_deref())?;
    let pulled = super::pull_with(&client, &package)
        .await
        .map_err(super::client_exit)?;
    if args.client.json {
        super::print_json(&serde_json::json!({
            "package": pulled.package,
            "version": pulled.version,
            "sha256": pulled.sha256,
            "dir": pulled.dir,
            "cached": pulled.cached,
        }));
    } else {
        eprintln!(
            "{}@{} {}",
            pulled.package,
            pulled.version,
            if pulled.cached {
                "(cached, verified)"
            } else {
                "(downloaded, verified)"
            }
        );
        println!("{}", pulled.dir.display());
    }
    Ok(())
}
