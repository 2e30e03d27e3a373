//! Where the peers that `scripts/install-peers` provides are: its cache folder, the
//! SmolLM2 test model (`scripts/fetch-model`), the llama.cpp tools
//! (`scripts/install-llamacpp`) and the Python venvs.
//!
//! Each place can be moved with an environment variable. One rule for all of them:
//! **a variable set to the empty string counts as unset** (the default is used), so
//! `AGENTSTACK_TEST_MODEL= cargo test` and a CI job that exports an empty value behave
//! like no variable at all.
//!
//! What is looked up must exist: a missing file fails the test with a `hint:` that says
//! which script provides it. Tests that need a peer are `#[ignore]`d and CI runs them,
//! so an unprovisioned run fails instead of passing silently.

use std::ffi::OsString;
use std::path::PathBuf;

use agentstack_static::env_vars;

/// The test model's file name under the cache's `models/`.
pub const TEST_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Where `scripts/install-llamacpp` puts the tools, under the cache folder.
pub const LLAMACPP_BIN_DIR: &str = "llama.cpp-0.3.36/bin";

/// The variable `name`, `None` when unset or empty.
fn var(name: &str) -> Option<OsString> {
    set(std::env::var_os(name))
}

/// A variable's value, with the empty string read as unset.
fn set(value: Option<OsString>) -> Option<OsString> {
    value.filter(|value| !value.is_empty())
}

/// `path`, which must be a file that `script` provides.
fn existing(path: PathBuf, from: &str, hint: &str) -> PathBuf {
    assert!(
        path.is_file(),
        "{} is missing (from {from} or its default)\nhint: {hint}",
        path.display()
    );
    path
}

/// `$AGENTSTACK_CACHE`, else `~/.cache/agentstack`.
pub fn cache_dir() -> PathBuf {
    match var(env_vars::AGENTSTACK_CACHE) {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(var(env_vars::HOME).expect("HOME is set")).join(".cache/agentstack"),
    }
}

/// The SmolLM2-135M-Instruct Q4_1 test model: `$AGENTSTACK_TEST_MODEL`, else the file in
/// the cache. Fails (does not skip) when it is missing.
pub fn test_model() -> PathBuf {
    let path = match var(env_vars::AGENTSTACK_TEST_MODEL) {
        Some(path) => PathBuf::from(path),
        None => cache_dir().join("models").join(TEST_MODEL_FILE),
    };
    existing(
        path,
        env_vars::AGENTSTACK_TEST_MODEL,
        "run scripts/fetch-model",
    )
}

/// The llama.cpp tool `tool` (`llama-server`, `llama-quantize`, ...):
/// `$AGENTSTACK_LLAMACPP_BIN/<tool>`, else the cache's. Fails when it is missing.
pub fn llama_bin(tool: &str) -> PathBuf {
    let dir = match var(env_vars::AGENTSTACK_LLAMACPP_BIN) {
        Some(dir) => PathBuf::from(dir),
        None => cache_dir().join(LLAMACPP_BIN_DIR),
    };
    existing(
        dir.join(tool),
        env_vars::AGENTSTACK_LLAMACPP_BIN,
        "run scripts/install-llamacpp",
    )
}

/// A peer's Python: `$variable`, else `<cache>/<venv>/bin/python` (the venvs
/// `scripts/install-peers` makes). Fails when it is missing.
pub fn peer_python(variable: &str, venv: &str) -> PathBuf {
    let path = match var(variable) {
        Some(path) => PathBuf::from(path),
        None => cache_dir().join(venv).join("bin/python"),
    };
    existing(
        path,
        variable,
        "run scripts/install-peers (it creates the Python venvs under \
         ${AGENTSTACK_CACHE:-~/.cache/agentstack}), or point the variable at a venv's bin/python",
    )
}

/// Python with `openenv` 0.10.0: `$AGENTSTACK_OPENENV_PYTHON`, else the cache's venv.
pub fn openenv_python() -> PathBuf {
    peer_python(env_vars::AGENTSTACK_OPENENV_PYTHON, "venv-openenv-0.10.0")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_variable_counts_as_unset() {
        assert_eq!(set(None), None);
        assert_eq!(set(Some(OsString::new())), None);
        assert_eq!(set(Some("m.gguf".into())), Some("m.gguf".into()));
    }

    #[test]
    #[should_panic(expected = "hint: run scripts/install-peers")]
    fn a_missing_peer_fails_with_a_hint() {
        peer_python("AGENTSTACK_TEST_SUPPORT_NEVER_SET", "no-such-venv");
    }
}
