//! Asynchronous rollouts (`rollout.mode = "async"`): groups of episodes play
//! continuously on the engine's policy slot, into a bounded buffer, while the learner
//! learns from the groups that finished first.
//!
//! - **Staleness control** (as AReaL's): the g-th group this producer starts (from 0)
//!   waits until the learner has published `g / prompts_per_step − max_staleness`
//!   updates, so at most `max_staleness + 1` steps' worth of groups are in flight or
//!   buffered, and a group taken in the order it started is at most `max_staleness`
//!   updates old. Groups finish out of order (a long answer holds its group back), so
//!   the trainer also checks each token: one sampled more than `max_staleness` updates
//!   before the learner's weights is masked out of the loss, and the rest are
//!   corrected by TIS (and MIS, when configured).
//! - **Partial rollouts:** weight updates go into the policy slot while groups play; a
//!   generation in progress continues on the new weights from its next token, and
//!   every token records the slot version that sampled it (with its log-probability
//!   under those weights).
//! - **Continuous batching:** a new group starts whenever the episodes still playing
//!   leave room for its `group_size` under `rollout.concurrency`, counted by episode,
//!   not by group: a group waiting on one long answer holds one place, not
//!   `group_size`, so the engine keeps decoding a full batch while long answers
//!   finish, instead of waiting for the slowest sample of each step or group.
//!
//! Which groups finish first depends on timing, so an asynchronous run is not
//! reproducible bit for bit (a synchronous one is). Each group's task and sampling
//! seed come from its position in the run's task sequence; a checkpoint records where
//! the producer should go on, and groups in flight when a run stops are not replayed.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use agentstack_harness::prompt::Presenter;
use agentstack_harness::{EnvHandle, Episode};
use tokio::sync::{Notify, mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};

use super::TrainError;
use super::rollout::{Player, loop_config, mix, reset_at};
use crate::config::TrainConfig;

/// One finished group: `group_size` episodes of the task at `position`.
#[derive(Debug)]
pub(super) struct Group {
    /// Its place in the run's task sequence.
    pub(super) position: u64,
    /// Its episodes, in sample order.
    pub(super) episodes: Vec<Episode>,
    /// The policy slot's version when it started.
    pub(super) started_version: u64,
    /// Seconds from its start to its last episode's end.
    pub(super) seconds: f64,
}

/// The producer of a run's groups. Dropping it stops the rollouts in flight.
pub(super) struct Producer {
    groups: mpsc::Receiver<Result<Group, TrainError>>,
    learned: watch::Sender<u64>,
    task: JoinHandle<()>,
}

/// What the producer's loop needs.
pub(super) struct ProducerSetup {
    pub(super) config: Arc<TrainConfig>,
    /// Where the episodes play.
    pub(super) player: Player,
    pub(super) env: Arc<EnvHandle>,
    pub(super) presenter: Arc<Presenter>,
    /// The first position to play.
    pub(super) first_position: u64,
    /// The policy slot's current version, which the trainer updates on every push.
    pub(super) version: Arc<AtomicU64>,
}

impl Producer {
    /// Starts playing groups from `setup.first_position` on.
    pub(super) fn start(setup: ProducerSetup) -> Self {
        let per_step = setup.config.rollout.prompts_per_step;
        let k = setup.config.rollout.max_staleness;
        // Never more than the staleness window holds, so sends rarely wait.
        let (sender, groups) = mpsc::channel(per_step * (k + 1));
        let (learned, updates) = watch::channel(0);
        let task = tokio::spawn(produce(setup, sender, updates));
        Self {
            groups,
            learned,
            task,
        }
    }

    /// The next group to finish (waiting for one when none is buffered).
    pub(super) async fn next(&mut self) -> Result<Group, TrainError> {
        match self.groups.recv().await {
            Some(group) => group,
            None => Err(TrainError::Config(
                "the asynchronous rollouts stopped unexpectedly".into(),
            )),
        }
    }

    /// The learner has published one more update, which lets more groups start.
    pub(super) fn learned(&self) {
        self.learned.send_modify(|updates| *updates += 1);
    }
}

impl Drop for Producer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Whether group number `started` (from 0) may start after `updates` published
/// updates: see the [module docs](self).
fn may_start(started: u64, updates: u64, per_step: u64, max_staleness: u64) -> bool {
    started < per_step * (updates + max_staleness + 1)
}

/// The episodes playing, counted against `rollout.concurrency`.
#[derive(Default)]
struct Playing {
    episodes: AtomicUsize,
    /// Woken when an episode ends.
    ended: Notify,
}

/// One episode's place under the concurrency, given back when it is dropped: when the
/// episode ends, fails, or its group's task is aborted.
struct Place(Arc<Playing>);

impl Place {
    /// Takes `n` places.
    fn take(playing: &Arc<Playing>, n: usize) -> Vec<Self> {
        playing.episodes.fetch_add(n, Ordering::AcqRel);
        (0..n).map(|_| Self(playing.clone())).collect()
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.0.episodes.fetch_sub(1, Ordering::AcqRel);
        self.0.ended.notify_one();
    }
}

