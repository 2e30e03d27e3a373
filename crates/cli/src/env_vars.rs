//! Every environment variable agentstack reads, declared once.

/// Log filter in `tracing` syntax, e.g. `debug` or `agentstack_env=trace`.
pub const AGENTSTACK_LOG: &str = "AGENTSTACK_LOG";

/// The Python interpreter used to serve Python OpenEnv packages (default `python3`).
pub const AGENTSTACK_PYTHON: &str = "AGENTSTACK_PYTHON";

/// The data directory (models, hub database, runs); default `$XDG_DATA_HOME/agentstack`
/// or `~/.local/share/agentstack`.
pub const AGENTSTACK_HOME: &str = "AGENTSTACK_HOME";

/// The hub the `hub` commands talk to (default: the URL saved by `hub login`, then
/// `http://127.0.0.1:8700`).
pub const AGENTSTACK_HUB_URL: &str = "AGENTSTACK_HUB_URL";

/// The API token sent to the hub (default: the one saved by `hub login`).
pub const AGENTSTACK_HUB_TOKEN: &str = "AGENTSTACK_HUB_TOKEN";

/// The database `hub serve` keeps its metadata in (`sqlite:///…` or `postgres://…`).
pub const AGENTSTACK_HUB_DATABASE_URL: &str = "AGENTSTACK_HUB_DATABASE_URL";

/// API keys `model serve` and `env serve` ask for (`Authorization: Bearer KEY` on every
/// route but `/health`; several, comma-separated). Clients send the first: the
/// trainer's adapter pushes (unless `[sync] api_key_env` names another variable),
/// `eval --model URL` (before `OPENAI_API_KEY`), and whatever opens an environment by
/// URL (`env run`, `env validate`, `eval --env URL`, `train` with an env URL).
pub const AGENTSTACK_API_KEY: &str = "AGENTSTACK_API_KEY";

/// The Ray Jobs API `launch --infra ray` submits to (default `http://127.0.0.1:8265`).
pub const AGENTSTACK_RAY_ADDRESS: &str = "AGENTSTACK_RAY_ADDRESS";

/// CPUs local launches may hold at once (default: the machine's); a component's
/// `resources.cpus` counts against it, and a higher `priority` preempts a lower one.
pub const AGENTSTACK_LOCAL_CPUS: &str = "AGENTSTACK_LOCAL_CPUS";

/// The container image `launch --infra k8s` runs (it must hold bash and the programs).
pub const AGENTSTACK_K8S_IMAGE: &str = "AGENTSTACK_K8S_IMAGE";

/// The namespace `launch --infra k8s` uses (default: the context's, else `default`).
pub const AGENTSTACK_K8S_NAMESPACE: &str = "AGENTSTACK_K8S_NAMESPACE";

/// Set and not empty: no colour in log lines, even with `CLICOLOR_FORCE` (no-color.org).
pub const NO_COLOR: &str = "NO_COLOR";

/// Set and not `0`: colour in log lines even when stderr is not a terminal (unless
/// `NO_COLOR` is set).
pub const CLICOLOR_FORCE: &str = "CLICOLOR_FORCE";
