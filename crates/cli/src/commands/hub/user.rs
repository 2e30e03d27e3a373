//! `agentstack hub user create` and `hub token create|list|revoke`. Creating runs on
//! the hub's machine, against its database; a token is printed once and only its
//! hash is stored. Listing and revoking work either way: with `--user` against the
//! database (the operator, any user's tokens), else through the hub with your token
//! (your own tokens only).

use agentstack_hub::api::{self, TokenInfo};
use agentstack_hub::auth::{self, Token};
use agentstack_hub::db::{Db, DbError, User};
use anyhow::{Context, anyhow};

use crate::Exit;
use crate::args::{
    HubTokenAction, HubTokenArgs, HubTokenCreateArgs, HubTokenListArgs, HubTokenRevokeArgs,
    HubUserCreateArgs,
};
use crate::settings;

async fn open(flag: Option<&str>) -> anyhow::Result<Db> {
    std::fs::create_dir_all(settings::data_dir()).ok();
    let url = settings::hub_database(flag);
    Db::connect(&url).await.context("opening the hub database")
}

/// `hub user create NAME`.
pub async fn create(args: HubUserCreateArgs) -> Result<(), Exit> {
    api::check_name("user", &args.name).map_err(|e| Exit::user(anyhow!(e)))?;
    let db = open(args.database.as_deref()).await?;
    let user = match db.create_user(&args.name).await {
        Ok(user) => user,
        Err(DbError::Conflict) => {
            return Err(Exit::user(anyhow!(
                "user '{}' exists\nhint: make another token with `agentstack hub token --user {}`",
                args.name,
                args.name
            )));
        }
        Err(e) => return Err(anyhow::Error::from(e).context("creating the user").into()),
    };
    let token = Token::generate();
    db.add_token(user.id, &token.hash(), "first", None)
        .await
        .context("storing the token")?;
    eprintln!(
        "created user {} (the token is shown once; keep it secret):",
        user.name
    );
    println!("{}", token.expose());
    Ok(())
}

/// `hub token ...`.
pub async fn token(args: HubTokenArgs) -> Result<(), Exit> {
    match args.action {
        None => match args.create {
            Some(create) => create_token(create).await,
            None => Err(Exit::user(anyhow!(
                "`hub token` needs --user NAME (to create a token) or a subcommand: create, list, revoke"
            ))),
        },
        Some(HubTokenAction::Create(create)) => create_token(create).await,
        Some(HubTokenAction::List(list)) => list_tokens(list).await,
        Some(HubTokenAction::Revoke(revoke)) => revoke_tokens(revoke).await,
    }
}

/// The user called `name` in the database, as a user error when there is none.
async fn existing_user(db: &Db, name: &str) -> Result<User, Exit> {
    db.user(name)
        .await
        .context("looking up the user")?
        .ok_or_else(|| {
            Exit::user(anyhow!(
                "no user '{name}'\nhint: create one with `agentstack hub user create {name}`"
            ))
        })
}

/// `hub token [create] --user NAME [--expires-in 30d]`.
async fn create_token(args: HubTokenCreateArgs) -> Result<(), Exit> {
    let expires_at = match &args.expires_in {
        Some(text) => {
            let lifetime =
                auth::parse_lifetime(text).map_err(|e| Exit::user(anyhow!("--expires-in: {e}")))?;
            Some(agentstack_hub::db::now() + lifetime.as_secs() as i64)
        }
        None => None,
    };
    let db = open(args.database.as_deref()).await?;
    let user = existing_user(&db, &args.user).await?;
    let token = Token::generate();
    let id = db
        .add_token(user.id, &token.hash(), &args.label, expires_at)
        .await
        .context("storing the token")?;
    let until = expires_at.map_or("never expires".to_owned(), |at| {
        format!("expires at {}", time(at))
    });
    eprintln!(
        "token {id} of {} ({until}; shown once, keep it secret):",
        user.name
    );
    println!("{}", token.expose());
    Ok(())
}

