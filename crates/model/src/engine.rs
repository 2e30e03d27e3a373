//! Continuous batching: one thread owns the model and runs a loop in which every
//! running sequence advances together. Each pass takes one token from every decoding
//! sequence and fills the rest of a token budget with prompt chunks of new ones, so
//! long prompts do not stall other requests' decoding; a decoding sequence may also
//! bring a draft of its next tokens to verify (speculative decoding, [`crate::speculate`]),
//! where the measured cost of the pass says it pays. Requests join and leave between
//! passes; a request whose receiver is dropped (client gone) is cancelled at the next
//! pass; a full waiting queue refuses new work (back-pressure) instead of growing.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

use crate::LanguageModel;
use crate::error::{ModelError, Result};
use crate::generate::{GenerateOutput, GenerateRequest, Sequence, TokenEvent, common_prefix};
use candle_core::Tensor;

use crate::kernels;
use crate::model::{Model, SeqCache};
use crate::speculate::{PROBE_LEN, PassCosts, Speculation};

/// Limits of the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// Sequences decoded together at most.
    pub max_running: usize,
    /// Requests waiting for a slot at most; more are refused.
    pub max_waiting: usize,
    /// Tokens per forward pass at most (decode tokens plus prompt chunks).
    pub max_batch_tokens: usize,
    /// Bytes of finished sequences' KV caches kept for reuse (prefix caching); 0 turns
    /// it off. A request whose prompt starts with a kept sequence's tokens (the next
    /// turn of a conversation) runs only the rest through the model; so does one whose
    /// prompt starts like a running sequence's (a group of samples of one prompt).
    pub prefix_cache_bytes: usize,
    /// Speculative decoding for requests that do not choose
    /// ([`GenerateRequest::speculation`]); drafts run only where they pay.
    pub speculation: Speculation,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_running: 16,
            max_waiting: 256,
            max_batch_tokens: 512,
            prefix_cache_bytes: 1 << 30,
            speculation: Speculation::default(),
        }
    }
}

/// Which weights a cache was computed with: the base (`None`) or an adapter slot's
/// name and version.
type WeightsTag = Option<(String, u64)>;

/// Finished sequences' caches, most recently used last, within a byte budget. A cache
/// is reused only under the weights it was computed with.
struct PrefixPool {
    entries: Vec<(Vec<u32>, SeqCache, WeightsTag)>,
    bytes: usize,
    budget: usize,
}

/// Shorter shared prefixes are not worth a cache's memory.
const MIN_PREFIX_TOKENS: usize = 16;

impl PrefixPool {
    fn new(budget: usize) -> Self {
        Self {
            entries: Vec::new(),
            bytes: 0,
            budget,
        }
    }

    /// Takes the entry sharing the longest prefix with `prompt`, if any is worth it.
    fn take(&mut self, prompt: &[u32], tag: &WeightsTag) -> Option<(Vec<u32>, SeqCache)> {
        let (best, shared) = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, (_, _, t))| t == tag)
            .map(|(i, (tokens, _, _))| (i, common_prefix(tokens, prompt)))
            .max_by_key(|&(i, shared)| (shared, i))?;
        if shared < MIN_PREFIX_TOKENS {
            return None;
        }
        let (tokens, cache, _) = self.entries.remove(best);
        self.bytes -= cache.bytes();
        Some((tokens, cache))
    }

    fn put(&mut self, tokens: Vec<u32>, cache: SeqCache, tag: WeightsTag) {
        let bytes = cache.bytes();
        if tokens.len() < MIN_PREFIX_TOKENS || bytes > self.budget {
            return;
        }
        // A longer continuation of the same conversation makes its prefix redundant.
        self.entries.retain(|(t, c, w)| {
            let redundant = *w == tag && t.len() <= tokens.len() && tokens.starts_with(t);
            if redundant {
                self.bytes -= c.bytes();
            }
            !redundant
        });
        self.bytes += bytes;
        self.entries.push((tokens, cache, tag));
        while self.bytes > self.budget && !self.entries.is_empty() {
            let (_, evicted, _) = self.entries.remove(0);
            self.bytes -= evicted.bytes();
        }
    }
}

