//! Foreign environments: any OpenEnv-compatible server run as a child process (a
//! Python OpenEnv package, with its `openenv.yaml` or just a `server/app.py`, or any
//! command line), and a reverse proxy that serves it through our address.
//!
//! A Python package is served the way its manifest declares (`uvicorn server.app:app`
//! in its directory). Many packages of OpenEnv's own repository declare that but
//! import package-relatively (`from ..models import X`), which only works as
//! `<dir>.server.app:app` from the parent directory, as their images run them: when
//! the declared form dies of exactly that import error, the package form is started
//! instead ([`ForeignCommand::fallback`]).
//!
//! The child runs in its own process group, is told to die with us
//! (`PR_SET_PDEATHSIG` on Linux), and is killed with its group when the
//! [`ForeignEnv`] is dropped, so no server outlives the command that started it.

use std::net::{Ipv4Addr, SocketAddr, TcpListener as StdListener};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use agentstack_serve::HOP_BY_HOP_HEADERS;
use agentstack_static::env_vars;
use axum::Router;
use axum::body::Body;
use axum::extract::ws::{CloseFrame as AxumCloseFrame, Message as AxumMessage, WebSocketUpgrade};
use axum::extract::{FromRequestParts, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::{SinkExt, StreamExt};
use serde::Deserialize;
use tokio::process::{Child, Command};
use tokio_tungstenite::tungstenite::Error as TError;
use tokio_tungstenite::tungstenite::Message as TMessage;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

use crate::client::{HttpClient, route_url};

/// How to start a foreign server.
#[derive(Debug, Clone, PartialEq)]
pub struct ForeignCommand {
    /// Program and arguments. `{port}` and `{host}` in any argument are replaced.
    pub argv: Vec<String>,
    /// Working directory.
    pub cwd: Option<PathBuf>,
    /// Extra environment variables (`PORT` and `HOST` are always set).
    pub env: Vec<(String, String)>,
    /// A name for messages and routes.
    pub name: String,
    /// Started instead when this command exits, before it is healthy, with a Python
    /// package-relative import error ([`RELATIVE_IMPORT_ERRORS`]): the package form of
    /// a Python package's app.
    pub fallback: Option<Box<ForeignCommand>>,
}

/// What Python says when a module imported as part of a top-level `server` package
/// imports from above it (`from ..models import X`): the sign that the app only
/// imports as `<dir>.server.app`.
pub const RELATIVE_IMPORT_ERRORS: [&str; 2] = [
    "attempted relative import beyond top-level package",
    "attempted relative import with no known parent package",
];

/// The app a package without `app` in its manifest (or without a manifest) serves.
pub const DEFAULT_APP: &str = "server.app:app";

/// Why a foreign environment could not be started.
#[derive(Debug, thiserror::Error)]
pub enum ForeignError {
    /// The manifest could not be read.
    #[error("could not read {path}")]
    Manifest {
        /// Its path.
        path: PathBuf,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The directory is neither an OpenEnv package nor a server app.
    #[error(
        "{} has neither an openenv.yaml nor a server/app.py\nhint: serve an OpenEnv package directory (openenv.yaml, or at least server/app.py with an ASGI `app`)",
        dir.display()
    )]
    NotAPackage {
        /// The directory.
        dir: PathBuf,
    },
    /// The manifest is not usable.
    #[error("{path}: {message}")]
    BadManifest {
        /// Its path.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The command line is empty.
    #[error("empty command line")]
    EmptyCommand,
    /// The process could not be started.
    #[error("could not start `{command}`")]
    Spawn {
        /// The command.
        command: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The process exited before it was healthy.
    #[error(
        "`{command}` exited with {status} before answering /health; its output ends with:\n{output}"
    )]
    Exited {
        /// The command.
        command: String,
        /// Its exit status.
        status: std::process::ExitStatus,
        /// The end of its stderr.
        output: String,
    },
    /// The process did not become healthy in time.
    #[error("`{command}` did not answer GET /health within {after:?}")]
    NotReady {
        /// The command.
        command: String,
        /// How long we waited.
        after: Duration,
    },
    /// No free port.
    #[error("could not find a free port")]
    Port(#[source] std::io::Error),
}

/// The parts of an `openenv.yaml` we read to run a Python package.
#[derive(Debug, Clone, Deserialize)]
pub struct OpenEnvManifest {
    /// The environment's name.
    pub name: String,
    /// `module:attribute` of the ASGI app, e.g. `server.app:app`.
    #[serde(default)]
    pub app: Option<String>,
    /// The port it listens on in a container.
    #[serde(default)]
    pub port: Option<u16>,
    /// `fastapi` for the reference template.
    #[serde(default)]
    pub runtime: Option<String>,
    /// Our section; `agentstack.serve` is the command that serves a package that is
    /// not a Python OpenEnv app (`{port}` and `{host}` are replaced).
    #[serde(default)]
    pub agentstack: Option<AgentstackKeys>,
}

/// The keys of `openenv.yaml`'s `agentstack:` section that serving reads (the hub
/// checks the whole section).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct AgentstackKeys {
    /// The command line that serves the package, run in its directory.
    #[serde(default)]
    pub serve: Option<String>,
}

