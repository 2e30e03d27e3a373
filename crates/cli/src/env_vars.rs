//! Every environment variable agentstack reads, declared once.

/// Log filter in `tracing` syntax, e.g. `debug` or `agentstack_env=trace`.
pub const AGENTSTACK_LOG: &str = "AGENTSTACK_LOG";

/// The Python interpreter used to serve Python OpenEnv packages (default `python3`).
pub const AGENTSTACK_PYTHON: &str = "AGENTSTACK_PYTHON";

/// The data directory (models, hub database, runs); default `$XDG_DATA_HOME/agentstack`
/// or `~/.local/share/agentstack`.
pub const AGENTSTACK_HOME: &str = "AGENTSTACK_HOME";

/// The hub the `hub` commands talk to (default: the URL saved by `hub login`, then
/// `http://127.0.0.1:8700`).
pub const AGENTSTACK_HUB_URL: &str = "AGENTSTACK_HUB_URL";

/// The API token sent to the hub (default: the one saved by `hub login`).
pub const AGENTSTACK_HUB_TOKEN: &str = "AGENTSTACK_HUB_TOKEN";

/// The database `hub serve` keeps its metadata in (`sqlite:///…` or `postgres://…`).
pub const AGENTSTACK_HUB_DATABASE_URL: &str = "AGENTSTACK_HUB_DATABASE_URL";
