//! The two servers under test, children of the benchmark, on 127.0.0.1 only.

use std::fmt;
use std::fs::File;
use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde::Serialize;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::time::{sleep, timeout, timeout_at};

use crate::settings::Settings;

/// What `agentstack model serve` prints first on stdout, followed by its port.
const LISTENING_PREFIX: &str = "listening on http://127.0.0.1:";
/// How long one `GET /health` may take while waiting for a server to come up.
const HEALTH_REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// Pause between two `GET /health` attempts.
const HEALTH_POLL_INTERVAL: Duration = Duration::from_millis(100);
/// How long a server has to exit after SIGTERM before it gets SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(10);
/// Lines of a server's log shown when it fails.
const LOG_TAIL_LINES: usize = 30;

/// Which server a process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Engine {
    /// `agentstack model serve`, or our forward pass in process.
    Agentstack,
    /// `llama-server`, or `llama-bench`.
    LlamaCpp,
}

impl fmt::Display for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Agentstack => "agentstack",
            Self::LlamaCpp => "llama.cpp",
        })
    }
}

/// A running server, killed when dropped.
pub struct Server {
    /// Which server this is.
    pub engine: Engine,
    /// Its port on 127.0.0.1.
    pub port: u16,
    /// Its command line, for the report.
    pub command: String,
    log_path: PathBuf,
    child: Child,
}

/// The command that starts `engine`'s server with `threads` compute threads, and the
/// port it will listen on if it is chosen here (agentstack picks its own and says).
pub fn command(
    settings: &Settings,
    model: &Path,
    engine: Engine,
    threads: usize,
) -> Result<(Command, Option<u16>)> {
    Ok(match engine {
        Engine::Agentstack => {
            let mut command = Command::new(&settings.agentstack);
            command.args(["model", "serve"]).arg(model).args([
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--threads",
                &threads.to_string(),
            ]);
            (command, None)
        }
        Engine::LlamaCpp => {
            // llama-server cannot listen on port 0 and report it, so take a free
            // port from the kernel and hand it over; the gap is a few milliseconds.
            let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
                .and_then(|l| l.local_addr())
                .context("finding a free port for llama-server")?
                .port();
            let mut command = Command::new(&settings.llama_server);
            command.arg("-m").arg(model).args([
                "-t",
                &threads.to_string(),
                "-np",
                &settings.plan.requests.to_string(),
                "-c",
                &settings.plan.llama_server_ctx.to_string(),
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
            ]);
            (command, Some(port))
        }
    })
}

impl Server {
    /// Starts the server and waits until `GET /health` answers 200.
    pub async fn start(
        engine: Engine,
        (mut command, port): (Command, Option<u16>),
        log_path: PathBuf,
        startup_timeout: Duration,
        http: &reqwest::Client,
    ) -> Result<Self> {
        let log =
            File::create(&log_path).with_context(|| format!("creating {}", log_path.display()))?;
        let stdout = match port {
            Some(_) => Stdio::from(log.try_clone().context("sharing the log file")?),
            None => Stdio::piped(),
        };
        command
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(Stdio::from(log))
            .kill_on_drop(true);
        let shown = describe(&command);
        let deadline = tokio::time::Instant::now() + startup_timeout;
        let mut child = command
            .spawn()
            .with_context(|| format!("starting the {engine} server: {shown}"))?;
        let stdout = child.stdout.take();
        let mut server = Self {
            engine,
            port: port.unwrap_or(0),
            command: shown,
            log_path,
            child,
        };
        if let Some(stdout) = stdout {
            let mut lines = BufReader::new(stdout).lines();
            let first = match timeout_at(deadline, lines.next_line()).await {
                Err(_) => bail!(
                    "the {engine} server printed nothing on stdout within {startup_timeout:?}{}",
                    server.log_tail()
                ),
                Ok(Err(e)) => {
                    return Err(e).context(format!("reading the {engine} server's stdout"));
                }
                Ok(Ok(None)) => {
                    server.ensure_running()?;
                    bail!("the {engine} server closed its stdout without printing its address")
                }
                Ok(Ok(Some(line))) => line,
            };
            server.port = parse_port(&first)
                .with_context(|| format!("the {engine} server's first line was {first:?}, expected '{LISTENING_PREFIX}PORT'"))?;
            // Keep draining stdout so the server never blocks on a full pipe.
            let mut rest = lines.into_inner();
            tokio::spawn(async move {
                let _ = tokio::io::copy(&mut rest, &mut tokio::io::sink()).await;
            });
        }
        let started = Instant::now();
        loop {
            let health = http
                .get(format!("{}/health", server.url()))
                .timeout(HEALTH_REQUEST_TIMEOUT)
                .send()
                .await;
            if health.is_ok_and(|r| r.status().is_success()) {
                break;
            }
            server.ensure_running()?;
            if tokio::time::Instant::now() >= deadline {
                bail!(
                    "the {engine} server did not answer GET /health within {startup_timeout:?} ({:.0} s after it printed its port){}",
                    started.elapsed().as_secs_f64(),
                    server.log_tail()
                );
            }
            sleep(HEALTH_POLL_INTERVAL).await;
        }
        Ok(server)
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Fails, with the end of the server's log, if it has exited.
    pub fn ensure_running(&mut self) -> Result<()> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => bail!(
                "the {} server exited: {status}{}",
                self.engine,
                self.log_tail()
            ),
            Err(e) => Err(e).context(format!("checking on the {} server", self.engine)),
        }
    }

    /// SIGTERM, then SIGKILL if it has not exited within [`STOP_GRACE`].
    pub async fn stop(mut self) {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        if let Some(pid) = self.child.id().and_then(|pid| i32::try_from(pid).ok()) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        }
        if timeout(STOP_GRACE, self.child.wait()).await.is_err() {
            let _ = self.child.kill().await;
        }
    }

    /// The last lines of the server's log, as a suffix for an error message.
    pub fn log_tail(&self) -> String {
        log_tail(&self.log_path)
    }
}

fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let tail = &lines[lines.len().saturating_sub(LOG_TAIL_LINES)..];
    if tail.is_empty() {
        format!("\n(its log, {}, is empty)", path.display())
    } else {
        format!(
            "\nlast lines of its log ({}):\n{}",
            path.display(),
            tail.join("\n")
        )
    }
}

fn describe(command: &Command) -> String {
    let std = command.as_std();
    std::iter::once(std.get_program())
        .chain(std.get_args())
        .map(|s| s.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

fn parse_port(line: &str) -> Result<u16> {
    let port = line
        .trim()
        .strip_prefix(LISTENING_PREFIX)
        .ok_or_else(|| anyhow!("wrong prefix"))?
        .trim_end_matches('/');
    let port: u16 = port.parse().context("bad port")?;
    ensure!(port != 0, "port 0");
    Ok(port)
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
        assert!(parse_port("listening on http://0.0.0.0:80").is_err());
        assert!(parse_port("listening on http://127.0.0.1:0").is_err());
    }
}
