//! Which adapters sample which step's batch.
//!
//! With `rollout.max_staleness = 0` each step's batch is sampled by the adapters as
//! they are when the step starts. With a staleness of 1 the batch of step k+1 is
//! played while step k learns, by the adapters from before step k learned (so
//! generation and learning overlap). The [`RolloutScheduler`] owns that state, the
//! batch started ahead and the adapters that sampled it, the way
//! text-embeddings-inference's batching queue owns its queue: the trainer only asks
//! it for a step's batch and tells it when a step has learned.
//!
//! Its invariant makes a killed run resume exactly: the adapters a checkpoint keeps
//! beside the current ones ([`RolloutScheduler::checkpoint_sampler`]) are those that
//! sampled the next step's batch. The batch itself dies with the process; a
//! scheduler made from the checkpoint samples it again with the same adapters, and
//! every rollout seed derives from the step, so it is the same batch.
//!
//! The scheduler is generic over the adapters `A` and the batch being played `B`
//! (the trainer's are a `Lora` and a rollout task), so it tests without a model.

/// The staleness state of a run's rollouts. See the [module docs](self).
#[derive(Debug)]
pub(super) struct RolloutScheduler<A, B> {
    /// Whether the next step's batch is played while this step learns.
    ahead: bool,
    /// Steps in the run (no batch is started past the last).
    steps: usize,
    /// The batch started ahead, with its step.
    pending: Option<(usize, B)>,
    /// The adapters that sampled (or, on a resume, will sample) the next step's batch.
    next_sampler: Option<A>,
}

impl<A, B> RolloutScheduler<A, B> {
    /// A scheduler for a run of `steps` with `max_staleness`; `next_sampler` is what
    /// the checkpoint resumed from kept (none on a fresh start).
    pub(super) fn new(max_staleness: usize, steps: usize, next_sampler: Option<A>) -> Self {
        Self {
            ahead: max_staleness > 0,
            steps,
            pending: None,
            next_sampler,
        }
    }

    /// The batch of `step`: the one started during the last step, or one that
    /// `start` begins now with the adapters the invariant names (one step ahead and
    /// just resumed: those the checkpoint kept; otherwise `current`).
    pub(super) fn batch<E>(
        &mut self,
        step: usize,
        current: &A,
        start: impl FnOnce(usize, &A) -> Result<B, E>,
    ) -> Result<B, E> {
        if let Some((started, batch)) = self.pending.take() {
            assert_eq!(started, step, "the batch started ahead is another step's");
            return Ok(batch);
        }
        let sampler = match &self.next_sampler {
            Some(kept) if self.ahead => kept,
            _ => current,
        };
        start(step, sampler)
    }

    /// Once `step`'s batch is in hand, before the step learns: one step ahead, starts
    /// the next step's batch with the adapters as they are now, `current`.
    pub(super) fn start_next<E>(
        &mut self,
        step: usize,
        current: &A,
        start: impl FnOnce(usize, &A) -> Result<B, E>,
    ) -> Result<(), E> {
        if self.ahead && step + 1 < self.steps {
            self.pending = Some((step + 1, start(step + 1, current)?));
        }
        Ok(())
    }

    /// A step has learned; `before` is a copy of the adapters from before it did
    /// (those [`Self::start_next`] sampled the next batch with).
    pub(super) fn learned(&mut self, before: A) {
        self.next_sampler = Some(before);
    }

    /// What a checkpoint keeps beside the current adapters: the adapters that sampled
    /// the next step's batch, when batches run one step ahead.
    pub(super) fn checkpoint_sampler(&self) -> Option<&A> {
        self.next_sampler.as_ref().filter(|_| self.ahead)
    }

