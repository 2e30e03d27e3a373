//! `/v1/chat/completions` and `/v1/completions`.

use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::{Stream, StreamExt};
use serde::Deserialize;
use serde_json::{Value as Json_, json};
use tokio_stream::StreamMap;
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::{ApiError, ApiJson, AppState};
use crate::chat::{FunctionCall, Message, ToolCall};
use crate::constraint::{Constraint, ToolChoice, parse_tool_calls};
use crate::engine::{Event, weights_versions};
use crate::generate::{FinishReason, GenerateOutput, GenerateRequest, TokenEvent};
use crate::sampling::{SamplingParams, TokenLogprob};
use crate::speculate::Speculation;

/// `stop`: one string or several.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub(super) enum StopField {
    One(String),
    Many(Vec<String>),
}

impl StopField {
    fn into_vec(self) -> Vec<String> {
        match self {
            Self::One(s) => vec![s],
            Self::Many(v) => v,
        }
    }
}

/// Sampling fields shared by the endpoints (OpenAI's plus llama.cpp/vLLM extensions).
#[derive(Debug, Clone, Default, Deserialize)]
pub(super) struct SamplingFields {
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    min_p: Option<f32>,
    repetition_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    presence_penalty: Option<f32>,
    seed: Option<u64>,
    stop: Option<StopField>,
    stop_token_ids: Option<Vec<u32>>,
    ignore_eos: Option<bool>,
    pub(super) detect_loops: Option<bool>,
    /// Prompt-lookup speculative decoding: `true` (the server's settings), `false`, or
    /// vLLM's knobs `{"num_speculative_tokens", "prompt_lookup_max",
    /// "prompt_lookup_min"}`, each defaulting to the server's.
    speculative: Option<Json_>,
    /// OpenAI's predicted outputs: `{"type": "content", "content": text or text
    /// parts}`, the output the caller expects; its tokens become drafts.
    prediction: Option<Json_>,
}

/// The `speculative` field's object form.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SpeculativeFields {
    num_speculative_tokens: Option<usize>,
    prompt_lookup_max: Option<usize>,
    prompt_lookup_min: Option<usize>,
}

/// A request's speculative decoding and predicted output, resolved once for all its
/// choices ([`SamplingFields::drafting`]).
#[derive(Debug, Clone, Default)]
pub(super) struct Drafting {
    speculation: Option<Speculation>,
    prediction: Vec<u32>,
}

const SPECULATIVE_FORM: &str = "must be true, false, or an object with any of num_speculative_tokens, prompt_lookup_max and prompt_lookup_min (non-negative integers)";

