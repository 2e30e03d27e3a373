//! `agentstack model serve`: the OpenAI-compatible server.

use std::io::Write;
use std::net::SocketAddr;
use std::sync::Arc;

use agentstack_model::constraint::ConstraintCompiler;
use agentstack_model::engine::{Engine, EngineConfig};
use agentstack_model::server::{AppState, ServerConfig, serve};
use agentstack_model::speculate::Speculation;
use agentstack_static::env_vars;
use anyhow::Context;

use crate::args::ModelServeArgs;
use crate::{Exit, IntoUserError, settings};

/// Runs the command.
pub async fn run(args: ModelServeArgs) -> Result<(), Exit> {
    let lm = Arc::new(super::load(&args.run.model, args.run.threads).await?);
    let constraints = if args.no_constraints {
        None
    } else {
        let lm = lm.clone();
        Some(
            tokio::task::spawn_blocking(move || ConstraintCompiler::new(lm.tokenizer()))
                .await
                .context("indexing the vocabulary")?
                .map_err(anyhow::Error::from)?,
        )
    };
    let name = args.name.clone().unwrap_or_else(|| lm.info().name.clone());
    let keyed = !args.api_keys.is_empty();
    let engine = Engine::start(
        lm,
        EngineConfig {
            max_running: args.max_running.max(1),
            max_waiting: args.max_waiting.max(1),
            max_batch_tokens: args.max_batch_tokens.max(1),
            prefix_cache_bytes: args.prefix_cache_mib << 20,
            speculation: Speculation {
                max_draft: args.speculative_draft,
                ..Speculation::default()
            },
        },
    );
    let state = AppState::new(
        engine,
        constraints,
        ServerConfig {
            model_name: name.clone(),
            api_keys: args.api_keys,
            adapter_dir: args.adapter_dir.clone(),
            connections: settings::connection_limits(
                &args.connections,
                agentstack_serve::Limits::DEFAULT_MAX_CONNECTIONS,
            ),
            ..ServerConfig::default()
        },
    );
    if settings::no_key_on_a_network(args.host, keyed) {
        tracing::warn!(
            host = %args.host,
            "serving on a non-loopback address without an API key: anyone who can reach it can use the model and load adapters; set {} or --api-key",
            env_vars::AGENTSTACK_API_KEY
        );
    }
    match &args.adapter_dir {
        Some(dir) if !dir.is_dir() => tracing::warn!(
            dir = %dir.display(),
            "the adapter directory does not exist (yet); adapter loads are refused until it does"
        ),
        Some(dir) => {
            tracing::info!(dir = %dir.display(), "adapters load from inside this directory")
        }
        None => tracing::info!("adapter loading is off (no --adapter-dir)"),
    }
    let listener = tokio::net::TcpListener::bind(SocketAddr::new(args.host, args.port))
        .await
        .with_user_context(|| format!("could not listen on {}:{}", args.host, args.port))?;
    let address = listener.local_addr().context("reading the bound address")?;
    {
        let mut stdout = std::io::stdout().lock();
        let _ = writeln!(
            stdout,
            "listening on http://{address}\n  model {name}\n  OpenAI base URL http://{address}/v1"
        );
        let _ = stdout.flush();
    }
    serve(state, listener, super::super::env::serve::shutdown_signal())
        .await
        .context("serving")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_server_and_its_clients_read_the_same_variable() {
        assert_eq!(
            env_vars::AGENTSTACK_API_KEY,
            agentstack_model::server::API_KEY_ENV
        );
    }
}
