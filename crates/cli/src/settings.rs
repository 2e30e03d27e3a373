//! Settings resolved from flags and environment variables, with one precedence rule:
//! flag > environment variable > default ([`flag_or_env`]).
//!
//! One rule for an empty value: an environment variable set to the empty string is
//! unset (`AGENTSTACK_K8S_NAMESPACE= agentstack launch …` uses the default), and so is
//! an empty flag value — which is also what clap passes on from an empty variable bound
//! to a flag with `#[arg(env = …)]`. Each command gathers its settings in one
//! `*Settings::resolve` (`train`, `eval`, `launch`), which the hidden `--show-settings`
//! prints.

use std::fmt::Display;
use std::time::Duration;

use agentstack_env::client::{ApiKey, ClientConfig};
use agentstack_env::server::ServerConfig;

use agentstack_serve::Limits;
use agentstack_static::env_vars;

use crate::args::{ConnectionArgs, ServeArgs};

/// The environment variable `name`, by the one rule for an empty value: empty (or not
/// Unicode) is unset.
pub fn env_var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// The one precedence rule: the flag, else the environment variable `name`, else
/// `None` (the caller then takes its default). An empty value, from either, is unset.
/// The text is parsed with `parse`; a value that does not parse is the user's error,
/// saying where it came from (`NAME=`value`: why`, or `` `value`: why `` for a flag).
pub fn flag_or_env<T, E: Display>(
    flag: Option<&str>,
    name: &str,
    parse: impl FnOnce(&str) -> Result<T, E>,
) -> anyhow::Result<Option<T>> {
    flag_or_value(flag, name, std::env::var(name).ok(), parse)
}

/// [`flag_or_env`] with the variable's value given (`None`: unset).
fn flag_or_value<T, E: Display>(
    flag: Option<&str>,
    name: &str,
    value: Option<String>,
    parse: impl FnOnce(&str) -> Result<T, E>,
) -> anyhow::Result<Option<T>> {
    let (text, from_env) = match flag.filter(|v| !v.is_empty()) {
        Some(text) => (text.to_owned(), false),
        None => match value.filter(|v| !v.is_empty()) {
            Some(text) => (text, true),
            None => return Ok(None),
        },
    };
    parse(&text).map(Some).map_err(|e| {
        if from_env {
            crate::user_error!("{name}=`{text}` {e}")
        } else {
            crate::user_error!("`{text}` {e}")
        }
    })
}

/// [`flag_or_env`] for a setting whose text is its value.
pub fn flag_or_env_text(flag: Option<&str>, name: &str) -> Option<String> {
    flag_or_env(flag, name, |text| {
        Ok::<_, std::convert::Infallible>(text.to_owned())
    })
    .ok()
    .flatten()
}

/// What the hidden `--show-settings` prints: a command's resolved settings, in Rust's
/// pretty debug form, on stdout (a closed pipe is success, as for any output).
pub fn show(settings: &impl std::fmt::Debug) -> Result<(), crate::Exit> {
    use std::io::Write as _;
    writeln!(std::io::stdout().lock(), "{settings:#?}").map_err(crate::Exit::internal)
}

/// The Python interpreter for foreign Python packages: the flag, else
/// `AGENTSTACK_PYTHON`, else `python3`.
pub fn python(flag: Option<&str>) -> String {
    flag_or_env_text(flag, env_vars::AGENTSTACK_PYTHON).unwrap_or_else(|| "python3".to_owned())
}

/// A server's connection limits: the flags, else `default_max_connections` and the
/// default header-read timeout.
pub fn connection_limits(args: &ConnectionArgs, default_max_connections: usize) -> Limits {
    Limits {
        header_read_timeout: Duration::from_secs_f64(args.header_timeout),
        max_connections: args
            .max_connections
            .map_or(default_max_connections, |n| n as usize),
    }
}

/// The server configuration for `env serve`.
pub fn server_config(args: &ServeArgs) -> ServerConfig {
    let defaults = ServerConfig::default();
    let max_sessions = args.max_sessions.unwrap_or(defaults.max_sessions);
    // Each session's WebSocket holds a connection: leave room beside them for requests.
    let limits = connection_limits(
        &args.connections,
        max_sessions.saturating_add(Limits::DEFAULT_MAX_CONNECTIONS),
    );
    ServerConfig {
        host: args.host,
        port: args.port,
        max_sessions,
        idle_timeout: args
            .idle_timeout
            .map_or(defaults.idle_timeout, Duration::from_secs_f64),
        step_timeout: args
            .step_timeout
            .map_or(defaults.step_timeout, Duration::from_secs_f64),
        max_frame_bytes: args.max_message_bytes.unwrap_or(defaults.max_frame_bytes),
        max_body_bytes: args.max_message_bytes.unwrap_or(defaults.max_body_bytes),
        simulation: !args.production,
        header_read_timeout: limits.header_read_timeout,
        max_connections: limits.max_connections,
        api_keys: args.api_keys.clone(),
    }
}

/// The client settings for an environment opened by URL: the first key of
/// `AGENTSTACK_API_KEY`, when it holds one, for a server started with keys.
pub fn env_client() -> ClientConfig {
    ClientConfig {
        api_key: std::env::var(env_vars::AGENTSTACK_API_KEY)
            .ok()
            .and_then(|list| ApiKey::first_of_list(&list)),
        ..ClientConfig::default()
    }
}

/// Whether a server on `host` without a key (`keyed` false) can be reached from other
/// machines: then it warns at start.
pub fn no_key_on_a_network(host: std::net::IpAddr, keyed: bool) -> bool {
    !keyed && !host.is_loopback()
}

