//! Load time and memory: each engine, in a fresh process, loads the model and computes
//! one token, in alternating rounds. The figures are the process's wall time, from
//! spawn to exit, and its peak resident memory (`ru_maxrss` from `wait4`), next to the
//! file's size: what a user waits for and pays for before the first token.
//!
//! - **agentstack**: this binary's `__measure` child, prefill of one token and one
//!   decoded token (`--prompt-tokens 1 --gen-tokens 1 --repetitions 0`).
//! - **llama.cpp**: `llama-completion -m MODEL -p Hi -n 1 --no-warmup -no-cnv -t T`.
//!   llama.cpp maps the file and, for the types it repacks on this CPU, repacks
//!   those tensors into memory of its own; the pages of the file it touches count in
//!   its RSS as in ours.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;

use crate::report::Rate;
use crate::settings::Kernels;

/// Longest one process may take.
const PROCESS_TIMEOUT: Duration = Duration::from_secs(10 * 60);

/// One engine's figures over the rounds.
#[derive(Debug, Clone, Serialize)]
pub struct Side {
    /// The command line.
    pub command: String,
    /// Spawn to exit, seconds.
    pub seconds: Rate,
    /// Peak resident memory, MiB.
    pub peak_rss_mib: Rate,
    /// Why it has no figures.
    pub error: Option<String>,
}

/// Both engines on one model.
#[derive(Debug, Clone, Serialize)]
pub struct Startup {
    /// Compute threads of both.
    pub threads: usize,
    /// The file's size, MiB.
    pub file_mib: f64,
    /// Ours.
    pub agentstack: Side,
    /// llama.cpp.
    pub llamacpp: Side,
    /// Ours / llama.cpp, mean seconds (below 1× is faster).
    pub seconds_ratio: f64,
}

/// What one process took.
struct Measured {
    seconds: f64,
    peak_rss_kib: i64,
}

/// Runs `command` to its end, with its wall time and peak RSS. Blocking.
fn measure(mut command: Command) -> Result<Measured> {
    let started = Instant::now();
    let child = command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {command:?}"))?;
    let pid = libc::pid_t::try_from(child.id()).context("process id")?;
    // A watchdog: a process past the timeout is killed (and then reaped below).
    let (done, watched) = std::sync::mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if watched.recv_timeout(PROCESS_TIMEOUT).is_err() {
            // Our own child's id: nothing reaps it but the wait4 below, so the id is
            // still this child's.
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    });
    let mut status = 0;
    // SAFETY: rusage is a plain C struct for which all-zero bytes are a valid value.
    #[expect(unsafe_code, reason = "a zeroed C struct")]
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let reaped = loop {
        // SAFETY: wait4 on our own child, writing into the two locals above.
        #[expect(
            unsafe_code,
            reason = "wait4(2) is the only way to read a child's rusage"
        )]
        let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
        if r == -1 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        break r;
    };
    let seconds = started.elapsed().as_secs_f64();
    let _ = done.send(());
    let _ = watchdog.join();
    // The child is reaped; dropping its handle neither waits nor kills.
    drop(child);
    if reaped != pid {
        bail!(
            "waiting for {command:?}: {}",
            std::io::Error::last_os_error()
        );
    }
    if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        bail!(
            "{command:?} failed (wait status {status:#x}{})",
            if seconds >= PROCESS_TIMEOUT.as_secs_f64() {
                ", killed after the timeout"
            } else {
                ""
            }
        );
    }
    Ok(Measured {
        seconds,
        peak_rss_kib: usage.ru_maxrss,
    })
}

/// Our side's command: this binary, measuring one token with the native kernels.
fn ours(model: &Path, threads: usize) -> Result<Command> {
    let mut command =
        crate::in_process::measure_command(model, (1, 1, 0), threads, Kernels::Native)?;
    command.stderr(Stdio::null());
    Ok(command)
}

