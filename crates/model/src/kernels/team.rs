//! A team of spinning threads for the parallel regions of one forward pass.
//!
//! A prefill of a 30-layer model runs a few hundred parallel regions (the matmuls,
//! the attention, the norms, residual adds and gating of every layer) with a little
//! serial work between them (rope, the cache writes), each region a fraction of a
//! millisecond. Rayon's workers go to sleep when they find no work for a few dozen
//! rounds, so every region pays a futex wake-up, and in a virtual machine the wake-up
//! of a halted vCPU, which costs tens of microseconds to milliseconds when the host is
//! busy. llama.cpp's thread pool spins instead; so does this team.
//!
//! [`with_team`] opens the team for the duration of a closure on the calling thread
//! (one forward pass). While it is open, the team's helper threads spin waiting for
//! work, and [`for_each_chunk_mut`] called on that thread hands its tasks out to them
//! and takes its own share. Each task is claimed by exactly one thread and writes only
//! its own chunk, so the result does not depend on which thread ran what. After the
//! team closes, the helpers keep spinning for [`GRACE`] (the next decode step opens it
//! again soon) and then park.
//!
//! `AGENTSTACK_SPIN=off` turns teams off, for a machine shared with other work.
//!
//! Only one team is open at a time. A forward pass that finds it taken (two passes on
//! two threads at once), or one on a thread outside a team, splits its work with rayon
//! as before.

use std::cell::Cell;
use std::mem::MaybeUninit;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock, TryLockError};
use std::thread::Thread;
use std::time::{Duration, Instant};

use rayon::prelude::*;

/// How long a helper keeps spinning after its team closed before it parks.
const GRACE: Duration = Duration::from_millis(5);

thread_local! {
    /// The number of threads (helpers and this one) of the team this thread has open,
    /// or 0.
    static OPEN: Cell<usize> = const { Cell::new(0) };
    /// Whether this thread is running a region's tasks: a region inside a task runs
    /// on this thread alone.
    static IN_REGION: Cell<bool> = const { Cell::new(false) };
}

/// What the helpers and the thread that opens a team share.
struct Shared {
    /// Threads in the open team, the opener included; 0 when closed. Helper `i`
    /// takes part while `i + 1 < size`.
    size: AtomicUsize,
    /// Bumped after each new job is published: what a spinning helper watches.
    epoch: AtomicU64,
    /// The job being run, or null. Only read between an increment and a decrement of
    /// `active`.
    job: AtomicPtr<Job<'static>>,
    /// Helpers that may be holding a pointer read from `job`.
    active: AtomicUsize,
}

/// The helper threads, started as teams need them; its lock is the one open team.
struct Helpers {
    threads: Vec<Thread>,
}

fn shared() -> &'static Shared {
    static SHARED: OnceLock<Shared> = OnceLock::new();
    SHARED.get_or_init(|| Shared {
        size: AtomicUsize::new(0),
        epoch: AtomicU64::new(0),
        job: AtomicPtr::new(std::ptr::null_mut()),
        active: AtomicUsize::new(0),
    })
}

fn helpers() -> &'static Mutex<Helpers> {
    static HELPERS: Mutex<Helpers> = Mutex::new(Helpers {
        threads: Vec::new(),
    });
    &HELPERS
}

/// One parallel region: `n` tasks, handed out by `next`.
struct Job<'a> {
    task: &'a (dyn Fn(usize) + Sync),
    n: usize,
    next: AtomicUsize,
    panicked: AtomicBool,
}

impl Job<'_> {
    /// Claims and runs tasks until none are left; a panic is recorded, not spread.
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.n {
                return;
            }
            if catch_unwind(AssertUnwindSafe(|| (self.task)(i))).is_err() {
                self.panicked.store(true, Ordering::Relaxed);
            }
        }
    }
}

/// Runs `f` with a team of `rayon::current_num_threads()` threads open on this thread
/// (see the module's documentation). With one thread, inside an open team, or when
/// another thread's team is open, it just runs `f`.
pub(crate) fn with_team<R>(f: impl FnOnce() -> R) -> R {
    let size = rayon::current_num_threads();
    if size <= 1 || OPEN.get() != 0 || !spin_on() {
        return f();
    }
    // A pass that panicked poisons the lock; the helpers it holds are still sound.
    let mut helpers = match helpers().try_lock() {
        Ok(helpers) => helpers,
        Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
        Err(TryLockError::WouldBlock) => return f(),
    };
    while helpers.threads.len() + 1 < size {
        let index = helpers.threads.len();
        let spawned = std::thread::Builder::new()
            .name(format!("agentstack-team-{index}"))
            .spawn(move || help(index));
        match spawned {
            Ok(handle) => helpers.threads.push(handle.thread().clone()),
            // Without a thread more, the team is smaller.
            Err(_) => break,
        }
    }
    let size = size.min(helpers.threads.len() + 1);
    shared().size.store(size, Ordering::SeqCst);
    for t in &helpers.threads[..size - 1] {
        t.unpark();
    }
    /// Closes the team when `f` returns or unwinds.
    struct Close;
    impl Drop for Close {
        fn drop(&mut self) {
            OPEN.set(0);
            shared().size.store(0, Ordering::SeqCst);
        }
    }
    OPEN.set(size);
    let _close = Close;
    f()
}

