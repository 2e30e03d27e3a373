//! `agentstack hub search [WORDS...] [--sort relevance|downloads|score]`.

use agentstack_hub::api::{SearchQuery, SearchSort, escape_forbidden};

use crate::Exit;
use crate::args::{HubSearchArgs, HubSort};
use crate::settings;

/// Searches and prints a table.
pub async fn run(args: HubSearchArgs) -> Result<(), Exit> {
    let client = settings::hub_client(args.client.hub.as_deref())?;
    let query = SearchQuery {
        q: args.query.join(" "),
        sort: match args.sort {
            HubSort::Relevance => SearchSort::Relevance,
            HubSort::Downloads => SearchSort::Downloads,
            HubSort::Score => SearchSort::Score,
        },
        limit: Some(args.limit),
        offset: None,
    };
    let hits = client.search(&query).await.map_err(super::client_exit)?;
    if args.client.json {
        super::print_json(&hits);
        return Ok(());
    }
    if hits.is_empty() {
        println!("no environments found");
        return Ok(());
    }
    println!(
        "{:<32} {:<10} {:>9} {:>6}  description",
        "package", "latest", "downloads", "best"
    );
    for h in hits {
        println!(
            "{:<32} {:<10} {:>9} {:>6}  {}",
            format!("{}/{}", h.owner, h.name),
            h.latest.unwrap_or_default(),
            h.downloads,
            h.best_score.map(|s| format!("{s:.3}")).unwrap_or_default(),
            escape_forbidden(&h.description)
        );
    }
    Ok(())
}
