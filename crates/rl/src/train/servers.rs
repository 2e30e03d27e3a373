//! Rollouts on `agentstack model serve` processes (`rollout.servers`), surviving the
//! death of any of them.
//!
//! - Each episode plays on the least busy server that is up, through the OpenAI client
//!   that asks for token ids and log-probabilities, so the learner gets the ids the
//!   server sampled. Requests name the run's adapters (`sync.name`, else the run id).
//! - A server that cannot be reached, or answers 5xx, is marked down, and the episodes
//!   it was playing are played again from their start on the others: an episode is
//!   learned from whole or not at all, so no group is lost or counted twice.
//! - A watcher polls a down server's `/health`. Once it answers (restarted by its
//!   supervisor, e.g. the compute layer's job group), the current adapters are pushed
//!   to it (`POST /v1/adapters`) before it takes episodes again.
//! - After every step the adapters are saved and pushed to every server that is up; one
//!   that fails the push is marked down the same way, and the run goes on. The run
//!   fails only when no server comes back within `sync.wait_seconds`.
//!
//! The servers do not say which adapter version sampled a token, so an asynchronous run
//! counts each of their tokens at the version its group started under: the oldest it
//! can be, since a server only ever gets newer adapters.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use agentstack_harness::episode::{EpisodeError, LoopConfig, play};
use agentstack_harness::model::ModelError;
use agentstack_harness::prompt::Presenter;
use agentstack_harness::{EnvHandle, Episode, ModelClient};
use agentstack_model::server::ApiKey;
use agentstack_protocol::http::ResetRequest;
use agentstack_static::with_causes;
use serde_json::json;
use tokio::sync::Notify;

use super::TrainError;
use super::error::tensors;
use super::sync::push_adapter;
use crate::lora::Lora;

/// How long one model call to a server may take before it counts as failed.
const CALL_TIMEOUT: Duration = Duration::from_secs(300);

/// How often a watcher asks a down server whether it is back.
const POLL: Duration = Duration::from_millis(500);

/// How long an adapter push keeps retrying a server before it counts as down.
const PUSH_WAIT: Duration = Duration::from_secs(5);

/// One rollout server.
struct Member {
    /// Its base URL (`http://host:port`).
    base: String,
    client: ModelClient,
    up: AtomicBool,
    /// Episodes it is playing.
    busy: AtomicUsize,
    /// When it went down, while it is.
    down_since: Mutex<Option<Instant>>,
}

/// The rollout servers of a run. See the [module docs](self).
pub(super) struct ServerPool {
    members: Vec<Arc<Member>>,
    http: reqwest::Client,
    key: Option<ApiKey>,
    /// The adapters' name on the servers.
    name: String,
    /// The file they load the adapters from.
    path: PathBuf,
    /// How long an episode waits for a server to be up.
    wait: Duration,
    /// Woken when a server comes back.
    back: Notify,
    /// Episodes played again after their server failed, since the last [`Self::take_counts`].
    replayed: AtomicUsize,
    /// Seconds from each failure to the server's return, since the last take.
    recoveries: Mutex<Vec<f64>>,
}

impl ServerPool {
    /// A pool of `servers` (base URLs), whose requests and pushes bear `key`, for the
    /// adapters named `name` saved at `path`; episodes wait up to `wait` for a server.
    pub(super) fn new(
        servers: &[String],
        key: Option<ApiKey>,
        name: String,
        path: PathBuf,
        wait: Duration,
    ) -> Arc<Self> {
        let members = servers
            .iter()
            .map(|url| {
                let base = url.trim_end_matches('/').trim_end_matches("/v1").to_owned();
                let client = ModelClient::openai(
                    &format!("{base}/v1"),
                    &name,
                    key.as_ref().map(|k| k.expose().to_owned()),
                    CALL_TIMEOUT,
                );
                Arc::new(Member {
                    base,
                    client,
                    up: AtomicBool::new(true),
                    busy: AtomicUsize::new(0),
                    down_since: Mutex::new(None),
                })
            })
            .collect();
        Arc::new(Self {
            members,
            http: reqwest::Client::new(),
            key,
            name,
            path,
            wait,
            back: Notify::new(),
            replayed: AtomicUsize::new(0),
            recoveries: Mutex::new(Vec::new()),
        })
    }

    /// Servers up now.
    pub(super) fn up(&self) -> usize {
        self.members
            .iter()
            .filter(|m| m.up.load(Ordering::Acquire))
            .count()
    }

    /// Episodes played again and the servers' recovery times (seconds) since the last
    /// call.
    pub(super) fn take_counts(&self) -> (usize, Vec<f64>) {
        let replayed = self.replayed.swap(0, Ordering::AcqRel);
        let recoveries = std::mem::take(&mut *self.recoveries.lock().expect("recoveries lock"));
        (replayed, recoveries)
    }

    /// Saves `lora` and pushes it to every server that is up (at once); a server that
    /// fails is marked down. Fails only when no server is up afterwards and none comes
    /// back within the wait. The milliseconds it took.
    pub(super) async fn push(self: &Arc<Self>, lora: &Lora) -> Result<f64, TrainError> {
        let t = Instant::now();
        lora.save(&self.path)
            .map_err(tensors("write", &self.path))?;
        let pushes = self
            .members
            .iter()
            .filter(|m| m.up.load(Ordering::Acquire))
            .map(|member| async move { (member, self.push_to(member).await) });
        for (member, result) in futures_util::future::join_all(pushes).await {
            if let Err(e) = result {
                self.mark_down(member, &with_causes(&e));
            }
        }
        if self.up() == 0 {
            self.wait_for_one().await?;
        }
        Ok(t.elapsed().as_secs_f64() * 1e3)
    }