impl OpenEnvManifest {
    /// Reads `dir/openenv.yaml`; for a directory without one that has a
    /// `server/app.py` (as several packages of OpenEnv's own repository), assumes the
    /// name of the directory and [`DEFAULT_APP`] and logs that it did.
    pub fn read_or_assume(dir: &Path) -> Result<Self, ForeignError> {
        if dir.join("openenv.yaml").is_file() {
            return Self::read(dir);
        }
        if !dir.join("server/app.py").is_file() {
            return Err(ForeignError::NotAPackage {
                dir: dir.to_owned(),
            });
        }
        let name = dir
            .canonicalize()
            .ok()
            .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "foreign".to_owned());
        tracing::warn!(
            dir = %dir.display(),
            %name,
            app = DEFAULT_APP,
            "no openenv.yaml; serving server/app.py as a Python OpenEnv app named after its directory"
        );
        Ok(Self {
            name,
            app: None,
            port: None,
            runtime: None,
            agentstack: None,
        })
    }

    /// Reads `dir/openenv.yaml`.
    pub fn read(dir: &Path) -> Result<Self, ForeignError> {
        let path = dir.join("openenv.yaml");
        let text = std::fs::read_to_string(&path).map_err(|e| ForeignError::Manifest {
            path: path.clone(),
            source: Box::new(e),
        })?;
        let manifest: Self = serde_norway::from_str(&text).map_err(|e| ForeignError::Manifest {
            path: path.clone(),
            source: Box::new(e),
        })?;
        if manifest.name.trim().is_empty() {
            return Err(ForeignError::BadManifest {
                path,
                message: "`name` is empty".into(),
            });
        }
        Ok(manifest)
    }
}

impl ForeignCommand {
    /// The command that serves a Python OpenEnv package in `dir` with `python`:
    /// `python -m uvicorn <app> --host {host} --port {port}`, run in `dir`, with the
    /// package form (`<dir name>.<app>` run in the parent) as its
    /// [`fallback`](ForeignCommand::fallback). A directory without `openenv.yaml` is
    /// served when it has `server/app.py` ([`OpenEnvManifest::read_or_assume`]).
    pub fn python_package(dir: &Path, python: &str) -> Result<Self, ForeignError> {
        let manifest = OpenEnvManifest::read_or_assume(dir)?;
        Self::python_app(dir, python, manifest)
    }

