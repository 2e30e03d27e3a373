//! Every environment variable agentstack reads (and the ones it sets for the programs
//! it launches), declared once.
//!
//! Each is a const whose value is its own name, with a doc comment saying what it does
//! and its default. Code reads a variable through its const
//! (`std::env::var(env_vars::AGENTSTACK_HOME)`), never through a string literal, so this
//! file is the whole list; [`ALL`] lists them for tools and tests.
//!
//! ```
//! use agentstack_static::env_vars;
//! assert_eq!(env_vars::AGENTSTACK_HOME, "AGENTSTACK_HOME");
//! assert!(env_vars::ALL.contains(&("AGENTSTACK_HOME", "AGENTSTACK_HOME")));
//! ```

/// Declares one const per `NAME = "NAME";` line, and [`ALL`] listing them, so the test
/// below can check every value against its name.
macro_rules! env_vars {
    ($( $(#[$doc:meta])* $name:ident = $value:literal; )*) => {
        $( $(#[$doc])* pub const $name: &str = $value; )*

        /// Every variable of this module, as (the const's name, the variable's name), in
        /// the order they are declared.
        pub const ALL: &[(&str, &str)] = &[$( (stringify!($name), $value) ),*];
    };
}

env_vars! {
    // ----- agentstack's settings -----

    /// Log filter in `tracing` syntax, e.g. `debug` or `agentstack_env=trace`.
    AGENTSTACK_LOG = "AGENTSTACK_LOG";

    /// The Python interpreter used to serve Python OpenEnv packages and to run `pip`
    /// for `pip:` model references (default `python3`).
    AGENTSTACK_PYTHON = "AGENTSTACK_PYTHON";

    /// The data directory (models, hub database, runs); default
    /// `$XDG_DATA_HOME/agentstack` or `~/.local/share/agentstack`.
    AGENTSTACK_HOME = "AGENTSTACK_HOME";

    /// The hub the `hub` commands talk to (default: the URL saved by `hub login`, then
    /// `http://127.0.0.1:8700`).
    AGENTSTACK_HUB_URL = "AGENTSTACK_HUB_URL";

    /// The API token sent to the hub (default: the one saved by `hub login`).
    AGENTSTACK_HUB_TOKEN = "AGENTSTACK_HUB_TOKEN";

    /// The database `hub serve` keeps its metadata in (`sqlite:///…` or `postgres://…`).
    AGENTSTACK_HUB_DATABASE_URL = "AGENTSTACK_HUB_DATABASE_URL";

    /// API keys `model serve` and `env serve` ask for (`Authorization: Bearer KEY` on
    /// every route but `/health`; several, comma-separated). Clients send the first: the
    /// trainer's adapter pushes (unless `[sync] api_key_env` names another variable),
    /// `eval --model URL` (before `OPENAI_API_KEY`), and whatever opens an environment
    /// by URL (`env run`, `env validate`, `eval --env URL`, `train` with an env URL).
    AGENTSTACK_API_KEY = "AGENTSTACK_API_KEY";

    /// The Ray Jobs API `launch --infra ray` submits to (default
    /// `http://127.0.0.1:8265`).
    AGENTSTACK_RAY_ADDRESS = "AGENTSTACK_RAY_ADDRESS";

    /// CPUs local launches may hold at once (default: the machine's); a component's
    /// `resources.cpus` counts against it, and a higher `priority` preempts a lower one.
    AGENTSTACK_LOCAL_CPUS = "AGENTSTACK_LOCAL_CPUS";

    /// The address a launch's `service` load balancers listen on (default `127.0.0.1`;
    /// `0.0.0.0` serves other machines: the replicas' API keys then matter).
    AGENTSTACK_SERVICE_HOST = "AGENTSTACK_SERVICE_HOST";

    /// The container image `launch --infra k8s` runs (it must hold bash and the
    /// programs).
    AGENTSTACK_K8S_IMAGE = "AGENTSTACK_K8S_IMAGE";

    /// The namespace `launch --infra k8s` uses (default: the context's, else `default`).
    AGENTSTACK_K8S_NAMESPACE = "AGENTSTACK_K8S_NAMESPACE";

    /// The highest instruction set the model kernels use: `scalar`, `avx2` or `avx512`
    /// (AVX-512 VNNI without AMX and GFNI) cap them; unset or anything else uses the best
    /// the CPU has (AMX for prefill where the process may use it, GFNI for Q3_K,
    /// AVX-512 VNNI, else AVX2, else scalar). Read once per process.
    AGENTSTACK_KERNELS = "AGENTSTACK_KERNELS";

    /// Whether model weights go on huge pages: `off`/`0`/`false` turns them off; unset,
    /// empty, `on`/`1`/`true` keep them on (anything else warns and keeps them on).
    /// Read once per process.
    AGENTSTACK_HUGE_PAGES = "AGENTSTACK_HUGE_PAGES";

    /// How a decode reads a model's weights: `streams` (four groups of rows at a time,
    /// prefetched in software), `sequential` (one after another, the K-quants left to
    /// the hardware prefetcher) or `prefetched` (one after another, every type
    /// prefetched in software); unset or empty picks by the CPU (AMD Zen 5 and newer:
    /// prefetched, older AMD: sequential, else streams); anything else warns and does
    /// the same. Only speed depends on it (the
    /// outputs are the same bits). Read once per process.
    AGENTSTACK_DECODE_READ = "AGENTSTACK_DECODE_READ";

    /// The repack cache, where weights repacked for the kernels are kept so later loads
    /// of the same GGUF file map them instead of repacking: `off`/`0`/`false` turns it
    /// off; a path puts it there; unset, empty or `on` use
    /// `$XDG_CACHE_HOME/agentstack/repacked` (default `~/.cache/agentstack/repacked`).
    AGENTSTACK_REPACK_CACHE = "AGENTSTACK_REPACK_CACHE";

    /// The repack cache's bound in GiB (default 32): the least recently used entries go
    /// first.
    AGENTSTACK_REPACK_CACHE_MAX_GIB = "AGENTSTACK_REPACK_CACHE_MAX_GIB";

    /// Whether a forward pass's threads spin between its parallel regions (as
    /// llama.cpp's do): `off`/`0`/`false` lets them sleep (rayon's pool), for a machine
    /// shared with other work; unset, empty, `on`/`1`/`true` spin (anything else warns
    /// and spins). Read once per process.
    AGENTSTACK_SPIN = "AGENTSTACK_SPIN";

    /// The program started as the sandbox's init process, when it is not the current
    /// executable (tests, or a library embedding the sandbox in another binary). The
    /// program must call `agentstack_sandbox::run_if_init` first thing in `main`.
    AGENTSTACK_SANDBOX_INIT = "AGENTSTACK_SANDBOX_INIT";

    /// A directory of tasks (the documented layout) the built-in `coding` environment
    /// serves instead of its own set.
    AGENTSTACK_CODING_TASKS = "AGENTSTACK_CODING_TASKS";

    // ----- set by `launch` for each program it starts (service discovery) -----
    // `AGENTSTACK_<COMPONENT>_ADDRS` too, one per component: see
    // `agentstack_compute::discovery::addrs_var`.

    /// Set by `launch`: the instance's own component.
    AGENTSTACK_COMPONENT = "AGENTSTACK_COMPONENT";

    /// Set by `launch`: the instance's replica index, from 0.
    AGENTSTACK_REPLICA = "AGENTSTACK_REPLICA";

    /// Set by `launch`: the port the instance should listen on.
    AGENTSTACK_PORT = "AGENTSTACK_PORT";

    // ----- other programs' variables, read with their usual meaning -----

    /// Set and not empty: no colour in log lines, even with `CLICOLOR_FORCE`
    /// (no-color.org).
    NO_COLOR = "NO_COLOR";

    /// Set and not `0`: colour in log lines even when stderr is not a terminal (unless
    /// `NO_COLOR` is set).
    CLICOLOR_FORCE = "CLICOLOR_FORCE";

    /// The Hugging Face endpoint `hf:` model references download from (empty or unset:
    /// the public one).
    HF_ENDPOINT = "HF_ENDPOINT";

    /// The Hugging Face token sent with `hf:` downloads (empty or unset: none).
    HF_TOKEN = "HF_TOKEN";

    /// The API key `eval --model URL` sends when `AGENTSTACK_API_KEY` is unset or empty.
    OPENAI_API_KEY = "OPENAI_API_KEY";

    /// The kubeconfig files `launch --infra k8s` reads (the first of the list); default
    /// `~/.kube/config`.
    KUBECONFIG = "KUBECONFIG";

    /// The user's home directory, for `~` defaults.
    HOME = "HOME";

    /// Where user caches go (XDG); the repack cache's default folder is its
    /// `agentstack/repacked` when set, else `~/.cache/agentstack/repacked`.
    XDG_CACHE_HOME = "XDG_CACHE_HOME";

    /// Where user data goes (XDG); the default data directory is its `agentstack`
    /// folder when `AGENTSTACK_HOME` is unset.
    XDG_DATA_HOME = "XDG_DATA_HOME";

    /// Kept, after agentstack's own entries, in the Python path of the environment
    /// servers it starts.
    PYTHONPATH = "PYTHONPATH";

    // ----- set for the programs and libraries agentstack runs -----

    /// Set by the CLI, before any thread starts, to its thread count: rayon's global
    /// pool (the model kernels) reads it.
    RAYON_NUM_THREADS = "RAYON_NUM_THREADS";

    /// Set by the CLI to 1 unless already set: the workers of candle's element-wise
    /// pool (its barrier pool; candle's matrix products use rayon's) spin while idle
    /// and would take time from rayon's threads.
    CANDLE_NUM_THREADS = "CANDLE_NUM_THREADS";

    /// Set for a foreign environment server's command: the port it should listen on
    /// (also its `{port}` placeholder).
    PORT = "PORT";

    /// Set for a foreign environment server's command: the address it should listen on
    /// (also its `{host}` placeholder).
    HOST = "HOST";

    /// Set to `1` on the Python `env import` runs to probe a project, so the probe
    /// leaves no `__pycache__` in the user's directory.
    PYTHONDONTWRITEBYTECODE = "PYTHONDONTWRITEBYTECODE";

    // ----- tests and benchmarks -----

    /// Tests and benchmarks: agentstack's cache folder, where `scripts/fetch-model` and
    /// the peer installers put models, llama.cpp and Python venvs (default
    /// `~/.cache/agentstack`).
    AGENTSTACK_CACHE = "AGENTSTACK_CACHE";

    /// Tests and benchmarks: the GGUF model file to run (default: SmolLM2-135M-Instruct
    /// Q4_1 in the cache's `models/`).
    AGENTSTACK_TEST_MODEL = "AGENTSTACK_TEST_MODEL";

    /// Tests and benchmarks: a folder holding the llama.cpp tools (default
    /// `$AGENTSTACK_CACHE/llama.cpp-0.3.36/bin`, which `scripts/install-llamacpp`
    /// builds).
    AGENTSTACK_LLAMACPP_BIN = "AGENTSTACK_LLAMACPP_BIN";

    /// Tests and benchmarks: a PostgreSQL server the hub's PostgreSQL tests create
    /// their databases on (`scripts/start-postgres` starts one).
    AGENTSTACK_TEST_POSTGRES_URL = "AGENTSTACK_TEST_POSTGRES_URL";

    /// Tests: the image the Kubernetes tests run (default `bash:5`).
    AGENTSTACK_TEST_K8S_IMAGE = "AGENTSTACK_TEST_K8S_IMAGE";

    /// Tests: the Python of the venv with `openenv` 0.10.0 (default: the cache's
    /// `venv-openenv-0.10.0`, which `scripts/install-peers` builds).
    AGENTSTACK_OPENENV_PYTHON = "AGENTSTACK_OPENENV_PYTHON";

    /// Tests: the Python of the venv with `openenv-core` 0.3.0 (default: the cache's
    /// `venv-openenv-core-0.3.0`).
    AGENTSTACK_OPENENV030_PYTHON = "AGENTSTACK_OPENENV030_PYTHON";

    /// Tests: the Python of the venv with the `openai` client (default: the cache's
    /// `venv-openai-3.57.0`).
    AGENTSTACK_OPENAI_PYTHON = "AGENTSTACK_OPENAI_PYTHON";

    /// Tests: the Python of the venv with `verifiers` (default: the cache's
    /// `venv-verifiers-0.3.1`).
    AGENTSTACK_VERIFIERS_PYTHON = "AGENTSTACK_VERIFIERS_PYTHON";
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::ALL;

    #[test]
    fn every_value_is_its_name() {
        for (name, value) in ALL {
            assert_eq!(name, value, "env_vars::{name} reads another variable");
        }
    }

    #[test]
    fn no_variable_is_declared_twice() {
        let mut seen = BTreeSet::new();
        for (_, value) in ALL {
            assert!(seen.insert(value), "{value} is declared twice");
        }
    }

    #[test]
    fn names_are_portable() {
        for (_, value) in ALL {
            assert!(
                !value.is_empty()
                    && !value.starts_with(|c: char| c.is_ascii_digit())
                    && value
                        .chars()
                        .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'),
                "{value} is not a portable variable name (A-Z, 0-9, _)"
            );
        }
    }
}
