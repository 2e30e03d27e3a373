//! `agentstack sandbox ...`

pub mod check;
pub mod run;

use agentstack_sandbox::{Isolation, SandboxConfig};

/// The configuration for one command-line run: no warm pool (one run), one at a time.
fn config(unsafe_no_isolation: bool, read_only: Vec<std::path::PathBuf>) -> SandboxConfig {
    SandboxConfig {
        isolation: if unsafe_no_isolation {
            Isolation::UnsafeNone
        } else {
            Isolation::Namespaces
        },
        warm: 0,
        max_concurrent: 1,
        read_only,
        ..SandboxConfig::default()
    }
}
