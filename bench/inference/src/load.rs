//! The load generator: rounds of concurrent `/v1/completions` requests.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use indicatif::ProgressBar;
use serde_json::{Value, json};
use tokio::task::JoinSet;

use crate::servers::{Engine, Server};
use crate::settings::Plan;

/// What one round measured.
#[derive(Debug, Clone, Copy)]
pub struct Round {
    /// From the first request sent to the last answer read.
    pub wall: Duration,
    /// Tokens generated, summed over the answers' `usage.completion_tokens`.
    pub tokens: u64,
    /// Answers with fewer than `max_tokens` tokens.
    pub short_answers: usize,
}

impl Round {
    /// Aggregate throughput, tok/s.
    pub fn tokens_per_second(&self) -> f64 {
        self.tokens as f64 / self.wall.as_secs_f64().max(f64::MIN_POSITIVE)
    }
}

/// The body of every request. Greedy, and `ignore_eos` so every answer runs to
/// `max_tokens`; for agentstack also `detect_loops: false` (on by default there,
/// it ends a greedy answer that repeats itself; llama.cpp has no such stop).
pub fn body(plan: &Plan, engine: Engine) -> Value {
    let mut body = json!({
        "prompt": plan.prompt,
        "max_tokens": plan.max_tokens,
        "temperature": 0.0,
        "ignore_eos": true,
    });
    if engine == Engine::Agentstack {
        body["detect_loops"] = Value::Bool(false);
    }
    body
}

/// Sends `requests` copies of `body` at once and waits for all the answers.
pub async fn round(
    http: &reqwest::Client,
    server: &Server,
    body: &Value,
    requests: usize,
    max_tokens: usize,
    bar: &ProgressBar,
) -> Result<Round> {
    let url = format!("{}/v1/completions", server.url());
    let start = Instant::now();
    let mut tasks = JoinSet::new();
    for _ in 0..requests {
        let request = http.post(&url).json(body);
        let bar = bar.clone();
        tasks.spawn(async move {
            let response = request.send().await.context("sending the request")?;
            let status = response.status();
            let text = response.text().await.context("reading the answer")?;
            if !status.is_success() {
                bail!("HTTP {status}: {text}");
            }
            let answer: Value = serde_json::from_str(&text)
                .with_context(|| format!("the answer is not JSON: {text}"))?;
            let tokens = answer["usage"]["completion_tokens"]
                .as_u64()
                .with_context(|| format!("no usage.completion_tokens in the answer: {text}"))?;
            bar.inc(1);
            Ok(tokens)
        });
    }
    let mut tokens = 0;
    let mut short_answers = 0;
    while let Some(joined) = tasks.join_next().await {
        let got = joined
            .context("a request task panicked")?
            .with_context(|| format!("{} server, POST {url}", server.engine))?;
        tokens += got;
        if got < max_tokens as u64 {
            short_answers += 1;
        }
    }
    Ok(Round {
        wall: start.elapsed(),
        tokens,
        short_answers,
    })
}
