//! `agentstack-bench-hub`: what the environment hub does with its time. A real
//! `agentstack hub serve` process (release build), on SQLite and then on PostgreSQL, in
//! one run, driven through the real client, `agentstack_hub::client::HubClient`:
//!
//! - **push and pull**: packages of 1 MiB and 32 MiB of incompressible data,
//!   `push_bytes` and `download` (the client hashes what it downloads and checks it
//!   against the hub's sha256; the hub unpacks and checks every push, and hashes every
//!   blob it serves), a few repetitions each, medians in MB/s (10⁶ bytes/s);
//! - **seeding**: 10,000 small packages (names, descriptions, tags and READMEs drawn
//!   from a fixed vocabulary with a seeded RNG, so that words are common or rare)
//!   pushed through the HTTP API, 8 at once: pushes/s;
//! - **search**: 2,000 sequential queries of seven kinds over those 10,000 packages (one
//!   common word, two words, a three-letter prefix, a rare word, and the empty query
//!   newest first, by downloads and by score): p50/p99 per kind and overall.
//!
//! There is no other registry to run here, so the peer is the **floor**: the same
//! bytes copied over a plain tokio TCP connection on loopback (no HTTP, no hashing, no
//! database), the blob read back from disk, one sha256 pass, a 1-byte TCP round trip,
//! and `GET /api/v1/health` on the same hub (HTTP, no database). Ratios say what
//! fraction of the floor the hub reaches. See bench/README.md.
//!
//! ```text
//! cargo build --release -p agentstack -p agentstack-bench-hub
//! target/release/agentstack-bench-hub --write-results bench/RESULTS.md
//! ```

use std::collections::{BTreeMap, HashSet};
use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentstack_bench_support::machine::{self, Machine};
use agentstack_bench_support::report::{publish, version_of};
use agentstack_bench_support::stats::{self, Stats, mean};
use agentstack_hub::api::{LeaderboardPost, PackageRef, SearchQuery, SearchSort, VersionInfo};
use agentstack_hub::auth::Token;
use agentstack_hub::blobs::sha256_hex;
use agentstack_hub::client::HubClient;
use agentstack_static::env_vars;
use anyhow::{Context, bail, ensure};
use clap::{Parser, ValueEnum};
use indicatif::ProgressBar;
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The users packages are pushed as (a user may push only to their own namespace).
const OWNERS: [&str; 8] = [
    "ada", "grace", "alan", "edsger", "barbara", "donald", "frances", "ken",
];

/// The words of names, descriptions and READMEs, most frequent first (drawn with
/// Zipf weights 1/rank). None is an English stop word, so PostgreSQL keeps them all.
const VOCAB: &[&str] = &[
    "agent",
    "reasoning",
    "game",
    "tool",
    "code",
    "math",
    "puzzle",
    "web",
    "task",
    "benchmark",
    "reward",
    "planning",
    "grid",
    "text",
    "language",
    "search",
    "navigation",
    "dialogue",
    "memory",
    "board",
    "strategy",
    "python",
    "sql",
    "browser",
    "chess",
    "maze",
    "logic",
    "arithmetic",
    "trading",
    "robot",
    "control",
    "physics",
    "simulation",
    "negotiation",
    "coding",
    "terminal",
    "shell",
    "compiler",
    "sudoku",
    "wordle",
    "crossword",
    "algebra",
    "geometry",
    "theorem",
    "proof",
    "lean",
    "verification",
    "unit",
    "tests",
    "repository",
    "refactor",
    "debugging",
    "api",
    "retrieval",
    "question",
    "answering",
    "summarization",
    "translation",
    "spelling",
    "counting",
    "sorting",
    "graph",
    "shortest",
    "path",
    "scheduling",
    "calendar",
    "email",
    "shopping",
    "inventory",
    "warehouse",
    "logistics",
    "routing",
    "traffic",
    "weather",
    "finance",
    "portfolio",
    "auction",
    "market",
    "poker",
    "blackjack",
    "cards",
    "dice",
    "tictactoe",
    "connect",
    "checkers",
    "snake",
    "tetris",
    "platformer",
    "atari",
    "gridworld",
    "cartpole",
    "pendulum",
    "locomotion",
    "manipulation",
    "grasping",
    "vision",
    "image",
    "captioning",
    "diagram",
    "chart",
    "table",
    "spreadsheet",
    "json",
    "schema",
    "parsing",
    "regex",
    "unix",
    "git",
    "docker",
    "kubernetes",
    "cloud",
    "security",
    "exploit",
    "forensics",
    "crypto",
    "cipher",
    "riddle",
    "trivia",
    "history",
    "geography",
    "chemistry",
    "biology",
    "medicine",
    "diagnosis",
    "legal",
    "contract",
    "tutor",
    "student",
    "curriculum",
    "adaptive",
    "sparse",
    "dense",
    "horizon",
    "episodic",
    "stochastic",
    "deterministic",
    "partial",
    "observability",
    "cooperative",
    "competitive",
    "adversarial",
    "selfplay",
    "human",
    "feedback",
    "preference",
    "rubric",
    "judge",
    "verifier",
    "sandbox",
    "isolated",
    "lightweight",
    "procedural",
    "generated",
    "seeded",
    "curated",
    "synthetic",
    "realistic",
    "difficulty",
    "levels",
];

/// `tags:` values, most frequent first (Zipf weights).
const TAGS: &[&str] = &[
    "games",
    "reasoning",
    "coding",
    "math",
    "tools",
    "web",
    "dialogue",
    "planning",
    "robotics",
    "vision",
    "finance",
    "security",
    "education",
    "science",
    "puzzles",
    "text",
    "agents",
    "benchmark",
    "long-horizon",
    "multi-agent",
    "sparse-reward",
    "procedural",
    "verifiable",
    "single-turn",
    "multi-turn",
];

/// Syllables of the rare words (one per README, a few packages each).
const SYLLABLES: [&str; 20] = [
    "ka", "zu", "ri", "mo", "vex", "tor", "lin", "qua", "pho", "nyx", "dra", "bel", "sor", "fen",
    "gli", "thu", "wex", "yon", "pri", "sku",
];

/// The word every description holds.
const EVERYWHERE: &str = "environment";

/// Results per search, as the web page asks.
const SEARCH_LIMIT: u32 = 20;

/// The longest the hub may take to start, or a validation backlog to drain.
const WAIT: Duration = Duration::from_secs(600);

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Backend {
    Sqlite,
    Postgres,
}

impl Backend {
    fn label(self) -> &'static str {
        match self {
            Self::Sqlite => "SQLite",
            Self::Postgres => "PostgreSQL",
        }
    }

    fn key(self) -> &'static str {
        match self {
            Self::Sqlite => "sqlite",
            Self::Postgres => "postgres",
        }
    }
}