/// The adapter versions of a generation's `tokens` tokens, as its
/// [`Event::Token`]s gave them: one per token, or `None` (the base model has no
/// versions; a count that does not match is not used).
pub fn weights_versions(versions: Vec<u64>, tokens: usize) -> Option<Vec<u64>> {
    (tokens > 0 && versions.len() == tokens).then_some(versions)
}

/// What a request's receiver gets.
#[derive(Debug)]
pub enum Event {
    /// A generated token.
    Token(TokenEvent),
    /// The generation ended; the whole result.
    Done(GenerateOutput),
    /// The generation failed.
    Error(ModelError),
}

struct Job {
    request: GenerateRequest,
    events: UnboundedSender<Event>,
    slot: Option<Arc<Slot>>,
}

/// A named adapter's current weights. Replacing them bumps the version; sequences
/// already running continue on the new weights from their next token on (their
/// tokens' log-probabilities say which weights sampled them).
#[derive(Debug)]
struct Slot {
    name: String,
    model: RwLock<Arc<Model>>,
    version: AtomicU64,
}

impl Slot {
    /// The weights and their version, read together (the version changes only under
    /// the write lock, so a pair never mixes two updates).
    fn current(&self) -> (Arc<Model>, u64) {
        let model = self.model.read().expect("adapter slot lock");
        (model.clone(), self.version.load(Ordering::Acquire))
    }
}

/// A loaded adapter, as [`Engine::adapters`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterInfo {
    /// Its name; requests pick it by this name.
    pub name: String,
    /// How many times it was loaded or replaced (1 after the first load).
    pub version: u64,
}

/// A handle to a running engine; cheap to clone. The engine stops when the last handle
/// is dropped.
#[derive(Clone)]
pub struct Engine {
    queue: SyncSender<Job>,
    lm: Arc<LanguageModel>,
    waiting: Arc<AtomicUsize>,
    running: Arc<AtomicUsize>,
    reused: Arc<AtomicUsize>,
    config: EngineConfig,
    adapters: Arc<Mutex<HashMap<String, Arc<Slot>>>>,
    _thread: Arc<ThreadGuard>,
}

struct ThreadGuard(Option<JoinHandle<()>>);

impl Drop for ThreadGuard {
    fn drop(&mut self) {
        // The loop ends once every sender is gone; it is not joined here because the
        // last handle may be dropped on the engine thread's behalf.
        drop(self.0.take());
    }
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("config", &self.config)
            .field("waiting", &self.waiting.load(Ordering::Relaxed))
            .field("running", &self.running.load(Ordering::Relaxed))
            .finish()
    }
}

impl Engine {
    /// Starts the engine thread.
    pub fn start(lm: Arc<LanguageModel>, config: EngineConfig) -> Self {
        let (queue, jobs) = sync_channel(config.max_waiting.max(1));
        let waiting = Arc::new(AtomicUsize::new(0));
        let running = Arc::new(AtomicUsize::new(0));
        let reused = Arc::new(AtomicUsize::new(0));
        let thread = {
            let lm = lm.clone();
            let waiting = waiting.clone();
            let running = running.clone();
            let reused = reused.clone();
            std::thread::Builder::new()
                .name("agentstack-engine".into())
                .spawn(move || run(&lm, config, &jobs, &waiting, &running, &reused))
                .expect("spawning the engine thread")
        };
        Self {
            queue,
            lm,
            waiting,
            running,
            reused,
            config,
            adapters: Arc::default(),
            _thread: Arc::new(ThreadGuard(Some(thread))),
        }
    }

    /// Loads `model` (this engine's model with adapters applied, e.g. by
    /// [`crate::adapter::Adapter::apply`]) under `name`, or replaces the weights of the
    /// adapter of that name. Returns its new version. Requests submitted with
    /// [`Engine::submit_with`] and this name run on it.
    pub fn set_adapter(&self, name: &str, model: Model) -> u64 {
        let mut adapters = self.adapters.lock().expect("adapters lock");
        match adapters.get(name) {
            Some(slot) => {
                let mut weights = slot.model.write().expect("adapter slot lock");
                *weights = Arc::new(model);
                slot.version.fetch_add(1, Ordering::AcqRel) + 1
            }
            None => {
                adapters.insert(
                    name.to_owned(),
                    Arc::new(Slot {
                        name: name.to_owned(),
                        model: RwLock::new(Arc::new(model)),
                        version: AtomicU64::new(1),
                    }),
                );
                1
            }
        }
    }

