//! The two servers under test, run as children of the load generator so that they
//! inherit its raised file-descriptor limit and die with it.

use std::fmt;
use std::fs::File;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use agentstack_bench_support::server::{
    self, HEALTH_POLL_INTERVAL, HEALTH_REQUEST_TIMEOUT, Supervised,
};
use anyhow::{Context, Result, anyhow, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};
use tokio::time::{sleep, timeout};

use crate::procfs;

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

        server.port =
            server::read_port(&mut server, stdout, kind, deadline, startup_timeout).await?;

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

    /// SIGTERM, then SIGKILL if it has not exited within [`server::STOP_GRACE`].
    pub async fn stop(mut self) {
        server::stop(&mut self.child).await;
    }

    /// The last lines of the server's stderr, as a suffix for an error message.
    pub fn log_tail(&self) -> String {
        server::log_tail(&self.log_path, "stderr", LOG_TAIL_LINES)
    }
}

impl Supervised for ServerProcess {
    fn ensure_running(&mut self) -> Result<()> {
        Self::ensure_running(self)
    }

    fn log_tail(&self) -> String {
        Self::log_tail(self)
    }
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