#[derive(Parser)]
#[command(
    about = "Hub push/pull MB/s and search latency over 10,000 packages on SQLite and PostgreSQL, against the loopback floor"
)]
struct Args {
    /// The `agentstack` binary that serves the hub.
    #[arg(long, default_value = "target/release/agentstack")]
    agentstack: PathBuf,
    /// Backends to run, one after the other.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "sqlite,postgres"
    )]
    backends: Vec<Backend>,
    /// A PostgreSQL server URL whose role may create databases (default:
    /// AGENTSTACK_TEST_POSTGRES_URL, else what `scripts/start-postgres` prints). A
    /// fresh database is made for the run and dropped at the end.
    #[arg(long)]
    postgres_url: Option<String>,
    /// Payload sizes of the push/pull phase, MiB of incompressible data.
    #[arg(long, value_delimiter = ',', default_value = "1,32")]
    sizes_mib: Vec<usize>,
    /// Pushes and pulls of each size (medians reported).
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Small packages seeded before the searches.
    #[arg(long, default_value_t = 10_000)]
    packages: usize,
    /// Pushes in flight while seeding.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Timed search queries (sequential).
    #[arg(long, default_value_t = 2000)]
    queries: usize,
    /// Timed `GET /api/v1/health` requests and 1-byte TCP round trips (sequential).
    #[arg(long, default_value_t = 2000)]
    health: usize,
    /// Pulls of small packages after seeding (so `downloads` differ), sequential.
    #[arg(long, default_value_t = 2000)]
    pulls: usize,
    /// Leaderboard results posted after seeding (so `best_score` differs).
    #[arg(long, default_value_t = 1000)]
    results: usize,
    /// Seed of the generated packages, payloads and queries.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Smoke run: 2 repeats, 500 packages, 200 queries, 200 health checks, 100 pulls,
    /// 50 results.
    #[arg(long)]
    quick: bool,
    /// Write every figure (and every search latency) as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Append a section to this Markdown file.
    #[arg(long)]
    write_results: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let mut args = Args::parse();
    if args.quick {
        args.repeats = 2;
        args.packages = 500;
        args.queries = 200;
        args.health = 200;
        args.pulls = 100;
        args.results = 50;
    }
    ensure!(args.repeats >= 1, "--repeats must be at least 1");
    ensure!(args.packages >= 1, "--packages must be at least 1");
    ensure!(args.concurrency >= 1, "--concurrency must be at least 1");
    ensure!(!args.sizes_mib.is_empty(), "--sizes-mib needs a size");
    ensure!(
        args.agentstack.exists(),
        "{} is not there; build it with `cargo build --release -p agentstack`",
        args.agentstack.display()
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    let scratch = tempfile::Builder::new()
        .prefix(&format!("agentstack-bench-hub-{}-", std::process::id()))
        .tempdir()
        .context("making a scratch directory")?;
    let result = runtime.block_on(bench(&args, scratch.path()));
    if result.is_err() {
        // Keep the hubs' logs to look at.
        let kept = scratch.keep();
        eprintln!("the hubs' logs are kept in {}", kept.display());
    }
    result
}

async fn bench(args: &Args, scratch: &Path) -> anyhow::Result<()> {
    let load_start = machine::load_average().unwrap_or_default();
    let agentstack_version = version_of(&args.agentstack);
    let git = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    let postgres = if args.backends.contains(&Backend::Postgres) {
        match postgres_server(args.postgres_url.as_deref()) {
            Ok(url) => Some(url),
            Err(e) => {
                eprintln!("PostgreSQL skipped: {e:#}");
                None
            }
        }
    } else {
        None
    };
    let postgres_settings = postgres.as_deref().map(postgres_settings);

    // Everything both backends get, made once.
    // The payloads draw from their own stream, so that the packages and queries do not
    // depend on the sizes and repeats asked for.
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    let corpus = make_corpus(args, scratch, &mut rng)?;
    let queries = make_queries(args, &corpus, &mut rng);
    let downloads = zipf_picks(&mut rng, corpus.packages.len(), args.pulls);
    let results = make_results(&mut rng, corpus.packages.len(), args.results);
    let mut payload_rng = ChaCha8Rng::seed_from_u64(args.seed);
    payload_rng.set_stream(1);
    let payloads = make_payloads(args, scratch, &mut payload_rng)?;

    // The floor: a plain TCP server holding the largest payload.
    let largest = payloads
        .iter()
        .map(|p| p.bytes.len())
        .max()
        .unwrap_or_default();
    let biggest = payloads
        .iter()
        .find(|p| p.bytes.len() == largest)
        .map(|p| Arc::clone(&p.bytes))
        .unwrap_or_default();
    let floor_addr = start_floor_server(Arc::clone(&biggest))?;
    let mut floor = FloorClient::connect(floor_addr).await?;
    let round_trip = floor_round_trips(&mut floor, args.health).await?;
    eprintln!(
        "floor: 1-byte TCP round trip p50 {:.3} ms p99 {:.3} ms",
        round_trip.p50, round_trip.p99
    );

    let mut runs = Vec::new();
    for &backend in &args.backends {
        let database = match backend {
            Backend::Sqlite => None,
            Backend::Postgres => match &postgres {
                Some(url) => Some(PgDatabase::create(url)?),
                None => continue,
            },
        };
        let home = scratch.join(backend.key());
        std::fs::create_dir_all(&home).with_context(|| format!("creating {}", home.display()))?;
        let url = match &database {
            Some(db) => db.url.clone(),
            None => format!("sqlite://{}", home.join("hub.db").display()),
        };
        let hub = Hub::start(&args.agentstack, &home, &url)?;
        eprintln!(
            "{}: hub at {} (log {})",
            backend.label(),
            hub.url,
            hub.log.display()
        );
        let run = run_backend(
            args, backend, &hub, &url, &payloads, &corpus, &queries, &downloads, &results,
            &mut floor,
        )
        .await
        .with_context(|| format!("{} (hub log: {})", backend.label(), hub.log.display()));
        drop(hub);
        drop(database);
        runs.push(run?);
    }
    ensure!(!runs.is_empty(), "no backend ran");

    let sha = sha_throughput(&payloads);
    let load_end = machine::load_average().unwrap_or_default();
    let report = Report {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        machine: Machine::here(load_start, load_end),
        agentstack: format!(
            "{agentstack_version} ({}, git {git})",
            args.agentstack.display()
        ),
        postgres: postgres_settings,
        postgres_skipped: args.backends.contains(&Backend::Postgres) && postgres.is_none(),
        repeats: args.repeats,
        concurrency: args.concurrency,
        seed: args.seed,
        packages: corpus.packages.len(),
        mean_packed: corpus.mean_packed(),
        pulls: args.pulls,
        results: args.results,
        health: args.health,
        payloads: payloads
            .iter()
            .map(|p| (p.mib, p.bytes.len()))
            .collect::<BTreeMap<_, _>>(),
        sha,
        round_trip,
        queries: &queries,
        runs,
    };
    let section = report.markdown();
    publish(
        &section,
        args.json.as_deref(),
        || report.json(),
        args.write_results.as_deref(),
    )
}

/// One backend's figures.
struct Run {
    backend: Backend,
    health: Stats,
    transfers: Vec<Transfer>,
    seeding: Seeding,
    small_pulls: Stats,
    search: Vec<(Kind, Stats, f64)>,
    search_all: Stats,
    search_samples: Vec<(Kind, f64)>,
}

