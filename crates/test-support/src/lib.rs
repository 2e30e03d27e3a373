//! What the workspace's tests share, so that no test binary keeps its own copy and none
//! borrows another's file with `#[path]` (uv's `uv-test` is the model). Used only as a
//! dev-dependency; never published.
//!
//! - [`peers`]: where `scripts/install-peers` put things: the cache folder, the SmolLM2
//!   test model, the llama.cpp tools, the Python venvs. A missing peer fails the test
//!   with a hint (it does not skip), so an unprovisioned CI run cannot pass silently.
//! - [`ports`]: free loopback ports, for servers that must be told their port.
//! - [`processes`]: child processes with every wait bounded, and servers stopped when
//!   their guard drops.
//! - [`cli`]: the `agentstack` binary run in a temporary home, its exit code and output
//!   captured for assertions and `insta` snapshots.
//!
//! ```no_run
//! use agentstack_test_support::cli::{agentstack, snapshot};
//!
//! let out = agentstack(&["env", "list"]);
//! assert_eq!(out.code, 0, "{}", snapshot(&out));
//! ```

pub mod cli;
pub mod peers;
pub mod ports;
pub mod processes;
