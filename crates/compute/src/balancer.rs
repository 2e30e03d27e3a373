//! The load balancer in front of a service's replicas: one HTTP endpoint on the
//! service's port that spreads requests over the replicas the supervisor found ready,
//! and sends a request again to another replica when the one it went to died.
//!
//! The supervisor runs it in-process and calls [`Balancer::set_replicas`] each time the
//! set of ready replicas changes (a readiness probe passed or failed, a replica was
//! restarted under a new id). Requests go to the replica with the fewest requests in
//! flight ([`Policy::LeastLoad`], ties broken in turn) or to each in turn
//! ([`Policy::RoundRobin`]) — the names of SkyServe's `load_balancing_policy`.
//!
//! # When a request is sent again
//!
//! Request bodies are held in memory (up to [`BalancerConfig::max_body_bytes`]) so that
//! they can be sent again. Each replica gets a request at most once, and a request is
//! tried at most once more than there are ready replicas.
//!
//! - **No connection** (refused, unreachable, connect timeout): the replica never saw
//!   the request, so it goes to another replica whatever its method.
//! - **Broken after sending** (the connection was reset or closed before a complete
//!   response head, or a response body being buffered broke off) and **503** from the
//!   replica (draining, shutting down, overloaded): sent again only if the request is
//!   idempotent: `GET`, `HEAD`, `OPTIONS`, `PUT`, `DELETE`, `TRACE`, and `POST`s to
//!   [`BalancerConfig::idempotent_posts`] (on an OpenAI-compatible server, completions
//!   and embeddings are pure functions of the request). Otherwise the client gets 502
//!   (or the replica's 503), because the replica may have acted on it.
//! - **Timeouts** ([`BalancerConfig::upstream_timeout`]) are never retried: the
//!   replica may still be working on the request.
//!
//! A replica whose connection failed is skipped for [`BalancerConfig::eject_for`]
//! (passive health checking), unless the supervisor gives it again under a new id. When
//! every ready replica is skipped, the least recently skipped is tried rather than
//! failing. When no replica is left to try (none is ready, or all failed this
//! request), the request waits for [`Balancer::set_replicas`] to add one, up to
//! [`BalancerConfig::replica_wait`] from its arrival; then it gets 503 (none was
//! ready) or 502 (all failed).
//!
//! # Streaming
//!
//! A response with a `Content-Length` of at most
//! [`BalancerConfig::max_buffered_response_bytes`] that is not `text/event-stream` is
//! read whole before the client sees its head, so a replica dying mid-body is treated
//! like one dying before it answered. Any other response (server-sent events, chunked,
//! large) is passed on as it arrives: it can fail over only before its head went out;
//! once it did, a replica failure breaks the client's response (the connection is
//! closed without the end of the body), so the client sees an error rather than a
//! silently truncated answer.
//!
//! An HTTP upgrade (OpenEnv's WebSocket at `/ws`) goes to one replica, chosen and
//! failed over like an idempotent request until the replica answers; a `101` joins the
//! two connections byte for byte, with no failover from then on; any other answer is
//! passed on.
//!
//! Every response from a replica carries `x-agentstack-replica: <replica id>`. The
//! balancer's own errors are JSON, `{"error": {"message": "...", "type":
//! "load_balancer"}}`, in the shape OpenAI clients read. With
//! [`BalancerConfig::keys`], every path but `/health` needs `Authorization: Bearer`
//! with one of them, checked before the body is read; the header is forwarded
//! unchanged, as the replicas check it too.
//!
//! ```no_run
//! use agentstack_compute::balancer::{Balancer, BalancerConfig, Policy, Replica};
//!
//! # async fn demo() -> std::io::Result<()> {
//! let config = BalancerConfig {
//!     policy: "round_robin".parse().expect("a policy name"),
//!     ..BalancerConfig::default()
//! };
//! assert_eq!(config.policy, Policy::RoundRobin);
//! let balancer = Balancer::new(config);
//! balancer.set_replicas(vec![
//!     Replica { id: "serve/0#1".into(), url: "http://127.0.0.1:9001".into() },
//!     Replica { id: "serve/1#1".into(), url: "http://127.0.0.1:9002".into() },
//! ]);
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8000").await?;
//! let shutdown = async {
//!     let _ = tokio::signal::ctrl_c().await;
//! };
//! balancer.clone().serve(listener, shutdown).await?;
//! println!("{}", serde_json::to_string(&balancer.stats()).expect("stats serialize"));
//! # Ok(())
//! # }
//! ```

use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use agentstack_serve::auth::{ApiKey, KeyGuard, Refusal};
use agentstack_serve::{HOP_BY_HOP_HEADERS, Limits};
use axum::Router;
use axum::body::Body;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::uri::{Authority, PathAndQuery, Scheme};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use hyper::upgrade::OnUpgrade;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::Instrument;

/// How requests are spread over the ready replicas (SkyServe's
/// `load_balancing_policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// `least_load`: the replica with the fewest requests in flight; ties go to each in
    /// turn.
    #[default]
    LeastLoad,
    /// `round_robin`: each replica in turn.
    RoundRobin,
}

impl Policy {
    /// Every policy, in the order their names are listed to users.
    pub const ALL: [Policy; 2] = [Policy::LeastLoad, Policy::RoundRobin];