#[expect(clippy::too_many_arguments, reason = "the run's shared inputs")]
async fn run_backend(
    args: &Args,
    backend: Backend,
    hub: &Hub,
    database: &str,
    payloads: &[Payload],
    corpus: &Corpus,
    queries: &[Query],
    downloads: &[usize],
    results: &[(usize, f64)],
    floor: &mut FloorClient,
) -> anyhow::Result<Run> {
    let mut clients = Vec::new();
    for owner in OWNERS {
        let token = hub.user(owner, database)?;
        clients.push(HubClient::new(&hub.url, Some(Token::new(token)))?);
    }
    let anonymous = HubClient::new(&hub.url, None)?;
    let http = reqwest::Client::new();

    // Latency floor of HTTP on this server: a route that touches nothing.
    let health_url = format!("{}/api/v1/health", hub.url);
    let mut samples = Vec::new();
    for i in 0..args.health + args.health / 10 {
        let start = Instant::now();
        let response = http.get(&health_url).send().await?.error_for_status()?;
        response.bytes().await?;
        if i >= args.health / 10 {
            samples.push(ms(start.elapsed()));
        }
    }
    let health = Stats::of(&samples);
    eprintln!(
        "{}: GET /api/v1/health p50 {:.3} ms p99 {:.3} ms",
        backend.label(),
        health.p50,
        health.p99
    );

    // Push and pull, each repetition in turn with its floors.
    let owner = OWNERS[0];
    let client = &clients[0];
    let mut transfers = Vec::new();
    let bar = progress(payloads.len(), &format!("{}: push/pull", backend.label()));
    for payload in payloads {
        let name = payload.name();
        let size = payload.bytes.len();
        let body = payload.bytes.as_ref().clone();
        let start = Instant::now();
        let pushed = client
            .push_bytes(owner, &name, &payload.version, false, body)
            .await
            .with_context(|| format!("pushing {name}@{}", payload.version))?;
        let push = start.elapsed();
        ensure!(
            pushed.sha256 == payload.sha256,
            "the hub hashed {name}@{} as {}, not {}",
            payload.version,
            pushed.sha256,
            payload.sha256
        );
        // The hub validates in the background after the push; let that end first.
        validated(&http, &hub.url, owner, &name, &payload.version).await?;
        let reference = PackageRef {
            owner: owner.to_owned(),
            name: name.clone(),
            reference: Some(payload.version.clone()),
        };
        let start = Instant::now();
        let (_, sha256, bytes) = client.download(&reference).await?;
        let pull = start.elapsed();
        ensure!(
            sha256 == payload.sha256 && bytes.len() == size,
            "{name}@{} came back different",
            payload.version
        );
        drop(bytes);
        let tcp_down = floor.download(size).await?;
        let tcp_up = floor.upload(&payload.bytes).await?;
        let blob = hub
            .blobs
            .join("sha256")
            .join(&payload.sha256[..2])
            .join(&payload.sha256);
        let disk = tokio::task::spawn_blocking(move || {
            let start = Instant::now();
            let read = std::fs::read(&blob).with_context(|| format!("reading {}", blob.display()));
            read.map(|bytes| (start.elapsed(), bytes.len()))
        })
        .await??;
        ensure!(disk.1 == size, "the blob on disk is {} bytes", disk.1);
        transfers.push(Transfer {
            mib: payload.mib,
            bytes: size,
            push,
            pull,
            tcp_up,
            tcp_down,
            disk: disk.0,
        });
        bar.inc(1);
    }
    bar.finish_and_clear();
    for &mib in &args.sizes_mib {
        let t = TransferSummary::of(&transfers, mib);
        eprintln!(
            "{}: {mib} MiB push {:.1} MB/s pull {:.1} MB/s (TCP floor up {:.1} down {:.1}, disk {:.1})",
            backend.label(),
            t.push,
            t.pull,
            t.tcp_up,
            t.tcp_down,
            t.disk
        );
    }

    // Seeding: every small package, `concurrency` pushes in flight.
    let seeding = seed(args, backend, &clients, corpus).await?;
    let drain_start = Instant::now();
    for &i in &seeding.last_done {
        let p = &corpus.packages[i];
        validated(&http, &hub.url, OWNERS[p.owner], &p.name, "1.0.0").await?;
    }
    let backlog = drain_start.elapsed();
    eprintln!(
        "{}: seeded {} packages in {:.1} s, {:.0} pushes/s; validation backlog drained {:.1} s later",
        backend.label(),
        seeding.count,
        seeding.wall.as_secs_f64(),
        seeding.count as f64 / seeding.wall.as_secs_f64(),
        backlog.as_secs_f64()
    );

    // Downloads and scores, so that those orders differ between packages.
    let bar = progress(
        downloads.len() + results.len(),
        &format!("{}: pulls and leaderboard results", backend.label()),
    );
    let mut pull_samples = Vec::new();
    for &i in downloads {
        let p = &corpus.packages[i];
        let reference = PackageRef {
            owner: OWNERS[p.owner].to_owned(),
            name: p.name.clone(),
            reference: None,
        };
        let start = Instant::now();
        let (_, sha256, _) = anonymous.download(&reference).await?;
        pull_samples.push(ms(start.elapsed()));
        ensure!(sha256 == p.sha256, "{} came back different", p.name);
        bar.inc(1);
    }
    for (k, &(i, score)) in results.iter().enumerate() {
        let p = &corpus.packages[i];
        let reference = PackageRef {
            owner: OWNERS[p.owner].to_owned(),
            name: p.name.clone(),
            reference: Some("1.0.0".into()),
        };
        let post = LeaderboardPost {
            model: format!("bench-model-{}", k % 7),
            score,
            ci95: [score - 0.05, score + 0.05],
            episodes: 100,
            harness: "bench".into(),
            details: Value::Null,
        };
        clients[k % clients.len()]
            .post_result(&reference, &post)
            .await
            .with_context(|| format!("posting a result to {}", p.name))?;
        bar.inc(1);
    }
    bar.finish_and_clear();
    let small_pulls = Stats::of(&pull_samples);

    // Search: a warm-up, then every query in order.
    let bar = progress(
        queries.len() + queries.len().min(50),
        &format!("{}: search", backend.label()),
    );
    for q in queries.iter().take(50) {
        anonymous.search(&q.request()).await?;
        bar.inc(1);
    }
    let mut search_samples = Vec::new();
    let mut hits: BTreeMap<Kind, Vec<f64>> = BTreeMap::new();
    for q in queries {
        let request = q.request();
        let start = Instant::now();
        let found = anonymous.search(&request).await?;
        search_samples.push((q.kind, ms(start.elapsed())));
        hits.entry(q.kind).or_default().push(found.len() as f64);
        bar.inc(1);
    }
    bar.finish_and_clear();
    let search: Vec<(Kind, Stats, f64)> = Kind::ALL
        .iter()
        .filter_map(|&kind| {
            let samples: Vec<f64> = search_samples
                .iter()
                .filter(|(k, _)| *k == kind)
                .map(|(_, s)| *s)
                .collect();
            let returned = hits.get(&kind).map_or(0.0, |h| mean(h));
            (!samples.is_empty()).then(|| (kind, Stats::of(&samples), returned))
        })
        .collect();
    let all: Vec<f64> = search_samples.iter().map(|(_, s)| *s).collect();
    let search_all = Stats::of(&all);
    for (kind, stats, _) in &search {
        eprintln!(
            "{}: search {:<24} p50 {:>7.2} ms p99 {:>7.2} ms",
            backend.label(),
            kind.label(),
            stats.p50,
            stats.p99
        );
    }
    Ok(Run {
        backend,
        health,
        transfers,
        seeding: Seeding { backlog, ..seeding },
        small_pulls,
        search,
        search_all,
        search_samples,
    })
}

