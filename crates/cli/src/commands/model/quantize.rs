//! `agentstack model quantize`: a GGUF model to one type, or to a mix chosen by measured
//! sensitivity under a size budget.

use std::path::Path;

use agentstack_model::{LanguageModel, WeightForm};
use agentstack_quant::allocate::{
    allocate, check_budget, error_table, measure_sensitivity, per_tensor,
};
use agentstack_quant::gguf::Gguf;
use agentstack_quant::imatrix::Imatrix;
use agentstack_quant::recipe::{Plan, quantize_file};
use agentstack_quant::types::GgmlType;
use anyhow::Context;

use crate::args::QuantizeArgs;
use crate::{Exit, IntoUserError, user_error};

/// Tokens per chunk when measuring sensitivity (the second half of each is scored).
const SENSITIVITY_CTX: usize = 256;

/// Parses `80MiB`, `84000000`, `1.5GB`.
fn parse_size(s: &str) -> anyhow::Result<u64> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| {
        user_error!("--target-size `{s}`: expected a number with an optional unit, such as 80MiB")
    })?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" | "k" => 1e3,
        "mb" | "m" => 1e6,
        "gb" | "g" => 1e9,
        "kib" => 1024.0,
        "mib" => 1048576.0,
        "gib" => 1073741824.0,
        other => {
            return Err(user_error!(
                "--target-size `{s}`: unknown unit `{other}` (use B, KB, MB, GB, KiB, MiB or GiB)"
            ));
        }
    };
    Ok((n * mult) as u64)
}

/// Runs the command.
pub async fn run(args: QuantizeArgs) -> Result<(), Exit> {
    let fixed: Option<GgmlType> = args
        .ty
        .as_deref()
        .map(|t| t.parse().map_err(|e: String| user_error!("--type: {e}")))
        .transpose()?;
    let target_size = args.target_size.as_deref().map(parse_size).transpose()?;
    if let Some(b) = args.target_bpw
        && !(b > 0.0 && b <= 32.0)
    {
        return Err(Exit::user(anyhow::anyhow!(
            "--target-bpw {b}: give bits per weight between 0 and 32, such as 4.5"
        )));
    }
    let input = super::resolve(&args.input).await?;
    let calibration = args
        .calibration
        .as_ref()
        .map(|p| {
            std::fs::read_to_string(p)
                .with_user_context(|| format!("could not read --calibration {}", p.display()))
        })
        .transpose()?;
    let imatrix = match (&args.imatrix, &calibration) {
        (Some(path), _) => Some(Imatrix::load(path).user_context("could not read --imatrix")?),
        (None, Some(text)) => {
            let (input, ctx, text) = (input.clone(), args.ctx, text.clone());
            Some(
                tokio::task::spawn_blocking(move || {
                    // The output projection too: a mix may give the (tied) embedding
                    // a type that uses importance.
                    super::imatrix::collect(&input, &text, ctx, "calibration", true)
                })
                .await
                .map_err(anyhow::Error::from)??,
            )
        }
        (None, None) => None,
    };
    let output = args.output.clone();
    let report_path = args.report.clone();
    let per_tensor = args.per_tensor;
    let target_bpw = args.target_bpw;
    let report = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        let mut file = Gguf::open(&input).context("could not open the model")?;
        let plan = match fixed {
            Some(ty) => Plan::uniform(&file, ty),
            None => {
                let imatrix = imatrix.as_ref().expect("a target requires --calibration");
                let text = calibration
                    .as_deref()
                    .expect("a target requires --calibration");
                mixed_plan(
                    &mut file,
                    &input,
                    imatrix,
                    text,
                    &Mix {
                        target_size,
                        target_bpw,
                        per_tensor,
                        report: report_path.as_deref(),
                    },
                )?
            }
        };
        let bar = super::steps_bar(file.tensors.len(), "quantizing");
        let report = quantize_file(
            &mut file,
            &output,
            &plan,
            imatrix.as_ref(),
            &mut |done, _, _| bar.set_position(done as u64),
        )
        .context("could not quantize")?;
        bar.finish_and_clear();
        Ok(report)
    })
    .await
    .map_err(anyhow::Error::from)??;
    println!(
        "wrote {} ({:.1} MiB, {:.3} bits per weight)",
        args.output.display(),
        report.file_bytes as f64 / 1048576.0,
        report.bpw
    );
    for (ty, n) in &report.by_type {
        println!("  {ty:<8} {:>6.1} M parameters", *n as f64 / 1e6);
    }
    Ok(())
}

/// What a mix is asked for.
struct Mix<'a> {
    target_size: Option<u64>,
    target_bpw: Option<f64>,
    per_tensor: bool,
    report: Option<&'a Path>,
}

fn mixed_plan(
    file: &mut Gguf,
    input: &Path,
    imatrix: &Imatrix,
    text: &str,
    mix: &Mix<'_>,
) -> anyhow::Result<Plan> {
    let (target_size, target_bpw, report) = (mix.target_size, mix.target_bpw, mix.report);
    let overhead = std::fs::metadata(input)?
        .len()
        .saturating_sub(file.tensor_bytes())
        + file.alignment * file.tensors.len() as u64;
    let budget = match (target_size, target_bpw) {
        (Some(s), _) => s.checked_sub(overhead).ok_or_else(|| {
            user_error!("--target-size {s} is smaller than the file's metadata ({overhead} bytes)")
        })?,
        (None, Some(b)) => (b * file.parameters() as f64 / 8.0) as u64,
        (None, None) => return Err(user_error!("give --type, --target-size or --target-bpw")),
    };
    check_budget(file, budget)?;
    let bar = super::steps_bar(0, "error table");
    let mut table = error_table(file, imatrix, &mut |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64)
    })?;
    bar.finish_and_clear();
    if mix.per_tensor {
        per_tensor(&mut table);
    }
    let lm =
        LanguageModel::load(input, WeightForm::Quantized).context("could not load the model")?;
    let tokens = lm.tokenizer().encode(text, false)?;
    let bar = super::steps_bar(0, "measuring sensitivity");
    let sens = measure_sensitivity(
        file,
        &lm,
        &table,
        imatrix,
        &tokens,
        SENSITIVITY_CTX,
        &mut |done, total| {
            bar.set_length(total as u64);
            bar.set_position(done as u64)
        },
    )?;
    bar.finish_and_clear();
    let alloc = allocate(file, &table, &sens, budget)?;
    println!(
        "allocated {} weights into {:.2} MiB of tensors; predicted mean KLD {:.5} (measure it with `agentstack model kld`)",
        alloc.choice.len(),
        alloc.tensor_bytes as f64 / 1048576.0,
        alloc.predicted_kld
    );
    if let Some(path) = report {
        let json = serde_json::json!({"table": table, "sensitivity": sens, "allocation": alloc});
        std::fs::write(path, serde_json::to_vec_pretty(&json)?)
            .with_context(|| format!("could not write {}", path.display()))?;
    }
    Ok(alloc.plan(file))
}
