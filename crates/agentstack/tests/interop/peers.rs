//! Where the peers that scripts/install-peers provides are: its cache folder and the
//! SmolLM2 test model. Shared by the integration tests that need them.

use std::path::PathBuf;

/// `$AGENTSTACK_CACHE`, else `~/.cache/agentstack`.
pub fn cache_dir() -> PathBuf {
    match std::env::var_os("AGENTSTACK_CACHE") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => {
            PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache/agentstack")
        }
    }
}

/// `$AGENTSTACK_TEST_MODEL`, else the SmolLM2 file in the cache. Fails (does not skip)
/// when it is missing, so an unprovisioned CI run cannot pass silently.
pub fn test_model() -> PathBuf {
    let path = match std::env::var_os("AGENTSTACK_TEST_MODEL") {
        Some(path) if !path.is_empty() => PathBuf::from(path),
        _ => cache_dir().join("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    };
    assert!(
        path.is_file(),
        "{} is missing\nhint: run scripts/fetch-model",
        path.display()
    );
    path
}
