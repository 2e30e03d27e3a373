//! The `agentstack` command line: clap arguments ([`args`]) are resolved into settings
//! ([`settings`]) and handed to one command in [`commands`]. Domain logic lives in the
//! domain crates; this crate parses, prints and sets exit codes.
//!
//! Exit codes ([`exit`]): 0 success, 1 the user's error (bad input, flags, files or
//! configuration, a refused request, a failed check; clap's usage errors too), 2 an
//! internal error (a panic, a failure of our own state, a check that could not run).
//! `sandbox run` exits with its command's code.

pub mod args;
pub mod commands;
pub mod exit;
pub mod settings;

pub use exit::{Exit, ExitStatus, IntoUserError, UserError};

use std::io::IsTerminal;
use std::process::ExitCode;

use agentstack_static::env_vars;
use clap::Parser;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// Runs the CLI with the process arguments and returns the exit code.
pub fn main() -> ExitCode {
    // A sandbox's init process is this executable started again; it must run before
    // any thread starts (see agentstack-sandbox).
    agentstack_sandbox::run_if_init();
    let cli = match args::Cli::try_parse() {
        Ok(cli) => cli,
        // Usage errors are the user's (exit 1, not clap's 2, which is our internal
        // error); --help and --version succeed.
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                ExitStatus::Failure.into()
            } else {
                ExitStatus::Success.into()
            };
        }
    };
    init_tracing(cli.global.verbose, cli.global.quiet);
    set_compute_threads(cli.compute_threads());
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            exit::print_error(&anyhow::Error::new(e).context("could not start the async runtime"));
            return ExitStatus::Error.into();
        }
    };
    // A panic is a bug: the hook has printed it; exit 2 rather than Rust's 101.
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        runtime.block_on(commands::run(cli))
    }));
    match result {
        Ok(Ok(())) => ExitStatus::Success.into(),
        Ok(Err(exit)) => {
            if let Some(error) = exit.error {
                if is_broken_pipe(&error) {
                    return ExitStatus::Success.into();
                }
                exit::print_error(&error);
            }
            ExitCode::from(exit.code)
        }
        Err(_) => ExitStatus::Error.into(),
    }
}

fn is_broken_pipe(error: &anyhow::Error) -> bool {
    error.chain().any(|e| {
        e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

fn init_tracing(verbose: u8, quiet: bool) {
    let default = match (quiet, verbose) {
        (true, _) => "error",
        (false, 0) => "warn,agentstack=info",
        (false, 1) => "info",
        (false, _) => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env(env_vars::AGENTSTACK_LOG)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let colour = log_colour(
        std::env::var_os(env_vars::NO_COLOR).as_deref(),
        std::env::var_os(env_vars::CLICOLOR_FORCE).as_deref(),
        std::io::stderr().is_terminal(),
    );
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colour)
        .finish()
        .with(tracing_subscriber::filter::filter_fn(holds_no_secret))
        .try_init();
}

/// Whether an event may be logged, whatever the filter asks for. tungstenite logs a
/// WebSocket client's whole handshake request at TRACE, and with it the
/// `Authorization` header that carries an API key (`env run`, `eval` against a server
/// started with `--api-key`): those events are never logged.
fn holds_no_secret(metadata: &tracing::Metadata<'_>) -> bool {
    !(*metadata.level() == tracing::Level::TRACE
        && metadata.target().starts_with("tungstenite::handshake"))
}

/// Whether log lines are coloured: only on a terminal, so files and pipes get plain
/// text; `NO_COLOR` (set, not empty) turns colour off everywhere, and otherwise
/// `CLICOLOR_FORCE` (set, not `0`) turns it on everywhere.
fn log_colour(
    no_color: Option<&std::ffi::OsStr>,
    force: Option<&std::ffi::OsStr>,
    stderr_is_terminal: bool,
) -> bool {
    if no_color.is_some_and(|v| !v.is_empty()) {
        return false;
    }
    if force.is_some_and(|v| !v.is_empty() && v != "0") {
        return true;
    }
    stderr_is_terminal
}

/// Tells the compute libraries how many threads to use: rayon's pool (the model
/// kernels, candle's matrix products) `threads`, when the command has the flag. Candle's
/// element-wise ops run on a pool of their own whose idle workers spin; beside rayon's
/// threads they took most of a core from a 2-thread prefill (SmolLM2 Q4_0: 1203 tok/s
/// with them, 1750 without), so that pool gets no workers of its own unless
/// `CANDLE_NUM_THREADS` asks for some. Both libraries read the environment once, so it
/// is set there.
fn set_compute_threads(threads: Option<usize>) {
    let candle_asked =
        std::env::var_os(env_vars::CANDLE_NUM_THREADS).is_some_and(|v| !v.is_empty());
    #[expect(
        unsafe_code,
        reason = "setting the environment for the compute libraries' thread pools"
    )]
    // SAFETY: called from `main` before the async runtime or any other thread starts,
    // so nothing reads the environment concurrently.
    unsafe {
        if let Some(threads) = threads {
            std::env::set_var(env_vars::RAYON_NUM_THREADS, threads.max(1).to_string());
        }
        if !candle_asked {
            std::env::set_var(env_vars::CANDLE_NUM_THREADS, "1");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::ffi::OsStr;

    use super::log_colour;

    #[test]
    fn colour_only_on_a_terminal_unless_asked() {
        let set = |v: &'static str| Some(OsStr::new(v));
        assert!(log_colour(None, None, true));
        assert!(!log_colour(None, None, false));
        assert!(!log_colour(set("1"), None, true));
        assert!(
            log_colour(set(""), None, true),
            "an empty NO_COLOR is unset"
        );
        assert!(log_colour(None, set("1"), false));
        assert!(!log_colour(None, set("0"), false));
        assert!(!log_colour(set("1"), set("1"), true), "NO_COLOR wins");
    }
}
