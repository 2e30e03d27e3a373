//! The leaf every agentstack crate may import: names and one-line helpers that depend on
//! nothing, so that no crate keeps its own copy (uv's `uv-static` is the model).
//!
//! - [`env_vars`]: every environment variable agentstack reads (and the ones it sets
//!   for the programs it launches), declared once with what it means.
//! - [`packaging`]: the names packing, pushing or importing an environment never copies
//!   (`.git`, `__pycache__`, `.venv`, `target`, …), one list for the hub and `env import`.
//! - [`with_causes`]: an error and its sources as one `: `-separated line, for messages
//!   that leave the process (an HTTP body, a results file, a log line).
//!
//! ```
//! use agentstack_static::{env_vars, with_causes};
//!
//! let home = std::env::var_os(env_vars::AGENTSTACK_HOME);
//! # let _ = home;
//! let error = std::io::Error::other("disk full");
//! assert_eq!(with_causes(&error), "disk full");
//! ```

pub mod env_vars;
mod error_chain;
pub mod packaging;

pub use error_chain::with_causes;
