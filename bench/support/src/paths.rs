//! Where the benchmarks find agentstack's cache and the llama.cpp tools they compare
//! against.

use std::path::{Path, PathBuf};

use agentstack_static::env_vars;

/// Where `scripts/install-llamacpp` puts the tools, under the cache folder.
pub const DEFAULT_LLAMACPP_BIN: &str = "llama.cpp-0.3.36/bin";

/// A variable's value, unless it is unset or empty (an empty variable is unset, as
/// everywhere in agentstack).
fn var(name: &str) -> Option<PathBuf> {
    std::env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// `$AGENTSTACK_CACHE`, else `~/.cache/agentstack`.
pub fn cache_dir() -> PathBuf {
    var(env_vars::AGENTSTACK_CACHE).unwrap_or_else(|| home().join(".cache/agentstack"))
}

/// The llama.cpp tools folder: the flag, else `$AGENTSTACK_LLAMACPP_BIN`, else the
/// cache's.
pub fn llamacpp_bin(flag: Option<&Path>, cache: &Path) -> PathBuf {
    flag.map(Path::to_path_buf)
        .or_else(|| var(env_vars::AGENTSTACK_LLAMACPP_BIN))
        .unwrap_or_else(|| cache.join(DEFAULT_LLAMACPP_BIN))
}

fn home() -> PathBuf {
    var(env_vars::HOME).unwrap_or_else(|| PathBuf::from("/root"))
}