/// Waits (untimed) until a version's background validation has ended.
async fn validated(
    http: &reqwest::Client,
    base: &str,
    owner: &str,
    name: &str,
    version: &str,
) -> anyhow::Result<()> {
    let url = format!("{base}/api/v1/envs/{owner}/{name}/versions/{version}");
    let deadline = Instant::now() + WAIT;
    loop {
        let info: VersionInfo = http
            .get(&url)
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        if info.validation.status != "pending" {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{owner}/{name}@{version} was still pending validation after {WAIT:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

struct Seeding {
    count: usize,
    wall: Duration,
    latency: Stats,
    /// The last pushes to finish, whose validation marks the backlog's end.
    last_done: Vec<usize>,
    /// From the last push's reply to the last validation stored.
    backlog: Duration,
}

async fn seed(
    args: &Args,
    backend: Backend,
    clients: &[HubClient],
    corpus: &Corpus,
) -> anyhow::Result<Seeding> {
    let total = corpus.packages.len();
    let bar = progress(
        total,
        &format!("{}: seeding, {} at once", backend.label(), args.concurrency),
    );
    let next = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(Mutex::new(Vec::with_capacity(total)));
    let packages = Arc::new(corpus.packages.clone());
    let start = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..args.concurrency {
        let (next, done, packages, bar) = (
            Arc::clone(&next),
            Arc::clone(&done),
            Arc::clone(&packages),
            bar.clone(),
        );
        let clients = clients.to_vec();
        set.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(p) = packages.get(i) else {
                    return Ok::<_, anyhow::Error>(());
                };
                let t = Instant::now();
                clients[p.owner]
                    .push_bytes(OWNERS[p.owner], &p.name, "1.0.0", false, p.bytes.clone())
                    .await
                    .with_context(|| format!("pushing {}/{}", OWNERS[p.owner], p.name))?;
                let took = ms(t.elapsed());
                done.lock().expect("not poisoned").push((i, took));
                bar.inc(1);
            }
        });
    }
    while let Some(joined) = set.join_next().await {
        joined.context("a seeding worker panicked")??;
    }
    let wall = start.elapsed();
    bar.finish_and_clear();
    let done = std::mem::take(&mut *done.lock().expect("not poisoned"));
    let latencies: Vec<f64> = done.iter().map(|(_, t)| *t).collect();
    let last_done = done
        .iter()
        .rev()
        .take(args.concurrency)
        .map(|(i, _)| *i)
        .collect();
    Ok(Seeding {
        count: total,
        wall,
        latency: Stats::of(&latencies),
        last_done,
        backlog: Duration::ZERO,
    })
}

// ---- the hub process ----

/// A running `agentstack hub serve`, stopped when dropped.
struct Hub {
    child: Child,
    url: String,
    agentstack: PathBuf,
    home: PathBuf,
    blobs: PathBuf,
    log: PathBuf,
}

impl Hub {
    fn start(agentstack: &Path, home: &Path, database: &str) -> anyhow::Result<Self> {
        let blobs = home.join("blobs");
        let log = home.join("hub.log");
        let stderr =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let mut child = Command::new(agentstack)
            .args(["hub", "serve", "--port", "0", "--no-conformance"])
            .args(["--database", database])
            .arg("--blobs")
            .arg(&blobs)
            .env(env_vars::AGENTSTACK_HOME, home)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .with_context(|| format!("starting {}", agentstack.display()))?;
        let mut line = String::new();
        let stdout = child.stdout.take().context("the hub's stdout")?;
        let read = BufReader::new(stdout).read_line(&mut line);
        let url = match (read, line.trim().strip_prefix("agentstack hub at ")) {
            (Ok(_), Some(url)) => url.to_owned(),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                bail!(
                    "the hub did not start (first line {line:?}); its log: {}",
                    log.display()
                );
            }
        };
        Ok(Self {
            child,
            url,
            agentstack: agentstack.to_owned(),
            home: home.to_owned(),
            blobs,
            log,
        })
    }

    /// Creates a user; returns their token.
    fn user(&self, name: &str, database: &str) -> anyhow::Result<String> {
        let output = Command::new(&self.agentstack)
            .args(["hub", "user", "create", name, "--database", database])
            .env(env_vars::AGENTSTACK_HOME, &self.home)
            .stdin(Stdio::null())
            .output()
            .context("running `agentstack hub user create`")?;
        ensure!(
            output.status.success(),
            "`agentstack hub user create {name}` failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let token = String::from_utf8_lossy(&output.stdout).trim().to_owned();
        ensure!(!token.is_empty(), "no token for {name}");
        Ok(token)
    }
}

impl Drop for Hub {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The PostgreSQL server to use.
fn postgres_server(flag: Option<&str>) -> anyhow::Result<String> {
    if let Some(url) = flag {
        return Ok(url.to_owned());
    }
    if let Ok(url) = std::env::var(env_vars::AGENTSTACK_TEST_POSTGRES_URL) {
        return Ok(url);
    }
    let output = Command::new("scripts/start-postgres")
        .stdin(Stdio::null())
        .output()
        .context("running scripts/start-postgres (run the bench from the repository root)")?;
    ensure!(
        output.status.success(),
        "scripts/start-postgres failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

/// The server's version and the settings that decide write speed.
fn postgres_settings(url: &str) -> String {
    let output = Command::new("psql")
        .arg(url)
        .args([
            "-qAtc",
            "SELECT current_setting('server_version') || ', fsync ' || current_setting('fsync') || ', synchronous_commit ' || current_setting('synchronous_commit') || ', shared_buffers ' || current_setting('shared_buffers') || ', jit ' || current_setting('jit') || ' (jit_above_cost ' || current_setting('jit_above_cost') || ')'",
        ])
        .output();
    match output {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).trim().to_owned(),
        _ => "version unknown".into(),
    }
}

/// A fresh PostgreSQL database, dropped with the value.
struct PgDatabase {
    server: String,
    name: String,
    url: String,
}

impl PgDatabase {
    fn create(base: &str) -> anyhow::Result<Self> {
        let (server, _) = base
            .rsplit_once('/')
            .context("the PostgreSQL URL names no database")?;
        let name = format!("hub_bench_{}", std::process::id());
        psql(
            base,
            &format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
        )?;
        psql(base, &format!("CREATE DATABASE {name}"))?;
        Ok(Self {
            server: server.to_owned(),
            url: format!("{server}/{name}"),
            name,
        })
    }
}

impl Drop for PgDatabase {
    fn drop(&mut self) {
        let drop = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name);
        if let Err(e) = psql(&format!("{}/postgres", self.server), &drop) {
            eprintln!("could not drop {}: {e:#}", self.name);
        }
    }
}

fn psql(url: &str, sql: &str) -> anyhow::Result<()> {
    let output = Command::new("psql")
        .arg(url)
        .args(["-qc", sql])
        .stdin(Stdio::null())
        .output()
        .context("running psql")?;
    ensure!(
        output.status.success(),
        "psql {sql:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(())
}

// ---- the floor ----

/// A plain TCP server on its own thread and runtime: `P` answers one byte, `D n`
/// sends the first n bytes of its payload, `U n` reads n bytes and answers one.
fn start_floor_server(payload: Arc<Vec<u8>>) -> anyhow::Result<SocketAddr> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("binding the floor")?;
    listener.set_nonblocking(true)?;
    let address = listener.local_addr()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("the floor's runtime")?;
    std::thread::spawn(move || {
        runtime.block_on(async move {
            let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                return;
            };
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(floor_connection(stream, Arc::clone(&payload)));
            }
        });
    });
    Ok(address)
}

async fn floor_connection(mut stream: TcpStream, payload: Arc<Vec<u8>>) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let mut header = [0u8; 9];
    let mut sink = vec![0u8; 256 << 10];
    loop {
        if stream.read_exact(&mut header).await.is_err() {
            return Ok(());
        }
        let mut len = [0u8; 8];
        len.copy_from_slice(&header[1..]);
        let len = usize::try_from(u64::from_le_bytes(len)).unwrap_or(usize::MAX);
        match header[0] {
            b'P' => stream.write_all(&[1]).await?,
            b'D' => stream.write_all(&payload[..len.min(payload.len())]).await?,
            b'U' => {
                let mut left = len;
                while left > 0 {
                    let chunk = left.min(sink.len());
                    let n = stream.read(&mut sink[..chunk]).await?;
                    if n == 0 {
                        return Ok(());
                    }
                    left -= n;
                }
                stream.write_all(&[1]).await?;
            }
            _ => return Ok(()),
        }
    }
}

/// One kept-alive connection to the floor server, as reqwest keeps one to the hub.
struct FloorClient {
    stream: TcpStream,
}

impl FloorClient {
    async fn connect(address: SocketAddr) -> anyhow::Result<Self> {
        let stream = TcpStream::connect(address).await?;
        stream.set_nodelay(true)?;
        Ok(Self { stream })
    }

    async fn command(&mut self, kind: u8, len: usize) -> std::io::Result<()> {
        let mut header = [kind; 9];
        header[1..].copy_from_slice(&(len as u64).to_le_bytes());
        self.stream.write_all(&header).await
    }

    async fn ping(&mut self) -> anyhow::Result<Duration> {
        let start = Instant::now();
        self.command(b'P', 0).await?;
        let mut one = [0u8; 1];
        self.stream.read_exact(&mut one).await?;
        Ok(start.elapsed())
    }

