//! The load: OpenEnv WebSocket sessions driven over the raw `/ws` protocol, one
//! request outstanding per session, as the Python clients do.
//!
//! A session is `connect`, `{"type":"reset","data":{"seed":1}}`, then
//! `{"type":"step","data":{"message":"hello"}}` as many times as asked, each waiting
//! for its reply, then `{"type":"close"}`. Every await is under a timeout.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use futures_util::future::{join_all, try_join_all};
use futures_util::{SinkExt, StreamExt};
use serde_json::Value;
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, oneshot, watch};
use tokio::task::JoinSet;
use tokio::time::{sleep, timeout, timeout_at};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream, connect_async_with_config};

use crate::procfs;
use crate::servers::ServerProcess;

const RESET: &str = r#"{"type":"reset","data":{"seed":1}}"#;
const STEP: &str = r#"{"type":"step","data":{"message":"hello"}}"#;
const CLOSE: &str = r#"{"type":"close"}"#;
/// What a step with [`STEP`] echoes back.
const STEP_MESSAGE: &str = "hello";
/// The reward for [`STEP_MESSAGE`]: `min(0.1 × 5, 1.0)`.
const STEP_REWARD: f64 = 0.5;
/// Tolerance when comparing a reward read from JSON.
const REWARD_TOLERANCE: f64 = 1e-9;

/// Longest a TCP connect plus WebSocket handshake may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest one request may wait for its reply.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest a polite close may take before the socket is just dropped.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);
/// Upper bound on a step phase: this much plus [`STEP_PHASE_PER_STEP`] per step.
const STEP_PHASE_BASE: Duration = Duration::from_secs(60);
/// See [`STEP_PHASE_BASE`]; 5 ms per step is 10× the reference server's worst case.
const STEP_PHASE_PER_STEP: Duration = Duration::from_millis(5);
/// Sessions being opened at once during the ramp.
const RAMP_OPEN_CONCURRENCY: usize = 32;
/// Pause before reading RSS, so the server has finished setting sessions up.
const SETTLE: Duration = Duration::from_secs(1);
/// Longest the release (close) of all ramp sessions may take.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(60);

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// One open, reset WebSocket session.
pub struct Session {
    ws: Ws,
}

impl Session {
    /// Connects to `ws://127.0.0.1:port/ws` and resets.
    pub async fn open(port: u16) -> Result<Self> {
        let url = format!("ws://127.0.0.1:{port}/ws");
        // Nagle off, as every WebSocket client for request/response traffic does.
        let (ws, _) = timeout(CONNECT_TIMEOUT, connect_async_with_config(url, None, true))
            .await
            .map_err(|_| anyhow!("connect: no handshake within {CONNECT_TIMEOUT:?}"))?
            .context("connect")?;
        let mut session = Self { ws };
        let reply = session.request(RESET).await.context("reset")?;
        ensure!(
            reply["type"] == "observation",
            "unexpected reply to reset: {reply}"
        );
        Ok(session)
    }

