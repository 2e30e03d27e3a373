//! The model side of the loop: the in-process engine, or any OpenAI-compatible
//! server (`agentstack model serve`, vLLM, llama-server, a hosted API).
//!
//! Both take the same [`ChatRequest`] and give the same [`ChatResponse`]. Token ids
//! and logprobs come back whenever the model side has them: always in process, and
//! from servers that support the `return_token_ids` extension (ours and vLLM's).
//! Against `agentstack model serve` both sides build the prompt with
//! [`LanguageModel::chat_prompt`] and sample with the same seeded sampler, so an
//! evaluation gives the same tokens in process and over HTTP.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentstack_model::chat::{FunctionCall, Message, ToolCall};
use agentstack_model::constraint::{Constraint, ConstraintCompiler, parse_tool_calls};
use agentstack_model::engine::{Engine, Event, weights_versions};
use agentstack_model::generate::GenerateRequest;
use agentstack_model::server::{API_KEY_ENV, ApiKey};
use agentstack_model::{LanguageModel, SamplingParams};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// Why the model side failed.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The in-process model refused the request or failed.
    #[error(transparent)]
    Local(#[from] agentstack_model::ModelError),
    /// The engine would not take the request.
    #[error("the engine refused the request: {0}")]
    Engine(String),
    /// The HTTP request failed.
    #[error("request to {url} failed")]
    Http {
        /// Where.
        url: String,
        /// Why.
        #[source]
        source: reqwest::Error,
    },
    /// The server answered with an error status.
    #[error("{url} answered HTTP {status}: {body}{hint}")]
    Status {
        /// Where.
        url: String,
        /// The status code.
        status: u16,
        /// The body (an OpenAI-shaped error, usually).
        body: String,
        /// What to change, when it is clear (empty, or a line starting with a newline).
        hint: String,
    },
    /// The server's answer is not a chat completion.
    #[error("{url} sent a reply that is not a chat completion: {message}")]
    Reply {
        /// Where.
        url: String,
        /// What was wrong.
        message: String,
    },
}

/// How to sample one turn. Recorded with every result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sampling {
    /// Softmax temperature; 0 is greedy.
    pub temperature: f32,
    /// Nucleus sampling mass (1 = off).
    pub top_p: f32,
    /// Most tokens per turn.
    pub max_tokens: usize,
}

impl Default for Sampling {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            max_tokens: 256,
        }
    }
}

/// One call of the model.
#[derive(Debug, Clone)]
pub struct ChatRequest {
    /// The conversation so far.
    pub messages: Vec<Message>,
    /// OpenAI tool definitions the model may call; empty for none.
    pub tools: Vec<Value>,
    /// How to sample.
    pub sampling: Sampling,
    /// The sampling seed of this call.
    pub seed: u64,
    /// A JSON Schema the answer must match (constrained decoding), when the model side
    /// supports it.
    pub json_schema: Option<Value>,
    /// The conversation's previous call, whose token ids this call's prompt continues
    /// exactly when the in-process engine runs it (multi-turn RL trains on the ids the
    /// policy sampled, never tokenized again). Other model sides render the whole
    /// conversation.
    pub continues: Option<Continuation>,
}

/// A model call a later call of the same conversation continues (see
/// [`ChatRequest::continues`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Continuation {
    /// The messages of that call.
    pub messages: Vec<Message>,
    /// Its prompt's token ids.
    pub prompt_ids: Vec<u32>,
    /// The token ids it generated.
    pub completion_ids: Vec<u32>,
}

impl Continuation {
    /// What a later call continues after `request` was answered with `reply`, when the
    /// reply carries its token ids.
    pub fn after(request: &ChatRequest, reply: &ChatResponse) -> Option<Self> {
        let (prompt, completion, _) = reply.tokens.complete()?;
        Some(Self {
            messages: request.messages.clone(),
            prompt_ids: prompt.to_vec(),
            completion_ids: completion.to_vec(),
        })
    }
}