    /// Receives `len` bytes into a new buffer, as a download does.
    async fn download(&mut self, len: usize) -> anyhow::Result<Duration> {
        let start = Instant::now();
        self.command(b'D', len).await?;
        let mut buffer = Vec::with_capacity(len);
        let read = (&mut self.stream)
            .take(len as u64)
            .read_to_end(&mut buffer)
            .await?;
        let took = start.elapsed();
        ensure!(read == len, "the floor sent {read} of {len} bytes");
        Ok(took)
    }

    /// Sends `bytes` and waits for the server to have read them all.
    async fn upload(&mut self, bytes: &[u8]) -> anyhow::Result<Duration> {
        let start = Instant::now();
        self.command(b'U', bytes.len()).await?;
        self.stream.write_all(bytes).await?;
        let mut one = [0u8; 1];
        self.stream.read_exact(&mut one).await?;
        Ok(start.elapsed())
    }
}

async fn floor_round_trips(floor: &mut FloorClient, n: usize) -> anyhow::Result<Stats> {
    let mut samples = Vec::new();
    for i in 0..n + n / 10 {
        let took = floor.ping().await?;
        if i >= n / 10 {
            samples.push(ms(took));
        }
    }
    Ok(Stats::of(&samples))
}

/// One sha256 pass over each payload, MB/s, median per size.
fn sha_throughput(payloads: &[Payload]) -> BTreeMap<usize, f64> {
    let mut per_size: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    for p in payloads {
        let start = Instant::now();
        std::hint::black_box(sha256_hex(&p.bytes));
        per_size
            .entry(p.mib)
            .or_default()
            .push(mb_per_s(p.bytes.len(), start.elapsed()));
    }
    per_size.into_iter().map(|(k, v)| (k, median(&v))).collect()
}

// ---- what is pushed ----

/// A large package: `data.bin` of incompressible bytes.
struct Payload {
    mib: usize,
    version: String,
    bytes: Arc<Vec<u8>>,
    sha256: String,
}

impl Payload {
    fn name(&self) -> String {
        format!("payload-{}mib", self.mib)
    }
}

/// Packs `repeats` packages of each size, each with its own random bytes (the hub
/// stores a blob once per hash, so a repeated package would skip the write).
fn make_payloads(
    args: &Args,
    scratch: &Path,
    rng: &mut ChaCha8Rng,
) -> anyhow::Result<Vec<Payload>> {
    let mut payloads = Vec::new();
    let bar = progress(
        args.sizes_mib.len() * args.repeats,
        "packing the large packages",
    );
    for &mib in &args.sizes_mib {
        for r in 0..args.repeats {
            let dir = scratch.join(format!("payload-{mib}-{r}"));
            std::fs::create_dir_all(&dir)?;
            let version = format!("1.0.{r}");
            let name = format!("payload-{mib}mib");
            std::fs::write(
                dir.join("openenv.yaml"),
                format!(
                    "spec_version: 1\nname: {name}\nversion: {version}\ndescription: {mib} MiB of incompressible data\ntags: [benchmark]\nagentstack:\n  serve: agentstack env serve echo --port {{port}}\n"
                ),
            )?;
            std::fs::write(dir.join("README.md"), format!("# {name}\n"))?;
            let mut data = vec![0u8; mib << 20];
            rng.fill_bytes(&mut data);
            std::fs::write(dir.join("data.bin"), &data)?;
            drop(data);
            let packed = agentstack_hub::package::pack(&dir)
                .with_context(|| format!("packing {}", dir.display()))?;
            std::fs::remove_dir_all(&dir)?;
            payloads.push(Payload {
                mib,
                version,
                sha256: packed.sha256,
                bytes: Arc::new(packed.bytes),
            });
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    Ok(payloads)
}

/// A small package to seed, and its words for counting matches.
#[derive(Clone)]
struct Small {
    owner: usize,
    name: String,
    bytes: Vec<u8>,
    sha256: String,
    /// Every word of its owner, name, description, tags and README, lowercased,
    /// sorted, once each.
    words: Vec<String>,
    /// The rare word in its README.
    rare: String,
}

struct Corpus {
    packages: Vec<Small>,
}

impl Corpus {
    fn mean_packed(&self) -> f64 {
        mean(
            &self
                .packages
                .iter()
                .map(|p| p.bytes.len() as f64)
                .collect::<Vec<_>>(),
        )
    }

    /// How many packages every word of `q` starts a word of (what a prefix search
    /// over the text finds, before stemming).
    fn matches(&self, q: &str) -> usize {
        let words: Vec<String> = q
            .split(|c: char| !c.is_alphanumeric())
            .filter(|w| !w.is_empty())
            .map(str::to_lowercase)
            .collect();
        if words.is_empty() {
            return self.packages.len();
        }
        self.packages
            .iter()
            .filter(|p| words.iter().all(|w| has_prefix(&p.words, w)))
            .count()
    }
}

/// Whether a sorted list of words holds one starting with `prefix`.
fn has_prefix(sorted: &[String], prefix: &str) -> bool {
    let i = sorted.partition_point(|w| w.as_str() < prefix);
    sorted.get(i).is_some_and(|w| w.starts_with(prefix))
}

/// Draws indexes 0..n with weights 1/(rank+1).
struct Zipf {
    cumulative: Vec<f64>,
}

impl Zipf {
    fn new(n: usize) -> Self {
        let mut total = 0.0;
        let cumulative = (1..=n)
            .map(|k| {
                total += 1.0 / k as f64;
                total
            })
            .collect();
        Self { cumulative }
    }

    fn draw(&self, rng: &mut ChaCha8Rng) -> usize {
        let total = self.cumulative.last().copied().unwrap_or(0.0);
        let x = rng.random::<f64>() * total;
        self.cumulative
            .partition_point(|&c| c < x)
            .min(self.cumulative.len() - 1)
    }
}

fn zipf_words(rng: &mut ChaCha8Rng, zipf: &Zipf, n: usize) -> Vec<&'static str> {
    (0..n).map(|_| VOCAB[zipf.draw(rng)]).collect()
}

fn rare_words(rng: &mut ChaCha8Rng, n: usize) -> Vec<String> {
    let mut seen = HashSet::new();
    let mut words = Vec::new();
    while words.len() < n {
        let word: String = (0..3)
            .map(|_| SYLLABLES[rng.random_range(0..SYLLABLES.len())])
            .collect();
        if seen.insert(word.clone()) {
            words.push(word);
        }
    }
    words
}

/// The small packages: names from two words, descriptions and READMEs of Zipf-drawn
/// words (`environment` in every description), 2 to 4 tags, and one rare word each
/// (about 5 packages per rare word).
fn make_corpus(args: &Args, scratch: &Path, rng: &mut ChaCha8Rng) -> anyhow::Result<Corpus> {
    let zipf = Zipf::new(VOCAB.len());
    let tag_zipf = Zipf::new(TAGS.len());
    let rare = rare_words(rng, (args.packages / 5).max(10));
    let dir = scratch.join("small");
    std::fs::create_dir_all(dir.join("data"))?;
    let mut names = HashSet::new();
    let mut packages = Vec::with_capacity(args.packages);
    let bar = progress(args.packages, "packing the small packages");
    for i in 0..args.packages {
        let owner = rng.random_range(0..OWNERS.len());
        let base = format!(
            "{}-{}",
            VOCAB[rng.random_range(0..VOCAB.len())],
            VOCAB[rng.random_range(0..VOCAB.len())]
        );
        let mut name = base.clone();
        let mut n = 2;
        while !names.insert((owner, name.clone())) {
            name = format!("{base}-{n}");
            n += 1;
        }
        let count = rng.random_range(5..10);
        let description_words = zipf_words(rng, &zipf, count);
        let description = format!(
            "A {} {EVERYWHERE} for {}.",
            description_words[0],
            description_words[1..].join(" ")
        );
        let mut tags = Vec::new();
        for _ in 0..rng.random_range(2..5) {
            let tag = TAGS[tag_zipf.draw(rng)];
            if !tags.contains(&tag) {
                tags.push(tag);
            }
        }
        let rare_word = rare[rng.random_range(0..rare.len())].clone();
        let count = rng.random_range(20..40);
        let first = zipf_words(rng, &zipf, count).join(" ");
        let count = rng.random_range(20..40);
        let second = zipf_words(rng, &zipf, count).join(" ");
        let readme = format!(
            "# {name}\n\n{first}.\n\n## Usage\n\n```sh\nagentstack env serve hub:{}/{name}\n```\n\n{second}. Codename {rare_word}.\n",
            OWNERS[owner]
        );
        let yaml = format!(
            "spec_version: 1\nname: {name}\nversion: 1.0.0\ndescription: {description}\ntags: [{}]\nagentstack:\n  serve: agentstack env serve echo --port {{port}}\n  reward_range: [0, 1]\n",
            tags.join(", ")
        );
        std::fs::write(dir.join("openenv.yaml"), &yaml)?;
        std::fs::write(dir.join("README.md"), &readme)?;
        std::fs::write(
            dir.join("data/cases.jsonl"),
            format!("{{\"case\": {i}}}\n{{\"case\": {}}}\n", i + 1),
        )?;
        let packed = agentstack_hub::package::pack(&dir).context("packing a small package")?;
        let text = format!(
            "{} {name} {description} {} {readme}",
            OWNERS[owner],
            tags.join(" ")
        );
        let mut words: Vec<String> = text
            .split(|c: char| !c.is_alphanumeric())
            .filter(|w| !w.is_empty())
            .map(str::to_lowercase)
            .collect();
        words.sort();
        words.dedup();
        packages.push(Small {
            owner,
            name,
            bytes: packed.bytes,
            sha256: packed.sha256,
            words,
            rare: rare_word,
        });
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(Corpus { packages })
}

/// Package indexes to pull, Zipf over a seeded shuffle (a few popular packages).
fn zipf_picks(rng: &mut ChaCha8Rng, n: usize, count: usize) -> Vec<usize> {
    let zipf = Zipf::new(n);
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        order.swap(i, rng.random_range(0..=i));
    }
    (0..count).map(|_| order[zipf.draw(rng)]).collect()
}

/// Leaderboard results: (package, score in [0.05, 0.95]).
fn make_results(rng: &mut ChaCha8Rng, n: usize, count: usize) -> Vec<(usize, f64)> {
    (0..count)
        .map(|_| {
            let score = 0.05 + 0.9 * rng.random::<f64>();
            (rng.random_range(0..n), (score * 1000.0).round() / 1000.0)
        })
        .collect()
}

// ---- the queries ----

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Common,
    TwoWords,
    Prefix,
    Rare,
    Newest,
    Downloads,
    Score,
}

