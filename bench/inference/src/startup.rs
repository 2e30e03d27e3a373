//! Load time and memory: each engine, in a fresh process, loads the model and computes
//! one token, in alternating rounds. The figures are the process's wall time, from
//! spawn to exit, and its peak resident memory (`VmHWM`), next to the file's size: what a user waits for and pays for before the first token.
//!
//! - **agentstack**: this binary's `__measure` child, prefill of one token and one
//!   decoded token (`--prompt-tokens 1 --gen-tokens 1 --repetitions 0`). Its first run
//!   finds the model's repack cache empty: it repacks the weights and writes the entry,
//!   and is reported on its own as the first load; the rounds then map the entry, as a
//!   user's later loads do.
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
    /// Our first load, with an empty repack cache: seconds and peak RSS in MiB.
    pub first_load: Option<(f64, f64)>,
}

/// What one process took.
struct Measured {
    seconds: f64,
    peak_rss_kib: u64,
}

/// How often a running process's peak RSS is read.
const POLL: Duration = Duration::from_millis(2);

/// Runs `command` to its end, with its wall time and peak RSS. Blocking.
///
/// The peak is the process's `VmHWM`, read every [`POLL`] while it runs (the last read
/// at most that long before it exits). Not `wait4`'s `ru_maxrss`: Linux carries that
/// over from the parent through fork and exec, so it would report this benchmark's own
/// peak (its bandwidth buffers) for a child that used less.
fn measure(mut command: Command) -> Result<Measured> {
    let started = Instant::now();
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {command:?}"))?;
    let status_file = format!("/proc/{}/status", child.id());
    let mut peak_rss_kib = 0;
    let status = loop {
        if let Some(kib) = std::fs::read_to_string(&status_file)
            .ok()
            .as_deref()
            .and_then(peak_rss)
        {
            peak_rss_kib = peak_rss_kib.max(kib);
        }
        if let Some(status) = child
            .try_wait()
            .with_context(|| format!("waiting for {command:?}"))?
        {
            break status;
        }
        if started.elapsed() > PROCESS_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{command:?} took over {PROCESS_TIMEOUT:?}; killed it");
        }
        std::thread::sleep(POLL);
    };
    let seconds = started.elapsed().as_secs_f64();
    if !status.success() {
        bail!("{command:?} failed ({status})");
    }
    Ok(Measured {
        seconds,
        peak_rss_kib,
    })
}

/// `VmHWM` in kB from a `/proc/<pid>/status` text.
fn peak_rss(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|rest| rest.trim().strip_suffix("kB"))
        .and_then(|kib| kib.trim().parse().ok())
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
    let command = |engine: &str| {
        if engine == "agentstack" {
            ours(model, threads)
        } else {
            theirs(llama_completion, model, threads, &log)
        }
    };
    let engines = ["agentstack", "llama.cpp"];
    let commands = [
        format!("{:?}", command(engines[0])?),
        format!("{:?}", command(engines[1])?),
    ];
    // Per engine: seconds, peak RSS in MiB, and why it stopped.
    let mut tallies: [(Vec<f64>, Vec<f64>, Option<String>); 2] = Default::default();
    let first = command(engines[0])?;
    let first_load = match tokio::task::spawn_blocking(move || measure(first)).await? {
        Ok(m) => {
            let mib = m.peak_rss_kib as f64 / 1024.0;
            eprintln!(
                "  first load (repacked, cache written): agentstack {:.2} s, peak RSS {mib:.0} MiB",
                m.seconds
            );
            Some((m.seconds, mib))
        }
        Err(e) => {
            eprintln!("  first load failed: {e:#}");
            tallies[0].2 = Some(format!("failed: {e:#}"));
            None
        }
    };
    for round in 1..=rounds {
        for (engine, (seconds, rss, error)) in engines.into_iter().zip(&mut tallies) {
            if error.is_some() {
                continue;
            }
            let command = command(engine)?;
            match tokio::task::spawn_blocking(move || measure(command)).await? {
                Ok(m) => {
                    let mib = m.peak_rss_kib as f64 / 1024.0;
                    eprintln!(
                        "  load + first token, round {round}: {engine} {:.2} s, peak RSS {mib:.0} MiB",
                        m.seconds
                    );
                    seconds.push(m.seconds);
                    rss.push(mib);
                }
                Err(e) => {
                    eprintln!("  load + first token failed: {e:#}");
                    *error = Some(format!("failed: {e:#}"));
                }
            }
        }
    }
    let side =
        |command: String, (seconds, rss, error): (Vec<f64>, Vec<f64>, Option<String>)| Side {
            command,
            seconds: Rate::of(seconds),
            peak_rss_mib: Rate::of(rss),
            error,
        };
    let ([our_command, their_command], [our_tally, their_tally]) = (commands, tallies);
    let (ours, theirs) = (
        side(our_command, our_tally),
        side(their_command, their_tally),
    );
    Ok(Startup {
        threads,
        file_mib,
        seconds_ratio: crate::report::ratio(ours.seconds.mean, theirs.seconds.mean),
        agentstack: ours,
        llamacpp: theirs,
        first_load,
    })
}

