//! The real `agentstack` binary, run in a temporary home with its output captured: the
//! runner every CLI test uses, and the text `insta` snapshots of it are made of.
//!
//! The home is clean: `HOME` and `AGENTSTACK_HOME` (its `data/`) point into it, no
//! `AGENTSTACK_LOG` from the developer's shell, and `NO_COLOR`, so the output is the
//! same on every machine.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};

use agentstack_static::env_vars;

use crate::processes::Finished;

/// How a run of the binary ended, and what it printed.
#[derive(Debug, Clone)]
pub struct Output {
    /// The exit code (-1 when a signal ended it).
    pub code: i32,
    /// Everything on stdout.
    pub stdout: String,
    /// Everything on stderr.
    pub stderr: String,
}

impl Output {
    /// Runs `command` to its end and captures its output.
    pub fn of(command: &mut Command) -> Self {
        let out = command
            .output()
            .unwrap_or_else(|e| panic!("could not run {:?}: {e}", command.get_program()));
        Self {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }
}

impl From<Finished> for Output {
    /// A bounded run's result; one killed for time (or by a signal) has code -1.
    fn from(done: Finished) -> Self {
        Self {
            code: done.status.and_then(|s| s.code()).unwrap_or(-1),
            stdout: done.stdout,
            stderr: done.stderr,
        }
    }
}

/// The `agentstack` binary cargo built for these tests.
pub fn bin() -> PathBuf {
    assert_cmd::cargo::cargo_bin("agentstack")
}

/// The binary with `home` as its home (its data directory is `home/data`), no
/// `AGENTSTACK_LOG` and no colours; add arguments and run it with [`Output::of`].
pub fn command_in(home: &Path) -> Command {
    let mut command = Command::new(bin());
    command
        .env(env_vars::HOME, home)
        .env(env_vars::AGENTSTACK_HOME, home.join("data"))
        .env_remove(env_vars::AGENTSTACK_LOG)
        .env(env_vars::NO_COLOR, "1");
    command
}

/// Runs the binary with `args` in a new temporary home.
pub fn agentstack(args: &[&str]) -> Output {
    let home = tempfile::tempdir().expect("a temporary home");
    agentstack_in(home.path(), args)
}

/// Runs the binary with `args` and `home` as its home.
pub fn agentstack_in(home: &Path, args: &[&str]) -> Output {
    Output::of(command_in(home).args(args))
}

/// The text a snapshot holds: exit code, stdout, stderr.
pub fn snapshot(out: &Output) -> String {
    format!(
        "exit: {}\n--- stdout\n{}--- stderr\n{}",
        out.code, out.stdout, out.stderr
    )
}

/// `insta` filters (regex, replacement) for what changes from one run of the CLI to
/// the next: loopback ports and temporary directories (`tempfile`'s `.tmpXXXXXX`).
pub const FILTERS: [(&str, &str); 2] = [
    (r"127\.0\.0\.1:\d+", "127.0.0.1:[PORT]"),
    (r"[^\s'\x22]*/\.tmp[0-9A-Za-z]{6}", "[TMP]"),
];

/// The URL a server started with `--port 0` prints first on stdout
/// (`listening on URL`); the child's stdout must be piped.
pub fn listening_url(child: &mut Child) -> String {
    let stdout = child.stdout.take().expect("the server's stdout is piped");
    let first = BufReader::new(stdout)
        .lines()
        .next()
        .expect("the server printed a line")
        .expect("the server's first line is text");
    first.trim_start_matches("listening on ").to_owned()
}
