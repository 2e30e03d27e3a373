//! Child processes with every wait bounded: commands that must finish within a
//! time limit, and servers that are stopped (SIGTERM, then SIGKILL) when their
//! guard drops, even when a test panics. [`pids_with`] finds the processes a test did
//! not start itself by their arguments.

use std::fmt;
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// How often a bounded wait looks at the child.
const POLL_INTERVAL: Duration = Duration::from_millis(50);

/// How long a finished command's output pipes may stay open (held by a process it
/// started) before what was read is taken as its output.
const DRAIN: Duration = Duration::from_secs(2);

/// How long a server gets to stop after SIGTERM before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// What a finished (or timed-out) command left behind.
pub struct Finished {
    /// The command line, for messages.
    pub command: String,
    /// Its exit status; `None` when it ran out of time and was killed.
    pub status: Option<ExitStatus>,
    /// Everything it printed on stdout.
    pub stdout: String,
    /// Everything it printed on stderr.
    pub stderr: String,
    /// How long it ran.
    pub elapsed: Duration,
}

impl Finished {
    /// Whether it exited with status 0.
    pub fn success(&self) -> bool {
        self.status.is_some_and(|s| s.success())
    }
}

impl fmt::Display for Finished {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let status = match self.status {
            Some(status) => status.to_string(),
            None => "killed: ran out of time".to_owned(),
        };
        writeln!(f, "$ {}", self.command)?;
        writeln!(f, "{status} after {:.1?}", self.elapsed)?;
        writeln!(f, "--- stdout ---\n{}", self.stdout.trim_end())?;
        write!(f, "--- stderr ---\n{}", self.stderr.trim_end())
    }
}

fn describe(command: &Command) -> String {
    let mut words = vec![command.get_program().to_string_lossy().into_owned()];
    words.extend(command.get_args().map(|a| a.to_string_lossy().into_owned()));
    words.join(" ")
}

/// A pipe read to its end on a thread of its own.
struct Capture {
    bytes: Arc<Mutex<Vec<u8>>>,
    reader: thread::JoinHandle<()>,
}

fn read_all(mut from: impl Read + Send + 'static) -> Capture {
    let bytes = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&bytes);
    let reader = thread::spawn(move || {
        let mut chunk = [0u8; 8192];
        while let Ok(n @ 1..) = from.read(&mut chunk) {
            if let Ok(mut bytes) = sink.lock() {
                bytes.extend_from_slice(&chunk[..n]);
            }
        }
    });
    Capture { bytes, reader }
}

impl Capture {
    /// What was read, once the pipe closed or at `deadline`, whichever is first.
    fn text(self, deadline: Instant) -> String {
        while !self.reader.is_finished() && Instant::now() < deadline {
            thread::sleep(POLL_INTERVAL);
        }
        let bytes = self.bytes.lock().map(|b| b.clone()).unwrap_or_default();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// Starts `command` with no stdin and its stdout and stderr piped.
fn spawn_piped(command: &mut Command, shown: &str) -> Child {
    command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("could not start `{shown}`: {e}"))
}

/// Runs `command` to completion, killing it after `limit`. Its output is what it
/// printed by then: a grandchild still holding the pipes open (a server the command
/// started) is given two seconds to close them, not waited for.
pub fn run_bounded(mut command: Command, limit: Duration) -> Finished {
    let shown = describe(&command);
    let started = Instant::now();
    let mut child = spawn_piped(&mut command, &shown);
    let stdout = read_all(child.stdout.take().expect("stdout is piped"));
    let stderr = read_all(child.stderr.take().expect("stderr is piped"));
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if started.elapsed() >= limit => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            Ok(None) => thread::sleep(POLL_INTERVAL),
            Err(e) => panic!("waiting for `{shown}`: {e}"),
        }
    };
    let drained = Instant::now() + DRAIN;
    Finished {
        command: shown,
        status,
        stdout: stdout.text(drained),
        stderr: stderr.text(drained),
        elapsed: started.elapsed(),
    }
}

/// A server started as a child that prints `listening on <url>` as its first
/// stdout line. Stopped when dropped.
pub struct Server {
    child: Child,
    command: String,
    /// The URL from the first line.
    pub url: String,
    /// What it printed after the first line, and all of its stderr.
    log: Arc<Mutex<String>>,
}

