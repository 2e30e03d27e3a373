//! The environment runtime: the [`Environment`] trait, an OpenEnv-compatible server
//! ([`server`]), a client ([`client`]), and hosting of foreign OpenEnv servers as
//! child processes ([`foreign`]). A server can ask for API keys
//! ([`server::ServerConfig::api_keys`]); the client sends one
//! ([`client::ClientConfig::api_key`]).
//!
//! ```no_run
//! # async fn demo(spec: agentstack_env::EnvSpec) -> Result<(), Box<dyn std::error::Error>> {
//! use agentstack_env::server::{Server, ServerConfig};
//! use agentstack_env::client::EnvClient;
//!
//! let server = Server::bind(ServerConfig::default(), vec![spec]).await?;
//! let url = server.url();
//! tokio::spawn(server.serve());
//!
//! let mut client = EnvClient::connect(&url, Default::default()).await?;
//! let first = client.reset(Default::default()).await?;
//! let next = client.step(&serde_json::json!({"message": "hi"})).await?;
//! println!("{first:?} {next:?}");
//! client.close().await?;
//! # Ok(()) }
//! ```

pub mod client;
pub mod conformance;
pub mod environment;
pub mod foreign;
pub mod import;
pub mod policy;
pub mod scaffold;
pub mod server;
pub mod spec;
pub mod tasks;

pub use environment::{
    BoxFuture, DynEnvironment, EnvError, EnvInfo, Environment, Hosted, ResetArgs, Step, StepError,
    StepJson, ToolCallError,
};
pub use spec::EnvSpec;
pub use tasks::{TaskError, TaskList, TaskSource};
