//! The agent harness: the loop that connects a model to an environment, and
//! evaluation runs on top of it.
//!
//! - [`model`]: the model side (in-process engine or any OpenAI-compatible URL);
//! - [`env`](mod@env): the environment side (in process, or any OpenEnv server);
//! - [`prompt`]: observations to messages, replies to actions;
//! - [`context`]: context policies (token budget, truncation, compaction, thinking);
//! - [`episode`]: one episode of the loop, recorded with token ids and logprobs;
//! - [`reference`](mod@reference): what an `--env` or `--model` reference names (URL, built-in,
//!   package directory, `hub:` package, command line; URL or local model);
//! - [`run`]: evaluation runs written to `runs/<id>/`, resumable;
//! - [`compare`]: tables and charts of several runs;
//! - [`stats`]: mean, standard error, confidence interval, pass@k.
//!
//! The RL trainer plays its rollouts through [`episode::play`].

pub mod compare;
pub mod context;
pub mod env;
pub mod episode;
pub mod leaderboard;
pub mod model;
pub mod prompt;
pub mod reference;
pub mod run;
pub mod stats;

pub use context::{ContextPolicy, Overflow};
pub use env::EnvHandle;
pub use episode::{Episode, LoopConfig};
pub use model::{ModelClient, Sampling};
pub use prompt::Profile;
pub use run::{EvalConfig, Run, Summary};
