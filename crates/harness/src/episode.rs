//! The agent loop: observation → messages → model → action → step, until the episode
//! ends or the turn limit.

use std::time::Instant;

use agentstack_model::chat::Message;
use agentstack_protocol::http::ResetRequest;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::context::{self, ContextPolicy, Overflow};
use crate::env::{EnvError, EnvHandle, StepOutcome};
use crate::model::{ChatRequest, Continuation, ModelClient, ModelError, Sampling, TokenTrace};
use crate::prompt::{ActionFormat, Presenter};

/// How episodes are played. Recorded with every result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoopConfig {
    /// Most model turns per episode.
    pub max_turns: usize,
    /// How each turn is sampled.
    pub sampling: Sampling,
    /// What of the conversation the model sees.
    pub context: ContextPolicy,
    /// Constrain JSON actions to the action schema (when the model side can).
    pub constrain: bool,
}

impl Default for LoopConfig {
    fn default() -> Self {
        Self {
            max_turns: 16,
            sampling: Sampling::default(),
            context: ContextPolicy::default(),
            constrain: false,
        }
    }
}

/// What one model call was for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TurnKind {
    /// The model chose an action.
    Act,
    /// The model summarised earlier turns (compaction).
    Compact,
}

/// One model call and what came of it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Turn {
    /// What the call was for.
    pub kind: TurnKind,
    /// The call's token ids and logprobs, as far as the model side gives them
    /// (`prompt_ids`, `completion_ids`, `logprobs` in JSON).
    #[serde(flatten)]
    pub tokens: TokenTrace,
    /// The reply's text.
    pub text: String,
    /// The reply's tool calls.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<agentstack_model::chat::ToolCall>,
    /// Why the generation ended.
    pub finish_reason: String,
    /// The action sent to the environment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<Value>,
    /// Why the reply was not a usable action (a parse failure or the environment's
    /// rejection), as fed back to the model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The step's reward.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reward: Option<f64>,
    /// Whether the step ended the episode.
    #[serde(default)]
    pub done: bool,
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Of those, the tokens read from the model side's cache (prefix reuse), for a turn
    /// played by this process; `None` for one read back from a results file. Not
    /// written: it depends on what else ran at the time (concurrency, the cache's
    /// contents), and a results file is the same whatever those were.
    #[serde(skip)]
    pub cached_tokens: Option<usize>,
    /// Speculative decoding's draft tokens verified and kept in this turn, for a turn
    /// played by this process (not written, for the same reason as `cached_tokens`).
    #[serde(skip)]
    pub drafts: Option<DraftCounts>,
    /// Tokens generated.
    pub completion_tokens: usize,
}

/// A model call's speculative decoding: draft tokens verified, and kept.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DraftCounts {
    /// Draft tokens verified.
    pub drafted: usize,
    /// Of those, kept.
    pub accepted: usize,
}

impl Turn {
    /// A model call's record, before any action or step.
    fn from_reply(kind: TurnKind, reply: crate::model::ChatResponse) -> Self {
        Self {
            kind,
            tokens: reply.tokens,
            text: reply.text,
            tool_calls: reply.tool_calls,
            finish_reason: reply.finish_reason,
            action: None,
            error: None,
            reward: None,
            done: false,
            prompt_tokens: reply.prompt_tokens,
            cached_tokens: Some(reply.cached_tokens),
            drafts: Some(DraftCounts {
                drafted: reply.draft_tokens,
                accepted: reply.accepted_draft_tokens,
            }),
            completion_tokens: reply.completion_tokens,
        }
    }
}

/// How an episode ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Finish {
    /// The environment said done.
    Done,
    /// The turn limit was reached.
    TurnLimit,
    /// The conversation outgrew the context budget.
    Context,
}

/// One played episode: the trajectory, token ids included.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Episode {
    /// The reset request that started it.
    pub reset: Value,
    /// Sum of the step rewards.
    pub reward: f64,
    /// How it ended.
    pub finish: Finish,
    /// Steps applied by the environment.
    pub steps: usize,
    /// Replies that were not an action.
    pub parse_errors: usize,
    /// Actions the environment rejected.
    pub invalid_actions: usize,
    /// Every model call, in order.
    pub turns: Vec<Turn>,
    /// The final conversation (as kept, after any truncation or compaction).
    pub messages: Vec<Message>,
}

/// Wall time spent per turn, kept apart from the trajectory (which is deterministic).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    /// Milliseconds waiting for the model, per turn.
    pub model_ms: Vec<f64>,
    /// Milliseconds waiting for the environment (reset and steps).
    pub env_ms: f64,
    /// The whole episode, milliseconds.
    pub total_ms: f64,
}

