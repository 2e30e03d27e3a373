//! The two servers under test, run as children of the load generator so that they
//! inherit its raised file-descriptor limit and die with it.

use std::fmt;
use std::fs::File;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};
use tokio::time::{sleep, timeout, timeout_at};

use crate::procfs;

/// What both servers print first on stdout, followed by the URL they listen on.
const LISTENING_PREFIX: &str = "listening on http://127.0.0.1:";
/// How long one `GET /health` may take while waiting for a server to come up.
const HEALTH_REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// Pause between two `GET /health` attempts.
const HEALTH_POLL_INTERVAL: Duration = Duration::from_millis(100);
/// How long a server has to exit after SIGTERM before it gets SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(10);
/// Lines of a server's stderr shown when it fails.
const LOG_TAIL_LINES: usize = 40;

/// Which server a process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ServerKind {
    /// `agentstack env serve echo`.
    Agentstack,
    /// openenv 0.10.0's `create_app` under uvicorn, serving the `openenv init` echo env.
    Reference,
}

impl fmt::Display for ServerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Agentstack => "agentstack",
            Self::Reference => "reference",
        })
    }
}

/// A running server, killed when dropped.
pub struct ServerProcess {
    /// Which server this is.
    pub kind: ServerKind,
    /// Its process id.
    pub pid: u32,
    /// The port it listens on, on 127.0.0.1.
    pub port: u16,
    /// From spawn until `GET /health` answered 200.
    pub startup: Duration,
    /// Where its stderr goes.
    pub log_path: PathBuf,
    child: Child,
}

impl ServerProcess {
    /// Spawns `command`, reads the port from its first stdout line, and waits until
    /// `GET /health` answers 200; all within `startup_timeout`.
    pub async fn start(
        kind: ServerKind,
        mut command: Command,
        log_path: PathBuf,
        startup_timeout: Duration,
    ) -> Result<Self> {
        let log =
            File::create(&log_path).with_context(|| format!("creating {}", log_path.display()))?;
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .kill_on_drop(true);
        let started = Instant::now();
        let deadline = tokio::time::Instant::now() + startup_timeout;
        let mut child = command
            .spawn()
            .with_context(|| format!("starting the {kind} server: {command:?}"))?;
        let pid = child
            .id()
            .ok_or_else(|| anyhow!("the {kind} server exited at once"))?;
        let stdout = child.stdout.take().context("no stdout pipe")?;
        let mut server = Self {
            kind,
            pid,
            port: 0,
            startup: Duration::ZERO,
            log_path,
            child,
        };

        let mut lines = BufReader::new(stdout).lines();
        let first = match timeout_at(deadline, lines.next_line()).await {
            Err(_) => bail!(
                "the {kind} server printed nothing on stdout within {startup_timeout:?}{}",
                server.log_tail()
            ),
            Ok(Err(e)) => return Err(e).context(format!("reading the {kind} server's stdout")),
            Ok(Ok(None)) => {
                server.ensure_running()?;
                bail!("the {kind} server closed its stdout without printing its address")
            }
            Ok(Ok(Some(line))) => line,
        };
        server.port = parse_port(&first).with_context(|| {
            format!(
                "the {kind} server's first line was {first:?}, expected '{LISTENING_PREFIX}PORT'"
            )
        })?;
        // Keep draining stdout so the server never blocks on a full pipe.
        let mut rest = lines.into_inner();
        tokio::spawn(async move {
            let _ = tokio::io::copy(&mut rest, &mut tokio::io::sink()).await;
        });

        loop {
            if health_ok(server.port).await {
                break;
            }
            server.ensure_running()?;
            if tokio::time::Instant::now() >= deadline {
                bail!(
                    "the {kind} server did not answer GET /health within {startup_timeout:?}{}",
                    server.log_tail()
                );
            }
            sleep(HEALTH_POLL_INTERVAL).await;
        }
        server.startup = started.elapsed();
        Ok(server)
    }

    /// Fails, with the end of the server's stderr, if it has exited.
    pub fn ensure_running(&mut self) -> Result<()> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => bail!(
                "the {} server (pid {}) exited: {status}{}",
                self.kind,
                self.pid,
                self.log_tail()
            ),
            Err(e) => Err(e).context(format!("checking on the {} server", self.kind)),
        }
    }

    /// CPU time the server has used so far, in clock ticks.
    pub fn cpu_ticks(&self) -> Result<u64> {
        procfs::cpu_ticks(self.pid)
    }

    /// The server's resident memory now, KiB.
    pub fn rss_kib(&self) -> Result<u64> {
        procfs::rss_kib(self.pid)
    }

    /// The server's thread count now.
    pub fn threads(&self) -> Result<u64> {
        procfs::threads(self.pid)
    }

    /// SIGTERM, then SIGKILL if it has not exited within [`STOP_GRACE`].
    pub async fn stop(mut self) {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        if let Ok(pid) = i32::try_from(self.pid) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        }
        if timeout(STOP_GRACE, self.child.wait()).await.is_err() {
            let _ = self.child.kill().await;
        }
    }

    /// The last lines of the server's stderr, as a suffix for an error message.
    pub fn log_tail(&self) -> String {
        log_tail(&self.log_path)
    }
}

fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let tail = &lines[lines.len().saturating_sub(LOG_TAIL_LINES)..];
    if tail.is_empty() {
        format!("\n(its stderr, {}, is empty)", path.display())
    } else {
        format!(
            "\nlast lines of its stderr ({}):\n{}",
            path.display(),
            tail.join("\n")
        )
    }
}

fn parse_port(line: &str) -> Result<u16> {
    let port = line
        .trim()
        .strip_prefix(LISTENING_PREFIX)
        .context("wrong prefix")?
        .trim_end_matches('/');
    let port: u16 = port.parse().context("bad port")?;
    ensure!(port != 0, "port 0");
    Ok(port)
}

/// Whether `GET /health` on the port answers 200 within [`HEALTH_REQUEST_TIMEOUT`].
async fn health_ok(port: u16) -> bool {
    let attempt = async {
        let mut stream = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).await?;
        stream
            .write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            .await?;
        let mut head = [0u8; 12];
        stream.read_exact(&mut head).await?;
        Ok::<_, std::io::Error>(&head == b"HTTP/1.1 200")
    };
    matches!(timeout(HEALTH_REQUEST_TIMEOUT, attempt).await, Ok(Ok(true)))
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
}
