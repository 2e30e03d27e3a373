//! bench/quant: agentstack's allocated mixes against `llama-quantize --imatrix` mixes at
//! matched file sizes, every file measured by the same tool (`llama-perplexity
//! --kl-divergence`) on the same evaluation text, against the original model.
//!
//! ```sh
//! cargo run --release -p agentstack-bench-quant -- [--write-results bench/RESULTS.md]
//! ```
//!
//! Calibration (`bench/quant/calibration.txt`: importance matrices of both tools and our
//! sensitivity measurement) and evaluation (`bench/quant/eval.txt`) texts are separate.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use agentstack_bench_support::paths;
use agentstack_model::{LanguageModel, WeightForm};
use agentstack_quant::allocate::{allocate, error_table, measure_sensitivity, per_tensor};
use agentstack_quant::gguf::Gguf;
use agentstack_quant::imatrix::Imatrix;
use agentstack_quant::plot::{Point, draw};
use agentstack_quant::recipe::quantize_file;
use anyhow::{Context, bail};

/// Tokens per evaluation chunk (llama-perplexity's -c); half of each is scored.
const EVAL_CTX: &str = "512";
/// Tokens per importance-matrix chunk (both tools).
const IMATRIX_CTX: usize = 128;
/// Tokens per sensitivity chunk.
const SENSITIVITY_CTX: usize = 256;

fn bin(tool: &str) -> PathBuf {
    paths::llamacpp_bin(None, &paths::cache_dir()).join(tool)
}

fn run(cmd: &mut Command) -> anyhow::Result<String> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        bail!("{cmd:?} failed:\n{text}");
    }
    Ok(text)
}

fn stats_of(out: &str) -> BTreeMap<String, (f64, f64)> {
    let mut m = BTreeMap::new();
    for line in out.lines() {
        if let Some((k, v)) = line.split_once(':') {
            let nums: Vec<f64> = v
                .split(['±', '%'])
                .filter_map(|x| x.trim().parse::<f64>().ok())
                .collect();
            if let Some(&a) = nums.first() {
                m.insert(
                    k.trim().to_owned(),
                    (a, nums.get(1).copied().unwrap_or(0.0)),
                );
            }
        }
    }
    m
}

/// A file made for the comparison.
struct Made {
    name: String,
    series: String,
    path: PathBuf,
    /// The allocator's predicted mean KLD.
    predicted: Option<f64>,
    /// Seconds to write the file from its plan.
    seconds: Option<f64>,
}

struct Row {
    name: String,
    series: String,
    bytes: u64,
    bpw: f64,
    stats: BTreeMap<String, (f64, f64)>,
    predicted: Option<f64>,
    seconds: Option<f64>,
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let write_results = args
        .iter()
        .position(|a| a == "--write-results")
        .and_then(|i| args.get(i + 1))
        .map(PathBuf::from);
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let (calib, eval) = (root.join("calibration.txt"), root.join("eval.txt"));
    let model = paths::cache_dir().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let work = std::env::temp_dir().join("agentstack-bench-quant");
    std::fs::create_dir_all(&work)?;
    let t0 = Instant::now();

    // llama.cpp: its importance matrix from the calibration text, its mixes, F16 floor.
    let im_llama = work.join("imatrix-llama.gguf");
    let c = IMATRIX_CTX.to_string();
    run(Command::new(bin("llama-imatrix"))
        .arg("-m")
        .arg(&model)
        .arg("-f")
        .arg(&calib)
        .args(["-c", &c, "-b", &c, "-t", "1", "--no-ppl", "-o"])
        .arg(&im_llama))?;
    let mut files: Vec<Made> = Vec::new();
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .to_string();
    for mix in ["Q4_K_M", "Q3_K_M", "Q2_K"] {
        let out = work.join(format!("llama-{mix}.gguf"));
        let t = Instant::now();
        run(Command::new(bin("llama-quantize"))
            .arg("--allow-requantize")
            .arg("--imatrix")
            .arg(&im_llama)
            .arg(&model)
            .arg(&out)
            .arg(mix)
            .arg(&threads))?;
        files.push(Made {
            name: format!("llama.cpp {mix} + imatrix"),
            series: "llama.cpp + imatrix".into(),
            path: out,
            predicted: None,
            seconds: Some(t.elapsed().as_secs_f64()),
        });
    }
    let f16 = work.join("llama-F16.gguf");
    run(Command::new(bin("llama-quantize"))
        .arg("--allow-requantize")
        .arg(&model)
        .arg(&f16)
        .arg("F16")
        .arg("1"))?;
    eprintln!("llama.cpp files in {:.0} s", t0.elapsed().as_secs_f64());

