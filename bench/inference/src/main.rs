//! Side-by-side inference benchmark of `agentstack-model` against llama.cpp, in one
//! run, on one GGUF file:
//!
//! 1. **Prefill and decode** (`pp`, `tg`) at each thread count, llama-bench's
//!    protocol: `llama-bench -m MODEL -p 64 -n 128 -t T -r 1 -o json` against the
//!    same tests on our `Model::forward` in a child process (see [`in_process`]),
//!    alternating, one timed run each per round, 3 rounds.
//! 2. **Aggregate throughput** of concurrent requests: `llama-server -np 8` against
//!    `agentstack model serve`, both started with the same thread count, both
//!    answering rounds of 8 concurrent `/v1/completions` requests (greedy,
//!    `max_tokens` 128, `ignore_eos`) from one load generator on 127.0.0.1.
//! 3. **Cost floor**: $ per million generated tokens at an assumed machine price.
//! 4. **Startup**: load time and peak memory of each engine loading the model and
//!    computing one token in a fresh process (see [`startup`]).
//!
//! Progress goes to stderr, the tables (markdown) to stdout, every figure to a JSON
//! file, and with `--write-results` the tables are appended to `bench/RESULTS.md`.
//! See `bench/README.md`.

mod bandwidth;
mod in_process;
mod llama_bench;
mod load;
mod models;
mod random_model;
mod report;
mod servers;
mod settings;
mod startup;

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use agentstack_bench_support::machine;
use agentstack_bench_support::report as bench_report;
use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};

use agentstack_quant::gguf::Gguf;
use in_process::{MeasureArgs, Outcome};
use models::{ModelSet, ModelsArgs};
use report::{Concurrent, ModelResults, PpTg, Rate, Results, RoundRecord, ServerFigures, Versions};
use servers::{Engine, Server};
use settings::{Kernels, Phase, Plan, Settings, UserError};

/// How often the spinners redraw.
pub(crate) const SPINNER_TICK: Duration = Duration::from_millis(120);

