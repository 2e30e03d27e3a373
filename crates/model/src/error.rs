//! The errors of this crate.

use std::path::PathBuf;

/// Something went wrong loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A model file could not be opened or read.
    #[error("cannot read {}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A file is not a GGUF file this runtime can read.
    #[error("{} is not a readable GGUF file", path.display())]
    Gguf {
        /// The file.
        path: PathBuf,
        /// What the reader said.
        #[source]
        source: candle_core::Error,
    },
    /// A metadata key the model needs is absent.
    #[error("the model file has no metadata key `{key}`")]
    MissingMetadata {
        /// The key.
        key: String,
    },
    /// A metadata key has a value of the wrong kind or out of range.
    #[error("metadata key `{key}` is invalid: {reason}")]
    BadMetadata {
        /// The key.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The file's architecture is not one this runtime implements.
    #[error("architecture `{0}` is not supported (supported: llama, qwen2, qwen3)")]
    UnsupportedArchitecture(String),
    /// A weight tensor the architecture needs is absent or has the wrong shape.
    #[error("weight `{name}`: {reason}")]
    BadTensor {
        /// The tensor's name in the file.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// The tokenizer could not be built or used.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template could not be compiled or rendered.
    #[error("chat template: {0}")]
    Template(String),
    /// A request is invalid (the message says which field and how to fix it).
    #[error("{0}")]
    InvalidRequest(String),
    /// A sequence would exceed the model's context window.
    #[error(
        "{tokens} tokens exceed the context window of {context} tokens; shorten the prompt or lower max_tokens"
    )]
    ContextOverflow {
        /// Tokens the request needs (prompt plus requested output).
        tokens: usize,
        /// The model's context window.
        context: usize,
    },
    /// The tensor library failed.
    #[error("tensor computation failed")]
    Candle(#[from] candle_core::Error),
    /// A download failed.
    #[error("download of {url} failed: {reason}")]
    Download {
        /// What was fetched.
        url: String,
        /// Why it failed.
        reason: String,
    },
}

/// The result type of this crate.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;