/// Set by [`stop_spinning`].
static STOPPED: AtomicBool = AtomicBool::new(false);

/// Whether teams are used: unless `AGENTSTACK_SPIN` says off (read once) or
/// [`stop_spinning`] was called.
fn spin_on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    !STOPPED.load(Ordering::Relaxed)
        && *ON.get_or_init(|| {
            super::memory::env_switch(agentstack_static::env_vars::AGENTSTACK_SPIN, "spinning")
        })
}

/// Opens no more teams in this process, as `AGENTSTACK_SPIN=off` does: for a process
/// whose other work shares the cores with its forward passes (an asynchronous
/// trainer's learner beside its rollouts), where a spinning helper takes a core from
/// that work. Teams already open run to their end; idle helpers park.
pub fn stop_spinning() {
    STOPPED.store(true, Ordering::Relaxed);
}

/// A helper's life: park until a team takes it, spin while it is open and for
/// [`GRACE`] after, running the tasks of each job it sees.
fn help(index: usize) {
    let shared = shared();
    // Not an epoch yet: a job published before this thread first looks is still run.
    let mut seen = u64::MAX;
    let mut closed_at: Option<Instant> = None;
    loop {
        if shared.size.load(Ordering::Acquire) > index + 1 {
            closed_at = None;
            let epoch = shared.epoch.load(Ordering::Acquire);
            if epoch == seen {
                std::hint::spin_loop();
                continue;
            }
            seen = epoch;
            // Announce before reading the pointer: the opener clears it and then waits
            // for `active` to fall to 0, so a pointer read here stays valid until the
            // decrement (both sides SeqCst: one of them sees the other's write).
            shared.active.fetch_add(1, Ordering::SeqCst);
            let job = shared.job.load(Ordering::SeqCst);
            if !job.is_null() {
                #[expect(unsafe_code, reason = "a job's pointer, guarded by `active`")]
                // SAFETY: the job lives on the stack of `for_each_index`, which clears
                // `shared.job` and then waits for `active` to be 0 before it returns or
                // unwinds; this thread incremented `active` before loading the pointer.
                unsafe { &*job }.work();
            }
            shared.active.fetch_sub(1, Ordering::SeqCst);
        } else {
            let since = *closed_at.get_or_insert_with(Instant::now);
            if since.elapsed() < GRACE {
                std::hint::spin_loop();
            } else {
                closed_at = None;
                // A wake-up between the check and the park is kept by the thread's token.
                std::thread::park();
            }
        }
    }
}

/// Runs `task(i)` for every `i` in `0..n` on the open team, the calling thread taking
/// its share, and returns when all have run. A task's panic is raised here.
fn for_each_index(n: usize, task: &(dyn Fn(usize) + Sync)) {
    let shared = shared();
    let job = Job {
        task,
        n,
        next: AtomicUsize::new(0),
        panicked: AtomicBool::new(false),
    };
    /// Withdraws the job and waits until no helper can be using it, also on unwind.
    struct Withdraw<'a>(&'a Shared);
    impl Drop for Withdraw<'_> {
        fn drop(&mut self) {
            self.0.job.store(std::ptr::null_mut(), Ordering::SeqCst);
            while self.0.active.load(Ordering::SeqCst) != 0 {
                std::hint::spin_loop();
            }
        }
    }
    /// Marks this thread as inside a region until the region ends.
    struct Region;
    impl Drop for Region {
        fn drop(&mut self) {
            IN_REGION.set(false);
        }
    }
    IN_REGION.set(true);
    let _region = Region;
    let erased: *const Job<'_> = &job;
    shared
        .job
        .store(erased.cast::<Job<'static>>().cast_mut(), Ordering::SeqCst);
    let withdraw = Withdraw(shared);
    shared.epoch.fetch_add(1, Ordering::Release);
    job.work();
    drop(withdraw);
    assert!(
        !job.panicked.load(Ordering::Relaxed),
        "a task of a parallel region panicked"
    );
}