    /// The policy's name in a spec: `least_load` or `round_robin`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Policy::LeastLoad => "least_load",
            Policy::RoundRobin => "round_robin",
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A load-balancing policy name that is not one of [`Policy::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown load_balancing_policy `{given}`; use `least_load` or `round_robin`")]
pub struct UnknownPolicy {
    /// The name given.
    pub given: String,
}

impl FromStr for Policy {
    type Err = UnknownPolicy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Policy::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| UnknownPolicy {
                given: s.to_owned(),
            })
    }
}

/// How a [`Balancer`] serves, waits and retries. Every field is a bound.
#[derive(Debug, Clone)]
pub struct BalancerConfig {
    /// How a replica is chosen.
    pub policy: Policy,
    /// Header-read timeout and connection cap of the balancer's own listener.
    pub limits: Limits,
    /// Largest request body; bodies are held in memory so that they can be sent again.
    /// A larger one is answered 413.
    pub max_body_bytes: usize,
    /// Paths (exactly, without the query) whose `POST`s are safe to send to a second
    /// replica after the first broke the connection mid-request.
    pub idempotent_posts: Vec<String>,
    /// API keys; when not empty, every path but `/health` needs
    /// `Authorization: Bearer` with one of them, checked before the body is read.
    pub keys: Vec<ApiKey>,
    /// How long a request waits for a ready replica it has not tried yet, counted from
    /// its arrival; then 503 (or 502 if every replica it tried failed).
    pub replica_wait: Duration,
    /// Time for a replica to open a connection; past it, the replica counts as
    /// unreachable and the request goes to another.
    pub connect_timeout: Duration,
    /// Time for a replica to send its response head (and, separately, to finish a
    /// response body the balancer buffers); past it, 504, not retried.
    pub upstream_timeout: Duration,
    /// How long a replica whose connection failed is skipped.
    pub eject_for: Duration,
    /// Largest `Content-Length` of a response read whole before it is passed on (so
    /// that a replica dying mid-body can be retried); larger, unsized or
    /// `text/event-stream` responses are streamed.
    pub max_buffered_response_bytes: usize,
}

impl BalancerConfig {
    /// The default [`BalancerConfig::idempotent_posts`]: the OpenAI routes whose answer
    /// is a pure function of the request.
    pub const DEFAULT_IDEMPOTENT_POSTS: [&'static str; 3] =
        ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"];
    /// The default [`BalancerConfig::max_body_bytes`]: 8 MiB, above what the model
    /// server takes (4 MiB), so the replica's own 413 is the one clients usually see.
    pub const DEFAULT_MAX_BODY_BYTES: usize = 8 << 20;
    /// The default [`BalancerConfig::replica_wait`]: long enough for a replica to be
    /// restarted after a crash of a small server, short of a client's usual timeout.
    pub const DEFAULT_REPLICA_WAIT: Duration = Duration::from_secs(30);
    /// The default [`BalancerConfig::connect_timeout`]; on one network a connect takes
    /// milliseconds, so a replica slower than this is not answering.
    pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
    /// The default [`BalancerConfig::upstream_timeout`]: a long non-streamed
    /// generation may take minutes before its head is sent.
    pub const DEFAULT_UPSTREAM_TIMEOUT: Duration = Duration::from_secs(600);
    /// The default [`BalancerConfig::eject_for`].
    pub const DEFAULT_EJECT_FOR: Duration = Duration::from_secs(10);
    /// The default [`BalancerConfig::max_buffered_response_bytes`]: a chat completion's
    /// JSON is kilobytes.
    pub const DEFAULT_MAX_BUFFERED_RESPONSE_BYTES: usize = 1 << 20;
}

impl Default for BalancerConfig {
    fn default() -> Self {
        Self {
            policy: Policy::default(),
            limits: Limits::default(),
            max_body_bytes: Self::DEFAULT_MAX_BODY_BYTES,
            idempotent_posts: Self::DEFAULT_IDEMPOTENT_POSTS
                .iter()
                .map(|p| (*p).to_owned())
                .collect(),
            keys: Vec::new(),
            replica_wait: Self::DEFAULT_REPLICA_WAIT,
            connect_timeout: Self::DEFAULT_CONNECT_TIMEOUT,
            upstream_timeout: Self::DEFAULT_UPSTREAM_TIMEOUT,
            eject_for: Self::DEFAULT_EJECT_FOR,
            max_buffered_response_bytes: Self::DEFAULT_MAX_BUFFERED_RESPONSE_BYTES,
        }
    }
}

/// A ready replica.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Replica {
    /// Who it is, e.g. `serve/1#2` (component / replica # attempt): a restarted replica
    /// gets a new id, so it is not skipped for its predecessor's failure.
    pub id: String,
    /// Its base URL, e.g. `http://127.0.0.1:9001` (plain HTTP; a path is a prefix).
    pub url: String,
}

/// What a balancer has done so far, and where its requests are now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Stats {
    /// Requests received (WebSocket upgrades included).
    pub requests: u64,
    /// Times a request was sent again to another replica.
    pub retried: u64,
    /// Requests the balancer answered 502, 503 or 504 itself.
    pub failed: u64,
    /// Requests waiting now for a ready replica.
    pub waiting: u64,
    /// The ready replicas, in the order given to [`Balancer::set_replicas`].
    pub replicas: Vec<ReplicaStats>,
}

/// One ready replica in [`Stats`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReplicaStats {
    /// The replica's id.
    pub id: String,
    /// Its base URL.
    pub url: String,
    /// Requests sent to it and not finished (a streamed response until its end, a
    /// WebSocket until it closes).
    pub in_flight: u64,
    /// Responses of its that were passed on to clients.
    pub answered: u64,
    /// Whether it is skipped now after a failed connection.
    pub ejected: bool,
}

/// The load balancer. Cheap to clone: clones share replicas and counters.
#[derive(Clone)]
pub struct Balancer {
    inner: Arc<Inner>,
}