/// Whether a group of `group_size` may start beside `playing` episodes: when they
/// leave room under `concurrency`, or none play (a group larger than the concurrency
/// still runs, alone).
fn has_room(playing: usize, group_size: usize, concurrency: usize) -> bool {
    playing == 0 || playing + group_size <= concurrency
}

/// The producer's loop: start groups while the staleness window and the concurrency
/// allow, hand finished ones to the learner in the order they finish.
async fn produce(
    setup: ProducerSetup,
    sender: mpsc::Sender<Result<Group, TrainError>>,
    mut updates: watch::Receiver<u64>,
) {
    let config = setup.config.clone();
    let rollout = &config.rollout;
    let (per_step, k) = (
        rollout.prompts_per_step as u64,
        rollout.max_staleness as u64,
    );
    let group_size = rollout.group_size;
    let setup = Arc::new(setup);
    let playing = Arc::new(Playing::default());
    let mut running: JoinSet<Result<Group, TrainError>> = JoinSet::new();
    let (mut started, mut position) = (0u64, setup.first_position);
    loop {
        loop {
            let room = has_room(
                playing.episodes.load(Ordering::Acquire),
                group_size,
                rollout.concurrency,
            );
            if !room || !may_start(started, *updates.borrow(), per_step, k) {
                break;
            }
            let places = Place::take(&playing, group_size);
            running.spawn(play_group(setup.clone(), position, places));
            started += 1;
            position += 1;
        }
        tokio::select! {
            // An episode ended: its place may let the next group start.
            () = playing.ended.notified() => {}
            Some(done) = running.join_next(), if !running.is_empty() => {
                let group = done.unwrap_or_else(|e| {
                    Err(TrainError::Config(format!("a rollout group's task failed: {e}")))
                });
                let failed = group.is_err();
                if sender.send(group).await.is_err() || failed {
                    return;
                }
            }
            changed = updates.changed() => {
                if changed.is_err() {
                    return;
                }
            }
        }
    }
}

/// Plays the `group_size` episodes of the task at `position`, at once, each holding
/// one of `places` until it ends.
async fn play_group(
    setup: Arc<ProducerSetup>,
    position: u64,
    places: Vec<Place>,
) -> Result<Group, TrainError> {
    let config = &setup.config;
    let started_version = setup.version.load(Ordering::Acquire);
    let t = Instant::now();
    let reset = reset_at(
        config,
        &setup.env,
        position,
        format!("train-async-{position}"),
    )?;
    let play_config = loop_config(config);
    let episodes =
        futures_util::future::join_all(places.into_iter().enumerate().map(|(i, place)| {
            let (reset, play_config) = (reset.clone(), &play_config);
            let seed = mix(&[config.seed, 0xa5c0, position, i as u64]);
            let setup = setup.clone();
            async move {
                let episode = setup
                    .player
                    .play(&setup.env, &setup.presenter, reset, seed, play_config)
                    .await;
                drop(place);
                episode
            }
        }))
        .await;
    let episodes = episodes.into_iter().collect::<Result<Vec<_>, _>>()?;
    Ok(Group {
        position,
        episodes,
        started_version,
        seconds: t.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::Ordering;

    use super::{Place, Playing, has_room, may_start};

    /// Places are counted by episode: a group whose other episodes ended holds only the
    /// places of those still playing, and an aborted group gives all of its back.
    #[test]
    fn places_are_held_by_the_episodes_still_playing() {
        let playing = Arc::new(Playing::default());
        let mut first = Place::take(&playing, 8);
        assert!(!has_room(8, 8, 12));
        // Seven of the first group's eight episodes end; one long answer plays on.
        first.truncate(1);
        assert_eq!(playing.episodes.load(Ordering::Acquire), 1);
        assert!(
            has_room(1, 8, 12),
            "one long answer must not hold a group's places"
        );
        let second = Place::take(&playing, 8);
        assert_eq!(playing.episodes.load(Ordering::Acquire), 9);
        drop(second);
        drop(first);
        assert_eq!(playing.episodes.load(Ordering::Acquire), 0);
        // A group larger than the concurrency still runs when nothing else does.
        assert!(has_room(0, 16, 8));
        assert!(!has_room(1, 16, 8));
    }

    /// With groups taken in the order they start, none is more than `max_staleness`
    /// updates old when the learner takes it, and the window holds `k + 1` steps.
    #[test]
    fn the_window_bounds_the_staleness_of_groups_taken_in_order() {
        for (per_step, k) in [(1u64, 1u64), (2, 1), (3, 2), (4, 3)] {
            // Group g starts after the fewest updates that allow it.
            let start_updates = |g: u64| (0..).find(|&u| may_start(g, u, per_step, k)).unwrap();
            for g in 0..40 {
                // Step s (after s updates) takes groups s·per_step .. (s+1)·per_step.
                let taken_at = g / per_step;
                let staleness = taken_at - start_updates(g).min(taken_at);
                assert!(staleness <= k, "per_step {per_step}, k {k}, group {g}");
                assert!(
                    start_updates(g) <= taken_at,
                    "a group starts before it is needed"
                );
            }
            assert!(may_start(per_step * (k + 1) - 1, 0, per_step, k));
            assert!(!may_start(per_step * (k + 1), 0, per_step, k));
        }
    }
}
