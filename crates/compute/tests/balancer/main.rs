//! The load balancer against real servers on loopback: axum routers standing in for
//! replicas (killable: a replica's connections die with it, as a crashed process's do)
//! and raw TCP servers that break connections on purpose. Every wait is bounded by
//! [`BOUND`], so a regression fails instead of hanging; nothing is timed.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use agentstack_compute::balancer::{
    Balancer, BalancerConfig, Policy, REPLICA_HEADER, Replica, Stats,
};
use agentstack_serve::auth::ApiKey;
use axum::Router;
use axum::body::Body;
use axum::extract::ws::{Message, WebSocketUpgrade};
use axum::http::{HeaderMap, Request, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Mutex, Semaphore, mpsc};
use tokio::task::{JoinHandle, JoinSet};
use tower::ServiceExt;

/// The longest any step of a test may take before it counts as hung.
const BOUND: Duration = Duration::from_secs(30);

/// A replica server on a free loopback port. Its connections are tasks of its own
/// task, so [`TestReplica::kill`] closes all of them at once and frees the port: what
/// clients see when a replica's process dies.
struct TestReplica {
    name: String,
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl TestReplica {
    async fn start(name: &str, router: Router) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let mut connections = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((stream, _)) = accepted else { continue };
                        let service = TowerToHyperService::new(router.clone());
                        connections.spawn(async move {
                            let _ = hyper::server::conn::http1::Builder::new()
                                .serve_connection(TokioIo::new(stream), service)
                                .with_upgrades()
                                .await;
                        });
                    }
                    Some(_) = connections.join_next(), if !connections.is_empty() => {}
                }
            }
        });
        Self {
            name: name.to_owned(),
            addr,
            task,
        }
    }

    fn replica(&self) -> Replica {
        Replica {
            id: self.name.clone(),
            url: format!("http://{}", self.addr),
        }
    }

    fn kill(&self) {
        self.task.abort();
    }
}

impl Drop for TestReplica {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Routes of an OpenAI-compatible replica named `name`.
fn openai(name: &str) -> Router {
    let name = name.to_owned();
    let chat = {
        let name = name.clone();
        move |body: Bytes| async move {
            axum::Json(serde_json::json!({"replica": name, "prompt_bytes": body.len()}))
        }
    };
    let models = move || async move { axum::Json(serde_json::json!({"data": [{"id": name}]})) };
    Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/jobs", post(|| async { "created" }))
        .route(
            "/echo-auth",
            post(|headers: HeaderMap| async move {
                format!("{:?}", headers.get(header::AUTHORIZATION))
            }),
        )
}

/// How a [`broken_replica`] fails each request.
#[derive(Clone, Copy)]
enum Break {
    /// Reads the request head, then resets the connection without answering.
    BeforeHead,
    /// Answers a head promising 100 bytes, sends 7, and closes.
    MidBody,
}

/// A raw TCP server that breaks every connection after reading a request head, and
/// counts the heads it read.
async fn broken_replica(how: Break) -> (Replica, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let heads = Arc::new(AtomicUsize::new(0));
    let counted = heads.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let heads = counted.clone();
            tokio::spawn(async move {
                read_head(&mut stream).await;
                heads.fetch_add(1, Ordering::SeqCst);
                if let Break::MidBody = how {
                    let _ = stream
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
                        .await;
                }
                let _ = stream.set_zero_linger();
            });
        }
    });
    let replica = Replica {
        id: "broken".to_owned(),
        url: format!("http://{addr}"),
    };
    (replica, heads)
}

/// Reads from `stream` until the end of a message head; returns what was read.
async fn read_head(stream: &mut TcpStream) -> String {
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 65536 {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&head).into_owned()
}

/// A replica address nothing listens on (bound, then released).
async fn dead_replica() -> Replica {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    Replica {
        id: "dead".to_owned(),
        url: format!("http://{addr}"),
    }
}

/// Serves `balancer` on a free loopback port until the test's runtime ends.
async fn serve(balancer: &Balancer) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(balancer.clone().serve(listener, std::future::pending()));
    addr
}

/// A balancer with `config` over `replicas`, served as [`serve`] does.
async fn serve_over(config: BalancerConfig, replicas: Vec<Replica>) -> (Balancer, SocketAddr) {
    let balancer = Balancer::new(config);
    balancer.set_replicas(replicas);
    let addr = serve(&balancer).await;
    (balancer, addr)
}

