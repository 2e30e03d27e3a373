//! Foreign environments: any OpenEnv-compatible server run as a child process (a
//! Python OpenEnv package with its `openenv.yaml`, or any command line), and a
//! reverse proxy that serves it through our address.
//!
//! The child runs in its own process group, is told to die with us
//! (`PR_SET_PDEATHSIG` on Linux), and is killed with its group when the
//! [`ForeignEnv`] is dropped, so no server outlives the command that started it.

use std::net::{Ipv4Addr, SocketAddr, TcpListener as StdListener};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ws::{CloseFrame as AxumCloseFrame, Message as AxumMessage, WebSocketUpgrade};
use axum::extract::{FromRequestParts, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::{SinkExt, StreamExt};
use serde::Deserialize;
use tokio::process::{Child, Command};
use tokio_tungstenite::tungstenite::Message as TMessage;

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
}

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
    /// `python -m uvicorn <app> --host {host} --port {port}`, run in `dir`.
    pub fn python_package(dir: &Path, python: &str) -> Result<Self, ForeignError> {
        let manifest = OpenEnvManifest::read(dir)?;
        let app = manifest.app.unwrap_or_else(|| "server.app:app".to_owned());
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
        let pythonpath = match std::env::var("PYTHONPATH") {
            Ok(p) if !p.is_empty() => format!("{}:{}:{p}", dir.display(), parent.display()),
            _ => format!("{}:{}", dir.display(), parent.display()),
        };
        Ok(Self {
            argv: [
                python,
                "-m",
                "uvicorn",
                &app,
                "--host",
                "{host}",
                "--port",
                "{port}",
                "--log-level",
                "warning",
            ]
            .map(str::to_owned)
            .to_vec(),
            cwd: Some(dir),
            env: vec![("PYTHONPATH".into(), pythonpath)],
            name: manifest.name,
        })
    }

    /// The command that serves the package in `dir`: its `agentstack.serve` command
    /// line (run in `dir`) when it has one, else the Python OpenEnv app served with
    /// `python` ([`ForeignCommand::python_package`]).
    pub fn package(dir: &Path, python: &str) -> Result<Self, ForeignError> {
        let manifest = OpenEnvManifest::read(dir)?;
        match manifest.agentstack.and_then(|a| a.serve) {
            Some(line) => {
                let mut command = Self::command_line(&line)?;
                command.cwd = Some(dir.canonicalize().map_err(|e| ForeignError::Manifest {
                    path: dir.to_owned(),
                    source: Box::new(e),
                })?);
                command.name = manifest.name;
                Ok(command)
            }
            None => Self::python_package(dir, python),
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
        })
    }

    fn display(&self) -> String {
        self.argv.join(" ")
    }
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
    /// `GET /health` to answer healthy.
    pub async fn start(
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
            .env("PORT", port.to_string())
            .env("HOST", host)
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

/// A reverse proxy to the OpenEnv server at `upstream`: every HTTP request and every
/// WebSocket (frame by frame) is forwarded unchanged.
pub fn proxy_router(upstream: &str, max_body_bytes: usize) -> Router {
    let state = Upstream {
        base: upstream.trim_end_matches('/').to_owned(),
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(300))
            .build()
            .expect("a plain reqwest client builds"),
        max_body: max_body_bytes,
    };
    Router::new().fallback(forward).with_state(state)
}

const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

fn copy_headers(from: &HeaderMap, to: &mut HeaderMap) {
    for (name, value) in from {
        if !HOP_BY_HOP.contains(&name.as_str()) && name != "host" && name != "content-length" {
            to.append(name.clone(), value.clone());
        }
    }
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
        let Ok(target) = route_url(&up.base, &path, true) else {
            return StatusCode::BAD_GATEWAY.into_response();
        };
        return upgrade
            .max_message_size(up.max_body)
            .on_upgrade(move |socket| bridge(socket, target));
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
    let sent = up
        .http
        .request(parts.method, &url)
        .headers(headers)
        .body(body)
        .send()
        .await;
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
        Err(e) => (
            StatusCode::BAD_GATEWAY,
            axum::Json(serde_json::json!({"detail": format!("upstream {url} failed: {e}")})),
        )
            .into_response(),
    }
}

async fn bridge(client: axum::extract::ws::WebSocket, target: String) {
    let upstream = match tokio_tungstenite::connect_async(&target).await {
        Ok((socket, _)) => socket,
        Err(e) => {
            tracing::warn!(%target, error = %e, "upstream WebSocket failed");
            let (mut tx, _) = client.split();
            let _ = tx
                .send(AxumMessage::Close(Some(AxumCloseFrame {
                    code: 1011,
                    reason: "upstream unavailable".into(),
                })))
                .await;
            return;
        }
    };
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
