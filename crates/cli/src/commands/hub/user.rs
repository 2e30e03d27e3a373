//! `agentstack hub user create` and `hub token`: run on the hub's machine, against its
//! database. A token is printed once; only its hash is stored.

use agentstack_hub::api;
use agentstack_hub::auth::Token;
use agentstack_hub::db::{Db, DbError};
use anyhow::{Context, anyhow};

use crate::Exit;
use crate::args::{HubTokenArgs, HubUserCreateArgs};
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
    db.add_token(user.id, &token.hash(), "first")
        .await
        .context("storing the token")?;
    eprintln!(
        "created user {} (the token is shown once; keep it secret):",
        user.name
    );
    println!("{}", token.expose());
    Ok(())
}

/// `hub token --user NAME`.
pub async fn token(args: HubTokenArgs) -> Result<(), Exit> {
    let db = open(args.database.as_deref()).await?;
    let user = db
        .user(&args.user)
        .await
        .context("looking up the user")?
        .ok_or_else(|| {
            Exit::user(anyhow!(
                "no user '{}'\nhint: create one with `agentstack hub user create {}`",
                args.user,
                args.user
            ))
        })?;
    let token = Token::generate();
    db.add_token(user.id, &token.hash(), &args.label)
        .await
        .context("storing the token")?;
    println!("{}", token.expose());
    Ok(())
}
