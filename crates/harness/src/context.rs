//! Context policies: what of the conversation the model sees on each turn.
//!
//! - a **token budget** for prompt plus answer (`max_tokens`);
//! - what happens when the conversation outgrows it ([`Overflow`]): stop the episode,
//!   drop the oldest exchanges (rolling truncation), or have the model summarise them
//!   (compaction);
//! - whether earlier `<think>…</think>` blocks stay in the history
//!   (`keep_thinking`, "preserve thinking").
//!
//! The system prompt and the first user message (the task) are never dropped.

use agentstack_model::chat::Message;
use serde::{Deserialize, Serialize};

use crate::prompt::strip_thinking;

/// What to do when the conversation does not fit the budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Overflow {
    /// End the episode (finish reason `context`).
    #[default]
    Stop,
    /// Drop the oldest exchanges until it fits.
    Truncate,
    /// Replace the older exchanges by a summary the model writes, then truncate if it
    /// still does not fit.
    Compact,
}

impl std::str::FromStr for Overflow {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "stop" => Ok(Self::Stop),
            "truncate" => Ok(Self::Truncate),
            "compact" => Ok(Self::Compact),
            other => Err(format!(
                "unknown overflow policy `{other}`; use stop, truncate or compact"
            )),
        }
    }
}

/// The context policy of a run. Recorded with every result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContextPolicy {
    /// Most tokens of prompt plus answer per turn; `None` for the model's own limit.
    pub max_tokens: Option<usize>,
    /// What to do beyond it.
    pub overflow: Overflow,
    /// Keep earlier reasoning blocks in the history (else they are stripped).
    pub keep_thinking: bool,
}

impl Default for ContextPolicy {
    fn default() -> Self {
        Self {
            max_tokens: None,
            overflow: Overflow::Stop,
            keep_thinking: true,
        }
    }
}

/// Messages never dropped: the system prompt and the task.
pub const PROTECTED: usize = 2;

/// The history as the model is shown it: reasoning stripped from earlier assistant
/// turns unless kept.
pub fn visible(history: &[Message], policy: &ContextPolicy) -> Vec<Message> {
    history
        .iter()
        .map(|m| {
            if !policy.keep_thinking
                && m.role == "assistant"
                && let Some(text) = &m.content
            {
                let mut m = m.clone();
                m.content = Some(strip_thinking(text));
                return m;
            }
            m.clone()
        })
        .collect()
}

/// The range of the oldest whole exchange after the protected messages: an assistant
/// message and what follows it up to the next assistant message. `None` when only
/// the latest exchange is left.
pub fn oldest_exchange(history: &[Message]) -> Option<std::ops::Range<usize>> {
    let start = PROTECTED;
    let mut end = start + 1;
    while end < history.len() && history[end].role != "assistant" {
        end += 1;
    }
    // Keep the latest exchange: the model must see what it answers.
    (end < history.len()).then_some(start..end)
}

/// The exchanges that compaction summarises: all but the latest.
pub fn compactable(history: &[Message]) -> Option<std::ops::Range<usize>> {
    let last_assistant = history.iter().rposition(|m| m.role == "assistant")?;
    (last_assistant > PROTECTED).then_some(PROTECTED..last_assistant)
}

/// The prompt that asks the model to summarise `messages`.
pub fn summary_request(messages: &[Message]) -> Vec<Message> {
    let mut transcript = String::new();
    for m in messages {
        transcript.push_str(&format!(
            "{}: {}\n",
            m.role,
            m.content.as_deref().unwrap_or_default()
        ));
    }
    vec![
        Message::new(
            "system",
            "Summarise the conversation below in a few sentences: what was tried, what was learned, what remains. Write only the summary.",
        ),
        Message::new("user", transcript),
    ]
}

/// The message that stands for summarised exchanges.
pub fn summary_message(summary: &str) -> Message {
    Message::new(
        "user",
        format!("Summary of the earlier turns: {}", summary.trim()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn history() -> Vec<Message> {
        vec![
            Message::new("system", "s"),
            Message::new("user", "task"),
            Message::new("assistant", "<think>a</think>one"),
            Message::new("user", "obs 1"),
            Message::new("assistant", "two"),
            Message::new("user", "obs 2"),
        ]
    }

    #[test]
    fn exchanges_and_thinking() {
        let h = history();
        assert_eq!(oldest_exchange(&h), Some(2..4));
        assert_eq!(compactable(&h), Some(2..4));
        assert_eq!(oldest_exchange(&h[..4]), None);
        let stripped = visible(
            &h,
            &ContextPolicy {
                keep_thinking: false,
                ..Default::default()
            },
        );
        assert_eq!(stripped[2].content.as_deref(), Some("one"));
        let kept = visible(&h, &ContextPolicy::default());
        assert_eq!(kept[2].content.as_deref(), Some("<think>a</think>one"));
        assert!("squeeze".parse::<Overflow>().is_err());
    }
}