/// What the model answered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatResponse {
    /// The text (without tool calls).
    pub text: String,
    /// Tool calls, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// OpenAI's finish reason: `stop`, `length`, `tool_calls`, ….
    pub finish_reason: String,
    /// The call's token ids and logprobs, as far as the model side gives them
    /// (`prompt_ids`, `completion_ids`, `logprobs` in JSON).
    #[serde(flatten)]
    pub tokens: TokenTrace,
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Of those, the tokens the model side read from a cache instead of running them
    /// (OpenAI's `usage.prompt_tokens_details.cached_tokens`; 0 when it does not say).
    #[serde(default)]
    pub cached_tokens: usize,
    /// Tokens generated.
    pub completion_tokens: usize,
    /// Draft tokens speculative decoding verified (OpenAI's accepted plus rejected
    /// prediction tokens; 0 when the model side does not say).
    #[serde(default)]
    pub draft_tokens: usize,
    /// Of those, kept (each saved a forward pass).
    #[serde(default)]
    pub accepted_draft_tokens: usize,
}

/// One model call at the token level, what training learns from: the prompt's and the
/// completion's token ids and the completion's log-probabilities. Each is there when
/// the model side gives it (always in process; from a server when it returns them).
///
/// The reply and the turn flatten it (`#[serde(flatten)]`), so in their JSON these are
/// the top-level keys `prompt_ids`, `completion_ids` and `logprobs`, each left out when
/// absent.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TokenTrace {
    /// The prompt's token ids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_ids: Option<Vec<u32>>,
    /// The generated token ids, exactly as sampled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_ids: Option<Vec<u32>>,
    /// The log-probability of each generated token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<Vec<f32>>,
    /// The version of the adapter weights that sampled each generated token, when an
    /// in-process engine ran them on a named adapter, or a server that says
    /// (`choices[].weights_versions`, as `agentstack model serve` does on an adapter).
    /// A weight update during the generation (an asynchronous RL rollout) shows as a
    /// step up. A server's versions are its own count of the adapter's loads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights_versions: Option<Vec<u64>>,
}

impl TokenTrace {
    /// The prompt ids, completion ids and logprobs, when all three are there.
    pub fn complete(&self) -> Option<(&[u32], &[u32], &[f32])> {
        Some((
            self.prompt_ids.as_deref()?,
            self.completion_ids.as_deref()?,
            self.logprobs.as_deref()?,
        ))
    }
}

/// Where the model runs, and a clock of when it has work.
#[derive(Clone)]
pub struct ModelClient {
    backend: Backend,
    activity: Activity,
}

#[derive(Clone)]
enum Backend {
    Engine(Arc<EngineModel>),
    OpenAi(Arc<OpenAiModel>),
}

impl std::fmt::Debug for ModelClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.backend {
            Backend::Engine(m) => write!(f, "Engine({})", m.name),
            Backend::OpenAi(m) => write!(f, "OpenAi({} at {})", m.model, m.base_url),
        }
    }
}

/// When the model had no call in flight: the harness's measure of an idle model.
#[derive(Clone)]
pub struct Activity(Arc<Mutex<ActivityState>>);

struct ActivityState {
    in_flight: usize,
    started: Instant,
    since: Instant,
    idle: Duration,
}

impl Activity {
    fn new() -> Self {
        let now = Instant::now();
        Self(Arc::new(Mutex::new(ActivityState {
            in_flight: 0,
            started: now,
            since: now,
            idle: Duration::ZERO,
        })))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ActivityState> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Starts measuring afresh (keeping calls in flight); returns the clock.
    pub fn restart(&self) -> Self {
        let mut s = self.lock();
        let now = Instant::now();
        s.started = now;
        s.since = now;
        s.idle = Duration::ZERO;
        drop(s);
        self.clone()
    }

    fn enter(&self) -> InFlight<'_> {
        let mut s = self.lock();
        if s.in_flight == 0 {
            let gap = s.since.elapsed();
            s.idle += gap;
        }
        s.in_flight += 1;
        InFlight(self)
    }

