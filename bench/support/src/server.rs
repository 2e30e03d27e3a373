//! A server under test as a child of the benchmark: the port it prints first on
//! stdout, the end of its log when it fails, and a stop that gives it time to exit.

use std::fmt::Display;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context as _, Result, bail, ensure};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::process::{Child, ChildStdout};
use tokio::time::{Instant, timeout, timeout_at};

/// What agentstack's servers print first on stdout, followed by their port.
pub const LISTENING_PREFIX: &str = "listening on http://127.0.0.1:";
/// How long one `GET /health` may take while waiting for a server to come up.
pub const HEALTH_REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// Pause between two `GET /health` attempts.
pub const HEALTH_POLL_INTERVAL: Duration = Duration::from_millis(100);
/// How long a server has to exit after SIGTERM before it gets SIGKILL.
pub const STOP_GRACE: Duration = Duration::from_secs(10);

/// A benchmark's handle on its server child, as [`read_port`] needs it.
pub trait Supervised {
    /// Fails, with the end of the server's log, if it has exited.
    fn ensure_running(&mut self) -> Result<()>;
    /// The last lines of the server's log, as a suffix for an error message.
    fn log_tail(&self) -> String;
}

/// Reads the port from the first line the server `name` prints on `stdout`
/// (`LISTENING_PREFIX` then the port) by `deadline`, then keeps draining its stdout so
/// that it never blocks on a full pipe.
pub async fn read_port(
    server: &mut impl Supervised,
    stdout: ChildStdout,
    name: impl Display,
    deadline: Instant,
    startup_timeout: Duration,
) -> Result<u16> {
    let mut lines = BufReader::new(stdout).lines();
    let first = match timeout_at(deadline, lines.next_line()).await {
        Err(_) => bail!(
            "the {name} server printed nothing on stdout within {startup_timeout:?}{}",
            server.log_tail()
        ),
        Ok(Err(e)) => return Err(e).context(format!("reading the {name} server's stdout")),
        Ok(Ok(None)) => {
            server.ensure_running()?;
            bail!("the {name} server closed its stdout without printing its address")
        }
        Ok(Ok(Some(line))) => line,
    };
    let port = parse_port(&first).with_context(|| {
        format!("the {name} server's first line was {first:?}, expected '{LISTENING_PREFIX}PORT'")
    })?;
    let mut rest = lines.into_inner();
    tokio::spawn(async move {
        let _ = tokio::io::copy(&mut rest, &mut tokio::io::sink()).await;
    });
    Ok(port)
}

/// The port in a `LISTENING_PREFIX PORT[/]` line; never 0.
pub fn parse_port(line: &str) -> Result<u16> {
    let port = line
        .trim()
        .strip_prefix(LISTENING_PREFIX)
        .context("wrong prefix")?
        .trim_end_matches('/');
    let port: u16 = port.parse().context("bad port")?;
    ensure!(port != 0, "port 0");
    Ok(port)
}

/// The last `lines` lines of the log at `path`, which holds the server's `stream`
/// (`stderr`, `log`), as a suffix for an error message.
pub fn log_tail(path: &Path, stream: &str, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    let tail = &all[all.len().saturating_sub(lines)..];
    if tail.is_empty() {
        format!("\n(its {stream}, {}, is empty)", path.display())
    } else {
        format!(
            "\nlast lines of its {stream} ({}):\n{}",
            path.display(),
            tail.join("\n")
        )
    }
}

/// SIGTERM, then SIGKILL if the child has not exited within [`STOP_GRACE`].
pub async fn stop(child: &mut Child) {
    if matches!(child.try_wait(), Ok(Some(_))) {
        return;
    }
    if let Some(pid) = child.id().and_then(|pid| i32::try_from(pid).ok()) {
        let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
    }
    if timeout(STOP_GRACE, child.wait()).await.is_err() {
        let _ = child.kill().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_is_read_from_the_first_line() {
        assert_eq!(
            parse_port("listening on http://127.0.0.1:8123\n").unwrap(),
            8123
        );
        assert_eq!(parse_port("listening on http://127.0.0.1:80/").unwrap(), 80);
        assert!(parse_port("listening on http://0.0.0.0:80").is_err());
        assert!(parse_port("Uvicorn running").is_err());
        assert!(parse_port("listening on http://127.0.0.1:0").is_err());
    }

    /// A child under test: `sh -c SCRIPT`, its stdout piped.
    struct Shell {
        child: Child,
    }

    impl Shell {
        fn spawn(script: &str) -> (Self, ChildStdout) {
            let mut child = tokio::process::Command::new("sh")
                .args(["-c", script])
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::piped())
                .kill_on_drop(true)
                .spawn()
                .unwrap();
            let stdout = child.stdout.take().unwrap();
            (Self { child }, stdout)
        }
    }

    /// Spawns `sh -c SCRIPT` and reads its port as a server named `test`.
    async fn port_of(script: &str) -> (Shell, Result<u16>) {
        let (mut shell, stdout) = Shell::spawn(script);
        let port = read_port(
            &mut shell,
            stdout,
            "test",
            Instant::now() + STARTUP,
            STARTUP,
        )
        .await;
        (shell, port)
    }

    impl Supervised for Shell {
        fn ensure_running(&mut self) -> Result<()> {
            match self.child.try_wait()? {
                None => Ok(()),
                Some(status) => bail!("the shell exited: {status}"),
            }
        }

        fn log_tail(&self) -> String {
            String::new()
        }
    }

    /// Longer than any of these children needs to print its first line.
    const STARTUP: Duration = Duration::from_secs(10);

    #[tokio::test]
    async fn the_port_is_read_from_a_child_and_the_child_stopped() {
        let (mut shell, port) =
            port_of("echo 'listening on http://127.0.0.1:4321/'; exec sleep 30").await;
        let port = port.unwrap();
        assert_eq!(port, 4321);
        let started = std::time::Instant::now();
        stop(&mut shell.child).await;
        assert!(started.elapsed() < STOP_GRACE, "SIGTERM ends it");
        assert!(shell.child.try_wait().unwrap().is_some());
    }

    #[tokio::test]
    async fn a_wrong_first_line_is_quoted_in_the_error() {
        let (mut shell, error) = port_of("echo 'Uvicorn running'; exec sleep 30").await;
        let error = error.unwrap_err();
        assert_eq!(
            error.to_string(),
            format!(
                "the test server's first line was \"Uvicorn running\", expected '{LISTENING_PREFIX}PORT'"
            )
        );
        stop(&mut shell.child).await;
    }

    #[tokio::test]
    async fn a_child_that_exits_silently_is_reported() {
        let (_shell, error) = port_of("exit 3").await;
        let error = error.unwrap_err();
        let text = format!("{error:#}");
        assert!(
            text.contains("exited") || text.contains("closed its stdout"),
            "{text}"
        );
    }

    #[test]
    fn the_log_tail_keeps_the_last_lines() {
        let path = std::env::temp_dir().join(format!("bench-support-log-{}", std::process::id()));
        std::fs::write(&path, "").unwrap();
        assert!(log_tail(&path, "log", 2).contains("is empty"));
        std::fs::write(&path, "a\nb\nc\n").unwrap();
        assert_eq!(
            log_tail(&path, "stderr", 2),
            format!("\nlast lines of its stderr ({}):\nb\nc", path.display())
        );
        std::fs::remove_file(&path).unwrap();
    }
}