    /// Unloads an adapter; requests already running on it finish on it. Whether it
    /// was loaded.
    pub fn remove_adapter(&self, name: &str) -> bool {
        self.adapters
            .lock()
            .expect("adapters lock")
            .remove(name)
            .is_some()
    }

    /// The loaded adapters, by name.
    pub fn adapters(&self) -> Vec<AdapterInfo> {
        let mut list: Vec<AdapterInfo> = self
            .adapters
            .lock()
            .expect("adapters lock")
            .values()
            .map(|slot| AdapterInfo {
                name: slot.name.clone(),
                version: slot.version.load(Ordering::Acquire),
            })
            .collect();
        list.sort_by(|a, b| a.name.cmp(&b.name));
        list
    }

    /// The model.
    pub fn model(&self) -> &LanguageModel {
        &self.lm
    }

    /// The limits.
    pub fn config(&self) -> EngineConfig {
        self.config
    }

    /// Requests waiting and running now.
    pub fn load(&self) -> (usize, usize) {
        (
            self.waiting.load(Ordering::Relaxed),
            self.running.load(Ordering::Relaxed),
        )
    }

    /// Prompt tokens taken from a cache (a finished sequence's, or a running one's with
    /// the same start) instead of being read by the model, since the engine started.
    pub fn reused_prompt_tokens(&self) -> usize {
        self.reused.load(Ordering::Relaxed)
    }

    /// Queues a request. The request is checked first (bad input is an error here, not
    /// an event). Fails with [`ModelError::InvalidRequest`] saying the server is
    /// overloaded when the waiting queue is full. Dropping the receiver cancels the request.
    pub fn submit(
        &self,
        request: GenerateRequest,
    ) -> Result<UnboundedReceiver<Event>, SubmitError> {
        self.submit_with(request, None)
    }

    /// [`Engine::submit`] on the weights of the adapter named `adapter` (the base
    /// model for `None`); an adapter that is not loaded is an error.
    pub fn submit_with(
        &self,
        request: GenerateRequest,
        adapter: Option<&str>,
    ) -> Result<UnboundedReceiver<Event>, SubmitError> {
        let slot = match adapter {
            None => None,
            Some(name) => Some(
                self.adapters
                    .lock()
                    .expect("adapters lock")
                    .get(name)
                    .cloned()
                    .ok_or_else(|| SubmitError::UnknownAdapter(name.to_owned()))?,
            ),
        };
        // Validate eagerly so the caller can answer 400 rather than stream an error.
        Sequence::new(&self.lm, request.clone()).map_err(SubmitError::Invalid)?;
        let (events, receiver) = unbounded_channel();
        self.waiting.fetch_add(1, Ordering::Relaxed);
        match self.queue.try_send(Job {
            request,
            events,
            slot,
        }) {
            Ok(()) => Ok(receiver),
            Err(TrySendError::Full(_)) => {
                self.waiting.fetch_sub(1, Ordering::Relaxed);
                Err(SubmitError::Overloaded {
                    waiting: self.config.max_waiting,
                })
            }
            Err(TrySendError::Disconnected(_)) => {
                self.waiting.fetch_sub(1, Ordering::Relaxed);
                Err(SubmitError::Stopped)
            }
        }
    }

    /// Runs a request to completion.
    pub async fn generate(&self, request: GenerateRequest) -> Result<GenerateOutput, SubmitError> {
        self.generate_with(request, None).await
    }

    /// Runs a request to completion on an adapter's weights (see
    /// [`Engine::submit_with`]).
    pub async fn generate_with(
        &self,
        request: GenerateRequest,
        adapter: Option<&str>,
    ) -> Result<GenerateOutput, SubmitError> {
        let mut events = self.submit_with(request, adapter)?;
        while let Some(event) = events.recv().await {
            match event {
                Event::Token(_) => {}
                Event::Done(out) => return Ok(out),
                Event::Error(e) => return Err(SubmitError::Failed(e)),
            }
        }
        Err(SubmitError::Stopped)
    }
}