    /// Sends one text frame and waits for the one reply.
    async fn request(&mut self, text: &'static str) -> Result<Value> {
        let exchange = async {
            self.ws.send(Message::text(text)).await.context("send")?;
            loop {
                match self.ws.next().await {
                    Some(Ok(Message::Text(reply))) => {
                        let reply: Value =
                            serde_json::from_str(reply.as_str()).context("reply is not JSON")?;
                        if reply["type"] == "error" {
                            bail!("server error: {}", reply["data"]);
                        }
                        return Ok(reply);
                    }
                    Some(Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => {}
                    Some(Ok(Message::Binary(_))) => bail!("unexpected binary frame"),
                    Some(Ok(Message::Close(frame))) => bail!("server closed the socket: {frame:?}"),
                    Some(Err(e)) => return Err(e).context("receive"),
                    None => bail!("connection ended"),
                }
            }
        };
        timeout(REQUEST_TIMEOUT, exchange)
            .await
            .map_err(|_| anyhow!("no reply within {REQUEST_TIMEOUT:?}"))?
    }

    async fn step(&mut self) -> Result<()> {
        let reply = self.request(STEP).await?;
        let echoed = &reply["data"]["observation"]["echoed_message"];
        let reward = reply["data"]["reward"].as_f64();
        ensure!(
            reply["type"] == "observation"
                && echoed == STEP_MESSAGE
                && reward.is_some_and(|r| (r - STEP_REWARD).abs() < REWARD_TOLERANCE),
            "unexpected reply to step: {reply}"
        );
        Ok(())
    }

    /// Sends `close` and waits, briefly, for the server to close the socket.
    pub async fn close(mut self) {
        let polite = async {
            self.ws.send(Message::text(CLOSE)).await?;
            while let Some(frame) = self.ws.next().await {
                frame?;
            }
            Ok::<_, anyhow::Error>(())
        };
        let _ = timeout(CLOSE_TIMEOUT, polite).await;
    }
}

/// One timed step phase: `sessions` sessions stepping side by side.
#[derive(Debug, Clone)]
pub struct StepRun {
    /// Steps over all sessions.
    pub steps: u64,
    /// From the first step sent to the last reply received.
    pub wall: Duration,
    /// Every step's latency, send to reply parsed, ns.
    pub latencies_ns: Vec<u64>,
    /// CPU the server used over the phase, clock ticks.
    pub server_cpu_ticks: u64,
    /// CPU the load generator used over the phase, clock ticks.
    pub generator_cpu_ticks: u64,
}

/// Opens and resets `sessions` sessions, then times `steps_per_session` steps on
/// each, all at once. Only the steps are timed and charged CPU; connect, reset and
/// close are not.
pub async fn run_steps(
    server: &mut ServerProcess,
    sessions: usize,
    steps_per_session: usize,
) -> Result<StepRun> {
    let port = server.port;
    let total_steps = sessions * steps_per_session;
    let open_all = try_join_all((0..sessions).map(|_| Session::open(port)));
    let opened = timeout(CONNECT_TIMEOUT + REQUEST_TIMEOUT, open_all)
        .await
        .map_err(|_| anyhow!("opening {sessions} sessions timed out"))?
        .with_context(|| format!("opening {sessions} sessions"))?;

    let phase_limit = STEP_PHASE_BASE + STEP_PHASE_PER_STEP * u32::try_from(total_steps)?;
    let server_before = server.cpu_ticks()?;
    let own_before = procfs::own_cpu_ticks()?;
    let start = Instant::now();
    let deadline = tokio::time::Instant::now() + phase_limit;
    let mut tasks = JoinSet::new();
    for (index, mut session) in opened.into_iter().enumerate() {
        tasks.spawn(async move {
            let mut latencies = Vec::with_capacity(steps_per_session);
            for step in 0..steps_per_session {
                let sent = Instant::now();
                session
                    .step()
                    .await
                    .with_context(|| format!("session {index}, step {}", step + 1))?;
                latencies.push(u64::try_from(sent.elapsed().as_nanos()).unwrap_or(u64::MAX));
            }
            Ok::<_, anyhow::Error>((session, latencies))
        });
    }
    let mut finished = Vec::with_capacity(sessions);
    let mut latencies_ns = Vec::with_capacity(total_steps);
    loop {
        let joined = timeout_at(deadline, tasks.join_next())
            .await
            .map_err(|_| anyhow!("the step phase did not finish within {phase_limit:?}"))?;
        let Some(joined) = joined else { break };
        let (session, latencies) = joined.context("a session task panicked")??;
        finished.push(session);
        latencies_ns.extend(latencies);
    }
    let wall = start.elapsed();
    let server_cpu_ticks = server.cpu_ticks()?.saturating_sub(server_before);
    let generator_cpu_ticks = procfs::own_cpu_ticks()?.saturating_sub(own_before);

    join_all(finished.into_iter().map(Session::close)).await;
    server.ensure_running()?;
    Ok(StepRun {
        steps: u64::try_from(total_steps)?,
        wall,
        latencies_ns,
        server_cpu_ticks,
        generator_cpu_ticks,
    })
}

/// How far to ramp up idle sessions.
#[derive(Debug, Clone, Copy)]
pub struct RampPlan {
    /// Stop once this many sessions are held.
    pub cap: usize,
    /// Measure RSS per idle session once this many are held.
    pub idle_sessions: usize,
    /// Sessions opened per batch.
    pub batch: usize,
    /// Stop once the ramp has taken this long.
    pub budget: Duration,
}

/// Why the ramp stopped.
#[derive(Debug, Clone)]
pub enum RampStop {
    /// It reached the cap.
    Cap,
    /// Opening a session failed; the first error.
    Failed(String),
    /// The server dropped sessions it had been holding.
    SessionsLost(usize),
    /// The time budget ran out.
    TimeBudget(Duration),
}

/// What the ramp of idle sessions found.
#[derive(Debug, Clone)]
pub struct Ramp {
    /// RSS before the first session of the ramp, KiB.
    pub baseline_rss_kib: u64,
    /// Sessions held and RSS (KiB) when [`RampPlan::idle_sessions`] were held; `None`
    /// if the ramp stopped before.
    pub at_idle_sessions: Option<(usize, u64)>,
    /// Most sessions held at once.
    pub max_held: usize,
    /// RSS with [`Self::max_held`] sessions held, KiB.
    pub rss_at_max_kib: u64,
    /// Server threads with [`Self::max_held`] sessions held.
    pub threads_at_max: u64,
    /// Why it stopped.
    pub stop: RampStop,
    /// How long it took to open them (pauses to measure RSS not included).
    pub elapsed: Duration,
}

impl Ramp {
    /// RSS per idle session, KiB, and how many sessions that was measured over.
    pub fn per_session_kib(&self) -> Option<(f64, usize)> {
        let (held, rss) = self
            .at_idle_sessions
            .unwrap_or((self.max_held, self.rss_at_max_kib));
        (held > 0).then(|| {
            #[expect(
                clippy::cast_precision_loss,
                reason = "KiB and session counts are far below 2^52"
            )]
            let per = rss.saturating_sub(self.baseline_rss_kib) as f64 / held as f64;
            (per, held)
        })
    }
}