/// `hub token list [--user NAME]`.
async fn list_tokens(args: HubTokenListArgs) -> Result<(), Exit> {
    let list = match &args.user {
        Some(name) => {
            let db = open(args.database.as_deref()).await?;
            let user = existing_user(&db, name).await?;
            let rows = db.tokens(user.id).await.context("listing tokens")?;
            api::TokenList {
                user: user.name,
                tokens: rows
                    .into_iter()
                    .map(|t| TokenInfo {
                        id: t.id,
                        label: t.label,
                        created_at: t.created_at,
                        expires_at: t.expires_at,
                        revoked_at: t.revoked_at,
                        current: false,
                    })
                    .collect(),
            }
        }
        None => {
            let client = settings::hub_client(args.client.hub.as_deref())?;
            client.tokens().await.map_err(super::client_exit)?
        }
    };
    if args.client.json {
        super::print_json(&list);
        return Ok(());
    }
    println!("tokens of {}", list.user);
    println!(
        "  {:>5}  {:<16} {:<20} {:<28}",
        "id", "label", "created", "state"
    );
    let now = agentstack_hub::db::now();
    for t in &list.tokens {
        let state = match (t.revoked_at, t.expires_at) {
            (Some(at), _) => format!("revoked {}", time(at)),
            (None, Some(at)) if at <= now => format!("expired {}", time(at)),
            (None, Some(at)) => format!("expires {}", time(at)),
            (None, None) => "never expires".to_owned(),
        };
        println!(
            "  {:>5}  {:<16} {:<20} {}{}",
            t.id,
            api::escape_forbidden(&t.label),
            time(t.created_at),
            state,
            if t.current { "  (this one)" } else { "" }
        );
    }
    Ok(())
}

/// `hub token revoke ID | --current | --user NAME (ID | --all)`.
async fn revoke_tokens(args: HubTokenRevokeArgs) -> Result<(), Exit> {
    let (user, revoked) = match &args.user {
        Some(name) => {
            let db = open(args.database.as_deref()).await?;
            let user = existing_user(&db, name).await?;
            let id = if args.all { None } else { args.id };
            let n = db
                .revoke_tokens(user.id, id)
                .await
                .context("revoking tokens")?;
            if n == 0 && id.is_some() {
                return Err(Exit::user(anyhow!(
                    "{name} has no live token {}\nhint: `agentstack hub token list --user {name}` shows them",
                    args.id.unwrap_or_default()
                )));
            }
            (user.name, n)
        }
        None => {
            let client = settings::hub_client(args.client.hub.as_deref())?;
            let who = client.whoami().await.map_err(super::client_exit)?;
            let id = if args.current { None } else { args.id };
            client.revoke_token(id).await.map_err(super::client_exit)?;
            (who, 1)
        }
    };
    if args.client.json {
        super::print_json(&serde_json::json!({"user": user, "revoked": revoked}));
    } else {
        println!("revoked {revoked} token(s) of {user}");
    }
    Ok(())
}

/// Unix seconds as `YYYY-MM-DD HH:MM UTC` (times before 1970 print as 1970).
fn time(unix: i64) -> String {
    let at = std::time::UNIX_EPOCH + std::time::Duration::from_secs(unix.max(0).unsigned_abs());
    // RFC 3339, e.g. 2024-03-01T00:00:00Z: the date, then the hour and minute.
    let rfc3339 = humantime::format_rfc3339_seconds(at).to_string();
    format!("{} {} UTC", &rfc3339[..10], &rfc3339[11..16])
}

#[cfg(test)]
mod tests {
    #[test]
    fn times_print_as_utc_dates() {
        assert_eq!(super::time(0), "1970-01-01 00:00 UTC");
        assert_eq!(super::time(1_709_251_200), "2024-03-01 00:00 UTC");
        assert_eq!(super::time(951_782_400 + 3_661), "2000-02-29 01:01 UTC");
    }
}