    /// The fraction of the time since the last restart with no call in flight.
    pub fn idle_fraction(&self) -> f64 {
        let s = self.lock();
        let mut idle = s.idle;
        if s.in_flight == 0 {
            idle += s.since.elapsed();
        }
        let wall = s.started.elapsed().as_secs_f64().max(1e-9);
        (idle.as_secs_f64() / wall).min(1.0)
    }
}

struct InFlight<'a>(&'a Activity);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let mut s = self.0.lock();
        s.in_flight -= 1;
        if s.in_flight == 0 {
            s.since = Instant::now();
        }
    }
}

/// The in-process engine and what it needs to build prompts and constraints.
pub struct EngineModel {
    engine: Engine,
    compiler: Option<ConstraintCompiler>,
    /// Compiled, unstarted constraints by schema: every turn of a run asks for the
    /// same one, and a clone is cheaper than compiling it again.
    constraints: Mutex<HashMap<String, Constraint>>,
    name: String,
    adapter: Option<String>,
}

/// The most compiled constraints kept; the cache starts over beyond it.
const MAX_CACHED_CONSTRAINTS: usize = 64;

/// An OpenAI-compatible server.
pub struct OpenAiModel {
    http: reqwest::Client,
    base_url: String,
    model: String,
    api_key: Option<ApiKey>,
}

/// The standard variable for an OpenAI API key; sent when [`API_KEY_ENV`] is unset.
pub const OPENAI_API_KEY_ENV: &str = agentstack_static::env_vars::OPENAI_API_KEY;

/// The key to send to an OpenAI-compatible server, from the environment: the first key
/// of [`API_KEY_ENV`] (`AGENTSTACK_API_KEY`, what `agentstack model serve` asks for),
/// else [`OPENAI_API_KEY_ENV`]. Empty values count as unset.
pub fn api_key_from_env() -> Option<String> {
    api_key_from(|name| std::env::var(name).ok())
}

/// [`api_key_from_env`] over the variables `var` gives.
fn api_key_from(var: impl Fn(&str) -> Option<String>) -> Option<String> {
    var(API_KEY_ENV)
        .and_then(|list| ApiKey::first_of_list(&list))
        .map(|key| key.expose().to_owned())
        .or_else(|| var(OPENAI_API_KEY_ENV).filter(|k| !k.trim().is_empty()))
}

impl ModelClient {
    /// The in-process engine over `engine`'s model, called `name` in results.
    pub fn engine(engine: Engine, name: &str) -> Self {
        Self::engine_adapter(engine, name, None)
    }

    /// The in-process engine on the weights of its adapter named `adapter` (loaded
    /// with [`Engine::set_adapter`]; `None` for the base model).
    pub fn engine_adapter(engine: Engine, name: &str, adapter: Option<&str>) -> Self {
        let compiler = ConstraintCompiler::new(engine.model().tokenizer()).ok();
        Self {
            backend: Backend::Engine(Arc::new(EngineModel {
                engine,
                compiler,
                constraints: Mutex::new(HashMap::new()),
                name: name.to_owned(),
                adapter: adapter.map(str::to_owned),
            })),
            activity: Activity::new(),
        }
    }

    /// An OpenAI-compatible server at `base_url` (ending in `/v1`), serving `model`;
    /// `api_key` is sent as a bearer token (never logged).
    pub fn openai(base_url: &str, model: &str, api_key: Option<String>, timeout: Duration) -> Self {
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .expect("an HTTP client with rustls builds");
        Self {
            backend: Backend::OpenAi(Arc::new(OpenAiModel {
                http,
                base_url: base_url.trim_end_matches('/').to_owned(),
                model: model.to_owned(),
                api_key: api_key.and_then(|k| ApiKey::new(k).ok()),
            })),
            activity: Activity::new(),
        }
    }

