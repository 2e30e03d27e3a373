//! The HTTP server on the real model: answers, and bad input answered with a 4xx that
//! says what was wrong, while the server stays up.

use std::time::{Duration, Instant};

use agentstack_model::constraint::ConstraintCompiler;
use agentstack_model::engine::{Engine, EngineConfig};
use agentstack_model::generate::{GenerateRequest, generate};
use agentstack_model::server::{AppState, ServerConfig, app};
use axum::body::Body;
use axum::http::{Request, StatusCode};
use serde_json::{Value, json};
use tower::ServiceExt;

use super::{chat, lm};

fn state() -> AppState {
    let lm = lm();
    let compiler = ConstraintCompiler::new(lm.tokenizer()).unwrap();
    let engine = Engine::start(lm, EngineConfig::default());
    AppState::new(
        engine,
        Some(compiler),
        ServerConfig {
            model_name: "smollm2".into(),
            ..Default::default()
        },
    )
}

async fn call(
    state: &AppState,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> (StatusCode, Value) {
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .body(body.map_or_else(Body::empty, |b| Body::from(b.to_owned())))
        .unwrap();
    let response = app(state.clone()).oneshot(request).await.unwrap();
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 24)
        .await
        .unwrap();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

async fn post(state: &AppState, path: &str, body: Value) -> (StatusCode, Value) {
    call(state, "POST", path, Some(&body.to_string())).await
}

fn message(body: &Value) -> &str {
    body["error"]["message"].as_str().unwrap_or("")
}

#[tokio::test]
#[ignore = "needs the SmolLM2 model (scripts/fetch-model)"]
async fn generate_returns_exactly_the_sampled_tokens() {
    let state = state();
    let prompt = chat(&lm(), "Name a fruit.");
    let (status, body) = post(
        &state,
        "/generate",
        json!({"input_ids": prompt, "max_tokens": 12, "temperature": 0, "top_logprobs": 2}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let direct = generate(
        &lm(),
        &GenerateRequest {
            top_logprobs: 2,
            ..GenerateRequest::greedy(prompt.clone(), 12)
        },
    )
    .unwrap();
    let ids: Vec<u32> = serde_json::from_value(body["output_ids"].clone()).unwrap();
    let logprobs: Vec<f32> = serde_json::from_value(body["logprobs"].clone()).unwrap();
    assert_eq!(ids, direct.tokens);
    assert_eq!(logprobs, direct.logprobs);
    assert_eq!(body["top_logprobs"][0].as_array().unwrap().len(), 2);

    let (status, body) = post(&state, "/tokenize", json!({"text": "Hello <|im_end|>"})).await;
    assert_eq!(status, StatusCode::OK);
    let tokens = body["tokens"].clone();
    let (_, text) = post(&state, "/detokenize", json!({"tokens": tokens})).await;
    assert_eq!(text["text"], "Hello <|im_end|>");

    let (status, models) = call(&state, "GET", "/v1/models", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(models["data"][0]["id"], "smollm2");
}

#[tokio::test]
#[ignore = "needs the SmolLM2 model (scripts/fetch-model)"]
async fn bad_input_gets_a_clear_4xx_and_the_server_stays_up() {
    let state = state();
    let user = json!([{"role": "user", "content": "hi"}]);
    let cases: Vec<(&str, Value, StatusCode, &str)> = vec![
        (
            "/generate",
            json!({"input_ids": [1, 2, 999999], "max_tokens": 4}),
            StatusCode::BAD_REQUEST,
            "out of range",
        ),
        (
            "/generate",
            json!({"input_ids": vec![1u32; 9000], "max_tokens": 4}),
            StatusCode::BAD_REQUEST,
            "context window",
        ),
        (
            "/generate",
            json!({"input_ids": [1, 2], "max_tokens": 4, "top_p": 0}),
            StatusCode::BAD_REQUEST,
            "top_p",
        ),
        (
            "/generate",
            json!({"max_tokens": 4}),
            StatusCode::BAD_REQUEST,
            "input_ids",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": user, "temperature": -1}),
            StatusCode::BAD_REQUEST,
            "temperature",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": user, "temperature": "hot"}),
            StatusCode::BAD_REQUEST,
            "temperature",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": user, "max_tokens": 100000}),
            StatusCode::BAD_REQUEST,
            "context window",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": []}),
            StatusCode::BAD_REQUEST,
            "messages",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
            StatusCode::BAD_REQUEST,
            "role",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": user, "n": 0}),
            StatusCode::BAD_REQUEST,
            "n",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": user, "top_logprobs": 50, "logprobs": true}),
            StatusCode::BAD_REQUEST,
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": user, "tools": [{"type": "function"}]}),
            StatusCode::BAD_REQUEST,
            "tools[0]",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": user, "tools": [{"type": "function", "function": {"name": "f", "parameters": 5}}]}),
            StatusCode::BAD_REQUEST,
            "parameters",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": user, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
            StatusCode::BAD_REQUEST,
            "schema",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": user, "tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [{"type": "function", "function": {"name": "f"}}]}),
            StatusCode::BAD_REQUEST,
            "nope",
        ),
        (
            "/v1/completions",
            json!({"prompt": "", "max_tokens": 3}),
            StatusCode::BAD_REQUEST,
            "prompt",
        ),
        (
            "/detokenize",
            json!({"tokens": [5, 4000000]}),
            StatusCode::BAD_REQUEST,
            "out of range",
        ),
    ];
    for (path, body, status, needle) in cases {
        let (got, answer) = post(&state, path, body.clone()).await;
        assert_eq!(got, status, "{path} {body}: {answer}");
        assert!(message(&answer).contains(needle), "{path} {body}: {answer}");
        assert_eq!(answer["error"]["type"], "invalid_request_error", "{answer}");
    }
    let (status, answer) = call(&state, "POST", "/v1/chat/completions", Some("{not json")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(message(&answer).contains("JSON"), "{answer}");
    let (status, answer) = call(&state, "GET", "/v2/nothing", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(
        message(&answer).contains("/v1/chat/completions"),
        "{answer}"
    );
    // Still serving.
    let (status, answer) = post(
        &state,
        "/v1/chat/completions",
        json!({"messages": user, "max_tokens": 3}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{answer}");
}

#[tokio::test]
#[ignore = "needs the SmolLM2 model (scripts/fetch-model)"]
async fn a_client_that_disconnects_mid_stream_is_cancelled() {
    let state = state();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(agentstack_model::server::serve(
        state.clone(),
        listener,
        std::future::pending(),
    ));
    let client = reqwest::Client::new();
    let mut response = client
        .post(format!("{url}/v1/chat/completions"))
        .json(&json!({"messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 4000,
                      "stream": true, "ignore_eos": true, "detect_loops": false}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let first = response.chunk().await.unwrap().unwrap();
    assert!(
        String::from_utf8_lossy(&first).starts_with("data: "),
        "{first:?}"
    );
    drop(response);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let health: Value = client
            .get(format!("{url}/health"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if health["running"] == 0 && health["waiting"] == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "generation not cancelled: {health}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, _) = post(
        &state,
        "/v1/completions",
        json!({"prompt": "Hello", "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    server.abort();
}
