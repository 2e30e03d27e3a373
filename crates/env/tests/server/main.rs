//! The server over real sockets: protocol, bad input, bounds, sessions, API keys.

mod api_keys;

use std::sync::Arc;
use std::time::Duration;

use agentstack_env::client::{ClientConfig, ClientError, EnvClient, HttpClient};
use agentstack_env::server::{Server, ServerConfig, ServerHandle};
use agentstack_env::{
    EnvError, EnvInfo, EnvSpec, Environment, ResetArgs, Step, TaskError, TaskSource, ToolCallError,
};
use agentstack_protocol::http::ResetRequest;
use agentstack_protocol::mcp::{ToolSpec, code, method};
use agentstack_protocol::tasks::{Split, SplitType};
use agentstack_protocol::ws::{ErrorCode, ServerMessage};
use futures_util::{SinkExt, StreamExt};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use tokio_tungstenite::tungstenite::Message;

/// A counter: each step adds `amount`; reward is the new total / 10.
#[derive(Default)]
struct Counter {
    total: i64,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct Add {
    amount: i64,
}

#[derive(Serialize, JsonSchema)]
struct Total {
    total: i64,
}

#[derive(Serialize, JsonSchema)]
struct CounterState {
    total: i64,
}

struct Numbers;

impl TaskSource for Numbers {
    fn splits(&self) -> Vec<Split> {
        vec![Split {
            name: "train".into(),
            kind: SplitType::Train,
        }]
    }
    fn num_tasks(&self, split: &str) -> Result<usize, TaskError> {
        if split == "train" {
            Ok(5)
        } else {
            Err(self.unknown_split(split))
        }
    }
    fn task(&self, split: &str, index: usize) -> Result<Value, TaskError> {
        if index >= self.num_tasks(split)? {
            return Err(TaskError::InvalidIndex);
        }
        Ok(json!({"start": index}))
    }
}

impl Environment for Counter {
    type Action = Add;
    type Observation = Total;
    type State = CounterState;

    fn info(&self) -> EnvInfo {
        EnvInfo::new("counter", "Adds numbers")
    }

    async fn reset(&mut self, args: ResetArgs) -> Result<Step<Total>, EnvError> {
        if args.options.contains_key("explode") {
            return Err(EnvError::new("asked to explode"));
        }
        self.total = args.seed.unwrap_or(0) as i64;
        Ok(Step::new(Total { total: self.total }))
    }

    async fn step(&mut self, action: Add) -> Result<Step<Total>, EnvError> {
        if action.amount == 999 {
            tokio::time::sleep(Duration::from_secs(5)).await;
        }
        self.total += action.amount;
        Ok(Step::new(Total { total: self.total })
            .with_reward(self.total as f64 / 10.0)
            .with_done(self.total >= 10))
    }

    fn state(&self) -> CounterState {
        CounterState { total: self.total }
    }

    fn tools(&self) -> Vec<ToolSpec> {
        vec![ToolSpec {
            name: "peek".into(),
            description: "The total".into(),
            input_schema: json!({"type":"object","properties":{}}),
        }]
    }

    async fn call_tool(
        &mut self,
        name: &str,
        _arguments: Map<String, Value>,
    ) -> Result<Value, ToolCallError> {
        match name {
            "peek" => Ok(json!(self.total)),
            other => Err(ToolCallError::NotFound(other.to_owned())),
        }
    }

    fn task_source(&self) -> Option<Arc<dyn TaskSource>> {
        Some(Arc::new(Numbers))
    }
}

struct Running {
    url: String,
    handle: ServerHandle,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.handle.shutdown();
    }
}

async fn start(config: ServerConfig) -> Running {
    let server = Server::bind(config, vec![EnvSpec::new(Counter::default)])
        .await
        .unwrap();
    let url = server.url();
    let handle = server.handle();
    tokio::spawn(server.serve());
    Running { url, handle }
}

