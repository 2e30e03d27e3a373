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
//! A server says which of its loads of the adapters sampled each token
//! (`weights_versions`; a generation in flight goes on with adapters pushed meanwhile,
//! so a long answer can span several). The pool records, per server, the trainer's
//! version of each push the server answered with its own version, and translates: the
//! learner gets every token at the trainer's version that sampled it, as from the
//! in-process engine. A token whose server version it cannot place (a server that does
//! not say, or a restart in between) leaves the episode's turn without versions, and
//! the asynchronous trainer counts it at the version its group started under: the
//! oldest it can be, since a server only ever gets newer adapters.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
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

/// The most pushes a server's version table remembers: far more steps than a token
/// may be stale.
const VERSIONS_KEPT: usize = 64;

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
    /// Its versions of the adapters → the trainer's, oldest first (since it last came
    /// up: a restarted server counts from 1 again).
    versions: Mutex<Versions>,
}

/// A server's adapter versions and the trainer's version each one holds.
#[derive(Debug, Default)]
struct Versions(Vec<(u64, u64)>);

impl Versions {
    /// The server loaded the trainer's version `trainer` as its version `server`.
    fn record(&mut self, server: u64, trainer: u64) {
        self.0.retain(|&(s, _)| s != server);
        self.0.push((server, trainer));
        if self.0.len() > VERSIONS_KEPT {
            self.0.remove(0);
        }
    }

    /// The trainer's versions of `server_versions`, or `None` when one is not known.
    fn translate(&self, server_versions: &[u64]) -> Option<Vec<u64>> {
        server_versions
            .iter()
            .map(|v| self.0.iter().find(|(s, _)| s == v).map(|&(_, t)| t))
            .collect()
    }

    /// Every turn of `episode` gets the trainer's versions of its tokens, or none.
    fn translate_episode(&self, episode: &mut Episode) {
        for turn in &mut episode.turns {
            let tokens = &mut turn.tokens;
            tokens.weights_versions = tokens
                .weights_versions
                .as_deref()
                .and_then(|v| self.translate(v));
        }
    }
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
    /// The trainer's version of the adapters last saved at `path`.
    version: AtomicU64,
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
                    versions: Mutex::default(),
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
            version: AtomicU64::new(0),
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

    /// Saves `lora`, the trainer's `version` of the adapters, and pushes it to every
    /// server that is up (at once); a server that fails is marked down. Fails only when
    /// no server is up afterwards and none comes back within the wait. The
    /// milliseconds it took.
    pub(super) async fn push(
        self: &Arc<Self>,
        lora: &Lora,
        version: u64,
    ) -> Result<f64, TrainError> {
        let t = Instant::now();
        lora.save(&self.path)
            .map_err(tensors("write", &self.path))?;
        // After the file: a watcher's push that reads this version loads this file or
        // a newer one, so a token is never counted newer than it is.
        self.version.store(version, Ordering::Release);
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

    /// Pushes the saved adapters to one server, and records which of the trainer's
    /// versions its answer's version holds.
    async fn push_to(&self, member: &Member) -> Result<(), TrainError> {
        let version = self.version.load(Ordering::Acquire);
        let body = json!({"name": self.name, "path": self.path});
        let loaded = push_adapter(
            &self.http,
            &member.base,
            self.key.as_ref(),
            &body,
            PUSH_WAIT,
        )
        .await?;
        if let Some(server) = loaded {
            member
                .versions
                .lock()
                .expect("versions lock")
                .record(server, version);
        }
        Ok(())
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
                Ok((mut episode, _)) => {
                    member
                        .versions
                        .lock()
                        .expect("versions lock")
                        .translate_episode(&mut episode);
                    return Ok(episode);
                }
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
        // Back up, it counts its versions from 1 again.
        member.versions.lock().expect("versions lock").0.clear();
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

    /// A server's versions become the trainer's that each push carried; a version the
    /// table does not hold (before the first push, or forgotten) leaves none.
    #[test]
    fn server_versions_translate_to_the_trainers() {
        let mut versions = Versions::default();
        versions.record(1, 0);
        versions.record(2, 1);
        versions.record(3, 1); // a watcher's push of the same adapters
        assert_eq!(versions.translate(&[1, 1, 2, 3]), Some(vec![0, 0, 1, 1]));
        assert_eq!(versions.translate(&[2, 4]), None);
        assert_eq!(versions.translate(&[]), Some(vec![]));
        for server in 4..4 + VERSIONS_KEPT as u64 {
            versions.record(server, server);
        }
        assert_eq!(versions.0.len(), VERSIONS_KEPT);
        assert_eq!(versions.translate(&[1]), None, "the oldest are forgotten");
        assert_eq!(versions.translate(&[4]), Some(vec![4]));
    }

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