/// llama.cpp's command, its stderr to `log`.
fn theirs(llama_completion: &Path, model: &Path, threads: usize, log: &Path) -> Result<Command> {
    let log = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let mut command = Command::new(llama_completion);
    command
        .arg("-m")
        .arg(model)
        .args(["-p", "Hi", "-n", "1", "--no-warmup", "-no-cnv", "-t"])
        .arg(threads.to_string())
        .stderr(log);
    Ok(command)
}

/// `llama-completion` beside `llama-bench`.
pub fn llama_completion(llama_bench: &Path) -> PathBuf {
    llama_bench.with_file_name("llama-completion")
}

/// Both engines, `rounds` alternating rounds, at `threads` threads.
pub async fn phase(
    llama_completion: &Path,
    model: &Path,
    threads: usize,
    rounds: usize,
    log_dir: &Path,
    index: usize,
) -> Result<Startup> {
    let file_mib = std::fs::metadata(model)
        .with_context(|| format!("reading {}", model.display()))?
        .len() as f64
        / (1024.0 * 1024.0);
    let log = log_dir.join(format!("llama-completion-m{}.stderr", index + 1));
    let mut sides = [
        (
            format!("{:?}", ours(model, threads)?),
            Vec::new(),
            Vec::new(),
            None::<String>,
        ),
        (
            format!("{:?}", theirs(llama_completion, model, threads, &log)?),
            Vec::new(),
            Vec::new(),
            None,
        ),
    ];
    for round in 1..=rounds {
        for (i, (_, seconds, rss, error)) in sides.iter_mut().enumerate() {
            if error.is_some() {
                continue;
            }
            let command = if i == 0 {
                ours(model, threads)?
            } else {
                theirs(llama_completion, model, threads, &log)?
            };
            match tokio::task::spawn_blocking(move || measure(command)).await? {
                Ok(m) => {
                    eprintln!(
                        "  load + first token, round {round}: {} {:.2} s, peak RSS {:.0} MiB",
                        if i == 0 { "agentstack" } else { "llama.cpp" },
                        m.seconds,
                        m.peak_rss_kib as f64 / 1024.0
                    );
                    seconds.push(m.seconds);
                    rss.push(m.peak_rss_kib as f64 / 1024.0);
                }
                Err(e) => {
                    eprintln!("  load + first token failed: {e:#}");
                    *error = Some(format!("failed: {e:#}"));
                }
            }
        }
    }
    let [ours, theirs] = sides.map(|(command, seconds, rss, error)| Side {
        command,
        seconds: Rate::of(seconds),
        peak_rss_mib: Rate::of(rss),
        error,
    });
    Ok(Startup {
        threads,
        file_mib,
        seconds_ratio: crate::report::ratio(ours.seconds.mean, theirs.seconds.mean),
        agentstack: ours,
        llamacpp: theirs,
    })
}

/// The table: one row per model.
pub fn table(models: &[(String, &Startup)], rounds: usize) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| Model (file size) | Load + first token, s (mean ± sd of {rounds}): agentstack | llama.cpp | agentstack / llama.cpp (below 1× is faster) | Peak RSS, MiB: agentstack | llama.cpp | agentstack peak RSS / file size |"
    );
    let _ = writeln!(out, "|---|--:|--:|--:|--:|--:|--:|");
    for (label, s) in models {
        let cell = |side: &Side, rate: &Rate, digits: usize| match &side.error {
            Some(e) => e.lines().next().unwrap_or_default().replace('|', "/"),
            None => format!("{:.*} ± {:.*}", digits, rate.mean, digits, rate.stddev),
        };
        let _ = writeln!(
            out,
            "| **{label}** ({:.0} MiB, {} thread{}) | {} | {} | {:.2}× | {} | {} | {:.2} |",
            s.file_mib,
            s.threads,
            if s.threads == 1 { "" } else { "s" },
            cell(&s.agentstack, &s.agentstack.seconds, 2),
            cell(&s.llamacpp, &s.llamacpp.seconds, 2),
            s.seconds_ratio,
            cell(&s.agentstack, &s.agentstack.peak_rss_mib, 0),
            cell(&s.llamacpp, &s.llamacpp.peak_rss_mib, 0),
            s.agentstack.peak_rss_mib.mean / s.file_mib,
        );
    }
    out
}