impl SamplingFields {
    pub(super) fn params(&self, choice: usize) -> SamplingParams {
        let d = SamplingParams::default();
        SamplingParams {
            temperature: self.temperature.unwrap_or(d.temperature),
            top_k: self.top_k.unwrap_or(d.top_k),
            top_p: self.top_p.unwrap_or(d.top_p),
            min_p: self.min_p.unwrap_or(d.min_p),
            repetition_penalty: self.repetition_penalty.unwrap_or(d.repetition_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(d.frequency_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(d.presence_penalty),
            // Each of n choices gets its own stream of the same seed.
            seed: self.seed.map(|s| s.wrapping_add(choice as u64)),
        }
    }

    /// The request's `speculative` and `prediction` fields, checked, on `engine`.
    pub(super) fn drafting(&self, engine: &crate::engine::Engine) -> Result<Drafting, ApiError> {
        Ok(Drafting {
            speculation: self.speculation(engine.config().speculation)?,
            prediction: self.prediction(engine.model().tokenizer())?,
        })
    }

    /// The speculation a request asks for (`None`: the engine's, `default`; the
    /// object form's missing knobs are `default`'s too).
    fn speculation(&self, default: Speculation) -> Result<Option<Speculation>, ApiError> {
        let on = if default.is_on() {
            default
        } else {
            Speculation {
                max_draft: Speculation::default().max_draft,
                ..default
            }
        };
        let chosen = match &self.speculative {
            // A prediction is only of use to drafts.
            None if self.prediction.is_some() => on,
            None => return Ok(None),
            Some(Json_::Bool(true)) => on,
            Some(Json_::Bool(false)) => Speculation::off(),
            Some(object @ Json_::Object(_)) => {
                let fields = SpeculativeFields::deserialize(object).map_err(|e| {
                    ApiError::invalid("speculative", format!("{SPECULATIVE_FORM}: {e}"))
                })?;
                Speculation {
                    max_draft: fields.num_speculative_tokens.unwrap_or(on.max_draft),
                    ngram_max: fields.prompt_lookup_max.unwrap_or(on.ngram_max),
                    ngram_min: fields.prompt_lookup_min.unwrap_or(on.ngram_min),
                }
            }
            Some(_) => return Err(ApiError::invalid("speculative", SPECULATIVE_FORM)),
        };
        chosen
            .validate()
            .map_err(|e| ApiError::invalid("speculative", e.to_string()))?;
        Ok(Some(chosen))
    }

    /// The prediction's token ids (none without one); its form is checked.
    fn prediction(&self, tokenizer: &crate::Tokenizer) -> Result<Vec<u32>, ApiError> {
        const FORM: &str = r#"must be {"type": "content", "content": "text"} (content may also be a list of {"type": "text", "text": ...} parts)"#;
        let Some(prediction) = &self.prediction else {
            return Ok(Vec::new());
        };
        if prediction.get("type").and_then(Json_::as_str) != Some("content") {
            return Err(ApiError::invalid("prediction", FORM));
        }
        let text = match prediction.get("content") {
            Some(Json_::String(text)) => text.clone(),
            Some(Json_::Array(parts)) => parts
                .iter()
                .map(|part| match (part.get("type"), part.get("text")) {
                    (Some(Json_::String(kind)), Some(Json_::String(text))) if kind == "text" => {
                        Ok(text.as_str())
                    }
                    _ => Err(ApiError::invalid("prediction", FORM)),
                })
                .collect::<Result<String, _>>()?,
            _ => return Err(ApiError::invalid("prediction", FORM)),
        };
        tokenizer
            .encode(&text, false)
            .map_err(|e| ApiError::invalid("prediction", e.to_string()))
    }

    pub(super) fn request(
        &self,
        prompt: Vec<u32>,
        max_tokens: usize,
        top_logprobs: usize,
        constraint: Option<Constraint>,
        choice: usize,
        drafting: &Drafting,
    ) -> GenerateRequest {
        GenerateRequest {
            prompt,
            max_tokens,
            sampling: self.params(choice),
            stop: self
                .stop
                .clone()
                .map(StopField::into_vec)
                .unwrap_or_default(),
            stop_tokens: self.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            top_logprobs,
            detect_loops: self.detect_loops.unwrap_or(true),
            constraint,
            speculation: drafting.speculation,
            prediction: drafting.prediction.clone(),
        }
    }

    pub(super) fn check(&self) -> Result<(), ApiError> {
        self.params(0)
            .validate()
            .map_err(|e| ApiError::invalid("sampling", e.to_string()))?;
        if let Some(stop) = &self.stop {
            let stops = stop.clone().into_vec();
            if stops.len() > 16 {
                return Err(ApiError::invalid("stop", "at most 16 stop strings"));
            }
        }
        Ok(())
    }
}

#[derive(Debug, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// Message content: text, or a list of parts of which only text is supported.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Json_>),
}

#[derive(Debug, Deserialize)]
struct InMessage {
    role: String,
    #[serde(default)]
    content: Option<Content>,
    #[serde(default)]
    tool_calls: Option<Vec<ToolCall>>,
    #[serde(default)]
    tool_call_id: Option<String>,
    #[serde(default)]
    name: Option<String>,
}

#[derive(Debug, Deserialize)]
pub(super) struct ChatRequest {
    #[serde(default)]
    model: Option<String>,
    messages: Vec<InMessage>,
    max_tokens: Option<usize>,
    max_completion_tokens: Option<usize>,
    #[serde(default)]
    n: Option<usize>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    logprobs: bool,
    top_logprobs: Option<usize>,
    tools: Option<Vec<Json_>>,
    tool_choice: Option<Json_>,
    /// Several tool calls in one turn (OpenAI's default: true).
    parallel_tool_calls: Option<bool>,
    response_format: Option<Json_>,
    /// Extension: a Lark grammar (llguidance dialect) the output must match.
    grammar: Option<String>,
    /// Extension (vLLM's name): also return the prompt's token ids
    /// (`prompt_token_ids`) and each choice's generated ids (`choices[].token_ids`),
    /// so that a trainer gets the exact tokens without re-tokenizing. Not streamed.
    /// On a loaded adapter, each choice also says which version of the adapter's
    /// weights sampled each token (`choices[].weights_versions`, the `version` that
    /// `POST /v1/adapters` answered): a generation that spans a reload steps up.
    #[serde(default)]
    return_token_ids: bool,
    #[serde(flatten)]
    sampling: SamplingFields,
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn convert_messages(messages: Vec<InMessage>) -> Result<Vec<Message>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "messages must not be empty"));
    }
    messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            if !matches!(m.role.as_str(), "system" | "developer" | "user" | "assistant" | "tool") {
                return Err(ApiError::invalid(
                    &format!("messages[{i}].role"),
                    format!(
                        "unknown role `{}`; use system, developer, user, assistant or tool",
                        m.role
                    ),
                ));
            }
            let content = match m.content {
                None => None,
                Some(Content::Text(t)) => Some(t),
                Some(Content::Parts(parts)) => {
                    let mut text = String::new();
                    for (j, part) in parts.iter().enumerate() {
                        match (part.get("type").and_then(Json_::as_str), part.get("text").and_then(Json_::as_str)) {
                            (Some("text"), Some(t)) => text.push_str(t),
                            _ => {
                                return Err(ApiError::invalid(
                                    &format!("messages[{i}].content[{j}]"),
                                    "only text parts ({\"type\": \"text\", \"text\": …}) are supported by this model",
                                ));
                            }
                        }
                    }
                    Some(text)
                }
            };
            let role = if m.role == "developer" { "system".to_owned() } else { m.role };
            Ok(Message {
                role,
                content,
                tool_calls: m.tool_calls,
                tool_call_id: m.tool_call_id,
                name: m.name,
            })
        })
        .collect()
}

