//! The two servers under test, children of the benchmark, on 127.0.0.1 only.

use std::fmt;
use std::fs::File;
use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use agentstack_bench_support::server::{
    self, HEALTH_POLL_INTERVAL, HEALTH_REQUEST_TIMEOUT, Supervised,
};
use anyhow::{Context, Result, bail};
use serde::Serialize;
use tokio::process::{Child, Command};
use tokio::time::sleep;

use crate::settings::Settings;

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
            let (name, value) = crate::in_process::repack_cache_env();
            command.env(name, value);
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
            server.port =
                server::read_port(&mut server, stdout, engine, deadline, startup_timeout).await?;
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

    /// SIGTERM, then SIGKILL if it has not exited within [`server::STOP_GRACE`].
    pub async fn stop(mut self) {
        server::stop(&mut self.child).await;
    }

    /// The last lines of the server's log, as a suffix for an error message.
    pub fn log_tail(&self) -> String {
        server::log_tail(&self.log_path, "log", LOG_TAIL_LINES)
    }
}

impl Supervised for Server {
    fn ensure_running(&mut self) -> Result<()> {
        Self::ensure_running(self)
    }

    fn log_tail(&self) -> String {
        Self::log_tail(self)
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
