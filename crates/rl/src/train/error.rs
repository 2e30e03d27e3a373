//! Why training stops: one variant per kind of cause, the cause kept as the source
//! (so the CLI prints it once, as a `caused by:` line) and the message saying what
//! the trainer was doing.

use std::path::{Path, PathBuf};

/// Why training stopped.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The configuration cannot run (the message says what to change).
    #[error("{0}")]
    Config(String),
    /// A configuration value is invalid.
    #[error(transparent)]
    InvalidConfig(#[from] crate::config::ConfigError),
    /// The prompt profile does not compile.
    #[error(transparent)]
    Profile(#[from] agentstack_harness::prompt::ProfileError),
    /// The environment's task list could not be read.
    #[error("{env}: cannot read the tasks of split `{split}`")]
    Tasks {
        /// The environment.
        env: String,
        /// The split.
        split: String,
        /// What the task list said.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Reading or writing the run directory.
    #[error("cannot read or write {}", path.display())]
    Io {
        /// Which file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A JSON file of the run (a checkpoint's state, an eval run's records) is unreadable.
    #[error("cannot parse {}{}", path.display(), line.map(|n| format!(":{n}")).unwrap_or_default())]
    Json {
        /// Which file.
        path: PathBuf,
        /// The line, in a JSON-lines file.
        line: Option<usize>,
        /// What the parser said.
        #[source]
        source: serde_json::Error,
    },
    /// A model file could not be loaded.
    #[error("cannot load the {role} {}", path.display())]
    LoadModel {
        /// Which model: `model` or `teacher`.
        role: &'static str,
        /// Its file.
        path: PathBuf,
        /// Why.
        #[source]
        source: Box<agentstack_model::ModelError>,
    },
    /// The model runtime failed.
    #[error("model: {what}")]
    Model {
        /// What it was doing.
        what: &'static str,
        /// Why it failed.
        #[source]
        source: Box<agentstack_model::ModelError>,
    },
    /// A tensor operation of the learner (adapters, optimizer, loss) failed.
    #[error("model: {what}")]
    Tensor {
        /// What it was doing.
        what: &'static str,
        /// Why it failed.
        #[source]
        source: candle_core::Error,
    },
    /// Adapters or optimizer moments could not be read or written.
    #[error("cannot {action} {}", path.display())]
    Tensors {
        /// `read` or `write`.
        action: &'static str,
        /// Which file.
        path: PathBuf,
        /// Why.
        #[source]
        source: candle_core::Error,
    },
    /// A task of the trainer panicked or was cancelled.
    #[error("{what} stopped before it finished")]
    Join {
        /// Which task.
        what: &'static str,
        /// Why.
        #[source]
        source: tokio::task::JoinError,
    },
    /// An episode could not be played (the environment or the engine failed).
    #[error("rollout: an episode could not be played")]
    Episode(#[source] Box<agentstack_harness::episode::EpisodeError>),
    /// A held-out evaluation failed.
    #[error("the held-out evaluation in {} failed", dir.display())]
    Eval {
        /// The evaluation's run directory.
        dir: PathBuf,
        /// Why.
        #[source]
        source: Box<agentstack_harness::run::RunError>,
    },
    /// A model server refused the adapters, or kept failing until the wait ran out
    /// (the message holds the server's answer).
    #[error("rollout: {0}")]
    Sync(String),
    /// A model server could not be reached until the wait ran out.
    #[error(
        "rollout: {url}: still failing after {waited_s} s; sync.wait_seconds sets how long to retry"
    )]
    SyncUnreachable {
        /// The adapters endpoint.
        url: String,
        /// Seconds retried.
        waited_s: u64,
        /// The last failure.
        #[source]
        source: reqwest::Error,
    },
}

pub(super) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::Io {
        path: path.to_owned(),
        source,
    }
}

/// A learner's tensor error, with what it was doing.
pub(super) fn tensor(what: &'static str) -> impl FnOnce(candle_core::Error) -> TrainError {
    move |source| TrainError::Tensor { what, source }
}

/// Reading (`action` = `read`) or writing adapters or optimizer moments at `path`.
pub(super) fn tensors<'a>(
    action: &'static str,
    path: &'a Path,
) -> impl FnOnce(candle_core::Error) -> TrainError + 'a {
    move |source| TrainError::Tensors {
        action,
        path: path.to_owned(),
        source,
    }
}

/// A task of the trainer that did not finish.
pub(super) fn join(what: &'static str) -> impl FnOnce(tokio::task::JoinError) -> TrainError {
    move |source| TrainError::Join { what, source }
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::*;

    /// Each message leaves its cause to the source chain (which the CLI prints line by
    /// line), so the cause shows once.
    #[test]
    fn error_messages_leave_their_cause_to_the_source_chain() {
        let errors = [
            io(Path::new("/runs/r/metrics.jsonl"))(std::io::Error::other("disk on fire")),
            TrainError::Json {
                path: "/runs/r/results.jsonl".into(),
                line: Some(3),
                source: serde_json::from_str::<Value>("{").unwrap_err(),
            },
            tensor("creating the adapters")(candle_core::Error::Msg("bad shape".into())),
            tensors("read", Path::new("/c/adapter.safetensors"))(candle_core::Error::Msg(
                "truncated".into(),
            )),
        ];
        for e in errors {
            let cause = std::error::Error::source(&e).expect("a source").to_string();
            let message = e.to_string();
            assert!(!message.contains(&cause), "{message} repeats {cause}");
        }
    }
}