    fn python_app(
        dir: &Path,
        python: &str,
        manifest: OpenEnvManifest,
    ) -> Result<Self, ForeignError> {
        let app = manifest.app.unwrap_or_else(|| DEFAULT_APP.to_owned());
        if !app.contains(':') {
            return Err(ForeignError::BadManifest {
                path: dir.join("openenv.yaml"),
                message: format!("`app` must be `module:attribute`, got '{app}'"),
            });
        }
        let dir = dir.canonicalize().map_err(|e| ForeignError::Manifest {
            path: dir.to_owned(),
            source: Box::new(e),
        })?;
        // The package's modules import each other both as `server.x` and as
        // `<name>.server.x`; put the package and its parent on the path.
        let parent = dir.parent().map(Path::to_path_buf).unwrap_or_default();
        let pythonpath = |first: &Path, second: &Path| match std::env::var(env_vars::PYTHONPATH) {
            Ok(p) if !p.is_empty() => format!("{}:{}:{p}", first.display(), second.display()),
            _ => format!("{}:{}", first.display(), second.display()),
        };
        let uvicorn = |app: &str| {
            [
                python,
                "-m",
                "uvicorn",
                app,
                "--host",
                "{host}",
                "--port",
                "{port}",
                "--log-level",
                "warning",
            ]
            .map(str::to_owned)
            .to_vec()
        };
        // The package form: what OpenEnv's images run for packages whose modules import
        // package-relatively. Only for a directory whose name Python can import.
        let package_name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .filter(|n| is_python_identifier(n));
        let fallback = package_name
            .filter(|n| !app.starts_with(&format!("{n}.")))
            .map(|package| {
                Box::new(Self {
                    argv: uvicorn(&format!("{package}.{app}")),
                    cwd: Some(parent.clone()),
                    env: vec![(env_vars::PYTHONPATH.into(), pythonpath(&parent, &dir))],
                    name: manifest.name.clone(),
                    fallback: None,
                })
            });
        Ok(Self {
            argv: uvicorn(&app),
            env: vec![(env_vars::PYTHONPATH.into(), pythonpath(&dir, &parent))],
            cwd: Some(dir),
            name: manifest.name,
            fallback,
        })
    }

    /// The command that serves the package in `dir`: its `agentstack.serve` command
    /// line (run in `dir`) when it has one, else the Python OpenEnv app served with
    /// `python` ([`ForeignCommand::python_package`]).
    pub fn package(dir: &Path, python: &str) -> Result<Self, ForeignError> {
        let manifest = OpenEnvManifest::read_or_assume(dir)?;
        match manifest.agentstack.as_ref().and_then(|a| a.serve.clone()) {
            Some(line) => {
                let mut command = Self::command_line(&line)?;
                command.cwd = Some(dir.canonicalize().map_err(|e| ForeignError::Manifest {
                    path: dir.to_owned(),
                    source: Box::new(e),
                })?);
                command.name = manifest.name;
                Ok(command)
            }
            None => Self::python_app(dir, python, manifest),
        }
    }

    /// A command line split on whitespace (use `{port}` where the port goes, or read
    /// `$PORT`).
    pub fn command_line(line: &str) -> Result<Self, ForeignError> {
        let argv: Vec<String> = line.split_whitespace().map(str::to_owned).collect();
        let first = argv.first().ok_or(ForeignError::EmptyCommand)?;
        let name = Path::new(first).file_stem().map_or_else(
            || "foreign".to_owned(),
            |s| s.to_string_lossy().into_owned(),
        );
        Ok(Self {
            argv,
            cwd: None,
            env: Vec::new(),
            name,
            fallback: None,
        })
    }

    fn display(&self) -> String {
        self.argv.join(" ")
    }
}

/// Whether `name` can be imported as a Python module name (keywords aside).
fn is_python_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c == '_' || c.is_ascii_alphabetic())
        && chars.all(|c| c == '_' || c.is_ascii_alphanumeric())
}

/// A running foreign server.
pub struct ForeignEnv {
    child: Child,
    url: String,
    name: String,
}

/// Picks a free port on the loopback interface.
pub fn free_port() -> Result<u16, ForeignError> {
    let listener = StdListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))
        .map_err(ForeignError::Port)?;
    Ok(listener.local_addr().map_err(ForeignError::Port)?.port())
}

impl ForeignEnv {
    /// Starts `command` on a free loopback port and waits up to `ready_within` for
    /// `GET /health` to answer healthy. When it exits first with a package-relative
    /// import error and has a [`fallback`](ForeignCommand::fallback), the fallback is
    /// started instead (with its own `ready_within`).
    pub async fn start(
        mut command: ForeignCommand,
        ready_within: Duration,
    ) -> Result<Self, ForeignError> {
        loop {
            let fallback = command.fallback.take();
            match Self::start_once(command, ready_within).await {
                Err(ForeignError::Exited {
                    command: shown,
                    status,
                    output,
                }) => match fallback {
                    Some(next)
                        if RELATIVE_IMPORT_ERRORS
                            .iter()
                            .any(|marker| output.contains(marker)) =>
                    {
                        tracing::warn!(
                            failed = %shown,
                            instead = %next.display(),
                            "the declared app imports package-relatively; serving the package form from its parent directory"
                        );
                        command = *next;
                    }
                    _ => {
                        return Err(ForeignError::Exited {
                            command: shown,
                            status,
                            output,
                        });
                    }
                },
                other => return other,
            }
        }
    }

