//! Settings resolved from flags and environment variables, with one precedence rule:
//! flag > environment variable > default.

use std::time::Duration;

use agentstack_env::server::ServerConfig;

use crate::args::ServeArgs;
use crate::env_vars;

/// The Python interpreter for foreign Python packages.
pub fn python(flag: Option<&str>) -> String {
    flag.map(str::to_owned)
        .or_else(|| {
            std::env::var(env_vars::AGENTSTACK_PYTHON)
                .ok()
                .filter(|p| !p.is_empty())
        })
        .unwrap_or_else(|| "python3".to_owned())
}

/// The server configuration for `env serve`.
pub fn server_config(args: &ServeArgs) -> ServerConfig {
    let defaults = ServerConfig::default();
    ServerConfig {
        host: args.host,
        port: args.port,
        max_sessions: args.max_sessions.unwrap_or(defaults.max_sessions),
        idle_timeout: args
            .idle_timeout
            .map_or(defaults.idle_timeout, Duration::from_secs_f64),
        step_timeout: args
            .step_timeout
            .map_or(defaults.step_timeout, Duration::from_secs_f64),
        max_frame_bytes: args.max_message_bytes.unwrap_or(defaults.max_frame_bytes),
        max_body_bytes: args.max_message_bytes.unwrap_or(defaults.max_body_bytes),
        simulation: !args.production,
    }
}

/// The data directory: `AGENTSTACK_HOME`, else `$XDG_DATA_HOME/agentstack`, else
/// `~/.local/share/agentstack`.
pub fn data_dir() -> std::path::PathBuf {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    if let Some(home) = var(env_vars::AGENTSTACK_HOME) {
        return home.into();
    }
    if let Some(xdg) = var("XDG_DATA_HOME") {
        return std::path::PathBuf::from(xdg).join("agentstack");
    }
    let home = var("HOME").unwrap_or_else(|| ".".into());
    std::path::PathBuf::from(home).join(".local/share/agentstack")
}

/// Where fetched models are cached.
pub fn models_dir() -> std::path::PathBuf {
    data_dir().join("models")
}