/// The number of threads a parallel region on this thread runs on: the open team's
/// size, or rayon's.
pub(crate) fn threads() -> usize {
    match OPEN.get() {
        0 => rayon::current_num_threads(),
        size => size,
    }
}

/// `f(i, chunk)` for each `chunk_len`-long chunk of `data` (the last may be shorter),
/// on the open team when this thread has one, else with rayon.
pub(crate) fn for_each_chunk_mut<T: Send>(
    data: &mut [T],
    chunk_len: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    assert!(chunk_len > 0, "chunks of 0 elements");
    let n = data.len().div_ceil(chunk_len);
    if OPEN.get() == 0 {
        data.par_chunks_mut(chunk_len)
            .enumerate()
            .for_each(|(i, c)| f(i, c));
        return;
    }
    if n <= 1 || IN_REGION.get() {
        for (i, c) in data.chunks_mut(chunk_len).enumerate() {
            f(i, c);
        }
        return;
    }
    /// The buffer's start, shared by the tasks that each take their own chunk.
    struct Base<T>(*mut T);
    impl<T> Base<T> {
        fn at(&self, i: usize) -> *mut T {
            self.0.wrapping_add(i)
        }
    }
    #[expect(
        unsafe_code,
        reason = "disjoint chunks of one buffer on several threads"
    )]
    // SAFETY: the pointer is only used to make disjoint `&mut [T]` chunks, one per
    // task, each claimed by one thread; `T: Send` lets a chunk move to another thread.
    unsafe impl<T: Send> Sync for Base<T> {}
    let len = data.len();
    let base = Base(data.as_mut_ptr());
    let task = |i: usize| {
        let start = i * chunk_len;
        let end = len.min(start + chunk_len);
        #[expect(unsafe_code, reason = "a task's own chunk of the buffer")]
        // SAFETY: `start..end` lies within `data` (i < n), chunks of different `i` do
        // not overlap, each `i` runs once, and `data` is borrowed mutably for the whole
        // call, which returns only after every task has finished.
        let chunk = unsafe { std::slice::from_raw_parts_mut(base.at(start), end - start) };
        f(i, chunk);
    };
    for_each_index(n, &task);
}

/// `f(item)` for every item of `items`, on a team opened for the call (or the one this
/// thread has open) when teams are in use; otherwise one after another on this thread,
/// not on rayon's pool, which other work of the process (an asynchronous trainer's
/// learner) may be holding. For work between forward passes (the engine's sampling of
/// each sequence's next token), which would otherwise leave the helpers spinning idle.
pub(crate) fn for_each_item<T: Send>(items: &mut [T], f: impl Fn(&mut T) + Sync) {
    if items.len() <= 1 {
        items.iter_mut().for_each(&f);
        return;
    }
    with_team(|| {
        if OPEN.get() == 0 {
            items.iter_mut().for_each(&f);
        } else {
            for_each_chunk_mut(items, 1, |_, chunk| chunk.iter_mut().for_each(&f));
        }
    });
}