/// Why a request was not accepted or did not finish.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// The request is invalid.
    #[error(transparent)]
    Invalid(ModelError),
    /// Too many requests are waiting.
    #[error("the server is overloaded: {waiting} requests are already waiting; retry later")]
    Overloaded {
        /// The queue's limit.
        waiting: usize,
    },
    /// The engine has stopped.
    #[error("the engine has stopped")]
    Stopped,
    /// No adapter of this name is loaded.
    #[error(
        "no adapter named `{0}` is loaded; load it first (POST /v1/adapters) or pick a loaded one (GET /v1/models)"
    )]
    UnknownAdapter(String),
    /// Generation failed.
    #[error(transparent)]
    Failed(ModelError),
}

struct Running {
    seq: Sequence,
    events: UnboundedSender<Event>,
    slot: Option<Arc<Slot>>,
    /// The weights it started on.
    tag: WeightsTag,
}

fn tag_of(slot: Option<&Arc<Slot>>) -> WeightsTag {
    slot.map(|s| (s.name.clone(), s.version.load(Ordering::Acquire)))
}

fn run(
    lm: &LanguageModel,
    config: EngineConfig,
    jobs: &Receiver<Job>,
    waiting: &AtomicUsize,
    running_count: &AtomicUsize,
    reused_count: &AtomicUsize,
) {
    let mut running: Vec<Running> = Vec::new();
    // Admitted, waiting for a sibling to finish reading the prompt they share.
    let mut deferred: Vec<Running> = Vec::new();
    let mut pool = PrefixPool::new(config.prefix_cache_bytes);
    let mut costs = PassCosts::default();
    loop {
        // Admit new work: block when idle, otherwise take what is there.
        while running.len() + deferred.len() < config.max_running.max(1) {
            let job = if running.is_empty() && deferred.is_empty() {
                match jobs.recv() {
                    Ok(job) => job,
                    Err(_) => return,
                }
            } else {
                match jobs.try_recv() {
                    Ok(job) => job,
                    Err(_) => break,
                }
            };
            waiting.fetch_sub(1, Ordering::Relaxed);
            let mut request = job.request;
            request.speculation.get_or_insert(config.speculation);
            match Sequence::new(lm, request) {
                Ok(seq) if seq.is_finished() => {
                    let _ = job.events.send(Event::Done(seq.output()));
                }
                Ok(mut seq) => {
                    let tag = tag_of(job.slot.as_ref());
                    if let Some((tokens, cache)) = pool.take(seq.prompt(), &tag) {
                        let reused = seq.reuse_prefix(cache, &tokens);
                        reused_count.fetch_add(reused, Ordering::Relaxed);
                        tracing::debug!(reused, "prefix cache hit");
                    }
                    deferred.push(Running {
                        seq,
                        events: job.events,
                        slot: job.slot,
                        tag,
                    });
                }
                Err(e) => {
                    let _ = job.events.send(Event::Error(e));
                }
            }
        }
        // Cancel those whose client went away.
        running.retain(|r| !r.events.is_closed());
        deferred.retain(|r| !r.events.is_closed());
        if config.prefix_cache_bytes > 0 {
            start_deferred(&mut running, &mut deferred, reused_count);
        } else {
            running.append(&mut deferred);
        }
        running_count.store(running.len() + deferred.len(), Ordering::Relaxed);
        if running.is_empty() {
            continue;
        }
        if let Err(error) = step(lm, config, &mut running, &mut costs) {
            tracing::error!(%error, "forward pass failed; failing its requests");
            for r in running.drain(..) {
                let _ = r
                    .events
                    .send(Event::Error(ModelError::InvalidRequest(format!(
                        "generation failed: {error}"
                    ))));
            }
        }
        let (done, still): (Vec<Running>, Vec<Running>) =
            running.into_iter().partition(|r| r.seq.is_finished());
        running = still;
        if config.prefix_cache_bytes > 0 {
            for r in done {
                // A cache whose weights changed on the way mixes two models: dropped.
                if tag_of(r.slot.as_ref()) == r.tag {
                    let (cache, tokens) = r.seq.into_cache();
                    pool.put(tokens, cache, r.tag);
                }
            }
        }
        running_count.store(running.len() + deferred.len(), Ordering::Relaxed);
    }
}