impl fmt::Debug for Balancer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Balancer")
            .field("config", &self.inner.config)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl Balancer {
    /// A balancer with no replica yet: requests wait for [`Balancer::set_replicas`].
    pub fn new(config: BalancerConfig) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(config.connect_timeout));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .pool_max_idle_per_host(POOL_MAX_IDLE_PER_REPLICA)
            .build(connector);
        let (changed, _) = watch::channel(0);
        Self {
            inner: Arc::new(Inner {
                config,
                client,
                pool: Mutex::new(Pool::default()),
                changed,
                requests: AtomicU64::new(0),
                retried: AtomicU64::new(0),
                failed: AtomicU64::new(0),
                waiting: AtomicU64::new(0),
            }),
        }
    }

    /// Replaces the set of ready replicas. A replica keeps its counters and its
    /// ejection while its id stays; a new id starts afresh. A URL that is not a plain
    /// `http://host[:port]` base is left out (and logged). Requests waiting for a
    /// replica are woken.
    pub fn set_replicas(&self, ready: Vec<Replica>) {
        let mut pool = self.inner.pool();
        let mut next: Vec<Slot> = Vec::with_capacity(ready.len());
        for replica in ready {
            if next.iter().any(|s| s.replica.id == replica.id) {
                tracing::error!(replica = %replica.id, "a replica id was given twice; the second is left out");
                continue;
            }
            let base = match Base::parse(&replica.url) {
                Ok(base) => base,
                Err(why) => {
                    tracing::error!(replica = %replica.id, url = %replica.url, "{why}; the replica is left out");
                    continue;
                }
            };
            let kept = pool
                .replicas
                .iter()
                .find(|s| s.replica.id == replica.id && s.replica.url == replica.url);
            next.push(Slot {
                load: kept.map_or_else(Arc::default, |s| s.load.clone()),
                ejected_at: kept.and_then(|s| s.ejected_at),
                replica,
                base,
            });
        }
        tracing::info!(
            ready = next.len(),
            replicas = ?next.iter().map(|s| s.replica.id.as_str()).collect::<Vec<_>>(),
            "ready replicas changed"
        );
        pool.replicas = next;
        drop(pool);
        self.inner
            .changed
            .send_modify(|generation| *generation += 1);
    }

    /// The whole balancer as a router (one fallback route, behind the key check when
    /// there are keys).
    pub fn router(&self) -> Router {
        let router = Router::new()
            .fallback(balance)
            .with_state(self.inner.clone());
        let guard = KeyGuard::new(self.inner.config.keys.clone(), refuse);
        if !guard.is_active() {
            return router;
        }
        // The guard takes an accepted key off the request; the replicas check keys too,
        // so the balancer keeps the header aside and puts it back.
        guard
            .wrap(router)
            .layer(axum::middleware::from_fn(keep_authorization))
    }

    /// Serves the balancer on `listener` (through [`agentstack_serve::serve`], with
    /// [`BalancerConfig::limits`]) until `shutdown` resolves.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let limits = self.inner.config.limits;
        agentstack_serve::serve(listener, self.router(), limits, shutdown).await
    }

    /// The counters now.
    pub fn stats(&self) -> Stats {
        let inner = &self.inner;
        let now = Instant::now();
        let replicas = inner
            .pool()
            .replicas
            .iter()
            .map(|s| ReplicaStats {
                id: s.replica.id.clone(),
                url: s.replica.url.clone(),
                in_flight: s.load.in_flight.load(Ordering::Relaxed),
                answered: s.load.answered.load(Ordering::Relaxed),
                ejected: s.is_ejected(now, inner.config.eject_for),
            })
            .collect();
        Stats {
            requests: inner.requests.load(Ordering::Relaxed),
            retried: inner.retried.load(Ordering::Relaxed),
            failed: inner.failed.load(Ordering::Relaxed),
            waiting: inner.waiting.load(Ordering::Relaxed),
            replicas,
        }
    }
}

/// How long a pooled connection to a replica may sit idle: below the 10 s after which
/// an agentstack server closes an idle connection, so the balancer rarely sends a
/// request on a connection the replica is closing.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(5);

/// Idle connections kept per replica.
const POOL_MAX_IDLE_PER_REPLICA: usize = 64;

/// The response header naming the replica that answered.
pub const REPLICA_HEADER: &str = "x-agentstack-replica";

/// The methods that are safe to send twice (RFC 9110, 9.2.2).
const IDEMPOTENT_METHODS: [Method; 6] = [
    Method::GET,
    Method::HEAD,
    Method::OPTIONS,
    Method::PUT,
    Method::DELETE,
    Method::TRACE,
];

struct Inner {
    config: BalancerConfig,
    client: Client<HttpConnector, Body>,
    pool: Mutex<Pool>,
    /// Bumped by every [`Balancer::set_replicas`], to wake waiting requests.
    changed: watch::Sender<u64>,
    requests: AtomicU64,
    retried: AtomicU64,
    failed: AtomicU64,
    waiting: AtomicU64,
}

#[derive(Default)]
struct Pool {
    replicas: Vec<Slot>,
    /// Where the next turn starts (round robin, and ties of least load).
    cursor: usize,
}

struct Slot {
    replica: Replica,
    base: Base,
    load: Arc<Load>,
    /// When its connection last failed.
    ejected_at: Option<Instant>,
}

impl Slot {
    fn is_ejected(&self, now: Instant, eject_for: Duration) -> bool {
        self.ejected_at.is_some_and(|at| now < at + eject_for)
    }
}

/// A replica's counters, shared with the requests in flight to it.
#[derive(Default)]
struct Load {
    in_flight: AtomicU64,
    answered: AtomicU64,
}

/// One request in flight to a replica, until dropped.
struct InFlight(Arc<Load>);