    /// Pushes the saved adapters to one server.
    async fn push_to(&self, member: &Member) -> Result<(), TrainError> {
        let body = json!({"name": self.name, "path": self.path});
        push_adapter(
            &self.http,
            &member.base,
            self.key.as_ref(),
            &body,
            PUSH_WAIT,
        )
        .await
    }

    /// Plays one episode on a server that is up, again on another when its server
    /// fails.
    pub(super) async fn play(
        self: &Arc<Self>,
        env: &EnvHandle,
        presenter: &Presenter,
        reset: ResetRequest,
        seed: u64,
        config: &LoopConfig,
    ) -> Result<Episode, TrainError> {
        loop {
            let member = match self.pick() {
                Some(member) => member,
                None => {
                    self.wait_for_one().await?;
                    continue;
                }
            };
            member.busy.fetch_add(1, Ordering::AcqRel);
            let played = play(&member.client, env, presenter, reset.clone(), seed, config).await;
            member.busy.fetch_sub(1, Ordering::AcqRel);
            match played {
                Ok((episode, _)) => return Ok(episode),
                Err(EpisodeError::Model(e)) if server_failed(&e) => {
                    self.mark_down(&member, &with_causes(&e));
                    self.replayed.fetch_add(1, Ordering::AcqRel);
                }
                Err(e) => return Err(TrainError::Episode(Box::new(e))),
            }
        }
    }

    /// The least busy server that is up.
    fn pick(&self) -> Option<Arc<Member>> {
        self.members
            .iter()
            .filter(|m| m.up.load(Ordering::Acquire))
            .min_by_key(|m| m.busy.load(Ordering::Acquire))
            .cloned()
    }

    /// Waits until some server is up, for at most the pool's wait.
    async fn wait_for_one(&self) -> Result<(), TrainError> {
        let deadline = Instant::now() + self.wait;
        while self.up() == 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(TrainError::Sync(format!(
                    "no rollout server is up ({}) and none came back within {} s; sync.wait_seconds sets how long to wait",
                    self.members
                        .iter()
                        .map(|m| m.base.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                    self.wait.as_secs()
                )));
            }
            // A wake-up between the check and the wait is not lost: the poll is short.
            let _ = tokio::time::timeout(left.min(POLL), self.back.notified()).await;
        }
        Ok(())
    }

    /// Marks `member` down (once) and starts its watcher.
    fn mark_down(self: &Arc<Self>, member: &Arc<Member>, why: &str) {
        if !member.up.swap(false, Ordering::AcqRel) {
            return;
        }
        *member.down_since.lock().expect("down_since lock") = Some(Instant::now());
        tracing::warn!(server = %member.base, error = %why, "rollout server failed; its episodes go to the others until it is back");
        tokio::spawn(watch(Arc::downgrade(self), member.clone()));
    }
}

/// Polls a down server until it answers `/health` and takes the current adapters, then
/// marks it up. Ends when the pool is gone.
async fn watch(pool: Weak<ServerPool>, member: Arc<Member>) {
    let health = format!("{}/health", member.base);
    loop {
        tokio::time::sleep(POLL).await;
        let Some(pool) = pool.upgrade() else {
            return;
        };
        let answered = pool
            .http
            .get(&health)
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if !answered || pool.push_to(&member).await.is_err() {
            continue;
        }
        let since = member
            .down_since
            .lock()
            .expect("down_since lock")
            .take()
            .map_or(0.0, |t| t.elapsed().as_secs_f64());
        pool.recoveries.lock().expect("recoveries lock").push(since);
        member.up.store(true, Ordering::Release);
        pool.back.notify_waiters();
        tracing::info!(server = %member.base, down_s = since, "rollout server is back with the current adapters");
        return;
    }
}

/// Whether a model call failed because of its server (unreachable, gone mid-request,
/// timed out, 5xx, or no longer holding the run's adapters: a server restarted between
/// two polls answers `model_not_found` until the watcher pushes them again), so another
/// server should play the episode.
fn server_failed(e: &ModelError) -> bool {
    match e {
        ModelError::Http { .. } => true,
        ModelError::Status { status, body, .. } => {
            *status >= 500 || (*status == 404 && body.contains("\"model_not_found\""))
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only failures of the server itself move an episode elsewhere (a server that lost
    /// the run's adapters among them): an answer that is not a chat completion, or
    /// another 4xx (a bad request, a missing route), ends the run.
    #[test]
    fn only_server_failures_move_an_episode() {
        let status = |status| ModelError::Status {
            url: "u".into(),
            status,
            body: String::new(),
            hint: String::new(),
        };
        assert!(server_failed(&status(503)));
        let lost = ModelError::Status {
            url: "u".into(),
            status: 404,
            body: r#"{"error":{"message":"the model `run` is not served here","type":"invalid_request_error","param":"model","code":"model_not_found"}}"#.into(),
            hint: String::new(),
        };
        assert!(server_failed(&lost), "a restarted server lost the adapters");
        assert!(server_failed(&status(502)));
        assert!(!server_failed(&status(400)));
        assert!(!server_failed(&status(404)));
        assert!(!server_failed(&ModelError::Reply {
            url: "u".into(),
            message: "m".into(),
        }));
    }
}
