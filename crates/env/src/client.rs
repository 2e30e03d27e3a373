//! A client for any OpenEnv-compatible server: WebSocket sessions (typed or JSON),
//! the HTTP routes, MCP JSON-RPC, and a pool of parallel sessions.
//!
//! Every call has a time limit; a server error frame becomes
//! [`ClientError::Server`] with the server's code and message. Clients never
//! reconnect silently: a broken session is an error the caller sees.
//!
//! A server started with API keys (`agentstack env serve --api-key`) asks for one on
//! every route but `/health`: [`ClientConfig::api_key`] is sent as `Authorization:
//! Bearer KEY` on HTTP requests and WebSocket upgrades, and a 401 becomes
//! [`ClientError::Unauthorized`], which says to set `AGENTSTACK_API_KEY`.

use std::marker::PhantomData;
use std::time::Duration;

use agentstack_protocol::http::{
    EnvironmentMetadata, HealthResponse, ResetRequest, SchemaResponse,
};
use agentstack_protocol::mcp::{JsonRpcRequest, JsonRpcResponse, RequestId};
use agentstack_protocol::tasks::{Split, SplitRequest, TasksResponse};
use agentstack_protocol::ws::{ClientMessage, ServerMessage, StepResult, WsError};
use futures_util::{SinkExt, StreamExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

pub use agentstack_serve::auth::{API_KEY_ENV, ApiKey};

use crate::tasks::TaskList;

/// Time and size limits of a client, and the key it sends.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Longest wait to open a connection.
    pub connect_timeout: Duration,
    /// Longest wait for one reply.
    pub message_timeout: Duration,
    /// Largest message accepted from the server, bytes.
    pub max_message_bytes: usize,
    /// The API key sent as `Authorization: Bearer KEY` on HTTP requests and WebSocket
    /// upgrades, for a server started with keys; none: no header. Redacted in `Debug`.
    pub api_key: Option<ApiKey>,
}

impl Default for ClientConfig {
    /// The Python client's defaults: 10 s to connect, 60 s per message, 100 MB; no key.
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(10),
            message_timeout: Duration::from_secs(60),
            max_message_bytes: 100 * 1024 * 1024,
            api_key: None,
        }
    }
}

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The URL is not `http(s)://` or `ws(s)://`.
    #[error("'{0}' is not an http:// or ws:// URL")]
    InvalidUrl(String),
    /// The connection could not be opened.
    #[error("could not connect to {url}")]
    Connect {
        /// Where.
        url: String,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// No reply in time.
    #[error("{what} timed out after {after:?}")]
    Timeout {
        /// What was waited for.
        what: &'static str,
        /// How long.
        after: Duration,
    },
    /// The server answered with an error frame.
    #[error("server error: {0}")]
    Server(WsError),
    /// The server closed the session.
    #[error("the server closed the session{}", .0.as_deref().map(|r| format!(": {r}")).unwrap_or_default())]
    Closed(Option<String>),
    /// The server sent something that is not the protocol.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// Transport failure on an open socket.
    #[error("WebSocket failure")]
    WebSocket(#[source] tokio_tungstenite::tungstenite::Error),
    /// An HTTP call failed.
    #[error("HTTP request to {url} failed")]
    Http {
        /// The URL.
        url: String,
        /// Why.
        #[source]
        source: reqwest::Error,
    },
    /// The server asked for an API key (HTTP 401): none was sent, or the one sent is
    /// not one of its keys.
    #[error(
        "{url} answered 401 Unauthorized: {}\nhint: set {API_KEY_ENV} to one of the server's keys (those `agentstack env serve` was given with --api-key or {API_KEY_ENV})",
        if *key_sent { "the API key sent is not one of the server's" } else { "the server needs an API key" }
    )]
    Unauthorized {
        /// The URL.
        url: String,
        /// Whether a key was sent.
        key_sent: bool,
    },
    /// An HTTP call got a non-success status.
    #[error("HTTP {status} from {url}: {body}")]
    Status {
        /// The URL.
        url: String,
        /// The status code.
        status: u16,
        /// The body, for the reader.
        body: String,
    },
}

