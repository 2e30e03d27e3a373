//! The benchmark's model set, prepared once and cached: `agentstack-bench-inference
//! models`.
//!
//! Under `$AGENTSTACK_CACHE/bench-models/llama.cpp-<commit>/` (a folder per llama.cpp
//! build, since its quantizers make the files):
//!
//! - `SmolLM2-135M-Instruct.F16.gguf`: the exact dequantization of the cached Q4_1
//!   (`llama-quantize --allow-requantize Q4_1 F16`), the source of every other type;
//! - `SmolLM2-135M-Instruct.{Q4_K_M,Q5_K_M,Q6_K,Q8_0,Q4_0,IQ4_XS,Q3_K_M,Q2_K}.gguf`:
//!   `llama-quantize F16 TYPE`;
//! - `SmolLM2-135M-Instruct.agentstack-mix.gguf`: `agentstack model quantize
//!   --target-size` at the Q4_K_M file's size, one of our allocator's mixes;
//! - `random-llama-1B.F16.gguf`: random weights in a ~1B llama shape (see
//!   [`random_model`]), and the same eight types from it;
//! - `random-llama-1B.agentstack-mix.gguf`: SmolLM2's mix carried over tensor by tensor
//!   (same kind of weight at the same relative depth), quantized by agentstack-quant.
//!
//! Files that exist are kept; each new one is written under a temporary name and
//! renamed when complete, so an interrupted run never leaves a partial file.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use agentstack_quant::gguf::Gguf;
use agentstack_quant::recipe::{Plan, quantize_file};
use agentstack_quant::types::GgmlType;
use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};

use crate::random_model;
use crate::settings::{self, UserError};

/// llama.cpp's types in the set, as `llama-quantize` names them: what people ship.
pub const LLAMA_TYPES: &[&str] = &[
    "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0", "IQ4_XS", "Q3_K_M", "Q2_K",
];
/// The file-name suffix of our allocator's mix.
pub const MIX: &str = "agentstack-mix";
/// File stem of the SmolLM2 files.
const SMOLLM2: &str = "SmolLM2-135M-Instruct";
/// File stem of the random 1B files.
const ONE_B: &str = "random-llama-1B";
/// `--ctx` of `agentstack model quantize`: bench/quant's calibration text is 437 tokens.
const MIX_CTX: &str = "128";
/// Longest one step (a quantization) may take.
const STEP_TIMEOUT: Duration = Duration::from_secs(60 * 60);

/// Which models of the set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ModelSet {
    /// SmolLM2-135M-Instruct in each type.
    Smollm2,
    /// The random-weight ~1B llama in each type.
    #[value(name = "1b")]
    OneB,
    /// Both.
    All,
}

/// `models`: prepare the set.
#[derive(Debug, Clone, clap::Args)]
pub struct ModelsArgs {
    /// Which models to prepare.
    #[arg(long, value_enum, default_value = "all")]
    pub set: ModelSet,
    /// The Q4_1 file the SmolLM2 files are made from [default: $AGENTSTACK_TEST_MODEL,
    /// else ~/.cache/agentstack/models/SmolLM2-135M-Instruct.Q4_1.gguf].
    #[arg(long, value_name = "PATH")]
    pub source: Option<PathBuf>,
    /// Folder with llama-quantize and llama-bench [default: $AGENTSTACK_LLAMACPP_BIN,
    /// else ~/.cache/agentstack/llama.cpp-0.3.36/bin].
    #[arg(long, value_name = "DIR")]
    pub llamacpp_bin: Option<PathBuf>,
    /// The agentstack binary that makes the allocator's mix [default: the newer of
    /// target/release/agentstack and target/debug/agentstack].
    #[arg(long, value_name = "PATH")]
    pub agentstack: Option<PathBuf>,
    /// Threads of the quantizers [default: every CPU].
    #[arg(long)]
    pub threads: Option<usize>,
}

/// The files of the set in the benchmark's order: each llama.cpp type, then the mix.
pub fn files(dir: &Path, set: ModelSet) -> Vec<PathBuf> {
    let stems: &[&str] = match set {
        ModelSet::Smollm2 => &[SMOLLM2],
        ModelSet::OneB => &[ONE_B],
        ModelSet::All => &[SMOLLM2, ONE_B],
    };
    stems
        .iter()
        .flat_map(|stem| {
            LLAMA_TYPES
                .iter()
                .chain(std::iter::once(&MIX))
                .map(move |ty| dir.join(format!("{stem}.{ty}.gguf")))
        })
        .collect()
}

/// The set's folder for the llama.cpp tools in `llamacpp_bin`:
/// `<cache>/bench-models/llama.cpp-<commit>`.
pub fn set_dir(cache: &Path, llamacpp_bin: &Path) -> PathBuf {
    cache
        .join("bench-models")
        .join(format!("llama.cpp-{}", llamacpp_commit(llamacpp_bin)))
}