/// Opens sessions in batches, resets each and keeps them all open (answering the
/// server's pings), until `plan.cap` are held, one fails, the server drops one, or
/// `plan.budget` runs out. Measures RSS at `plan.idle_sessions` and at the end, then
/// closes them all.
pub async fn ramp(server: &mut ServerProcess, plan: RampPlan) -> Result<Ramp> {
    let port = server.port;
    let baseline_rss_kib = server.rss_kib()?;
    let held = Arc::new(AtomicUsize::new(0));
    let lost = Arc::new(AtomicUsize::new(0));
    let opening = Arc::new(Semaphore::new(RAMP_OPEN_CONCURRENCY));
    let (release, released) = watch::channel(false);
    let mut tasks = JoinSet::new();
    let mut requested = 0usize;
    let mut at_idle_sessions = None;
    let start = Instant::now();
    // Time spent waiting to measure RSS, not opening sessions.
    let mut settling = Duration::ZERO;
    let deadline = tokio::time::Instant::now() + plan.budget;

    let stop = loop {
        if requested >= plan.cap {
            break RampStop::Cap;
        }
        // Batches end exactly at `idle_sessions`, where RSS is measured.
        let boundary = if requested < plan.idle_sessions {
            plan.idle_sessions.min(requested + plan.batch)
        } else {
            requested + plan.batch
        };
        let count = boundary.min(plan.cap) - requested;
        let mut reports = Vec::with_capacity(count);
        for _ in 0..count {
            let (report, reported) = oneshot::channel();
            tasks.spawn(hold_session(
                port,
                Arc::clone(&opening),
                report,
                released.clone(),
                Arc::clone(&held),
                Arc::clone(&lost),
            ));
            reports.push(reported);
        }
        requested += count;

        let Ok(reports) = timeout_at(deadline, join_all(reports)).await else {
            break RampStop::TimeBudget(plan.budget);
        };
        let first_error = reports.into_iter().find_map(|report| match report {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(format!("{e:#}")),
            Err(_) => Some("a session task ended without reporting".to_owned()),
        });
        server.ensure_running()?;
        eprintln!(
            "  [{}] ramp: {} sessions held, RSS {:.1} MiB, {} threads, {:.1} s",
            server.kind,
            held.load(Ordering::SeqCst),
            kib_to_mib(server.rss_kib()?),
            server.threads()?,
            start.elapsed().as_secs_f64()
        );
        if let Some(error) = first_error {
            break RampStop::Failed(error);
        }
        let lost_now = lost.load(Ordering::SeqCst);
        if lost_now > 0 {
            break RampStop::SessionsLost(lost_now);
        }
        if at_idle_sessions.is_none() && requested == plan.idle_sessions {
            settling += SETTLE;
            sleep(SETTLE).await;
            at_idle_sessions = Some((held.load(Ordering::SeqCst), server.rss_kib()?));
        }
        if tokio::time::Instant::now() >= deadline {
            break RampStop::TimeBudget(plan.budget);
        }
    };
    let elapsed = start.elapsed().saturating_sub(settling);
    sleep(SETTLE).await;
    server.ensure_running()?;
    let max_held = held.load(Ordering::SeqCst);
    let rss_at_max_kib = server.rss_kib()?;
    let threads_at_max = server.threads()?;

    let _ = release.send(true);
    let drained = timeout(RELEASE_TIMEOUT, async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        eprintln!(
            "  [{}] {} sessions did not close within {RELEASE_TIMEOUT:?}; dropping them",
            server.kind,
            tasks.len()
        );
        tasks.abort_all();
    }
    Ok(Ramp {
        baseline_rss_kib,
        at_idle_sessions,
        max_held,
        rss_at_max_kib,
        threads_at_max,
        stop,
        elapsed,
    })
}

