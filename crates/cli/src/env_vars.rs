//! Every environment variable agentstack reads, declared once.

/// Log filter in `tracing` syntax, e.g. `debug` or `agentstack_env=trace`.
pub const AGENTSTACK_LOG: &str = "AGENTSTACK_LOG";

/// The Python interpreter used to serve Python OpenEnv packages (default `python3`).
pub const AGENTSTACK_PYTHON: &str = "AGENTSTACK_PYTHON";

/// The data directory (models, hub database, runs); default `$XDG_DATA_HOME/agentstack`
/// or `~/.local/share/agentstack`.
pub const AGENTSTACK_HOME: &str = "AGENTSTACK_HOME";