/// Sends a GET for `path` to the balancer at `addr`.
async fn get_from(http: &reqwest::Client, addr: SocketAddr, path: &str) -> reqwest::Response {
    http.get(format!("http://{addr}{path}"))
        .send()
        .await
        .unwrap()
}

/// Sends a POST of `body` to `path` on the balancer at `addr` (an empty body goes out
/// as no body does: `content-length: 0`).
async fn post_to(
    http: &reqwest::Client,
    addr: SocketAddr,
    path: &str,
    body: &'static str,
) -> reqwest::Response {
    http.post(format!("http://{addr}{path}"))
        .body(body)
        .send()
        .await
        .unwrap()
}

/// The response to a request sent on a task of its own, waited for within [`BOUND`].
async fn response_of(sent: JoinHandle<reqwest::Result<reqwest::Response>>) -> reqwest::Response {
    tokio::time::timeout(BOUND, sent)
        .await
        .unwrap()
        .unwrap()
        .unwrap()
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(BOUND)
        .build()
        .unwrap()
}

fn answered_by(response: &reqwest::Response) -> String {
    response
        .headers()
        .get(REPLICA_HEADER)
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default()
}

/// The `error.message` of a balancer's JSON error.
async fn error_message(response: reqwest::Response) -> String {
    let json: serde_json::Value = response.json().await.unwrap();
    assert_eq!(json["error"]["type"], "load_balancer", "{json}");
    json["error"]["message"].as_str().unwrap().to_owned()
}