/// Which constraint a chat request asks for.
fn chat_constraint(
    state: &AppState,
    grammar: Option<&str>,
    response_format: Option<&Json_>,
    tools: &[Json_],
    tool_choice: Option<&Json_>,
    parallel: bool,
) -> Result<Option<Constraint>, ApiError> {
    let compiler = || {
        state.constraints.as_ref().ok_or_else(|| {
            ApiError::invalid(
                "response_format",
                "constrained decoding is disabled on this server",
            )
        })
    };
    if let Some(grammar) = grammar {
        return Ok(Some(
            compiler()?
                .lark(grammar)
                .map_err(|e| ApiError::invalid("grammar", e.to_string()))?,
        ));
    }
    if let Some(format) = response_format {
        match format.get("type").and_then(Json_::as_str) {
            Some("text") | None if format.get("type").is_some() => {}
            Some("json_object") => {
                return Ok(Some(compiler()?.json_object().map_err(|e| {
                    ApiError::invalid("response_format", e.to_string())
                })?));
            }
            Some("json_schema") => {
                let schema = format
                    .pointer("/json_schema/schema")
                    .ok_or_else(|| ApiError::invalid("response_format.json_schema.schema", "missing; give {\"type\": \"json_schema\", \"json_schema\": {\"name\": …, \"schema\": {…}}}"))?;
                return Ok(Some(compiler()?.json_schema(schema).map_err(|e| {
                    ApiError::invalid("response_format.json_schema.schema", e.to_string())
                })?));
            }
            _ => {
                return Err(ApiError::invalid(
                    "response_format.type",
                    "must be text, json_object or json_schema",
                ));
            }
        }
    }
    // Without a constraint engine tools still work: the model's output is parsed.
    if tools.is_empty() || state.constraints.is_none() {
        return Ok(None);
    }
    let (selected, required) = match tool_choice {
        None => (tools.to_vec(), false),
        Some(Json_::String(s)) if s == "auto" => (tools.to_vec(), false),
        Some(Json_::String(s)) if s == "none" => return Ok(None),
        Some(Json_::String(s)) if s == "required" => (tools.to_vec(), true),
        Some(choice) => {
            let name = choice
                .pointer("/function/name")
                .and_then(Json_::as_str)
                .ok_or_else(|| ApiError::invalid("tool_choice", "must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": …}}"))?;
            let tool = tools
                .iter()
                .find(|t| t.pointer("/function/name").and_then(Json_::as_str) == Some(name))
                .ok_or_else(|| {
                    ApiError::invalid("tool_choice", format!("no tool named `{name}` in tools"))
                })?;
            (vec![tool.clone()], true)
        }
    };
    Ok(Some(
        compiler()?
            .tool_calls(&selected, ToolChoice { required, parallel })
            .map_err(|e| ApiError::invalid("tools", e.to_string()))?,
    ))
}