#[derive(Debug, Parser)]
#[command(
    name = "agentstack-bench-inference",
    about = "Benchmark agentstack-model against llama.cpp on the same GGUF file: prefill, decode, concurrent requests, cost floor",
    args_conflicts_with_subcommands = true
)]
struct Args {
    /// The GGUF file [default: $AGENTSTACK_TEST_MODEL, else
    /// ~/.cache/agentstack/models/SmolLM2-135M-Instruct.Q4_1.gguf].
    #[arg(long, conflicts_with_all = ["models", "set"])]
    model: Option<PathBuf>,
    /// Several GGUF files, measured one after the other into one table.
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "PATH,...",
        conflicts_with = "set"
    )]
    models: Option<Vec<PathBuf>>,
    /// The prepared model set (see the `models` command): each type of SmolLM2, of the
    /// random 1B model, or both. With several models the default phase is pp-tg.
    #[arg(long, value_enum)]
    set: Option<ModelSet>,
    /// Our kernel families, each measured as its own rows: native (the widest this CPU
    /// has) and avx2 (AGENTSTACK_KERNELS=avx2 in our child) [default: native].
    #[arg(long, value_enum, value_delimiter = ',')]
    kernels: Option<Vec<Kernels>>,
    /// Folder with llama-bench and llama-server [default: $AGENTSTACK_LLAMACPP_BIN, else
    /// ~/.cache/agentstack/llama.cpp-0.3.36/bin].
    #[arg(long, value_name = "DIR")]
    llamacpp_bin: Option<PathBuf>,
    /// The agentstack binary to serve with [default: the newer of target/release/agentstack
    /// and target/debug/agentstack].
    #[arg(long, value_name = "PATH")]
    agentstack: Option<PathBuf>,
    /// Phases to run [default: pp-tg,concurrent].
    #[arg(long, value_enum, value_delimiter = ',')]
    only: Option<Vec<Phase>>,
    /// Compute thread counts, each measured separately [default: 1,2; quick: 1].
    #[arg(long, value_delimiter = ',')]
    threads: Option<Vec<usize>>,
    /// Prompt tokens of the prefill test (llama-bench -p).
    #[arg(long, short = 'p', default_value_t = 64)]
    prompt_tokens: usize,
    /// Generated tokens of the decode test (llama-bench -n).
    #[arg(long, short = 'n', default_value_t = 128)]
    gen_tokens: usize,
    /// Timed runs of each prefill/decode test (llama-bench -r) [default: 3; quick: 1].
    #[arg(long, short = 'r')]
    repetitions: Option<usize>,
    /// Concurrent requests per round (and llama-server's -np).
    #[arg(long, default_value_t = 8)]
    requests: usize,
    /// max_tokens of each request [default: 128; quick: 32].
    #[arg(long)]
    max_tokens: Option<usize>,
    /// Measured rounds per server and thread count [default: 3; quick: 1].
    #[arg(long)]
    rounds: Option<usize>,
    /// Unmeasured rounds first, per server and thread count.
    #[arg(long, default_value_t = 1)]
    warmup_rounds: usize,
    /// The prompt of every request.
    #[arg(
        long,
        default_value = "Write a short story about a robot who learns to paint."
    )]
    prompt: String,
    /// llama-server's -c, the context its slots share.
    #[arg(long, default_value_t = 8192)]
    llama_server_ctx: usize,
    /// Machine price for the cost floor, $ per hour (an assumption; use your own).
    #[arg(long, default_value_t = 0.10)]
    price_per_hour: f64,
    /// Where to write every figure as JSON.
    #[arg(
        long,
        value_name = "PATH",
        default_value = "target/bench-inference.json"
    )]
    json: PathBuf,
    /// Append the tables, with date, machine and command, to this markdown file.
    #[arg(long, value_name = "PATH")]
    write_results: Option<PathBuf>,
    /// Fewer counts, for a smoke run of a minute or two.
    #[arg(long)]
    quick: bool,
    /// How long each server may take to answer `GET /health`, seconds.
    #[arg(long, default_value_t = 180)]
    startup_timeout: u64,
    /// How long one request may take, seconds.
    #[arg(long, default_value_t = 600)]
    request_timeout: u64,
    #[command(subcommand)]
    command: Option<Command>,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
enum Command {
    /// Prepare the model set (`--set`): SmolLM2 and a random ~1B llama in each type
    /// people ship, and our allocator's mix, cached under
    /// ~/.cache/agentstack/bench-models/.
    Models(ModelsArgs),
    /// Measures our forward pass (run by the benchmark in a child, per thread count).
    #[command(name = "__measure", hide = true)]
    Measure(MeasureArgs),
}

/// The allocator the `agentstack` binary uses (see its `main.rs`), so our side runs as
/// the CLI does.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let args = match Args::try_parse() {
        Ok(args) => args,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(1)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    if let Some(Command::Measure(measure)) = &args.command {
        return exit(in_process::measure(measure));
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the tokio runtime: {e}");
            return ExitCode::from(2);
        }
    };
    exit(runtime.block_on(run(args)))
}

/// 0 ok, 1 for what the user can fix, 2 for the rest.
fn exit(result: Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            if e.downcast_ref::<UserError>().is_some() {
                ExitCode::from(1)
            } else {
                ExitCode::from(2)
            }
        }
    }
}