/// Where a new sequence's prompt can come from.
enum Share {
    /// A running sequence on the same weights has read this many of its first tokens.
    From(usize, usize),
    /// One is still reading them.
    Wait,
    /// None shares enough.
    Alone,
}

/// The running sequence whose prompt shares the most of `new`'s first tokens (at least
/// [`MIN_PREFIX_TOKENS`]), on the same weights, unchanged since it started. Only a
/// cache that can be cut at the shared prefix (the quantized form's) is worth waiting
/// for.
fn share_for(running: &[Running], new: &Running) -> Share {
    if !new.seq.cache().is_empty() || !new.seq.cache().can_truncate() {
        return Share::Alone;
    }
    let best = running
        .iter()
        .enumerate()
        .filter(|(_, r)| r.tag == new.tag && tag_of(r.slot.as_ref()) == r.tag)
        .map(|(i, r)| (common_prefix(r.seq.prompt(), new.seq.prompt()), i))
        .max();
    match best {
        Some((common, i)) if common >= MIN_PREFIX_TOKENS => {
            if running[i].seq.cache().len() >= common {
                Share::From(i, common)
            } else {
                Share::Wait
            }
        }
        _ => Share::Alone,
    }
}

/// Starts the deferred sequences that can start. One whose prompt begins like a running
/// sequence's waits until that one has read the shared tokens, then starts from a copy
/// of its cache: a GRPO group (or `n` > 1) sends the same prompt many times at once, and
/// each would otherwise read it in full. Reusing a prefix gives the same bits as reading
/// it (see [`Sequence::reuse_prefix`]), so results do not depend on who waited.
fn start_deferred(
    running: &mut Vec<Running>,
    deferred: &mut Vec<Running>,
    reused_count: &AtomicUsize,
) {
    let mut i = 0;
    while i < deferred.len() {
        match share_for(running, &deferred[i]) {
            Share::Wait => i += 1,
            Share::From(from, common) => {
                let mut r = deferred.remove(i);
                let source = &running[from].seq;
                match source.cache().fork() {
                    Ok(cache) => {
                        let reused = r.seq.reuse_prefix(cache, &source.prompt()[..common]);
                        reused_count.fetch_add(reused, Ordering::Relaxed);
                        tracing::debug!(reused, "shared a running sequence's prompt");
                    }
                    Err(error) => tracing::warn!(%error, "could not copy a prompt's cache"),
                }
                running.push(r);
            }
            Share::Alone => running.push(deferred.remove(i)),
        }
    }
}

/// Sequences (index, tokens to take) that run on the same weights.
type WeightsGroup = (Option<Arc<Slot>>, Vec<(usize, usize)>);

/// Gives the decoding sequences drafts to verify where they pay (see
/// [`crate::speculate`]), within the pass's token budget.
fn add_drafts(running: &mut [Running], budget: usize, costs: &PassCosts) {
    let decoding = running.iter().filter(|r| r.seq.is_decoding()).count();
    if decoding == 0 {
        return;
    }
    let mut rows = decoding;
    let mut room = budget.saturating_sub(decoding);
    for r in running.iter_mut().filter(|r| r.seq.is_decoding()) {
        let Some(candidate) = r.seq.draft_candidate(room) else {
            continue;
        };
        let available = candidate.tokens.len();
        let mut k = costs.draft_len(candidate.rate, available, rows, decoding);
        if k == 0 && candidate.probe {
            k = PROBE_LEN.min(available);
        }
        r.seq.propose(&candidate.tokens[..k]);
        rows += k;
        room -= k;
    }
}

/// One sequence's sampling after a pass: its rows of logits, and the tokens it drew.
struct Sampling<'a> {
    running: &'a mut Running,
    rows: Tensor,
    version: Option<u64>,
    events: Option<Result<Vec<TokenEvent>>>,
}

