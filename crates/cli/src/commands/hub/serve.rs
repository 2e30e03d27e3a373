//! `agentstack hub serve`: the registry, on SQLite (default) or PostgreSQL, with blobs
//! on local disk; pushed packages are validated in the sandbox.

use std::net::SocketAddr;
use std::sync::Arc;

use agentstack_hub::blobs::Blobs;
use agentstack_hub::db::Db;
use agentstack_hub::registry::{Limits, Registry};
use agentstack_hub::validate::{Conformance, Validators};
use agentstack_sandbox::{Sandbox, SandboxConfig};
use anyhow::Context;

use crate::Exit;
use crate::args::HubServeArgs;
use crate::settings;

/// The sandbox validation runs in, or why there is none.
async fn conformance(args: &HubServeArgs) -> Conformance {
    let config = SandboxConfig {
        warm: 0,
        max_concurrent: 1,
        max_queued: 64,
        read_only: args.validate_read_only.clone(),
        expose_program: true,
        ..SandboxConfig::default()
    };
    match Sandbox::start(config).await {
        Ok(sandbox) => {
            let mut c = Conformance::new(Arc::new(sandbox));
            c.env
                .push(("AGENTSTACK_PYTHON".into(), args.validate_python.clone()));
            c
        }
        Err(e) => {
            tracing::warn!(error = %e, "this machine cannot isolate: pushed packages will not be started");
            Conformance::unavailable(format!("this hub cannot isolate package code ({e})"))
        }
    }
}

/// Serves until Ctrl-C or SIGTERM.
pub async fn run(args: HubServeArgs) -> Result<(), Exit> {
    let database = settings::hub_database(args.database.as_deref());
    let blobs_dir = args
        .blobs
        .clone()
        .unwrap_or_else(|| settings::data_dir().join("blobs"));
    std::fs::create_dir_all(settings::data_dir())
        .with_context(|| format!("creating {}", settings::data_dir().display()))?;
    let db = Db::connect(&database)
        .await
        .with_context(|| format!("opening the hub database {}", redact_url(&database)))?;
    let blobs = Blobs::local(&blobs_dir).context("opening the blob store")?;
    let mut validators = Validators::default().with_concurrency(1);
    if !args.no_conformance {
        validators.push(Arc::new(conformance(&args).await));
    }
    let limits = Limits {
        max_package_bytes: args.max_package_mib << 20,
        ..Limits::default()
    };
    let registry = Registry::with(db, blobs, limits, validators);
    let listener = tokio::net::TcpListener::bind(SocketAddr::new(args.host, args.port))
        .await
        .with_context(|| format!("listening on {}:{}", args.host, args.port))?;
    let address = listener.local_addr().context("local address")?;
    println!("agentstack hub at http://{address}");
    tracing::info!(database = %redact_url(&database), blobs = %blobs_dir.display(), "hub serving");
    agentstack_hub::server::serve(
        listener,
        Arc::new(registry),
        crate::commands::env::serve::shutdown_signal(),
    )
    .await
    .context("serving")?;
    Ok(())
}

/// A database URL without its password, for logs and errors.
fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            match userinfo.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..scheme + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn database_passwords_never_reach_logs() {
        assert_eq!(
            super::redact_url("postgres://hub:s3cret@127.0.0.1/hub"),
            "postgres://hub:***@127.0.0.1/hub"
        );
        assert_eq!(
            super::redact_url("sqlite:///x/hub.db"),
            "sqlite:///x/hub.db"
        );
    }
}
