//! An OpenEnv-compatible server for one or several environments in one process.
//!
//! Routes (for the default environment at `/`, and for every environment under
//! `/{name}/` as well):
//! `WS /ws` (stateful sessions), `WS /mcp` and `POST /mcp` (JSON-RPC tools and
//! sessions), `POST /reset`, `POST /step`, `GET /state` (stateless, simulation mode),
//! `GET /health`, `/metadata`, `/schema`, `/openapi.json`; and at the root the Task
//! API (`/list_environments`, `/{env}/splits`, `/{env}/tasks`, ...).
//!
//! Everything is bounded: sessions ([`ServerConfig::max_sessions`], answered with
//! `CAPACITY_REACHED`), frame and body size, time per step, and idle time (sessions
//! idle longer than [`ServerConfig::idle_timeout`] are reaped, attached or not),
//! connections ([`ServerConfig::max_connections`]) and the time to send a request head
//! ([`ServerConfig::header_read_timeout`]).
//!
//! With API keys in [`ServerConfig::api_keys`], every route but `/health` (and each
//! environment's `/{name}/health`) needs `Authorization: Bearer KEY`: the HTTP routes,
//! the `/ws` and `/mcp` WebSocket upgrades, MCP over HTTP, the Task API and, for a
//! foreign environment, everything the proxy forwards. The key is checked before a
//! body is read or a WebSocket accepted; a request without it gets 401 with
//! `{"detail": "..."}` (the shape of the server's other errors), and the key is taken
//! off a request before a handler, or a foreign server behind the proxy, sees it.

mod http;
mod mcp;
mod sessions;
mod ws;

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

pub use agentstack_serve::auth::{API_KEY_ENV, ApiKey};

use agentstack_serve::auth::KeyGuard;
use axum::Router;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::spec::EnvSpec;
use sessions::Sessions;

/// Limits and addresses of a server. Every limit is reported in the error a client
/// gets when it hits it.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Address to listen on.
    pub host: IpAddr,
    /// Port; 0 picks a free one.
    pub port: u16,
    /// Most sessions alive at once, over all environments.
    pub max_sessions: usize,
    /// A session with no message for this long is closed. OpenEnv's default is
    /// never, which leaks sessions of clients that vanish.
    pub idle_timeout: Duration,
    /// Longest time one reset, step or tool call may take.
    pub step_timeout: Duration,
    /// Largest WebSocket message, bytes.
    pub max_frame_bytes: usize,
    /// Largest HTTP request body, bytes.
    pub max_body_bytes: usize,
    /// Whether to serve the stateless `/reset`, `/step`, `/state` routes (OpenEnv's
    /// simulation mode).
    pub simulation: bool,
    /// Longest time to receive a request head; a slow or idle connection is then
    /// closed.
    pub header_read_timeout: Duration,
    /// Most connections open at once (each WebSocket session holds one for its life);
    /// past it, new connections wait until one closes.
    pub max_connections: usize,
    /// Keys a request must bear one of (`Authorization: Bearer KEY`) on every route but
    /// `/health`; none: no key is asked for. Redacted in `Debug`.
    pub api_keys: Vec<ApiKey>,
}

/// Connections the default [`ServerConfig`] keeps beside its sessions' WebSockets,
/// for plain HTTP requests.
const HTTP_CONNECTIONS: usize = 1024;

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            port: 0,
            max_sessions: 16_384,
            idle_timeout: Duration::from_secs(600),
            step_timeout: Duration::from_secs(60),
            max_frame_bytes: 16 * 1024 * 1024,
            max_body_bytes: 16 * 1024 * 1024,
            simulation: true,
            header_read_timeout: agentstack_serve::Limits::DEFAULT_HEADER_READ_TIMEOUT,
            max_connections: 16_384 + HTTP_CONNECTIONS,
            api_keys: Vec::new(),
        }
    }
}

/// Why a server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// No environment was given.
    #[error("no environment to serve")]
    NoEnvironments,
    /// Two environments share a name.
    #[error("two environments are named '{0}'; serve one of them under another name")]
    DuplicateName(String),
    /// The name cannot be a URL path segment.
    #[error("environment name '{0}' is not usable in a URL; use letters, digits, '-' and '_'")]
    BadName(String),
    /// Binding the address failed.
    #[error("could not listen on {addr}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Shared state of all routes.
pub(crate) struct AppState {
    pub config: ServerConfig,
    pub envs: Vec<EnvSpec>,
    pub sessions: Sessions,
    pub shutdown: watch::Receiver<bool>,
}

impl AppState {
    pub fn env_index(&self, name: &str) -> Option<usize> {
        self.envs
            .iter()
            .position(|e| e.name().eq_ignore_ascii_case(name))
    }
}

/// A read-only view of a running server, for monitoring and tests.
#[derive(Clone)]
pub struct ServerHandle {
    state: Arc<AppState>,
    shutdown: Arc<watch::Sender<bool>>,
}

impl ServerHandle {
    /// Sessions alive now.
    pub fn active_sessions(&self) -> usize {
        self.state.sessions.active()
    }

    /// Asks the server to shut down: sockets are closed with code 1000.
    pub fn shutdown(&self) {
        let _ = self.shutdown.send(true);
    }
}

/// A bound, not yet serving, server.
pub struct Server {
    listener: TcpListener,
    app: Router,
    handle: ServerHandle,
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        && !matches!(
            name,
            "ws" | "mcp"
                | "reset"
                | "step"
                | "state"
                | "health"
                | "metadata"
                | "schema"
                | "docs"
                | "openapi.json"
                | "list_environments"
        )
}