/// One session of the ramp: open and reset it (at most [`RAMP_OPEN_CONCURRENCY`]
/// at once), report, then hold it, reading (so pings are answered) until released.
async fn hold_session(
    port: u16,
    opening: Arc<Semaphore>,
    report: oneshot::Sender<Result<()>>,
    mut released: watch::Receiver<bool>,
    held: Arc<AtomicUsize>,
    lost: Arc<AtomicUsize>,
) {
    let opened = async {
        let _permit = opening.acquire().await?;
        Session::open(port).await
    };
    let mut session = match opened.await {
        Ok(session) => session,
        Err(e) => {
            let _ = report.send(Err(e));
            return;
        }
    };
    held.fetch_add(1, Ordering::SeqCst);
    let _ = report.send(Ok(()));
    while !*released.borrow_and_update() {
        tokio::select! {
            changed = released.changed() => {
                if changed.is_err() {
                    break;
                }
            }
            frame = session.ws.next() => match frame {
                Some(Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => {}
                _ => {
                    held.fetch_sub(1, Ordering::SeqCst);
                    lost.fetch_add(1, Ordering::SeqCst);
                    return;
                }
            }
        }
    }
    session.close().await;
}

/// KiB to MiB.
pub fn kib_to_mib(kib: u64) -> f64 {
    #[expect(
        clippy::cast_precision_loss,
        reason = "memory sizes are far below 2^52"
    )]
    let kib = kib as f64;
    kib / 1024.0
}