/// llama.cpp's commit from `llama-bench --version` (`... (build 1, commit 0c1e570)`),
/// else the tools folder's parent's name.
fn llamacpp_commit(bin: &Path) -> String {
    let version = std::process::Command::new(bin.join("llama-bench"))
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .ok()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr)
        })
        .unwrap_or_default();
    let commit = version.split("commit ").nth(1).map(|rest| {
        rest.chars()
            .take_while(char::is_ascii_alphanumeric)
            .collect::<String>()
    });
    match commit {
        Some(c) if !c.is_empty() => c,
        _ => bin
            .parent()
            .and_then(Path::file_name)
            .map_or_else(|| "unknown".into(), |n| n.to_string_lossy().into_owned()),
    }
}

/// Prepares the set: every missing file, then a check that llama.cpp and our loader
/// both take the 1B F16 and Q8_0 files.
pub async fn prepare(args: &ModelsArgs) -> Result<()> {
    let cache = settings::cache_dir();
    let bin = settings::llamacpp_bin(args.llamacpp_bin.as_deref(), &cache);
    let quantize = bin.join("llama-quantize");
    let llama_bench = bin.join("llama-bench");
    for tool in [&quantize, &llama_bench] {
        if !tool.is_file() {
            return Err(UserError(format!(
                "{} does not exist\nhint: run scripts/install-llamacpp, or pass --llamacpp-bin",
                tool.display()
            ))
            .into());
        }
    }
    let source = args
        .source
        .clone()
        .unwrap_or_else(|| settings::default_model(&cache));
    if !source.is_file() {
        return Err(UserError(format!(
            "the source model {} does not exist\nhint: run scripts/fetch-model, or pass --source",
            source.display()
        ))
        .into());
    }
    let agentstack = args
        .agentstack
        .clone()
        .unwrap_or_else(settings::default_agentstack);
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from))
        .to_string();
    let dir = set_dir(&cache, &bin);
    let logs = dir.join("logs");
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    eprintln!("model set in {}\nlogs in {}", dir.display(), logs.display());

    let path = |stem: &str, ty: &str| dir.join(format!("{stem}.{ty}.gguf"));
    let started = Instant::now();
    // SmolLM2 is needed by the 1B set too: its tokenizer, and its mix to carry over.
    let smol_f16 = path(SMOLLM2, "F16");
    step(&smol_f16, &logs, |out| {
        let mut c = std::process::Command::new(&quantize);
        c.arg("--allow-requantize")
            .arg(&source)
            .arg(out)
            .args(["F16", &threads]);
        run_logged(c, out, &logs)
    })?;
    let smol_types = if args.set == ModelSet::OneB {
        &LLAMA_TYPES[..1] // the mix's size is Q4_K_M's
    } else {
        LLAMA_TYPES
    };
    for ty in smol_types {
        step(&path(SMOLLM2, ty), &logs, |out| {
            let mut c = std::process::Command::new(&quantize);
            c.arg(&smol_f16).arg(out).args([*ty, &threads]);
            run_logged(c, out, &logs)
        })?;
    }
    let smol_mix = path(SMOLLM2, MIX);
    step(&smol_mix, &logs, |out| {
        if !agentstack.is_file() {
            return Err(UserError(format!(
                "the agentstack binary {} does not exist\nhint: build it with `cargo build -p agentstack`, or pass --agentstack PATH",
                agentstack.display()
            ))
            .into());
        }
        let size = std::fs::metadata(path(SMOLLM2, "Q4_K_M"))?.len();
        let calibration = Path::new(env!("CARGO_MANIFEST_DIR")).join("../quant/calibration.txt");
        let mut c = std::process::Command::new(&agentstack);
        c.args(["model", "quantize"])
            .arg(&smol_f16)
            .arg(out)
            .args(["--target-size", &size.to_string(), "--calibration"])
            .arg(calibration)
            .args(["--ctx", MIX_CTX]);
        run_logged(c, out, &logs)
    })?;

    if args.set != ModelSet::Smollm2 {
        let big_f16 = path(ONE_B, "F16");
        if !big_f16.is_file() {
            let bar = ProgressBar::new(0);
            bar.set_style(
                ProgressStyle::with_template(
                    "  writing {prefix} [{bar:30}] {percent}% of the weights, {elapsed}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            bar.set_prefix(file_name(&big_f16));
            let t = Instant::now();
            let size = random_model::write(&random_model::ONE_B, &smol_f16, &big_f16, &bar)?;
            bar.finish_and_clear();
            eprintln!(
                "  made {} ({}) in {:.0} s",
                file_name(&big_f16),
                mib(size),
                t.elapsed().as_secs_f64()
            );
        }
        for ty in LLAMA_TYPES {
            step(&path(ONE_B, ty), &logs, |out| {
                let mut c = std::process::Command::new(&quantize);
                c.arg(&big_f16).arg(out).args([*ty, &threads]);
                run_logged(c, out, &logs)
            })?;
        }
        step(&path(ONE_B, MIX), &logs, |out| {
            carry_mix(&smol_mix, &big_f16, out)
        })?;
        for ty in ["F16", "Q8_0"] {
            check(&llama_bench, &path(ONE_B, ty), &logs).await?;
        }
    }
    eprintln!(
        "the set is ready ({:.0} s):",
        started.elapsed().as_secs_f64()
    );
    for file in files(&dir, args.set) {
        let size = std::fs::metadata(&file).map_or(0, |m| m.len());
        eprintln!("  {} {}", mib(size), file.display());
    }
    Ok(())
}

/// Makes `out` with `make` (which writes to the path it is given) unless it exists:
/// a spinner meanwhile, then the time it took.
fn step(out: &Path, logs: &Path, make: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    if out.is_file() {
        eprintln!("  have {}", file_name(out));
        return Ok(());
    }
    let partial = out.with_extension("gguf.partial");
    let spinner = ProgressBar::new_spinner();
    spinner.set_style(
        ProgressStyle::with_template("  {spinner} making {msg}, {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    spinner.set_message(file_name(out));
    spinner.enable_steady_tick(crate::SPINNER_TICK);
    let t = Instant::now();
    let made = make(&partial);
    spinner.finish_and_clear();
    if let Err(e) = made {
        let _ = std::fs::remove_file(&partial);
        return Err(e.context(format!(
            "making {} (logs in {})",
            out.display(),
            logs.display()
        )));
    }
    std::fs::rename(&partial, out)
        .with_context(|| format!("renaming {} to {}", partial.display(), out.display()))?;
    let size = std::fs::metadata(out).map_or(0, |m| m.len());
    eprintln!(
        "  made {} ({}) in {:.0} s",
        file_name(out),
        mib(size),
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Runs `command`, its stdout and stderr to `logs/<out's name>.log`; on failure the
/// error carries the log's end.
fn run_logged(mut command: std::process::Command, out: &Path, logs: &Path) -> Result<()> {
    let log = logs.join(format!("{}.log", file_name(out)));
    let file =
        std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    let status = command
        .stdin(Stdio::null())
        .stdout(file.try_clone()?)
        .stderr(file)
        .status()
        .with_context(|| format!("running {command:?}"))?;
    if !status.success() {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(15).collect();
        bail!(
            "{command:?} failed ({status}); the end of {}:\n{}",
            log.display(),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    Ok(())
}

/// The 1B mix: each of its weights gets the type SmolLM2's mix gave the same kind of
/// weight (`attn_q`, `ffn_down`, ...) at the nearest relative depth, so the mix has the
/// allocator's proportions at a shape where measuring sensitivities would take hours
/// (and mean nothing on random weights).
fn carry_mix(smol_mix: &Path, big_f16: &Path, out: &Path) -> Result<()> {
    let mix = Gguf::open(smol_mix).with_context(|| format!("reading {}", smol_mix.display()))?;
    let mix_layers = layer_count(&mix);
    let mut big = Gguf::open(big_f16).with_context(|| format!("reading {}", big_f16.display()))?;
    let big_layers = layer_count(&big);
    let type_of = |name: &str| mix.tensor(name).map(|t| t.ty);
    let plan = Plan::with(&big, |t| {
        let Some((layer, kind)) = split_layer(&t.name) else {
            return type_of(&t.name);
        };
        let at = if big_layers > 1 {
            (layer as f64 * (mix_layers - 1) as f64 / (big_layers - 1) as f64).round() as usize
        } else {
            0
        };
        type_of(&format!("blk.{at}.{kind}"))
    });
    quantize_file(&mut big, out, &plan, None, &mut |_, _, _| {})
        .with_context(|| format!("quantizing {}", big_f16.display()))?;
    Ok(())
}

/// `blk.7.attn_q.weight` → `(7, "attn_q.weight")`.
fn split_layer(name: &str) -> Option<(usize, &str)> {
    let rest = name.strip_prefix("blk.")?;
    let (layer, kind) = rest.split_once('.')?;
    Some((layer.parse().ok()?, kind))
}

fn layer_count(file: &Gguf) -> usize {
    file.tensors
        .iter()
        .filter_map(|t| split_layer(&t.name))
        .map(|(layer, _)| layer + 1)
        .max()
        .unwrap_or(0)
}

/// `llama-bench -p 8 -n 8` and our loader (a child running pp8/tg8) both take `model`.
async fn check(llama_bench: &Path, model: &Path, logs: &Path) -> Result<()> {
    let name = file_name(model);
    let log = logs.join(format!("check-{name}.log"));
    let file =
        std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    let status = tokio::time::timeout(
        STEP_TIMEOUT,
        tokio::process::Command::new(llama_bench)
            .arg("-m")
            .arg(model)
            .args(["-p", "8", "-n", "8", "-r", "1"])
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .kill_on_drop(true)
            .status(),
    )
    .await
    .context("llama-bench took too long")??;
    if !status.success() {
        bail!(
            "llama-bench cannot run {} ({status}); see {}",
            model.display(),
            log.display()
        );
    }
    let plan = settings::Plan::tiny();
    match crate::in_process::run_child(model, &plan, 1, settings::Kernels::Native).await? {
        crate::in_process::Outcome::Measured(m) => eprintln!(
            "  checked {name}: llama-bench runs it; agentstack loads it in {:.1} s, pp8 {:.1} tok/s, tg8 {:.1} tok/s",
            m.load_seconds, m.pp.mean, m.tg.mean
        ),
        crate::in_process::Outcome::CannotLoad { error } => {
            bail!("agentstack cannot load {}: {error}", model.display())
        }
    }
    Ok(())
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned())
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// The label of a model file: its stem, and its type from `general.file_type` when
/// the name does not say (`random-llama-1B.Q4_K_M`, `my-model (Q4_K_M)`).
pub fn label(path: &Path) -> String {
    let stem = path
        .file_stem()
        .map_or_else(String::new, |s| s.to_string_lossy().into_owned());
    let named = stem
        .rsplit_once('.')
        .is_some_and(|(_, ty)| ty == MIX || ty.parse::<GgmlType>().is_ok() || ftype_named(ty));
    if named {
        return stem;
    }
    match Gguf::open(path)
        .ok()
        .and_then(|f| f.get("general.file_type").and_then(|v| v.as_u64()))
    {
        Some(ft) => format!("{stem} ({})", ftype_name(ft)),
        None => stem,
    }
}

/// llama.cpp's `llama_ftype` names.
const FTYPES: &[(u64, &str)] = &[
    (0, "F32"),
    (1, "F16"),
    (2, "Q4_0"),
    (3, "Q4_1"),
    (7, "Q8_0"),
    (8, "Q5_0"),
    (9, "Q5_1"),
    (10, "Q2_K"),
    (11, "Q3_K_S"),
    (12, "Q3_K_M"),
    (13, "Q3_K_L"),
    (14, "Q4_K_S"),
    (15, "Q4_K_M"),
    (16, "Q5_K_S"),
    (17, "Q5_K_M"),
    (18, "Q6_K"),
    (19, "IQ2_XXS"),
    (20, "IQ2_XS"),
    (21, "Q2_K_S"),
    (22, "IQ3_XS"),
    (23, "IQ3_XXS"),
    (24, "IQ1_S"),
    (25, "IQ4_NL"),
    (26, "IQ3_S"),
    (27, "IQ3_M"),
    (28, "IQ2_S"),
    (29, "IQ2_M"),
    (30, "IQ4_XS"),
    (31, "IQ1_M"),
    (32, "BF16"),
];

fn ftype_name(ft: u64) -> String {
    FTYPES
        .iter()
        .find(|(id, _)| *id == ft)
        .map_or_else(|| format!("file type {ft}"), |(_, n)| (*n).to_owned())
}

fn ftype_named(name: &str) -> bool {
    FTYPES.iter().any(|(_, n)| n.eq_ignore_ascii_case(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_set_lists_each_type_then_the_mix() {
        let files = files(Path::new("/d"), ModelSet::All);
        assert_eq!(files.len(), 2 * (LLAMA_TYPES.len() + 1));
        assert_eq!(files[0], Path::new("/d/SmolLM2-135M-Instruct.Q4_K_M.gguf"));
        assert_eq!(
            files[LLAMA_TYPES.len()],
            Path::new("/d/SmolLM2-135M-Instruct.agentstack-mix.gguf")
        );
        assert_eq!(
            files.last().unwrap(),
            Path::new("/d/random-llama-1B.agentstack-mix.gguf")
        );
    }

    #[test]
    fn layers_split_from_tensor_names() {
        assert_eq!(
            split_layer("blk.12.ffn_down.weight"),
            Some((12, "ffn_down.weight"))
        );
        assert_eq!(split_layer("token_embd.weight"), None);
        assert_eq!(ftype_name(15), "Q4_K_M");
        assert!(ftype_named("q5_k_m"));
    }
}