impl InFlight {
    fn enter(load: &Arc<Load>) -> Self {
        load.in_flight.fetch_add(1, Ordering::Relaxed);
        Self(load.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A replica's base URL, split.
#[derive(Clone)]
struct Base {
    authority: Authority,
    /// The path prefix, without a trailing `/` (usually empty).
    prefix: String,
}

impl Base {
    fn parse(url: &str) -> Result<Self, String> {
        let uri: Uri = url
            .parse()
            .map_err(|e| format!("the replica URL is not a URL ({e})"))?;
        if uri.scheme() != Some(&Scheme::HTTP) {
            return Err("the replica URL must start with `http://`".to_owned());
        }
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| "the replica URL has no host".to_owned())?;
        if uri.query().is_some() {
            return Err("the replica URL must not have a query".to_owned());
        }
        Ok(Self {
            authority,
            prefix: uri.path().trim_end_matches('/').to_owned(),
        })
    }

    /// The path and query to send a request for `path` (the client's path and query).
    fn path(&self, path: &str) -> Option<PathAndQuery> {
        if self.prefix.is_empty() {
            return path.parse().ok();
        }
        format!("{}{path}", self.prefix).parse().ok()
    }

    /// The absolute URL of `path` on the replica.
    fn uri(&self, path: &str) -> Option<Uri> {
        Uri::builder()
            .scheme(Scheme::HTTP)
            .authority(self.authority.clone())
            .path_and_query(self.path(path)?)
            .build()
            .ok()
    }

    /// `host:port` to open a TCP connection to.
    fn socket(&self) -> String {
        format!(
            "{}:{}",
            self.authority.host(),
            self.authority.port_u16().unwrap_or(80)
        )
    }
}

/// The replica a try goes to.
struct Chosen {
    id: String,
    base: Base,
    load: Arc<Load>,
}

impl Pool {
    /// The replica for the next try of a request that already tried `tried`: by
    /// `policy` among those not ejected; when all are, the least recently ejected;
    /// `None` when every ready replica was tried.
    fn pick(
        &mut self,
        policy: Policy,
        tried: &[String],
        now: Instant,
        eject_for: Duration,
    ) -> Option<Chosen> {
        let n = self.replicas.len();
        let untried = (0..n)
            .map(|k| (self.cursor + k) % n)
            .filter(|&i| !tried.contains(&self.replicas[i].replica.id));
        let mut fresh = untried
            .clone()
            .filter(|&i| !self.replicas[i].is_ejected(now, eject_for));
        let chosen = match policy {
            Policy::RoundRobin => fresh.next(),
            // The first of the least loaded from the cursor on, so ties go in turn.
            Policy::LeastLoad => fresh
                .fold(None, |best: Option<(usize, u64)>, i| {
                    let load = self.replicas[i].load.in_flight.load(Ordering::Relaxed);
                    match best {
                        Some((_, least)) if least <= load => best,
                        _ => Some((i, load)),
                    }
                })
                .map(|(i, _)| i),
        }
        .or_else(|| untried.min_by_key(|&i| self.replicas[i].ejected_at))?;
        self.cursor = (chosen + 1) % n;
        let slot = &self.replicas[chosen];
        Some(Chosen {
            id: slot.replica.id.clone(),
            base: slot.base.clone(),
            load: slot.load.clone(),
        })
    }
}

/// What one try of a request came to.
enum Attempt {
    /// A response to pass on.
    Answered(Response),
    /// The replica answered 503: it is draining, stopping or overloaded.
    Unavailable(Response),
    /// No connection could be opened: the replica never saw the request.
    NoConnection(String),
    /// The connection broke after the request was sent, before a whole answer.
    Broken(String),
    /// The replica took longer than the upstream timeout.
    TimedOut(Stage),
}

/// Where in a response a replica ran out of time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Head,
    Body,
}

/// How tries of a request failed, for the answer when none succeeded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FailureKind {
    NoConnection,
    Broken,
}

/// Why the balancer answered a request itself. Each maps to one status in
/// [`BalancerError::status`].
#[derive(Debug, thiserror::Error)]
enum BalancerError {
    /// The request body is over [`BalancerConfig::max_body_bytes`].
    #[error(
        "the request body is larger than the load balancer's limit of {limit} bytes; send a smaller one"
    )]
    BodyTooLarge { limit: usize },
    /// The client's body could not be read (it hung up, or sent a malformed body).
    #[error("the request body could not be read")]
    BodyUnreadable(#[source] axum::Error),
    /// No replica became ready within [`BalancerConfig::replica_wait`].
    #[error(
        "no replica of the service is ready (waited {waited:?}); the supervisor adds replicas \
         as their readiness probes pass: check them with `agentstack status <job>` and retry"
    )]
    NoReplica { waited: Duration },
    /// Every replica tried failed and no other became ready in time.
    #[error(
        "no replica could answer: {} tried ({}), the last {}; the supervisor restarts failed \
         replicas: retry shortly, or check them with `agentstack status <job>`",
        tried.len(),
        tried.join(", "),
        match last { FailureKind::NoConnection => "could not be connected to", FailureKind::Broken => "broke the connection before answering" }
    )]
    AllFailed {
        tried: Vec<String>,
        last: FailureKind,
    },
    /// A replica broke the connection of a request that may not be sent twice.
    #[error(
        "replica {replica} broke the connection before it answered; the request was not sent \
         again because a {method} to {path} may not be idempotent (only GET, HEAD, OPTIONS, \
         PUT, DELETE, TRACE and POSTs to {posts} are retried); check whether it took effect \
         before sending it again"
    )]
    NotRetried {
        replica: String,
        method: Method,
        path: String,
        posts: String,
    },
    /// A replica took longer than [`BalancerConfig::upstream_timeout`].
    #[error(
        "replica {replica} did not send its response {} within {after:?}; the request was not \
         sent again because the replica may still be working on it",
        match stage { Stage::Head => "head", Stage::Body => "body" }
    )]
    TimedOut {
        replica: String,
        stage: Stage,
        after: Duration,
    },
}

impl BalancerError {
    /// The one table from what went wrong to the status the client gets.
    fn status(&self) -> StatusCode {
        match self {
            BalancerError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            BalancerError::BodyUnreadable(_) => StatusCode::BAD_REQUEST,
            BalancerError::NoReplica { .. } => StatusCode::SERVICE_UNAVAILABLE,
            BalancerError::AllFailed { .. } | BalancerError::NotRetried { .. } => {
                StatusCode::BAD_GATEWAY
            }
            BalancerError::TimedOut { .. } => StatusCode::GATEWAY_TIMEOUT,
        }
    }
}

impl IntoResponse for BalancerError {
    fn into_response(self) -> Response {
        error_response(self.status(), &self.to_string())
    }
}

/// The balancer's own answer: `{"error": {"message": ..., "type": "load_balancer"}}`.
fn error_response(status: StatusCode, message: &str) -> Response {
    let body = serde_json::json!({"error": {"message": message, "type": "load_balancer"}});
    (status, axum::Json(body)).into_response()
}

/// The key guard's refusal, in the balancer's error shape.
fn refuse(refusal: Refusal) -> Response {
    error_response(refusal.status(), refusal.message())
}

/// The client's `Authorization`, kept aside from the key guard (which removes it) to be
/// forwarded to the replicas.
#[derive(Clone)]
struct ClientAuthorization(HeaderValue);

async fn keep_authorization(mut request: Request, next: Next) -> Response {
    if let Some(value) = request.headers().get(header::AUTHORIZATION).cloned() {
        request.extensions_mut().insert(ClientAuthorization(value));
    }
    next.run(request).await
}