/// Turns a base URL into the URL of a route: `http://h:p/echo` + `/ws` →
/// `ws://h:p/echo/ws`.
pub fn route_url(base_url: &str, route: &str, websocket: bool) -> Result<String, ClientError> {
    let base = base_url.trim_end_matches('/');
    let (scheme, rest) = base
        .split_once("://")
        .ok_or_else(|| ClientError::InvalidUrl(base_url.to_owned()))?;
    let scheme = match (scheme, websocket) {
        ("http" | "ws", true) => "ws",
        ("https" | "wss", true) => "wss",
        ("http" | "ws", false) => "http",
        ("https" | "wss", false) => "https",
        _ => return Err(ClientError::InvalidUrl(base_url.to_owned())),
    };
    Ok(format!("{scheme}://{rest}{route}"))
}

type Socket = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// One stateful session over `/ws`, with JSON actions and observations.
pub struct EnvClient {
    socket: Socket,
    config: ClientConfig,
    next_rpc_id: i64,
}

impl EnvClient {
    /// Opens a new session on the server at `base_url`.
    pub async fn connect(base_url: &str, config: ClientConfig) -> Result<Self, ClientError> {
        Self::open(route_url(base_url, "/ws", true)?, config).await
    }

    /// Attaches to a session made with `openenv/session/create`.
    pub async fn attach(
        base_url: &str,
        session_id: &str,
        config: ClientConfig,
    ) -> Result<Self, ClientError> {
        let url = format!(
            "{}?session_id={session_id}",
            route_url(base_url, "/ws", true)?
        );
        Self::open(url, config).await
    }

    async fn open(url: String, config: ClientConfig) -> Result<Self, ClientError> {
        let mut ws_config = WebSocketConfig::default();
        ws_config.max_message_size = Some(config.max_message_bytes);
        ws_config.max_frame_size = Some(config.max_message_bytes);
        let connect_error = |e| ClientError::Connect {
            url: url.clone(),
            source: Box::new(e),
        };
        let mut request = url.as_str().into_client_request().map_err(connect_error)?;
        if let Some(key) = &config.api_key {
            let mut value: reqwest::header::HeaderValue =
                format!("Bearer {}", key.expose()).parse().map_err(|_| {
                    ClientError::Protocol("the API key is not a valid header value".into())
                })?;
            value.set_sensitive(true);
            request.headers_mut().insert("authorization", value);
        }
        let connecting =
            tokio_tungstenite::connect_async_with_config(request, Some(ws_config), true);
        let (socket, _) = tokio::time::timeout(config.connect_timeout, connecting)
            .await
            .map_err(|_| ClientError::Timeout {
                what: "connecting",
                after: config.connect_timeout,
            })?
            .map_err(|e| match e {
                tokio_tungstenite::tungstenite::Error::Http(response)
                    if response.status() == reqwest::StatusCode::UNAUTHORIZED =>
                {
                    ClientError::Unauthorized {
                        url: url.clone(),
                        key_sent: config.api_key.is_some(),
                    }
                }
                e => connect_error(e),
            })?;
        Ok(Self {
            socket,
            config,
            next_rpc_id: 1,
        })
    }

    /// Sends one raw text frame and returns the reply, whatever it is (also error
    /// frames, as `Ok`). For conformance testing.
    pub async fn request_raw(&mut self, frame: String) -> Result<ServerMessage, ClientError> {
        self.socket
            .send(Message::Text(frame.into()))
            .await
            .map_err(ClientError::WebSocket)?;
        self.receive().await
    }

    /// Sends a raw frame without waiting for a reply.
    pub async fn send_raw(&mut self, message: Message) -> Result<(), ClientError> {
        self.socket
            .send(message)
            .await
            .map_err(ClientError::WebSocket)
    }

    /// Waits for the next protocol frame.
    pub async fn receive(&mut self) -> Result<ServerMessage, ClientError> {
        let limit = self.config.message_timeout;
        loop {
            let next = tokio::time::timeout(limit, self.socket.next())
                .await
                .map_err(|_| ClientError::Timeout {
                    what: "waiting for the server's reply",
                    after: limit,
                })?;
            match next {
                None => return Err(ClientError::Closed(None)),
                Some(Err(e)) => return Err(ClientError::WebSocket(e)),
                Some(Ok(Message::Text(text))) => {
                    return agentstack_protocol::ws::parse_server_message(text.as_str())
                        .map_err(|e| ClientError::Protocol(format!("{e}: {}", text.as_str())));
                }
                Some(Ok(Message::Close(frame))) => {
                    return Err(ClientError::Closed(
                        frame.map(|f| format!("code {} {}", u16::from(f.code), f.reason)),
                    ));
                }
                Some(Ok(Message::Binary(_))) => {
                    return Err(ClientError::Protocol("unexpected binary frame".into()));
                }
                Some(Ok(_)) => continue,
            }
        }
    }