async fn run(args: Args) -> Result<()> {
    if let Some(Command::Models(models_args)) = &args.command {
        return models::prepare(models_args).await;
    }
    let settings = Settings::resolve(&args)?;
    let plan = &settings.plan;
    let mut machine = report::Machine::read();
    let log_dir =
        std::env::temp_dir().join(format!("agentstack-bench-inference-{}", std::process::id()));
    std::fs::create_dir_all(&log_dir).with_context(|| format!("creating {}", log_dir.display()))?;
    let mut versions = versions(&settings);
    eprintln!(
        "{} model(s):\n  {}\nllama.cpp tools in {}\nagentstack {}\nlogs in {}\nload average {}",
        settings.models.len(),
        settings
            .models
            .iter()
            .map(|m| m.display().to_string())
            .collect::<Vec<_>>()
            .join("\n  "),
        settings
            .llama_bench
            .parent()
            .unwrap_or(Path::new(""))
            .display(),
        settings.agentstack.display(),
        log_dir.display(),
        machine.load_average_start
    );

    let (mut bandwidths, mut reads) = (Vec::new(), Vec::new());
    if plan.phases.contains(&Phase::PpTg) {
        let mut counts = vec![1];
        counts.extend(plan.threads.iter().copied().filter(|&t| t != 1));
        // One measurement with a spinner, then its figures on stderr.
        let measure = |what: &str, bytes: usize, threads: usize, run: fn(usize) -> Result<_>| {
            let progress = spinner(format!(
                "{what} bandwidth, {} MiB, {threads} thread(s)",
                bytes >> 20
            ));
            let measured: Result<bandwidth::Bandwidth> = run(threads);
            progress.finish_and_clear();
            let measured = measured?;
            eprintln!(
                "{what} bandwidth, {threads} thread(s): best {:.1} GB/s, median {:.1} GB/s",
                measured.best_bytes_per_second / 1e9,
                measured.median_bytes_per_second / 1e9
            );
            Ok::<_, anyhow::Error>(measured)
        };
        for threads in counts {
            bandwidths.push(measure(
                "memcpy",
                bandwidth::BUFFER_BYTES,
                threads,
                bandwidth::measure,
            )?);
            reads.push(measure(
                "read",
                bandwidth::read_buffer_bytes(),
                threads,
                bandwidth::measure_read,
            )?);
        }
    }

    let mut model_results = Vec::new();
    for (index, model) in settings.models.iter().enumerate() {
        let label = models::label(model);
        let bytes_per_token = match Gguf::open(model) {
            Ok(file) => bandwidth::weight_bytes_per_token(&file),
            Err(e) => {
                eprintln!("  warning: cannot read {}'s tensors: {e}", model.display());
                0
            }
        };
        eprintln!(
            "model {}/{}: {label}, {:.1} MiB of weights read per decoded token",
            index + 1,
            settings.models.len(),
            bytes_per_token as f64 / (1024.0 * 1024.0)
        );
        // A repack cache of the model's own, which its first child fills: the figures
        // are those of a user's later loads (the startup phase also times the first).
        let repack_cache = log_dir.join(format!("repacked-m{}", index + 1));
        in_process::set_repack_cache(Some(repack_cache.clone()));
        let mut startup = None;
        if plan.phases.contains(&Phase::Startup) {
            let threads = plan.threads[0];
            eprintln!(
                "  load + first token: {} rounds at {threads} thread(s)",
                plan.repetitions
            );
            startup = Some(
                startup::phase(
                    &startup::llama_completion(&settings.llama_bench),
                    model,
                    threads,
                    plan.repetitions,
                    &log_dir,
                    index,
                )
                .await?,
            );
        }
        let mut pp_tg = Vec::new();
        if plan.phases.contains(&Phase::PpTg) {
            pp_tg = pp_tg_phase(
                &settings,
                model,
                index,
                bytes_per_token,
                (&bandwidths, &reads),
                &log_dir,
                &mut versions,
            )
            .await?;
        }
        let mut concurrent = Vec::new();
        if plan.phases.contains(&Phase::Concurrent) {
            let http = reqwest::Client::builder()
                .no_proxy()
                .timeout(settings.request_timeout)
                .build()
                .context("building the HTTP client")?;
            eprintln!(
                "concurrent: {} requests × {} tokens at once, {} warm-up + {} measured rounds per server, at {:?} thread(s)",
                plan.requests, plan.max_tokens, plan.warmup_rounds, plan.rounds, plan.threads
            );
            for &threads in &plan.threads {
                concurrent.push(
                    concurrent_phase(&settings, model, index, &http, threads, &log_dir).await?,
                );
            }
        }
        in_process::set_repack_cache(None);
        if let Err(e) = std::fs::remove_dir_all(&repack_cache)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            eprintln!("  warning: cannot remove {}: {e}", repack_cache.display());
        }
        model_results.push(ModelResults {
            path: model.display().to_string(),
            label,
            weight_bytes_per_token: bytes_per_token,
            pp_tg,
            concurrent,
            startup,
        });
    }

    machine.load_average_end = report::load_average();
    let cost = report::costs(plan, &model_results);
    let results = Results {
        benchmark: "inference",
        date: machine::utc_now(),
        command: bench_report::command_line(),
        machine,
        versions,
        plan: plan.clone(),
        bandwidth: bandwidths,
        read_bandwidth: reads,
        models: model_results,
        cost,
    };
    let throughput = plan.phases.contains(&Phase::PpTg) || plan.phases.contains(&Phase::Concurrent);
    let mut table = if throughput {
        report::table(&results)
    } else {
        String::new()
    };
    if !results.bandwidth.is_empty() {
        table.push('\n');
        table.push_str(&report::bandwidth_line(&results));
    }
    let startups: Vec<_> = results
        .models
        .iter()
        .filter_map(|m| m.startup.as_ref().map(|s| (m.label.clone(), s)))
        .collect();
    if !startups.is_empty() {
        if !table.is_empty() {
            table.push('\n');
        }
        table.push_str(&startup::table(&startups, plan.repetitions));
    }
    // Native rows only (`report::costs`): an AVX2-only run has none.
    let cost_table = if throughput && !results.cost.is_empty() {
        report::cost_table(&results)
    } else {
        String::new()
    };
    println!("{table}\n{cost_table}");

    bench_report::write_json(&settings.json, &results)?;
    if let Some(path) = &settings.write_results {
        append_results(path, &results, &table, &cost_table)?;
        eprintln!("appended the results to {}", path.display());
    }
    Ok(())
}

