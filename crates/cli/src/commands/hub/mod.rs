//! `agentstack hub ...`: run a registry, and talk to one.

pub mod check;
pub mod fork;
pub mod info;
pub mod leaderboard;
pub mod login;
pub mod pull;
pub mod push;
pub mod search;
pub mod serve;
pub mod tag;
pub mod user;

use agentstack_hub::api::PackageRef;
use agentstack_hub::client::{ClientError, HubClient, Pulled};
use anyhow::anyhow;

use crate::Exit;

/// Parses a package reference, as a user error.
pub(crate) fn package_ref(text: &str) -> Result<PackageRef, Exit> {
    PackageRef::parse(text).map_err(|e| Exit::user(anyhow!(e)))
}

/// A client error as an exit: what the hub refused is the user's to fix (1); an
/// unreachable hub or a corrupt download is not (2).
pub(crate) fn client_exit(e: ClientError) -> Exit {
    if is_users(&e) {
        Exit::user(e.into())
    } else {
        Exit::internal(e)
    }
}

/// Whether the hub client's error is the user's to fix: what the hub refused, a bad
/// reference or package.
pub(crate) fn is_users(e: &ClientError) -> bool {
    match e {
        ClientError::Api { status, .. } => *status < 500,
        ClientError::Invalid(_) | ClientError::Package(_) => true,
        _ => false,
    }
}

/// Prints `value` as pretty JSON.
pub(crate) fn print_json<T: serde::Serialize>(value: &T) {
    println!(
        "{}",
        serde_json::to_string_pretty(value).expect("API types serialize")
    );
}

/// Pulls `package` through `client` into its hub's local cache (checked; a cached copy
/// of a fixed version is re-verified instead of downloaded).
pub(crate) async fn pull_with(
    client: &HubClient,
    package: &PackageRef,
) -> Result<Pulled, ClientError> {
    let cache = crate::settings::hub_cache_dir(client.url());
    let pulled = client.pull(package, &cache).await?;
    tracing::info!(package = %pulled.package, version = %pulled.version, dir = %pulled.dir.display(), cached = pulled.cached, "pulled from the hub");
    Ok(pulled)
}

/// A `hub:owner/name[@version]` target, pulled; `None` for any other target.
pub(crate) async fn pull_hub_target(target: &str) -> anyhow::Result<Option<Pulled>> {
    if !target.starts_with("hub:") {
        return Ok(None);
    }
    let package = PackageRef::parse(target).map_err(|e| crate::user_error!("{e}"))?;
    Ok(Some(pull_package(&package).await?))
}

/// Pulls `package` from the hub the settings name.
pub(crate) async fn pull_package(package: &PackageRef) -> anyhow::Result<Pulled> {
    let client = crate::settings::hub_client(None)?;
    Ok(pull_with(&client, package).await?)
}

/// `hub:owner/name[@version]` → the directory of the pulled (checked, cached)
/// package; any other target is returned as it is.
pub(crate) async fn pull_target(target: &str) -> anyhow::Result<String> {
    Ok(match pull_hub_target(target).await? {
        Some(pulled) => pulled.dir.to_string_lossy().into_owned(),
        None => target.to_owned(),
    })
}