/// The one handler: every request.
async fn balance(State(inner): State<Arc<Inner>>, request: Request) -> Response {
    inner.requests.fetch_add(1, Ordering::Relaxed);
    // The path without the query: a query may hold a secret.
    let span = tracing::debug_span!(
        "balance",
        method = %request.method(),
        path = request.uri().path(),
    );
    async move {
        match inner.forward(request).await {
            Ok(response) => response,
            Err(error) => {
                let status = error.status();
                if status.is_server_error() {
                    inner.failed.fetch_add(1, Ordering::Relaxed);
                }
                tracing::debug!(%status, error = %error, "answered by the load balancer");
                error.into_response()
            }
        }
    }
    .instrument(span)
    .await
}

/// Whether a request asks to switch protocols (`Connection: upgrade` and `Upgrade`).
fn is_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE)
        && headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|token| token.trim().eq_ignore_ascii_case("upgrade"))
}

/// A replica's answer as the client gets it: its hop-by-hop headers dropped and the
/// replica named.
fn relayed(
    response: hyper::Response<hyper::body::Incoming>,
    replica: &str,
) -> (axum::http::response::Parts, Body) {
    let (mut head, incoming) = response.into_parts();
    strip_hop_by_hop(&mut head.headers);
    name_replica(&mut head.headers, replica);
    (head, Body::new(incoming))
}

/// Removes the hop-by-hop headers, those named in `Connection` included.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<String> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|name| name.trim().to_ascii_lowercase())
        .filter(|name| !name.is_empty())
        .collect();
    for name in HOP_BY_HOP_HEADERS
        .iter()
        .copied()
        .chain(named.iter().map(String::as_str))
    {
        headers.remove(name);
    }
}

/// Reads a body whole, refusing one over `limit` bytes.
async fn read_body(body: Body, limit: usize) -> Result<Bytes, BalancerError> {
    let mut stream = body.into_data_stream();
    let mut buffer = BytesMut::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(BalancerError::BodyUnreadable)?;
        if buffer.len() + chunk.len() > limit {
            return Err(BalancerError::BodyTooLarge { limit });
        }
        buffer.extend_from_slice(&chunk);
    }
    Ok(buffer.freeze())
}

/// What a request is, apart from its head.
enum Payload {
    /// A plain request and its whole body.
    Body(Bytes),
    /// An upgrade to `protocol`; `client` is the client's side of it, taken when a
    /// replica switches protocols.
    Upgrade {
        protocol: HeaderValue,
        client: Option<OnUpgrade>,
    },
}

impl Inner {
    fn pool(&self) -> MutexGuard<'_, Pool> {
        // The pool is left consistent at every step, so a panic elsewhere while it was
        // held does not make it unusable.
        self.pool
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn is_idempotent(&self, method: &Method, path: &str) -> bool {
        IDEMPOTENT_METHODS.contains(method)
            || (method == Method::POST && self.config.idempotent_posts.iter().any(|p| p == path))
    }

    /// Sends `request` to replicas by the rules of the module docs until one answers.
    async fn forward(self: &Arc<Self>, request: Request) -> Result<Response, BalancerError> {
        let arrived = Instant::now();
        let (mut parts, body) = request.into_parts();
        let upgrade = parts.headers.get(header::UPGRADE).cloned();
        let mut payload = if let Some(protocol) = upgrade.filter(|_| is_upgrade(&parts.headers)) {
            Payload::Upgrade {
                protocol,
                client: parts.extensions.remove::<OnUpgrade>(),
            }
        } else {
            let limit = self.config.max_body_bytes;
            let declared = parts
                .headers
                .get(header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok());
            if declared.is_some_and(|n| n > limit as u64) {
                return Err(BalancerError::BodyTooLarge { limit });
            }
            Payload::Body(read_body(body, limit).await?)
        };
        let path = parts
            .uri
            .path_and_query()
            .map_or("/", PathAndQuery::as_str)
            .to_owned();
        let idempotent = self.is_idempotent(&parts.method, parts.uri.path());
        let headers = self.upstream_headers(&parts);
        let deadline = arrived + self.config.replica_wait;
        let mut tried: Vec<String> = Vec::new();
        let mut last_failure = None;
        let mut unavailable = None;
        loop {
            if tried.len() > self.pool().replicas.len() {
                break;
            }
            let Some(chosen) = self.choose(&tried, deadline).await else {
                break;
            };
            if !tried.is_empty() {
                self.retried.fetch_add(1, Ordering::Relaxed);
            }
            tried.push(chosen.id.clone());
            let attempt = match &mut payload {
                Payload::Body(body) => {
                    self.send(&chosen, &parts.method, &path, &headers, body.clone())
                        .await
                }
                Payload::Upgrade { protocol, client } => {
                    let mut headers = headers.clone();
                    headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
                    headers.insert(header::UPGRADE, protocol.clone());
                    self.upgrade(&chosen, &parts.method, &path, &headers, client)
                        .await
                }
            };
            match attempt {
                Attempt::Answered(response) => {
                    chosen.load.answered.fetch_add(1, Ordering::Relaxed);
                    return Ok(response);
                }
                Attempt::Unavailable(response) => {
                    tracing::debug!(replica = %chosen.id, "replica answered 503");
                    if !idempotent {
                        chosen.load.answered.fetch_add(1, Ordering::Relaxed);
                        return Ok(response);
                    }
                    unavailable = Some((response, chosen.load.clone()));
                }
                Attempt::NoConnection(error) => {
                    self.eject(&chosen.id, &error);
                    last_failure = Some(FailureKind::NoConnection);
                }
                Attempt::Broken(error) => {
                    self.eject(&chosen.id, &error);
                    if !idempotent {
                        return Err(BalancerError::NotRetried {
                            replica: chosen.id,
                            method: parts.method,
                            path: parts.uri.path().to_owned(),
                            posts: self.config.idempotent_posts.join(", "),
                        });
                    }
                    last_failure = Some(FailureKind::Broken);
                }
                Attempt::TimedOut(stage) => {
                    tracing::warn!(replica = %chosen.id, ?stage, "replica timed out");
                    return Err(BalancerError::TimedOut {
                        replica: chosen.id,
                        stage,
                        after: self.config.upstream_timeout,
                    });
                }
            }
        }
        // A replica's own 503 says more than "it failed" (it is draining, say).
        if let Some((response, load)) = unavailable {
            load.answered.fetch_add(1, Ordering::Relaxed);
            return Ok(response);
        }
        match last_failure {
            Some(last) => Err(BalancerError::AllFailed { tried, last }),
            None => Err(BalancerError::NoReplica {
                waited: self.config.replica_wait,
            }),
        }
    }