    async fn call(&mut self, message: ClientMessage<'_>) -> Result<ServerMessage, ClientError> {
        match self.request_raw(message.to_json()).await? {
            ServerMessage::Error(err) => Err(ClientError::Server(err)),
            other => Ok(other),
        }
    }

    fn observation(reply: ServerMessage) -> Result<StepResult, ClientError> {
        match reply {
            ServerMessage::Observation(result) => Ok(result),
            other => Err(ClientError::Protocol(format!(
                "expected an observation, got {}",
                other.to_json()
            ))),
        }
    }

    /// Starts a new episode.
    pub async fn reset(&mut self, request: ResetRequest) -> Result<StepResult, ClientError> {
        let data = serde_json::value::to_raw_value(&request).expect("reset requests serialize");
        let reply = self.call(ClientMessage::Reset(&data)).await?;
        Self::observation(reply)
    }

    /// Applies one action (any value that serializes to a JSON object).
    pub async fn step<A: Serialize + ?Sized>(
        &mut self,
        action: &A,
    ) -> Result<StepResult, ClientError> {
        let data = serde_json::value::to_raw_value(action)
            .map_err(|e| ClientError::Protocol(format!("action does not serialize: {e}")))?;
        let reply = self.call(ClientMessage::Step(&data)).await?;
        Self::observation(reply)
    }

    /// The environment's state.
    pub async fn state(&mut self) -> Result<Map<String, Value>, ClientError> {
        match self.call(ClientMessage::State).await? {
            ServerMessage::State(state) => Ok(state),
            other => Err(ClientError::Protocol(format!(
                "expected a state, got {}",
                other.to_json()
            ))),
        }
    }

    /// A JSON-RPC call through the session (`{"type":"mcp"}`).
    pub async fn mcp(
        &mut self,
        method: &str,
        params: Map<String, Value>,
    ) -> Result<JsonRpcResponse, ClientError> {
        let id = self.next_rpc_id;
        self.next_rpc_id += 1;
        let request = JsonRpcRequest::new(method, params, Some(RequestId::Number(id)));
        let data = serde_json::value::to_raw_value(&request).expect("requests serialize");
        match self.call(ClientMessage::Mcp(&data)).await? {
            ServerMessage::Mcp(value) => serde_json::from_value(value)
                .map_err(|e| ClientError::Protocol(format!("bad JSON-RPC response: {e}"))),
            other => Err(ClientError::Protocol(format!(
                "expected an mcp reply, got {}",
                other.to_json()
            ))),
        }
    }

    /// Ends the session: sends `close` and waits for the server to close the socket.
    pub async fn close(mut self) -> Result<(), ClientError> {
        self.socket
            .send(Message::Text(ClientMessage::Close.to_json().into()))
            .await
            .map_err(ClientError::WebSocket)?;
        let limit = self.config.message_timeout;
        let _ = tokio::time::timeout(limit, async {
            while let Some(Ok(message)) = self.socket.next().await {
                if matches!(message, Message::Close(_)) {
                    break;
                }
            }
        })
        .await;
        Ok(())
    }
}

/// A session with typed actions and observations.
pub struct TypedEnvClient<A, O> {
    inner: EnvClient,
    types: PhantomData<fn(A) -> O>,
}

impl<A: Serialize, O: DeserializeOwned> TypedEnvClient<A, O> {
    /// Opens a new session.
    pub async fn connect(base_url: &str, config: ClientConfig) -> Result<Self, ClientError> {
        Ok(Self {
            inner: EnvClient::connect(base_url, config).await?,
            types: PhantomData,
        })
    }

    fn typed(result: StepResult) -> Result<StepResult<O>, ClientError> {
        let observation =
            serde_json::from_value(Value::Object(result.observation)).map_err(|e| {
                ClientError::Protocol(format!("observation does not fit its type: {e}"))
            })?;
        Ok(StepResult {
            observation,
            reward: result.reward,
            done: result.done,
            metadata: result.metadata,
        })
    }

    /// Starts a new episode.
    pub async fn reset(&mut self, request: ResetRequest) -> Result<StepResult<O>, ClientError> {
        Self::typed(self.inner.reset(request).await?)
    }