/// One forward pass over the running sequences.
fn step(
    lm: &LanguageModel,
    config: EngineConfig,
    running: &mut [Running],
    costs: &mut PassCosts,
) -> Result<()> {
    let mut budget = config.max_batch_tokens.max(1);
    add_drafts(running, budget, costs);
    // Decoding sequences first (one token each), then prompt chunks.
    let mut order: Vec<usize> = (0..running.len()).collect();
    order.sort_by_key(|&i| !running[i].seq.is_decoding());
    let mut chosen = Vec::new();
    for i in order {
        if budget == 0 {
            break;
        }
        let take = running[i].seq.pending().min(budget);
        budget -= take;
        chosen.push((i, take));
    }
    chosen.sort_unstable();
    // One forward pass per set of weights: the base, then each adapter in use.
    let mut groups: Vec<WeightsGroup> = Vec::new();
    for &(i, take) in &chosen {
        let slot = &running[i].slot;
        let same = |g: &Option<Arc<Slot>>| match (g, slot) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        match groups.iter_mut().find(|(g, _)| same(g)) {
            Some((_, members)) => members.push((i, take)),
            None => groups.push((slot.clone(), vec![(i, take)])),
        }
    }
    let mut results: Vec<((usize, usize), Tensor, Option<u64>)> = Vec::with_capacity(chosen.len());
    for (slot, members) in groups {
        let current = slot.as_ref().map(|s| s.current());
        let version = current.as_ref().map(|(_, v)| *v);
        let model = current.as_ref().map_or(lm.model(), |(m, _)| m.as_ref());
        // Only passes of decoding sequences (with their drafts) teach the cost of a
        // pass's rows; a prompt chunk's rows cost differently (no logits, long spans).
        let decoding = members.iter().all(|&(i, _)| running[i].seq.is_decoding());
        let rows: usize = members.iter().map(|&(_, take)| take).sum();
        let mut inputs = Vec::with_capacity(members.len());
        let mut taken = Vec::with_capacity(members.len());
        let mut next = members.iter().peekable();
        for (i, r) in running.iter_mut().enumerate() {
            if let Some(&&(j, take)) = next.peek()
                && i == j
            {
                next.next();
                let (input, n) = r.seq.input(take);
                inputs.push(input);
                taken.push((i, n));
            }
        }
        let started = std::time::Instant::now();
        let logits = model.forward(&mut inputs)?;
        if decoding {
            costs.record(rows, started.elapsed().as_secs_f64());
        }
        drop(inputs);
        results.extend(
            taken
                .into_iter()
                .zip(logits)
                .map(|(taken, row)| (taken, row, version)),
        );
    }
    // Each sequence samples from its own rows with its own sampler, so the sequences
    // sample side by side on the team (the same tokens as one after another); the
    // events then go out in order.
    let mut rows_of: Vec<Option<(usize, Tensor, Option<u64>)>> = vec![None; running.len()];
    for ((i, n), row, version) in results {
        rows_of[i] = Some((n, row, version));
    }
    let mut samplings: Vec<Sampling<'_>> = Vec::with_capacity(running.len());
    for (r, rows) in running.iter_mut().zip(rows_of) {
        if let Some((n, rows, version)) = rows
            && r.seq.consumed(n)
        {
            samplings.push(Sampling {
                running: r,
                rows,
                version,
                events: None,
            });
        }
    }
    kernels::team::for_each_item(&mut samplings, |s| {
        s.events = Some(
            s.rows
                .flatten_all()
                .and_then(|rows| rows.to_vec1::<f32>())
                .map_err(ModelError::from)
                .and_then(|rows| s.running.seq.sample_rows(lm, &rows)),
        );
    });
    for s in samplings {
        let r = s.running;
        match s.events.expect("every sequence sampled") {
            Ok(events) => {
                for mut event in events {
                    event.weights_version = s.version;
                    let done = event.finish.is_some();
                    if r.events.send(Event::Token(event)).is_err() {
                        r.seq.cancel();
                        break;
                    }
                    if done {
                        let _ = r.events.send(Event::Done(r.seq.output()));
                    }
                }
            }
            Err(error) => {
                r.seq.cancel();
                let _ = r.events.send(Event::Error(error));
            }
        }
    }
    Ok(())
}