    /// The request headers a replica gets: the client's, less hop-by-hop ones, `Host`
    /// (set from the replica's URL) and the body's framing (the body is re-sent whole);
    /// plus `X-Forwarded-For`.
    fn upstream_headers(&self, parts: &axum::http::request::Parts) -> HeaderMap {
        let mut headers = parts.headers.clone();
        strip_hop_by_hop(&mut headers);
        for name in [header::HOST, header::CONTENT_LENGTH, header::EXPECT] {
            headers.remove(name);
        }
        if let Some(ClientAuthorization(value)) = parts.extensions.get::<ClientAuthorization>() {
            headers.insert(header::AUTHORIZATION, value.clone());
        }
        if let Some(ConnectInfo(peer)) = parts.extensions.get::<ConnectInfo<SocketAddr>>()
            && let Ok(value) = HeaderValue::from_str(&peer.ip().to_string())
        {
            headers.append("x-forwarded-for", value);
        }
        headers
    }

    /// The next replica to try, waiting until `deadline` for one when none is left.
    async fn choose(&self, tried: &[String], deadline: Instant) -> Option<Chosen> {
        let mut changed = self.changed.subscribe();
        let mut waiting = None;
        loop {
            let picked = self.pool().pick(
                self.config.policy,
                tried,
                Instant::now(),
                self.config.eject_for,
            );
            if picked.is_some() {
                return picked;
            }
            if waiting.is_none() {
                tracing::debug!("waiting for a ready replica");
                waiting = Some(Waiting::enter(&self.waiting));
            }
            match tokio::time::timeout_at(deadline, changed.changed()).await {
                Ok(Ok(())) => {}
                // Timed out (or, impossibly, the balancer is gone).
                Ok(Err(_)) | Err(_) => return None,
            }
        }
    }

    /// Skips replica `id` for [`BalancerConfig::eject_for`].
    fn eject(&self, id: &str, error: &str) {
        let mut pool = self.pool();
        if let Some(slot) = pool.replicas.iter_mut().find(|s| s.replica.id == id) {
            slot.ejected_at = Some(Instant::now());
            tracing::warn!(
                replica = %id,
                eject_for = ?self.config.eject_for,
                %error,
                "replica connection failed; skipping the replica"
            );
        }
    }

    /// One try of a plain request.
    async fn send(
        &self,
        chosen: &Chosen,
        method: &Method,
        path: &str,
        headers: &HeaderMap,
        body: Bytes,
    ) -> Attempt {
        let Some(uri) = chosen.base.uri(path) else {
            return Attempt::NoConnection(format!("`{path}` does not make a URL on the replica"));
        };
        let mut request = axum::http::Request::new(Body::from(body));
        *request.method_mut() = method.clone();
        *request.uri_mut() = uri;
        *request.headers_mut() = headers.clone();
        let in_flight = InFlight::enter(&chosen.load);
        let timeout = self.config.upstream_timeout;
        let response = match tokio::time::timeout(timeout, self.client.request(request)).await {
            Err(_) => return Attempt::TimedOut(Stage::Head),
            Ok(Err(e)) if e.is_connect() => {
                return Attempt::NoConnection(agentstack_static::with_causes(&e));
            }
            Ok(Err(e)) => return Attempt::Broken(agentstack_static::with_causes(&e)),
            Ok(Ok(response)) => response,
        };
        let (head, body) = relayed(response, &chosen.id);
        if head.status == StatusCode::SERVICE_UNAVAILABLE {
            return Attempt::Unavailable(Response::from_parts(head, body));
        }
        if !self.buffers(&head.headers) {
            return Attempt::Answered(Response::from_parts(head, streamed(body, in_flight)));
        }
        let limit = self.config.max_buffered_response_bytes;
        match tokio::time::timeout(timeout, read_body(body, limit)).await {
            Err(_) => Attempt::TimedOut(Stage::Body),
            Ok(Ok(bytes)) => Attempt::Answered(Response::from_parts(head, Body::from(bytes))),
            Ok(Err(e)) => Attempt::Broken(agentstack_static::with_causes(&e)),
        }
    }

