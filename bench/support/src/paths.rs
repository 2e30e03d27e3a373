//! Where the benchmarks find agentstack's cache and the llama.cpp tools they compare
//! against.

use std::path::{Path, PathBuf};

use agentstack_static::env_vars;

/// Where `scripts/install-llamacpp` puts the tools, under the cache folder.
pub const DEFAULT_LLAMACPP_BIN: &str = "llama.cpp-0.3.36/bin";

/// `$AGENTSTACK_CACHE`, else `~/.cache/agentstack`.
pub fn cache_dir() -> PathBuf {
    std::env::var_os(env_vars::AGENTSTACK_CACHE)
        .map(PathBuf::from)
        .unwrap_or_else(|| home().join(".cache/agentstack"))
}

/// The llama.cpp tools folder: the flag, else `$AGENTSTACK_LLAMACPP_BIN`, else the
/// cache's.
pub fn llamacpp_bin(flag: Option<&Path>, cache: &Path) -> PathBuf {
    flag.map(Path::to_path_buf)
        .or_else(|| std::env::var_os(env_vars::AGENTSTACK_LLAMACPP_BIN).map(PathBuf::from))
        .unwrap_or_else(|| cache.join(DEFAULT_LLAMACPP_BIN))
}

fn home() -> PathBuf {
    std::env::var_os(env_vars::HOME).map_or_else(|| PathBuf::from("/root"), PathBuf::from)
}
