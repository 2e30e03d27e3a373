//! `agentstack env serve`: built-in environments in one process, or one foreign
//! environment (an OpenEnv package or a command line) behind our address.
//!
//! With `--api-key` (or `AGENTSTACK_API_KEY`, comma-separated) every route but
//! `/health` asks for one of the keys, the foreign environment's included; without a
//! key, serving off loopback is warned about. Keys are never logged.

use std::io::Write;
use std::time::Duration;

use agentstack_env::EnvSpec;
use agentstack_env::foreign::{ForeignCommand, ForeignEnv};
use agentstack_env::server::Server;
use agentstack_harness::reference::EnvReference;
use agentstack_static::env_vars;
use anyhow::Context;

use crate::args::ServeArgs;
use crate::settings;
use crate::{Exit, IntoUserError};

/// What one target names.
pub(crate) enum Target {
    /// A built-in environment.
    Builtin(Box<EnvSpec>),
    /// A server to start and proxy.
    Foreign(ForeignCommand),
}

/// Resolves a target string: a built-in name, a package directory, or a command line
/// (what it names is decided by agentstack-harness's [`EnvReference`]).
pub(crate) fn resolve(target: &str, python: &str) -> anyhow::Result<Target> {
    match EnvReference::parse_local(target, &builtins()).user()? {
        EnvReference::Builtin(name) => agentstack_envs::find(&name)
            .map(|spec| Target::Builtin(Box::new(spec)))
            .ok_or_else(|| anyhow::anyhow!("the built-in environment {name} is gone")),
        EnvReference::Package(dir) => Ok(Target::Foreign(
            ForeignCommand::package(&dir, python).user()?,
        )),
        EnvReference::Command(line) => {
            Ok(Target::Foreign(ForeignCommand::command_line(&line).user()?))
        }
        other @ (EnvReference::Hub(_) | EnvReference::Url(_)) => Err(anyhow::anyhow!(
            "{other} is not served by a process of ours"
        )),
    }
}

/// The built-in environments' names.
pub(crate) fn builtins() -> Vec<String> {
    agentstack_envs::builtin()
        .iter()
        .map(|s| s.name().to_owned())
        .collect()
}

pub(crate) fn builtin_names() -> String {
    builtins().join(", ")
}

pub(crate) async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

/// Prints the URLs in one write. Best effort: a server keeps serving when whoever
/// started it has stopped reading its output (a reader that takes the first line and
/// closes the pipe must not kill it).
fn announce(banner: &str) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(banner.as_bytes()).and_then(|()| out.flush());
}

/// Each connection (a session's WebSocket among them) holds a socket: lift the soft
/// open-file limit to the hard one (a default soft limit of 1024 would refuse
/// connections long before `--max-sessions`), and say so when even the hard limit is
/// below what the connections need.
fn raise_open_file_limit(max_connections: usize) {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return;
    };
    if soft < hard && setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_err() {
        tracing::warn!(soft, hard, "could not raise the open-file limit");
    }
    let wanted = max_connections as u64 + 64;
    if hard < wanted {
        tracing::warn!(
            limit = hard,
            max_connections,
            "the open-file limit is below --max-connections; connections beyond it will be refused (raise it with `ulimit -n` or lower --max-connections)"
        );
    }
}

/// Serves until Ctrl-C or SIGTERM.
pub async fn run(args: ServeArgs) -> Result<(), Exit> {
    let python = settings::python(args.python.as_deref());
    let config = settings::server_config(&args);
    raise_open_file_limit(config.max_connections);
    if settings::no_key_on_a_network(args.host, !config.api_keys.is_empty()) {
        tracing::warn!(
            host = %args.host,
            "serving on a non-loopback address without an API key: anyone who can reach it can open sessions and run the environments (a foreign package's code among them); set {} or --api-key",
            env_vars::AGENTSTACK_API_KEY
        );
    } else if !config.api_keys.is_empty() {
        tracing::info!(
            keys = config.api_keys.len(),
            "every route but /health asks for an API key"
        );
    }
    let mut targets = Vec::new();
    for target in &args.targets {
        let target = crate::commands::hub::pull_target(target).await?;
        targets.push(resolve(&target, &python)?);
    }
    let mut specs = Vec::new();
    let mut foreign = Vec::new();
    for target in targets {
        match target {
            Target::Builtin(spec) => specs.push(*spec),
            Target::Foreign(command) => foreign.push(command),
        }
    }
    match (specs.is_empty(), foreign.len()) {
        (false, 0) => {
            let server = Server::bind(config, specs.clone())
                .await
                .user_context("starting the server")?;
            let url = server.url();
            let mut banner = format!("listening on {url}\n");
            for spec in &specs {
                banner.push_str(&format!("  {}  {url}/{}\n", spec.name(), spec.name()));
            }
            announce(&banner);
            server
                .serve_with_shutdown(shutdown_signal())
                .await
                .context("serving")?;
        }
        (true, 1) => {
            let command = foreign.pop().expect("one foreign target");
            let name = command.name.clone();
            let child = ForeignEnv::start(command, Duration::from_secs_f64(args.ready_timeout))
                .await
                .user_context("starting the foreign environment")?;
            let server = Server::bind_proxy(config, child.url())
                .await
                .user_context("starting the proxy")?;
            let url = server.url();
            announce(&format!(
                "listening on {url}\n  {name}  {url}  (foreign, pid {})\n",
                child.pid().unwrap_or(0)
            ));
            server
                .serve_with_shutdown(shutdown_signal())
                .await
                .context("serving")?;
            child.stop(Duration::from_secs(5)).await;
        }
        _ => {
            return Err(Exit::user(anyhow::anyhow!(
                "a foreign environment (package directory or command line) is served on its own\nhint: run one `agentstack env serve` per foreign environment"
            )));
        }
    }
    Ok(())
}