fn check_tools(tools: &[Json_]) -> Result<(), ApiError> {
    crate::constraint::tool_call_schema(tools)
        .map(|_| ())
        .map_err(|e| ApiError::invalid("tools", e.to_string()))
}

fn top_n(logprobs: bool, top: Option<usize>) -> Result<usize, ApiError> {
    match (logprobs, top) {
        (_, Some(n)) if n > crate::sampling::MAX_TOP_LOGPROBS => Err(ApiError::invalid(
            "top_logprobs",
            format!(
                "must be between 0 and {}",
                crate::sampling::MAX_TOP_LOGPROBS
            ),
        )),
        (false, Some(n)) if n > 0 => {
            Err(ApiError::invalid("top_logprobs", "requires logprobs: true"))
        }
        (_, Some(n)) => Ok(n),
        _ => Ok(0),
    }
}

fn max_tokens_for(
    state: &AppState,
    prompt: usize,
    asked: Option<usize>,
) -> Result<usize, ApiError> {
    let context = state.engine.model().model().max_positions();
    let room = context.saturating_sub(prompt);
    if room == 0 {
        return Err(ApiError::from(crate::ModelError::ContextOverflow {
            tokens: prompt + 1,
            context,
        }));
    }
    match asked {
        Some(0) => Err(ApiError::invalid("max_tokens", "must be at least 1")),
        Some(n) if n > room => Err(ApiError::from(crate::ModelError::ContextOverflow {
            tokens: prompt + n,
            context,
        })),
        Some(n) => Ok(n),
        None => Ok(room),
    }
}

fn token_text(state: &AppState, id: u32) -> (String, Vec<u8>) {
    let bytes = state
        .engine
        .model()
        .tokenizer()
        .token_bytes(id)
        .unwrap_or_default()
        .to_vec();
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

fn chat_logprob_entry(state: &AppState, token: &TokenLogprob, top: &[TokenLogprob]) -> Json_ {
    let (text, bytes) = token_text(state, token.id);
    let top: Vec<Json_> = top
        .iter()
        .map(|t| {
            let (text, bytes) = token_text(state, t.id);
            json!({"token": text, "logprob": t.logprob, "bytes": bytes})
        })
        .collect();
    json!({"token": text, "logprob": token.logprob, "bytes": bytes, "top_logprobs": top})
}

fn finish_str(reason: FinishReason, has_calls: bool) -> &'static str {
    if has_calls {
        return "tool_calls";
    }
    reason.openai_name()
}

fn tool_calls_json(calls: &[(String, String)]) -> Vec<Json_> {
    calls
        .iter()
        .map(|(name, arguments)| {
            serde_json::to_value(ToolCall {
                id: format!("call_{}", uuid::Uuid::new_v4().simple()),
                kind: "function".into(),
                function: FunctionCall {
                    name: name.clone(),
                    arguments: arguments.clone(),
                },
            })
            .unwrap_or(Json_::Null)
        })
        .collect()
}