    /// Applies one action.
    pub async fn step(&mut self, action: &A) -> Result<StepResult<O>, ClientError> {
        Self::typed(self.inner.step(action).await?)
    }

    /// The state.
    pub async fn state(&mut self) -> Result<Map<String, Value>, ClientError> {
        self.inner.state().await
    }

    /// Ends the session.
    pub async fn close(self) -> Result<(), ClientError> {
        self.inner.close().await
    }

    /// The untyped client underneath.
    pub fn untyped(&mut self) -> &mut EnvClient {
        &mut self.inner
    }
}

/// The HTTP side of a server: health, metadata, schemas, MCP JSON-RPC, stateless
/// reset/step.
#[derive(Clone)]
pub struct HttpClient {
    base: String,
    http: reqwest::Client,
    next_rpc_id: std::sync::Arc<std::sync::atomic::AtomicI64>,
    api_key: Option<ApiKey>,
}

impl HttpClient {
    /// A client for the server at `base_url` with `config`'s key and its message
    /// timeout per request.
    pub fn from_config(base_url: &str, config: &ClientConfig) -> Result<Self, ClientError> {
        let mut client = Self::new(base_url, config.message_timeout)?;
        client.api_key = config.api_key.clone();
        Ok(client)
    }

    /// A client for the server at `base_url`, with `timeout` per request and no key.
    pub fn new(base_url: &str, timeout: Duration) -> Result<Self, ClientError> {
        let base = route_url(base_url, "", false)?;
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .map_err(|e| ClientError::Http {
                url: base.clone(),
                source: e,
            })?;
        Ok(Self {
            base,
            http,
            next_rpc_id: std::sync::Arc::new(std::sync::atomic::AtomicI64::new(1)),
            api_key: None,
        })
    }

    /// The base URL.
    pub fn base_url(&self) -> &str {
        &self.base
    }

    /// GETs `route` and returns the status and JSON body (`Null` if not JSON); a 401
    /// is [`ClientError::Unauthorized`].
    pub async fn get_json(&self, route: &str) -> Result<(u16, Value), ClientError> {
        let url = format!("{}{route}", self.base);
        let request = self.http.get(&url);
        self.send(url, request).await
    }

    /// POSTs `body` (raw text) to `route` and returns the status and JSON body; a 401
    /// is [`ClientError::Unauthorized`].
    pub async fn post_json(&self, route: &str, body: String) -> Result<(u16, Value), ClientError> {
        let url = format!("{}{route}", self.base);
        let request = self
            .http
            .post(&url)
            .header("content-type", "application/json")
            .body(body);
        self.send(url, request).await
    }

    /// Sends `request` with the key and returns the status and JSON body (`Null` if
    /// not JSON).
    async fn send(
        &self,
        url: String,
        mut request: reqwest::RequestBuilder,
    ) -> Result<(u16, Value), ClientError> {
        if let Some(key) = &self.api_key {
            request = request.bearer_auth(key.expose());
        }
        let http_error = |source| ClientError::Http {
            url: url.clone(),
            source,
        };
        let response = request.send().await.map_err(http_error)?;
        let status = response.status().as_u16();
        if response.status() == reqwest::StatusCode::UNAUTHORIZED {
            return Err(ClientError::Unauthorized {
                url,
                key_sent: self.api_key.is_some(),
            });
        }
        let text = response.text().await.map_err(http_error)?;
        Ok((status, serde_json::from_str(&text).unwrap_or(Value::Null)))
    }

    async fn get_typed<T: DeserializeOwned>(&self, route: &str) -> Result<T, ClientError> {
        let (status, body) = self.get_json(route).await?;
        self.decode(route, status, body)
    }

    async fn post_typed<T: DeserializeOwned>(
        &self,
        route: &str,
        request: &impl Serialize,
    ) -> Result<T, ClientError> {
        let body = serde_json::to_string(request).expect("requests serialize");
        let (status, body) = self.post_json(route, body).await?;
        self.decode(route, status, body)
    }

    /// A 2xx answer's body as `T`; any other status, or a body of another shape, is an
    /// error naming the URL.
    fn decode<T: DeserializeOwned>(
        &self,
        route: &str,
        status: u16,
        body: Value,
    ) -> Result<T, ClientError> {
        let url = format!("{}{route}", self.base);
        if !(200..300).contains(&status) {
            return Err(ClientError::Status {
                url,
                status,
                body: body.to_string(),
            });
        }
        serde_json::from_value(body.clone())
            .map_err(|e| ClientError::Protocol(format!("unexpected body from {url}: {e}: {body}")))
    }