async fn raw(
    url: &str,
    query: &str,
) -> tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>> {
    let ws = url.replace("http://", "ws://");
    tokio_tungstenite::connect_async(format!("{ws}/ws{query}"))
        .await
        .unwrap()
        .0
}

async fn reply<S>(socket: &mut S) -> Value
where
    S: StreamExt<Item = Result<Message, tokio_tungstenite::tungstenite::Error>> + Unpin,
{
    loop {
        let msg = tokio::time::timeout(Duration::from_secs(10), socket.next())
            .await
            .expect("reply in time");
        match msg {
            Some(Ok(Message::Text(t))) => return serde_json::from_str(t.as_str()).unwrap(),
            Some(Ok(Message::Close(frame))) => {
                return json!({"closed": frame.map(|f| u16::from(f.code))});
            }
            Some(Ok(_)) => continue,
            other => return json!({"ended": format!("{other:?}")}),
        }
    }
}

#[tokio::test]
async fn episode_over_websocket() {
    let server = start(ServerConfig::default()).await;
    let mut client = EnvClient::connect(&server.url, ClientConfig::default())
        .await
        .unwrap();
    let r = client
        .reset(ResetRequest {
            seed: Some(3),
            episode_id: Some("ep-1".into()),
            options: Map::new(),
        })
        .await
        .unwrap();
    assert_eq!(r.observation["total"], 3);
    assert_eq!(
        r.observation["metadata"],
        json!({}),
        "metadata nested as the reference does"
    );
    assert_eq!(r.reward, None);
    let r = client.step(&json!({"amount": 4})).await.unwrap();
    assert_eq!(
        (r.observation["total"].clone(), r.reward, r.done),
        (json!(7), Some(0.7), false)
    );
    let r = client
        .step(&json!({"amount": 4, "metadata": {}}))
        .await
        .unwrap();
    assert!(r.done, "the Action base's metadata key is accepted");
    let state = client.state().await.unwrap();
    assert_eq!(state["episode_id"], "ep-1");
    assert_eq!(state["step_count"], 2);
    assert_eq!(state["total"], 11);
    client.close().await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(server.handle.active_sessions(), 0);
}