pub(super) async fn chat_completions(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<ChatRequest>,
) -> Result<Response, ApiError> {
    let ChatRequest {
        model,
        messages,
        max_tokens,
        max_completion_tokens,
        n,
        stream,
        stream_options,
        logprobs,
        top_logprobs,
        tools,
        tool_choice,
        parallel_tool_calls,
        response_format,
        grammar,
        return_token_ids,
        sampling,
    } = req;
    sampling.check()?;
    let drafting = sampling.drafting(&state.engine)?;
    let adapter = state.adapter_for(model.as_deref())?;
    if stream && return_token_ids {
        return Err(ApiError::invalid(
            "return_token_ids",
            "is not available with stream: true; use /generate to stream token ids",
        ));
    }
    let n = n.unwrap_or(1);
    if n == 0 || n > state.config.max_n {
        return Err(ApiError::invalid(
            "n",
            format!("must be between 1 and {}", state.config.max_n),
        ));
    }
    let want_logprobs = logprobs;
    let top_logprobs = top_n(want_logprobs, top_logprobs)?;
    let tools = tools.unwrap_or_default();
    if !tools.is_empty() {
        check_tools(&tools)?;
    }
    let lm = state.engine.model();
    let messages = convert_messages(messages)?;
    let prompt = lm.chat_prompt(messages, &tools).map_err(|e| match e {
        crate::ModelError::Template(m) => ApiError::invalid("messages", m),
        other => other.into(),
    })?;
    let max_tokens = max_tokens_for(&state, prompt.len(), max_completion_tokens.or(max_tokens))?;
    let constraint = chat_constraint(
        &state,
        grammar.as_deref(),
        response_format.as_ref(),
        &tools,
        tool_choice.as_ref(),
        parallel_tool_calls.unwrap_or(true),
    )?;
    let mut receivers = StreamMap::new();
    for i in 0..n {
        let request = sampling.request(
            prompt.clone(),
            max_tokens,
            top_logprobs,
            constraint.clone(),
            i,
            &drafting,
        );
        let rx = state.engine.submit_with(request, adapter.as_deref())?;
        receivers.insert(i, UnboundedReceiverStream::new(rx));
    }
    let id = format!("chatcmpl-{}", uuid::Uuid::new_v4().simple());
    let model = model.unwrap_or_else(|| state.config.model_name.clone());
    let has_tools =
        !tools.is_empty() && !matches!(&tool_choice, Some(Json_::String(s)) if s == "none");
    if stream {
        let include_usage = stream_options.as_ref().is_some_and(|o| o.include_usage);
        let stream = chat_stream(
            state.clone(),
            receivers,
            id,
            model,
            want_logprobs,
            has_tools,
            include_usage,
            prompt.len(),
        );
        return Ok(Sse::new(stream)
            .keep_alive(KeepAlive::default())
            .into_response());
    }
    let (outputs, versions) = collect(receivers, n, state.config.request_timeout).await?;
    let usage = Usage::of(prompt.len(), &outputs);
    let mut choices = Vec::with_capacity(n);
    for (index, (out, versions)) in outputs.into_iter().zip(versions).enumerate() {
        let (calls, text) = if has_tools {
            parse_tool_calls(&out.text)
        } else {
            (Vec::new(), out.text.clone())
        };
        let logprobs = want_logprobs.then(|| {
            let content: Vec<Json_> = out
                .tokens
                .iter()
                .zip(&out.logprobs)
                .enumerate()
                .map(|(k, (&id, &logprob))| {
                    let top = out.top_logprobs.get(k).map(Vec::as_slice).unwrap_or(&[]);
                    chat_logprob_entry(&state, &TokenLogprob { id, logprob }, top)
                })
                .collect();
            json!({"content": content})
        });
        let mut message = json!({"role": "assistant", "content": if calls.is_empty() { Json_::String(text) } else if text.is_empty() { Json_::Null } else { Json_::String(text) }});
        if !calls.is_empty() {
            message["tool_calls"] = Json_::Array(tool_calls_json(&calls));
        }
        let mut choice = json!({
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish_str(out.finish, !calls.is_empty()),
        });
        if return_token_ids {
            choice["token_ids"] = json!(out.tokens);
            if let Some(versions) = weights_versions(versions, out.tokens.len()) {
                choice["weights_versions"] = json!(versions);
            }
        }
        choices.push(choice);
    }
    let mut body = json!({
        "id": id,
        "object": "chat.completion",
        "created": now(),
        "model": model,
        "choices": choices,
        "usage": usage.json(),
    });
    if return_token_ids {
        body["prompt_token_ids"] = json!(prompt);
    }
    Ok(Json(body).into_response())
}