    /// `GET /health`.
    pub async fn health(&self) -> Result<HealthResponse, ClientError> {
        self.get_typed("/health").await
    }

    /// `GET /metadata`.
    pub async fn metadata(&self) -> Result<EnvironmentMetadata, ClientError> {
        self.get_typed("/metadata").await
    }

    /// `GET /schema`.
    pub async fn schema(&self) -> Result<SchemaResponse, ClientError> {
        self.get_typed("/schema").await
    }

    /// The task list of the environment `env_name` through the Task API: `GET
    /// /{env}/splits`, then `POST /{env}/tasks` for each split. `None` when the server
    /// has no Task API or no tasks for it (any non-2xx answer to `/splits`, as
    /// OpenEnv's servers without one give). The base URL may be the server's root or
    /// the environment's own prefix (`http://host:port/{env}`).
    pub async fn task_list(&self, env_name: &str) -> Result<Option<TaskList>, ClientError> {
        let prefix = if self.base.ends_with(&format!("/{env_name}")) {
            String::new()
        } else {
            format!("/{env_name}")
        };
        let route = format!("{prefix}/splits");
        let (status, body) = self.get_json(&route).await?;
        if !(200..300).contains(&status) {
            return Ok(None);
        }
        let splits: Vec<Split> = self.decode(&route, status, body)?;
        let mut list = TaskList::new();
        for split in splits {
            let request = SplitRequest {
                split: split.name.clone(),
            };
            let reply: TasksResponse = self
                .post_typed(&format!("{prefix}/tasks"), &request)
                .await?;
            list.insert(split, reply.tasks);
        }
        Ok(Some(list))
    }

    /// `POST /mcp` with a JSON-RPC request.
    pub async fn mcp(
        &self,
        method: &str,
        params: Map<String, Value>,
    ) -> Result<JsonRpcResponse, ClientError> {
        let id = self
            .next_rpc_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let request = JsonRpcRequest::new(method, params, Some(RequestId::Number(id)));
        let (status, body) = self
            .post_json(
                "/mcp",
                serde_json::to_string(&request).expect("requests serialize"),
            )
            .await?;
        if status != 200 {
            return Err(ClientError::Status {
                url: format!("{}/mcp", self.base),
                status,
                body: body.to_string(),
            });
        }
        serde_json::from_value(body)
            .map_err(|e| ClientError::Protocol(format!("bad JSON-RPC response: {e}")))
    }

    /// Polls `/health` until it answers healthy or `within` passes.
    pub async fn wait_healthy(&self, within: Duration) -> Result<(), ClientError> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if matches!(self.health().await, Ok(h) if h == HealthResponse::HEALTHY) {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(ClientError::Timeout {
                    what: "waiting for /health",
                    after: within,
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Many parallel sessions on one server.
pub struct EnvPool {
    clients: Vec<EnvClient>,
}

impl EnvPool {
    /// Opens `size` sessions, at most `parallel` connecting at once.
    pub async fn connect(
        base_url: &str,
        size: usize,
        parallel: usize,
        config: ClientConfig,
    ) -> Result<Self, ClientError> {
        let clients = futures_util::stream::iter(
            (0..size).map(|_| EnvClient::connect(base_url, config.clone())),
        )
        .buffer_unordered(parallel.max(1))
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { clients })
    }

    /// The sessions, to drive concurrently (e.g. with `join_all` over `iter_mut`).
    pub fn clients(&mut self) -> &mut [EnvClient] {
        &mut self.clients
    }

    /// Closes every session.
    pub async fn close(self) -> Result<(), ClientError> {
        for client in self.clients {
            client.close().await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_urls() {
        assert_eq!(
            route_url("http://h:1/echo/", "/ws", true).unwrap(),
            "ws://h:1/echo/ws"
        );
        assert_eq!(
            route_url("https://o-n.hf.space", "/ws", true).unwrap(),
            "wss://o-n.hf.space/ws"
        );
        assert_eq!(
            route_url("ws://h:1", "/health", false).unwrap(),
            "http://h:1/health"
        );
        assert!(matches!(
            route_url("h:1", "/ws", true),
            Err(ClientError::InvalidUrl(_))
        ));
        assert!(matches!(
            route_url("ftp://h", "/ws", true),
            Err(ClientError::InvalidUrl(_))
        ));
    }
}
