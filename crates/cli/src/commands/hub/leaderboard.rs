//! `agentstack hub leaderboard owner/name[@version]`. Text from the hub is printed
//! with control characters escaped, so a stored row cannot drive the terminal.

use agentstack_hub::api::escape_forbidden;

use crate::Exit;
use crate::args::HubRefArgs;
use crate::settings;

/// Prints a version's leaderboard, best first.
pub async fn run(args: HubRefArgs) -> Result<(), Exit> {
    let package = super::package_ref(&args.package)?;
    let client = settings::hub_client(args.client.hub.as_deref())?;
    let board = client
        .leaderboard(&package)
        .await
        .map_err(super::client_exit)?;
    if args.client.json {
        super::print_json(&board);
        return Ok(());
    }
    println!(
        "{}@{}",
        escape_forbidden(&board.package),
        escape_forbidden(&board.version)
    );
    if board.entries.is_empty() {
        println!("  no results yet (post one with `agentstack eval ... --post`)");
        return Ok(());
    }
    println!(
        "  {:>3}  {:<40} {:>7}  {:<17} {:>8}  {:<16} by",
        "#", "model", "score", "95% CI", "episodes", "harness"
    );
    for e in &board.entries {
        println!(
            "  {:>3}  {:<40} {:>7.3}  [{:.3}, {:.3}]   {:>8}  {:<16} {}",
            e.rank,
            escape_forbidden(&e.post.model),
            e.post.score,
            e.post.ci95[0],
            e.post.ci95[1],
            e.post.episodes,
            escape_forbidden(&e.post.harness),
            escape_forbidden(&e.user)
        );
    }
    Ok(())
}