    async fn start_once(
        command: ForeignCommand,
        ready_within: Duration,
    ) -> Result<Self, ForeignError> {
        let port = free_port()?;
        let host = "127.0.0.1";
        let argv: Vec<String> = command
            .argv
            .iter()
            .map(|a| {
                a.replace("{port}", &port.to_string())
                    .replace("{host}", host)
            })
            .collect();
        let (program, args) = argv.split_first().ok_or(ForeignError::EmptyCommand)?;
        let mut cmd = Command::new(program);
        cmd.args(args)
            .env(env_vars::PORT, port.to_string())
            .env(env_vars::HOST, host)
            .envs(command.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        if let Some(cwd) = &command.cwd {
            cmd.current_dir(cwd);
        }
        die_with_parent(&mut cmd);
        let shown = command.display();
        let mut child = cmd.spawn().map_err(|source| ForeignError::Spawn {
            command: shown.clone(),
            source,
        })?;
        let tail = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        if let Some(stderr) = child.stderr.take() {
            tokio::spawn(forward_stderr(stderr, command.name.clone(), tail.clone()));
        }
        let url = format!("http://{host}:{port}");
        let http = HttpClient::new(&url, Duration::from_secs(2)).expect("loopback URL is valid");
        let deadline = tokio::time::Instant::now() + ready_within;
        loop {
            if let Some(status) = child.try_wait().map_err(|source| ForeignError::Spawn {
                command: shown.clone(),
                source,
            })? {
                tokio::time::sleep(Duration::from_millis(50)).await;
                let output = tail.lock().map(|t| t.clone()).unwrap_or_default();
                return Err(ForeignError::Exited {
                    command: shown,
                    status,
                    output,
                });
            }
            if http.health().await.is_ok() {
                break;
            }
            if tokio::time::Instant::now() >= deadline {
                let mut env = Self {
                    child,
                    url,
                    name: command.name,
                };
                env.kill();
                return Err(ForeignError::NotReady {
                    command: shown,
                    after: ready_within,
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tracing::info!(name = %command.name, %url, "foreign environment is healthy");
        Ok(Self {
            child,
            url,
            name: command.name,
        })
    }

    /// Its base URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    fn kill(&mut self) {
        if let Some(pid) = self.child.id() {
            let group = nix::unistd::Pid::from_raw(pid as i32);
            let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
        }
        let _ = self.child.start_kill();
    }

    /// Stops the server: SIGTERM to its group, then SIGKILL after `grace`.
    pub async fn stop(mut self, grace: Duration) {
        if let Some(pid) = self.child.id() {
            let group = nix::unistd::Pid::from_raw(pid as i32);
            let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGTERM);
            if tokio::time::timeout(grace, self.child.wait()).await.is_ok() {
                let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
                return;
            }
        }
        self.kill();
        let _ = self.child.wait().await;
    }
}

impl Drop for ForeignEnv {
    fn drop(&mut self) {
        self.kill();
    }
}

#[cfg(target_os = "linux")]
fn die_with_parent(cmd: &mut Command) {
    #[expect(
        unsafe_code,
        reason = "pre_exec is the only way to set PR_SET_PDEATHSIG in the child"
    )]
    // SAFETY: the closure only calls prctl, which is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_parent(_cmd: &mut Command) {}

async fn forward_stderr(
    stderr: tokio::process::ChildStderr,
    name: String,
    tail: std::sync::Arc<std::sync::Mutex<String>>,
) {
    use tokio::io::AsyncBufReadExt;
    let mut lines = tokio::io::BufReader::new(stderr).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        tracing::debug!(env = %name, "{line}");
        if let Ok(mut t) = tail.lock() {
            t.push_str(&line);
            t.push('\n');
            if t.len() > 4096 {
                let cut = t.len() - 4096;
                let cut = (cut..t.len()).find(|&i| t.is_char_boundary(i)).unwrap_or(0);
                t.drain(..cut);
            }
        }
    }
}

/// Route state of the proxy.
#[derive(Clone)]
struct Upstream {
    base: String,
    http: reqwest::Client,
    max_body: usize,
}

/// How long the proxy waits for the upstream to answer a WebSocket upgrade.
const UPSTREAM_UPGRADE_TIMEOUT: Duration = Duration::from_secs(30);

/// How long the proxy waits for the upstream to answer an HTTP request.
const UPSTREAM_REQUEST_TIMEOUT: Duration = Duration::from_secs(300);

/// A reverse proxy to the OpenEnv server at `upstream`: every HTTP request and every
/// WebSocket (frame by frame) is forwarded unchanged.
///
/// A WebSocket is opened upstream before the client's upgrade is answered, so an
/// upgrade the upstream refuses (a 403, say) reaches the client as that refusal. An
/// HTTP request that fails because the pooled connection it went out on was already
/// closed by the upstream (uvicorn closes the connection after an unhandled
/// exception's 500, racing the pool) is sent once more on a fresh one
/// (`stale_connection`).
pub fn proxy_router(upstream: &str, max_body_bytes: usize) -> Router {
    let state = Upstream {
        base: upstream.trim_end_matches('/').to_owned(),
        http: reqwest::Client::builder()
            .timeout(UPSTREAM_REQUEST_TIMEOUT)
            .build()
            .expect("a plain reqwest client builds"),
        max_body: max_body_bytes,
    };
    Router::new().fallback(forward).with_state(state)
}

/// Headers of the client's upgrade request that belong to its own handshake with us,
/// not to ours with the upstream (which makes its own key and offers no extensions).
const WEBSOCKET_HANDSHAKE: [&str; 4] = [
    "sec-websocket-key",
    "sec-websocket-version",
    "sec-websocket-extensions",
    "sec-websocket-accept",
];

fn copy_headers(from: &HeaderMap, to: &mut HeaderMap) {
    for (name, value) in from {
        if !HOP_BY_HOP_HEADERS.contains(&name.as_str())
            && name != "host"
            && name != "content-length"
        {
            to.append(name.clone(), value.clone());
        }
    }
}

/// Whether a failed upstream request never got an answer because its connection was
/// unusable: it could not be opened, or the upstream closed it (end of stream or
/// reset) before a complete response head. The body is held in memory (bounded by
/// `max_body`), so the proxy can send it once more, whatever the method.
///
/// The case this is for is a pooled connection the upstream closed while idle
/// (uvicorn after an unhandled exception's 500): the request was never read. An
/// upstream that dies while handling a request also ends here and gets that request
/// a second time; for OpenEnv's HTTP routes that is harmless (`/reset` and `/step`
/// build a fresh environment per call), and a server that crashed mid-request is
/// rarely up to serve the copy. Disabling pooling instead would avoid the guess but
/// costs a connection per request (measured 0.5 ms vs 1.1 ms median for `GET
/// /health` through the proxy to uvicorn on a loaded 2-core machine). A timeout, or
/// an error once a response has begun, is never retried.
fn stale_connection(error: &reqwest::Error) -> bool {
    if error.is_timeout() {
        return false;
    }
    if error.is_connect() {
        return true;
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(error);
    while let Some(e) = source {
        if let Some(h) = e.downcast_ref::<hyper::Error>()
            && (h.is_incomplete_message() || h.is_canceled())
        {
            return true;
        }
        if let Some(io) = e.downcast_ref::<std::io::Error>()
            && matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::BrokenPipe
            )
        {
            return true;
        }
        source = e.source();
    }
    false
}

async fn forward(State(up): State<Upstream>, request: Request) -> Response {
    let (mut parts, body) = request.into_parts();
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    let is_upgrade = parts
        .headers
        .get("upgrade")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("websocket"));
    if is_upgrade {
        let upgrade = match WebSocketUpgrade::from_request_parts(&mut parts, &()).await {
            Ok(u) => u,
            Err(rejection) => return rejection.into_response(),
        };
        return forward_upgrade(&up, upgrade, &parts.headers, &path).await;
    }
    let body = match axum::body::to_bytes(body, up.max_body).await {
        Ok(b) => b,
        Err(_) => {
            return (
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("request body larger than {} bytes", up.max_body),
            )
                .into_response();
        }
    };
    let mut headers = HeaderMap::new();
    copy_headers(&parts.headers, &mut headers);
    let url = format!("{}{path}", up.base);
    let send = || {
        up.http
            .request(parts.method.clone(), &url)
            .headers(headers.clone())
            .body(body.clone())
            .send()
    };
    let mut sent = send().await;
    if let Err(e) = &sent
        && stale_connection(e)
    {
        tracing::debug!(%url, error = %e, "upstream connection was closed before it answered; sending once more");
        sent = send().await;
    }
    match sent {
        Ok(response) => {
            let status = response.status();
            let mut out_headers = HeaderMap::new();
            copy_headers(response.headers(), &mut out_headers);
            let bytes = response.bytes().await.unwrap_or_default();
            let mut out = Response::new(Body::from(bytes));
            *out.status_mut() = status;
            *out.headers_mut() = out_headers;
            out
        }
        Err(e) => bad_gateway(&url, &e),
    }
}

