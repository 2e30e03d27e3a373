//! `agentstack hub check`: does the registry's storage agree with itself?

use agentstack_hub::blobs::Blobs;
use agentstack_hub::db::Db;
use agentstack_hub::registry::Registry;
use anyhow::Context;

use crate::Exit;
use crate::args::HubCheckArgs;
use crate::settings;

/// Prints the report; exit 1 when it found a problem.
pub async fn run(args: HubCheckArgs) -> Result<(), Exit> {
    let db = Db::connect(&settings::hub_database(args.database.as_deref()))
        .await
        .context("opening the hub database")?;
    let blobs_dir = args
        .blobs
        .clone()
        .unwrap_or_else(|| settings::data_dir().join("blobs"));
    let blobs = Blobs::local(&blobs_dir).context("opening the blob store")?;
    let report = Registry::new(db, blobs).check().await.context("checking")?;
    if args.json {
        super::print_json(&report);
    } else {
        for (table, rows) in &report.rows {
            println!("{table:<12} {rows:>8} rows");
        }
        for (what, list) in [
            (
                "orphan blob (no version refers to it)",
                &report.orphan_blobs,
            ),
            (
                "missing blob (a version refers to it)",
                &report.missing_blobs,
            ),
            (
                "corrupt blob (its bytes do not match its hash)",
                &report.corrupt_blobs,
            ),
        ] {
            for sha in list {
                println!("{what}: {sha}");
            }
        }
        println!("{}", if report.ok() { "ok" } else { "PROBLEMS FOUND" });
    }
    if report.ok() {
        Ok(())
    } else {
        Err(Exit::quiet(1))
    }
}
