//! Task lists served by the Task API.

use std::collections::BTreeMap;

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

/// A task list held in memory: what a client read from a server's Task API.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TaskList {
    splits: Vec<Split>,
    tasks: BTreeMap<String, Vec<Value>>,
}

impl TaskList {
    /// An empty list.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a split and its tasks (replacing a split of the same name).
    pub fn insert(&mut self, split: Split, tasks: Vec<Value>) {
        self.splits.retain(|s| s.name != split.name);
        self.tasks.insert(split.name.clone(), tasks);
        self.splits.push(split);
    }
}

impl TaskSource for TaskList {
    fn splits(&self) -> Vec<Split> {
        self.splits.clone()
    }

    fn num_tasks(&self, split: &str) -> Result<usize, TaskError> {
        self.tasks
            .get(split)
            .map(Vec::len)
            .ok_or_else(|| self.unknown_split(split))
    }

    fn task(&self, split: &str, index: usize) -> Result<Value, TaskError> {
        let tasks = self
            .tasks
            .get(split)
            .ok_or_else(|| self.unknown_split(split))?;
        tasks.get(index).cloned().ok_or(TaskError::InvalidIndex)
    }
}