    /// The batch started ahead and not taken (the run stopped), to be dropped.
    pub(super) fn take_pending(&mut self) -> Option<B> {
        self.pending.take().map(|(_, batch)| batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Adapters in these tests are versions: version k is the adapters after k steps.
    type Version = u32;

    /// What a step of a simulated run saw: its step and the version that sampled it.
    type Sampled = (usize, Version);

    /// Runs steps `from..to` of a run of `steps` the way the trainer drives the
    /// scheduler (batch, next batch, learn), resuming with `kept` (what the checkpoint
    /// after step `from` holds). Returns which version sampled each step's batch and
    /// what the checkpoint after the last step run keeps.
    fn run(
        max_staleness: usize,
        steps: usize,
        (from, to): (usize, usize),
        kept: Option<Version>,
    ) -> (Vec<Sampled>, Option<Version>, Option<Sampled>) {
        let mut scheduler = RolloutScheduler::new(max_staleness, steps, kept);
        let start = |step: usize, sampler: &Version| Ok::<_, ()>((step, *sampler));
        let mut sampled = Vec::new();
        for step in from..to {
            // The adapters as the step starts: `step` steps have learned.
            let adapters = step as Version;
            sampled.push(scheduler.batch(step, &adapters, start).unwrap());
            scheduler.start_next(step, &adapters, start).unwrap();
            // The step learns (version `step + 1`); the scheduler keeps the version
            // from before.
            scheduler.learned(adapters);
        }
        let kept = scheduler.checkpoint_sampler().copied();
        (sampled, kept, scheduler.take_pending())
    }

    #[test]
    fn synchronous_batches_are_sampled_by_the_current_adapters() {
        let (sampled, kept, pending) = run(0, 4, (0, 4), None);
        assert_eq!(sampled, [(0, 0), (1, 1), (2, 2), (3, 3)]);
        assert_eq!(
            kept, None,
            "a synchronous checkpoint keeps no second adapters"
        );
        assert_eq!(pending, None);
    }

    #[test]
    fn one_step_ahead_batches_are_sampled_before_the_last_step_learned() {
        let (sampled, kept, pending) = run(1, 4, (0, 4), None);
        // The first batch has no older adapters; each later one is one step stale.
        assert_eq!(sampled, [(0, 0), (1, 0), (2, 1), (3, 2)]);
        // The last step starts no batch past the run.
        assert_eq!(pending, None);
        assert_eq!(kept, Some(3));
    }

    #[test]
    fn a_stopped_run_has_the_next_batch_pending_and_keeps_its_sampler() {
        let (_, kept, pending) = run(1, 4, (0, 2), None);
        assert_eq!(
            pending,
            Some((2, 1)),
            "step 2's batch, sampled by version 1"
        );
        assert_eq!(
            kept,
            Some(1),
            "the checkpoint keeps the sampler of step 2's batch"
        );
    }

    /// The resume invariant: a run killed after any step and resumed from that step's
    /// checkpoint samples every later batch with the same adapters as a run never
    /// interrupted.
    #[test]
    fn a_resumed_run_samples_every_batch_as_an_uninterrupted_run() {
        const STEPS: usize = 6;
        for staleness in [0, 1, 2] {
            let (straight, _, _) = run(staleness, STEPS, (0, STEPS), None);
            for killed_after in 1..STEPS {
                let (before, kept, _) = run(staleness, STEPS, (0, killed_after), None);
                let (after, _, _) = run(staleness, STEPS, (killed_after, STEPS), kept);
                assert_eq!(
                    [before, after].concat(),
                    straight,
                    "staleness {staleness}, killed after step {killed_after}"
                );
            }
        }
    }

    /// Without the kept adapters (a checkpoint that lacks them) a resumed run falls
    /// back to the current adapters, and the resumed batch is fresher than it should
    /// be: what the invariant guards against.
    #[test]
    fn a_checkpoint_without_the_sampler_would_resume_differently() {
        let (straight, _, _) = run(1, 4, (0, 4), None);
        let (after, _, _) = run(1, 4, (2, 4), None);
        assert_eq!(after[0], (2, 2));
        assert_ne!(after[..], straight[2..]);
    }
}