impl Server {
    /// Binds the address and prepares the routes for `envs` (the first is also served
    /// at the root).
    pub async fn bind(config: ServerConfig, envs: Vec<EnvSpec>) -> Result<Self, ServerError> {
        if envs.is_empty() {
            return Err(ServerError::NoEnvironments);
        }
        for (i, env) in envs.iter().enumerate() {
            if !valid_name(env.name()) {
                return Err(ServerError::BadName(env.name().to_owned()));
            }
            if envs[..i]
                .iter()
                .any(|e| e.name().eq_ignore_ascii_case(env.name()))
            {
                return Err(ServerError::DuplicateName(env.name().to_owned()));
            }
        }
        let addr = SocketAddr::new(config.host, config.port);
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| ServerError::Bind { addr, source })?;
        let (tx, rx) = watch::channel(false);
        let state = Arc::new(AppState {
            sessions: Sessions::new(config.max_sessions),
            config,
            envs,
            shutdown: rx,
        });
        let app = app(state.clone());
        Ok(Self {
            listener,
            app,
            handle: ServerHandle {
                state,
                shutdown: Arc::new(tx),
            },
        })
    }

    /// Binds the address and forwards every request and WebSocket to the OpenEnv
    /// server at `upstream` (a foreign environment).
    pub async fn bind_proxy(config: ServerConfig, upstream: &str) -> Result<Self, ServerError> {
        let addr = SocketAddr::new(config.host, config.port);
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| ServerError::Bind { addr, source })?;
        let (tx, rx) = watch::channel(false);
        let app = key_guard(&config, &[]).wrap(crate::foreign::proxy_router(
            upstream,
            config.max_body_bytes,
        ));
        let state = Arc::new(AppState {
            sessions: Sessions::new(config.max_sessions),
            config,
            envs: Vec::new(),
            shutdown: rx,
        });
        Ok(Self {
            listener,
            app,
            handle: ServerHandle {
                state,
                shutdown: Arc::new(tx),
            },
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// `http://host:port` of the default environment.
    pub fn url(&self) -> String {
        let addr = self.local_addr();
        let host = match addr.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => "127.0.0.1".to_owned(),
            IpAddr::V6(ip) if ip.is_unspecified() => "[::1]".to_owned(),
            IpAddr::V6(ip) => format!("[{ip}]"),
            ip => ip.to_string(),
        };
        format!("http://{host}:{}", addr.port())
    }

    /// The URL of environment `name` (its routes under `/{name}`).
    pub fn env_url(&self, name: &str) -> String {
        format!("{}/{name}", self.url())
    }

    /// A handle for monitoring and shutting down.
    pub fn handle(&self) -> ServerHandle {
        self.handle.clone()
    }

    /// Serves until [`ServerHandle::shutdown`] is called.
    pub async fn serve(self) -> std::io::Result<()> {
        let mut rx = self.handle.shutdown.subscribe();
        self.serve_with_shutdown(async move {
            let _ = rx.wait_for(|stop| *stop).await;
        })
        .await
    }

    /// Serves until `signal` completes (or [`ServerHandle::shutdown`] is called), then
    /// closes every session with code 1000 and returns.
    pub async fn serve_with_shutdown(
        self,
        signal: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let handle = self.handle.clone();
        let reaper = tokio::spawn(reap_loop(handle.state.clone()));
        let stop = handle.clone();
        let mut rx = handle.shutdown.subscribe();
        let limits = agentstack_serve::Limits {
            header_read_timeout: handle.state.config.header_read_timeout,
            max_connections: handle.state.config.max_connections,
        };
        let result = agentstack_serve::serve(self.listener, self.app, limits, async move {
            tokio::select! {
                () = signal => stop.shutdown(),
                _ = rx.wait_for(|stop| *stop) => {}
            }
        })
        .await;
        reaper.abort();
        handle.state.sessions.clear();
        result
    }
}

async fn reap_loop(state: Arc<AppState>) {
    let every =
        (state.config.idle_timeout / 4).clamp(Duration::from_millis(50), Duration::from_secs(30));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let reaped = state.sessions.reap_idle(state.config.idle_timeout);
        if reaped > 0 {
            tracing::info!(
                reaped,
                active = state.sessions.active(),
                "reaped idle sessions"
            );
        }
    }
}

/// Builds the whole service for `state`, behind its API keys when it has any.
pub(crate) fn app(state: Arc<AppState>) -> Router {
    let mut router = http::task_routes(state.clone()).merge(http::env_routes(state.clone(), 0));
    for index in 0..state.envs.len() {
        let name = state.envs[index].name().to_owned();
        router = router.nest(&format!("/{name}"), http::env_routes(state.clone(), index));
    }
    let router = router
        .fallback(http::not_found)
        .layer(axum::extract::DefaultBodyLimit::max(
            state.config.max_body_bytes,
        ));
    key_guard(&state.config, &state.envs).wrap(router)
}

/// The key check of a server with `config` serving `envs`: `/health` and each
/// environment's `/{name}/health` stay open for readiness probes.
fn key_guard(config: &ServerConfig, envs: &[EnvSpec]) -> KeyGuard {
    envs.iter().fold(
        KeyGuard::new(config.api_keys.clone(), http::unauthorized),
        |guard, env| guard.open_path(format!("/{}/health", env.name())),
    )
}