/// Our side's figures at one thread count and kernel family, gathered over the rounds.
struct OurSide {
    kernels: Kernels,
    pp: Vec<f64>,
    tg: Vec<f64>,
    load_seconds: Vec<f64>,
    error: Option<String>,
}

/// Prefill and decode of one model at each thread count: llama-bench, then ours with
/// each kernel family, one timed run each per round, alternating, so that a shared
/// machine's slow drifts reach every side alike instead of whichever ran during them.
/// A side that fails (ours cannot load the model, or a run fails) is reported in its
/// rows and the others go on.
async fn pp_tg_phase(
    settings: &Settings,
    model: &Path,
    index: usize,
    bytes_per_token: u64,
    (bandwidths, reads): (&[bandwidth::Bandwidth], &[bandwidth::Bandwidth]),
    log_dir: &Path,
    versions: &mut Versions,
) -> Result<Vec<PpTg>> {
    let plan = &settings.plan;
    eprintln!(
        "  prefill/decode: pp{} and tg{}, {} rounds, at {:?} thread(s), our kernels {:?}",
        plan.prompt_tokens, plan.gen_tokens, plan.repetitions, plan.threads, plan.kernels
    );
    let once = Plan {
        repetitions: 1,
        ..plan.clone()
    };
    // Whether our runtime loads the model does not depend on threads or kernels.
    let mut cannot_load: Option<String> = None;
    let mut rows = Vec::new();
    for &threads in &plan.threads {
        let log = log_dir.join(format!("llama-bench-m{}-t{threads}.stderr", index + 1));
        let (mut their_pp, mut their_tg) = (Vec::new(), Vec::new());
        let mut their_error: Option<String> = None;
        let mut build_commit = String::new();
        let mut ours: Vec<OurSide> = plan
            .kernels
            .iter()
            .map(|&kernels| OurSide {
                kernels,
                pp: Vec::new(),
                tg: Vec::new(),
                load_seconds: Vec::new(),
                error: None,
            })
            .collect();
        for round in 1..=plan.repetitions {
            if their_error.is_none() {
                let spinner = spinner(format!(
                    "llama-bench -t {threads} -r 1, round {round}/{}",
                    plan.repetitions
                ));
                let theirs =
                    llama_bench::run(&settings.llama_bench, model, &once, threads, &log).await;
                spinner.finish_and_clear();
                match theirs {
                    Ok(theirs) => {
                        eprintln!(
                            "  {threads} thread(s), round {round}: llama.cpp pp {:.0} tg {:.1} tok/s",
                            theirs.pp.mean, theirs.tg.mean
                        );
                        their_pp.extend(theirs.pp.samples);
                        their_tg.extend(theirs.tg.samples);
                        build_commit = theirs.build_commit;
                    }
                    Err(e) => {
                        eprintln!("  llama.cpp failed: {e:#}");
                        their_error = Some(format!("failed: {e:#}"));
                    }
                }
            }
            for side in &mut ours {
                if side.error.is_some() {
                    continue;
                }
                if let Some(e) = &cannot_load {
                    side.error = Some(e.clone());
                    continue;
                }
                match in_process::run_child(model, &once, threads, side.kernels).await {
                    Ok(Outcome::Measured(m)) => {
                        eprintln!(
                            "  {threads} thread(s), round {round}: agentstack ({} kernels) pp {:.0} tg {:.1} tok/s",
                            side.kernels, m.pp.mean, m.tg.mean
                        );
                        side.pp.extend(m.pp.samples);
                        side.tg.extend(m.tg.samples);
                        side.load_seconds.push(m.load_seconds);
                    }
                    Ok(Outcome::CannotLoad { error }) => {
                        eprintln!("  agentstack cannot load {}: {error}", model.display());
                        let e = format!("cannot load: {error}");
                        cannot_load = Some(e.clone());
                        side.error = Some(e);
                    }
                    Err(e) => {
                        eprintln!("  agentstack ({} kernels) failed: {e:#}", side.kernels);
                        side.error = Some(format!("failed: {e:#}"));
                    }
                }
            }
        }
        let llamacpp_pp = Rate::of(their_pp);
        let llamacpp_tg = Rate::of(their_tg);
        if !build_commit.is_empty() && !versions.llamacpp.contains(&build_commit) {
            let _ = write!(versions.llamacpp, " (llama-bench build {build_commit})");
        }
        let decode_ceiling =
            bandwidth::ceiling(bandwidth::at_most(bandwidths, threads), bytes_per_token);
        let read_ceiling = bandwidth::ceiling(bandwidth::at_most(reads, threads), bytes_per_token);
        for side in ours {
            let agentstack_pp = Rate::of(side.pp);
            let agentstack_tg = Rate::of(side.tg);
            let load_seconds =
                side.load_seconds.iter().sum::<f64>() / side.load_seconds.len().max(1) as f64;
            let ours_line = match &side.error {
                Some(e) => e.lines().next().unwrap_or_default().to_owned(),
                None => format!(
                    "pp {:.0} tg {:.1} tok/s (loaded in {load_seconds:.2} s)",
                    agentstack_pp.mean, agentstack_tg.mean
                ),
            };
            let theirs_line = match &their_error {
                Some(e) => e.lines().next().unwrap_or_default().to_owned(),
                None => format!(
                    "pp {:.0} tg {:.1} tok/s",
                    llamacpp_pp.mean, llamacpp_tg.mean
                ),
            };
            eprintln!(
                "  {threads} thread(s), {} kernels: agentstack {ours_line}; llama.cpp {theirs_line}; decode ceiling {decode_ceiling:.1} tok/s (memcpy), {read_ceiling:.1} (reads)",
                side.kernels
            );
            let measured = |rate: &Rate, error: &Option<String>| {
                if error.is_some() { f64::NAN } else { rate.mean }
            };
            let (ours_pp, ours_tg) = (
                measured(&agentstack_pp, &side.error),
                measured(&agentstack_tg, &side.error),
            );
            let (theirs_pp, theirs_tg) = (
                measured(&llamacpp_pp, &their_error),
                measured(&llamacpp_tg, &their_error),
            );
            rows.push(PpTg {
                threads,
                kernels: side.kernels,
                llamacpp_command: format!(
                    "{} {}",
                    settings.llama_bench.display(),
                    llama_bench::arguments(model, &once, threads).join(" ")
                ),
                agentstack_error: side.error,
                llamacpp_error: their_error.clone(),
                pp_ratio: report::ratio(ours_pp, theirs_pp),
                tg_ratio: report::ratio(ours_tg, theirs_tg),
                decode_ceiling,
                agentstack_tg_of_ceiling: ours_tg / decode_ceiling,
                llamacpp_tg_of_ceiling: theirs_tg / decode_ceiling,
                read_ceiling,
                agentstack_tg_of_read_ceiling: ours_tg / read_ceiling,
                llamacpp_tg_of_read_ceiling: theirs_tg / read_ceiling,
                agentstack_pp,
                agentstack_tg,
                agentstack_load_seconds: load_seconds,
                llamacpp_pp: llamacpp_pp.clone(),
                llamacpp_tg: llamacpp_tg.clone(),
            });
        }
    }
    Ok(rows)
}