    /// Whether a response with `headers` is read whole before it is passed on.
    fn buffers(&self, headers: &HeaderMap) -> bool {
        let event_stream = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim_start().starts_with("text/event-stream"));
        let length = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        !event_stream && length.is_some_and(|n| n <= self.config.max_buffered_response_bytes as u64)
    }

    /// One try of an upgrade (`headers` ask for it): the request goes out on a
    /// connection of its own; a `101` joins it with the client's.
    async fn upgrade(
        &self,
        chosen: &Chosen,
        method: &Method,
        path: &str,
        headers: &HeaderMap,
        client: &mut Option<OnUpgrade>,
    ) -> Attempt {
        let in_flight = InFlight::enter(&chosen.load);
        let Some(path_and_query) = chosen.base.path(path) else {
            return Attempt::NoConnection(format!("`{path}` does not make a URL on the replica"));
        };
        let connect = tokio::net::TcpStream::connect(chosen.base.socket());
        let stream = match tokio::time::timeout(self.config.connect_timeout, connect).await {
            Err(_) => {
                return Attempt::NoConnection(format!(
                    "no connection within {:?}",
                    self.config.connect_timeout
                ));
            }
            Ok(Err(e)) => return Attempt::NoConnection(agentstack_static::with_causes(&e)),
            Ok(Ok(stream)) => stream,
        };
        let _ = stream.set_nodelay(true);
        let (mut sender, connection) =
            match hyper::client::conn::http1::handshake(TokioIo::new(stream)).await {
                Ok(handshake) => handshake,
                Err(e) => return Attempt::Broken(agentstack_static::with_causes(&e)),
            };
        let replica = chosen.id.clone();
        tokio::spawn(async move {
            if let Err(e) = connection.with_upgrades().await {
                tracing::debug!(%replica, error = %e, "upgrade connection to the replica ended");
            }
        });
        let mut request = axum::http::Request::new(Body::empty());
        *request.method_mut() = method.clone();
        *request.uri_mut() = Uri::from(path_and_query);
        *request.headers_mut() = headers.clone();
        if let Ok(host) = HeaderValue::from_str(chosen.base.authority.as_str()) {
            request.headers_mut().insert(header::HOST, host);
        }
        let timeout = self.config.upstream_timeout;
        let mut response = match tokio::time::timeout(timeout, sender.send_request(request)).await {
            Err(_) => return Attempt::TimedOut(Stage::Head),
            Ok(Err(e)) => return Attempt::Broken(agentstack_static::with_causes(&e)),
            Ok(Ok(response)) => response,
        };
        if response.status() != StatusCode::SWITCHING_PROTOCOLS {
            let (head, body) = relayed(response, &chosen.id);
            if head.status == StatusCode::SERVICE_UNAVAILABLE {
                return Attempt::Unavailable(Response::from_parts(head, body));
            }
            return Attempt::Answered(Response::from_parts(head, streamed(body, in_flight)));
        }
        let upstream = hyper::upgrade::on(&mut response);
        let Some(client) = client.take() else {
            // Served without upgrades (a router driven in a test, say): nothing to join.
            return Attempt::Answered(error_response(
                StatusCode::BAD_REQUEST,
                "this connection cannot be upgraded",
            ));
        };
        let replica = chosen.id.clone();
        tokio::spawn(
            async move {
                let _in_flight = in_flight;
                match tokio::join!(client, upstream) {
                    (Ok(client), Ok(upstream)) => {
                        let (mut client, mut upstream) =
                            (TokioIo::new(client), TokioIo::new(upstream));
                        match tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
                            Ok((up, down)) => {
                                tracing::debug!(up, down, "upgraded connection closed")
                            }
                            Err(e) => tracing::debug!(error = %e, "upgraded connection broke"),
                        }
                    }
                    (client, upstream) => tracing::debug!(
                        client = ?client.err(),
                        upstream = ?upstream.err(),
                        "the upgrade did not complete"
                    ),
                }
            }
            .instrument(tracing::debug_span!("tunnel", %replica)),
        );
        // The replica's 101 as it is: `Connection`, `Upgrade` and the handshake's
        // headers belong to the protocol switch the client asked for.
        let (mut head, _) = response.into_parts();
        name_replica(&mut head.headers, &chosen.id);
        Attempt::Answered(Response::from_parts(head, Body::empty()))
    }
}

/// Adds `x-agentstack-replica: id` to a replica's response.
fn name_replica(headers: &mut HeaderMap, id: &str) {
    if let Ok(value) = HeaderValue::from_str(id) {
        headers.insert(REPLICA_HEADER, value);
    }
}

/// A replica's body passed on as it arrives, counting the request in flight until the
/// body ends or the client goes. An error from the replica stays an error, so the
/// client's response breaks rather than ending early as if complete.
fn streamed(body: Body, in_flight: InFlight) -> Body {
    Body::from_stream(body.into_data_stream().map(move |chunk| {
        let _held = &in_flight;
        chunk
    }))
}

/// A request counted as waiting for a replica, until dropped.
struct Waiting<'a>(&'a AtomicU64);