    // Ours: importance, error table and sensitivity once, then one allocation per size.
    let text = std::fs::read_to_string(&calib)?;
    let lm = LanguageModel::load(&model, WeightForm::Quantized)?;
    let tokens = lm.tokenizer().encode(&text, false)?;
    let im = Imatrix::collect(
        lm.model(),
        &tokens,
        IMATRIX_CTX,
        "calibration.txt",
        true,
        &mut |_, _| {},
    )?;
    let mut src = Gguf::open(&model)?;
    let t1 = Instant::now();
    let mut table = error_table(&mut src, &im, &mut |_, _| {})?;
    if args.iter().any(|a| a == "--per-tensor") {
        per_tensor(&mut table);
    }
    eprintln!("error table in {:.0} s", t1.elapsed().as_secs_f64());
    let sens = measure_sensitivity(
        &mut src,
        &lm,
        &table,
        &im,
        &tokens,
        SENSITIVITY_CTX,
        &mut |_, _| {},
    )?;
    eprintln!(
        "error table and sensitivity in {:.0} s",
        t1.elapsed().as_secs_f64()
    );
    drop(lm);
    for mix in ["Q4_K_M", "Q3_K_M", "Q2_K"] {
        let theirs = Gguf::open(work.join(format!("llama-{mix}.gguf")))?;
        let alloc = allocate(&src, &table, &sens, theirs.tensor_bytes())?;
        let out = work.join(format!("ours-{mix}-size.gguf"));
        let plan = alloc.plan(&src);
        std::fs::write(
            work.join(format!("ours-{mix}-size.json")),
            serde_json::to_vec_pretty(
                &serde_json::json!({"sensitivity": sens, "allocation": alloc}),
            )?,
        )?;
        eprintln!(
            "{mix}'s size: token_embd as {}",
            alloc
                .choice
                .get("token_embd.weight")
                .map_or("-".into(), |t| t.to_string())
        );
        let t = Instant::now();
        quantize_file(&mut src, &out, &plan, Some(&im), &mut |_, _, _| {})?;
        files.push(Made {
            name: format!("agentstack at {mix}'s size"),
            series: "agentstack allocated".into(),
            path: out,
            predicted: Some(alloc.predicted_kld),
            seconds: Some(t.elapsed().as_secs_f64()),
        });
    }
    files.push(Made {
        name: "noise floor: F16 (exact dequantization)".into(),
        series: "noise floor".into(),
        path: f16,
        predicted: None,
        seconds: None,
    });