impl Kind {
    const ALL: [Self; 7] = [
        Self::Common,
        Self::TwoWords,
        Self::Prefix,
        Self::Rare,
        Self::Newest,
        Self::Downloads,
        Self::Score,
    ];

    fn key(self) -> &'static str {
        match self {
            Self::Common => "common_word",
            Self::TwoWords => "two_words",
            Self::Prefix => "prefix",
            Self::Rare => "rare_word",
            Self::Newest => "empty_newest",
            Self::Downloads => "empty_by_downloads",
            Self::Score => "empty_by_score",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Self::Common => "one common word",
            Self::TwoWords => "two words",
            Self::Prefix => "a 3-letter prefix",
            Self::Rare => "one rare word",
            Self::Newest => "empty, newest first",
            Self::Downloads => "empty, by downloads",
            Self::Score => "empty, by score",
        }
    }
}

struct Query {
    kind: Kind,
    q: String,
    sort: SearchSort,
    /// Packages whose text every word starts a word of (before stemming).
    matches: usize,
}

impl Query {
    fn request(&self) -> SearchQuery {
        SearchQuery {
            q: self.q.clone(),
            sort: self.sort,
            limit: Some(SEARCH_LIMIT),
            offset: None,
        }
    }

    fn shown(&self) -> String {
        let sort = match self.sort {
            SearchSort::Relevance => "",
            SearchSort::Downloads => "&sort=downloads",
            SearchSort::Score => "&sort=score",
        };
        format!("`?q={}{sort}`", self.q.replace(' ', "+"))
    }
}

/// The query sequence both backends run: kinds drawn uniformly, words as each kind
/// says. Common: `environment` or one of the 2 most frequent words; two words: ranks
/// 6 to 40; prefix: the first 3 letters of a word of rank 1 to 80; rare: the rare
/// word of a random package.
fn make_queries(args: &Args, corpus: &Corpus, rng: &mut ChaCha8Rng) -> Vec<Query> {
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    let mut queries = Vec::with_capacity(args.queries);
    let bar = progress(args.queries, "making the queries");
    for _ in 0..args.queries {
        let kind = Kind::ALL[rng.random_range(0..Kind::ALL.len())];
        let (q, sort) = match kind {
            Kind::Common => {
                let words = [EVERYWHERE, VOCAB[0], VOCAB[1]];
                (
                    words[rng.random_range(0..words.len())].to_owned(),
                    SearchSort::Relevance,
                )
            }
            Kind::TwoWords => {
                let a = rng.random_range(5..40);
                let mut b = rng.random_range(5..40);
                while b == a {
                    b = rng.random_range(5..40);
                }
                (format!("{} {}", VOCAB[a], VOCAB[b]), SearchSort::Relevance)
            }
            Kind::Prefix => {
                let word = loop {
                    let w = VOCAB[rng.random_range(0..80)];
                    if w.len() > 3 {
                        break w;
                    }
                };
                (word[..3].to_owned(), SearchSort::Relevance)
            }
            Kind::Rare => {
                let p = &corpus.packages[rng.random_range(0..corpus.packages.len())];
                (p.rare.clone(), SearchSort::Relevance)
            }
            Kind::Newest => (String::new(), SearchSort::Relevance),
            Kind::Downloads => (String::new(), SearchSort::Downloads),
            Kind::Score => (String::new(), SearchSort::Score),
        };
        let matches = *counts
            .entry(q.clone())
            .or_insert_with(|| corpus.matches(&q));
        queries.push(Query {
            kind,
            q,
            sort,
            matches,
        });
        bar.inc(1);
    }
    bar.finish_and_clear();
    queries
}

// ---- figures ----

struct Transfer {
    mib: usize,
    bytes: usize,
    push: Duration,
    pull: Duration,
    tcp_up: Duration,
    tcp_down: Duration,
    disk: Duration,
}

/// Medians of one size's repetitions, MB/s.
struct TransferSummary {
    n: usize,
    push: f64,
    pull: f64,
    tcp_up: f64,
    tcp_down: f64,
    disk: f64,
}

impl TransferSummary {
    fn of(transfers: &[Transfer], mib: usize) -> Self {
        let these: Vec<&Transfer> = transfers.iter().filter(|t| t.mib == mib).collect();
        let rate = |f: fn(&Transfer) -> Duration| {
            median(
                &these
                    .iter()
                    .map(|t| mb_per_s(t.bytes, f(t)))
                    .collect::<Vec<_>>(),
            )
        };
        Self {
            n: these.len(),
            push: rate(|t| t.push),
            pull: rate(|t| t.pull),
            tcp_up: rate(|t| t.tcp_up),
            tcp_down: rate(|t| t.tcp_down),
            disk: rate(|t| t.disk),
        }
    }
}