/// A response's `usage`.
#[derive(Debug, Default)]
struct Usage {
    prompt_tokens: usize,
    completion_tokens: usize,
    /// The prompt is counted once; so are its tokens read from a cache (the most any
    /// choice reused).
    cached_tokens: usize,
    /// Speculative decoding's draft tokens verified and kept, over all choices.
    draft_tokens: usize,
    accepted_draft_tokens: usize,
}

impl Usage {
    fn of(prompt_tokens: usize, outputs: &[GenerateOutput]) -> Self {
        let mut usage = Self {
            prompt_tokens,
            ..Self::default()
        };
        for out in outputs {
            usage.add(out);
        }
        usage
    }

    fn add(&mut self, out: &GenerateOutput) {
        self.completion_tokens += out.tokens.len();
        self.cached_tokens = self.cached_tokens.max(out.cached_tokens);
        self.draft_tokens += out.draft_tokens;
        self.accepted_draft_tokens += out.accepted_draft_tokens;
    }

    /// OpenAI's fields; the draft tokens as its predicted outputs' accepted and
    /// rejected prediction tokens.
    fn json(&self) -> Json_ {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "completion_tokens_details": {
                "accepted_prediction_tokens": self.accepted_draft_tokens,
                "rejected_prediction_tokens": self.draft_tokens - self.accepted_draft_tokens,
            },
        })
    }
}

/// Waits for all choices; a timeout cancels them (dropping the receivers).
/// Each choice's output, and the adapter version of each of its tokens (empty on the
/// base model).
async fn collect(
    mut receivers: StreamMap<usize, UnboundedReceiverStream<Event>>,
    n: usize,
    timeout: std::time::Duration,
) -> Result<(Vec<GenerateOutput>, Vec<Vec<u64>>), ApiError> {
    let mut outputs: Vec<Option<GenerateOutput>> = vec![None; n];
    let mut versions: Vec<Vec<u64>> = vec![Vec::new(); n];
    let work = async {
        while let Some((i, event)) = receivers.next().await {
            match event {
                Event::Token(token) => versions[i].extend(token.weights_version),
                Event::Done(out) => outputs[i] = Some(out),
                Event::Error(e) => return Err(ApiError::from(e)),
            }
        }
        Ok(())
    };
    match tokio::time::timeout(timeout, work).await {
        Ok(result) => result?,
        Err(_) => {
            return Err(ApiError::new(
                axum::http::StatusCode::GATEWAY_TIMEOUT,
                "timeout",
                format!("the request ran longer than {} s", timeout.as_secs()),
            ));
        }
    }
    let outputs = outputs
        .into_iter()
        .map(|o| o.ok_or_else(|| ApiError::from(crate::engine::SubmitError::Stopped)))
        .collect::<Result<_, _>>()?;
    Ok((outputs, versions))
}

