//! The environment hub: environments shared like model checkpoints.
//!
//! - [`package`]: the package format, a directory with an `openenv.yaml` packed into
//!   deterministic bytes with a manifest of hashes, unpacked with every file checked.
//! - [`registry`] over [`db`] (SQLite by default, PostgreSQL given a URL) and [`blobs`]
//!   (content-addressed through `object_store`): push, pull, fork, search, tags,
//!   leaderboards, and [`validate`] (checks run on every pushed version, the package
//!   started inside the sandbox).
//! - [`server`]: the registry over HTTP ([`api`], version 1) with read-only [`web`]
//!   pages; [`client`]: the other side, with a checked local cache; [`auth`]: tokens.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use agentstack_hub::{api::PackageRef, auth::Token, client::HubClient};
//!
//! let hub = HubClient::new("http://127.0.0.1:8700", Some(Token::new("ash_...")))?;
//! let pushed = hub.push_dir("my_env".as_ref(), "alice", None, None, false).await?;
//! println!("{}@{} {}", pushed.package, pushed.version, pushed.sha256);
//! let pulled = hub.pull(&PackageRef::parse("alice/my_env@latest")?, "cache".as_ref()).await?;
//! println!("unpacked at {}", pulled.dir.display());
//! # Ok(()) }
//! ```

pub mod api;
pub mod auth;
pub mod blobs;
pub mod client;
pub mod db;
pub mod package;
pub mod registry;
pub mod server;
pub mod validate;
pub mod web;
