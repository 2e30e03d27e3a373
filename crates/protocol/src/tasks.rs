//! The Task API: `GET /list_environments`, `GET /{env}/splits`, `POST /{env}/tasks`,
//! `/num_tasks`, `/task`, `/task_range`.
//!
//! Request bodies are `extra="forbid"` on the reference. An unknown environment is a
//! `404 {"detail":"unknown environment 'x'"}`, an environment without tasks a `501`,
//! an index out of range a `400 {"detail":"Invalid task index"}`.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The kind of a split.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SplitType {
    /// For training.
    Train,
    /// For validation.
    Validation,
    /// Held out for testing.
    Test,
}

/// One entry of `GET /{env}/splits`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Split {
    /// The split's name.
    pub name: String,
    /// Its kind.
    #[serde(rename = "type")]
    pub kind: SplitType,
}

/// The body of `POST /{env}/tasks` and `/num_tasks`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SplitRequest {
    /// The split's name.
    pub split: String,
}

/// The body of `POST /{env}/task`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskRequest {
    /// The split's name.
    pub split: String,
    /// The task's index; Python-style negative indices count from the end.
    pub index: i64,
}

/// The body of `POST /{env}/task_range`: Python slice bounds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskRangeRequest {
    /// The split's name.
    pub split: String,
    /// Inclusive start.
    #[serde(default)]
    pub start: Option<i64>,
    /// Exclusive stop.
    #[serde(default)]
    pub stop: Option<i64>,
}

/// The reply to `POST /{env}/tasks`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TasksResponse {
    /// The tasks.
    pub tasks: Vec<Value>,
    /// The environment's name.
    pub env_name: String,
}

/// The reply to `POST /{env}/num_tasks`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NumTasksResponse {
    /// How many tasks the split has.
    pub num_tasks: usize,
}

/// The reply to `POST /{env}/task`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskResponse {
    /// The task.
    pub task: Value,
}

/// The reply to `POST /{env}/task_range`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskRangeResponse {
    /// The tasks in the range.
    pub tasks: Vec<Value>,
}

/// Resolves a Python-style index into `0..len`, or `None` when out of range.
pub fn resolve_index(index: i64, len: usize) -> Option<usize> {
    let len = i64::try_from(len).ok()?;
    let i = if index < 0 { index + len } else { index };
    (0..len).contains(&i).then_some(i as usize)
}

/// Resolves Python slice bounds (step 1) into a range within `0..len`.
pub fn resolve_range(start: Option<i64>, stop: Option<i64>, len: usize) -> std::ops::Range<usize> {
    let n = i64::try_from(len).unwrap_or(i64::MAX);
    let clamp = |v: i64| -> i64 {
        let v = if v < 0 { v + n } else { v };
        v.clamp(0, n)
    };
    let s = start.map_or(0, clamp);
    let e = stop.map_or(n, clamp);
    (s as usize)..(e.max(s) as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_indexing() {
        assert_eq!(resolve_index(0, 3), Some(0));
        assert_eq!(resolve_index(-1, 3), Some(2));
        assert_eq!(resolve_index(3, 3), None);
        assert_eq!(resolve_index(-4, 3), None);
        assert_eq!(resolve_range(None, None, 5), 0..5);
        assert_eq!(resolve_range(Some(1), Some(-1), 5), 1..4);
        assert_eq!(resolve_range(Some(4), Some(2), 5), 4..4);
        assert_eq!(resolve_range(Some(-10), Some(100), 5), 0..5);
    }

    #[test]
    fn bodies_forbid_extra_keys() {
        assert!(serde_json::from_str::<SplitRequest>(r#"{"split":"train","x":1}"#).is_err());
        let r: TaskRangeRequest = serde_json::from_str(r#"{"split":"test","start":2}"#).unwrap();
        assert_eq!(r.stop, None);
        let s = Split {
            name: "train".into(),
            kind: SplitType::Train,
        };
        assert_eq!(
            serde_json::to_string(&s).unwrap(),
            r#"{"name":"train","type":"train"}"#
        );
    }
}