#[expect(clippy::too_many_arguments, reason = "one stream's fixed context")]
fn chat_stream(
    state: AppState,
    mut receivers: StreamMap<usize, UnboundedReceiverStream<Event>>,
    id: String,
    model: String,
    logprobs: bool,
    has_tools: bool,
    include_usage: bool,
    prompt_tokens: usize,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    async_stream(move |tx| async move {
        let created = now();
        let chunk = |index: usize, delta: Json_, logprobs: Json_, finish: Json_| {
            json!({
                "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
            })
        };
        let mut started = std::collections::HashSet::new();
        let mut held: std::collections::HashMap<usize, String> = Default::default();
        let mut usage = Usage {
            prompt_tokens,
            ..Usage::default()
        };
        while let Some((index, event)) = receivers.next().await {
            if started.insert(index) {
                let first = chunk(
                    index,
                    json!({"role": "assistant", "content": ""}),
                    Json_::Null,
                    Json_::Null,
                );
                if tx.send(first).is_err() {
                    return;
                }
            }
            match event {
                Event::Token(TokenEvent {
                    token,
                    top,
                    text,
                    finish,
                    ..
                }) => {
                    let lp = if logprobs {
                        json!({"content": [chat_logprob_entry(&state, &token, &top)]})
                    } else {
                        Json_::Null
                    };
                    // With tools, text is held to the end: only then is it known whether
                    // it was a tool call.
                    let content = if has_tools {
                        held.entry(index).or_default().push_str(&text);
                        String::new()
                    } else {
                        text
                    };
                    if (!content.is_empty() || logprobs)
                        && tx
                            .send(chunk(index, json!({"content": content}), lp, Json_::Null))
                            .is_err()
                    {
                        return;
                    }
                    let _ = finish;
                }
                Event::Done(out) => {
                    usage.add(&out);
                    let mut calls = Vec::new();
                    if has_tools {
                        let (c, rest) =
                            parse_tool_calls(held.get(&index).map(String::as_str).unwrap_or(""));
                        calls = c;
                        let delta = if calls.is_empty() {
                            json!({"content": held.remove(&index).unwrap_or_default()})
                        } else {
                            let calls_json: Vec<Json_> = tool_calls_json(&calls)
                                .into_iter()
                                .enumerate()
                                .map(|(k, mut c)| {
                                    c["index"] = json!(k);
                                    c
                                })
                                .collect();
                            json!({"content": if rest.is_empty() { Json_::Null } else { Json_::String(rest) }, "tool_calls": calls_json})
                        };
                        if tx
                            .send(chunk(index, delta, Json_::Null, Json_::Null))
                            .is_err()
                        {
                            return;
                        }
                    }
                    let last = chunk(
                        index,
                        json!({}),
                        Json_::Null,
                        json!(finish_str(out.finish, !calls.is_empty())),
                    );
                    if tx.send(last).is_err() {
                        return;
                    }
                }
                Event::Error(e) => {
                    let _ = tx
                        .send(json!({"error": {"message": e.to_string(), "type": "server_error"}}));
                    return;
                }
            }
        }
        if include_usage {
            let _ = tx.send(json!({
                "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [],
                "usage": usage.json(),
            }));
        }
    })
}