/// Polls the balancer's stats until `ready` holds of them.
async fn stats_until(balancer: &Balancer, ready: impl Fn(&Stats) -> bool) -> Stats {
    tokio::time::timeout(BOUND, async {
        loop {
            let stats = balancer.stats();
            if ready(&stats) {
                return stats;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the balancer's stats never got there")
}

fn config(policy: Policy) -> BalancerConfig {
    BalancerConfig {
        policy,
        replica_wait: BOUND,
        ..BalancerConfig::default()
    }
}

#[tokio::test]
async fn least_load_sends_to_the_replica_with_fewer_requests_in_flight() {
    let gate = Arc::new(Semaphore::new(0));
    let held = |name: &str| {
        let gate = gate.clone();
        openai(name).route(
            "/hold",
            get(move || async move {
                let _ = gate.acquire().await;
                "released"
            }),
        )
    };
    let (a, b) = (
        TestReplica::start("a", held("a")).await,
        TestReplica::start("b", held("b")).await,
    );
    let (balancer, addr) =
        serve_over(config(Policy::LeastLoad), vec![a.replica(), b.replica()]).await;
    let http = client();

    // Idle replicas: ties go in turn.
    let mut order = Vec::new();
    for _ in 0..4 {
        let response = get_from(&http, addr, "/v1/models").await;
        assert_eq!(response.status(), StatusCode::OK);
        order.push(answered_by(&response));
    }
    assert_eq!(order, ["a", "b", "a", "b"]);

    // One replica busy: every request goes to the other.
    let holding = tokio::spawn({
        let (http, url) = (http.clone(), format!("http://{addr}/hold"));
        async move { http.get(url).send().await.unwrap() }
    });
    let stats = stats_until(&balancer, |s| {
        s.replicas.iter().map(|r| r.in_flight).sum::<u64>() == 1
    })
    .await;
    let busy = stats.replicas.iter().find(|r| r.in_flight == 1).unwrap();
    let idle = if busy.id == "a" { "b" } else { "a" };
    for _ in 0..3 {
        let response = get_from(&http, addr, "/v1/models").await;
        assert_eq!(answered_by(&response), idle, "{stats:?}");
    }
    gate.add_permits(1);
    let held = tokio::time::timeout(BOUND, holding).await.unwrap().unwrap();
    assert_eq!(answered_by(&held), busy.id);
    assert_eq!(held.text().await.unwrap(), "released");
}

#[tokio::test]
async fn round_robin_takes_each_replica_in_turn() {
    let replicas = [
        TestReplica::start("a", openai("a")).await,
        TestReplica::start("b", openai("b")).await,
        TestReplica::start("c", openai("c")).await,
    ];
    let (balancer, addr) = serve_over(
        config(Policy::RoundRobin),
        replicas.iter().map(TestReplica::replica).collect(),
    )
    .await;
    let http = client();
    let mut order = Vec::new();
    for _ in 0..6 {
        let response = post_to(&http, addr, "/v1/chat/completions", "{}").await;
        assert_eq!(response.status(), StatusCode::OK);
        order.push(answered_by(&response));
    }
    assert_eq!(order, ["a", "b", "c", "a", "b", "c"]);
    let stats = balancer.stats();
    assert!(stats.replicas.iter().all(|r| r.answered == 2), "{stats:?}");
    assert_eq!((stats.requests, stats.retried, stats.failed), (6, 0, 0));
}

#[tokio::test]
async fn a_request_to_a_dead_replica_is_answered_by_the_other() {
    let alive = TestReplica::start("alive", openai("alive")).await;
    let replicas = vec![dead_replica().await, alive.replica()];
    let (balancer, addr) = serve_over(config(Policy::RoundRobin), replicas).await;
    let http = client();
    // The dead replica comes first in turn; a refused connection is retried whatever
    // the method, as the request never reached it.
    let response = post_to(&http, addr, "/v1/chat/completions", r#"{"messages": []}"#).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(answered_by(&response), "alive");
    let stats = balancer.stats();
    assert_eq!((stats.retried, stats.failed), (1, 0), "{stats:?}");
    assert!(stats.replicas[0].ejected, "{stats:?}");

    // Ejected, the dead one is not tried again: no retry for the next requests.
    for _ in 0..3 {
        let response = post_to(&http, addr, "/v1/jobs", "").await;
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(answered_by(&response), "alive");
    }
    assert_eq!(balancer.stats().retried, 1);

    // Given again under a new id (restarted), it is tried again; a refused
    // non-idempotent POST still goes to the other.
    let mut restarted = dead_replica().await;
    restarted.id = "dead#2".to_owned();
    balancer.set_replicas(vec![restarted, alive.replica()]);
    let response = post_to(&http, addr, "/v1/jobs", "").await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(balancer.stats().retried, 2);
}

#[tokio::test]
async fn a_broken_connection_is_retried_for_idempotent_requests_only() {
    let alive = TestReplica::start("alive", openai("alive")).await;
    let http = client();
    for (method, path, retried) in [
        ("GET", "/v1/models", true),
        ("POST", "/v1/chat/completions", true),
        ("POST", "/v1/jobs", false),
    ] {
        let (broken, heads) = broken_replica(Break::BeforeHead).await;
        let (balancer, addr) =
            serve_over(config(Policy::RoundRobin), vec![broken, alive.replica()]).await;
        let response = http
            .request(method.parse().unwrap(), format!("http://{addr}{path}"))
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(heads.load(Ordering::SeqCst), 1, "{method} {path}");
        let stats = balancer.stats();
        if retried {
            assert_eq!(response.status(), StatusCode::OK, "{method} {path}");
            assert_eq!(answered_by(&response), "alive");
            assert_eq!((stats.retried, stats.failed), (1, 0), "{stats:?}");
        } else {
            assert_eq!(
                response.status(),
                StatusCode::BAD_GATEWAY,
                "{method} {path}"
            );
            let message = error_message(response).await;
            assert!(
                message.contains("replica broken broke the connection before it answered")
                    && message.contains("was not sent again")
                    && message.contains("may not be idempotent"),
                "{message}"
            );
            assert_eq!((stats.retried, stats.failed), (0, 1), "{stats:?}");
        }
    }
}

#[tokio::test]
async fn a_response_body_that_breaks_while_buffered_is_retried() {
    let alive = TestReplica::start("alive", openai("alive")).await;
    let (broken, heads) = broken_replica(Break::MidBody).await;
    let (_balancer, addr) =
        serve_over(config(Policy::RoundRobin), vec![broken, alive.replica()]).await;
    let response = get_from(&client(), addr, "/v1/models").await;
    assert_eq!(heads.load(Ordering::SeqCst), 1);
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(answered_by(&response), "alive");
    let json: serde_json::Value = response.json().await.unwrap();
    assert_eq!(json["data"][0]["id"], "alive");
}

/// A replica whose `/sse` streams what the test sends into the returned channel (an
/// error breaks the stream), one request at a time.
async fn streaming_replica() -> (
    TestReplica,
    mpsc::Sender<Result<&'static str, std::io::Error>>,
) {
    let (tx, rx) = mpsc::channel::<Result<&'static str, std::io::Error>>(4);
    let rx = Arc::new(Mutex::new(Some(rx)));
    let router = Router::new().route(
        "/sse",
        get(move || async move {
            let rx = rx.lock().await.take().expect("one stream per test");
            let events = futures_util::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.map(|event| (event, rx))
            });
            Response::builder()
                .header(header::CONTENT_TYPE, "text/event-stream")
                .body(Body::from_stream(events))
                .unwrap()
        }),
    );
    (TestReplica::start("streamer", router).await, tx)
}

/// Reads the response's body until it has `expected` more bytes.
async fn read_chunks(response: &mut reqwest::Response, expected: &str) {
    let mut got = Vec::new();
    while got.len() < expected.len() {
        let chunk = tokio::time::timeout(BOUND, response.chunk())
            .await
            .expect("the chunk never came")
            .unwrap()
            .expect("the body ended early");
        got.extend_from_slice(&chunk);
    }
    assert_eq!(String::from_utf8_lossy(&got), expected);
}

#[tokio::test]
async fn a_streamed_response_passes_through_chunk_by_chunk() {
    let (streamer, events) = streaming_replica().await;
    let (balancer, addr) = serve_over(config(Policy::LeastLoad), vec![streamer.replica()]).await;
    events.send(Ok("data: 1\n\n")).await.unwrap();
    let mut response = get_from(&client(), addr, "/sse").await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(answered_by(&response), "streamer");
    assert_eq!(
        response.headers()[header::CONTENT_TYPE],
        "text/event-stream"
    );
    // Each event is sent only once the one before it reached the client.
    read_chunks(&mut response, "data: 1\n\n").await;
    assert_eq!(balancer.stats().replicas[0].in_flight, 1);
    events.send(Ok("data: 2\n\n")).await.unwrap();
    read_chunks(&mut response, "data: 2\n\n").await;
    drop(events);
    let end = tokio::time::timeout(BOUND, response.chunk()).await.unwrap();
    assert!(matches!(end, Ok(None)), "{end:?}");
    stats_until(&balancer, |s| s.replicas[0].in_flight == 0).await;
}

#[tokio::test]
async fn a_stream_that_breaks_after_its_first_chunk_breaks_the_clients_response() {
    let (streamer, events) = streaming_replica().await;
    let (balancer, addr) = serve_over(config(Policy::LeastLoad), vec![streamer.replica()]).await;
    events.send(Ok("data: 1\n\n")).await.unwrap();
    let mut response = get_from(&client(), addr, "/sse").await;
    read_chunks(&mut response, "data: 1\n\n").await;
    events
        .send(Err(std::io::Error::other("the replica died")))
        .await
        .unwrap();
    let rest = tokio::time::timeout(BOUND, response.chunk()).await.unwrap();
    assert!(
        rest.is_err(),
        "the client must see a broken response, got {rest:?}"
    );
    let stats = balancer.stats();
    assert_eq!((stats.retried, stats.failed), (0, 0), "{stats:?}");
}

#[tokio::test]
async fn the_replica_gets_the_clients_headers_less_hop_by_hop_ones() {
    let router = Router::new().route(
        "/headers",
        get(|headers: HeaderMap| async move {
            let all = |name: &str| {
                headers
                    .get_all(name)
                    .iter()
                    .map(|v| v.to_str().unwrap().to_owned())
                    .collect::<Vec<_>>()
            };
            axum::Json(serde_json::json!({
                "host": all("host"),
                "x-forwarded-for": all("x-forwarded-for"),
                "x-private": all("x-private"),
                "x-kept": all("x-kept"),
            }))
        }),
    );
    let replica = TestReplica::start("a", router).await;
    let (_balancer, addr) = serve_over(config(Policy::LeastLoad), vec![replica.replica()]).await;
    let response = client()
        .get(format!("http://{addr}/headers"))
        .header("connection", "x-private")
        .header("x-private", "for the balancer only")
        .header("x-kept", "yes")
        .header("x-forwarded-for", "10.0.0.1")
        .send()
        .await
        .unwrap();
    assert_eq!(answered_by(&response), "a");
    let seen: serde_json::Value = response.json().await.unwrap();
    assert_eq!(
        seen,
        serde_json::json!({
            "host": [replica.addr.to_string()],
            "x-forwarded-for": ["10.0.0.1", "127.0.0.1"],
            "x-private": [],
            "x-kept": ["yes"],
        })
    );
    // A HEAD keeps the length of what a GET would send.
    let head = client()
        .head(format!("http://{addr}/headers"))
        .send()
        .await
        .unwrap();
    assert_eq!(head.status(), StatusCode::OK);
    assert!(head.headers().contains_key(header::CONTENT_LENGTH));
}

#[tokio::test]
async fn a_replica_that_times_out_is_not_sent_the_request_again() {
    let router =
        |name: &str| openai(name).route("/v1/hang", get(std::future::pending::<&'static str>));
    let slow = TestReplica::start("slow", router("slow")).await;
    let other = TestReplica::start("other", router("other")).await;
    let short_timeout = BalancerConfig {
        upstream_timeout: Duration::from_millis(300),
        ..config(Policy::RoundRobin)
    };
    let (balancer, addr) = serve_over(short_timeout, vec![slow.replica(), other.replica()]).await;
    let response = get_from(&client(), addr, "/v1/hang").await;
    assert_eq!(response.status(), StatusCode::GATEWAY_TIMEOUT);
    let message = error_message(response).await;
    assert!(
        message.starts_with("replica slow did not send its response head within 300ms")
            && message.contains("may still be working on it"),
        "{message}"
    );
    let stats = balancer.stats();
    assert_eq!((stats.retried, stats.failed), (0, 1), "{stats:?}");
    assert_eq!(stats.replicas[1].answered, 0, "{stats:?}");
    assert!(!stats.replicas[0].ejected, "{stats:?}");
}

async fn oneshot(balancer: &Balancer, request: Request<Body>) -> (StatusCode, String) {
    let response = balancer.router().oneshot(request).await.unwrap();
    let status = response.status();
    let body = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .unwrap();
    (status, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test(start_paused = true)]
async fn with_no_ready_replica_a_request_waits_then_gets_503() {
    let wait = Duration::from_secs(20);
    let balancer = Balancer::new(BalancerConfig {
        replica_wait: wait,
        ..BalancerConfig::default()
    });
    let start = tokio::time::Instant::now();
    let request = Request::get("/v1/models").body(Body::empty()).unwrap();
    let (status, body) = oneshot(&balancer, request).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(
        start.elapsed() >= wait,
        "answered after {:?}",
        start.elapsed()
    );
    let json: serde_json::Value = serde_json::from_str(&body).unwrap();
    let message = json["error"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("no replica of the service is ready (waited 20s)"),
        "{message}"
    );
    assert_eq!(json["error"]["type"], "load_balancer");
    let stats = balancer.stats();
    assert_eq!((stats.failed, stats.waiting), (1, 0), "{stats:?}");
}

#[tokio::test]
async fn a_replica_added_while_a_request_waits_lets_it_through() {
    let late = TestReplica::start("late", openai("late")).await;
    let balancer = Balancer::new(config(Policy::LeastLoad));
    let addr = serve(&balancer).await;
    let waiting = tokio::spawn(
        client()
            .post(format!("http://{addr}/v1/chat/completions"))
            .body("{}")
            .send(),
    );
    stats_until(&balancer, |s| s.waiting == 1).await;
    balancer.set_replicas(vec![late.replica()]);
    let response = response_of(waiting).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(answered_by(&response), "late");
    assert_eq!(balancer.stats().waiting, 0);
}

#[tokio::test]
async fn a_body_over_the_limit_gets_413() {
    let balancer = Balancer::new(BalancerConfig {
        max_body_bytes: 1024,
        ..BalancerConfig::default()
    });
    let sized = Request::post("/v1/chat/completions")
        .header(header::CONTENT_LENGTH, 2048)
        .body(Body::from(vec![b'x'; 2048]))
        .unwrap();
    let chunks = futures_util::stream::iter(
        (0..4).map(|_| Ok::<_, std::io::Error>(Bytes::from(vec![b'x'; 512]))),
    );
    let chunked = Request::post("/v1/chat/completions")
        .body(Body::from_stream(chunks))
        .unwrap();
    for request in [sized, chunked] {
        let (status, body) = oneshot(&balancer, request).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{body}");
        assert!(body.contains("limit of 1024 bytes"), "{body}");
    }
    assert_eq!(balancer.stats().failed, 0);
}

/// Sends a POST whose head promises a body that never comes; returns the answer's
/// head, which must come without the body.
async fn post_without_body(addr: SocketAddr, authorization: Option<&str>) -> String {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let authorization = authorization
        .map(|a| format!("authorization: {a}\r\n"))
        .unwrap_or_default();
    let head = format!(
        "POST /echo-auth HTTP/1.1\r\nhost: test\r\n{authorization}content-length: 1000\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    tokio::time::timeout(BOUND, read_head(&mut stream))
        .await
        .expect("the refusal waited for the body")
}

#[tokio::test]
async fn with_keys_a_request_without_a_valid_key_is_refused_before_its_body_is_read() {
    let replica = TestReplica::start("a", openai("a")).await;
    let with_keys = BalancerConfig {
        keys: vec![ApiKey::new("k1").unwrap()],
        ..config(Policy::LeastLoad)
    };
    let (balancer, addr) = serve_over(with_keys, vec![replica.replica()]).await;
    for authorization in [None, Some("Bearer wrong")] {
        let head = post_without_body(addr, authorization).await;
        assert!(
            head.starts_with("HTTP/1.1 401"),
            "{authorization:?}: {head}"
        );
    }
    let http = client();
    let refused = post_to(&http, addr, "/echo-auth", "").await;
    assert_eq!(refused.status(), StatusCode::UNAUTHORIZED);
    assert!(
        error_message(refused)
            .await
            .contains("Authorization: Bearer")
    );
    let health = get_from(&http, addr, "/health").await;
    assert_eq!(health.status(), StatusCode::OK);
    // An accepted key reaches the replica unchanged: it checks keys too.
    let accepted = http
        .post(format!("http://{addr}/echo-auth"))
        .bearer_auth("k1")
        .send()
        .await
        .unwrap();
    assert_eq!(accepted.status(), StatusCode::OK);
    assert_eq!(accepted.text().await.unwrap(), r#"Some("Bearer k1")"#);
    assert_eq!(
        balancer.stats().requests,
        2,
        "refused requests are not balanced"
    );
}

#[tokio::test]
async fn a_websocket_is_joined_to_one_replica_byte_for_byte() {
    let router = Router::new()
        .route(
            "/ws",
            get(|upgrade: WebSocketUpgrade| async move {
                upgrade.on_upgrade(|mut socket| async move {
                    while let Some(Ok(message)) = socket.recv().await {
                        if let Message::Text(_) | Message::Binary(_) = message
                            && socket.send(message).await.is_err()
                        {
                            break;
                        }
                    }
                })
            }),
        )
        .route(
            "/refused",
            get(|| async { (StatusCode::FORBIDDEN, "no sessions left").into_response() }),
        );
    let replica = TestReplica::start("env", router).await;
    let replicas = vec![dead_replica().await, replica.replica()];
    let (balancer, addr) = serve_over(config(Policy::LeastLoad), replicas).await;

    let (mut socket, response) = tokio::time::timeout(
        BOUND,
        tokio_tungstenite::connect_async(format!("ws://{addr}/ws")),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(response.headers()[REPLICA_HEADER], "env");
    for text in ["hello", "again"] {
        socket
            .send(tokio_tungstenite::tungstenite::Message::text(text))
            .await
            .unwrap();
        let echo = tokio::time::timeout(BOUND, socket.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(echo.into_text().unwrap().as_str(), text);
    }
    assert_eq!(balancer.stats().replicas[1].in_flight, 1);
    socket.close(None).await.unwrap();
    // The replica answers the close and hangs up; the tunnel ends when both sides did.
    while let Ok(Some(Ok(_))) = tokio::time::timeout(BOUND, socket.next()).await {}
    drop(socket);
    stats_until(&balancer, |s| s.replicas[1].in_flight == 0).await;

    let refused = tokio_tungstenite::connect_async(format!("ws://{addr}/refused")).await;
    match refused {
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
            assert_eq!(response.status(), StatusCode::FORBIDDEN);
            assert_eq!(response.headers()[REPLICA_HEADER], "env");
            assert_eq!(response.body().as_deref(), Some(&b"no sessions left"[..]));
        }
        other => panic!("the replica's refusal should be relayed, got {other:?}"),
    }
}

#[tokio::test]
async fn requests_sent_while_a_replica_is_killed_all_succeed() {
    /// Requests answered before the kill, and after it, before the test ends.
    const BEFORE: usize = 40;
    const AFTER: usize = 200;
    /// Client tasks sending at once, so that requests are in flight at the kill.
    const CLIENTS: usize = 4;
    let slow = |name: &str| {
        openai(name).route(
            "/v1/embeddings",
            post(|| async {
                tokio::time::sleep(Duration::from_millis(5)).await;
                "[]"
            }),
        )
    };
    // On `a` (the one killed), `/v1/completions` never answers: a request held there
    // is certainly in flight when it dies.
    let held_on_a = Arc::new(AtomicUsize::new(0));
    let hangs = {
        let held_on_a = held_on_a.clone();
        slow("a").route(
            "/v1/completions",
            post(move || async move {
                held_on_a.fetch_add(1, Ordering::SeqCst);
                std::future::pending::<()>().await;
            }),
        )
    };
    let a = TestReplica::start("a", hangs).await;
    let b = TestReplica::start(
        "b",
        slow("b").route("/v1/completions", post(|| async { "b" })),
    )
    .await;
    let (balancer, addr) =
        serve_over(config(Policy::LeastLoad), vec![a.replica(), b.replica()]).await;

    let ok = Arc::new(AtomicUsize::new(0));
    let killed = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = JoinSet::new();
    for client_no in 0..CLIENTS {
        let (ok, killed, stop, http) = (ok.clone(), killed.clone(), stop.clone(), client());
        clients.spawn(async move {
            let mut failures = Vec::new();
            let mut after_kill_by = Vec::new();
            let mut n = client_no;
            while !stop.load(Ordering::SeqCst) {
                n += 1;
                let sent_after_kill = killed.load(Ordering::SeqCst);
                let request = match n % 3 {
                    0 => http.get(format!("http://{addr}/v1/models")),
                    1 => http
                        .post(format!("http://{addr}/v1/chat/completions"))
                        .body("{}"),
                    _ => http.post(format!("http://{addr}/v1/embeddings")).body("{}"),
                };
                match request.send().await {
                    Ok(response) if response.status() == StatusCode::OK => {
                        let by = answered_by(&response);
                        match response.bytes().await {
                            Ok(_) => {
                                ok.fetch_add(1, Ordering::SeqCst);
                                if sent_after_kill {
                                    after_kill_by.push(by);
                                }
                            }
                            Err(e) => failures.push(format!("body: {e}")),
                        }
                    }
                    Ok(response) => failures.push(format!(
                        "{}: {}",
                        response.status(),
                        response.text().await.unwrap_or_default()
                    )),
                    Err(e) => failures.push(e.to_string()),
                }
            }
            (failures, after_kill_by)
        });
    }
    let wait_for = |count: usize| {
        let ok = ok.clone();
        async move {
            tokio::time::timeout(BOUND, async {
                while ok.load(Ordering::SeqCst) < count {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            })
            .await
            .expect("the clients stalled");
        }
    };
    wait_for(BEFORE).await;
    // Completions until one is held on `a` (those that went to `b` are answered).
    let mut completions = Vec::new();
    while held_on_a.load(Ordering::SeqCst) == 0 {
        let sent = client()
            .post(format!("http://{addr}/v1/completions"))
            .body("{}")
            .send();
        completions.push(tokio::spawn(sent));
        tokio::time::timeout(BOUND, async {
            while held_on_a.load(Ordering::SeqCst) == 0
                && !completions.last().unwrap().is_finished()
            {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
        .await
        .unwrap();
    }
    a.kill();
    killed.store(true, Ordering::SeqCst);
    wait_for(ok.load(Ordering::SeqCst) + AFTER).await;
    stop.store(true, Ordering::SeqCst);

    let mut failures = Vec::new();
    let mut after_kill_by = Vec::new();
    while let Some(finished) = clients.join_next().await {
        let (f, by) = finished.unwrap();
        failures.extend(f);
        after_kill_by.extend(by);
    }
    for completion in completions {
        let response = response_of(completion).await;
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(answered_by(&response), "b");
    }
    let stats = balancer.stats();
    assert!(
        failures.is_empty(),
        "{} failed: {failures:?}",
        failures.len()
    );
    assert!(after_kill_by.len() >= AFTER / 2, "{}", after_kill_by.len());
    assert!(
        after_kill_by.iter().all(|by| by == "b"),
        "a killed replica answered: {after_kill_by:?}"
    );
    assert_eq!(stats.failed, 0, "{stats:?}");
    assert!(stats.retried >= 1, "{stats:?}");
}