    // Every file measured by llama-perplexity against the original on the eval text.
    let base = work.join("base.kld");
    run(Command::new(bin("llama-perplexity"))
        .arg("-m")
        .arg(&model)
        .arg("-f")
        .arg(&eval)
        .args([
            "-c",
            EVAL_CTX,
            "-b",
            EVAL_CTX,
            "-t",
            "1",
            "--kl-divergence-base",
        ])
        .arg(&base))?;
    let params = src.parameters() as f64;
    let mut rows = Vec::new();
    for Made {
        name,
        series,
        path,
        predicted,
        seconds,
    } in files
    {
        let out = run(Command::new(bin("llama-perplexity"))
            .arg("-m")
            .arg(&path)
            .args([
                "-c",
                EVAL_CTX,
                "-b",
                EVAL_CTX,
                "-t",
                "1",
                "--kl-divergence",
                "--kl-divergence-base",
            ])
            .arg(&base))?;
        let g = Gguf::open(&path)?;
        rows.push(Row {
            name,
            series,
            bytes: std::fs::metadata(&path)?.len(),
            bpw: g.tensor_bytes() as f64 * 8.0 / params,
            stats: stats_of(&out),
            predicted,
            seconds,
        });
    }
    let mut table_md = String::from(
        "| mix | MiB | bpw | mean KLD | 99% KLD | 99.9% KLD | max KLD | same top % | RMS Δp % | PPL | predicted KLD | write s |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let get = |r: &Row, k: &str| r.stats.get(k).copied().unwrap_or((f64::NAN, 0.0));
    for r in &rows {
        table_md.push_str(&format!(
            "| {} | {:.1} | {:.2} | {:.4} ± {:.4} | {:.3} | {:.3} | {:.3} | {:.1} ± {:.1} | {:.2} | {:.3} | {} | {} |\n",
            r.name, r.bytes as f64 / 1048576.0, r.bpw, get(r, "Mean    KLD").0, get(r, "Mean    KLD").1, get(r, "99.0%   KLD").0, get(r, "99.9%   KLD").0, get(r, "Maximum KLD").0,
            get(r, "Same top p").0, get(r, "Same top p").1, get(r, "RMS Δp").0, get(r, "Mean PPL(Q)").0,
            r.predicted.map_or("–".into(), |p| format!("{p:.4}")),
            r.seconds.map_or("–".into(), |t| format!("{t:.1}"))
        ));
    }
    let mut ratios = String::new();
    for mix in ["Q4_K_M", "Q3_K_M", "Q2_K"] {
        let theirs = rows
            .iter()
            .find(|r| r.name.contains(mix) && r.series.starts_with("llama"))
            .expect("row");
        let ours = rows
            .iter()
            .find(|r| r.name.contains(mix) && r.series.starts_with("agentstack"))
            .expect("row");
        ratios.push_str(&format!(
            "- at {mix}'s size ({:.1} vs {:.1} MiB): mean KLD ours/llama.cpp = {:.2}; 99.9% KLD {:.3} vs {:.3}; writing the file from its plan {:.1} s vs {:.1} s ({:.2}x)\n",
            ours.bytes as f64 / 1048576.0, theirs.bytes as f64 / 1048576.0,
            get(ours, "Mean    KLD").0 / get(theirs, "Mean    KLD").0, get(ours, "99.9%   KLD").0, get(theirs, "99.9%   KLD").0,
            ours.seconds.unwrap_or(f64::NAN), theirs.seconds.unwrap_or(f64::NAN),
            ours.seconds.unwrap_or(f64::NAN) / theirs.seconds.unwrap_or(f64::NAN)
        ));
    }
    let png = root.join("size_vs_kld.png");
    let points: Vec<Point> = rows
        .iter()
        .map(|r| Point {
            label: r.name.clone(),
            series: r.series.clone(),
            mib: r.bytes as f64 / 1048576.0,
            mean_kld: get(r, "Mean    KLD").0,
            p999_kld: get(r, "99.9%   KLD").0,
        })
        .collect();
    draw(&points, &png)?;
    let report = format!("{table_md}\n{ratios}");
    println!("{report}");
    eprintln!(
        "total {:.0} s; chart {}",
        t0.elapsed().as_secs_f64(),
        png.display()
    );
    if let Some(path) = write_results {
        let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)?;
        write!(
            f,
            "\n## quant: allocated mixes vs llama-quantize --imatrix at matched sizes\n\n`cargo run --release -p agentstack-bench-quant -- --write-results bench/RESULTS.md`; load average {}\n\n{report}\n![size vs KLD](quant/size_vs_kld.png)\n",
            load.split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" ")
        )?;
    }
    Ok(())
}