impl Server {
    /// Starts `command` and waits up to `ready_within` for its first stdout line.
    pub fn start(mut command: Command, ready_within: Duration) -> Self {
        let shown = describe(&command);
        let mut child = spawn_piped(&mut command, &shown);
        let log = Arc::new(Mutex::new(String::new()));

        let (first_line, first_line_rx) = mpsc::channel();
        let stdout = BufReader::new(child.stdout.take().expect("stdout is piped"));
        let stdout_log = Arc::clone(&log);
        thread::spawn(move || {
            let mut lines = stdout.lines();
            if let Some(Ok(line)) = lines.next() {
                let _ = first_line.send(line);
            }
            for line in lines.map_while(Result::ok) {
                append(&stdout_log, &line);
            }
        });
        let stderr = BufReader::new(child.stderr.take().expect("stderr is piped"));
        let stderr_log = Arc::clone(&log);
        thread::spawn(move || {
            for line in stderr.lines().map_while(Result::ok) {
                append(&stderr_log, &line);
            }
        });

        let mut server = Self {
            child,
            command: shown,
            url: String::new(),
            log,
        };
        let line = match first_line_rx.recv_timeout(ready_within) {
            Ok(line) => line,
            Err(RecvTimeoutError::Timeout) => {
                panic!(
                    "no `listening on` line within {ready_within:?}\n{}",
                    server.report()
                )
            }
            Err(RecvTimeoutError::Disconnected) => {
                // Exited before printing anything; give stderr a moment to drain.
                thread::sleep(Duration::from_millis(200));
                panic!("the server exited before listening\n{}", server.report())
            }
        };
        server.url = match line.strip_prefix("listening on ") {
            Some(url) => url.trim().trim_end_matches('/').to_owned(),
            None => panic!(
                "first stdout line is not `listening on <url>`: {line:?}\n{}",
                server.report()
            ),
        };
        server
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kills the server with SIGKILL (no shutdown of its own) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The command and everything the server printed so far, for failure messages.
    pub fn report(&mut self) -> String {
        let state = match self.child.try_wait() {
            Ok(Some(status)) => format!("exited: {status}"),
            _ => "running".to_owned(),
        };
        let log = self.log.lock().map(|l| l.clone()).unwrap_or_default();
        format!(
            "--- server `{}` ({state}) ---\n{}",
            self.command,
            log.trim_end()
        )
    }

    fn stop(&mut self) {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        // SIGTERM lets `agentstack env serve` stop the Python server it started.
        if let Ok(pid) = i32::try_from(self.child.id()) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        }
        let deadline = Instant::now() + STOP_GRACE;
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            thread::sleep(POLL_INTERVAL);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

fn append(log: &Mutex<String>, line: &str) {
    if let Ok(mut log) = log.lock() {
        log.push_str(line);
        log.push('\n');
    }
}

/// The processes whose command line holds every one of `needles` as whole arguments
/// (read from `/proc`, so Linux only): for tests that must find, signal or wait out a
/// process they did not start themselves, such as a replica a supervisor spawned.
///
/// # Panics
/// If `/proc` cannot be read.
pub fn pids_with(needles: &[&str]) -> Vec<i32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmdline
            .split(|&b| b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if needles.iter().all(|n| args.iter().any(|a| a == n)) {
            pids.push(pid);
        }
    }
    pids
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Command {
        let mut command = Command::new("sh");
        command.args(["-c", script]);
        command
    }

    #[test]
    fn a_command_is_captured_and_one_past_its_limit_is_killed() {
        let done = run_bounded(
            sh("echo out; echo err >&2; exit 3"),
            Duration::from_secs(10),
        );
        assert_eq!(done.status.and_then(|s| s.code()), Some(3));
        assert_eq!(
            (done.stdout.as_str(), done.stderr.as_str()),
            ("out\n", "err\n")
        );
        let slow = run_bounded(sh("sleep 30"), Duration::from_millis(200));
        assert!(slow.status.is_none() && !slow.success(), "{slow}");
        assert!(slow.elapsed < Duration::from_secs(10), "{slow}");
    }

    #[test]
    fn a_server_gives_its_url_and_is_stopped_when_dropped() {
        let server = Server::start(
            sh("echo 'listening on http://127.0.0.1:1/'; exec sleep 30"),
            Duration::from_secs(10),
        );
        assert_eq!(server.url, "http://127.0.0.1:1");
        let pid = Pid::from_raw(server.child.id() as i32);
        drop(server);
        // Reaped by the drop: no such process any more.
        assert!(kill(pid, None).is_err());
    }
}