impl<'a> Waiting<'a> {
    fn enter(counter: &'a AtomicU64) -> Self {
        counter.fetch_add(1, Ordering::Relaxed);
        Self(counter)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn balancer(policy: Policy, ids: &[&str]) -> Balancer {
        let balancer = Balancer::new(BalancerConfig {
            policy,
            ..BalancerConfig::default()
        });
        balancer.set_replicas(
            ids.iter()
                .enumerate()
                .map(|(i, id)| Replica {
                    id: (*id).to_owned(),
                    url: format!("http://127.0.0.1:{}", 9000 + i),
                })
                .collect(),
        );
        balancer
    }

    /// The ids of the next `n` picks at `now` for a request that tried `tried`.
    fn picks(balancer: &Balancer, tried: &[&str], now: Instant, n: usize) -> Vec<String> {
        let tried: Vec<String> = tried.iter().map(|t| (*t).to_owned()).collect();
        let inner = &balancer.inner;
        (0..n)
            .filter_map(|_| {
                inner
                    .pool()
                    .pick(inner.config.policy, &tried, now, inner.config.eject_for)
                    .map(|c| c.id)
            })
            .collect()
    }

    fn eject_at(balancer: &Balancer, id: &str, at: Instant) {
        let mut pool = balancer.inner.pool();
        let slot = pool.replicas.iter_mut().find(|s| s.replica.id == id);
        slot.unwrap().ejected_at = Some(at);
    }

    #[test]
    fn policies_are_named_as_in_skyserve() {
        for policy in Policy::ALL {
            assert_eq!(policy.as_str().parse::<Policy>(), Ok(policy));
            let json = serde_json::to_string(&policy).unwrap();
            assert_eq!(json, format!("\"{policy}\""));
        }
        assert_eq!(Policy::default(), Policy::LeastLoad);
        let err = "least_connections".parse::<Policy>().unwrap_err();
        assert_eq!(
            err.to_string(),
            "unknown load_balancing_policy `least_connections`; use `least_load` or `round_robin`"
        );
    }

    #[test]
    fn least_load_picks_the_least_busy_and_breaks_ties_in_turn() {
        let balancer = balancer(Policy::LeastLoad, &["a", "b", "c"]);
        let now = Instant::now();
        assert_eq!(picks(&balancer, &[], now, 4), ["a", "b", "c", "a"]);
        balancer.inner.pool().replicas[0]
            .load
            .in_flight
            .store(1, Ordering::Relaxed);
        assert_eq!(picks(&balancer, &[], now, 4), ["b", "c", "b", "c"]);
        assert_eq!(picks(&balancer, &["b"], now, 2), ["c", "c"]);
        assert_eq!(picks(&balancer, &["b", "c"], now, 1), ["a"]);
        assert!(picks(&balancer, &["a", "b", "c"], now, 1).is_empty());
    }

    #[test]
    fn round_robin_ignores_load() {
        let balancer = balancer(Policy::RoundRobin, &["a", "b"]);
        balancer.inner.pool().replicas[0]
            .load
            .in_flight
            .store(5, Ordering::Relaxed);
        assert_eq!(
            picks(&balancer, &[], Instant::now(), 4),
            ["a", "b", "a", "b"]
        );
    }

    #[test]
    fn an_ejected_replica_is_skipped_until_its_time_is_up_or_all_are() {
        let balancer = balancer(Policy::RoundRobin, &["a", "b"]);
        let eject_for = balancer.inner.config.eject_for;
        let t0 = Instant::now();
        eject_at(&balancer, "a", t0);
        assert_eq!(picks(&balancer, &[], t0, 3), ["b", "b", "b"]);
        // The only one left to try is ejected: tried rather than failing.
        assert_eq!(picks(&balancer, &["b"], t0, 1), ["a"]);
        // Both ejected: the least recently first.
        eject_at(&balancer, "b", t0 + Duration::from_secs(1));
        assert_eq!(
            picks(&balancer, &[], t0 + Duration::from_secs(2), 2),
            ["a", "a"]
        );
        // Both back in turn (which went on from `a`).
        let later = t0 + Duration::from_secs(1) + eject_for;
        assert_eq!(picks(&balancer, &[], later, 2), ["b", "a"]);
        let stats = balancer.stats();
        assert!(stats.replicas.iter().all(|r| r.ejected), "{stats:?}");
    }

    #[test]
    fn set_replicas_keeps_a_replica_by_id_and_leaves_out_bad_ones() {
        let balancer = balancer(Policy::LeastLoad, &["a", "b"]);
        let now = Instant::now();
        eject_at(&balancer, "a", now);
        balancer.inner.pool().replicas[0]
            .load
            .answered
            .store(3, Ordering::Relaxed);
        let a = |id: &str| Replica {
            id: id.to_owned(),
            url: "http://127.0.0.1:9000".to_owned(),
        };
        balancer.set_replicas(vec![a("a")]);
        let stats = balancer.stats();
        assert_eq!(stats.replicas.len(), 1);
        assert!(stats.replicas[0].ejected);
        assert_eq!(stats.replicas[0].answered, 3);
        // Restarted under a new id: a fresh start.
        balancer.set_replicas(vec![a("a#2")]);
        let stats = balancer.stats();
        assert!(!stats.replicas[0].ejected);
        assert_eq!(stats.replicas[0].answered, 0);
        let bad = |id: &str, url: &str| Replica {
            id: id.to_owned(),
            url: url.to_owned(),
        };
        balancer.set_replicas(vec![
            a("a#2"),
            a("a#2"),
            bad("tls", "https://127.0.0.1:9001"),
            bad("garbage", "not a url"),
            bad("query", "http://127.0.0.1:9002/?x=1"),
            bad("prefixed", "http://127.0.0.1:9003/env/"),
        ]);
        let ids: Vec<String> = balancer
            .stats()
            .replicas
            .into_iter()
            .map(|r| r.id)
            .collect();
        assert_eq!(ids, ["a#2", "prefixed"]);
    }

    #[test]
    fn a_path_prefix_of_the_replica_url_is_kept() {
        let base = Base::parse("http://127.0.0.1:9003/env/").unwrap();
        assert_eq!(
            base.uri("/step?x=1").unwrap().to_string(),
            "http://127.0.0.1:9003/env/step?x=1"
        );
        let base = Base::parse("http://localhost").unwrap();
        assert_eq!(base.uri("/").unwrap().to_string(), "http://localhost/");
        assert_eq!(base.socket(), "localhost:80");
    }

    #[test]
    fn idempotent_requests_are_safe_methods_and_the_listed_posts() {
        let balancer = balancer(Policy::LeastLoad, &[]);
        let inner = &balancer.inner;
        for (method, path, expected) in [
            (Method::GET, "/anything", true),
            (Method::PUT, "/anything", true),
            (Method::DELETE, "/anything", true),
            (Method::POST, "/v1/chat/completions", true),
            (Method::POST, "/v1/embeddings", true),
            (Method::POST, "/v1/chat/completions/", false),
            (Method::POST, "/reset", false),
            (Method::PATCH, "/v1/chat/completions", false),
        ] {
            assert_eq!(
                inner.is_idempotent(&method, path),
                expected,
                "{method} {path}"
            );
        }
    }

    #[test]
    fn hop_by_hop_headers_and_those_named_in_connection_are_dropped() {
        let mut headers = HeaderMap::new();
        for (name, value) in [
            ("connection", "keep-alive, x-private"),
            ("keep-alive", "timeout=5"),
            ("transfer-encoding", "chunked"),
            ("x-private", "1"),
            ("authorization", "Bearer k"),
            ("content-type", "application/json"),
        ] {
            headers.insert(name, HeaderValue::from_static(value));
        }
        strip_hop_by_hop(&mut headers);
        let mut left: Vec<&str> = headers.keys().map(|k| k.as_str()).collect();
        left.sort_unstable();
        assert_eq!(left, ["authorization", "content-type"]);
        assert!(is_upgrade(&HeaderMap::from_iter([
            (
                header::CONNECTION,
                HeaderValue::from_static("keep-alive, Upgrade")
            ),
            (header::UPGRADE, HeaderValue::from_static("websocket")),
        ])));
        assert!(!is_upgrade(&HeaderMap::from_iter([(
            header::UPGRADE,
            HeaderValue::from_static("websocket")
        )])));
    }

    #[test]
    fn small_sized_responses_are_buffered_and_streams_are_not() {
        let balancer = Balancer::new(BalancerConfig {
            max_buffered_response_bytes: 100,
            ..BalancerConfig::default()
        });
        let headers = |pairs: &[(header::HeaderName, &'static str)]| {
            HeaderMap::from_iter(
                pairs
                    .iter()
                    .map(|(n, v)| (n.clone(), HeaderValue::from_static(v))),
            )
        };
        let inner = &balancer.inner;
        assert!(inner.buffers(&headers(&[(header::CONTENT_LENGTH, "100")])));
        assert!(!inner.buffers(&headers(&[(header::CONTENT_LENGTH, "101")])));
        assert!(!inner.buffers(&headers(&[])));
        assert!(!inner.buffers(&headers(&[
            (header::CONTENT_LENGTH, "10"),
            (header::CONTENT_TYPE, "text/event-stream; charset=utf-8"),
        ])));
    }
}
