//! `agentstack hub login`: check a token against the hub and save both (the file is
//! readable by the user only).

use std::io::{BufRead, Write};

use agentstack_hub::auth::Token;
use agentstack_hub::client::HubClient;
use agentstack_static::env_vars;
use anyhow::{Context, anyhow};

use crate::args::HubLoginArgs;
use crate::{Exit, settings};

/// Saves the URL and token once the hub accepts the token.
pub async fn run(args: HubLoginArgs) -> Result<(), Exit> {
    let url = settings::hub_url(args.client.hub.as_deref());
    let secret = match args.token {
        Some(t) => t,
        None => match std::env::var(env_vars::AGENTSTACK_HUB_TOKEN) {
            Ok(t) if !t.is_empty() => t,
            _ => {
                eprintln!("paste the token (from `agentstack hub user create` or `hub token`):");
                let mut line = String::new();
                std::io::stdin()
                    .lock()
                    .read_line(&mut line)
                    .context("reading stdin")?;
                line
            }
        },
    };
    let token = Token::new(secret);
    if token.expose().is_empty() {
        return Err(Exit::user(anyhow!("no token given")));
    }
    let client = HubClient::new(&url, Some(token.clone())).map_err(super::client_exit)?;
    let user = client.whoami().await.map_err(super::client_exit)?;
    let path = settings::hub_credentials_path();
    let dir = path.parent().expect("the path has a parent");
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let body = serde_json::to_vec_pretty(&settings::HubCredentials {
        url: url.clone(),
        token: token.expose().to_owned(),
    })
    .expect("credentials serialize");
    write_private(&path, &body).with_context(|| format!("writing {}", path.display()))?;
    if args.client.json {
        super::print_json(&serde_json::json!({"url": url, "user": user}));
    } else {
        println!("logged in to {url} as {user}");
    }
    Ok(())
}

/// Writes `bytes` to `path` with mode 0600, atomically (temporary file + rename).
fn write_private(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("json.tmp");
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    std::fs::rename(&tmp, path)
}
