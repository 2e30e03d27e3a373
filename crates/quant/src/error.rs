//! The errors of this crate.

use std::path::PathBuf;

/// Something went wrong reading, writing, quantizing or measuring a model.
#[derive(Debug, thiserror::Error)]
pub enum QuantError {
    /// A file could not be opened, read or written.
    #[error("cannot access {}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A GGUF file breaks a rule llama.cpp enforces (the message names the rule).
    #[error("{}: not a valid GGUF file: {reason}", path.display())]
    BadGguf {
        /// The file.
        path: PathBuf,
        /// The rule broken, and where.
        reason: String,
    },
    /// An importance-matrix file is malformed.
    #[error("{}: not a valid importance matrix: {reason}", path.display())]
    BadImatrix {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A tensor cannot be quantized to the type asked for.
    #[error("tensor `{name}`: {reason}")]
    Unquantizable {
        /// The tensor.
        name: String,
        /// Why (row length, unknown type, …).
        reason: String,
    },
    /// The caller asked for something impossible (the message says how to fix it).
    #[error("{0}")]
    Invalid(String),
    /// The model runtime failed.
    #[error(transparent)]
    Model(#[from] agentstack_model::ModelError),
    /// A tensor operation failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// This crate's result.
pub type Result<T, E = QuantError> = std::result::Result<T, E>;
