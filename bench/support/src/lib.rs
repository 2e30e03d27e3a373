//! What the benchmarks in `bench/` share, so that each prints its machine, writes its
//! report and runs its server the same way: the machine's description read from
//! `/proc` ([`machine`]), the files a run writes and the command line it records
//! ([`report`]), a server under test spawned, awaited and stopped ([`server`]), and
//! where agentstack's cache and the llama.cpp tools are ([`paths`]); latency figures
//! and progress bars ([`stats`]).
//!
//! Not published: only the benchmark binaries use it. Errors are `anyhow`'s, as in the
//! benchmarks, so that the messages they print stay as they were.
//!
//! ```no_run
//! use agentstack_bench_support::{machine, report};
//!
//! let load_start = machine::load_average().unwrap_or_default();
//! let section = format!(
//!     "\n## example, {}\n\n- Command: `{}`; load average {load_start} at start.\n",
//!     machine::utc_now(),
//!     report::command_line(),
//! );
//! report::append_section(std::path::Path::new("bench/RESULTS.md"), &section)?;
//! # anyhow::Ok(())
//! ```

pub mod machine;
pub mod paths;
pub mod report;
pub mod server;
pub mod stats;
