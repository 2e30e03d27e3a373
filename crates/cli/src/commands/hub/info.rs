//! `agentstack hub info owner/name`.

use agentstack_hub::api::escape_forbidden;

use crate::Exit;
use crate::args::HubRefArgs;
use crate::settings;

/// Prints a package's versions, tags, validation and lineage.
pub async fn run(args: HubRefArgs) -> Result<(), Exit> {
    let package = super::package_ref(&args.package)?;
    let client = settings::hub_client(args.client.hub.as_deref())?;
    let info = client
        .info(&package.owner, &package.name)
        .await
        .map_err(super::client_exit)?;
    if args.client.json {
        super::print_json(&info);
        return Ok(());
    }
    println!(
        "{}/{}{}",
        info.owner,
        info.name,
        if info.private { " (private)" } else { "" }
    );
    if !info.description.is_empty() {
        // Free text from the package: escaped, so it cannot drive the terminal.
        println!("  {}", escape_forbidden(&info.description));
    }
    if let Some(p) = &info.parent {
        println!("  forked from {}@{}", p.package, p.version);
    }
    if !info.forks.is_empty() {
        println!("  forks: {}", info.forks.join(", "));
    }
    println!("  downloads: {}", info.downloads);
    for v in &info.versions {
        let tags = if v.tags.is_empty() {
            String::new()
        } else {
            format!(" [{}]", v.tags.join(", "))
        };
        println!(
            "  {}{tags}  {} bytes, {} files, validation {}  sha256 {}",
            v.version, v.size, v.files, v.validation.status, v.sha256
        );
        for c in &v.validation.checks {
            println!(
                "      {}: {} — {}",
                c.name,
                c.status,
                escape_forbidden(&c.message)
            );
        }
    }
    Ok(())
}