fn bad_gateway(url: &str, error: &dyn std::fmt::Display) -> Response {
    (
        StatusCode::BAD_GATEWAY,
        axum::Json(serde_json::json!({"detail": format!("upstream {url} failed: {error}")})),
    )
        .into_response()
}

/// Opens the WebSocket upstream first (with the client's headers, less those of its
/// own handshake), then answers the client: with the upgrade and a bridge when the
/// upstream accepted, with the upstream's own status, headers and body when it
/// refused, with 502 when it could not be reached.
async fn forward_upgrade(
    up: &Upstream,
    upgrade: WebSocketUpgrade,
    client_headers: &HeaderMap,
    path: &str,
) -> Response {
    let target = match route_url(&up.base, path, true) {
        Ok(t) => t,
        Err(e) => return bad_gateway(&up.base, &e),
    };
    let mut request = match target.as_str().into_client_request() {
        Ok(r) => r,
        Err(e) => return bad_gateway(&target, &e),
    };
    for (name, value) in client_headers {
        let name_str = name.as_str();
        if !HOP_BY_HOP_HEADERS.contains(&name_str)
            && !WEBSOCKET_HANDSHAKE.contains(&name_str)
            && name != "host"
            && name != "content-length"
        {
            request.headers_mut().append(name.clone(), value.clone());
        }
    }
    let connecting = tokio_tungstenite::connect_async(request);
    match tokio::time::timeout(UPSTREAM_UPGRADE_TIMEOUT, connecting).await {
        Ok(Ok((socket, response))) => {
            let mut upgrade = upgrade.max_message_size(up.max_body);
            if let Some(protocol) = response
                .headers()
                .get("sec-websocket-protocol")
                .and_then(|v| v.to_str().ok())
            {
                upgrade = upgrade.protocols([protocol.to_owned()]);
            }
            upgrade.on_upgrade(move |client| bridge(client, socket))
        }
        Ok(Err(TError::Http(refusal))) => {
            let (head, body) = (*refusal).into_parts();
            tracing::debug!(%target, status = %head.status, "upstream refused the WebSocket");
            let mut out = Response::new(Body::from(body.unwrap_or_default()));
            *out.status_mut() = head.status;
            copy_headers(&head.headers, out.headers_mut());
            out
        }
        Ok(Err(e)) => {
            tracing::warn!(%target, error = %e, "upstream WebSocket failed");
            bad_gateway(&target, &e)
        }
        Err(_) => bad_gateway(
            &target,
            &format!("no answer to the upgrade within {UPSTREAM_UPGRADE_TIMEOUT:?}"),
        ),
    }
}