#[tokio::test]
async fn bad_frames_get_reference_codes_and_the_session_survives() {
    let server = start(ServerConfig::default()).await;
    let mut ws = raw(&server.url, "").await;
    let cases = [
        ("{oops", "INVALID_JSON"),
        (r#"{"type":"teleport"}"#, "UNKNOWN_TYPE"),
        (r#"{"type":"state","extra":true}"#, "VALIDATION_ERROR"),
        (
            r#"{"type":"step","data":{"amount":"many"}}"#,
            "VALIDATION_ERROR",
        ),
        (
            r#"{"type":"step","data":{"amount":1,"bogus":2}}"#,
            "VALIDATION_ERROR",
        ),
        (r#"{"type":"step","data":{}}"#, "VALIDATION_ERROR"),
        (r#"{"type":"reset","data":{"seed":-1}}"#, "VALIDATION_ERROR"),
        (
            r#"{"type":"reset","data":{"explode":true}}"#,
            "EXECUTION_ERROR",
        ),
    ];
    for (frame, code) in cases {
        ws.send(Message::Text(frame.into())).await.unwrap();
        let r = reply(&mut ws).await;
        assert_eq!(r["type"], "error", "{frame}: {r}");
        assert_eq!(r["data"]["code"], code, "{frame}: {r}");
        assert!(
            r["data"]["message"].as_str().unwrap().len() > 5,
            "says what was wrong: {r}"
        );
    }
    // The wrong field is named.
    ws.send(Message::Text(
        r#"{"type":"step","data":{"amount":1,"bogus":2}}"#.into(),
    ))
    .await
    .unwrap();
    let r = reply(&mut ws).await;
    assert!(
        r["data"]["message"].as_str().unwrap().contains("bogus"),
        "{r}"
    );
    // Step before reset is allowed, as in the reference.
    ws.send(Message::Text(
        r#"{"type":"step","data":{"amount":2}}"#.into(),
    ))
    .await
    .unwrap();
    assert_eq!(reply(&mut ws).await["type"], "observation");
    // A binary frame is fatal: SESSION_ERROR then close 1000.
    ws.send(Message::Binary(vec![1, 2, 3].into()))
        .await
        .unwrap();
    let r = reply(&mut ws).await;
    assert_eq!(r["data"]["code"], "SESSION_ERROR");
    assert_eq!(reply(&mut ws).await, json!({"closed": 1000}));
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(server.handle.active_sessions(), 0);
}

fn socket_addr(url: &str) -> std::net::SocketAddr {
    url.trim_start_matches("http://").parse().unwrap()
}

/// The header-read timeout of the tests of connection limits.
const HEADER_TIMEOUT: Duration = Duration::from_millis(300);

/// Regression (issue 19): an unfinished request head held its connection forever.
#[tokio::test]
async fn a_slow_request_head_is_closed_after_the_header_timeout() {
    let server = start(ServerConfig {
        header_read_timeout: HEADER_TIMEOUT,
        ..ServerConfig::default()
    })
    .await;
    let closed = agentstack_serve::probe::time_to_close(
        socket_addr(&server.url),
        b"GET /health HTTP/1.1\r\nHost: slow",
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    assert!(closed.is_some(), "the server held a slow request head open");
}

#[tokio::test]
async fn a_websocket_session_outlives_the_header_timeout() {
    let server = start(ServerConfig {
        header_read_timeout: HEADER_TIMEOUT,
        ..ServerConfig::default()
    })
    .await;
    let mut ws = raw(&server.url, "").await;
    ws.send(Message::Text(r#"{"type":"reset","data":{}}"#.into()))
        .await
        .unwrap();
    assert_eq!(reply(&mut ws).await["type"], "observation");
    tokio::time::sleep(HEADER_TIMEOUT * 3).await;
    ws.send(Message::Text(
        r#"{"type":"step","data":{"amount":2}}"#.into(),
    ))
    .await
    .unwrap();
    let r = reply(&mut ws).await;
    assert_eq!(r["type"], "observation", "{r}");
}

#[tokio::test]
async fn websocket_sessions_hold_connection_slots() {
    let server = start(ServerConfig {
        max_connections: 2,
        ..ServerConfig::default()
    })
    .await;
    let first = raw(&server.url, "").await;
    let _second = raw(&server.url, "").await;
    let url = format!("{}/health", server.url);
    let third = tokio::spawn(async move { reqwest::get(url).await.map(|r| r.status()) });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !third.is_finished(),
        "a request was served while two WebSockets held both connection slots"
    );
    drop(first);
    let status = tokio::time::timeout(Duration::from_secs(5), third)
        .await
        .expect("the request is served once a WebSocket closes")
        .unwrap()
        .unwrap();
    assert_eq!(status, 200);
}

#[tokio::test]
async fn oversized_frame_is_refused_with_a_message() {
    let server = start(ServerConfig {
        max_frame_bytes: 64 * 1024,
        ..ServerConfig::default()
    })
    .await;
    let mut ws = raw(&server.url, "").await;
    let big = format!(
        r#"{{"type":"step","data":{{"amount":1,"pad":"{}"}}}}"#,
        "x".repeat(100 * 1024)
    );
    let _ = ws.send(Message::Text(big.into())).await;
    let r = reply(&mut ws).await;
    assert_eq!(r["data"]["code"], "SESSION_ERROR", "{r}");
    assert!(
        r["data"]["message"].as_str().unwrap().contains("65536"),
        "{r}"
    );
    // The server is still up.
    let mut client = EnvClient::connect(&server.url, ClientConfig::default())
        .await
        .unwrap();
    client.reset(ResetRequest::default()).await.unwrap();
}

#[tokio::test]
async fn unknown_session_and_capacity_are_fatal() {
    let server = start(ServerConfig {
        max_sessions: 2,
        ..ServerConfig::default()
    })
    .await;
    let mut ws = raw(&server.url, "?session_id=nope").await;
    let r = reply(&mut ws).await;
    assert_eq!(r["data"]["code"], "SESSION_ERROR");
    assert_eq!(r["data"]["message"], "Unknown session_id: nope");
    assert_eq!(reply(&mut ws).await, json!({"closed": 1000}));

    let a = EnvClient::connect(&server.url, ClientConfig::default())
        .await
        .unwrap();
    let b = EnvClient::connect(&server.url, ClientConfig::default())
        .await
        .unwrap();
    let mut c = raw(&server.url, "").await;
    let r = reply(&mut c).await;
    assert_eq!(r["data"]["code"], "CAPACITY_REACHED", "{r}");
    assert_eq!(r["data"]["max_sessions"], 2);
    assert_eq!(reply(&mut c).await, json!({"closed": 1000}));
    drop((a, b));
}

#[tokio::test]
async fn ten_thousand_abandoned_sessions_are_all_released() {
    let server = start(ServerConfig::default()).await;
    let baseline = server.handle.active_sessions();
    // Abandon in batches so file descriptors stay within the default soft limit.
    for _batch in 0..50 {
        let sockets = futures_util::future::join_all((0..200).map(|_| async {
            let mut ws = raw(&server.url, "").await;
            ws.send(Message::Text(r#"{"type":"reset"}"#.into()))
                .await
                .unwrap();
            assert_eq!(reply(&mut ws).await["type"], "observation");
            ws
        }))
        .await;
        drop(sockets); // no close frame: the TCP connections just go away
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while server.handle.active_sessions() > baseline {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} sessions leaked",
            server.handle.active_sessions()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn abandoned_mcp_sessions_are_reaped_when_idle() {
    let server = start(ServerConfig {
        idle_timeout: Duration::from_millis(300),
        ..ServerConfig::default()
    })
    .await;
    let http = HttpClient::new(&server.url, Duration::from_secs(10)).unwrap();
    for _ in 0..200 {
        let r = http.mcp(method::SESSION_CREATE, Map::new()).await.unwrap();
        assert!(r.outcome.unwrap()["session_id"].is_string());
    }
    assert_eq!(server.handle.active_sessions(), 200);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(server.handle.active_sessions(), 0);
}

#[tokio::test]
async fn idle_websocket_is_closed_with_a_reason() {
    let server = start(ServerConfig {
        idle_timeout: Duration::from_millis(200),
        ..ServerConfig::default()
    })
    .await;
    let mut ws = raw(&server.url, "").await;
    let r = reply(&mut ws).await;
    assert_eq!(r["data"]["code"], "SESSION_ERROR");
    assert!(r["data"]["message"].as_str().unwrap().contains("idle"));
    assert_eq!(reply(&mut ws).await, json!({"closed": 1000}));
}

#[tokio::test]
async fn slow_step_times_out_and_server_stays_up() {
    let server = start(ServerConfig {
        step_timeout: Duration::from_millis(200),
        ..ServerConfig::default()
    })
    .await;
    let mut client = EnvClient::connect(&server.url, ClientConfig::default())
        .await
        .unwrap();
    client.reset(ResetRequest::default()).await.unwrap();
    match client.step(&json!({"amount": 999})).await {
        Err(ClientError::Server(e)) => {
            assert_eq!(e.code, ErrorCode::ExecutionError);
            assert!(e.message.contains("step timeout"), "{e}");
        }
        other => panic!("expected a timeout error, got {other:?}"),
    }
    client.step(&json!({"amount": 1})).await.unwrap();
}

#[tokio::test]
async fn shutdown_closes_sessions_with_1000() {
    let server = start(ServerConfig::default()).await;
    let mut ws = raw(&server.url, "").await;
    ws.send(Message::Text(r#"{"type":"reset"}"#.into()))
        .await
        .unwrap();
    reply(&mut ws).await;
    server.handle.shutdown();
    assert_eq!(reply(&mut ws).await, json!({"closed": 1000}));
}

#[tokio::test]
async fn mcp_sessions_bind_to_websockets() {
    let server = start(ServerConfig::default()).await;
    let http = HttpClient::new(&server.url, Duration::from_secs(10)).unwrap();
    let created = http
        .mcp(method::SESSION_CREATE, Map::new())
        .await
        .unwrap()
        .outcome
        .unwrap();
    let sid = created["session_id"].as_str().unwrap().to_owned();
    let mut client = EnvClient::attach(&server.url, &sid, ClientConfig::default())
        .await
        .unwrap();
    client
        .reset(ResetRequest {
            seed: Some(5),
            ..Default::default()
        })
        .await
        .unwrap();
    let mut params = Map::new();
    params.insert("session_id".into(), json!(sid));
    params.insert("name".into(), json!("peek"));
    let peek = http
        .mcp(method::TOOLS_CALL, params.clone())
        .await
        .unwrap()
        .outcome
        .unwrap();
    assert_eq!(
        peek["data"], 5,
        "tools/call sees the WebSocket's episode: {peek}"
    );
    // A second socket cannot attach.
    let mut second = raw(&server.url, &format!("?session_id={sid}")).await;
    assert_eq!(reply(&mut second).await["data"]["code"], "SESSION_ERROR");
    // Closing while attached defers.
    let mut close = Map::new();
    close.insert("session_id".into(), json!(sid));
    let closing = http
        .mcp(method::SESSION_CLOSE, close.clone())
        .await
        .unwrap()
        .outcome
        .unwrap();
    assert_eq!(closing["closing"], true);
    client.close().await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(server.handle.active_sessions(), 0);
    let gone = http
        .mcp(method::SESSION_CLOSE, close)
        .await
        .unwrap()
        .outcome
        .unwrap_err();
    assert_eq!(gone.code, code::INVALID_PARAMS);
    // Through the WebSocket's own mcp envelope.
    let mut client = EnvClient::connect(&server.url, ClientConfig::default())
        .await
        .unwrap();
    let tools = client
        .mcp(method::TOOLS_LIST, Map::new())
        .await
        .unwrap()
        .outcome
        .unwrap();
    assert_eq!(tools["tools"][0]["inputSchema"]["type"], "object");
    // And the step-path actions of 0.3.0 clients.
    let r = client.step(&json!({"type":"list_tools"})).await.unwrap();
    assert_eq!(r.observation["tools"][0]["input_schema"]["type"], "object");
    let r = client
        .step(&json!({"type":"call_tool","tool_name":"nope","arguments":{}}))
        .await
        .unwrap();
    assert_eq!(r.observation["error"]["error_type"], "tool_not_found");
}

#[tokio::test]
async fn mcp_http_errors_have_reference_codes() {
    let server = start(ServerConfig::default()).await;
    let http = HttpClient::new(&server.url, Duration::from_secs(10)).unwrap();
    let cases = [
        ("{", code::PARSE_ERROR),
        ("{}", code::INVALID_REQUEST),
        (
            r#"{"jsonrpc":"2.0","method":"nope","id":1}"#,
            code::METHOD_NOT_FOUND,
        ),
        (
            r#"{"jsonrpc":"2.0","method":"tools/call","params":{},"id":2}"#,
            code::INVALID_PARAMS,
        ),
        (
            r#"{"jsonrpc":"2.0","method":"tools/list","params":{"session_id":"x"},"id":3}"#,
            code::INVALID_PARAMS,
        ),
        (
            r#"{"jsonrpc":"2.0","method":"tools/call","params":{"name":"nope"},"id":4}"#,
            code::INTERNAL_ERROR,
        ),
    ];
    for (body, want) in cases {
        let (status, v) = http.post_json("/mcp", body.into()).await.unwrap();
        assert_eq!(status, 200, "always HTTP 200");
        assert_eq!(v["jsonrpc"], "2.0");
        assert_eq!(v["error"]["code"], want, "{body}: {v}");
    }
}

#[tokio::test]
async fn http_routes_match_the_reference() {
    let server = start(ServerConfig::default()).await;
    let http = HttpClient::new(&server.url, Duration::from_secs(10)).unwrap();
    assert_eq!(
        http.get_json("/health").await.unwrap().1,
        json!({"status":"healthy"})
    );
    let meta = http.metadata().await.unwrap();
    assert_eq!(meta.name, "counter");
    let schema = http.schema().await.unwrap();
    assert_eq!(schema.action["required"], json!(["amount"]));
    assert!(schema.observation["properties"]["reward"].is_object());
    assert!(schema.state["properties"]["step_count"].is_object());
    let (_, doc) = http.get_json("/openapi.json").await.unwrap();
    assert_eq!(doc["info"]["version"], "1.0.0");
    let (s, r) = http
        .post_json("/reset", r#"{"seed":4}"#.into())
        .await
        .unwrap();
    assert_eq!((s, r["observation"]["total"].clone()), (200, json!(4)));
    let (s, r) = http.post_json("/reset", "".into()).await.unwrap();
    assert_eq!(s, 200, "empty body is allowed: {r}");
    let (s, r) = http
        .post_json("/reset", r#"{"seed":-3}"#.into())
        .await
        .unwrap();
    assert_eq!(
        (s, r["detail"][0]["loc"].clone()),
        (422, json!(["body", "seed"]))
    );
    let (s, r) = http
        .post_json("/step", r#"{"action":{"amount":3}}"#.into())
        .await
        .unwrap();
    assert_eq!((s, r["reward"].clone()), (200, json!(0.3)));
    let (s, r) = http.post_json("/step", "{}".into()).await.unwrap();
    assert_eq!(
        (s, r["detail"][0]["loc"].clone()),
        (422, json!(["body", "action"]))
    );
    let (s, r) = http
        .post_json("/step", r#"{"action":{"amount":"x"}}"#.into())
        .await
        .unwrap();
    assert_eq!((s, r["detail"][0]["loc"].clone()), (422, json!(["amount"])));
    let (s, r) = http.get_json("/state").await.unwrap();
    assert_eq!((s, r["step_count"].clone()), (200, json!(0)));
    // Prefixed routes.
    let (s, r) = http.get_json("/counter/health").await.unwrap();
    assert_eq!((s, r), (200, json!({"status":"healthy"})));
    let (s, _) = http.get_json("/nothing-here").await.unwrap();
    assert_eq!(s, 404);
    // Task API.
    assert_eq!(
        http.get_json("/list_environments").await.unwrap().1,
        json!(["counter"])
    );
    let (s, r) = http.get_json("/counter/splits").await.unwrap();
    assert_eq!((s, r), (200, json!([{"name":"train","type":"train"}])));
    let (s, r) = http
        .post_json("/counter/num_tasks", r#"{"split":"train"}"#.into())
        .await
        .unwrap();
    assert_eq!((s, r), (200, json!({"num_tasks":5})));
    let (_, r) = http
        .post_json("/counter/task", r#"{"split":"train","index":-1}"#.into())
        .await
        .unwrap();
    assert_eq!(r, json!({"task":{"start":4}}));
    let (s, r) = http
        .post_json("/counter/task", r#"{"split":"train","index":9}"#.into())
        .await
        .unwrap();
    assert_eq!((s, r), (400, json!({"detail":"Invalid task index"})));
    let (_, r) = http
        .post_json(
            "/counter/task_range",
            r#"{"split":"train","start":1,"stop":3}"#.into(),
        )
        .await
        .unwrap();
    assert_eq!(r["tasks"].as_array().unwrap().len(), 2);
    let (s, r) = http
        .post_json("/counter/tasks", r#"{"split":"train"}"#.into())
        .await
        .unwrap();
    assert_eq!((s, r["env_name"].clone()), (200, json!("counter")));
    let (s, r) = http.get_json("/other/splits").await.unwrap();
    assert_eq!(
        (s, r),
        (404, json!({"detail":"unknown environment 'other'"}))
    );
    let (s, _) = http
        .post_json("/counter/tasks", r#"{"split":"train","x":1}"#.into())
        .await
        .unwrap();
    assert_eq!(s, 422);
}

#[tokio::test]
async fn conformance_suite_passes_on_our_server() {
    let server = start(ServerConfig::default()).await;
    let report = agentstack_env::conformance::validate(&server.url, &Default::default())
        .await
        .unwrap();
    let failed: Vec<_> = report
        .checks
        .iter()
        .filter(|c| c.status == agentstack_env::conformance::Status::Fail)
        .collect();
    assert!(report.passed, "{failed:#?}");
    assert!(report.checks.len() >= 15);
}

#[tokio::test]
async fn server_messages_parse_with_protocol_types() {
    let server = start(ServerConfig::default()).await;
    let mut client = EnvClient::connect(&server.url, ClientConfig::default())
        .await
        .unwrap();
    match client
        .request_raw(r#"{"type":"state"}"#.into())
        .await
        .unwrap()
    {
        ServerMessage::State(s) => assert_eq!(s["step_count"], 0),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn pool_drives_parallel_sessions_and_typed_client_decodes() {
    use agentstack_env::client::{EnvPool, TypedEnvClient};

    let server = start(ServerConfig::default()).await;
    let mut pool = EnvPool::connect(&server.url, 16, 4, ClientConfig::default())
        .await
        .unwrap();
    assert_eq!(server.handle.active_sessions(), 16);
    let results = futures_util::future::join_all(pool.clients().iter_mut().enumerate().map(
        |(i, c)| async move {
            c.reset(ResetRequest {
                seed: Some(i as u64),
                ..Default::default()
            })
            .await
            .unwrap();
            c.step(&json!({"amount": 1})).await.unwrap().observation["total"]
                .as_i64()
                .unwrap()
        },
    ))
    .await;
    assert_eq!(
        results,
        (1..=16).collect::<Vec<i64>>(),
        "each session keeps its own state"
    );
    pool.close().await.unwrap();

    #[derive(Serialize)]
    struct AddAction {
        amount: i64,
    }
    #[derive(Deserialize, Debug)]
    struct TotalObservation {
        total: i64,
    }
    let mut typed = TypedEnvClient::<AddAction, TotalObservation>::connect(
        &server.url,
        ClientConfig::default(),
    )
    .await
    .unwrap();
    typed
        .reset(ResetRequest {
            seed: Some(2),
            ..Default::default()
        })
        .await
        .unwrap();
    let r = typed.step(&AddAction { amount: 3 }).await.unwrap();
    assert_eq!(r.observation.total, 5);
    assert_eq!(r.reward, Some(0.5));
    typed.close().await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(server.handle.active_sessions(), 0);
}

/// A client reads a server's whole task list through the Task API, from the server's
/// root or from the environment's own prefix; a server without one gives `None`.
#[tokio::test]
async fn a_client_reads_the_task_list_through_the_task_api() {
    let server = start(ServerConfig::default()).await;
    for base in [server.url.clone(), format!("{}/counter", server.url)] {
        let http = HttpClient::new(&base, Duration::from_secs(10)).unwrap();
        let list = http
            .task_list("counter")
            .await
            .unwrap()
            .expect("a task list");
        assert_eq!(list.splits(), Numbers.splits(), "{base}");
        assert_eq!(list.num_tasks("train").unwrap(), 5);
        for i in 0..5 {
            assert_eq!(
                list.task("train", i).unwrap(),
                Numbers.task("train", i).unwrap()
            );
        }
        assert_eq!(list.task("train", 5), Err(TaskError::InvalidIndex));
        assert!(matches!(
            list.num_tasks("test"),
            Err(TaskError::UnknownSplit { .. })
        ));
    }
    // An environment the server does not have: no Task API for it.
    let http = HttpClient::new(&server.url, Duration::from_secs(10)).unwrap();
    assert!(http.task_list("nothing").await.unwrap().is_none());
}