/// Both servers at one thread count: started together, rounds alternating between
/// them so that background load falls on both alike, then stopped.
async fn concurrent_phase(
    settings: &Settings,
    model: &Path,
    index: usize,
    http: &reqwest::Client,
    threads: usize,
    log_dir: &Path,
) -> Result<Concurrent> {
    let plan = &settings.plan;
    let mut running = Vec::new();
    for engine in [Engine::LlamaCpp, Engine::Agentstack] {
        let spinner = spinner(format!("starting the {engine} server, {threads} thread(s)"));
        let command = servers::command(settings, model, engine, threads)?;
        let log = log_dir.join(format!(
            "{}-server-m{}-t{threads}.log",
            engine.to_string().replace('.', ""),
            index + 1
        ));
        let server = Server::start(engine, command, log, settings.startup_timeout, http).await;
        spinner.finish_and_clear();
        let server = server?;
        eprintln!(
            "  {engine} server on port {}: {}",
            server.port, server.command
        );
        running.push(server);
    }

    let per_round = plan.requests as u64;
    let bar = ProgressBar::new(
        (plan.warmup_rounds + plan.rounds) as u64 * running.len() as u64 * per_round,
    );
    bar.set_style(
        ProgressStyle::with_template("  {prefix} [{bar:30}] {pos}/{len} requests, {elapsed} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_prefix(format!("concurrent, {threads} thread(s)"));
    let mut rounds: Vec<Vec<RoundRecord>> = vec![Vec::new(); running.len()];
    let outcome: Result<()> = async {
        for round in 0..plan.warmup_rounds + plan.rounds {
            let warmup = round < plan.warmup_rounds;
            for (i, server) in running.iter_mut().enumerate() {
                bar.set_message(if warmup {
                    format!("{} warm-up", server.engine)
                } else {
                    format!("{} round {}/{}", server.engine, round - plan.warmup_rounds + 1, plan.rounds)
                });
                let body = load::body(plan, server.engine);
                let result = load::round(http, server, &body, plan.requests, plan.max_tokens, &bar).await;
                server.ensure_running()?;
                let result = result?;
                if result.short_answers > 0 {
                    note(&bar, format!(
                        "  warning: {} of the {} answers from {} had fewer than {} tokens",
                        result.short_answers, plan.requests, server.engine, plan.max_tokens
                    ));
                }
                if !warmup {
                    note(&bar, format!(
                        "  {:<10} {threads} thread(s), round {}: {} tokens in {:.2} s = {:.1} tok/s",
                        server.engine.to_string(),
                        round - plan.warmup_rounds + 1,
                        result.tokens,
                        result.wall.as_secs_f64(),
                        result.tokens_per_second()
                    ));
                    rounds[i].push(RoundRecord {
                        wall_seconds: result.wall.as_secs_f64(),
                        tokens: result.tokens,
                        short_answers: result.short_answers,
                    });
                }
            }
        }
        Ok(())
    }
    .await;
    bar.finish_and_clear();
    let mut figures = Vec::new();
    for (server, rounds) in running.into_iter().zip(rounds) {
        figures.push(ServerFigures {
            command: server.command.clone(),
            tokens_per_second: Rate::of(
                rounds
                    .iter()
                    .map(|r| r.tokens as f64 / r.wall_seconds)
                    .collect(),
            ),
            rounds,
        });
        server.stop().await;
    }
    outcome?;
    let agentstack = figures.pop().context("no agentstack figures")?;
    let llamacpp = figures.pop().context("no llama.cpp figures")?;
    Ok(Concurrent {
        threads,
        ratio: report::ratio(
            agentstack.tokens_per_second.mean,
            llamacpp.tokens_per_second.mean,
        ),
        agentstack,
        llamacpp,
    })
}

/// A line above the progress bar, or plainly on stderr when the bar is hidden (stderr
/// is not a terminal), where indicatif would drop it.
fn note(bar: &ProgressBar, line: String) {
    if bar.is_hidden() {
        eprintln!("{line}");
    } else {
        bar.println(line);
    }
}

fn spinner(message: String) -> ProgressBar {
    let spinner = ProgressBar::new_spinner();
    spinner.set_style(
        ProgressStyle::with_template("  {spinner} {msg}, {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    spinner.set_message(message);
    spinner.enable_steady_tick(SPINNER_TICK);
    spinner
}

/// What ran: agentstack's version and git commit, llama.cpp's version.
fn versions(settings: &Settings) -> Versions {
    let output = |program: &Path, args: &[&str]| {
        std::process::Command::new(program)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let git = Path::new("git");
    let dir = manifest_dir.to_string_lossy();
    let commit = output(git, &["-C", &dir, "rev-parse", "--short", "HEAD"])
        .unwrap_or_else(|| "unknown".into());
    let dirty = output(
        git,
        &["-C", &dir, "status", "--porcelain", "--", "../../crates"],
    )
    .is_some_and(|s| !s.is_empty());
    let agentstack_version =
        output(&settings.agentstack, &["--version"]).unwrap_or_else(|| "version unknown".into());
    // Which build ran matters as much as its version (a native and an AVX2 build of
    // one commit sit side by side in the cache).
    let llamacpp = settings
        .llama_bench
        .parent()
        .and_then(Path::parent)
        .and_then(|dir| std::fs::read_to_string(dir.join("VERSION")).ok())
        .map_or_else(
            || format!("`{}`", settings.llama_bench.display()),
            |v| format!("{}: `{}`", v.trim(), settings.llama_bench.display()),
        );
    Versions {
        agentstack: format!(
            "{agentstack_version} ({}; in-process: this benchmark's build) at git {commit}{}",
            settings.agentstack.display(),
            if dirty {
                " plus uncommitted changes in crates/"
            } else {
                ""
            }
        ),
        llamacpp,
    }
}

fn append_results(path: &Path, results: &Results, table: &str, cost_table: &str) -> Result<()> {
    let plan = &results.plan;
    let m = &results.machine;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\n## inference: agentstack-model vs llama.cpp, {}\n",
        results.date
    );
    let _ = writeln!(
        s,
        "- Machine: {} × {}, {:.1} GiB RAM; load average {} at start, {} at end.",
        m.cpus, m.cpu_model, m.memory_gib, m.load_average_start, m.load_average_end
    );
    let _ = writeln!(s, "- Command: `{}`", results.command);
    for m in &results.models {
        let _ = writeln!(
            s,
            "- Model: `{}` ({:.1} MiB of weights read per decoded token).",
            m.path,
            m.weight_bytes_per_token as f64 / (1024.0 * 1024.0)
        );
    }
    let _ = writeln!(s, "- agentstack: {}.", results.versions.agentstack);
    let _ = writeln!(s, "- llama.cpp: {}.", results.versions.llamacpp);
    if plan.phases.contains(&Phase::PpTg) {
        let _ = writeln!(
            s,
            "- Prefill/decode: llama-bench's protocol on both sides, {} rounds alternating between them, one timed run \
             per side per round (`llama-bench -p {} -n {} -r 1 -t T -o json`; ours: \
             `Model::forward` in a child process with RAYON_NUM_THREADS=T and CANDLE_NUM_THREADS=1 (as the CLI), a {}-token prompt in one call \
             on a fresh cache, then {} one-token calls on another, random token ids, one warm-up each); our kernel \
             families {:?} (avx2: AGENTSTACK_KERNELS=avx2 in our child; llama.cpp runs the one `llama-bench` named above on every row).",
            plan.repetitions,
            plan.prompt_tokens,
            plan.gen_tokens,
            plan.prompt_tokens,
            plan.gen_tokens,
            plan.kernels
        );
        let _ = writeln!(
            s,
            "- Decode ceiling: best `memcpy` bandwidth at T threads (a {} MiB buffer copied, counted as traffic read + written, as STREAM does) / bytes \
             of weights read per decoded token (every 2-D weight matrix, the output head included; a tied embedding \
             counted once, as the head).",
            bandwidth::BUFFER_BYTES >> 20
        );
        let _ = writeln!(
            s,
            "- Read ceiling: best read-only bandwidth at T threads (a {} MiB buffer, twice the last-level cache and at least 1 GiB, each thread \
             reading its part as {} prefetched sequential streams at once and as one stream, the two ways decode reads its weights, the faster \
             counted) / the same bytes per token. A copy is not what decode does: one core may read more or less than `memcpy` counts (see \
             `bench/inference/src/bandwidth.rs`).",
            bandwidth::read_buffer_bytes() >> 20,
            bandwidth::READ_STREAMS
        );
    }
    if plan.phases.contains(&Phase::Startup) {
        let _ = writeln!(
            s,
            "- Startup: each engine in a fresh process loads the model and computes one token, {} rounds alternating \
             (ours: `Model::forward` on one prompt token then one decoded token in a child process; llama.cpp: \
             `llama-completion -m MODEL -p Hi -n 1 --no-warmup -no-cnv -t T`), at the first thread count; wall time from \
             spawn to exit, peak RSS its `VmHWM` read every 2 ms; the file is in the page cache. Our children use a repack cache of the model's own \
             (`AGENTSTACK_REPACK_CACHE`): the startup phase's first run of ours finds it empty, repacks and \
             writes the entry (reported as the first load), and every later child of ours (these rounds, \
             prefill/decode, the server) maps the entry, as a user's second and later loads do.",
            plan.repetitions
        );
    }
    if plan.phases.contains(&Phase::Concurrent) {
        let _ = writeln!(
            s,
            "- Concurrent: `llama-server -t T -np {} -c {}` and `agentstack model serve --threads T`, both on 127.0.0.1; \
             {} rounds of {} concurrent `/v1/completions` (prompt {:?}, max_tokens {}, temperature 0, ignore_eos; \
             agentstack also detect_loops false) after {} warm-up round(s), alternating between the servers; \
             aggregate = generated tokens / wall time of the round. The load generator shares the cores.",
            plan.requests,
            plan.llama_server_ctx,
            plan.rounds,
            plan.requests,
            plan.prompt,
            plan.max_tokens,
            plan.warmup_rounds
        );
    }
    let _ = writeln!(s, "\n{table}\n{cost_table}");
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    file.write_all(s.as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}