/// A new buffer of `len` values, chunk `i` (`chunk_len` long, the last may be
/// shorter) set to `T::default()` (zero) and then filled by `f(i, chunk)` on the open
/// team (see [`for_each_chunk_mut`]): the zeroing runs in the tasks, beside the writes,
/// instead of on this thread before the region (a prefill's outputs are megabytes).
pub(crate) fn collect_chunks<T: Default + Send>(
    len: usize,
    chunk_len: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) -> Vec<T> {
    let mut out: Vec<MaybeUninit<T>> = Vec::with_capacity(len);
    #[expect(unsafe_code, reason = "a buffer initialized by the tasks")]
    // SAFETY: the capacity is `len`, and `MaybeUninit` values need no initialization.
    unsafe {
        out.set_len(len)
    };
    for_each_chunk_mut(&mut out, chunk_len.max(1), |i, chunk| {
        for v in chunk.iter_mut() {
            v.write(T::default());
        }
        #[expect(unsafe_code, reason = "a chunk just initialized")]
        // SAFETY: every value of the chunk was written just above, and
        // `MaybeUninit<T>` has `T`'s layout.
        let chunk =
            unsafe { std::slice::from_raw_parts_mut(chunk.as_mut_ptr().cast::<T>(), chunk.len()) };
        f(i, chunk);
    });
    let mut out = std::mem::ManuallyDrop::new(out);
    #[expect(unsafe_code, reason = "the buffer, every value initialized")]
    // SAFETY: `for_each_chunk_mut` returned, so every chunk's task ran and initialized
    // its values (a task's panic is raised before this point); the pointer, length and
    // capacity are the vector's, of a type with `T`'s layout, and `out` is not dropped.
    unsafe {
        Vec::from_raw_parts(out.as_mut_ptr().cast::<T>(), out.len(), out.capacity())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
    }

    /// After `stop_spinning`, a pass opens no team (nextest runs each test in its own
    /// process, so the switch stays in this one), and its regions still cover every
    /// chunk, split with rayon.
    #[test]
    fn stop_spinning_opens_no_more_teams() {
        pool(2).install(|| {
            if spin_on() {
                assert_eq!(with_team(|| OPEN.get()), 2, "a team of two before");
            }
            stop_spinning();
            assert_eq!(with_team(|| OPEN.get()), 0, "no team after");
            let mut data = vec![0usize; 100];
            with_team(|| for_each_chunk_mut(&mut data, 7, |i, c| c.fill(i + 1)));
            assert!(data.iter().enumerate().all(|(j, &v)| v == j / 7 + 1));
        });
    }

    /// Every chunk is written once, by index, on a team of 1, 2 and 3 threads and with
    /// no team; regions run back to back reuse the helpers.
    #[test]
    fn every_chunk_once() {
        for threads in [1, 2, 3] {
            pool(threads).install(|| {
                with_team(|| {
                    for round in 0..200 {
                        let mut data = vec![0usize; 1000 + round];
                        for_each_chunk_mut(&mut data, 7, |i, c| {
                            for v in c.iter_mut() {
                                *v += i + 1;
                            }
                        });
                        for (j, v) in data.iter().enumerate() {
                            assert_eq!(*v, j / 7 + 1, "round {round}, element {j}");
                        }
                    }
                })
            });
        }
        let mut data = vec![0u8; 10];
        for_each_chunk_mut(&mut data, 3, |i, c| c.fill(i as u8));
        assert_eq!(data, [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]);
    }

    /// A collected buffer is each chunk's task output over zeros, with a team of 1, 2
    /// and 3 threads and with none; empty buffers and a zero chunk length are fine.
    #[test]
    fn collected_chunks_start_zeroed() {
        let fill = |i: usize, c: &mut [u32]| {
            assert!(c.iter().all(|&v| v == 0));
            // Leaves the chunk's last value zero.
            let n = c.len().saturating_sub(1);
            c[..n].fill(i as u32 + 1);
        };
        let want = |len: usize, chunk: usize| -> Vec<u32> {
            (0..len)
                .map(|j| {
                    if j % chunk == chunk - 1 || j == len - 1 {
                        0
                    } else {
                        (j / chunk) as u32 + 1
                    }
                })
                .collect()
        };
        for threads in [1, 2, 3] {
            pool(threads).install(|| {
                with_team(|| {
                    for len in [1, 5, 1000, 4099] {
                        assert_eq!(collect_chunks(len, 64, fill), want(len, 64), "{len}");
                    }
                })
            });
        }
        assert_eq!(collect_chunks(300, 7, fill), want(300, 7));
        assert!(collect_chunks::<f32>(0, 0, |_, _| {}).is_empty());
    }

    /// Helpers take tasks: on a team of 2, a region whose tasks wait for each other
    /// finishes only if two threads run them at once.
    #[test]
    fn helpers_take_tasks() {
        pool(2).install(|| {
            with_team(|| {
                if threads() < 2 {
                    // Another test's team is open: nothing to check on this one.
                    return;
                }
                let arrived = AtomicUsize::new(0);
                let mut data = vec![0u8; 2];
                for_each_chunk_mut(&mut data, 1, |_, _| {
                    arrived.fetch_add(1, Ordering::SeqCst);
                    let start = Instant::now();
                    while arrived.load(Ordering::SeqCst) < 2 {
                        assert!(start.elapsed() < Duration::from_secs(10), "ran alone");
                        std::hint::spin_loop();
                    }
                });
            })
        });
    }

    /// A task's panic reaches the caller, and the team still works afterwards.
    #[test]
    fn a_panic_is_raised_and_the_team_survives() {
        pool(2).install(|| {
            let caught = catch_unwind(AssertUnwindSafe(|| {
                with_team(|| {
                    let mut data = vec![0u8; 64];
                    for_each_chunk_mut(&mut data, 1, |i, _| assert!(i != 40, "task 40"));
                })
            }));
            assert!(caught.is_err());
            with_team(|| {
                // Each test runs in its own process (nextest): no other team is open.
                assert_eq!(OPEN.get(), 2, "the team is not used after a panic");
                let mut data = vec![0u8; 64];
                for_each_chunk_mut(&mut data, 1, |i, c| c[0] = i as u8);
                assert!(data.iter().enumerate().all(|(i, &v)| v == i as u8));
            });
        });
    }
}
