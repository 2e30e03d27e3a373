//! A server with API keys: every route but `/health` needs `Authorization: Bearer KEY`,
//! checked before a body is read or a WebSocket accepted; the same in front of a
//! foreign environment's proxy.

use agentstack_env::client::EnvPool;
use agentstack_env::server::ApiKey;
use reqwest::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_tungstenite::tungstenite::Error as WsError;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

use super::*;

/// The keys of the guarded servers here; a request may bear either.
const KEYS: [&str; 2] = ["first-key", "second-key"];

fn keyed_config() -> ServerConfig {
    ServerConfig {
        api_keys: KEYS.iter().map(|k| ApiKey::new(*k).unwrap()).collect(),
        ..ServerConfig::default()
    }
}

/// `method route` with `body`, bearing `key` (none: no `Authorization` header).
async fn send(
    base: &str,
    method: &str,
    route: &str,
    body: &str,
    key: Option<&str>,
) -> (StatusCode, reqwest::header::HeaderMap, Value) {
    let client = reqwest::Client::new();
    let url = format!("{base}{route}");
    let mut request = match method {
        "GET" => client.get(&url),
        _ => client
            .post(&url)
            .header("content-type", "application/json")
            .body(body.to_owned()),
    };
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let response = request.send().await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let text = response.text().await.unwrap();
    (
        status,
        headers,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// Opens a WebSocket on `route` bearing `key`: the socket, or the HTTP status the
/// upgrade was refused with.
async fn open_ws(
    base: &str,
    route: &str,
    key: Option<&str>,
) -> Result<
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>,
    (u16, String),
> {
    let url = format!("{}{route}", base.replace("http://", "ws://"));
    let mut request = url.into_client_request().unwrap();
    if let Some(key) = key {
        request
            .headers_mut()
            .insert("authorization", format!("Bearer {key}").parse().unwrap());
    }
    match tokio_tungstenite::connect_async(request).await {
        Ok((socket, _)) => Ok(socket),
        Err(WsError::Http(response)) => Err((
            response.status().as_u16(),
            String::from_utf8_lossy(response.body().as_deref().unwrap_or_default()).into_owned(),
        )),
        Err(e) => panic!("{route}: expected an accepted or refused upgrade, got {e}"),
    }
}

/// Every route of the server but `/health`, with a body that works when the key does.
const GUARDED: [(&str, &str, &str); 14] = [
    ("POST", "/reset", r#"{"seed":1}"#),
    ("POST", "/step", r#"{"action":{"amount":2}}"#),
    ("GET", "/state", ""),
    ("GET", "/schema", ""),
    ("GET", "/metadata", ""),
    ("GET", "/openapi.json", ""),
    (
        "POST",
        "/mcp",
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#,
    ),
    ("POST", "/counter/reset", ""),
    ("GET", "/counter/schema", ""),
    ("GET", "/list_environments", ""),
    ("GET", "/counter/splits", ""),
    ("POST", "/counter/tasks", r#"{"split":"train"}"#),
    ("POST", "/counter/num_tasks", r#"{"split":"train"}"#),
    ("POST", "/counter/task", r#"{"split":"train","index":0}"#),
];

/// Regression: `env serve` answered every route to anyone who could reach it. With
/// keys, each route but `/health` answers 401 `{"detail": ...}` with
/// `WWW-Authenticate: Bearer` to a request without a key, with a wrong one or with a
/// prefix of a right one; either right key is served.
#[tokio::test]
async fn api_keys_guard_every_http_route_but_health() {
    let server = start(keyed_config()).await;
    for (method, route, body) in GUARDED.iter().chain(&[("GET", "/nowhere", "")]) {
        for key in [None, Some("wrong-key"), Some("first-ke")] {
            let (status, headers, answer) = send(&server.url, method, route, body, key).await;
            assert_eq!(status, 401, "{method} {route} with {key:?}: {answer}");
            assert_eq!(headers["www-authenticate"], "Bearer", "{method} {route}");
            let detail = answer["detail"].as_str().unwrap_or_default();
            assert!(detail.contains("API key"), "{method} {route}: {answer}");
        }
    }
    let (_, _, missing) = send(&server.url, "GET", "/schema", "", None).await;
    let (_, _, wrong) = send(&server.url, "GET", "/schema", "", Some("nope")).await;
    assert_ne!(missing, wrong, "no key and a wrong key are told apart");
    for health in ["/health", "/counter/health"] {
        let (status, _, answer) = send(&server.url, "GET", health, "", None).await;
        assert_eq!(
            (status, answer),
            (StatusCode::OK, json!({"status": "healthy"})),
            "{health}"
        );
    }
    for (i, (method, route, body)) in GUARDED.iter().enumerate() {
        let key = KEYS[i % KEYS.len()];
        let (status, _, answer) = send(&server.url, method, route, body, Some(key)).await;
        assert_eq!(status, 200, "{method} {route} with the key: {answer}");
    }
}

/// Regression: without a key, the `/ws` and `/mcp` upgrades are refused with 401 (no
/// socket is accepted and then closed); with one, a session plays an episode.
#[tokio::test]
async fn api_keys_guard_the_websocket_upgrades() {
    let server = start(keyed_config()).await;
    for route in ["/ws", "/mcp", "/counter/ws", "/counter/mcp"] {
        for key in [None, Some("wrong-key")] {
            match open_ws(&server.url, route, key).await {
                Err((status, body)) => {
                    assert_eq!(status, 401, "{route} with {key:?}: {body}");
                    assert!(body.contains("API key"), "{route}: {body}");
                }
                Ok(_) => panic!("{route} with {key:?}: the upgrade was accepted"),
            }
        }
    }
    assert_eq!(server.handle.active_sessions(), 0);
    let mut ws = open_ws(&server.url, "/ws", Some(KEYS[1])).await.unwrap();
    ws.send(Message::Text(
        r#"{"type":"reset","data":{"seed":3}}"#.into(),
    ))
    .await
    .unwrap();
    assert_eq!(reply(&mut ws).await["data"]["observation"]["total"], 3);
    ws.send(Message::Text(
        r#"{"type":"step","data":{"amount":4}}"#.into(),
    ))
    .await
    .unwrap();
    assert_eq!(reply(&mut ws).await["data"]["observation"]["total"], 7);
    let mut mcp = open_ws(&server.url, "/counter/mcp", Some(KEYS[0]))
        .await
        .unwrap();
    mcp.send(Message::Text(
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#.into(),
    ))
    .await
    .unwrap();
    assert_eq!(reply(&mut mcp).await["result"]["tools"][0]["name"], "peek");
}

/// Regression: a request without a key is answered 401 before its body is read: one
/// announcing 10 GB gets its answer at once, over a real socket.
#[tokio::test]
async fn a_request_without_a_key_is_refused_before_its_body_is_read() {
    let server = start(keyed_config()).await;
    let mut socket = tokio::net::TcpStream::connect(socket_addr(&server.url))
        .await
        .unwrap();
    socket
        .write_all(b"POST /reset HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 10000000000\r\n\r\n{\"seed\": ")
        .await
        .unwrap();
    let mut answer = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(10), socket.read(&mut answer))
        .await
        .expect("the 401 comes without the body")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
}

/// A server's keys never show in its configuration's `Debug` (which a caller may log).
#[test]
fn keys_do_not_show_in_the_config() {
    let shown = format!("{:?}", keyed_config());
    for key in KEYS {
        assert!(!shown.contains(key), "{shown}");
    }
    assert!(shown.contains("api_keys"), "{shown}");
}

/// An upstream that answers every request with the `Authorization` header it got.
async fn header_echo() -> String {
    async fn echo(headers: axum::http::HeaderMap) -> String {
        format!("{:?}", headers.get("authorization"))
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = axum::Router::new()
        .route("/health", axum::routing::get(|| async { "healthy" }))
        .fallback(echo);
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

/// Regression: a foreign environment behind `env serve` was reachable without a key.
/// The proxy asks for one on everything but `/health`, WebSockets included, and does
/// not hand it on to the foreign server.
#[tokio::test]
async fn api_keys_guard_a_proxied_foreign_environment() {
    // Our own keyless server as the foreign one, for real sessions through the proxy.
    let foreign = start(ServerConfig::default()).await;
    let proxy = Server::bind_proxy(keyed_config(), &foreign.url)
        .await
        .unwrap();
    let url = proxy.url();
    let proxy_handle = proxy.handle();
    tokio::spawn(proxy.serve());
    let _stop = Running {
        url: url.clone(),
        handle: proxy_handle,
    };
    for (method, route, body) in &GUARDED[..7] {
        let (status, _, answer) = send(&url, method, route, body, None).await;
        assert_eq!(status, 401, "{method} {route}: {answer}");
        let (status, _, answer) = send(&url, method, route, body, Some(KEYS[0])).await;
        assert_eq!(status, 200, "{method} {route} with the key: {answer}");
    }
    let (status, _, _) = send(&url, "GET", "/health", "", None).await;
    assert_eq!(status, 200);
    let refused = open_ws(&url, "/ws", Some("wrong-key")).await.err();
    assert_eq!(refused.map(|(status, _)| status), Some(401));
    let mut ws = open_ws(&url, "/ws", Some(KEYS[0])).await.unwrap();
    ws.send(Message::Text(
        r#"{"type":"reset","data":{"seed":5}}"#.into(),
    ))
    .await
    .unwrap();
    assert_eq!(reply(&mut ws).await["data"]["observation"]["total"], 5);

    let upstream = header_echo().await;
    let proxy = Server::bind_proxy(keyed_config(), &upstream).await.unwrap();
    let url = proxy.url();
    let proxy_handle = proxy.handle();
    tokio::spawn(proxy.serve());
    let _stop_echo = Running {
        url: url.clone(),
        handle: proxy_handle,
    };
    let (status, _, seen) = send(&url, "GET", "/anything", "", Some(KEYS[1])).await;
    assert_eq!(
        (status, seen),
        (StatusCode::OK, json!("None")),
        "the foreign server saw the key"
    );
}

/// The client settings bearing `key`.
fn client_with(key: Option<&str>) -> ClientConfig {
    ClientConfig {
        api_key: key.map(|k| ApiKey::new(k).unwrap()),
        ..ClientConfig::default()
    }
}

/// Regression: the Rust client could not reach a server with keys. With
/// [`ClientConfig::api_key`] it sends the key on HTTP requests and the WebSocket
/// upgrade; without it, or with a wrong one, it fails with
/// [`ClientError::Unauthorized`], whose message says to set `AGENTSTACK_API_KEY`.
#[tokio::test]
async fn the_client_sends_its_key_and_explains_a_401() {
    let server = start(keyed_config()).await;
    for key in [None, Some("wrong-key")] {
        let config = client_with(key);
        let error = EnvClient::connect(&server.url, config.clone())
            .await
            .err()
            .expect("a session without the key");
        let ClientError::Unauthorized { key_sent, .. } = &error else {
            panic!("expected Unauthorized, got {error:?}");
        };
        assert_eq!(*key_sent, key.is_some());
        let message = error.to_string();
        assert!(message.contains("AGENTSTACK_API_KEY"), "{message}");
        assert!(message.contains("401"), "{message}");
        let http = HttpClient::from_config(&server.url, &config).unwrap();
        let error = http.metadata().await.unwrap_err();
        assert!(
            matches!(error, ClientError::Unauthorized { key_sent, .. } if key_sent == key.is_some()),
            "{error:?}"
        );
        let error = http.mcp(method::TOOLS_LIST, Map::new()).await.unwrap_err();
        assert!(
            matches!(error, ClientError::Unauthorized { .. }),
            "{error:?}"
        );
        let error = http.task_list("counter").await.unwrap_err();
        assert!(
            matches!(error, ClientError::Unauthorized { .. }),
            "a 401 is not 'no task list': {error:?}"
        );
        assert!(http.health().await.is_ok(), "/health needs no key");
    }

    let config = client_with(Some(KEYS[1]));
    assert!(!format!("{config:?}").contains(KEYS[1]), "{config:?}");
    let http = HttpClient::from_config(&server.url, &config).unwrap();
    assert_eq!(http.metadata().await.unwrap().name, "counter");
    assert!(http.task_list("counter").await.unwrap().is_some());
    let mut client = EnvClient::connect(&server.url, config.clone())
        .await
        .unwrap();
    client
        .reset(ResetRequest {
            seed: Some(2),
            ..Default::default()
        })
        .await
        .unwrap();
    let step = client.step(&json!({"amount": 3})).await.unwrap();
    assert_eq!(step.observation["total"], 5);
    client.close().await.unwrap();
    let mut pool = EnvPool::connect(&server.url, 3, 2, config).await.unwrap();
    assert_eq!(pool.clients().len(), 3);
    pool.close().await.unwrap();
}

/// `env validate` against a server with keys: with the key every check passes; without
/// it the checks do not run and the error is the client's 401.
#[tokio::test]
async fn conformance_checks_a_server_with_keys() {
    use agentstack_env::conformance::{Options, ValidateError, validate};

    let server = start(keyed_config()).await;
    let options = Options {
        api_key: Some(ApiKey::new(KEYS[0]).unwrap()),
        ..Options::default()
    };
    let report = validate(&server.url, &options).await.unwrap();
    assert!(report.passed, "{:#?}", report.checks);
    let error = validate(&server.url, &Options::default())
        .await
        .unwrap_err();
    assert!(
        matches!(
            error,
            ValidateError::Unauthorized(ClientError::Unauthorized {
                key_sent: false,
                ..
            })
        ),
        "{error:?}"
    );
}
