//! Command-line arguments (parsing only).

use std::net::IpAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// agentstack: the open agentic stack.
#[derive(Debug, Parser)]
#[command(name = "agentstack", version, about, propagate_version = true)]
pub struct Cli {
    /// Options for every command.
    #[command(flatten)]
    pub global: GlobalArgs,
    /// The command.
    #[command(subcommand)]
    pub command: Command,
}

/// Options for every command.
#[derive(Debug, Args)]
pub struct GlobalArgs {
    /// More logging on stderr (-v, -vv).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// Only errors on stderr.
    #[arg(short, long, global = true)]
    pub quiet: bool,
}

/// Top-level commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Environments: list, serve, run, validate, init.
    #[command(subcommand)]
    Env(EnvCommand),
}

/// `agentstack env ...`
#[derive(Debug, Subcommand)]
pub enum EnvCommand {
    /// List the built-in environments.
    List(ListArgs),
    /// Serve environments over the OpenEnv protocol (WebSocket, HTTP, MCP).
    Serve(ServeArgs),
    /// Drive episodes against an environment and print the rewards.
    Run(RunArgs),
    /// Check that a server speaks the OpenEnv protocol correctly.
    Validate(ValidateArgs),
    /// Create a new environment that serves and validates out of the box.
    Init(InitArgs),
}

/// `env list`.
#[derive(Debug, Args)]
pub struct ListArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `env serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// What to serve: built-in names (several are served from one process, each under
    /// /<name>, the first also at /), or one OpenEnv package directory (with an
    /// openenv.yaml), or one command line (quoted, e.g. "python server.py --port {port}").
    #[arg(required = true, value_name = "NAME|PATH|COMMAND")]
    pub targets: Vec<String>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Most sessions alive at once (default 16384).
    #[arg(long)]
    pub max_sessions: Option<usize>,
    /// Close sessions idle for this many seconds (default 600).
    #[arg(long, value_name = "SECS")]
    pub idle_timeout: Option<f64>,
    /// Longest time one reset/step/tool call may take, seconds (default 60).
    #[arg(long, value_name = "SECS")]
    pub step_timeout: Option<f64>,
    /// Largest WebSocket message or HTTP body, bytes (default 16 MiB).
    #[arg(long, value_name = "BYTES")]
    pub max_message_bytes: Option<usize>,
    /// Production mode: no stateless /reset, /step, /state routes.
    #[arg(long)]
    pub production: bool,
    /// Python interpreter for OpenEnv Python packages [env: AGENTSTACK_PYTHON] (default python3).
    #[arg(long)]
    pub python: Option<String>,
    /// Seconds to wait for a foreign server to become healthy.
    #[arg(long, default_value_t = 60.0, value_name = "SECS")]
    pub ready_timeout: f64,
}

/// Action policies for `env run`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PolicyArg {
    /// Random actions that fit the action schema.
    Random,
    /// Deterministic first-choice actions.
    Scripted,
}

/// `env run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// A built-in environment name (served in-process) or a server URL.
    #[arg(value_name = "NAME|URL")]
    pub target: String,
    /// Number of episodes.
    #[arg(long, short = 'n', default_value_t = 3)]
    pub episodes: usize,
    /// How actions are chosen.
    #[arg(long, value_enum, default_value_t = PolicyArg::Random)]
    pub policy: PolicyArg,
    /// Episodes run in parallel (one session each).
    #[arg(long, default_value_t = 1)]
    pub concurrency: usize,
    /// Step limit per episode.
    #[arg(long, default_value_t = 100)]
    pub max_steps: usize,
    /// Seed of the first episode (episode i uses seed + i).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Extra reset options as a JSON object, e.g. '{"difficulty":3}'.
    #[arg(long, value_name = "JSON")]
    pub options: Option<String>,
    /// Print one JSON object per episode instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `env validate`.
#[derive(Debug, Args)]
pub struct ValidateArgs {
    /// A server URL, a built-in environment name, or an OpenEnv package directory.
    #[arg(value_name = "URL|NAME|PATH")]
    pub target: String,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Python interpreter for OpenEnv Python packages [env: AGENTSTACK_PYTHON].
    #[arg(long)]
    pub python: Option<String>,
}

/// Languages for `env init`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Lang {
    /// A Rust crate using agentstack-env.
    Rust,
    /// A Python OpenEnv package.
    Python,
}

/// `env init`.
#[derive(Debug, Args)]
pub struct InitArgs {
    /// The environment's name (letters, digits, '_').
    pub name: String,
    /// The language.
    #[arg(long, value_enum, default_value_t = Lang::Rust)]
    pub lang: Lang,
    /// Parent directory to create it in.
    #[arg(long, short = 'o', default_value = ".")]
    pub output_dir: PathBuf,
}