/// The data directory: `AGENTSTACK_HOME`, else `$XDG_DATA_HOME/agentstack`, else
/// `~/.local/share/agentstack`.
pub fn data_dir() -> std::path::PathBuf {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    if let Some(home) = var(env_vars::AGENTSTACK_HOME) {
        return home.into();
    }
    if let Some(xdg) = var(env_vars::XDG_DATA_HOME) {
        return std::path::PathBuf::from(xdg).join("agentstack");
    }
    let home = var(env_vars::HOME).unwrap_or_else(|| ".".into());
    std::path::PathBuf::from(home).join(".local/share/agentstack")
}

/// Where fetched models are cached.
pub fn models_dir() -> std::path::PathBuf {
    data_dir().join("models")
}

/// Where `hub login` keeps the hub URL and token (readable by the user only).
pub fn hub_credentials_path() -> std::path::PathBuf {
    data_dir().join("hub").join("credentials.json")
}

/// What `hub login` saved.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct HubCredentials {
    /// The hub.
    pub url: String,
    /// Its token.
    pub token: String,
}

/// Reads the saved credentials, if any.
pub fn hub_credentials() -> Option<HubCredentials> {
    let text = std::fs::read_to_string(hub_credentials_path()).ok()?;
    serde_json::from_str(&text).ok()
}

/// The hub URL: the flag, then `AGENTSTACK_HUB_URL`, then the saved one, then the
/// default local hub.
pub fn hub_url(flag: Option<&str>) -> String {
    hub_url_with(flag, hub_credentials().as_ref())
}

fn hub_url_with(flag: Option<&str>, saved: Option<&HubCredentials>) -> String {
    flag_or_env_text(flag, env_vars::AGENTSTACK_HUB_URL)
        .or_else(|| saved.map(|c| c.url.clone()))
        .unwrap_or_else(|| "http://127.0.0.1:8700".to_owned())
}

/// The hub token: `AGENTSTACK_HUB_TOKEN`, then the one saved for the hub at `url`.
fn hub_token_with(
    url: &str,
    saved: Option<&HubCredentials>,
) -> Option<agentstack_hub::auth::Token> {
    if let Some(t) = env_var(env_vars::AGENTSTACK_HUB_TOKEN) {
        return Some(agentstack_hub::auth::Token::new(t));
    }
    saved
        .filter(|c| c.url.trim_end_matches('/') == url.trim_end_matches('/'))
        .map(|c| agentstack_hub::auth::Token::new(c.token.clone()))
}

/// A client for the hub the flags name, with its token (the credentials file is read
/// once for both).
pub fn hub_client(flag: Option<&str>) -> anyhow::Result<agentstack_hub::client::HubClient> {
    let saved = hub_credentials();
    let url = hub_url_with(flag, saved.as_ref());
    let token = hub_token_with(&url, saved.as_ref());
    Ok(agentstack_hub::client::HubClient::new(&url, token)?)
}

/// Where pulled packages of the hub at `url` are cached.
pub fn hub_cache_dir(url: &str) -> std::path::PathBuf {
    let host: String = url
        .split("://")
        .nth(1)
        .unwrap_or(url)
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    data_dir().join("hub-cache").join(host.trim_matches('_'))
}

/// The hub's database URL: the flag, then `AGENTSTACK_HUB_DATABASE_URL`, then
/// `hub.db` in the data directory.
pub fn hub_database(flag: Option<&str>) -> String {
    flag_or_env_text(flag, env_vars::AGENTSTACK_HUB_DATABASE_URL)
        .unwrap_or_else(|| format!("sqlite://{}", data_dir().join("hub.db").display()))
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::*;

    #[test]
    fn only_a_keyless_server_off_loopback_is_warned_about() {
        let any: IpAddr = "0.0.0.0".parse().unwrap();
        assert!(no_key_on_a_network(any, false));
        assert!(!no_key_on_a_network(any, true));
        assert!(!no_key_on_a_network("127.0.0.1".parse().unwrap(), false));
        assert!(!no_key_on_a_network("::1".parse().unwrap(), false));
        assert!(no_key_on_a_network("::".parse().unwrap(), false));
    }

    #[test]
    fn flag_then_variable_then_nothing_and_empty_is_unset() {
        let text = |t: &str| Ok::<_, std::convert::Infallible>(t.to_owned());
        let var = |v: &str| Some(v.to_owned());
        let pick = |flag, value| flag_or_value(flag, "X", value, text).unwrap();
        assert_eq!(pick(Some("f"), var("v")), Some("f".into()));
        assert_eq!(pick(None, var("v")), Some("v".into()));
        assert_eq!(pick(None, None), None);
        assert_eq!(pick(None, var("")), None, "an empty variable is unset");
        assert_eq!(
            pick(Some(""), var("v")),
            Some("v".into()),
            "an empty flag (clap's value of an empty bound variable) is unset"
        );
        assert_eq!(pick(Some(""), var("")), None);
    }

    #[test]
    fn a_value_that_does_not_parse_is_the_users_error_and_names_its_variable() {
        let number = |t: &str| t.parse::<u32>().map_err(|_| "is not a number");
        let error = flag_or_value(None, "X", Some("ten".into()), number).unwrap_err();
        assert_eq!(error.to_string(), "X=`ten` is not a number");
        assert!(error.downcast_ref::<crate::UserError>().is_some());
        let error = flag_or_value(Some("ten"), "X", None, number).unwrap_err();
        assert_eq!(error.to_string(), "`ten` is not a number");
    }

    #[test]
    fn env_serve_and_its_clients_read_the_same_variable() {
        assert_eq!(
            env_vars::AGENTSTACK_API_KEY,
            agentstack_env::server::API_KEY_ENV
        );
    }
}