/// The table: one row per model.
pub fn table(models: &[(String, &Startup)], rounds: usize) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| Model (file size) | Load + first token, s (mean ± sd of {rounds}): agentstack | llama.cpp | agentstack / llama.cpp (below 1× is faster) | Peak RSS, MiB: agentstack | llama.cpp | agentstack peak RSS / file size | agentstack first load (repack, cache written), s | its peak RSS, MiB |"
    );
    let _ = writeln!(out, "|---|--:|--:|--:|--:|--:|--:|--:|--:|");
    for (label, s) in models {
        let cell = |side: &Side, rate: &Rate, digits: usize| match &side.error {
            Some(e) => e.lines().next().unwrap_or_default().replace('|', "/"),
            None => format!("{:.*} ± {:.*}", digits, rate.mean, digits, rate.stddev),
        };
        let _ = writeln!(
            out,
            "| **{label}** ({:.0} MiB, {} thread{}) | {} | {} | {:.2}× | {} | {} | {:.2} | {} | {} |",
            s.file_mib,
            s.threads,
            if s.threads == 1 { "" } else { "s" },
            cell(&s.agentstack, &s.agentstack.seconds, 2),
            cell(&s.llamacpp, &s.llamacpp.seconds, 2),
            s.seconds_ratio,
            cell(&s.agentstack, &s.agentstack.peak_rss_mib, 0),
            cell(&s.llamacpp, &s.llamacpp.peak_rss_mib, 0),
            s.agentstack.peak_rss_mib.mean / s.file_mib,
            s.first_load
                .map_or_else(|| "—".into(), |(t, _)| format!("{t:.2}")),
            s.first_load
                .map_or_else(|| "—".into(), |(_, m)| format!("{m:.0}")),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peak_is_read_from_proc_status() {
        let text = "Name:\tx\nVmPeak:\t  9000 kB\nVmHWM:\t    1234 kB\nVmRSS:\t 1000 kB\n";
        assert_eq!(peak_rss(text), Some(1234));
        assert_eq!(peak_rss("Name:\tx\n"), None);
        let own = std::fs::read_to_string("/proc/self/status").unwrap();
        assert!(peak_rss(&own).unwrap() > 0);
    }

    #[test]
    fn a_child_s_peak_is_its_own_not_ours() {
        // This process holds 64 MiB; a small child must not report them.
        let held = vec![1u8; 64 << 20];
        let mut sleep = Command::new("sleep");
        sleep.arg("0.1");
        let m = measure(sleep).unwrap();
        assert!(
            m.peak_rss_kib > 0 && m.peak_rss_kib < 32 << 10,
            "{} kB",
            m.peak_rss_kib
        );
        assert!(m.seconds >= 0.1);
        assert!(held.iter().all(|&b| b == 1));
        assert!(measure(Command::new("false")).is_err());
    }
}
