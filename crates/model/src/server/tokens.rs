//! Token-in-token-out endpoints: `/generate`, `/tokenize`, `/detokenize`.
//!
//! `/generate` takes token ids (or text) and returns the generated ids with the
//! log-probability of each, exactly as sampled: what an RL trainer needs to score and
//! train on the very tokens the model produced, with no re-tokenization. On a loaded
//! adapter it also says which version of the adapter's weights sampled each token
//! (`weights_versions`): a generation that spans a reload (`POST /v1/adapters`) steps
//! up, which an asynchronous trainer needs to weigh each token by its staleness.

use axum::Json;
use axum::extract::State;
use axum::response::sse::{KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{Value as Json_, json};
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::openai::{SamplingFields, async_stream};
use super::{ApiError, ApiJson, AppState};
use crate::chat::Message;
use crate::engine::{Event, weights_versions};

#[derive(Debug, Deserialize)]
pub(super) struct GenerateBody {
    /// Prompt token ids.
    input_ids: Option<Vec<u32>>,
    /// Or prompt text (special tokens such as `<|im_start|>` are parsed).
    prompt: Option<String>,
    #[serde(default = "default_max_tokens")]
    max_tokens: usize,
    #[serde(default)]
    top_logprobs: usize,
    #[serde(default)]
    stream: bool,
    /// An adapter loaded with `POST /v1/adapters` (or the base model's name).
    #[serde(default)]
    model: Option<String>,
    #[serde(flatten)]
    sampling: SamplingFields,
}

fn default_max_tokens() -> usize {
    256
}

pub(super) async fn generate(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<GenerateBody>,
) -> Result<Response, ApiError> {
    body.sampling.check()?;
    let lm = state.engine.model();
    let prompt = match (body.input_ids, body.prompt) {
        (Some(ids), None) => ids,
        (None, Some(text)) => lm.tokenizer().encode(&text, true)?,
        _ => {
            return Err(ApiError::invalid(
                "input_ids",
                "give exactly one of input_ids (token ids) or prompt (text)",
            ));
        }
    };
    if body.max_tokens == 0 {
        return Err(ApiError::invalid("max_tokens", "must be at least 1"));
    }
    let context = lm.model().max_positions();
    if prompt.len() + body.max_tokens > context {
        return Err(crate::ModelError::ContextOverflow {
            tokens: prompt.len() + body.max_tokens,
            context,
        }
        .into());
    }
    let mut sampling = body.sampling;
    // Token-level callers get exactly the tokens they asked for unless they opt in.
    sampling.detect_loops = Some(sampling.detect_loops.unwrap_or(false));
    let drafting = sampling.drafting(&state.engine)?;
    let request = sampling.request(
        prompt.clone(),
        body.max_tokens,
        body.top_logprobs,
        None,
        0,
        &drafting,
    );
    let adapter = state.adapter_for(body.model.as_deref())?;
    let receiver = state.engine.submit_with(request, adapter.as_deref())?;
    if body.stream {
        let stream = async_stream(move |tx| async move {
            let mut events = UnboundedReceiverStream::new(receiver);
            while let Some(event) = events.next().await {
                let value = match event {
                    Event::Token(ev) => json!({
                        "token_id": ev.token.id,
                        "logprob": ev.token.logprob,
                        "top_logprobs": ev.top,
                        "text": ev.text,
                        "finish_reason": ev.finish,
                    }),
                    Event::Done(_) => continue,
                    Event::Error(e) => {
                        json!({"error": {"message": e.to_string(), "type": "server_error"}})
                    }
                };
                if tx.send(value).is_err() {
                    return;
                }
            }
        });
        return Ok(Sse::new(stream)
            .keep_alive(KeepAlive::default())
            .into_response());
    }
    let mut events = UnboundedReceiverStream::new(receiver);
    let mut versions = Vec::new();
    let work = async {
        while let Some(event) = events.next().await {
            match event {
                Event::Token(token) => versions.extend(token.weights_version),
                Event::Done(out) => return Ok(out),
                Event::Error(e) => return Err(ApiError::from(e)),
            }
        }
        Err(ApiError::from(crate::engine::SubmitError::Stopped))
    };
    let out = tokio::time::timeout(state.config.request_timeout, work)
        .await
        .map_err(|_| ApiError::invalid("max_tokens", "the request timed out"))??;
    let mut reply = json!({
        "output_ids": out.tokens,
        "logprobs": out.logprobs,
        "top_logprobs": if body.top_logprobs > 0 { json!(out.top_logprobs) } else { Json_::Null },
        "text": out.text,
        "finish_reason": out.finish,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.tokens.len(),
        "cached_tokens": out.cached_tokens,
        "draft_tokens": out.draft_tokens,
        "accepted_draft_tokens": out.accepted_draft_tokens,
    });
    if let Some(versions) = weights_versions(versions, out.tokens.len()) {
        reply["weights_versions"] = json!(versions);
    }
    Ok(Json(reply).into_response())
}

#[derive(Debug, Deserialize)]
pub(super) struct TokenizeBody {
    /// Text to tokenize.
    text: Option<String>,
    /// Or a conversation, rendered with the chat template first.
    messages: Option<Vec<Message>>,
    /// Parse special tokens written in the text (default true).
    #[serde(default = "yes")]
    parse_special: bool,
    /// With `messages`: end with the assistant header (default true).
    #[serde(default = "yes")]
    add_generation_prompt: bool,
}

fn yes() -> bool {
    true
}

pub(super) async fn tokenize(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<TokenizeBody>,
) -> Result<Json<Json_>, ApiError> {
    let lm = state.engine.model();
    let text = match (body.text, body.messages) {
        (Some(text), None) => text,
        (None, Some(messages)) => lm
            .template()
            .render(&messages, None, body.add_generation_prompt)
            .map_err(|e| ApiError::invalid("messages", e.to_string()))?,
        _ => {
            return Err(ApiError::invalid(
                "text",
                "give exactly one of text or messages",
            ));
        }
    };
    let tokens = lm.tokenizer().encode(&text, body.parse_special)?;
    Ok(Json(
        json!({"tokens": tokens, "count": tokens.len(), "max_model_len": lm.model().max_positions()}),
    ))
}

#[derive(Debug, Deserialize)]
pub(super) struct DetokenizeBody {
    tokens: Vec<u32>,
    #[serde(default)]
    skip_special_tokens: bool,
}

pub(super) async fn detokenize(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<DetokenizeBody>,
) -> Result<Json<Json_>, ApiError> {
    let tokenizer = state.engine.model().tokenizer();
    let vocab = tokenizer.vocab_size();
    if let Some((i, bad)) = body
        .tokens
        .iter()
        .enumerate()
        .find(|(_, t)| **t as usize >= vocab)
    {
        return Err(ApiError::invalid(
            &format!("tokens[{i}]"),
            format!(
                "token id {bad} is out of range; the vocabulary has {vocab} tokens (0..{vocab})"
            ),
        ));
    }
    Ok(Json(
        json!({"text": tokenizer.decode(&body.tokens, body.skip_special_tokens)}),
    ))
}