    /// The model's name, as results record it.
    pub fn name(&self) -> &str {
        match &self.backend {
            Backend::Engine(m) => &m.name,
            Backend::OpenAi(m) => &m.model,
        }
    }

    /// When the model had work.
    pub fn activity(&self) -> &Activity {
        &self.activity
    }

    /// The in-process model, if the model runs here.
    pub fn local(&self) -> Option<&LanguageModel> {
        match &self.backend {
            Backend::Engine(m) => Some(m.engine.model()),
            Backend::OpenAi(_) => None,
        }
    }

    /// The prompt tokens of `messages`, exactly when the model runs here, else
    /// estimated at four characters per token.
    pub fn count_tokens(&self, messages: &[Message], tools: &[Value]) -> usize {
        if let Some(lm) = self.local()
            && let Ok(ids) = lm.chat_prompt(messages.to_vec(), tools)
        {
            return ids.len();
        }
        let chars: usize = messages
            .iter()
            .map(|m| m.content.as_deref().map_or(0, str::len) + 16)
            .sum::<usize>()
            + tools.iter().map(|t| t.to_string().len()).sum::<usize>();
        chars.div_ceil(4)
    }

    /// Asks the model for the next assistant turn.
    pub async fn chat(&self, request: &ChatRequest) -> Result<ChatResponse, ModelError> {
        let _in_flight = self.activity.enter();
        match &self.backend {
            Backend::Engine(m) => m.chat(request).await,
            Backend::OpenAi(m) => m.chat(request).await,
        }
    }
}

impl EngineModel {
    /// A fresh constraint for `schema`, compiled once per schema.
    fn constraint_for(
        &self,
        compiler: &ConstraintCompiler,
        schema: &Value,
    ) -> Result<Constraint, ModelError> {
        let key = schema.to_string();
        let mut cache = self.constraints.lock().expect("constraint cache lock");
        if let Some(compiled) = cache.get(&key) {
            return Ok(compiled.clone());
        }
        let compiled = compiler.json_schema(schema)?;
        if cache.len() >= MAX_CACHED_CONSTRAINTS {
            cache.clear();
        }
        cache.insert(key, compiled.clone());
        Ok(compiled)
    }

