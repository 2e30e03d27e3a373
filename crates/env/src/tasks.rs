//! Task lists served by the Task API.

use agentstack_protocol::tasks::Split;
use serde_json::Value;

/// Why a task request failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TaskError {
    /// The split does not exist.
    #[error("unknown split '{split}'; this environment has: {known}")]
    UnknownSplit {
        /// The split asked for.
        split: String,
        /// The splits that exist, comma-separated.
        known: String,
    },
    /// The index is outside the split.
    #[error("Invalid task index")]
    InvalidIndex,
}

/// A fixed or generated list of tasks, grouped in splits.
pub trait TaskSource: Send + Sync {
    /// The splits, e.g. `train` and `test`.
    fn splits(&self) -> Vec<Split>;
    /// How many tasks `split` has.
    fn num_tasks(&self, split: &str) -> Result<usize, TaskError>;
    /// Task `index` of `split` (`0..num_tasks`).
    fn task(&self, split: &str, index: usize) -> Result<Value, TaskError>;

    /// Says which splits exist, for errors.
    fn unknown_split(&self, split: &str) -> TaskError {
        TaskError::UnknownSplit {
            split: split.to_owned(),
            known: self
                .splits()
                .iter()
                .map(|s| s.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        }
    }
}
