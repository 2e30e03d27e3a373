//! Pushing the adapters to `model serve` processes.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use agentstack_model::server::{API_KEY_ENV, ApiKey};
use serde_json::{Value, json};

use super::TrainError;
use super::error::tensors;
use crate::config::SyncSection;
use crate::lora::Lora;

/// Where and how a run pushes its adapters after each step.
pub(super) struct RemoteSync {
    http: reqwest::Client,
    servers: Vec<String>,
    key: Option<ApiKey>,
    /// The name requests pick the adapters by.
    name: String,
    /// The file the servers load the adapters from.
    path: PathBuf,
    /// How long to retry a server that is not up.
    wait: Duration,
}

impl RemoteSync {
    /// Pushes for run `run_id` in `dir`, with `key` (from the trainer's environment).
    pub(super) fn new(config: &SyncSection, key: Option<ApiKey>, run_id: &str, dir: &Path) -> Self {
        Self {
            http: reqwest::Client::new(),
            servers: config.servers.clone(),
            key,
            name: config.name.clone().unwrap_or_else(|| run_id.to_owned()),
            path: dir.join("adapter.safetensors"),
            wait: Duration::from_secs(config.wait_seconds),
        }
    }

    /// Saves `lora` and has every server load it; the milliseconds that took.
    pub(super) async fn push(&self, lora: &Lora) -> Result<f64, TrainError> {
        let t = Instant::now();
        lora.save(&self.path)
            .map_err(tensors("write", &self.path))?;
        let body = json!({"name": self.name, "path": self.path});
        for server in &self.servers {
            push_adapter(&self.http, server, self.key.as_ref(), &body, self.wait).await?;
        }
        Ok(t.elapsed().as_secs_f64() * 1e3)
    }
}

/// `POST {server}/v1/adapters` with `body`, bearing `key` when there is one; the
/// adapter's version on the server, when its answer says (`version`). A server
/// that cannot be reached or answers 5xx (still starting, or being replaced by its
/// supervisor) is retried, backing off from 0.25 s to 4 s, for up to `wait`; any other
/// failure, or the last one, ends the run with the server's answer.
pub(super) async fn push_adapter(
    http: &reqwest::Client,
    server: &str,
    key: Option<&ApiKey>,
    body: &Value,
    wait: Duration,
) -> Result<Option<u64>, TrainError> {
    let url = format!("{}/v1/adapters", server.trim_end_matches('/'));
    let deadline = Instant::now() + wait;
    let mut pause = Duration::from_millis(250);
    loop {
        let mut request = http.post(&url).json(body);
        if let Some(key) = key {
            request = request.bearer_auth(key.expose());
        }
        let failure = match request.send().await {
            Ok(response) if response.status().is_success() => {
                let answer: Option<Value> = response.json().await.ok();
                return Ok(answer.and_then(|a| a.get("version").and_then(Value::as_u64)));
            }
            Ok(response) => {
                let status = response.status();
                let text = response.text().await.unwrap_or_default();
                let mut message = format!("{url}: {status}: {text}");
                if status == reqwest::StatusCode::UNAUTHORIZED {
                    message.push_str(&format!(
                        "\nhint: set {API_KEY_ENV} (or the variable [sync] api_key_env names) in the trainer's environment to the server's API key"
                    ));
                } else if status == reqwest::StatusCode::FORBIDDEN
                    || text.contains("adapter directory")
                {
                    message.push_str("\nhint: start the model server with --adapter-dir set to this trainer's runs directory");
                }
                if !status.is_server_error() {
                    return Err(TrainError::Sync(message));
                }
                if Instant::now() + pause > deadline {
                    return Err(TrainError::Sync(format!(
                        "{message} (still failing after {} s; sync.wait_seconds sets how long to retry)",
                        wait.as_secs()
                    )));
                }
                message
            }
            Err(source) => {
                if Instant::now() + pause > deadline {
                    return Err(TrainError::SyncUnreachable {
                        url,
                        waited_s: wait.as_secs(),
                        source,
                    });
                }
                format!("{url}: {source}")
            }
        };
        tracing::warn!(server = %url, error = %failure, "adapter push failed; retrying");
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(4));
    }
}