    async fn chat(&self, request: &ChatRequest) -> Result<ChatResponse, ModelError> {
        let lm = self.engine.model();
        let prompt = match &request.continues {
            Some(earlier) => {
                let earlier = agentstack_model::EarlierTurn {
                    messages: &earlier.messages,
                    prompt: &earlier.prompt_ids,
                    completion: &earlier.completion_ids,
                };
                lm.chat_prompt_continuing(&earlier, request.messages.clone(), &request.tools)?
                    .0
            }
            None => lm.chat_prompt(request.messages.clone(), &request.tools)?,
        };
        let constraint = match (&request.json_schema, &self.compiler) {
            (Some(schema), Some(compiler)) => Some(self.constraint_for(compiler, schema)?),
            _ => None,
        };
        let generate = GenerateRequest {
            prompt: prompt.clone(),
            max_tokens: request.sampling.max_tokens,
            sampling: SamplingParams {
                temperature: request.sampling.temperature,
                top_p: request.sampling.top_p,
                seed: Some(request.seed),
                ..SamplingParams::default()
            },
            stop: Vec::new(),
            stop_tokens: Vec::new(),
            ignore_eos: false,
            top_logprobs: 0,
            // As `model serve`'s chat endpoint does by default.
            detect_loops: true,
            constraint,
            // The engine's (speculative decoding is exact: the same tokens and
            // log-probabilities as plain decoding, in fewer passes where drafts pay).
            speculation: None,
            prediction: Vec::new(),
        };
        let mut events = self
            .engine
            .submit_with(generate, self.adapter.as_deref())
            .map_err(|e| ModelError::Engine(e.to_string()))?;
        let mut versions = Vec::new();
        while let Some(event) = events.recv().await {
            match event {
                Event::Token(token) => versions.extend(token.weights_version),
                Event::Error(e) => return Err(ModelError::Engine(e.to_string())),
                Event::Done(out) => {
                    let (calls, text) = if request.tools.is_empty() {
                        (Vec::new(), out.text.clone())
                    } else {
                        parse_tool_calls(&out.text)
                    };
                    let tool_calls: Vec<ToolCall> = calls
                        .into_iter()
                        .enumerate()
                        .map(|(i, (name, arguments))| ToolCall {
                            id: format!("call_{i}"),
                            kind: "function".into(),
                            function: FunctionCall { name, arguments },
                        })
                        .collect();
                    let finish_reason = if tool_calls.is_empty() {
                        out.finish.openai_name()
                    } else {
                        "tool_calls"
                    }
                    .to_owned();
                    return Ok(ChatResponse {
                        text,
                        tool_calls,
                        finish_reason,
                        prompt_tokens: prompt.len(),
                        cached_tokens: out.cached_tokens,
                        completion_tokens: out.tokens.len(),
                        draft_tokens: out.draft_tokens,
                        accepted_draft_tokens: out.accepted_draft_tokens,
                        tokens: TokenTrace {
                            weights_versions: weights_versions(versions, out.tokens.len()),
                            prompt_ids: Some(prompt),
                            completion_ids: Some(out.tokens),
                            logprobs: Some(out.logprobs),
                        },
                    });
                }
            }
        }
        Err(ModelError::Engine("the engine stopped".into()))
    }
}

impl OpenAiModel {
    async fn chat(&self, request: &ChatRequest) -> Result<ChatResponse, ModelError> {
        let url = format!("{}/chat/completions", self.base_url);
        let mut body = json!({
            "model": self.model,
            "messages": request.messages,
            "max_tokens": request.sampling.max_tokens,
            "temperature": request.sampling.temperature,
            "top_p": request.sampling.top_p,
            "seed": request.seed,
            "logprobs": true,
            "return_token_ids": true,
        });
        if !request.tools.is_empty() {
            body["tools"] = Value::Array(request.tools.clone());
        }
        if let Some(schema) = &request.json_schema {
            body["response_format"] =
                json!({"type": "json_schema", "json_schema": {"name": "action", "schema": schema}});
        }
        let mut call = self.http.post(&url).json(&body);
        if let Some(key) = &self.api_key {
            call = call.bearer_auth(key.expose());
        }
        let response = call.send().await.map_err(|source| ModelError::Http {
            url: url.clone(),
            source,
        })?;
        let status = response.status();
        let text = response.text().await.map_err(|source| ModelError::Http {
            url: url.clone(),
            source,
        })?;
        if !status.is_success() {
            let hint = if status == reqwest::StatusCode::NOT_FOUND && !url.contains("/v1/") {
                "\nhint: an OpenAI-compatible base URL usually ends in /v1 (for `agentstack model serve`: http://HOST:PORT/v1)".to_owned()
            } else {
                String::new()
            };
            return Err(ModelError::Status {
                url,
                status: status.as_u16(),
                body: text.chars().take(2000).collect(),
                hint,
            });
        }
        let reply: Value = serde_json::from_str(&text).map_err(|e| ModelError::Reply {
            url: url.clone(),
            message: e.to_string(),
        })?;
        parse_completion(&reply).map_err(|message| ModelError::Reply { url, message })
    }
}