/// Forwards frames both ways until either side closes.
async fn bridge(
    client: axum::extract::ws::WebSocket,
    upstream: tokio_tungstenite::WebSocketStream<
        tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>,
    >,
) {
    let (mut client_tx, mut client_rx) = client.split();
    let (mut up_tx, mut up_rx) = upstream.split();
    let to_upstream = async {
        while let Some(Ok(message)) = client_rx.next().await {
            let message = match message {
                AxumMessage::Text(t) => TMessage::Text(t.as_str().into()),
                AxumMessage::Binary(b) => TMessage::Binary(b),
                AxumMessage::Ping(p) => TMessage::Ping(p),
                AxumMessage::Pong(p) => TMessage::Pong(p),
                AxumMessage::Close(frame) => {
                    let _ = up_tx
                        .send(TMessage::Close(frame.map(|f| {
                            tokio_tungstenite::tungstenite::protocol::CloseFrame {
                                code: f.code.into(),
                                reason: f.reason.as_str().into(),
                            }
                        })))
                        .await;
                    break;
                }
            };
            if up_tx.send(message).await.is_err() {
                break;
            }
        }
    };
    let to_client = async {
        while let Some(Ok(message)) = up_rx.next().await {
            let message = match message {
                TMessage::Text(t) => AxumMessage::Text(t.as_str().into()),
                TMessage::Binary(b) => AxumMessage::Binary(b),
                TMessage::Ping(p) => AxumMessage::Ping(p),
                TMessage::Pong(p) => AxumMessage::Pong(p),
                TMessage::Close(frame) => {
                    let _ = client_tx
                        .send(AxumMessage::Close(frame.map(|f| AxumCloseFrame {
                            code: f.code.into(),
                            reason: f.reason.as_str().into(),
                        })))
                        .await;
                    break;
                }
                TMessage::Frame(_) => continue,
            };
            if client_tx.send(message).await.is_err() {
                break;
            }
        }
    };
    tokio::select! {
        () = to_upstream => {}
        () = to_client => {}
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    use super::*;

    /// Requests sent through the proxy after the upstream dropped a connection.
    const REQUESTS_AFTER_DROP: usize = 20;

    /// Request body limit of the proxies under test.
    const MAX_BODY: usize = 1 << 20;

    /// Serves `router` on a loopback port and returns its base URL.
    async fn serve(router: Router) -> String {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router).await });
        format!("http://{addr}")
    }

    /// Reads one request head (and no body: the tests send none).
    async fn read_head(socket: &mut TcpStream) -> bool {
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            match socket.read(&mut byte).await {
                Ok(1) => head.push(byte[0]),
                _ => return false,
            }
        }
        true
    }

    /// An upstream that, on the first connection, answers the first request with a
    /// keep-alive 500 and then closes the connection when the next request arrives on
    /// it, without a byte of response: the worst case of uvicorn closing a connection
    /// after an unhandled exception, made deterministic. Every other request gets 200.
    async fn drops_after_500() -> String {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let crashed = Arc::new(AtomicBool::new(false));
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let crashed = crashed.clone();
                tokio::spawn(async move {
                    let this_one_crashes = !crashed.swap(true, Ordering::SeqCst);
                    let mut answered = 0;
                    while read_head(&mut socket).await {
                        let reply: &[u8] = match (this_one_crashes, answered) {
                            (true, 0) => {
                                b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 5\r\n\r\nboom!"
                            }
                            (true, _) => return,
                            (false, _) => b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
                        };
                        answered += 1;
                        if socket.write_all(reply).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        format!("http://{addr}")
    }

    #[tokio::test]
    async fn no_false_502_after_the_upstream_drops_a_pooled_connection() {
        let upstream = drops_after_500().await;
        let proxy = serve(proxy_router(&upstream, MAX_BODY)).await;
        let client = reqwest::Client::new();
        let first = client.get(format!("{proxy}/crash")).send().await.unwrap();
        assert_eq!(first.status(), 500);
        let mut statuses = Vec::new();
        for _ in 0..REQUESTS_AFTER_DROP {
            let response = client
                .post(format!("{proxy}/step"))
                .body("")
                .send()
                .await
                .unwrap();
            statuses.push(response.status().as_u16());
        }
        assert!(
            statuses.iter().all(|&s| s == 200),
            "statuses after the dropped connection: {statuses:?}"
        );
    }

    #[tokio::test]
    async fn a_refused_websocket_reaches_the_client_as_the_refusal() {
        async fn refuse() -> Response {
            (StatusCode::FORBIDDEN, "no such session").into_response()
        }
        async fn accept(ws: WebSocketUpgrade) -> Response {
            ws.on_upgrade(|mut socket| async move {
                while let Some(Ok(message)) = socket.recv().await {
                    if socket.send(message).await.is_err() {
                        break;
                    }
                }
            })
        }
        let upstream = serve(
            Router::new()
                .route("/refused", axum::routing::get(refuse))
                .route("/ws", axum::routing::get(accept)),
        )
        .await;
        let proxy = serve(proxy_router(&upstream, MAX_BODY)).await;
        let ws = proxy.replace("http://", "ws://");

        match tokio_tungstenite::connect_async(format!("{ws}/refused")).await {
            Err(TError::Http(response)) => {
                assert_eq!(response.status(), StatusCode::FORBIDDEN);
                assert_eq!(
                    response.body().as_deref(),
                    Some(b"no such session".as_slice())
                );
            }
            Ok(_) => panic!("the proxy accepted a WebSocket its upstream refused"),
            Err(e) => panic!("expected the upstream's 403, got {e}"),
        }

        // An accepted one still bridges frames both ways.
        let (mut socket, _) = tokio_tungstenite::connect_async(format!("{ws}/ws"))
            .await
            .unwrap();
        socket.send(TMessage::Text("ping".into())).await.unwrap();
        let echoed = socket.next().await.unwrap().unwrap();
        assert_eq!(echoed, TMessage::Text("ping".into()));
    }

    #[tokio::test]
    async fn an_unreachable_upstream_websocket_is_a_502() {
        let port = free_port().unwrap();
        let proxy = serve(proxy_router(&format!("http://127.0.0.1:{port}"), MAX_BODY)).await;
        let ws = proxy.replace("http://", "ws://");
        match tokio_tungstenite::connect_async(format!("{ws}/ws")).await {
            Err(TError::Http(response)) => assert_eq!(response.status(), StatusCode::BAD_GATEWAY),
            other => panic!("expected 502, got {:?}", other.map(|_| ())),
        }
    }

    #[test]
    fn python_identifiers() {
        for ok in ["grid_world_env", "_x", "env2"] {
            assert!(is_python_identifier(ok), "{ok}");
        }
        for bad in ["", "2env", "my-env", "a.b", "é"] {
            assert!(!is_python_identifier(bad), "{bad}");
        }
    }

    fn write(path: &Path, text: &str) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }

    #[test]
    fn a_package_without_a_manifest_serves_server_app_with_the_package_form_as_fallback() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("chess_like_env");
        write(&dir.join("server/app.py"), "app = None\n");
        let command = ForeignCommand::package(&dir, "python3").unwrap();
        assert_eq!(command.name, "chess_like_env");
        assert_eq!(command.argv[3], "server.app:app");
        let dir = dir.canonicalize().unwrap();
        assert_eq!(command.cwd.as_deref(), Some(dir.as_path()));
        let fallback = command.fallback.expect("a package form");
        assert_eq!(fallback.argv[3], "chess_like_env.server.app:app");
        assert_eq!(fallback.cwd.as_deref(), dir.parent());
        let path = &fallback.env[0].1;
        assert!(
            path.starts_with(&format!("{}:", dir.parent().unwrap().display())),
            "the parent comes first on PYTHONPATH: {path}"
        );
    }

    #[test]
    fn the_manifest_app_is_served_first() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("wild_env");
        write(
            &dir.join("openenv.yaml"),
            "name: wildfire\napp: server.main:api\n",
        );
        let command = ForeignCommand::package(&dir, "python3").unwrap();
        assert_eq!(command.name, "wildfire");
        assert_eq!(command.argv[3], "server.main:api");
        assert_eq!(
            command.fallback.expect("a package form").argv[3],
            "wild_env.server.main:api"
        );
    }

    #[test]
    fn a_directory_that_is_no_package_is_refused_with_a_hint() {
        let root = tempfile::tempdir().unwrap();
        let error = ForeignCommand::package(root.path(), "python3").unwrap_err();
        assert!(matches!(error, ForeignError::NotAPackage { .. }), "{error}");
        assert!(error.to_string().contains("hint:"), "{error}");
    }

    #[test]
    fn a_directory_python_cannot_import_has_no_package_form() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("my-env");
        write(&dir.join("server/app.py"), "app = None\n");
        let command = ForeignCommand::package(&dir, "python3").unwrap();
        assert!(command.fallback.is_none());
    }
}