/// Why an episode could not be played (not the model's fault).
#[derive(Debug, thiserror::Error)]
pub enum EpisodeError {
    /// The model side failed.
    #[error("the model side of the episode failed")]
    Model(#[from] ModelError),
    /// The environment side failed.
    #[error("the environment side of the episode failed")]
    Env(#[from] EnvError),
    /// The prompt profile failed to render.
    #[error(transparent)]
    Profile(#[from] crate::prompt::ProfileError),
}

/// A seed for turn `turn` of an episode seeded `seed` (SplitMix64 of both).
pub fn turn_seed(seed: u64, turn: usize) -> u64 {
    let mut z = seed ^ (turn as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Plays one episode. `seed` seeds the model's sampling (one stream per turn).
pub async fn play(
    model: &ModelClient,
    env: &EnvHandle,
    presenter: &Presenter,
    reset: ResetRequest,
    seed: u64,
    config: &LoopConfig,
) -> Result<(Episode, Timing), EpisodeError> {
    let started = Instant::now();
    let mut timing = Timing::default();
    let mut session = env.open().await?;
    let t = Instant::now();
    let reset_value = serde_json::to_value(&reset).unwrap_or_default();
    let first = session.reset(reset).await;
    timing.env_ms += ms(t);
    let first = match first {
        Ok(first) => first,
        Err(e) => {
            session.close().await;
            return Err(e.into());
        }
    };
    let mut episode = Episode {
        reset: reset_value,
        reward: 0.0,
        finish: Finish::TurnLimit,
        steps: 0,
        parse_errors: 0,
        invalid_actions: 0,
        turns: Vec::new(),
        messages: vec![
            Message::new("system", presenter.system()?),
            Message::new("user", presenter.user(&first.observation)?),
        ],
    };
    let result = act(
        model,
        &mut session,
        presenter,
        seed,
        config,
        &mut episode,
        &mut timing,
    )
    .await;
    session.close().await;
    result?;
    timing.total_ms = ms(started);
    Ok((episode, timing))
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

async fn act(
    model: &ModelClient,
    session: &mut crate::env::EnvSession,
    presenter: &Presenter,
    seed: u64,
    config: &LoopConfig,
    episode: &mut Episode,
    timing: &mut Timing,
) -> Result<(), EpisodeError> {
    let tools = presenter.tools().to_vec();
    let json_schema = if config.constrain {
        presenter.json_schema().cloned()
    } else {
        None
    };
    let mut calls = 0;
    // The last call, which the next one's prompt continues token for token.
    let mut earlier = None;
    for _ in 0..config.max_turns {
        // Fit the conversation into the budget.
        if !fit(model, presenter, seed, config, episode, timing, &mut calls).await? {
            episode.finish = Finish::Context;
            return Ok(());
        }
        let request = ChatRequest {
            messages: context::visible(&episode.messages, &config.context),
            tools: tools.clone(),
            sampling: config.sampling.clone(),
            seed: turn_seed(seed, calls),
            json_schema: json_schema.clone(),
            continues: earlier.take(),
        };
        calls += 1;
        let t = Instant::now();
        let reply = model.chat(&request).await?;
        timing.model_ms.push(ms(t));
        earlier = Continuation::after(&request, &reply);
        let mut assistant = Message::new("assistant", reply.text.clone());
        if !reply.tool_calls.is_empty() {
            assistant.tool_calls = Some(reply.tool_calls.clone());
            if reply.text.is_empty() {
                assistant.content = None;
            }
        }
        episode.messages.push(assistant);
        let parsed = presenter.parse(&reply.text, &reply.tool_calls);
        let call_id = reply.tool_calls.first().map(|call| call.id.clone());
        let mut turn = Turn::from_reply(TurnKind::Act, reply);
        let feedback_role = |m: &mut Vec<Message>, text: String| {
            if let Some(id) = &call_id {
                let mut tool = Message::new("tool", text);
                tool.tool_call_id = Some(id.clone());
                m.push(tool);
            } else {
                m.push(Message::new("user", text));
            }
        };
        match parsed {
            Err(why) => {
                episode.parse_errors += 1;
                let text = format!(
                    "Your reply could not be used: {why}. {}",
                    presenter.instructions()
                );
                turn.error = Some(why);
                feedback_role(&mut episode.messages, text);
            }
            Ok(action) => {
                turn.action = Some(action.clone());
                let t = Instant::now();
                let outcome = session.step(&action).await?;
                timing.env_ms += ms(t);
                match outcome {
                    StepOutcome::Rejected(why) => {
                        episode.invalid_actions += 1;
                        let text = format!(
                            "The environment rejected the action: {why}. {}",
                            presenter.instructions()
                        );
                        turn.error = Some(why);
                        feedback_role(&mut episode.messages, text);
                    }
                    StepOutcome::Applied(step) => {
                        episode.steps += 1;
                        episode.reward += step.reward.unwrap_or(0.0);
                        turn.reward = step.reward;
                        turn.done = step.done;
                        if step.done {
                            episode.turns.push(turn);
                            episode.finish = Finish::Done;
                            return Ok(());
                        }
                        let text = presenter.user(&step.observation)?;
                        if matches!(presenter.format(), ActionFormat::Tools) {
                            feedback_role(&mut episode.messages, text);
                        } else {
                            episode.messages.push(Message::new("user", text));
                        }
                    }
                }
            }
        }
        episode.turns.push(turn);
    }
    episode.finish = Finish::TurnLimit;
    Ok(())
}

/// Applies the context policy before a model call. False when the conversation cannot
/// be made to fit.
async fn fit(
    model: &ModelClient,
    presenter: &Presenter,
    seed: u64,
    config: &LoopConfig,
    episode: &mut Episode,
    timing: &mut Timing,
    calls: &mut usize,
) -> Result<bool, EpisodeError> {
    let Some(budget) = config.context.max_tokens else {
        return Ok(true);
    };
    let limit = budget.saturating_sub(config.sampling.max_tokens);
    let size = |messages: &[Message]| {
        model.count_tokens(
            &context::visible(messages, &config.context),
            presenter.tools(),
        )
    };
    let mut compacted = false;
    while size(&episode.messages) > limit {
        match config.context.overflow {
            Overflow::Stop => return Ok(false),
            Overflow::Compact if !compacted => {
                compacted = true;
                let Some(range) = context::compactable(&episode.messages) else {
                    return Ok(false);
                };
                let request = ChatRequest {
                    messages: context::summary_request(&episode.messages[range.clone()]),
                    tools: Vec::new(),
                    sampling: config.sampling.clone(),
                    seed: turn_seed(seed, *calls),
                    json_schema: None,
                    continues: None,
                };
                *calls += 1;
                let t = Instant::now();
                let reply = model.chat(&request).await?;
                timing.model_ms.push(ms(t));
                episode
                    .messages
                    .splice(range, [context::summary_message(&reply.text)]);
                episode
                    .turns
                    .push(Turn::from_reply(TurnKind::Compact, reply));
            }
            Overflow::Truncate | Overflow::Compact => {
                let Some(range) = context::oldest_exchange(&episode.messages) else {
                    return Ok(false);
                };
                episode.messages.drain(range);
            }
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// The turn's JSON keeps `prompt_ids`, `completion_ids` and `logprobs` as top-level
    /// keys, in their old place, each left out when absent (episode files written
    /// before [`TokenTrace`] read the same).
    #[test]
    fn token_trace_keeps_the_turns_json_keys() {
        let turn = Turn::from_reply(
            TurnKind::Act,
            crate::model::ChatResponse {
                text: "42".into(),
                tool_calls: Vec::new(),
                finish_reason: "stop".into(),
                tokens: TokenTrace {
                    prompt_ids: Some(vec![1, 2]),
                    completion_ids: Some(vec![7]),
                    logprobs: Some(vec![-0.5]),
                    weights_versions: None,
                },
                prompt_tokens: 2,
                cached_tokens: 0,
                completion_tokens: 1,
                draft_tokens: 0,
                accepted_draft_tokens: 0,
            },
        );
        let text = serde_json::to_string(&turn).unwrap();
        assert_eq!(
            text,
            r#"{"kind":"act","prompt_ids":[1,2],"completion_ids":[7],"logprobs":[-0.5],"text":"42","finish_reason":"stop","done":false,"prompt_tokens":2,"completion_tokens":1}"#
        );
        // What the cache held is this process's to know: it is not written.
        assert_eq!(turn.cached_tokens, Some(0));
        let turn = Turn {
            cached_tokens: None,
            drafts: None,
            ..turn
        };
        assert_eq!(serde_json::from_str::<Turn>(&text).unwrap(), turn);

        // Partial traces stay partial; none at all leaves the keys out.
        let mut partial = turn.clone();
        partial.tokens.prompt_ids = None;
        let value = serde_json::to_value(&partial).unwrap();
        assert!(value.get("prompt_ids").is_none());
        assert_eq!(value["completion_ids"], json!([7]));
        assert_eq!(serde_json::from_value::<Turn>(value).unwrap(), partial);
        assert_eq!(partial.tokens.complete(), None);
        let mut bare = turn.clone();
        bare.tokens = TokenTrace::default();
        let value = serde_json::to_value(&bare).unwrap();
        for key in ["prompt_ids", "completion_ids", "logprobs"] {
            assert!(value.get(key).is_none(), "{key}");
        }
        assert_eq!(
            turn.tokens.complete(),
            Some((&[1, 2][..], &[7][..], &[-0.5][..]))
        );
    }
}