/// `10000` as `10,000`.
fn thousands(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn mb_per_s(bytes: usize, took: Duration) -> f64 {
    bytes as f64 / 1e6 / took.as_secs_f64()
}

fn median(v: &[f64]) -> f64 {
    let mut sorted = v.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => f64::NAN,
        n if !n.is_multiple_of(2) => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

fn progress(total: usize, message: &str) -> ProgressBar {
    stats::progress(
        total,
        "{msg:40} [{bar:30}] {pos}/{len} {per_sec} {elapsed}",
        message,
    )
}

/// Latency figures (milliseconds) as the JSON report writes them.
trait StatsJson {
    fn json(&self) -> Value;
}

impl StatsJson for Stats {
    fn json(&self) -> Value {
        json!({"n": self.n, "p50_ms": self.p50, "p99_ms": self.p99, "mean_ms": self.mean, "max_ms": self.max})
    }
}

struct Report<'a> {
    command: String,
    machine: Machine,
    agentstack: String,
    postgres: Option<String>,
    postgres_skipped: bool,
    repeats: usize,
    concurrency: usize,
    seed: u64,
    packages: usize,
    mean_packed: f64,
    pulls: usize,
    results: usize,
    health: usize,
    /// MiB → packed bytes (of the first repetition).
    payloads: BTreeMap<usize, usize>,
    /// MiB → one sha256 pass, MB/s.
    sha: BTreeMap<usize, f64>,
    round_trip: Stats,
    queries: &'a [Query],
    runs: Vec<Run>,
}

impl Report<'_> {
    /// Per kind: an example query and the median number of matching packages.
    fn kinds(&self) -> Vec<(Kind, String, f64)> {
        Kind::ALL
            .iter()
            .filter_map(|&kind| {
                let these: Vec<&Query> = self.queries.iter().filter(|q| q.kind == kind).collect();
                let first = these.first()?;
                let matches: Vec<f64> = these.iter().map(|q| q.matches as f64).collect();
                Some((kind, first.shown(), median(&matches)))
            })
            .collect()
    }

    fn markdown(&self) -> String {
        let m = &self.machine;
        let mut s = String::new();
        let backends: Vec<&str> = self.runs.iter().map(|r| r.backend.label()).collect();
        let _ = writeln!(
            s,
            "\n## hub: push/pull and search on {} vs the loopback floor, {}\n",
            backends.join(" and "),
            m.date
        );
        let _ = writeln!(
            s,
            "- Command: `{}`; load average {} at start, {} at end. Single run.",
            self.command, m.load_start, m.load_end
        );
        let _ = writeln!(
            s,
            "- Machine: {} CPUs ({}), {}, Linux {}; blobs, SQLite file and PostgreSQL data on the same ext4 disk.",
            m.cpus, m.cpu_model, m.memory, m.kernel
        );
        let _ = writeln!(s, "- agentstack: {}.", self.agentstack);
        match (&self.postgres, self.postgres_skipped) {
            (Some(settings), _) => {
                let _ = writeln!(
                    s,
                    "- PostgreSQL {settings} (local server, a fresh database for the run, dropped after). SQLite: the file in WAL mode, `synchronous = NORMAL`, as the hub opens it."
                );
            }
            (None, true) => {
                let _ = writeln!(s, "- PostgreSQL skipped: no server.");
            }
            (None, false) => {}
        }
        let _ = writeln!(
            s,
            "- Server: `agentstack hub serve --port 0 --no-conformance --database URL --blobs DIR`, a child of the bench on 127.0.0.1, one backend at a time; with `--no-conformance` a push is still unpacked and checked before it is accepted, and checked again in the background (the validation row). Client: `agentstack_hub::client::HubClient` (reqwest, one kept-alive connection per client) on a tokio runtime with 2 worker threads. **Client, server and PostgreSQL share the 2 cores.**"
        );
        let _ = writeln!(
            s,
            "- Push/pull: {} repetitions per size, each its own random bytes (the hub stores a blob once per hash), version 1.0.r; push = `push_bytes` until the hub's reply (upload, unpack and check every file, hash, blob write, rows in one transaction); the bench then waits, untimed, for the background validation to end; pull = `download` (the hub reads the blob and hashes it, counts the download; the client hashes the body and compares). MB/s = 10⁶ bytes/s of the packed `.tar.gz`; medians.",
            self.repeats
        );
        let _ = writeln!(
            s,
            "- Floor: the same number of bytes over one kept-alive loopback TCP connection to a plain tokio server in the bench's process (own thread, no HTTP, no hashing, no database), each direction, taking turns with the hub's push and pull; the blob file read back with `std::fs::read` (page cache); one sha256 pass (`agentstack_hub::blobs::sha256_hex`) over the same bytes. Latency floor: a 1-byte TCP round trip and `GET /api/v1/health` (HTTP only), {} each, sequential.",
            thousands(self.health)
        );
        let _ = writeln!(
            s,
            "- Seeding: {} small packages (3 files, {:.1} KB packed on average; name of two words, description, 2–4 tags and a README of Zipf-drawn words from a {}-word vocabulary, plus one rare made-up word each; seed {}), pushed by {} users through the API, {} in flight. Then {} pulls of small packages (Zipf over the packages, sequential) and {} leaderboard results, so that downloads and scores differ.",
            thousands(self.packages),
            self.mean_packed / 1e3,
            VOCAB.len(),
            self.seed,
            OWNERS.len(),
            self.concurrency,
            thousands(self.pulls),
            thousands(self.results)
        );
        let n = thousands(self.runs.first().map_or(0, |r| r.search_all.n));
        let _ = writeln!(
            s,
            "- Search: {n} queries after 50 untimed, one at a time, anonymous, `limit={SEARCH_LIMIT}`, the kinds drawn at random (the same sequence on every backend); latency = request sent to results parsed by `HubClient::search`. Nearest-rank percentiles.\n"
        );

        // Transfers.
        let _ = writeln!(
            s,
            "Push and pull, MB/s (median of {}); \"of floor\" = the hub's rate / the TCP floor's in the same direction:\n",
            self.repeats
        );
        let _ = writeln!(
            s,
            "| size | packed MB | path | push MB/s | push of floor | pull MB/s | pull of floor |\n|:--|--:|:--|--:|--:|--:|--:|"
        );
        for (&mib, &bytes) in &self.payloads {
            let floors: Vec<TransferSummary> = self
                .runs
                .iter()
                .map(|r| TransferSummary::of(&r.transfers, mib))
                .collect();
            let tcp_up = median(&floors.iter().map(|f| f.tcp_up).collect::<Vec<_>>());
            let tcp_down = median(&floors.iter().map(|f| f.tcp_down).collect::<Vec<_>>());
            let disk = median(&floors.iter().map(|f| f.disk).collect::<Vec<_>>());
            let size = format!("{mib} MiB");
            let packed = format!("{:.2}", bytes as f64 / 1e6);
            for (run, t) in self.runs.iter().zip(&floors) {
                let _ = writeln!(
                    s,
                    "| {size} | {packed} | hub, {} | {:.1} | {:.0}% | {:.1} | {:.0}% |",
                    run.backend.label(),
                    t.push,
                    100.0 * t.push / tcp_up,
                    t.pull,
                    100.0 * t.pull / tcp_down,
                );
            }
            let _ = writeln!(
                s,
                "| {size} | {packed} | floor: loopback TCP, plain tokio | {tcp_up:.1} | 100% | {tcp_down:.1} | 100% |"
            );
            let _ = writeln!(
                s,
                "| {size} | {packed} | floor: blob file read (page cache) | – | – | {disk:.1} | {:.0}% |",
                100.0 * disk / tcp_down
            );
            if let Some(sha) = self.sha.get(&mib) {
                let _ = writeln!(
                    s,
                    "| {size} | {packed} | for scale: one sha256 pass | {sha:.1} | – | {sha:.1} | – |"
                );
            }
        }

        // Latency floor.
        let _ = writeln!(
            s,
            "\nLatency floor, sequential requests on a kept-alive connection:\n"
        );
        let _ = writeln!(
            s,
            "| what | p50 ms | p99 ms | p50 vs TCP round trip |\n|:--|--:|--:|--:|"
        );
        let rt = self.round_trip;
        let _ = writeln!(
            s,
            "| 1-byte TCP round trip, plain tokio | {:.3} | {:.3} | 1.0× |",
            rt.p50, rt.p99
        );
        for run in &self.runs {
            let _ = writeln!(
                s,
                "| `GET /api/v1/health`, hub on {} | {:.3} | {:.3} | {:.1}× |",
                run.backend.label(),
                run.health.p50,
                run.health.p99,
                run.health.p50 / rt.p50
            );
        }

        // Seeding.
        let _ = writeln!(
            s,
            "\nSeeding {} small packages, {} pushes in flight; then {} sequential small pulls:\n",
            thousands(self.packages),
            self.concurrency,
            thousands(self.pulls)
        );
        let _ = writeln!(
            s,
            "| backend | wall s | pushes/s | push p50 ms | push p99 ms | validation backlog after the last push s | small pull p50 ms | small pull p99 ms |\n|:--|--:|--:|--:|--:|--:|--:|--:|"
        );
        for run in &self.runs {
            let sd = &run.seeding;
            let _ = writeln!(
                s,
                "| {} | {:.1} | {:.0} | {:.2} | {:.2} | {:.1} | {:.2} | {:.2} |",
                run.backend.label(),
                sd.wall.as_secs_f64(),
                sd.count as f64 / sd.wall.as_secs_f64(),
                sd.latency.p50,
                sd.latency.p99,
                sd.backlog.as_secs_f64(),
                run.small_pulls.p50,
                run.small_pulls.p99
            );
        }

        // Search.
        let _ = writeln!(
            s,
            "\nSearch over {} packages, ms; \"matching\" = median number of packages whose text every query word starts a word of (counted by the bench before stemming; at most {SEARCH_LIMIT} come back); \"vs health\" = p50 / that backend's `/health` p50:\n",
            thousands(self.packages)
        );
        let mut header = String::from("| query | example | matching | queries |");
        let mut align = String::from("|:--|:--|--:|--:|");
        for run in &self.runs {
            let _ = write!(
                header,
                " {0} p50 | {0} p99 | {0} vs health |",
                run.backend.label()
            );
            align.push_str("--:|--:|--:|");
        }
        let _ = writeln!(s, "{header}\n{align}");
        for (kind, example, matching) in self.kinds() {
            let count = self.queries.iter().filter(|q| q.kind == kind).count();
            let _ = write!(
                s,
                "| {} | {example} | {} | {count} |",
                kind.label(),
                thousands(matching.round() as usize)
            );
            for run in &self.runs {
                match run.search.iter().find(|(k, _, _)| *k == kind) {
                    Some((_, st, _)) => {
                        let _ = write!(
                            s,
                            " {:.2} | {:.2} | {:.1}× |",
                            st.p50,
                            st.p99,
                            st.p50 / run.health.p50
                        );
                    }
                    None => s.push_str(" – | – | – |"),
                }
            }
            s.push('\n');
        }
        let _ = write!(s, "| **all** | | | {} |", thousands(self.queries.len()));
        for run in &self.runs {
            let _ = write!(
                s,
                " **{:.2}** | **{:.2}** | {:.1}× |",
                run.search_all.p50,
                run.search_all.p99,
                run.search_all.p50 / run.health.p50
            );
        }
        s.push('\n');
        s
    }

    fn json(&self) -> Value {
        let m = &self.machine;
        json!({
            "command": self.command,
            "date": m.date,
            "machine": {
                "cpus": m.cpus,
                "cpu_model": m.cpu_model,
                "memory": m.memory,
                "kernel": m.kernel,
                "load_average_start": m.load_start,
                "load_average_end": m.load_end,
            },
            "agentstack": self.agentstack,
            "postgres": self.postgres,
            "seed": self.seed,
            "packages": self.packages,
            "mean_packed_bytes": self.mean_packed,
            "floor": {
                "tcp_round_trip": self.round_trip.json(),
                "sha256_mb_per_s": self.sha.iter().map(|(k, v)| (format!("{k}_mib"), json!(v))).collect::<serde_json::Map<_, _>>(),
            },
            "queries": self.queries.iter().map(|q| json!({
                "kind": q.kind.key(),
                "q": q.q,
                "matches": q.matches,
            })).collect::<Vec<_>>(),
            "runs": self.runs.iter().map(|r| json!({
                "backend": r.backend.key(),
                "health": r.health.json(),
                "transfers": r.transfers.iter().map(|t| json!({
                    "mib": t.mib,
                    "bytes": t.bytes,
                    "push_s": t.push.as_secs_f64(),
                    "pull_s": t.pull.as_secs_f64(),
                    "tcp_up_s": t.tcp_up.as_secs_f64(),
                    "tcp_down_s": t.tcp_down.as_secs_f64(),
                    "disk_read_s": t.disk.as_secs_f64(),
                })).collect::<Vec<_>>(),
                "transfer_medians": self.payloads.keys().map(|&mib| {
                    let t = TransferSummary::of(&r.transfers, mib);
                    json!({
                        "mib": mib,
                        "repetitions": t.n,
                        "push_mb_per_s": t.push,
                        "pull_mb_per_s": t.pull,
                        "tcp_up_mb_per_s": t.tcp_up,
                        "tcp_down_mb_per_s": t.tcp_down,
                        "disk_read_mb_per_s": t.disk,
                    })
                }).collect::<Vec<_>>(),
                "seeding": {
                    "packages": r.seeding.count,
                    "wall_s": r.seeding.wall.as_secs_f64(),
                    "pushes_per_s": r.seeding.count as f64 / r.seeding.wall.as_secs_f64(),
                    "push_latency": r.seeding.latency.json(),
                    "validation_backlog_s": r.seeding.backlog.as_secs_f64(),
                },
                "small_pulls": r.small_pulls.json(),
                "search": r.search.iter().map(|(k, st, returned)| json!({
                    "kind": k.key(),
                    "latency": st.json(),
                    "mean_results": returned,
                })).collect::<Vec<_>>(),
                "search_all": r.search_all.json(),
                "search_samples_ms": r.search_samples.iter().map(|(k, v)| json!([k.key(), v])).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_of_odd_and_even_counts() {
        assert_eq!(median(&[4.0, 1.0, 3.0]), 3.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
    }

    #[test]
    fn thousands_are_separated() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(10_000), "10,000");
        assert_eq!(thousands(1_234_567), "1,234,567");
    }

    #[test]
    fn prefixes_are_found_in_sorted_words() {
        let words: Vec<String> = ["game", "grid", "maze"].map(String::from).to_vec();
        assert!(has_prefix(&words, "gam"));
        assert!(has_prefix(&words, "maze"));
        assert!(!has_prefix(&words, "mazes"));
        assert!(!has_prefix(&words, "b"));
    }

    #[test]
    fn zipf_favours_low_ranks() {
        let zipf = Zipf::new(100);
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let draws: Vec<usize> = (0..10_000).map(|_| zipf.draw(&mut rng)).collect();
        let first = draws.iter().filter(|&&d| d == 0).count();
        let last = draws.iter().filter(|&&d| d == 99).count();
        assert!(draws.iter().all(|&d| d < 100));
        assert!(first > 10 * last, "{first} vs {last}");
    }

    #[test]
    fn vocabulary_words_are_distinct_and_searchable() {
        let mut seen = HashSet::new();
        for w in VOCAB {
            assert!(seen.insert(*w), "{w} twice");
            assert!(w.chars().all(|c| c.is_ascii_lowercase()), "{w}");
        }
    }
}