/// Runs `body` as a task feeding JSON chunks into an SSE stream that ends with
/// `[DONE]`. When the client disconnects the stream is dropped, the channel closes,
/// the task's sends fail, it returns and drops the engine receivers, which cancels the
/// generation.
pub(super) fn async_stream<F, Fut>(body: F) -> impl Stream<Item = Result<SseEvent, Infallible>>
where
    F: FnOnce(tokio::sync::mpsc::UnboundedSender<Json_>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Json_>();
    let task = tokio::spawn(body(tx));
    let guard = AbortOnDrop(task);
    UnboundedReceiverStream::new(rx)
        .map(|value| Ok(SseEvent::default().data(value.to_string())))
        .chain(futures_util::stream::once(async move {
            drop(guard);
            Ok(SseEvent::default().data("[DONE]"))
        }))
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// `prompt`: text, texts, token ids, or lists of token ids.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum PromptField {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
pub(super) struct CompletionRequest {
    #[serde(default)]
    model: Option<String>,
    prompt: PromptField,
    max_tokens: Option<usize>,
    #[serde(default)]
    n: Option<usize>,
    #[serde(default)]
    stream: bool,
    logprobs: Option<usize>,
    #[serde(default)]
    echo: bool,
    #[serde(flatten)]
    sampling: SamplingFields,
}

pub(super) async fn completions(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    req.sampling.check()?;
    let drafting = req.sampling.drafting(&state.engine)?;
    let adapter = state.adapter_for(req.model.as_deref())?;
    if req.echo {
        return Err(ApiError::invalid(
            "echo",
            "echo is not supported; use /generate with the prompt's tokens",
        ));
    }
    let n = req.n.unwrap_or(1);
    if n == 0 || n > state.config.max_n {
        return Err(ApiError::invalid(
            "n",
            format!("must be between 1 and {}", state.config.max_n),
        ));
    }
    let top = req.logprobs.unwrap_or(0);
    if top > 5 {
        return Err(ApiError::invalid("logprobs", "must be between 0 and 5"));
    }
    let lm = state.engine.model();
    let prompts: Vec<Vec<u32>> = match req.prompt {
        PromptField::Text(t) => vec![lm.tokenizer().encode(&t, false)?],
        PromptField::Texts(ts) => ts
            .iter()
            .map(|t| lm.tokenizer().encode(t, false))
            .collect::<Result<_, _>>()?,
        PromptField::Tokens(ids) => vec![ids],
        PromptField::TokenLists(lists) => lists,
    };
    if prompts.is_empty() || prompts.iter().any(Vec::is_empty) {
        return Err(ApiError::invalid("prompt", "the prompt must not be empty"));
    }
    if prompts.len() * n > state.config.max_n.max(1) * 4 {
        return Err(ApiError::invalid(
            "prompt",
            "too many prompts × n in one request",
        ));
    }
    let mut receivers = StreamMap::new();
    let mut index = 0;
    let mut prompt_tokens = 0;
    for prompt in &prompts {
        prompt_tokens += prompt.len();
        let max_tokens = max_tokens_for(&state, prompt.len(), Some(req.max_tokens.unwrap_or(16)))?;
        for i in 0..n {
            let request = req
                .sampling
                .request(prompt.clone(), max_tokens, top, None, i, &drafting);
            let rx = state.engine.submit_with(request, adapter.as_deref())?;
            receivers.insert(index, UnboundedReceiverStream::new(rx));
            index += 1;
        }
    }
    let id = format!("cmpl-{}", uuid::Uuid::new_v4().simple());
    let model = req
        .model
        .clone()
        .unwrap_or_else(|| state.config.model_name.clone());
    if req.stream {
        let st = state.clone();
        let stream = async_stream(move |tx| async move {
            let created = now();
            let mut receivers = receivers;
            while let Some((index, event)) = receivers.next().await {
                let (text, finish, lp) = match event {
                    Event::Token(ev) => (
                        ev.text.clone(),
                        Json_::Null,
                        (top > 0).then(|| {
                            completion_logprobs(&st, &[ev.token.id], &[ev.token.logprob], &[ev.top])
                        }),
                    ),
                    Event::Done(out) => (String::new(), json!(finish_str(out.finish, false)), None),
                    Event::Error(e) => {
                        let _ = tx.send(
                            json!({"error": {"message": e.to_string(), "type": "server_error"}}),
                        );
                        return;
                    }
                };
                if text.is_empty() && finish.is_null() && lp.is_none() {
                    continue;
                }
                let chunk = json!({"id": id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": index, "text": text, "logprobs": lp, "finish_reason": finish}]});
                if tx.send(chunk).is_err() {
                    return;
                }
            }
        });
        return Ok(Sse::new(stream)
            .keep_alive(KeepAlive::default())
            .into_response());
    }
    let (outputs, _) = collect(receivers, index, state.config.request_timeout).await?;
    let usage = Usage::of(prompt_tokens, &outputs);
    let choices: Vec<Json_> = outputs
        .iter()
        .enumerate()
        .map(|(i, out)| {
            json!({
                "index": i,
                "text": out.text,
                "logprobs": (top > 0).then(|| completion_logprobs(&state, &out.tokens, &out.logprobs, &out.top_logprobs)),
                "finish_reason": finish_str(out.finish, false),
            })
        })
        .collect();
    Ok(Json(json!({
        "id": id, "object": "text_completion", "created": now(), "model": model,
        "choices": choices,
        "usage": usage.json(),
    }))
    .into_response())
}

fn completion_logprobs(
    state: &AppState,
    tokens: &[u32],
    logprobs: &[f32],
    top: &[Vec<TokenLogprob>],
) -> Json_ {
    let mut offset = 0;
    let mut offsets = Vec::new();
    let mut texts = Vec::new();
    let mut tops = Vec::new();
    for (k, &id) in tokens.iter().enumerate() {
        let (text, _) = token_text(state, id);
        offsets.push(offset);
        offset += text.len();
        texts.push(text);
        let map: serde_json::Map<String, Json_> = top
            .get(k)
            .map(|alts| {
                alts.iter()
                    .map(|t| (token_text(state, t.id).0, json!(t.logprob)))
                    .collect()
            })
            .unwrap_or_default();
        tops.push(Json_::Object(map));
    }
    json!({"tokens": texts, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets})
}