#[cfg(test)]
mod tests {
    use agentstack_test_support::ports::free_port;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    /// Whether `got` holds a whole HTTP request (headers and `content-length` bytes).
    fn complete(got: &[u8]) -> bool {
        let text = String::from_utf8_lossy(got);
        let Some(end) = text.find("\r\n\r\n") else {
            return false;
        };
        let length = text[..end]
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("content-length:")
                    .map(|v| v.trim().parse::<usize>().unwrap_or(0))
            })
            .unwrap_or(0);
        got.len() >= end + 4 + length
    }

    /// Answers one request on `listener` with `status` and `body`; returns the request.
    async fn answer(listener: &TcpListener, status: &str, body: &str) -> String {
        let (mut socket, _) = listener.accept().await.unwrap();
        let (mut buf, mut got) = (vec![0u8; 8192], Vec::new());
        while !complete(&got) {
            let n = socket.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        let reply = format!(
            "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        socket.write_all(reply.as_bytes()).await.unwrap();
        String::from_utf8_lossy(&got).into_owned()
    }

    /// A model server that is not up yet, then answers 503 while it loads, gets the
    /// adapters once it is ready; a 4xx fails at once with the server's message; a
    /// server that never comes fails the push after `wait`, saying how to wait longer.
    #[tokio::test]
    async fn adapter_pushes_wait_for_a_starting_server_but_not_for_a_refusal() {
        let http = reqwest::Client::new();
        let body = json!({"name": "run", "path": "/x/adapter.safetensors"});
        let port = free_port();
        let server = format!("http://127.0.0.1:{port}");
        let push = {
            let (http, body, server) = (http.clone(), body.clone(), server.clone());
            tokio::spawn(async move {
                let key = ApiKey::new("the-key").unwrap();
                push_adapter(&http, &server, Some(&key), &body, Duration::from_secs(20)).await
            })
        };
        tokio::time::sleep(Duration::from_millis(600)).await;
        let listener = TcpListener::bind(("127.0.0.1", port)).await.unwrap();
        answer(&listener, "503 Service Unavailable", "loading").await;
        let request = answer(&listener, "200 OK", r#"{"name":"run","version":3}"#).await;
        assert_eq!(
            push.await.unwrap().unwrap(),
            Some(3),
            "the server's version"
        );
        assert!(request.starts_with("POST /v1/adapters "), "{request}");
        assert!(request.contains("\"name\":\"run\""), "{request}");
        assert!(
            request
                .to_ascii_lowercase()
                .contains("authorization: bearer the-key\r\n"),
            "{request}"
        );

        let refusing = |status: &'static str, text: &'static str| {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap();
            listener.set_nonblocking(true).unwrap();
            let listener = TcpListener::from_std(listener).unwrap();
            tokio::spawn(async move {
                answer(&listener, status, text).await;
            });
            format!("http://{addr}")
        };
        let t = Instant::now();
        let server = refusing("400 Bad Request", "the adapter's shapes do not fit");
        let e = push_adapter(&http, &server, None, &body, Duration::from_secs(20))
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("400") && e.contains("shapes do not fit"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        // A missing key is a refusal too, with the variable to set.
        let server = refusing("401 Unauthorized", "this server needs an API key");
        let e = push_adapter(&http, &server, None, &body, Duration::from_secs(20))
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("401") && e.contains("hint: set AGENTSTACK_API_KEY"),
            "{e}"
        );
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());

        let nobody = format!("http://127.0.0.1:{}", free_port());
        let e = push_adapter(&http, &nobody, None, &body, Duration::from_secs(1))
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("still failing after 1 s") && e.contains("sync.wait_seconds"),
            "{e}"
        );
    }
}