/// Reads an OpenAI chat completion (first choice), with the `return_token_ids`
/// extension's fields when present.
fn parse_completion(reply: &Value) -> Result<ChatResponse, String> {
    let choice = reply
        .pointer("/choices/0")
        .ok_or("no choices[0] in the reply")?;
    let message = choice.get("message").ok_or("choices[0] has no message")?;
    let text = message
        .get("content")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let tool_calls: Vec<ToolCall> = match message.get("tool_calls") {
        None | Some(Value::Null) => Vec::new(),
        Some(calls) => serde_json::from_value(calls.clone())
            .map_err(|e| format!("choices[0].message.tool_calls: {e}"))?,
    };
    let ids = |v: Option<&Value>| -> Option<Vec<u32>> {
        v?.as_array()?
            .iter()
            .map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
            .collect()
    };
    let logprobs: Option<Vec<f32>> = choice
        .pointer("/logprobs/content")
        .and_then(Value::as_array)
        .and_then(|entries| {
            entries
                .iter()
                .map(|e| e.get("logprob").and_then(Value::as_f64).map(|x| x as f32))
                .collect()
        });
    let completion_ids = ids(choice.get("token_ids"));
    let weights_versions = choice
        .get("weights_versions")
        .and_then(Value::as_array)
        .and_then(|versions| versions.iter().map(Value::as_u64).collect())
        .zip(completion_ids.as_ref())
        .and_then(|(versions, ids)| weights_versions(versions, ids.len()));
    let usage = |key: &str| {
        reply
            .pointer(&format!("/usage/{key}"))
            .and_then(Value::as_u64)
            .unwrap_or(0) as usize
    };
    Ok(ChatResponse {
        text,
        tool_calls,
        finish_reason: choice
            .get("finish_reason")
            .and_then(Value::as_str)
            .unwrap_or("stop")
            .to_owned(),
        tokens: TokenTrace {
            prompt_ids: ids(reply.get("prompt_token_ids")),
            completion_ids,
            logprobs,
            weights_versions,
        },
        prompt_tokens: usage("prompt_tokens"),
        cached_tokens: usage("prompt_tokens_details/cached_tokens"),
        completion_tokens: usage("completion_tokens"),
        draft_tokens: usage("completion_tokens_details/accepted_prediction_tokens")
            + usage("completion_tokens_details/rejected_prediction_tokens"),
        accepted_draft_tokens: usage("completion_tokens_details/accepted_prediction_tokens"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_completions_with_and_without_token_ids() {
        let reply = json!({
            "choices": [{"message": {"role": "assistant", "content": "42"}, "finish_reason": "stop",
                         "token_ids": [7, 8], "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.25}]}}],
            "prompt_token_ids": [1, 2, 3],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2},
        });
        let r = parse_completion(&reply).unwrap();
        assert_eq!(r.text, "42");
        assert_eq!(r.tokens.prompt_ids, Some(vec![1, 2, 3]));
        assert_eq!(r.tokens.completion_ids, Some(vec![7, 8]));
        assert_eq!(r.tokens.logprobs, Some(vec![-0.5, -0.25]));
        assert_eq!(
            r.tokens.weights_versions, None,
            "the base model has no versions"
        );
        // A generation that spanned an adapter reload; versions that do not match the
        // tokens one for one are not used.
        let mut versioned = reply.clone();
        versioned["choices"][0]["weights_versions"] = json!([3, 4]);
        let r = parse_completion(&versioned).unwrap();
        assert_eq!(r.tokens.weights_versions, Some(vec![3, 4]));
        versioned["choices"][0]["weights_versions"] = json!([3]);
        assert_eq!(
            parse_completion(&versioned)
                .unwrap()
                .tokens
                .weights_versions,
            None
        );
        let plain = json!({"choices": [{"message": {"content": null, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, "finish_reason": "tool_calls"}]});
        let r = parse_completion(&plain).unwrap();
        assert_eq!(r.tool_calls[0].function.name, "f");
        assert_eq!(r.tokens, TokenTrace::default());
        assert!(parse_completion(&json!({"error": "x"})).is_err());
    }

    /// Regression (issue 19): clients send `AGENTSTACK_API_KEY` (its first key, the
    /// variable holding a server's list) before `OPENAI_API_KEY`; empty values are unset.
    #[test]
    fn the_api_key_comes_from_agentstack_then_openai() {
        let from = |agentstack: Option<&str>, openai: Option<&str>| {
            api_key_from(|name| match name {
                API_KEY_ENV => agentstack.map(str::to_owned),
                OPENAI_API_KEY_ENV => openai.map(str::to_owned),
                _ => None,
            })
        };
        assert_eq!(from(Some("k1,k2"), Some("sk")).as_deref(), Some("k1"));
        assert_eq!(from(Some(" k1 "), None).as_deref(), Some("k1"));
        assert_eq!(from(None, Some("sk")).as_deref(), Some("sk"));
        assert_eq!(from(Some(""), Some("sk")).as_deref(), Some("sk"));
        assert_eq!(from(Some(" , "), Some("")), None);
        assert_eq!(from(None, None), None);
    }

    /// A request with no messages: what the canned servers below answer does not depend
    /// on it.
    fn empty_request() -> ChatRequest {
        ChatRequest {
            messages: vec![],
            tools: vec![],
            json_schema: None,
            sampling: Sampling::default(),
            seed: 0,
            continues: None,
        }
    }

    /// The key is sent as a bearer token and is not in the client's `Debug` output.
    #[tokio::test]
    async fn the_openai_client_sends_its_key_as_a_bearer_token() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}/v1", listener.local_addr().unwrap());
        let server = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let (mut buf, mut got) = (vec![0u8; 8192], Vec::new());
            while !String::from_utf8_lossy(&got).contains("\r\n\r\n") {
                let n = socket.read(&mut buf).await.unwrap();
                got.extend_from_slice(&buf[..n]);
            }
            let body =
                json!({"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}]})
                    .to_string();
            let reply = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            socket.write_all(reply.as_bytes()).await.unwrap();
            String::from_utf8_lossy(&got).to_lowercase()
        });
        let client =
            ModelClient::openai(&base, "m", Some("s3cret".into()), Duration::from_secs(10));
        assert!(!format!("{client:?}").contains("s3cret"));
        let reply = client.chat(&empty_request()).await.unwrap();
        assert_eq!(reply.text, "ok");
        let head = server.await.unwrap();
        assert!(head.contains("authorization: bearer s3cret\r\n"), "{head}");
    }

    /// A base URL without `/v1` (a 404 from `model serve` at `/chat/completions`) gets
    /// a hint that says to add it; a 404 under `/v1/` does not.
    #[tokio::test]
    async fn a_404_outside_v1_hints_at_the_base_url() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            for _ in 0..2 {
                let (mut socket, _) = listener.accept().await.unwrap();
                let (mut buf, mut got) = (vec![0u8; 8192], Vec::new());
                while !String::from_utf8_lossy(&got).contains("\r\n\r\n") {
                    let n = socket.read(&mut buf).await.unwrap();
                    got.extend_from_slice(&buf[..n]);
                }
                let body = r#"{"error":{"message":"no route"}}"#;
                let reply = format!(
                    "HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                socket.write_all(reply.as_bytes()).await.unwrap();
            }
        });
        let error = |base: String| async move {
            ModelClient::openai(&base, "m", None, Duration::from_secs(10))
                .chat(&empty_request())
                .await
                .unwrap_err()
                .to_string()
        };
        let without = error(format!("http://{addr}")).await;
        assert!(without.contains("answered HTTP 404"), "{without}");
        assert!(
            without.contains("hint: an OpenAI-compatible base URL usually ends in /v1"),
            "{without}"
        );
        let with = error(format!("http://{addr}/v1")).await;
        assert!(
            with.contains("answered HTTP 404") && !with.contains("hint:"),
            "{with}"
        );
    }
}
